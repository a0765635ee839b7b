#!/usr/bin/env python3
"""Prefill only: dspec's warm prefill rate against mlx-lm's at the asked lengths, both
measured up to the first generated token (gpu_report.py's MlxLmPeer.prefill), in one
invocation. Run on the GPU machine through gpu-report.sh's setup, or as
    python3 scripts/gpu_prefill.py --dspec BIN --target DIR [--lengths 1024,4096]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_report import MlxLmPeer, Runner  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dspec", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--lengths", default="1024,4096")
    args = ap.parse_args()
    report = Runner().json([args.dspec, "bench", "--target", args.target, "--drafter", "ngram",
                            "--max-tokens", "4", "--prefill-lengths", args.lengths, "--json"])
    rows = [r for r in report["report"]["prefill"]["rows"] if r.get("prompt") is None]
    ids = [r["prompt_ids"] for r in report["report"]["rows"]]
    pool = sum(ids, [])
    peer = MlxLmPeer(args.target, args.target)
    for row in rows:
        n = row["prompt_tokens"]
        synthetic = (pool * (n // max(len(pool), 1) + 1))[:n]
        theirs, first = peer.prefill(synthetic)
        print(f"prefill {n:>6} tokens: dspec {row['tokens_per_second']:.0f} tok/s, "
              f"mlx-lm {theirs:.0f} tok/s ({row['tokens_per_second'] / theirs:.2f}x)")


if __name__ == "__main__":
    main()
