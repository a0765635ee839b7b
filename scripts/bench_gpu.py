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
import statistics
import struct
import subprocess
import sys
import time


def run_dspec_bench(dspec, target, drafter, max_draft, max_tokens, extra, env=None):
    """`max_draft`: a count, or `auto` (dspec picks each round's length); `env`: the
    child's environment (default: this one)."""
    cmd = [dspec, "bench", "--target", target, "--drafter", drafter,
           "--max-draft", str(max_draft), "--max-tokens", str(max_tokens), "--json", *extra]
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    # `dspec bench` exits non-zero when greedy outputs differ, after printing its report.
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
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
    tokens, from_draft, times, last_from_draft = [], 0, [], False
    for r in stream_generate(model, tokenizer, mx.array(prompt_ids), **kwargs):
        # The last response repeats the last token (or carries the EOS that ended it).
        if r.finish_reason is not None and tokens and r.generation_tokens == len(tokens):
            break
        if r.finish_reason == "stop":
            break
        tokens.append(int(r.token))
        from_draft += bool(r.from_draft)
        last_from_draft = bool(r.from_draft)
        times.append(time.perf_counter())
    tps = (len(tokens) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
    # Each verify yields one token of the target's own, except a last round cut short by
    # max_tokens, which ends on drafts: count it too, as dspec counts its forwards.
    rounds = len(tokens) - from_draft + int(last_from_draft)
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


class MlxLm:
    """mlx-lm with the target and draft loaded once, warmed up on the first prompt."""

    def __init__(self, target, draft, warm_prompt, max_tokens, num_draft):
        # mlx-lm's verify step hands MLX's CUDA attention a new key length every round,
        # and MLX builds (and caches) a cuDNN plan per shape: past 512 misses MLX 0.32.2
        # aborts with "Cache thrashing". A larger plan cache keeps mlx-lm's speculative
        # decoding running (each round still pays for a new plan).
        os.environ.setdefault("MLX_CUDA_SDPA_CACHE_SIZE", "65536")
        from mlx_lm import load, stream_generate
        from mlx_lm.sample_utils import make_sampler

        self.stream_generate = stream_generate
        self.model, self.tokenizer = load(mlx_lm_view(target))
        self.draft, _ = load(mlx_lm_view(draft))
        self.greedy = make_sampler(temp=0.0)
        self.max_tokens, self.num_draft = max_tokens, num_draft
        warm = max(8, min(32, max_tokens))
        self.generate(warm_prompt, warm, speculative=False)
        self.generate(warm_prompt, warm, speculative=True)

    def generate(self, ids, max_tokens, speculative):
        draft = self.draft if speculative else None
        return mlx_lm_generate(self.stream_generate, self.model, self.tokenizer, ids,
                               max_tokens, self.greedy, draft, self.num_draft)

    def run(self, prompts):
        rows = []
        for ids in prompts:
            plain, plain_tps, _ = self.generate(ids, self.max_tokens, speculative=False)
            spec, spec_tps, tau = self.generate(ids, self.max_tokens, speculative=True)
            rows.append({"plain_tokens": plain, "plain_tps": plain_tps,
                         "spec_tokens": spec, "spec_tps": spec_tps, "tau": tau})
        return rows


def difference_position(row):
    """Where a `dspec bench` row's speculative output first differs from its greedy one:
    None, or the position (`first_difference` is an object with a near-tie report; older
    dspec builds wrote the bare position)."""
    d = row["first_difference"]
    return d["position"] if isinstance(d, dict) else d


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


def one_pass(args, dm, ng, auto, peer, variants):
    """Table lines of one pass: decode tok/s over all prompts, tau, equality with the
    pass's dspec greedy output."""
    eos = set()
    for r in dm["rows"]:
        if r["plain"].get("stop_reason") == "eos" and r["tokens"]:
            eos.add(r["tokens"][-1])
    reference = [strip_eos(r["tokens"], eos) for r in dm["rows"]]
    lines = []

    def add(engine, mode, rows, tps_of, n_of, tau, diffs):
        rate = aggregate([(tps_of(r), n_of(r)) for r in rows])
        lines.append({"engine": engine, "mode": mode, "tokens_per_second": rate, "tau": tau,
                      "identical_to_dspec_greedy": all(d is None for d in diffs),
                      "first_differences": diffs,
                      "per_prompt_tokens_per_second": [tps_of(r) for r in rows]})

    def decoded(stats):
        return max(stats["generated_tokens"] - 1, 0)

    add("dspec", "greedy", dm["rows"], lambda r: r["plain"]["decode_tokens_per_second"],
        lambda r: decoded(r["plain"]), None, [None] * len(dm["rows"]))
    # `dspec bench` compares its speculative output with its greedy output itself.
    modes = [(dm, f"speculative, draft model k={args.max_draft}"),
             (ng, f"speculative, n-gram k={args.ngram_draft}")]
    if auto is not None:
        modes.append((auto, "speculative, draft model k=auto"))
    for report, mode in modes:
        add("dspec", mode, report["rows"],
            lambda r: r["speculative"]["decode_tokens_per_second"],
            lambda r: decoded(r["speculative"]), report["tau"],
            [difference_position(r) for r in report["rows"]])
    for label, variant in variants:
        # The same dspec runs with other settings: greedy against the default greedy
        # output when the setting can change plain decoding, speculative against its
        # own greedy output.
        rows = variant["report"]["rows"]
        if variant["greedy"]:
            add("dspec", f"greedy, {label}", rows,
                lambda r: r["plain"]["decode_tokens_per_second"], lambda r: decoded(r["plain"]),
                None, [same_greedy(strip_eos(r["tokens"], eos), ref, args.max_tokens)
                       for r, ref in zip(rows, reference)])
        add("dspec", f"speculative k={args.max_draft}, {label}", rows,
            lambda r: r["speculative"]["decode_tokens_per_second"],
            lambda r: decoded(r["speculative"]), variant["report"]["tau"],
            [difference_position(r) for r in rows])
    if peer is not None:
        def diffs(key):
            return [same_greedy(r[key], ref, args.max_tokens)
                    for r, ref in zip(peer, reference)]
        taus = [r["tau"] for r in peer if r["tau"]]
        add("mlx-lm", "greedy", peer, lambda r: r["plain_tps"],
            lambda r: max(len(r["plain_tokens"]) - 1, 0), None, diffs("plain_tokens"))
        add("mlx-lm", f"speculative, draft model k={args.max_draft}", peer,
            lambda r: r["spec_tps"], lambda r: max(len(r["spec_tokens"]) - 1, 0),
            sum(taus) / len(taus) if taus else None, diffs("spec_tokens"))
    return lines


def weight_bytes(model_dir):
    """Bytes of weights one decode step reads: every tensor, except that an embedding
    table is only gathered from (one row) when a separate lm_head does the output."""
    sizes = {}
    for f in os.listdir(model_dir):
        if f.endswith(".safetensors"):
            with open(os.path.join(model_dir, f), "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
            for name, info in header.items():
                if name != "__metadata__":
                    start, end = info["data_offsets"]
                    sizes[name] = end - start
    total = sum(sizes.values())
    if "lm_head.weight" in sizes:
        total -= sizes.get("model.embed_tokens.weight", 0)
    return total


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
    ap.add_argument("--passes", type=int, default=3,
                    help="alternating passes of both engines; lines report the median")
    ap.add_argument("--no-auto", action="store_true",
                    help="skip dspec's adaptive draft length (--max-draft auto) line")
    ap.add_argument("--ahead-off-too", action="store_true",
                    help="also run draft-model speculative decoding with --draft-ahead off "
                         "(the draft model on the engine's thread, drafting only when asked)")
    ap.add_argument("--eager-too", action="store_true",
                    help="also run draft-model speculative decoding with --draft-ahead eager "
                         "(a round whose drafts came true takes those ready, k at most)")
    ap.add_argument("--dspec-arg", action="append", default=[],
                    help="extra argument for both dspec runs (repeatable)")
    args = ap.parse_args()

    # Extra dspec lines: (label, extra arguments, extra environment, greedy line too).
    variant_specs = []
    if args.ahead_off_too:
        variant_specs.append(("draft-ahead off", ["--draft-ahead", "off"], {}, False))
    if args.eager_too:
        variant_specs.append(("draft-ahead eager", ["--draft-ahead", "eager"], {}, False))

    def run_dspec():
        dm = run_dspec_bench(args.dspec, args.target, f"model:{args.draft}", args.max_draft,
                             args.max_tokens, args.dspec_arg)
        ng = run_dspec_bench(args.dspec, args.target, "ngram", args.ngram_draft,
                             args.max_tokens, args.dspec_arg)
        auto = None if args.no_auto else run_dspec_bench(
            args.dspec, args.target, f"model:{args.draft}", "auto", args.max_tokens,
            args.dspec_arg)
        variants = [(label, {"greedy": greedy, "report": run_dspec_bench(
            args.dspec, args.target, f"model:{args.draft}", args.max_draft, args.max_tokens,
            args.dspec_arg + extra, env={**os.environ, **env})})
            for label, extra, env, greedy in variant_specs]
        return dm, ng, auto, variants

    # Passes alternate which engine goes first, so neither gains from the machine
    # warming up (GPU clocks, page cache); each line reports its median over passes.
    passes = []
    peer_engine = None
    for p in range(args.passes):
        dspec_first = p % 2 == 0 or peer_engine is None
        if dspec_first:
            dm, ng, auto, variants = run_dspec()
        if not args.skip_mlx_lm and peer_engine is None:
            prompts0 = [r["prompt_ids"] for r in dm["rows"]]
            peer_engine = MlxLm(args.target, args.draft, prompts0[0], args.max_tokens,
                                args.max_draft)
        peer = peer_engine.run([r["prompt_ids"] for r in dm["rows"]]) if peer_engine else None
        if not dspec_first:
            dm, ng, auto, variants = run_dspec()
        passes.append(one_pass(args, dm, ng, auto, peer, variants))
        if args.json_out:
            # Written after every pass too, so a run cut short still leaves its passes.
            with open(args.json_out, "w") as f:
                json.dump({"partial": True, "pass_lines": passes}, f, indent=1)
        print(f"pass {p + 1}: " + ", ".join(
            f"{l['engine']} {l['mode']} {l['tokens_per_second']:.1f}" for l in passes[-1]),
            file=sys.stderr, flush=True)

    lines = []
    for i, first in enumerate(passes[0]):
        rates = [pl[i]["tokens_per_second"] for pl in passes]
        line = dict(first)
        line["tokens_per_second"] = statistics.median(rates)
        line["pass_tokens_per_second"] = rates
        line["identical_to_dspec_greedy"] = all(pl[i]["identical_to_dspec_greedy"]
                                                for pl in passes)
        lines.append(line)
    prompts = [r["prompt_ids"] for r in dm["rows"]]

    by = {(l["engine"], l["mode"]): l["tokens_per_second"] for l in lines}
    mlx_greedy = by.get(("mlx-lm", "greedy"))
    mlx_spec = by.get(("mlx-lm", f"speculative, draft model k={args.max_draft}"))
    limit = args.hbm_gbps * 1e9 / max(weight_bytes(args.target), 1)

    print(f"\ntarget {args.target}   draft {args.draft}   prompts {len(prompts)}   "
          f"max tokens {args.max_tokens}")
    print(f"physical limit of plain decoding: {weight_bytes(args.target) / 1e9:.2f} GB of "
          f"weights read per token / {args.hbm_gbps:.0f} GB/s = {limit:.0f} tok/s")
    header = f"{'engine':<7} {'mode':<34} {'tok/s':>8} {'tau':>5} {'vs mlx-lm greedy':>17} " \
             f"{'vs mlx-lm spec':>15}  greedy output vs dspec greedy"
    print(header + f"   (median of {args.passes} passes)")
    for l in lines:
        tau = f"{l['tau']:.2f}" if l["tau"] else "-"
        vs_g = f"{l['tokens_per_second'] / mlx_greedy:.2f}x" if mlx_greedy else "-"
        vs_s = f"{l['tokens_per_second'] / mlx_spec:.2f}x" if mlx_spec else "-"
        same = "identical" if l["identical_to_dspec_greedy"] else \
            "DIFFER at " + ",".join("-" if d is None else str(d) for d in l["first_differences"])
        print(f"{l['engine']:<7} {l['mode']:<34} {l['tokens_per_second']:>8.1f} {tau:>5} "
              f"{vs_g:>17} {vs_s:>15}  {same}")
    record = {"target": args.target, "draft": args.draft, "max_tokens": args.max_tokens,
              "passes": args.passes, "physical_limit_tokens_per_second": limit,
              "lines": lines, "pass_lines": passes,
              "last_pass": {"dspec_draft_model": dm, "dspec_ngram": ng, "dspec_auto": auto,
                            "mlx_lm": peer}}
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
