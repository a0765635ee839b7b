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
import re
import sys

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

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

# The routed experts of every MoE family: 4 experts, 2 per position, each an MLP of 16.
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)

# The least margin between the k-th and (k+1)-th largest router probability, at every MoE
# layer and position of TOKENS: below it, a rounding difference (another BLAS, f32 sums in
# another order) could route a position to another expert and change its logits wholesale.
ROUTER_MIN_GAP = 1e-3

# Qwen3.5-MoE as released, shared by qwen3_5_moe and qwen3_5_moe_fused: the qwen3_5 text
# model with every layer's MLP sparse (Qwen3_5MoeTextConfig has no decoder_sparse_step,
# mlp_only_layers or norm_topk_prob: every layer routes, and the chosen probabilities are
# always renormalized) plus a shared expert behind a sigmoid gate.
QWEN3_5_MOE = (
    "Qwen3_5MoeConfig",
    dict(
        text_config={
            **BASE,
            **HYBRID,
            **MOE,
            "shared_expert_intermediate_size": 24,
            "rope_parameters": dict(
                HYBRID["rope_parameters"], mrope_section=[1, 1, 0], mrope_interleaved=True
            ),
        },
        vision_config=TINY_VISION,
    ),
    True,
    "Qwen3_5MoeForConditionalGeneration",
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
    # Qwen3-MoE (Qwen3-30B-A3B's layout): top-2 of 4 experts with the chosen probabilities
    # renormalized, a dense MLP on the layer listed in mlp_only_layers (layer 1, of
    # intermediate_size) between two sparse ones, q/k norms, untied head, rope base 1e6.
    # config.json gets the released `num_experts` beside transformers 5's
    # `num_local_experts` (CONFIG_ADDITIONS).
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            **MOE,
            num_hidden_layers=3,
            head_dim=16,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0),
        ),
        False,
    ),
    # Qwen3-MoE with sparse layers chosen by decoder_sparse_step alone (layers 1 and 3 of
    # four; 0 and 2 dense), the chosen probabilities used as they are (norm_topk_prob
    # off), and only transformers 5's `num_local_experts` in config.json.
    "qwen3_moe_step2": (
        "Qwen3MoeConfig",
        dict(
            **MOE,
            num_hidden_layers=4,
            head_dim=16,
            norm_topk_prob=False,
            decoder_sparse_step=2,
            mlp_only_layers=[],
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0),
        ),
        False,
    ),
    # Qwen3-Next as released: qwen3_next's hybrid with every layer's MLP sparse (top-2 of
    # 4 renormalized) plus a shared expert behind a sigmoid gate (shared_expert,
    # shared_expert_gate).
    "qwen3_next_moe": (
        "Qwen3NextConfig",
        dict(
            **HYBRID,
            **MOE,
            shared_expert_intermediate_size=24,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        ),
        True,
    ),
    # Qwen3.5/3.6-35B-A3B as released: qwen3_5's nesting, prefixes and rotary sections,
    # every layer's MLP sparse with a gated shared expert, the experts saved one tensor
    # per expert and projection (experts.{e}.gate_proj.weight, ...), as save_pretrained
    # writes them.
    "qwen3_5_moe": QWEN3_5_MOE,
    # The same model (seed, weights, logits) with each layer's experts saved fused, as
    # transformers 5 holds them in memory (FUSED_EXPERTS): experts.gate_up_proj
    # [experts, 2 * moe_intermediate, hidden] and experts.down_proj [experts, hidden,
    # moe_intermediate].
    "qwen3_5_moe_fused": QWEN3_5_MOE,
}

# Families saved with each layer's experts fused: family -> the family whose model (seed
# included) it saves.
FUSED_EXPERTS = {"qwen3_5_moe_fused": "qwen3_5_moe"}

# Seeds moved from SEED (by this much) for families whose routers nearly tie at SEED's
# weights (ROUTER_MIN_GAP); the others keep SEED.
SEED_OFFSETS = {
    "qwen3_next_moe": 1,  # SEED leaves a gap of 8.6e-4.
    "qwen3_5_moe": 2,  # SEED leaves 1.5e-5, SEED + 1 3.2e-4.
}

# Keys added to a family's config.json after save_pretrained wrote it, as released
# checkpoints have them: Qwen3-30B-A3B's config says `num_experts`, which transformers 5
# reads (through an attribute map) and saves as `num_local_experts`.
CONFIG_ADDITIONS = {"qwen3_moe": {"num_experts": MOE["num_experts"]}}


def randomize(model, seed, offset_norms):
    """Draws every weight from one seeded generator, in a fixed (name) order.

    transformers' own init is too tame to test anything: norms at exactly 1 (or 0 under
    the 1 + w convention) and weights of std 0.02 make wrong norm offsets, scalars or
    head mixes hard to see in the logits. Projections get std 1/sqrt(fan_in), so
    activations keep their scale through the layers. Parameters only MoE families have
    (fused experts, routers) get rules of their own; the other families have none of
    them, so their draws, in name order from the one generator, stay as they were.
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
            elif name.endswith("mlp.gate.weight"):
                # The router [experts, hidden]: logits of about unit scale, so the experts'
                # probabilities stand well apart (make() checks they do, ROUTER_MIN_GAP).
                p.copy_(normal(p.shape, 1.0 / math.sqrt(p.shape[1])))
            elif p.ndim == 2:
                p.copy_(normal(p.shape, 1.0 / math.sqrt(p.shape[1])))
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                # Every expert's projection [experts, out, in], as the 2-D rule per expert.
                p.copy_(normal(p.shape, 1.0 / math.sqrt(p.shape[-1])))
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


def router_gap(model, ids):
    """The least margin between the k-th and (k+1)-th largest router probability, over
    every MoE layer and position of ids; None for a model without routers."""
    routers = [m for name, m in model.named_modules() if name.endswith(".mlp.gate")]
    if not routers:
        return None
    gaps = []

    def record(router, args, output):
        # output[0]: the router's logits [positions, experts], before its softmax.
        top = torch.softmax(output[0].float(), dim=-1).topk(router.top_k + 1, dim=-1).values
        gaps.append((top[:, router.top_k - 1] - top[:, router.top_k]).min().item())

    hooks = [router.register_forward_hook(record) for router in routers]
    try:
        with torch.no_grad():
            model.eval()(input_ids=ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return min(gaps)


# One expert's projection as save_pretrained names it (transformers' qwen2_moe checkpoint
# conversion, reversed on save).
PER_EXPERT = re.compile(r"(.+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")
FUSED = ("experts.gate_up_proj", "experts.down_proj")


def save_fused_experts(model, out):
    """Rewrites out/model.safetensors, as save_pretrained wrote it (one tensor per expert and
    projection), with each layer's experts fused as the model holds them in memory, after
    checking that both hold the same numbers under the same names otherwise.

    gate_up_proj[e] is expert e's gate_proj over its up_proj (rows [0, moe_intermediate) are
    the gate). Qwen3_5MoeExperts.forward (transformers 5.24,
    models/qwen3_5_moe/modeling_qwen3_5_moe.py, line 884) computes
      gate, up = nn.functional.linear(current_state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
      current_hidden_states = self.act_fn(gate) * up
    and the qwen2_moe conversion that loads per-expert checkpoints concatenates the
    gate_proj tensors before the up_proj ones (Concatenate(dim=1)). Both are checked below:
    the tensors against the per-expert file, the order against the module itself.
    """
    path = out / "model.safetensors"
    per_expert = load_file(path)
    fused = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    # The other tensors keep save_pretrained's names (model.language_model., model.visual.,
    # lm_head.) and values.
    plain = {name for name in per_expert if not PER_EXPERT.fullmatch(name)}
    experts = {name for name in fused if name.endswith(FUSED)}
    if set(fused) - experts != plain:
        differ = sorted((set(fused) - experts) ^ plain)
        sys.exit(f"{out.name}: the in-memory names differ from save_pretrained's: {differ}")
    for name in plain:
        if not torch.equal(fused[name], per_expert[name]):
            sys.exit(f"{out.name}: {name} differs from the one save_pretrained wrote")
    per_expert_count = 0
    for name in sorted(experts):
        prefix, kind = name.rsplit(".", 1)
        module = model.get_submodule(prefix)
        x = torch.randn(len(TOKENS), module.hidden_dim, generator=torch.Generator().manual_seed(0))
        for e in range(fused[name].shape[0]):
            gate, up, down = (
                per_expert[f"{prefix}.{e}.{proj}_proj.weight"] for proj in ("gate", "up", "down")
            )
            per_expert_count += 1 if kind == "down_proj" else 2
            want = torch.cat([gate, up]) if kind == "gate_up_proj" else down
            if not torch.equal(fused[name][e], want):
                sys.exit(f"{out.name}: {name}[{e}] is not the per-expert tensors' {kind}")
            if kind == "gate_up_proj":
                # Every position routed to expert e alone, with weight 1: the module must
                # compute down(act(x gate^T) * x up^T) from the per-expert tensors.
                got = module(x, torch.full((len(TOKENS), 1), e), torch.ones(len(TOKENS), 1))
                ref = (module.act_fn(x @ gate.T) * (x @ up.T)) @ down.T
                if not torch.allclose(got, ref, rtol=1e-5, atol=1e-6):
                    sys.exit(f"{out.name}: {prefix} does not activate the gate_proj half")
    if per_expert_count != len(per_expert) - len(plain):
        sys.exit(f"{out.name}: save_pretrained wrote per-expert tensors no fused one holds")
    save_file(fused, path, metadata={"format": "pt"})


def make(family, out_root):
    # A fused family builds (seed included) and runs its source family's model.
    source = FUSED_EXPERTS.get(family, family)
    config_class, overrides, offset_norms, *model_class = FAMILIES[source]
    nested = "text_config" in overrides
    config = getattr(transformers, config_class)(**(overrides if nested else {**BASE, **overrides}))
    # Plain matmul-softmax attention, and the experts as a loop of per-expert matmuls (not
    # transformers' default grouped_mm): the reference is the textbook computation, not a
    # fused kernel.
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    seed = SEED + SEED_OFFSETS.get(source, 0)
    torch.manual_seed(seed)
    model_class = getattr(transformers, model_class[0]) if model_class else AutoModelForCausalLM
    if model_class is AutoModelForCausalLM:
        model = model_class.from_config(config, dtype=torch.float32)
    else:
        model = model_class(config).to(torch.float32)
    randomize(model, seed, offset_norms)
    ids = torch.tensor([TOKENS])
    gap = router_gap(model, ids)
    if gap is not None and gap < ROUTER_MIN_GAP:
        sys.exit(
            f"{family}: routers nearly tie on the golden tokens (least gap {gap:.2e} < "
            f"{ROUTER_MIN_GAP:g}); give {source} another SEED_OFFSETS entry"
        )

    out = out_root / family
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    keep = {"config.json", "model.safetensors"}
    for f in out.iterdir():
        if f.name not in keep:
            f.unlink()
    if family in CONFIG_ADDITIONS:
        saved = AutoConfig.from_pretrained(out).to_dict()
        config_json = json.loads((out / "config.json").read_text())
        config_json.update(CONFIG_ADDITIONS[family])
        # As save_pretrained writes it (PreTrainedConfig.to_json_string).
        (out / "config.json").write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
        if AutoConfig.from_pretrained(out).to_dict() != saved:
            added = CONFIG_ADDITIONS[family]
            sys.exit(f"{family}: transformers reads config.json otherwise with {added} in it")

    # The expected logits come from the checkpoint as saved, read back by transformers:
    # what dspec is compared with is exactly what the directory holds.
    def reload():
        return model_class.from_pretrained(
            out, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
        ).eval()

    with torch.no_grad():
        logits = reload()(input_ids=ids, use_cache=False).logits[0]
        direct = model.eval()(input_ids=ids, use_cache=False).logits[0]
    if not torch.equal(logits, direct):
        sys.exit(f"{family}: the reloaded checkpoint computes other logits than the model saved")
    if family in FUSED_EXPERTS:
        # The logits stay those of the per-expert checkpoint just read back (the source
        # family's); the fused one must give them exactly.
        save_fused_experts(model, out)
        with torch.no_grad():
            fused = reload()(input_ids=ids, use_cache=False).logits[0]
        if not torch.equal(fused, logits):
            sys.exit(f"{family}: the fused checkpoint computes other logits than the per-expert")

    expected = {
        "family": family,
        "model_type": model.config.model_type,
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
    if gap is not None:
        expected["computed_by"]["experts_implementation"] = "eager"
    (out / "expected.json").write_text(json.dumps(expected, separators=(",", ":")) + "\n")
    sizes = {f.name: f.stat().st_size for f in sorted(out.iterdir())}
    spread = logits.abs().max().item()
    routing = "" if gap is None else f", least router gap {gap:.2e}"
    print(f"{family}: {sizes}, max |logit| {spread:.3f}{routing}")


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
