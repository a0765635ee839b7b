#!/usr/bin/env python3
"""Writes checkpoints with random weights of real shapes: models, and drafters for them.

Speed on a GPU depends on shapes, not on weight values, and checkpoints of a few GB cannot
reach a GPU machine without network. Models are built through transformers from a shape
named below (or a directory holding a config.json) and saved as bf16 safetensors with a
tokenizer, loadable by dspec and mlx-lm alike. Random models agree with each other no more
than chance, so a random draft model's tau is about 1.

`--residual-scale S` multiplies every layer's output projections (o_proj, down_proj) by S,
so that the residual stream keeps the token embedding nearly unchanged and the next token
is, in effect, a function of the current one with wide margins between the top logits.
Random weights otherwise leave near-ties at most positions, where bf16 rounding that
differs between a verify's rows and a plain step's changes the greedy token, and a replayed
answer (every draft kept) is lost within a few tokens. Shapes, hence speed, are unchanged.

`--drafter dflash|dspark` writes a drafter shaped for the target instead, in the schema
dspec loads (config.json + model.safetensors), with exactly the tensors its loader asks for:
  dflash  z-lab's DFlashDraftModel (drafters/src/dflash.rs): `fc` (taps x hidden -> hidden),
          `hidden_norm`, `layers.N.*` (Qwen3 decoder layers), `norm`; it drafts through the
          target's embedding and head. Taps as z-lab spaces them: from layer 1 to layers - 3
          ([1, 9, 17, 25, 33] for a 36-layer target and 5 draft layers).
  dspark  a qwen3-family DSpark drafter (drafters/src/dspark.rs): the same layers plus its
          own `embed_tokens` and `lm_head`, a rank-r Markov head and a confidence head. The
          loader refuses any tensor it did not ask for, so nothing else is written.
Drafter matrices are normal x 0.02 and norms 1, so that activations stay finite in bf16.

Usage: python3 scripts/random_weights.py SHAPE|CONFIG_DIR OUT_DIR [--tokenizer DIR]
           [--seed N] [--residual-scale S]
       python3 scripts/random_weights.py SHAPE|CONFIG_DIR OUT_DIR --drafter dflash|dspark
           [--layers 5] [--block-size N (dflash 16, dspark 7)] [--markov-rank 256] [--seed N]
SHAPE: one of SHAPES below. --tokenizer: a directory with tokenizer.json (or .json.xz) and
tokenizer_config.json (scripts/gpu-prepare.sh packs Qwen3's, whose vocabulary Qwen2.5 shares).
"""

import argparse
import json
import lzma
import os
import shutil
import tempfile


def _qwen(model_type, hidden, inter, layers, heads, kv_heads, vocab, tied, **extra):
    return {
        "architectures": ["Qwen2ForCausalLM" if model_type == "qwen2" else "Qwen3ForCausalLM"],
        "model_type": model_type, "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "vocab_size": vocab, "tie_word_embeddings": tied,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_window_layers": layers, "use_sliding_window": False, "sliding_window": None,
        "attention_dropout": 0.0, "initializer_range": 0.02, "bos_token_id": 151643,
        "eos_token_id": 151645, "torch_dtype": "bfloat16", "use_cache": True, **extra,
    }


# The published configs' shapes (keys transformers needs; the rest take its defaults).
SHAPES = {
    "qwen05": _qwen("qwen2", 896, 4864, 24, 14, 2, 151936, True,
                    max_position_embeddings=32768),      # Qwen2.5-Coder-0.5B-Instruct
    "qwen15": _qwen("qwen2", 1536, 8960, 28, 12, 2, 151936, True,
                    max_position_embeddings=32768),      # Qwen2.5-Coder-1.5B-Instruct
    "qwen7b": _qwen("qwen2", 3584, 18944, 28, 28, 4, 152064, False,
                    max_position_embeddings=32768),      # Qwen2.5-7B-Instruct
    "qwen3-0.6b": _qwen("qwen3", 1024, 3072, 28, 16, 8, 151936, True, head_dim=128,
                        attention_bias=False, max_position_embeddings=40960),
    "qwen3-4b": _qwen("qwen3", 2560, 9728, 36, 32, 8, 151936, True, head_dim=128,
                      attention_bias=False, max_position_embeddings=40960),
    "qwen3-8b": _qwen("qwen3", 4096, 12288, 36, 32, 8, 151936, False, head_dim=128,
                      attention_bias=False, max_position_embeddings=40960),
}

# Qwen3's first id past its tokenizer (151643 ordinary + 26 added tokens), inside the
# padded embedding of 151936 rows: z-lab's Qwen3 drafters fill undrafted positions with it.
QWEN3_MASK_TOKEN_ID = 151669


def config_dir(shape_or_dir, tokenizer_dir, dst):
    """A directory holding the shape's config.json and the tokenizer files (decompressed
    from tokenizer.json.xz where that is what was carried). Returns its path."""
    if os.path.isdir(shape_or_dir) and not tokenizer_dir:
        return shape_or_dir
    os.makedirs(dst, exist_ok=True)
    if os.path.isdir(shape_or_dir):
        for f in os.listdir(shape_or_dir):
            shutil.copy(os.path.join(shape_or_dir, f), dst)
    else:
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(SHAPES[shape_or_dir], f, indent=2)
    if tokenizer_dir:
        shutil.copy(os.path.join(tokenizer_dir, "tokenizer_config.json"), dst)
        tok = os.path.join(dst, "tokenizer.json")
        if os.path.exists(os.path.join(tokenizer_dir, "tokenizer.json")):
            shutil.copy(os.path.join(tokenizer_dir, "tokenizer.json"), tok)
        elif not os.path.exists(tok):
            with lzma.open(os.path.join(tokenizer_dir, "tokenizer.json.xz")) as f, \
                    open(tok + ".tmp", "wb") as g:
                shutil.copyfileobj(f, g)
            os.replace(tok + ".tmp", tok)
    return dst


def write_model(cfg_dir, out_dir, seed, residual_scale):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(cfg_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config)
    # Cast after building: the dtype keyword of from_config changed name across
    # transformers releases, and an ignored one would silently save f32 weights.
    model = model.to(torch.bfloat16)
    if residual_scale is not None:
        scaled = 0
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    p.mul_(residual_scale)
                    scaled += 1
        if scaled == 0:
            raise SystemExit("--residual-scale: no o_proj/down_proj weights in this architecture")
    model.save_pretrained(out_dir, safe_serialization=True, max_shard_size="8GB")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        src = os.path.join(cfg_dir, name)
        if os.path.exists(src):
            shutil.copy(src, os.path.join(out_dir, name))
    print(out_dir)


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


def write_drafter(args, cfg_dir):
    t = read_target(cfg_dir)
    kind = args.drafter
    block = args.block_size or (16 if kind == "dflash" else 7)
    taps = zlab_taps(t["layers"], args.layers)
    if min(taps) < 0 or max(taps) >= t["layers"]:
        raise SystemExit(f"target of {t['layers']} layers is too shallow for "
                         f"{args.layers} evenly spaced taps ({taps})")
    mask = args.mask_token_id
    if mask >= t["vocab"]:
        # A small test vocabulary: the last id stands in for the mask token.
        mask = t["vocab"] - 1
    rank = args.markov_rank if kind == "dspark" else 0
    config = drafter_config(kind, t, args.layers, block, taps, mask, rank)

    import torch
    from safetensors.torch import save_file

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(args.seed)
    tensors = {}
    with torch.no_grad():
        for name, (shape, flat) in tensor_shapes(kind, t, args.layers, taps, rank).items():
            if name.endswith(".bias"):
                x = torch.zeros(shape, device=device, dtype=torch.bfloat16)
            elif flat:
                x = torch.ones(shape, device=device, dtype=torch.bfloat16)
            else:
                x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
                x = x.mul_(0.02).to(torch.bfloat16)
            tensors[name] = x.cpu()
    os.makedirs(args.out_dir, exist_ok=True)
    save_file(tensors, os.path.join(args.out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(args.out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    params = sum(x.numel() for x in tensors.values())
    print(f"{args.out_dir}: {kind}, {args.layers} layers, block {block}, taps {taps}, "
          f"{params / 1e6:.1f}M parameters ({2 * params / 1e9:.2f} GB bf16) on {device}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", help=f"one of {', '.join(SHAPES)}, or a directory with a "
                    "config.json")
    ap.add_argument("out_dir")
    ap.add_argument("--tokenizer", help="directory with the tokenizer files to copy beside")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--residual-scale", type=float, default=None)
    ap.add_argument("--drafter", choices=["dflash", "dspark"],
                    help="write a drafter for the target SHAPE instead of a model")
    ap.add_argument("--layers", type=int, default=5, help="drafter layers")
    ap.add_argument("--block-size", type=int, help="default: dflash 16, dspark 7")
    ap.add_argument("--markov-rank", type=int, default=256, help="dspark only")
    ap.add_argument("--mask-token-id", type=int, default=QWEN3_MASK_TOKEN_ID)
    args = ap.parse_args()
    if not os.path.isdir(args.shape) and args.shape not in SHAPES:
        ap.error(f"{args.shape}: neither a directory nor one of {', '.join(SHAPES)}")
    cfg = config_dir(args.shape, args.tokenizer, tempfile.mkdtemp(prefix="random-weights-"))
    if args.drafter:
        write_drafter(args, cfg)
    else:
        write_model(cfg, args.out_dir, args.seed, args.residual_scale)


if __name__ == "__main__":
    main()
