#!/usr/bin/env python3
"""Build tiny random mixture-of-experts checkpoints in mlx-lm's own layout,
and record the greedy tokens mlx-lm generates from them.

This is an independent reference for dspec: the models are built with
mlx-lm's own model classes, saved with mlx-lm's own save path, loaded back
with mlx-lm's own loader, and decoded with mlx-lm's own generation loop and
KV cache. dspec's tests load the same directories and must produce the same
greedy tokens.

What it writes, for each case below, under adapters/tests/mlx_lm/<case>/:

  config.json                   what mlx_lm.utils.save_config writes: the model
                                args (sorted), and for quantized cases the
                                `quantization` block (global defaults plus
                                per-module overrides) and its copy
                                `quantization_config`.
  model.safetensors             mlx_lm.utils.save_model's output: the model's
                                flattened parameters, metadata {"format": "mlx"}.
  model.safetensors.index.json  also written by save_model (weight map, sizes).
  expected.json                 {"case", "model_type", "prompt", "greedy",
                                 "computed_by", "logits_last_prompt_position"}.

Cases:
  qwen3_moe_f32, qwen3_moe_q4      mlx_lm.models.qwen3_moe
  qwen3_next_f32, qwen3_next_q4    mlx_lm.models.qwen3_next (hybrid: layers
                                   linear, linear, full attention)
  qwen3_5_moe_f32, qwen3_5_moe_q4  mlx_lm.models.qwen3_5_moe (text model under
                                   `language_model`, same shapes as qwen3_next)

The q4 cases hold the same weights as their f32 case, quantized the way
`mlx_lm.convert --quantize --q-bits 4 --q-group-size 32` does it: affine,
4 bits, group size 32, through mlx_lm.utils.quantize_model with the model's
own `quant_predicate`, which puts the routers (`mlp.gate`) and, where there is
one, `mlp.shared_expert_gate` at 8 bits with group size 64 and records each of
those modules in the `quantization` block.

Weights come from numpy's PCG64 generator with a fixed seed per model family:
embeddings N(0, 1); every linear / expert / router / lm_head weight
N(0, 1/sqrt(in_features)); RMSNorm weights (incl. the gated norm of the
linear-attention layers) 1 + N(0, 0.3); depthwise conv1d weights
N(0, 1/sqrt(kernel)); linear-attention A_log = log(U(0.1, 4)) and dt_bias
1 + N(0, 0.3). Weights are set in the layout the model class uses at run
time (what mlx-lm saves), i.e. after sanitize(): experts stacked as
`switch_mlp.{gate,up,down}_proj.weight` [E, out, in], conv1d [C, K, 1], norm
weights as the actual multiplier.

Install and run (from the repository root; CPU only, a few seconds):

  python3 -m venv target/mlx-lm-venv
  target/mlx-lm-venv/bin/pip install "mlx[cpu]==0.32.3" mlx-lm==0.32.2
  target/mlx-lm-venv/bin/python adapters/tests/mlx_lm/make_mlx_lm.py

Optional arguments: case names to build only those (default: all).

mlx 0.32.3, not 0.32.2: mlx-lm 0.32.2's quantized expert layer passes
`global_scale=` to mx.gather_qmm, which mlx 0.32.2 does not accept (the q4
cases fail there); 0.32.3 is the first mlx that does. The f32 outputs are
byte-identical under both.

Every case is checked before it is written: the reloaded model's logits equal
the in-memory model's exactly; mlx-lm's generate_step and a plain
make_prompt_cache + __call__ loop give the same 24 tokens; at least
MIN_DISTINCT different ids; and no near ties (top-1 minus top-2 logit at
least MIN_LOGIT_GAP at every step, k-th minus (k+1)-th router probability at
least MIN_ROUTER_GAP at every layer and position), so that an implementation
that rounds differently from mlx still picks the same tokens and experts.
The seeds in CASES are the first, counting up from a base, that pass all of
this for both the f32 and the q4 case of a family. Output is deterministic:
rerunning rewrites the same bytes.

CI never runs this script: its outputs are committed, and dspec's tests read
them. Rerun it only to regenerate the reference on purpose.
"""

import copy
import json
import shutil
import sys
from pathlib import Path

import numpy as np

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

import mlx_lm
from mlx_lm.generate import generate_step
from mlx_lm.models import qwen3_5_moe, qwen3_moe, qwen3_next
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model, quantize_model, save_config, save_model

OUT_DIR = Path(__file__).resolve().parent

PROMPT = [2, 45, 17, 99, 3, 64, 81, 17, 120, 8, 33, 71]
NEW_TOKENS = 24
# The greedy choice and the expert choice must not be near ties (see tie_margins).
MIN_LOGIT_GAP = 0.01
MIN_ROUTER_GAP = 0.001
# Greedy tokens must not be degenerate (one id repeated): at least this many ids.
MIN_DISTINCT = 12
Q_BITS = 4
Q_GROUP_SIZE = 32

# ---------------------------------------------------------------------------
# Configs (what config.json holds, before quantization is added)
# ---------------------------------------------------------------------------

QWEN3_MOE_CONFIG = {
    "model_type": "qwen3_moe",
    "vocab_size": 128,
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [1],
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}

# Hybrid: layer i is full attention iff (i + 1) % full_attention_interval == 0,
# so an interval of 3 over 3 layers gives linear, linear, full.
QWEN3_NEXT_CONFIG = {
    "model_type": "qwen3_next",
    "vocab_size": 128,
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "full_attention_interval": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "attention_bias": False,
    "partial_rotary_factor": 0.25,
    "rope_theta": 1000000.0,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}

# Qwen3.5-MoE nests the text model's args under text_config (as the Hugging
# Face checkpoints do). mlx-lm's TextModelArgs reads rope settings from
# rope_parameters (partial_rotary_factor, rope_theta); mrope_section is only
# used by the vision path and is ignored for text, it is given for a
# 4-dim rotary slice (sections sum to rotary_dim / 2). layer_types is not read
# by mlx-lm (it uses full_attention_interval) and is given for readers that do.
# Every layer of this model is MoE (mlx-lm ignores mlp_only_layers and
# decoder_sparse_step here), so there is no intermediate_size.
QWEN3_5_MOE_CONFIG = {
    "model_type": "qwen3_5_moe",
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_moe_text",
        "vocab_size": 128,
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "full_attention_interval": 3,
        "layer_types": ["linear_attention", "linear_attention", "full_attention"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "attention_bias": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [1, 1, 0],
            "mrope_interleaved": True,
        },
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    },
}

# name -> (module, config, seed, quantize)
CASES = {
    "qwen3_moe_f32": (qwen3_moe, QWEN3_MOE_CONFIG, 1037, False),
    "qwen3_moe_q4": (qwen3_moe, QWEN3_MOE_CONFIG, 1037, True),
    "qwen3_next_f32": (qwen3_next, QWEN3_NEXT_CONFIG, 2026, False),
    "qwen3_next_q4": (qwen3_next, QWEN3_NEXT_CONFIG, 2026, True),
    "qwen3_5_moe_f32": (qwen3_5_moe, QWEN3_5_MOE_CONFIG, 3016, False),
    "qwen3_5_moe_q4": (qwen3_5_moe, QWEN3_5_MOE_CONFIG, 3016, True),
}


# ---------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------


def init_value(name, shape, rng):
    """The value of one parameter, by its name and shape (see module doc)."""
    shape = tuple(shape)
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("embed_tokens.weight"):
        return rng.normal(0.0, 1.0, shape)
    if leaf == "A_log":
        return np.log(rng.uniform(0.1, 4.0, shape))
    if leaf == "dt_bias":
        return 1.0 + rng.normal(0.0, 0.3, shape)
    if name.endswith("conv1d.weight"):
        # Depthwise conv, mlx layout [channels, kernel, 1].
        return rng.normal(0.0, 1.0 / np.sqrt(shape[1] * shape[2]), shape)
    if leaf == "weight" and len(shape) == 1 and "norm" in name:
        return 1.0 + rng.normal(0.0, 0.3, shape)
    if leaf == "weight" and len(shape) >= 2:
        # Linear [out, in], expert stacks [E, out, in], routers [E, hidden].
        return rng.normal(0.0, 1.0 / np.sqrt(shape[-1]), shape)
    raise ValueError(f"no init rule for parameter {name} {shape}")


def set_random_weights(model, seed):
    rng = np.random.default_rng(seed)
    params = sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])
    new = [
        (name, mx.array(init_value(name, p.shape, rng).astype(np.float32)))
        for name, p in params
    ]
    model.update(tree_unflatten(new))
    mx.eval(model.parameters())


def build_model(module, config, seed, quantize):
    """Returns (model, config to save)."""
    config = copy.deepcopy(config)
    # from_dict may mutate nested dicts (qwen3_5's rope_parameters): give it a copy.
    args = module.ModelArgs.from_dict(copy.deepcopy(config))
    model = module.Model(args)
    set_random_weights(model, seed)
    if quantize:
        # As mlx_lm.convert does: quant_predicate=None means the model's own
        # quant_predicate (routers and shared-expert gates at 8 bits).
        model, config = quantize_model(
            model, config, group_size=Q_GROUP_SIZE, bits=Q_BITS, mode="affine"
        )
    model.eval()
    mx.eval(model.parameters())
    return model, config


# ---------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------


def last_prompt_logits(model):
    cache = make_prompt_cache(model)
    logits = model(mx.array(PROMPT)[None], cache=cache)
    return logits[0, -1].astype(mx.float32)


def greedy_generate_step(model):
    """mlx-lm's own generation loop with an argmax sampler."""
    tokens = []
    for token, _ in generate_step(
        mx.array(PROMPT),
        model,
        max_tokens=NEW_TOKENS,
        sampler=lambda logprobs: mx.argmax(logprobs, axis=-1),
    ):
        tokens.append(int(token))
    return tokens


def greedy_manual(model):
    """The model's __call__ with make_prompt_cache: prompt at once, then one
    token per step."""
    cache = make_prompt_cache(model)
    logits = model(mx.array(PROMPT)[None], cache=cache)
    tokens = []
    for _ in range(NEW_TOKENS):
        tok = int(mx.argmax(logits[0, -1]))
        tokens.append(tok)
        logits = model(mx.array([[tok]]), cache=cache)
    return tokens


class _RouterProbe(nn.Module):
    """Wraps a router to record, per call, the smallest gap between the k-th
    and (k+1)-th largest routing probability (how close routing is to a tie)."""

    def __init__(self, inner, k, log):
        super().__init__()
        self.inner = inner
        self._k = k
        self._log = log

    def __call__(self, x):
        y = self.inner(x)
        p = mx.sort(mx.softmax(y.astype(mx.float32), axis=-1), axis=-1)
        self._log.append(mx.min(p[..., -self._k] - p[..., -self._k - 1]).item())
        return y


def tie_margins(model):
    """Greedy-decodes as greedy_manual does, on a model that is changed in
    place (its routers are wrapped: use a throwaway copy), and returns
    (tokens, smallest top-1 minus top-2 logit gap over the 24 steps, smallest
    router k-th minus (k+1)-th probability gap over all layers and positions).
    Large gaps mean an implementation whose float rounding differs from
    mlx's still picks the same tokens and experts."""
    log = []
    for layer in model.layers:
        mlp = layer.mlp
        if hasattr(mlp, "gate") and hasattr(mlp, "switch_mlp"):
            mlp.gate = _RouterProbe(mlp.gate, mlp.top_k, log)
    cache = make_prompt_cache(model)
    logits = model(mx.array(PROMPT)[None], cache=cache)
    tokens, gaps = [], []
    for _ in range(NEW_TOKENS):
        row = mx.sort(logits[0, -1].astype(mx.float32))
        gaps.append((row[-1] - row[-2]).item())
        tok = int(mx.argmax(logits[0, -1]))
        tokens.append(tok)
        logits = model(mx.array([[tok]]), cache=cache)
    return tokens, min(gaps), min(log)


def sig6(x):
    return float(f"{x:.6g}")


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------


def describe_file(path):
    tensors = mx.load(str(path))
    return {k: (list(v.shape), str(v.dtype).replace("mlx.core.", "")) for k, v in sorted(tensors.items())}


def make_case(name):
    module, config, seed, quantize = CASES[name]
    out = OUT_DIR / name
    if out.exists():
        shutil.rmtree(out)

    model, save_cfg = build_model(module, config, seed, quantize)
    ref_logits = model(mx.array(PROMPT)[None])
    mx.eval(ref_logits)

    # mlx-lm's save path.
    save_model(out, model)
    save_config(save_cfg, config_path=out / "config.json")

    # Load back with mlx-lm's loader; the logits must be identical.
    loaded, _ = load_model(out)
    got_logits = loaded(mx.array(PROMPT)[None])
    if not mx.array_equal(ref_logits, got_logits).item():
        diff = mx.max(mx.abs(ref_logits - got_logits)).item()
        raise SystemExit(f"{name}: reloaded logits differ (max abs diff {diff})")

    greedy = greedy_generate_step(loaded)
    manual = greedy_manual(loaded)
    if greedy != manual:
        raise SystemExit(f"{name}: generate_step {greedy} != manual loop {manual}")
    if len(set(greedy)) < MIN_DISTINCT:
        raise SystemExit(f"{name}: too few distinct greedy tokens {greedy}; change the seed")

    probe, _ = load_model(out)
    probe_tokens, logit_gap, router_gap = tie_margins(probe)
    assert probe_tokens == greedy, (probe_tokens, greedy)
    if logit_gap < MIN_LOGIT_GAP or router_gap < MIN_ROUTER_GAP:
        raise SystemExit(
            f"{name}: near tie (logit gap {logit_gap:.3g}, router gap "
            f"{router_gap:.3g}); change the seed"
        )

    logits = last_prompt_logits(loaded)
    expected = {
        "case": name,
        "model_type": save_cfg["model_type"],
        "prompt": PROMPT,
        "greedy": greedy,
        "computed_by": {
            "mlx": mx.__version__,
            "mlx_lm": mlx_lm.__version__,
            "device": "cpu",
        },
        "logits_last_prompt_position": [sig6(v) for v in logits.tolist()],
    }
    # One key per line, each value on one line.
    with open(out / "expected.json", "w") as f:
        f.write("{\n")
        f.write(",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in expected.items()))
        f.write("\n}\n")

    print(f"== {name}: greedy {greedy}")
    print(f"   smallest logit gap {logit_gap:.4g}, smallest router gap {router_gap:.4g}")
    for k, (shape, dtype) in describe_file(out / "model.safetensors").items():
        print(f"   {k} {shape} {dtype}")


def main(argv):
    mx.set_default_device(mx.cpu)
    assert mx.default_device() == mx.cpu, mx.default_device()
    names = argv or list(CASES)
    for name in names:
        if name not in CASES:
            raise SystemExit(f"unknown case {name}; known: {', '.join(CASES)}")
        make_case(name)


if __name__ == "__main__":
    main(sys.argv[1:])
