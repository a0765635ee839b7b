#!/usr/bin/env python3
"""dspec against mlx-lm on the same models and prompts, in one run.

Runs, in this order and in one invocation:
  1. `dspec bench` with a draft model (plain greedy + speculative, one process),
  2. `dspec bench` with n-gram prompt lookup,
  3. mlx-lm (the same MLX build) greedy and speculative (`speculative_generate_step`
     through `stream_generate`, same draft model and number of draft tokens) on exactly
     the prompt token ids dspec used,
then prints one table (decode tok/s, tau, speedups, greedy-output equality) and writes
the whole record as JSON.

Decode tok/s is measured the same way for both engines: tokens after the first over
the time from the first token to the last (prefill excluded). Each engine warms up on
the first prompt before anything is timed.

Usage (on a machine where `import mlx_lm` works, e.g. the GPU box):
  python3 scripts/bench_gpu.py --dspec target/release/dspec --target DIR --draft DIR \
      [--max-tokens 256] [--max-draft 4] [--ngram-draft 6] [--json-out FILE]
"""

import argparse
import json
import os
import subprocess
import sys
import time


def run_dspec_bench(dspec, target, drafter, max_draft, max_tokens, extra):
    cmd = [dspec, "bench", "--target", target, "--drafter", drafter,
           "--max-draft", str(max_draft), "--max-tokens", str(max_tokens), "--json", *extra]
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    # `dspec bench` exits non-zero when greedy outputs differ, after printing its report.
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.stderr.strip():
        print(out.stderr.strip(), file=sys.stderr)
    try:
        return json.loads(out.stdout)["report"]
    except (json.JSONDecodeError, KeyError):
        sys.exit(f"{' '.join(cmd)} failed (exit {out.returncode}) without a report")


def mlx_lm_generate(stream_generate, model, tokenizer, prompt_ids, max_tokens, sampler,
                    draft=None, num_draft=0):
    """Generated ids (EOS excluded), decode tok/s, and tau (speculative only)."""
    import mlx.core as mx

    kwargs = {"max_tokens": max_tokens, "sampler": sampler}
    if draft is not None:
        kwargs.update(draft_model=draft, num_draft_tokens=num_draft)
    tokens, from_draft, times = [], 0, []
    for r in stream_generate(model, tokenizer, mx.array(prompt_ids), **kwargs):
        # The last response repeats the last token (or carries the EOS that ended it).
        if r.finish_reason is not None and tokens and r.generation_tokens == len(tokens):
            break
        if r.finish_reason == "stop":
            break
        tokens.append(int(r.token))
        from_draft += bool(r.from_draft)
        times.append(time.perf_counter())
    tps = (len(tokens) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
    rounds = len(tokens) - from_draft
    tau = len(tokens) / rounds if draft is not None and rounds else None
    return tokens, tps, tau


def mlx_lm_view(model_dir):
    """mlx-lm only loads weight files named model*.safetensors; dspec names its converted
    shards shard-NNNNN.safetensors. Gives a directory of links with names mlx-lm finds."""
    import glob
    import tempfile
    if glob.glob(os.path.join(model_dir, "model*.safetensors")):
        return model_dir
    view = tempfile.mkdtemp(prefix="mlx-lm-view-")
    for name in os.listdir(model_dir):
        src = os.path.abspath(os.path.join(model_dir, name))
        dst = f"model-{name}" if name.endswith(".safetensors") else name
        if name != "model.safetensors.index.json":
            os.symlink(src, os.path.join(view, dst))
    return view


def run_mlx_lm(target, draft, prompts, max_tokens, num_draft):
    # mlx-lm's verify step hands MLX's CUDA attention a new key length every round, and
    # MLX builds (and caches) a cuDNN plan per shape: past 512 misses MLX 0.32.2 aborts
    # with "Cache thrashing". A larger plan cache keeps mlx-lm's speculative decoding
    # running (each round still pays for a new plan).
    os.environ.setdefault("MLX_CUDA_SDPA_CACHE_SIZE", "65536")
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = load(mlx_lm_view(target))
    draft_model, _ = load(mlx_lm_view(draft))
    greedy = make_sampler(temp=0.0)
    # Warm-up: kernels, graph caches and allocations of both paths.
    warm = max(8, min(32, max_tokens))
    mlx_lm_generate(stream_generate, model, tokenizer, prompts[0], warm, greedy)
    mlx_lm_generate(stream_generate, model, tokenizer, prompts[0], warm, greedy,
                    draft_model, num_draft)
    rows = []
    for ids in prompts:
        plain, plain_tps, _ = mlx_lm_generate(stream_generate, model, tokenizer, ids,
                                              max_tokens, greedy)
        spec, spec_tps, tau = mlx_lm_generate(stream_generate, model, tokenizer, ids,
                                              max_tokens, greedy, draft_model, num_draft)
        rows.append({"plain_tokens": plain, "plain_tps": plain_tps,
                     "spec_tokens": spec, "spec_tps": spec_tps, "tau": tau})
    return rows


def strip_eos(tokens, eos_ids):
    return tokens[:-1] if tokens and tokens[-1] in eos_ids else tokens


def same_greedy(a, b, max_tokens):
    """Token-for-token equality; one side may be a prefix only where max_tokens cut it."""
    n = min(len(a), len(b))
    if a[:n] != b[:n]:
        return next(i for i in range(n) if a[i] != b[i])
    if len(a) != len(b) and max(len(a), len(b)) < max_tokens - 1:
        return n
    return None


def weight_bytes(model_dir):
    return sum(os.path.getsize(os.path.join(model_dir, f))
               for f in os.listdir(model_dir) if f.endswith(".safetensors"))


def aggregate(rates_tokens):
    """Overall tok/s over prompts: total tokens / total time."""
    tokens = sum(n for _, n in rates_tokens)
    seconds = sum(n / r for r, n in rates_tokens if r > 0)
    return tokens / seconds if seconds else 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dspec", default="target/release/dspec")
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-draft", type=int, default=4,
                    help="draft tokens per round for the draft model (both engines)")
    ap.add_argument("--ngram-draft", type=int, default=6,
                    help="draft tokens per round for dspec's n-gram drafter")
    ap.add_argument("--hbm-gbps", type=float, default=3350.0,
                    help="GPU memory bandwidth for the physical limit (H100 SXM: 3350)")
    ap.add_argument("--json-out")
    ap.add_argument("--skip-mlx-lm", action="store_true")
    ap.add_argument("--dspec-arg", action="append", default=[],
                    help="extra argument for both dspec runs (repeatable)")
    args = ap.parse_args()

    dm = run_dspec_bench(args.dspec, args.target, f"model:{args.draft}", args.max_draft,
                         args.max_tokens, args.dspec_arg)
    ng = run_dspec_bench(args.dspec, args.target, "ngram", args.ngram_draft,
                         args.max_tokens, args.dspec_arg)
    prompts = [r["prompt_ids"] for r in dm["rows"]]
    eos = set()
    for r in dm["rows"]:
        if r["plain"].get("stop_reason") == "eos" and r["tokens"]:
            eos.add(r["tokens"][-1])
    reference = [strip_eos(r["tokens"], eos) for r in dm["rows"]]

    peer = None if args.skip_mlx_lm else run_mlx_lm(args.target, args.draft, prompts,
                                                      args.max_tokens, args.max_draft)

    def n_decoded(tokens):
        return max(len(tokens) - 1, 0)

    lines = []

    def add(engine, mode, rows, tps_of, tau, tokens_of):
        rate = aggregate([(tps_of(r), n_decoded(tokens_of(r))) for r in rows])
        diffs = [same_greedy(tokens_of(r), ref, args.max_tokens)
                 for r, ref in zip(rows, reference)]
        lines.append({"engine": engine, "mode": mode, "tokens_per_second": rate, "tau": tau,
                      "identical_to_dspec_greedy": all(d is None for d in diffs),
                      "first_differences": diffs,
                      "per_prompt_tokens_per_second": [tps_of(r) for r in rows]})

    add("dspec", "greedy", dm["rows"], lambda r: r["plain"]["decode_tokens_per_second"],
        None, lambda r: strip_eos(r["tokens"], eos))
    add("dspec", f"speculative, draft model k={args.max_draft}", dm["rows"],
        lambda r: r["speculative"]["decode_tokens_per_second"], dm["tau"],
        lambda r: strip_eos(r["tokens"], eos) if r["identical"] else [])
    add("dspec", f"speculative, n-gram k={args.ngram_draft}", ng["rows"],
        lambda r: r["speculative"]["decode_tokens_per_second"], ng["tau"],
        lambda r: strip_eos(r["tokens"], eos) if r["identical"] else [])
    if peer is not None:
        taus = [r["tau"] for r in peer if r["tau"]]
        add("mlx-lm", "greedy", peer, lambda r: r["plain_tps"], None,
            lambda r: r["plain_tokens"])
        add("mlx-lm", f"speculative, draft model k={args.max_draft}", peer,
            lambda r: r["spec_tps"], sum(taus) / len(taus) if taus else None,
            lambda r: r["spec_tokens"])

    by = {(l["engine"], l["mode"]): l["tokens_per_second"] for l in lines}
    mlx_greedy = by.get(("mlx-lm", "greedy"))
    mlx_spec = by.get(("mlx-lm", f"speculative, draft model k={args.max_draft}"))
    limit = args.hbm_gbps * 1e9 / max(weight_bytes(args.target), 1)

    print(f"\ntarget {args.target}   draft {args.draft}   prompts {len(prompts)}   "
          f"max tokens {args.max_tokens}")
    print(f"physical limit of plain decoding: {weight_bytes(args.target) / 1e9:.2f} GB of "
          f"weights / {args.hbm_gbps:.0f} GB/s = {limit:.0f} tok/s")
    header = f"{'engine':<7} {'mode':<34} {'tok/s':>8} {'tau':>5} {'vs mlx-lm greedy':>17} " \
             f"{'vs mlx-lm spec':>15}  greedy output vs dspec greedy"
    print(header)
    for l in lines:
        tau = f"{l['tau']:.2f}" if l["tau"] else "-"
        vs_g = f"{l['tokens_per_second'] / mlx_greedy:.2f}x" if mlx_greedy else "-"
        vs_s = f"{l['tokens_per_second'] / mlx_spec:.2f}x" if mlx_spec else "-"
        same = "identical" if l["identical_to_dspec_greedy"] else \
            "DIFFER at " + ",".join("-" if d is None else str(d) for d in l["first_differences"])
        print(f"{l['engine']:<7} {l['mode']:<34} {l['tokens_per_second']:>8.1f} {tau:>5} "
              f"{vs_g:>17} {vs_s:>15}  {same}")
    record = {"target": args.target, "draft": args.draft, "max_tokens": args.max_tokens,
              "physical_limit_tokens_per_second": limit, "lines": lines,
              "dspec_draft_model": dm, "dspec_ngram": ng, "mlx_lm": peer}
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(record, f, indent=1)
    ok = mlx_greedy and mlx_spec and \
        by[("dspec", "greedy")] >= 1.5 * mlx_greedy and \
        by[("dspec", f"speculative, draft model k={args.max_draft}")] >= 1.5 * mlx_spec
    print("targets (dspec >= 1.5x mlx-lm, greedy and speculative):",
          "met" if ok else "NOT met")


if __name__ == "__main__":
    main()
