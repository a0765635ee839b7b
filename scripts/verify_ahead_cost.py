#!/usr/bin/env python3
"""What a round of w positions costs with rounds queued ahead, against one plain step.

For one model and a prompt, in one run, with a drafter whose drafts are mostly kept: the
n-gram drafter on a prompt whose answer copies it, or `replay` (the plain run's own
answer drafted back, every draft kept; any weights, random ones included):
  - plain greedy decoding (`dspec generate`, before and after the rest): one plain step
    = 1 / decode tok/s (the better of the two);
  - for each width w, the drafter with `--max-draft w-1`, traced (`--trace`), once with
    `--verify-ahead always` and once with `off`. A round's `verify_ms` is the time from the
    read of the round before it to its own read, drafting excluded: with rounds queued
    ahead, what the round adds to the generation. Reported per width: the median over
    rounds that drafted w-1 tokens, for `always` over those queued ahead (the guess held),
    for `off` over all of them.
Prints the costs in ms and in plain steps, with each run's decode tok/s and tau, and
writes everything as JSON.

Usage: python3 scripts/verify_ahead_cost.py --dspec BIN --model DIR --prompt-file JSONL
           [--drafter ngram|replay] [--widths 2,4,8,16] [--max-tokens 320] [--json-out FILE]
           [--spec-args "--verify exact"]

On a GPU, bf16 rounding differs between a verify's rows and a plain step's, and with
random weights near-ties are everywhere: a replayed answer is left within a few tokens
unless the verify computes each row as a plain step does (`--spec-args "--verify exact"`).
"""

import argparse
import json
import statistics
import tempfile

from gpu_verify_cost import dspec_json as run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dspec", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-file", required=True, help="JSONL; the first line's prompt")
    ap.add_argument("--drafter", choices=["ngram", "replay"], default="ngram")
    ap.add_argument("--widths", default="2,4,8,16")
    ap.add_argument("--max-tokens", type=int, default=320)
    ap.add_argument("--json-out")
    ap.add_argument("--spec-args", default="",
                    help="more arguments for the speculative runs (e.g. \"--verify exact\")")
    args = ap.parse_args()
    prompt = json.loads(open(args.prompt_file).readline())["prompt"]
    base = [args.dspec, "generate", "--target", args.model, "--prompt", prompt,
            "--max-tokens", str(args.max_tokens), "--json"]

    answer = tempfile.NamedTemporaryFile(suffix=".json")

    def plain():
        result = run(base)
        if result is None:
            return None
        with open(answer.name, "w") as f:
            json.dump(result, f)
        return result["stats"]["decode_tokens_per_second"]

    drafter = "ngram" if args.drafter == "ngram" else f"replay:{answer.name}"
    report = {"model": args.model, "drafter": args.drafter,
              "plain_tokens_per_second": [plain()], "widths": []}
    for w in [int(x) for x in args.widths.split(",")]:
        row = {"width": w}
        for ahead in ["always", "off"]:
            with tempfile.NamedTemporaryFile(suffix=".jsonl") as trace:
                result = run(base + ["--drafter", drafter, "--max-draft", str(w - 1),
                                     "--verify-ahead", ahead, "--trace", trace.name,
                                     *args.spec_args.split()])
                if result is None:
                    continue
                rounds = [json.loads(line) for line in open(trace.name) if line.strip()]
            # The first rounds pay one-off costs (kernel builds): left out.
            full = [r for r in rounds[4:] if len(r["drafted"]) == w - 1]
            timed = [r["verify_ms"] for r in full if ahead == "off" or r["queued_ahead"]]
            # Also reported: the host's time building and queueing those rounds.
            hosts = [r["host_ms"] for r in full if r.get("host_ms") is not None
                     and (ahead == "off" or r["queued_ahead"])]
            builds = [r["build_ms"] for r in full if r.get("build_ms") is not None
                      and (ahead == "off" or r["queued_ahead"])]
            row[ahead] = {
                "round_ms": statistics.median(timed) if timed else None,
                "host_ms": statistics.median(hosts) if hosts else None,
                "build_ms": statistics.median(builds) if builds else None,
                "rounds_timed": len(timed),
                "rounds": len(rounds),
                "rounds_queued_ahead": sum(r["queued_ahead"] for r in rounds),
                "decode_tokens_per_second": result["stats"]["decode_tokens_per_second"],
                "tau": result["speculative"]["tau"],
            }
        report["widths"].append(row)
    report["plain_tokens_per_second"].append(plain())
    best = max(t for t in report["plain_tokens_per_second"] if t)
    step = 1e3 / best
    report["plain_step_ms"] = step
    print(f"plain step {step:.2f} ms ({best:.1f} tok/s)")
    print("w   | ahead: ms  steps  host ms  tok/s  tau  (rounds timed) | off: the same")
    for row in report["widths"]:
        cells = []
        for ahead in ["always", "off"]:
            r = row.get(ahead)
            if not r or r["round_ms"] is None:
                cells.append("-")
                continue
            r["steps"] = r["round_ms"] / step
            host = f"{r['host_ms']:.2f}" if r["host_ms"] is not None else "-"
            if r.get("build_ms") is not None:
                host += f" (build {r['build_ms']:.2f})"
            cells.append(f"{r['round_ms']:.2f} {r['steps']:.2f} host {host} "
                         f"{r['decode_tokens_per_second']:.1f} {r['tau']:.2f} ({r['rounds_timed']})")
        print(f"{row['width']:<3} | " + " | ".join(cells))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
