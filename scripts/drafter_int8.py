#!/usr/bin/env python3
"""Carries a trained drafter back from the GPU machine, whose runs return at most 64 MiB.

pack (THERE, with torch and safetensors): DRAFTER_DIR OUT_DIR writes the drafter's matrices
rounded to 8 bits per row (a scale per row) and its vectors in f16, in 15 MiB parts
OUT_DIR/drafter8.partN, with its config.json beside them.
unpack (HERE, with numpy and safetensors): OUT_DIR DRAFTER_DIR joins the parts and writes
an f32 drafter that `dspec bench --drafter DRAFTER_DIR` loads.

The unpacked weights differ from the trained ones by the rounding (under 0.4% of each
row's largest value), which is what a CPU measurement of the carried drafter measures.
"""

import shutil
import sys
from pathlib import Path

PART = 15 * 1024 * 1024


def pack(drafter, out):
    import torch
    from safetensors.torch import load_file, save_file

    packed = {}
    for name, w in load_file(str(drafter / "model.safetensors")).items():
        w = w.float()
        if w.ndim == 2:
            scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
            packed[name + ".q"] = (w / scale).round().to(torch.int8)
            packed[name + ".s"] = scale.half()
        else:
            packed[name] = w.half()
    out.mkdir(parents=True, exist_ok=True)
    whole = out / "drafter8.safetensors"
    save_file(packed, str(whole))
    data = whole.read_bytes()
    whole.unlink()
    for i in range(0, len(data), PART):
        (out / f"drafter8.part{i // PART}").write_bytes(data[i : i + PART])
    shutil.copy(drafter / "config.json", out / "config.json")


def unpack(parts, drafter):
    import numpy as np
    from safetensors.numpy import load, save_file

    names = sorted(parts.glob("drafter8.part*"), key=lambda p: int(p.name[len("drafter8.part"):]))
    if not names:
        sys.exit(f"no drafter8.part* in {parts}")
    packed = load(b"".join(p.read_bytes() for p in names))
    weights = {}
    for name, value in packed.items():
        if name.endswith(".s"):
            continue
        if name.endswith(".q"):
            stem = name[:-2]
            weights[stem] = value.astype(np.float32) * packed[stem + ".s"].astype(np.float32)
        else:
            weights[name] = value.astype(np.float32)
    drafter.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(drafter / "model.safetensors"))
    shutil.copy(parts / "config.json", drafter / "config.json")


def main():
    if len(sys.argv) != 4 or sys.argv[1] not in ("pack", "unpack"):
        sys.exit(__doc__)
    action, src, dst = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    (pack if action == "pack" else unpack)(src, dst)


if __name__ == "__main__":
    main()
