#!/usr/bin/env python3
"""Writes a DFlash or DSpark drafter with random weights, shaped for a given target.

What a drafter's round costs on a GPU depends on its shapes, not on its weight values,
and the published checkpoints cannot be fetched where the GPU runs. This writes a
checkpoint in the schema dspec loads (config.json + model.safetensors, bf16), with
exactly the tensor names and shapes its loaders ask for:

  dflash  z-lab's DFlashDraftModel (drafters/src/dflash.rs, DraftNet::load): `fc`
          (taps x hidden -> hidden), `hidden_norm`, `layers.N.*` (Qwen3 decoder layers:
          q/k norms, no biases), `norm`. No embedding and no head: it drafts through the
          target's. Taps as z-lab spaces them: from layer 1 to layers - 3, one per
          draft layer ([1, 9, 17, 25, 33] for a 36-layer target and 5 draft layers).
  dspark  a qwen3-family DSpark drafter (drafters/src/dspark.rs, DSparkModel::load): the
          same layers plus its own `embed_tokens` and `lm_head` (the target's vocabulary
          and width), a rank-r Markov head (`markov_head.markov_w1/w2`) and a confidence
          head (`confidence_head.proj`, weight and bias). The loader refuses any tensor
          it did not ask for, so nothing else is written.

Widths, heads, head size, MLP size, vocabulary, RoPE base and norm epsilon are the
target's. Matrices are normal x 0.02 and norms 1, so that activations stay finite in
bf16. Tensors are made on the GPU when torch sees one (a few GB at the 8B shape).

Usage: python3 scripts/random_drafters.py --target-config DIR --kind dflash|dspark --out DIR
           [--layers 5] [--block-size N (dflash 16, dspark 7)] [--markov-rank 256]
           [--mask-token-id 151669] [--seed 0]
"""

import argparse
import json
import os

# Qwen3's first id past its tokenizer (151643 ordinary + 26 added tokens), inside the
# padded embedding of 151936 rows: z-lab's Qwen3 drafters fill undrafted positions with it.
QWEN3_MASK_TOKEN_ID = 151669


def zlab_taps(target_layers, draft_layers):
    """z-lab's choice of target layers to tap: evenly spaced from 1 to layers - 3."""
    if draft_layers == 1:
        return [target_layers // 2]
    start, end = 1, target_layers - 3
    return [int(round(start + i * (end - start) / (draft_layers - 1)))
            for i in range(draft_layers)]


def read_target(config_dir):
    with open(os.path.join(config_dir, "config.json")) as f:
        t = json.load(f)
    rope_theta = t.get("rope_theta")
    if rope_theta is None:
        # transformers >= 5 writes the base under rope_parameters.
        rope_theta = (t.get("rope_parameters") or {}).get("rope_theta", 1000000.0)
    heads = t["num_attention_heads"]
    return {
        "hidden": t["hidden_size"],
        "inter": t["intermediate_size"],
        "layers": t["num_hidden_layers"],
        "heads": heads,
        "kv_heads": t.get("num_key_value_heads") or heads,
        "head_dim": t.get("head_dim") or t["hidden_size"] // heads,
        "vocab": t["vocab_size"],
        "eps": t.get("rms_norm_eps", 1e-6),
        "rope_theta": rope_theta,
        "max_pos": t.get("max_position_embeddings", 40960),
        "eos": t.get("eos_token_id"),
        "bos": t.get("bos_token_id"),
    }


def tensor_shapes(kind, t, layers, taps, markov_rank):
    """Name -> (shape, is_norm_or_bias) of every tensor the loader asks for."""
    h, hd, inter, v = t["hidden"], t["head_dim"], t["inter"], t["vocab"]
    q, kv = t["heads"] * hd, t["kv_heads"] * hd
    shapes = {
        "fc.weight": ([h, len(taps) * h], False),
        "hidden_norm.weight": ([h], True),
        "norm.weight": ([h], True),
    }
    for i in range(layers):
        p = f"layers.{i}"
        shapes.update({
            f"{p}.input_layernorm.weight": ([h], True),
            f"{p}.post_attention_layernorm.weight": ([h], True),
            f"{p}.self_attn.q_proj.weight": ([q, h], False),
            f"{p}.self_attn.k_proj.weight": ([kv, h], False),
            f"{p}.self_attn.v_proj.weight": ([kv, h], False),
            f"{p}.self_attn.o_proj.weight": ([h, q], False),
            f"{p}.self_attn.q_norm.weight": ([hd], True),
            f"{p}.self_attn.k_norm.weight": ([hd], True),
            f"{p}.mlp.gate_proj.weight": ([inter, h], False),
            f"{p}.mlp.up_proj.weight": ([inter, h], False),
            f"{p}.mlp.down_proj.weight": ([h, inter], False),
        })
    if kind == "dspark":
        shapes.update({
            "embed_tokens.weight": ([v, h], False),
            "lm_head.weight": ([v, h], False),
            # Confidence head input: the position's hidden state + the Markov embedding
            # of the token before it (confidence_head_with_markov).
            "confidence_head.proj.weight": ([1, h + markov_rank], False),
            "confidence_head.proj.bias": ([1], True),
        })
        if markov_rank > 0:
            shapes.update({
                "markov_head.markov_w1.weight": ([v, markov_rank], False),
                "markov_head.markov_w2.weight": ([v, markov_rank], False),
            })
    return shapes


def drafter_config(kind, t, layers, block, taps, mask, markov_rank):
    common = {
        "model_type": "qwen3",
        "vocab_size": t["vocab"],
        "hidden_size": t["hidden"],
        "intermediate_size": t["inter"],
        "num_hidden_layers": layers,
        "num_attention_heads": t["heads"],
        "num_key_value_heads": t["kv_heads"],
        "head_dim": t["head_dim"],
        "hidden_act": "silu",
        "rms_norm_eps": t["eps"],
        "rope_theta": t["rope_theta"],
        "attention_bias": False,
        "max_position_embeddings": t["max_pos"],
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "block_size": block,
        "num_target_layers": t["layers"],
    }
    if kind == "dflash":
        # z-lab's layout: the taps and mask token inside dflash_config, block_size on top.
        return {
            "architectures": ["DFlashDraftModel"],
            **common,
            "rope_scaling": None,
            "layer_types": ["full_attention"] * layers,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": layers,
            "bos_token_id": t["bos"],
            "eos_token_id": t["eos"],
            "dflash_config": {"target_layer_ids": taps, "mask_token_id": mask},
        }
    # DSpark keeps every key at the top level; dspec tells it apart by the Markov and
    # confidence fields.
    return {
        **common,
        "mask_token_id": mask,
        "target_layer_ids": taps,
        "target_hidden_size": t["hidden"],
        "markov_rank": markov_rank,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target-config", required=True,
                    help="directory with the target's config.json")
    ap.add_argument("--kind", required=True, choices=["dflash", "dspark"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--block-size", type=int, help="default: dflash 16, dspark 7")
    ap.add_argument("--markov-rank", type=int, default=256, help="dspark only")
    ap.add_argument("--mask-token-id", type=int, default=QWEN3_MASK_TOKEN_ID)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    t = read_target(args.target_config)
    block = args.block_size or (16 if args.kind == "dflash" else 7)
    taps = zlab_taps(t["layers"], args.layers)
    if min(taps) < 0 or max(taps) >= t["layers"]:
        raise SystemExit(f"target of {t['layers']} layers is too shallow for "
                         f"{args.layers} evenly spaced taps ({taps})")
    mask = args.mask_token_id
    if mask >= t["vocab"]:
        # A small test vocabulary: the last id stands in for the mask token.
        mask = t["vocab"] - 1
    rank = args.markov_rank if args.kind == "dspark" else 0
    config = drafter_config(args.kind, t, args.layers, block, taps, mask, rank)

    import torch
    from safetensors.torch import save_file

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(args.seed)
    tensors = {}
    with torch.no_grad():
        for name, (shape, flat) in tensor_shapes(args.kind, t, args.layers, taps, rank).items():
            if name.endswith(".bias"):
                x = torch.zeros(shape, device=device, dtype=torch.bfloat16)
            elif flat:
                x = torch.ones(shape, device=device, dtype=torch.bfloat16)
            else:
                x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
                x = x.mul_(0.02).to(torch.bfloat16)
            tensors[name] = x.cpu()
    os.makedirs(args.out, exist_ok=True)
    save_file(tensors, os.path.join(args.out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    params = sum(x.numel() for x in tensors.values())
    print(f"{args.out}: {args.kind}, {args.layers} layers, block {block}, taps {taps}, "
          f"{params / 1e6:.1f}M parameters ({2 * params / 1e9:.2f} GB bf16) on {device}")


if __name__ == "__main__":
    main()
