#!/usr/bin/env python3
"""Writes a model directory with random weights of a real model's shapes.

Speed on a GPU depends on shapes, not on weight values, and a checkpoint of a few GB is
slow to bring to a machine without network. This takes a directory holding a real
model's config.json and tokenizer files, initialises the same architecture with random
weights through transformers (on the GPU when there is one) and saves it as bf16
safetensors next to copies of those files, loadable by dspec and mlx-lm alike.

`--residual-scale S` multiplies every layer's output projections (o_proj, down_proj) by S,
so that the residual stream keeps the token embedding nearly unchanged and the next token
is, in effect, a function of the current one with wide margins between the top logits.
Random weights otherwise leave near-ties at most positions, where bf16 rounding that
differs between a verify's rows and a plain step's changes the greedy token: a speculative
run is then off a replayed answer within a few tokens, and the cost of rounds whose
drafts are all kept cannot be measured. Shapes, hence speed, are unchanged.

Usage: python3 scripts/random_weights.py CONFIG_DIR OUT_DIR [--seed N] [--residual-scale S]
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
    ap.add_argument("--residual-scale", type=float, default=None)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    config = AutoConfig.from_pretrained(args.config_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config)
    # Cast after building: the dtype keyword of from_config changed name across
    # transformers releases, and an ignored one would silently save f32 weights.
    model = model.to(torch.bfloat16)
    if args.residual_scale is not None:
        scaled = 0
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    p.mul_(args.residual_scale)
                    scaled += 1
        if scaled == 0:
            raise SystemExit("--residual-scale: no o_proj/down_proj weights in this architecture")
    model.save_pretrained(args.out_dir, safe_serialization=True, max_shard_size="8GB")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        src = os.path.join(args.config_dir, name)
        if os.path.exists(src):
            shutil.copy(src, os.path.join(args.out_dir, name))
    print(args.out_dir)


if __name__ == "__main__":
    main()
