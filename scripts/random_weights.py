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

`--mlx-bits B` writes the model (qwen3 and qwen3_moe shapes) straight in mlx-lm's quantized
layout with numpy instead, tensor by tensor: affine B-bit groups of --mlx-group-size (64),
routers (`mlp.gate`) 8-bit group 64 as mlx-lm's convert puts them, packed words random,
bf16 scales and biases that spread the dequantized values uniformly over
+-1/sqrt(in_features), bf16 norms of ones; shards of at most 5 GiB named
model-0000N-of-0000M.safetensors with their index, config.json with the `quantization`
block. Qwen3-30B-A3B's shape (17.2 GB) takes one to two minutes on a 2-core machine
(extrapolated from 2 of its 48 layers), where transformers would build it in bf16 first. The o_proj / down_proj scales and biases go in files of their own,
so that `--scaled-twin` can write the same model with --residual-scale applied by
rewriting those files alone and hard-linking the rest.

Usage: python3 scripts/random_weights.py SHAPE|CONFIG_DIR OUT_DIR [--tokenizer DIR]
           [--seed N] [--residual-scale S] [--mlx-bits 4 [--mlx-group-size 64]]
       python3 scripts/random_weights.py MODEL_DIR OUT_DIR --scaled-twin --residual-scale S
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
import struct
import sys
import tempfile


ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM"}


def _qwen(model_type, hidden, inter, layers, heads, kv_heads, vocab, tied, **extra):
    return {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type, "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "vocab_size": vocab, "tie_word_embeddings": tied,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_window_layers": layers, "use_sliding_window": False, "sliding_window": None,
        "attention_dropout": 0.0, "initializer_range": 0.02, "bos_token_id": 151643,
        "eos_token_id": 151645, "torch_dtype": "bfloat16", "use_cache": True, **extra,
    }


def _qwen_moe(hidden, inter, moe_inter, layers, heads, kv_heads, head_dim, vocab, experts,
              top_k, mlp_only_layers=()):
    return _qwen("qwen3_moe", hidden, inter, layers, heads, kv_heads, vocab, False,
                 head_dim=head_dim, attention_bias=False, max_position_embeddings=40960,
                 moe_intermediate_size=moe_inter, num_experts=experts,
                 num_experts_per_tok=top_k, norm_topk_prob=True, decoder_sparse_step=1,
                 mlp_only_layers=list(mlp_only_layers), output_router_logits=False,
                 router_aux_loss_coef=0.001, rope_scaling=None)


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
    # Qwen3-30B-A3B: 128 experts of 768, 8 per token, every layer sparse.
    "qwen3-30b-a3b": _qwen_moe(2048, 6144, 768, 48, 32, 4, 128, 151936, 128, 8),
    # A CPU check of the same code paths: 8 experts, 2 per token, layer 3 dense
    # (mlp_only_layers), deep enough for a 5-layer DFlash drafter's taps.
    "qwen3-moe-tiny": _qwen_moe(128, 256, 64, 8, 4, 2, 32, 151936, 8, 2,
                                mlp_only_layers=[3]),
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


# mlx-lm's layout of a quantized checkpoint, written directly with numpy: a model of tens of
# GB goes through no framework (transformers would build it in bf16 first, for minutes).
MLX_MAX_SHARD_BYTES = 5 << 30    # mlx-lm's make_shards: at most 5 GiB a file
MLX_ROUTER_QUANT = {"group_size": 64, "bits": 8}   # qwen3_moe's quant_predicate for mlp.gate
BF16_ONE = 0x3F80
# The residual stream's writers: --residual-scale multiplies these (their dequantized values).
RESIDUAL_TENSORS = ("o_proj", "down_proj")


def bf16_bits(x):
    """The bf16 bit pattern nearest to the float x (ties to even)."""
    (u,) = struct.unpack("<I", struct.pack("<f", x))
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


def bf16_value(bits):
    return struct.unpack("<f", struct.pack("<I", bits << 16))[0]


def is_residual(name, dtype):
    """A float tensor of an o_proj or down_proj (a dense weight, or a quantized layer's
    scales and biases): what --residual-scale multiplies."""
    parts = name.split(".")
    return (dtype in ("BF16", "F16", "F32") and len(parts) >= 2
            and parts[-2] in RESIDUAL_TENSORS and parts[-1] in ("weight", "scales", "biases"))


def moe_layer(cfg, i):
    """Whether layer i is a mixture of experts, as mlx-lm's and transformers' qwen3_moe
    decide it."""
    return (cfg.get("num_experts", 0) > 0 and i not in cfg.get("mlp_only_layers", [])
            and (i + 1) % cfg.get("decoder_sparse_step", 1) == 0)


def mlx_plan(cfg, bits, group, residual_scale):
    """[(name, dtype, shape, fill)] of every tensor mlx-lm saves for this qwen3 or qwen3_moe
    config quantized to `bits` in groups of `group` (routers at 8 bits, group 64, as
    mlx-lm's convert puts them), and the config's `quantization` block. fill: None for
    random packed words, else the bf16 bit pattern every element takes. Scales and biases
    make the dequantized values uniform over +-1/sqrt(in_features) (the o_proj and
    down_proj ones times residual_scale); norms are ones."""
    if cfg["model_type"] not in ("qwen3", "qwen3_moe"):
        raise SystemExit(f"--mlx-bits writes qwen3 and qwen3_moe models, not "
                         f"{cfg['model_type']}")
    h, v, layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or h // heads
    plan, overrides = [], {}

    def norm(name, n):
        plan.append((name, "BF16", [n], BF16_ONE))

    def quant(prefix, lead, out, inp, b=bits, g=group):
        if inp % g or inp * b % 32:
            raise SystemExit(f"{prefix}: {inp} inputs do not divide into groups of {g} "
                             f"at {b} bits")
        levels = (1 << b) - 1
        scale = bf16_value(bf16_bits(2 / (inp ** 0.5 * levels)))
        if prefix.split(".")[-1] in RESIDUAL_TENSORS and residual_scale is not None:
            scale = bf16_value(bf16_bits(scale * residual_scale))
        plan.extend([
            (f"{prefix}.weight", "U32", lead + [out, inp * b // 32], None),
            (f"{prefix}.scales", "BF16", lead + [out, inp // g], bf16_bits(scale)),
            # Centred: the mean of the levels 0..2^b-1 dequantizes to 0.
            (f"{prefix}.biases", "BF16", lead + [out, inp // g],
             bf16_bits(-scale * levels / 2)),
        ])

    quant("model.embed_tokens", [], v, h)
    for i in range(layers):
        p = f"model.layers.{i}"
        norm(f"{p}.input_layernorm.weight", h)
        norm(f"{p}.post_attention_layernorm.weight", h)
        quant(f"{p}.self_attn.q_proj", [], heads * hd, h)
        quant(f"{p}.self_attn.k_proj", [], kv * hd, h)
        quant(f"{p}.self_attn.v_proj", [], kv * hd, h)
        quant(f"{p}.self_attn.o_proj", [], h, heads * hd)
        norm(f"{p}.self_attn.q_norm.weight", hd)
        norm(f"{p}.self_attn.k_norm.weight", hd)
        if moe_layer(cfg, i):
            e, inter = cfg["num_experts"], cfg["moe_intermediate_size"]
            quant(f"{p}.mlp.gate", [], e, h, MLX_ROUTER_QUANT["bits"],
                  MLX_ROUTER_QUANT["group_size"])
            overrides[f"{p}.mlp.gate"] = dict(MLX_ROUTER_QUANT)
            quant(f"{p}.mlp.switch_mlp.gate_proj", [e], inter, h)
            quant(f"{p}.mlp.switch_mlp.up_proj", [e], inter, h)
            quant(f"{p}.mlp.switch_mlp.down_proj", [e], h, inter)
        else:
            inter = cfg["intermediate_size"]
            quant(f"{p}.mlp.gate_proj", [], inter, h)
            quant(f"{p}.mlp.up_proj", [], inter, h)
            quant(f"{p}.mlp.down_proj", [], h, inter)
    norm("model.norm.weight", h)
    if not cfg.get("tie_word_embeddings", False):
        quant("lm_head", [], v, h)
    return plan, {"group_size": group, "bits": bits, "mode": "affine", **overrides}


DTYPE_BYTES = {"U32": 4, "BF16": 2, "F16": 2, "F32": 4}


def nbytes(dtype, shape):
    n = DTYPE_BYTES[dtype]
    for d in shape:
        n *= d
    return n


def write_safetensors(path, entries, data, metadata=None):
    """Writes a safetensors file of `entries` [(name, dtype, shape, ...)] whose bytes
    `data(entry)` gives one tensor at a time (a numpy array or bytes), so that no more than
    a tensor or two is ever in memory. The header is written by hand: numpy has no bf16,
    and its bits go in as they are. Writes run on a thread of their own while the next
    tensor is made."""
    from concurrent.futures import ThreadPoolExecutor

    header, offset = {"__metadata__": metadata or {"format": "mlx"}}, 0
    for name, dtype, shape, *_ in entries:
        n = nbytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f, ThreadPoolExecutor(1) as pool:
        f.write(struct.pack("<Q", len(blob)) + blob)
        pending = []
        for entry in entries:
            x = data(entry)
            if hasattr(x, "reshape"):
                x = x.reshape(-1).view("uint8")
            assert len(x) == nbytes(entry[1], entry[2]), entry[0]
            pending.append(pool.submit(f.write, x))
            if len(pending) > 1:
                pending.pop(0).result()
        for p in pending:
            p.result()
    return offset + 8 + len(blob)


def plan_shards(plan, max_bytes):
    """The plan's tensors in files of at most max_bytes (one larger tensor alone), the
    residual writers' float tensors in files of their own at the end, so that a twin of
    other residual scale (--scaled-twin) shares every other file."""
    rest = [e for e in plan if not is_residual(e[0], e[1])]
    residual = [e for e in plan if is_residual(e[0], e[1])]
    shards = []
    for part in (rest, residual):
        current, size = [], 0
        for e in part:
            n = nbytes(e[1], e[2])
            if current and size + n > max_bytes:
                shards.append(current)
                current, size = [], 0
            current.append(e)
            size += n
        if current:
            shards.append(current)
    return shards


def write_index(out_dir, weight_map, total):
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total},
                   "weight_map": dict(sorted(weight_map.items()))}, f, indent=4)
        f.write("\n")


def copy_beside(cfg_dir, out_dir):
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        src = os.path.join(cfg_dir, name)
        if os.path.exists(src):
            shutil.copy(src, os.path.join(out_dir, name))


def write_mlx_model(cfg_dir, out_dir, bits, group, seed, residual_scale,
                    max_shard_bytes=MLX_MAX_SHARD_BYTES):
    """A qwen3 / qwen3_moe model of random weights in mlx-lm's quantized layout (what
    `mlx_lm.convert -q --q-bits BITS --q-group-size GROUP` writes): packed uint32 words
    from numpy's SFC64 generator, bf16 scales, biases and norms, shards of at most 5 GiB
    named model-0000N-of-0000M.safetensors with their index, config.json with the
    quantization block, and the tokenizer files."""
    import time
    import numpy as np

    start = time.time()
    with open(os.path.join(cfg_dir, "config.json")) as f:
        cfg = json.load(f)
    plan, quantization = mlx_plan(cfg, bits, group, residual_scale)
    shards = plan_shards(plan, max_shard_bytes)
    bitgen = np.random.SFC64(seed)

    def data(entry):
        _, dtype, shape, fill = entry
        if fill is not None:
            return np.full(shape, fill, dtype=np.uint16)
        n = nbytes(dtype, shape) // 4
        return bitgen.random_raw((n + 1) // 2).view(np.uint32)[:n]

    os.makedirs(out_dir, exist_ok=True)
    weight_map, total = {}, 0
    for i, entries in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(os.path.join(out_dir, name), entries, data)
        for e in entries:
            weight_map[e[0]] = name
            total += nbytes(e[1], e[2])
        print(f"{name}: {len(entries)} tensors, {time.time() - start:.1f} s", file=sys.stderr,
              flush=True)
    write_index(out_dir, weight_map, total)
    cfg = {**cfg, "quantization": quantization, "quantization_config": quantization}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    copy_beside(cfg_dir, out_dir)
    print(f"{out_dir}: {cfg['model_type']}, {bits}-bit group {group}, {total / 1e9:.2f} GB "
          f"in {len(shards)} files, {time.time() - start:.1f} s")


def read_header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def write_scaled_twin(src_dir, out_dir, residual_scale):
    """OUT_DIR = the model in SRC_DIR with --residual-scale applied: the files holding o_proj
    or down_proj float tensors (weights, or scales and biases) rewritten with those
    multiplied, every other file hard-linked (copied where links fail). A model written by
    --mlx-bits keeps those tensors in files of their own, so its twin costs little."""
    import numpy as np

    os.makedirs(out_dir, exist_ok=True)
    scaled = 0
    for name in sorted(os.listdir(src_dir)):
        src, dst = os.path.join(src_dir, name), os.path.join(out_dir, name)
        if not name.endswith(".safetensors"):
            if os.path.isfile(src):
                shutil.copy(src, dst)
            continue
        header, base = read_header(src)
        entries = sorted(((k, v["dtype"], v["shape"], v["data_offsets"])
                          for k, v in header.items() if k != "__metadata__"),
                         key=lambda e: e[3][0])
        if not any(is_residual(e[0], e[1]) for e in entries):
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy(src, dst)
            continue
        with open(src, "rb") as f:
            def data(entry):
                k, dtype, shape, (a, b) = entry
                f.seek(base + a)
                raw = f.read(b - a)
                if not is_residual(k, dtype):
                    return raw
                if dtype == "BF16":
                    x = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
                    u = (x * np.float32(residual_scale)).view(np.uint32)
                    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
                x = np.frombuffer(raw, {"F16": np.float16, "F32": np.float32}[dtype])
                return (x * residual_scale).astype(x.dtype)

            write_safetensors(dst, entries, data, header.get("__metadata__"))
        scaled += sum(is_residual(e[0], e[1]) for e in entries)
    if scaled == 0:
        raise SystemExit(f"--scaled-twin: no o_proj/down_proj float tensors in {src_dir}")
    print(f"{out_dir}: {src_dir} with {scaled} o_proj/down_proj tensors x {residual_scale}")


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
    ap.add_argument("--mlx-bits", type=int, choices=[2, 3, 4, 5, 6, 8],
                    help="write the model in mlx-lm's quantized layout with numpy, not "
                    "through transformers (qwen3 and qwen3_moe shapes)")
    ap.add_argument("--mlx-group-size", type=int, default=64, choices=[32, 64, 128])
    ap.add_argument("--scaled-twin", action="store_true",
                    help="SHAPE is a model directory: write it to OUT_DIR with "
                    "--residual-scale applied, sharing the files it leaves alone")
    args = ap.parse_args()
    if args.scaled_twin:
        if not os.path.isdir(args.shape) or args.residual_scale is None:
            ap.error("--scaled-twin takes a model directory and --residual-scale")
        write_scaled_twin(args.shape, args.out_dir, args.residual_scale)
        return
    if not os.path.isdir(args.shape) and args.shape not in SHAPES:
        ap.error(f"{args.shape}: neither a directory nor one of {', '.join(SHAPES)}")
    cfg = config_dir(args.shape, args.tokenizer, tempfile.mkdtemp(prefix="random-weights-"))
    if args.drafter:
        write_drafter(args, cfg)
    elif args.mlx_bits:
        write_mlx_model(cfg, args.out_dir, args.mlx_bits, args.mlx_group_size, args.seed,
                        args.residual_scale)
    else:
        write_model(cfg, args.out_dir, args.seed, args.residual_scale)


if __name__ == "__main__":
    main()
