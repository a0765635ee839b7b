#!/usr/bin/env python3
"""Writes a Qwen3.5 (text) model directory with random bf16 weights of a given shape.

Speed depends on shapes, not values, and a hybrid checkpoint of the Qwen3.5-4B shape is
8 GB to carry. This writes the tensors dspec's qwen3_5 adapter reads (Hugging Face
names and layout, text model only) straight from numpy, one tensor at a time, so it
needs neither transformers' support for the family nor the memory of a whole model.

Usage: qwen35_random_weights.py OUT_DIR --tokenizer-dir DIR [--shape 4b|tiny] [--seed N]
  DIR holds tokenizer.json (and tokenizer_config.json, generation_config.json, copied
  when present); its ids must stay below the shape's vocabulary.
"""

import argparse
import json
import os
import shutil
import struct

import numpy as np

SHAPES = {
    # Qwen3.5-4B as its config.json lists it (text part).
    "4b": dict(hidden_size=2560, num_hidden_layers=32, intermediate_size=9216,
               num_attention_heads=16, num_key_value_heads=4, head_dim=256,
               linear_num_key_heads=16, linear_key_head_dim=128,
               linear_num_value_heads=32, linear_value_head_dim=128,
               vocab_size=248320),
    # A small one for trying the script on a CPU.
    "tiny": dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 linear_num_key_heads=2, linear_key_head_dim=16,
                 linear_num_value_heads=4, linear_value_head_dim=16,
                 vocab_size=151936),
}


def config_for(shape):
    c = dict(SHAPES[shape])
    c.update(model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"],
             hidden_act="silu", attention_bias=False, rms_norm_eps=1e-6,
             linear_conv_kernel_dim=4, full_attention_interval=4,
             tie_word_embeddings=True, max_position_embeddings=32768,
             rope_parameters=dict(rope_type="default", rope_theta=10000000.0,
                                  partial_rotary_factor=0.25))
    c["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                        for i in range(c["num_hidden_layers"])]
    return c


def tensors(c):
    h, inter = c["hidden_size"], c["intermediate_size"]
    hk, dk = c["linear_num_key_heads"], c["linear_key_head_dim"]
    hv, dv = c["linear_num_value_heads"], c["linear_value_head_dim"]
    heads, kv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    conv = 2 * hk * dk + hv * dv
    yield "model.embed_tokens.weight", [c["vocab_size"], h]
    yield "model.norm.weight", [h]
    for i, kind in enumerate(c["layer_types"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", [h]
        yield p + "post_attention_layernorm.weight", [h]
        yield p + "mlp.gate_proj.weight", [inter, h]
        yield p + "mlp.up_proj.weight", [inter, h]
        yield p + "mlp.down_proj.weight", [h, inter]
        if kind == "linear_attention":
            a = p + "linear_attn."
            yield a + "in_proj_qkv.weight", [conv, h]
            yield a + "in_proj_z.weight", [hv * dv, h]
            yield a + "in_proj_a.weight", [hv, h]
            yield a + "in_proj_b.weight", [hv, h]
            yield a + "conv1d.weight", [conv, 1, 4]
            yield a + "A_log", [hv]
            yield a + "dt_bias", [hv]
            yield a + "norm.weight", [dv]
            yield a + "out_proj.weight", [h, hv * dv]
        else:
            a = p + "self_attn."
            yield a + "q_proj.weight", [2 * heads * hd, h]
            yield a + "k_proj.weight", [kv * hd, h]
            yield a + "v_proj.weight", [kv * hd, h]
            yield a + "o_proj.weight", [h, heads * hd]
            yield a + "q_norm.weight", [hd]
            yield a + "k_norm.weight", [hd]


def bf16_bytes(rng, shape, name):
    n = int(np.prod(shape))
    if name.endswith("norm.weight"):
        x = np.zeros(n, dtype=np.float32)  # HF stores (1 + w) norms as w
    elif name.endswith("A_log"):
        x = np.log(rng.uniform(1.0, 16.0, n)).astype(np.float32)
    else:
        x = (rng.standard_normal(n, dtype=np.float32) * 0.02)
    return (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--tokenizer-dir", required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="4b")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    c = config_for(args.shape)
    os.makedirs(args.out_dir, exist_ok=True)
    listing = list(tensors(c))
    header, offset = {}, 0
    for name, shape in listing:
        size = int(np.prod(shape)) * 2
        header[name] = dict(dtype="BF16", shape=shape, data_offsets=[offset, offset + size])
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    rng = np.random.default_rng(args.seed)
    with open(os.path.join(args.out_dir, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape in listing:
            f.write(bf16_bytes(rng, shape, name))
    with open(os.path.join(args.out_dir, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        src = os.path.join(args.tokenizer_dir, name)
        if os.path.exists(src):
            shutil.copy(src, os.path.join(args.out_dir, name))
    print(args.out_dir, f"{offset / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
