#!/usr/bin/env python3
"""Writes the golden checkpoints and expected logits of adapters/tests/golden.rs.

For every built-in family, Hugging Face transformers itself builds a tiny model from a
fixed config (with the features the family is known for switched on), its weights are
drawn from a seeded generator, and it is saved as a model directory (config.json +
model.safetensors, float32). The model is then loaded back from that directory and run
on the CPU in float32 over a fixed token sequence; the logits of every position go to
expected.json beside the checkpoint, with the versions that computed them.

A developer runs this once, when a family or a family's features change; CI never
runs Python. Install (from the repository root):

    python3 -m venv target/golden-venv
    target/golden-venv/bin/pip install torch==2.15.0 transformers==5.24.0 safetensors==0.8.0
    target/golden-venv/bin/python adapters/tests/golden/make_golden.py

(PyPI's Linux torch wheel is the CUDA build and pulls NVIDIA libraries; this script
only ever runs it on the CPU. Where download.pytorch.org is reachable,
`pip install torch --index-url https://download.pytorch.org/whl/cpu` is the smaller
CPU-only wheel and computes the same.)

Usage: make_golden.py [--out adapters/tests/golden] [FAMILY...]
"""

import argparse
import json
import math
import pathlib
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM

# Every family gets the same tokens: 12 positions, one repeated id, all below VOCAB.
# The sliding windows below are shorter than this, so windowed layers really cut.
TOKENS = [2, 45, 17, 99, 3, 64, 81, 17, 120, 8, 33, 71]
VOCAB = 128
WINDOW = 5
SEED = 1234
SIGNIFICANT_DIGITS = 6

# The shape every family starts from: GQA (4 query heads over 2 KV heads).
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    max_position_embeddings=256,
)

# The hybrid families' shape: a Gated DeltaNet layer first and last, gated full
# attention between; 2 key heads of 8 over 4 value heads of 8, a convolution of 4.
HYBRID = dict(
    num_hidden_layers=3,
    head_dim=16,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    tie_word_embeddings=False,
    rope_parameters=dict(rope_type="default", rope_theta=10_000.0, partial_rotary_factor=0.25),
)

# A vision tower as small as Qwen3_5Config allows: the checkpoint must carry one to be a
# released-style Qwen3.5, and dspec ignores it.
TINY_VISION = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    patch_size=2,
    temporal_patch_size=2,
    spatial_merge_size=1,
    out_hidden_size=32,
    num_position_embeddings=16,
)

# family (dspec's adapter file) -> (config class, config overrides, norms stored as w
# in `x̂ · (1 + w)`[, model class when not AutoModelForCausalLM's choice]). Each comment
# names the features the config switches on. Overrides with a `text_config` are the
# whole config (BASE goes inside it).
FAMILIES = {
    # Biases on attention and MLP, llama3 rope scaling whose low-frequency band starts
    # inside a 12-token context, untied head.
    "llama": (
        "LlamaConfig",
        dict(
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
        False,
    ),
    # A sliding window on every layer, head_dim apart from hidden/heads, rope base 1e6.
    "mistral": (
        "MistralConfig",
        dict(
            head_dim=16,
            sliding_window=WINDOW,
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0),
        ),
        False,
    ),
    # q/k/v biases (not o), tied head, yarn rope, sliding window from layer 1 on
    # (`use_sliding_window` + `max_window_layers`), three layers.
    "qwen2": (
        "Qwen2Config",
        dict(
            num_hidden_layers=3,
            # Yarn's factor is this over original_max_position_embeddings.
            max_position_embeddings=32,
            tie_word_embeddings=True,
            use_sliding_window=True,
            max_window_layers=1,
            sliding_window=WINDOW,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=1_000_000.0,
                factor=4.0,
                original_max_position_embeddings=8,
            ),
        ),
        False,
    ),
    # RMSNorm on each head's q and k, head_dim apart from hidden/heads, tied head,
    # a windowed second layer.
    "qwen3": (
        "Qwen3Config",
        dict(
            head_dim=16,
            tie_word_embeddings=True,
            use_sliding_window=True,
            max_window_layers=1,
            sliding_window=WINDOW,
            rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0),
        ),
        False,
    ),
    # (1 + w) norms, √hidden embedding scale, tanh-GELU, tied head, one KV head (MQA,
    # as Gemma 2B), head_dim apart from hidden/heads.
    "gemma": (
        "GemmaConfig",
        dict(
            head_dim=16,
            num_key_value_heads=1,
            hidden_act="gelu_pytorch_tanh",
        ),
        True,
    ),
    # Sandwich norms, attention-score and final-logit softcapping (caps small enough
    # that tanh bends this tiny model's scores, up to about 3, and logits, up to about
    # 35), query_pre_attn_scalar apart from head_dim, a window on layer 0, global
    # attention on layer 1.
    "gemma2": (
        "Gemma2Config",
        dict(
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=WINDOW,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=10.0,
            hidden_activation="gelu_pytorch_tanh",
        ),
        True,
    ),
    # gemma2's layout plus (1 + w) q/k norms; a local layer (window, rope base 1e4)
    # then a global one (rope base 1e6 with linear scaling).
    "gemma3_text": (
        "Gemma3TextConfig",
        dict(
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters=dict(
                sliding_attention=dict(rope_type="default", rope_theta=10_000.0),
                full_attention=dict(
                    rope_type="linear", rope_theta=1_000_000.0, factor=8.0
                ),
            ),
        ),
        True,
    ),
    # Plain-weight sandwich norms, q/k norms and an unscaled v norm, attention scale 1,
    # learned per-layer output scalars, final-logit softcapping; a local layer with
    # head_dim 16 and its own v_proj, then a global layer with head_dim 32, one KV head
    # whose values come from the key projection, and proportional partial RoPE.
    "gemma4": (
        "Gemma4TextConfig",
        dict(
            head_dim=16,
            global_head_dim=32,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            hidden_size_per_layer_input=0,
            num_kv_shared_layers=0,
            enable_moe_block=False,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters=dict(
                sliding_attention=dict(rope_type="default", rope_theta=10_000.0),
                full_attention=dict(
                    rope_type="proportional",
                    partial_rotary_factor=0.25,
                    rope_theta=1_000_000.0,
                ),
            ),
            final_logit_softcapping=10.0,
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
        ),
        False,
    ),
    # Hybrid linear attention (dense Qwen3-Next): Gated DeltaNet layers around a gated
    # full-attention layer (q/k norms, a quarter of each head rotated), projections fused
    # per key head (in_proj_qkvz, in_proj_ba), two value heads per key head.
    "qwen3_next": (
        "Qwen3NextConfig",
        dict(**HYBRID, num_experts=0),
        True,
    ),
    # The same hybrid as Qwen3.5 releases it: the text model nested under text_config
    # beside a (tiny, unused) vision tower, tensors under model.language_model., separate
    # in_proj_qkv/z/b/a, multimodal rotary sections (text positions rotate as plain
    # RoPE).
    "qwen3_5": (
        "Qwen3_5Config",
        dict(
            text_config={
                **BASE,
                **HYBRID,
                "rope_parameters": dict(
                    HYBRID["rope_parameters"], mrope_section=[1, 1, 0], mrope_interleaved=True
                ),
            },
            vision_config=TINY_VISION,
        ),
        True,
        "Qwen3_5ForConditionalGeneration",
    ),
}


def randomize(model, seed, offset_norms):
    """Draws every weight from one seeded generator, in a fixed (name) order.

    transformers' own init is too tame to test anything: norms at exactly 1 (or 0 under
    the 1 + w convention) and weights of std 0.02 make wrong norm offsets, scalars or
    head mixes hard to see in the logits. Projections get std 1/sqrt(fan_in), so
    activations keep their scale through the layers.
    """
    gen = torch.Generator().manual_seed(seed)

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean

    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if ".visual." in name:
                # A vision tower dspec does not load: transformers' seeded init will do.
                continue
            if name.endswith("embed_tokens.weight"):
                p.copy_(normal(p.shape, 1.0))
            elif p.ndim == 2:
                p.copy_(normal(p.shape, 1.0 / math.sqrt(p.shape[1])))
            elif name.endswith("conv1d.weight"):
                # Depthwise [channels, 1, kernel].
                p.copy_(normal(p.shape, 1.0 / math.sqrt(p.shape[-1])))
            elif name.endswith("A_log"):
                # Decay rates exp(A_log) around 0.4: states keep a few positions' worth.
                p.copy_(normal(p.shape, 0.5, -1.0))
            elif name.endswith("dt_bias"):
                p.copy_(normal(p.shape, 0.5))
            elif name.endswith("linear_attn.norm.weight"):
                # The gated output norm scales plainly, in every family.
                p.copy_(normal(p.shape, 0.3, 1.0))
            elif "norm" in name:
                # Stored w of `x̂ · (1 + w)`, or the plain scale around 1.
                p.copy_(normal(p.shape, 0.3, 0.0 if offset_norms else 1.0))
            elif name.endswith(".bias"):
                p.copy_(normal(p.shape, 0.2))
            else:
                sys.exit(f"no rule to randomize parameter {name} {tuple(p.shape)}")
        for name, b in sorted(model.named_buffers(), key=lambda kv: kv[0]):
            # gemma4's learned per-layer output scale (a persistent buffer in HF).
            if name.endswith("layer_scalar"):
                b.copy_(normal(b.shape, 0.25, 1.0))


def rounded(x):
    return float(f"{x:.{SIGNIFICANT_DIGITS}g}")


def make(family, out_root):
    config_class, overrides, offset_norms, *model_class = FAMILIES[family]
    nested = "text_config" in overrides
    config = getattr(transformers, config_class)(**(overrides if nested else {**BASE, **overrides}))
    # Plain matmul-softmax attention: the reference is the textbook computation, not a
    # fused kernel.
    config._attn_implementation = "eager"
    torch.manual_seed(SEED)
    model_class = getattr(transformers, model_class[0]) if model_class else AutoModelForCausalLM
    if model_class is AutoModelForCausalLM:
        model = model_class.from_config(config, dtype=torch.float32)
    else:
        model = model_class(config).to(torch.float32)
    randomize(model, SEED, offset_norms)

    out = out_root / family
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    keep = {"config.json", "model.safetensors"}
    for f in out.iterdir():
        if f.name not in keep:
            f.unlink()

    # The expected logits come from the checkpoint as saved, read back by transformers:
    # what dspec is compared with is exactly what the directory holds.
    reloaded = model_class.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        ids = torch.tensor([TOKENS])
        logits = reloaded(input_ids=ids, use_cache=False).logits[0]
        direct = model.eval()(input_ids=ids, use_cache=False).logits[0]
    if not torch.equal(logits, direct):
        sys.exit(f"{family}: the reloaded checkpoint computes other logits than the model saved")

    expected = {
        "family": family,
        "model_type": reloaded.config.model_type,
        "tokens": TOKENS,
        "significant_digits": SIGNIFICANT_DIGITS,
        "computed_by": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "device": "cpu",
            "dtype": "float32",
            "attn_implementation": "eager",
        },
        "logits": [[rounded(v) for v in row] for row in logits.tolist()],
    }
    (out / "expected.json").write_text(json.dumps(expected, separators=(",", ":")) + "\n")
    sizes = {f.name: f.stat().st_size for f in sorted(out.iterdir())}
    spread = logits.abs().max().item()
    print(f"{family}: {sizes}, max |logit| {spread:.3f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", help=f"default: all ({', '.join(FAMILIES)})")
    # The golden data lives beside this script.
    here = pathlib.Path(__file__).resolve().parent
    parser.add_argument("--out", type=pathlib.Path, default=here)
    args = parser.parse_args()
    unknown = [f for f in args.families if f not in FAMILIES]
    if unknown:
        sys.exit(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    torch.set_num_threads(1)
    for family in args.families or FAMILIES:
        make(family, args.out)


if __name__ == "__main__":
    main()
