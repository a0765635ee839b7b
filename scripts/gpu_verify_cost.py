#!/usr/bin/env python3
"""What a speculative verify of w positions costs, against one plain decode step.

For each model, in one run:
  - plain greedy decoding (`dspec generate`): one decode step = 1 / decode tok/s;
  - the model drafting for itself with `--max-draft w-1` and `--draft-ahead off`, traced
    (`--trace`): its drafts are its own greedy tokens, so nearly every round verifies w
    positions; the verify cost is the median `verify_ms` of the rounds that drafted w-1;
  - the same with each `--verify` mode asked for (batched: the default; exact: position by
    position).
Prints verify(w) in ms and in decode steps, and writes everything as JSON.

Usage: python3 scripts/gpu_verify_cost.py --dspec BIN --model DIR [--model DIR ...]
           [--widths 2,4,8,16] [--verify batched,exact] [--quantize 4] [--json-out FILE]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

PROMPT = "Write a Python function that returns the n-th Fibonacci number iteratively."


def dspec_json(cmd, env=None):
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True,
                         env=None if env is None else {**os.environ, **env})
    if out.returncode != 0:
        print(out.stderr.strip()[-2000:], file=sys.stderr)
        return None
    return json.loads(out.stdout)


def kept_round_steps(report, trace_path):
    """A `dspec bench` of one prompt with `--verify-ahead always --trace`: what a round
    costs in the same process's plain steps. Returns (whole, traced, per_pass): whole =
    tau / speedup (a whole round, everything it does, from the passes' own ratios);
    per pass, the median `verify_ms` of its widest rounds queued ahead (the guess held)
    over the plain step of the plain run beside it (`plain_passes`, in the order run);
    traced = the median of those."""
    runs = []
    with open(trace_path) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            if r["round"] == 0 or not runs:
                runs.append([])
            runs[-1].append(r)
    widest = max((len(r["drafted"]) for run in runs for r in run), default=0)
    per_pass = []
    for run, plain in zip(runs, report["rows"][0]["plain_passes"]):
        ahead = [r["verify_ms"] for r in run if r["queued_ahead"] and len(r["drafted"]) == widest]
        if ahead and plain:
            per_pass.append(statistics.median(ahead) * plain / 1e3)
    whole = report["tau"] / report["speedup"] if report.get("speedup") else None
    return whole, (statistics.median(per_pass) if per_pass else None), per_pass


def plain_step_ms(dspec, model, max_tokens, extra, run=dspec_json):
    """One decode step's milliseconds, the decode rate and its breakdown; `run` runs the
    command and returns its JSON (gpu_report.py passes its Runner's)."""
    result = run([dspec, "generate", "--target", model, "--prompt", PROMPT,
                  "--max-tokens", str(max_tokens), "--no-chat-template", "--json", *extra])
    if result is None:
        return None, None, None
    tps = result["stats"]["decode_tokens_per_second"]
    return (1e3 / tps if tps else None), tps, result["stats"].get("decode_breakdown")


def verify_ms(dspec, model, width, max_tokens, extra, env=None, run=None):
    """The median verify milliseconds at `width` from a trace, and how many rounds gave
    it; `run` as in plain_step_ms (by default dspec_json with `env` added)."""
    run = run or (lambda cmd: dspec_json(cmd, env))
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as trace:
        result = run([dspec, "generate", "--target", model, "--drafter", f"model:{model}",
                      "--max-draft", str(width - 1), "--draft-ahead", "off",
                      "--prompt", PROMPT, "--max-tokens", str(max_tokens),
                      "--no-chat-template", "--json", "--trace", trace.name, *extra])
        if result is None:
            return None, 0
        rounds = [json.loads(line) for line in open(trace.name) if line.strip()]
    # The first rounds pay one-off costs (kernel builds, plans): leave them out.
    times = [r["verify_ms"] for r in rounds[2:] if len(r["drafted"]) == width - 1]
    return (statistics.median(times) if times else None), len(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dspec", required=True)
    ap.add_argument("--model", action="append", required=True)
    ap.add_argument("--widths", default="2,4,8,16")
    ap.add_argument("--verify", default="batched,exact")
    ap.add_argument("--quantize", default=None, help="also measure with --quantize BITS")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--env", action="append", default=[],
                    help="NAME=VALUE: also measure the default verify with this set")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    variants = [("bf16", [])]
    if args.quantize:
        variants.append((f"{args.quantize}-bit", ["--quantize", args.quantize]))
    record = []
    for model in args.model:
        for label, extra in variants:
            step, tps, breakdown = plain_step_ms(args.dspec, model, 256, extra)
            entry = {"model": os.path.basename(model.rstrip("/")), "weights": label,
                     "plain_tokens_per_second": tps, "step_ms": step,
                     "plain_breakdown": breakdown, "verify": {}}
            # Quantized weights: the default verify only (the exact mode's cost is the
            # one-token step's times the width whatever the weights).
            modes = [(m, None) for m in (args.verify.split(",") if not extra else ["batched"])]
            modes += [("batched " + kv, dict([kv.split("=", 1)])) for kv in args.env]
            for mode, env in modes:
                for w in widths:
                    ms, n = verify_ms(args.dspec, model, w, args.max_tokens,
                                      extra + ["--verify", mode.split()[0]], env)
                    entry["verify"][f"{mode}:{w}"] = {"ms": ms, "rounds": n,
                                                      "steps": ms / step if ms and step else None}
            record.append(entry)
            if args.json_out:
                with open(args.json_out, "w") as f:
                    json.dump(record, f, indent=1)
    print()
    print(f"{'model':<10} {'weights':<7} {'tok/s':>7} {'step ms':>8}  verify ms (steps) per mode:width")
    for e in record:
        cells = "  ".join(
            f"{k}={v['ms']:.2f} ({v['steps']:.2f})" if v["ms"] and v["steps"] else f"{k}=-"
            for k, v in e["verify"].items())
        tps = f"{e['plain_tokens_per_second']:.1f}" if e["plain_tokens_per_second"] else "-"
        step = f"{e['step_ms']:.2f}" if e["step_ms"] else "-"
        print(f"{e['model']:<10} {e['weights']:<7} {tps:>7} {step:>8}  {cells}")
        print(f"           plain decode breakdown (s): {e['plain_breakdown']}")


if __name__ == "__main__":
    main()
