#!/usr/bin/env python3
"""Writes a model directory with random weights of a real model's shapes.

Speed on a GPU depends on shapes, not on weight values, and a checkpoint of a few GB is
slow to bring to a machine without network. This takes a directory holding a real
model's config.json and tokenizer files, initialises the same architecture with random
weights through transformers (on the GPU when there is one) and saves it as bf16
safetensors next to copies of those files, loadable by dspec and mlx-lm alike.

Usage: python3 scripts/random_weights.py CONFIG_DIR OUT_DIR [--seed N]
"""

import argparse
import os
import shutil

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    config = AutoConfig.from_pretrained(args.config_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config)
    # Cast after building: the dtype keyword of from_config changed name across
    # transformers releases, and an ignored one would silently save f32 weights.
    model = model.to(torch.bfloat16)
    model.save_pretrained(args.out_dir, safe_serialization=True, max_shard_size="8GB")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        src = os.path.join(args.config_dir, name)
        if os.path.exists(src):
            shutil.copy(src, os.path.join(args.out_dir, name))
    print(args.out_dir)


if __name__ == "__main__":
    main()
