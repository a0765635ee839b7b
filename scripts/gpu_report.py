#!/usr/bin/env python3
"""One model's GPU report: every line of dspec's speed that matters, beside mlx-lm's.

In one invocation, on one target (and its draft model):
  - plain greedy, and speculative decoding with the draft model under `--max-draft auto`,
    on the built-in prompts (`dspec bench`, which also checks outputs and reports every
    first difference as a near-tie or a real mismatch), with warm prefill at the asked
    lengths and each length's first call apart;
  - n-gram lookup under `--max-draft auto` on the built-in prompts (where it rarely hits,
    so auto must fall back to plain speed), and on a long edit prompt whose answer copies
    the prompt (a rename across a long function);
  - sampled decoding (temperature 0.7, top-p 0.9) against greedy in the same passes of
    the n-gram `dspec bench` (`--temperature`), and 4-bit weights (`--quantize 4`) against
    greedy decoding run the same way (`dspec generate`, one process per prompt each);
  - verify cost per width against one decode step: the model drafting for itself, rounds
    read one by one (`--trace`, `--draft-ahead off`), and rounds queued ahead with every
    draft kept (the plain answer to the first prompt replayed, `dspec bench --verify-ahead
    always --trace`: a round against the plain steps of the same process; with random
    weights, only models written with `random_weights.py --residual-scale` keep them,
    given as --kept-target);
  - mlx-lm 0.32.2 on the same prompt ids: greedy, sampled, speculative with the same
    draft model (k=4), 4-bit (nn.quantize in the process) and warm prefill.
Prints one table with the physical limit of plain decoding, writes JSON after each part.

`--kept-only --kernels 1,0` runs only the kept-drafts lines, once with dspec's CUDA kernels
for short continuations (DSPEC_CUDA_KERNELS=1) and once with MLX's own (0), in one command.
`--write-edit-prompt FILE` writes the long edit prompt as `dspec bench --prompts` reads it.

Usage: python3 scripts/gpu_report.py --dspec BIN --target DIR --draft DIR [--json-out F]
           [--prefill-lengths 1024,4096,16384] [--widths 2,4,8,16] [--kept-passes 7]
           [--kept-target DIR] [--skip-mlx-lm] [--kept-only] [--kernels 1,0]
       python3 scripts/gpu_report.py --write-edit-prompt FILE
"""

import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time


EDIT_BODY = "\n".join(
    [
        "def summarize(records, threshold):",
        "    count = 0",
        "    skipped = 0",
        "    for record in records:",
        "        if record.value is None:",
        "            skipped += 1",
        "            continue",
        "        if record.value > threshold:",
        "            count += record.value",
        "            print(f\"record {record.name}: count is now {count}\")",
        "        elif record.value == threshold:",
        "            count += 1",
        "        else:",
        "            count -= record.penalty",
        "        if count < 0:",
        "            print(f\"count went negative at {record.name}\")",
        "            count = 0",
        "    average = count / max(len(records) - skipped, 1)",
        "    print(f\"final count = {count}, average = {average:.2f}, skipped = {skipped}\")",
        "    return {\"count\": count, \"average\": average, \"skipped\": skipped}",
    ]
)
EDIT_PROMPT = ("Rename the variable `count` to `running_total` everywhere in this function "
               "and return the whole function, nothing else:\n\n" + EDIT_BODY + "\n")
# The prompts of every line but the edit one: code, chat, and a short edit.
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a "
    "docstring.",
    "Explain in a few sentences why the sky is blue.",
    "Write a C function that reverses a singly linked list in place, and explain it.",
]
SAMPLING = ["--temperature", "0.7", "--top-p", "0.9", "--seed", "1"]


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


VERIFY_PROMPT = "Write a Python function that returns the n-th Fibonacci number iteratively."


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
    command and returns its JSON (the report passes its Runner's)."""
    result = run([dspec, "generate", "--target", model, "--prompt", VERIFY_PROMPT,
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
                      "--prompt", VERIFY_PROMPT, "--max-tokens", str(max_tokens),
                      "--no-chat-template", "--json", "--trace", trace.name, *extra])
        if result is None:
            return None, 0
        rounds = [json.loads(line) for line in open(trace.name) if line.strip()]
    # The first rounds pay one-off costs (kernel builds, plans): leave them out.
    times = [r["verify_ms"] for r in rounds[2:] if len(r["drafted"]) == width - 1]
    return (statistics.median(times) if times else None), len(times)


class Runner:
    """Runs the dspec processes of a report, numbered in order, and logs each command;
    `env` is added to every process's environment."""

    def __init__(self, env=None):
        self.runs = 0
        self.env = env

    def json(self, cmd, tries=2, timeout=900):
        """The JSON a command prints, or None. A process killed by a signal (an abort) is
        run once more, and the log says so: one crash should not empty every line that
        depends on it. One that runs past `timeout` seconds (a hang) is killed."""
        self.runs += 1
        print(f"+ [run {self.runs}] " + " ".join(cmd), file=sys.stderr, flush=True)
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                 env=None if self.env is None else {**os.environ, **self.env})
        except subprocess.TimeoutExpired:
            print(f"HUNG: killed after {timeout} s", file=sys.stderr)
            return None
        if out.stderr.strip():
            print(out.stderr.strip()[-1500:], file=sys.stderr)
        try:
            return json.loads(out.stdout)
        except json.JSONDecodeError:
            print(f"failed (exit {out.returncode})", file=sys.stderr)
            if out.returncode < 0 and tries > 1:
                print(f"CRASHED (signal {-out.returncode}); running it once more",
                      file=sys.stderr)
                return self.json(cmd, tries - 1, timeout)
            return None


def bench(args, runner, drafter, max_draft, extra, target=None):
    report = runner.json([args.dspec, "bench", "--target", target or args.target,
                          "--drafter", drafter, "--max-draft", max_draft,
                          "--max-tokens", str(args.max_tokens), "--json", *extra])
    return None if report is None else report["report"]


def generate_rate(args, runner, prompts, extra):
    """Decode tok/s over the prompts (total tokens over total time), one process each."""
    pairs = []
    for p in prompts:
        r = runner.json([args.dspec, "generate", "--target", args.target, "--prompt", p,
                         "--max-tokens", str(args.max_tokens), "--json", *extra])
        if r is not None:
            s = r["stats"]
            pairs.append((s["decode_tokens_per_second"], max(s["generated_tokens"] - 1, 0)))
    return aggregate(pairs) if pairs else None


def prompts_file(texts, directory=None):
    """A JSON-lines file of `texts` as `dspec bench --prompts` reads them: its path."""
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False, dir=directory) as f:
        for t in texts:
            f.write(json.dumps({"prompt": t}) + "\n")
        return f.name


def verify_kept(args, runner, widths):
    """Rounds queued ahead with every draft kept, per width: the plain answer to the first
    prompt replayed (`--drafter replay:`), one `dspec bench` process per width, its round
    costs from `--trace` against its own plain runs (kept_round_steps)."""
    target = args.kept_target or args.target
    answer = runner.json([args.dspec, "generate", "--target", target, "--prompt", PROMPTS[0],
                          "--max-tokens", str(args.max_tokens), "--json"])
    if answer is None:
        return None
    kept = {}
    with tempfile.TemporaryDirectory() as tmp:
        answer_file, trace = os.path.join(tmp, "answer.json"), os.path.join(tmp, "trace.jsonl")
        with open(answer_file, "w") as f:
            json.dump(answer, f)
        prompt = prompts_file([PROMPTS[0]], tmp)
        for w in widths:
            report = bench(args, runner, f"replay:{answer_file}", str(w - 1),
                           ["--prompts", prompt, "--verify-ahead", "always", "--passes",
                            str(args.kept_passes), "--prefill-runs", "0", "--trace", trace],
                           target)
            if report is None:
                continue
            whole, traced, per_pass = kept_round_steps(report, trace)
            kept[str(w)] = {"whole_steps": whole, "traced_steps": traced,
                            "traced_per_pass": per_pass, "speedup": report["speedup"],
                            "tau": report["tau"], "near_ties": report["near_ties"],
                            "real_mismatches": report["real_mismatches"]}
    return kept


class MlxLmPeer:
    def __init__(self, target, draft):
        os.environ.setdefault("MLX_CUDA_SDPA_CACHE_SIZE", "65536")
        import mlx.core as mx
        from mlx_lm import load, stream_generate
        from mlx_lm.sample_utils import make_sampler

        self.mx, self.stream_generate, self.make_sampler = mx, stream_generate, make_sampler
        self.model, self.tokenizer = load(mlx_lm_view(target))
        self.draft, _ = load(mlx_lm_view(draft))

    def rate(self, prompts, max_tokens, sampler, draft=None, num_draft=0):
        # Warm-up on the first prompt, not timed.
        mlx_lm_generate(self.stream_generate, self.model, self.tokenizer, prompts[0], 16,
                        sampler, draft, num_draft)
        pairs, taus = [], []
        for ids in prompts:
            tokens, tps, tau = mlx_lm_generate(self.stream_generate, self.model, self.tokenizer,
                                               ids, max_tokens, sampler, draft, num_draft)
            pairs.append((tps, max(len(tokens) - 1, 0)))
            if tau:
                taus.append(tau)
        return aggregate(pairs), (statistics.mean(taus) if taus else None)

    def prefill(self, ids, runs=3):
        """Warm prefill tok/s of `ids` and the first call's seconds, measured as dspec's
        is: up to the first generated token. As mlx-lm's generate_step reads a prompt: all
        but the last token in chunks of 2048 (only the cache evaluated), then the last
        token's step, whose logits give the first token."""
        from mlx_lm.models.cache import make_prompt_cache

        mx = self.mx
        head, last = ids[:-1], ids[-1:]
        times = []
        for _ in range(runs + 1):
            cache = make_prompt_cache(self.model)
            start = time.perf_counter()
            for i in range(0, len(head), 2048):
                self.model(mx.array(head[i:i + 2048])[None], cache=cache)
                mx.eval([c.state for c in cache])
            logits = self.model(mx.array(last)[None], cache=cache)
            mx.eval(mx.argmax(logits[:, -1, :], axis=-1), [c.state for c in cache])
            times.append(time.perf_counter() - start)
        return len(ids) / statistics.median(times[1:]), times[0]

    def quantize(self):
        import mlx.nn as nn

        nn.quantize(self.model, group_size=64, bits=4)
        self.mx.eval(self.model.parameters())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dspec")
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--write-edit-prompt", metavar="FILE")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--prefill-lengths", default="1024,4096,16384")
    ap.add_argument("--widths", default="2,4,8,16")
    ap.add_argument("--kept-passes", type=int, default=7)
    ap.add_argument("--kept-target", help="the model of the kept-drafts verify lines "
                    "(default: --target; for random weights, one written with "
                    "--residual-scale, of the same shapes)")
    ap.add_argument("--hbm-gbps", type=float, default=3350.0)
    ap.add_argument("--skip-mlx-lm", action="store_true")
    ap.add_argument("--skip-verify", action="store_true")
    ap.add_argument("--json-out")
    ap.add_argument("--kept-only", action="store_true",
                    help="only the lines of rounds queued ahead with every draft kept")
    ap.add_argument("--kernels", help="DSPEC_CUDA_KERNELS values to run the kept lines "
                    "with, comma-separated (default: dspec's own choice)")
    args = ap.parse_args()
    if args.write_edit_prompt:
        with open(args.write_edit_prompt, "w") as f:
            f.write(json.dumps({"prompt": EDIT_PROMPT}) + "\n")
        return
    if not (args.dspec and args.target and args.draft):
        ap.error("--dspec, --target and --draft are required")
    runner = Runner()
    rec = {"target": args.target, "draft": args.draft, "max_tokens": args.max_tokens}
    if args.kept_only:
        widths = [int(w) for w in args.widths.split(",")]
        for k in (args.kernels or "").split(",") if args.kernels else [None]:
            env = None if k is None else {"DSPEC_CUDA_KERNELS": k}
            rec[f"verify_kept_kernels_{k}"] = kept = verify_kept(args, Runner(env), widths)
            print_kept(f"DSPEC_CUDA_KERNELS={k}" if k is not None else "", kept)
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(rec, f, indent=1)
        return

    def save():
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(rec, f, indent=1)

    common, edit = prompts_file(PROMPTS), prompts_file([EDIT_PROMPT])
    dm = bench(args, runner, f"model:{args.draft}", "auto",
               ["--prompts", common, "--prefill-lengths", args.prefill_lengths])
    rec["draft_model_auto"] = dm
    save()
    # The sampled line rides on the n-gram bench, whose process has no draft thread.
    rec["ngram_auto"] = bench(args, runner, "ngram", "auto",
                              ["--prompts", common, "--prefill-runs", "0", *SAMPLING])
    rec["ngram_edit_auto"] = bench(args, runner, "ngram", "auto:16",
                                   ["--prompts", edit, "--prefill-runs", "0"])
    save()
    rec["generate_greedy"] = generate_rate(args, runner, PROMPTS, [])
    rec["generate_4bit"] = generate_rate(args, runner, PROMPTS, ["--quantize", "4"])
    save()
    if not args.skip_verify:
        widths = [int(w) for w in args.widths.split(",")]
        step, tps, _ = plain_step_ms(args.dspec, args.target, 128, [],
                                                      run=runner.json)
        verify = {"step_ms": step}
        for mode, ws in (("batched", widths), ("exact", [4])):
            for w in ws:
                ms, n = verify_ms(args.dspec, args.target, w, 96,
                                                  ["--verify", mode], run=runner.json)
                verify[f"{mode}:{w}"] = {"ms": ms, "steps": ms / step if ms and step else None}
        rec["verify"] = verify
        save()
        rec["verify_kept"] = verify_kept(args, runner, widths)
        save()

    peer = {}
    if not args.skip_mlx_lm and dm is not None:
        ids = [r["prompt_ids"] for r in dm["rows"]]
        m = MlxLmPeer(args.target, args.draft)
        greedy = m.make_sampler(temp=0.0)
        peer["greedy"], _ = m.rate(ids, args.max_tokens, greedy)
        peer["sampled"], _ = m.rate(ids, args.max_tokens, m.make_sampler(temp=0.7, top_p=0.9))
        peer["speculative_k4"], peer["speculative_k4_tau"] = m.rate(
            ids, args.max_tokens, greedy, m.draft, 4)
        prefill_rows = (dm.get("prefill") or {}).get("rows", [])
        peer["prefill"] = {}
        for row in prefill_rows:
            if row.get("prompt") is None:
                n = row["prompt_tokens"]
                synthetic = (sum(ids, []) * (n // max(len(sum(ids, [])), 1) + 1))[:n]
                peer["prefill"][str(n)] = m.prefill(synthetic)
        m.quantize()
        peer["greedy_4bit"], _ = m.rate(ids, args.max_tokens, greedy)
        rec["mlx_lm"] = peer
        save()

    limit = args.hbm_gbps * 1e9 / max(weight_bytes(args.target), 1)
    rec["physical_limit_tokens_per_second"] = limit
    save()
    print_table(rec, peer, limit)


def print_table(rec, peer, limit):
    def f(x):
        return f"{x:.1f}" if isinstance(x, (int, float)) else "-"

    dm, ng, edit = rec.get("draft_model_auto"), rec.get("ngram_auto"), rec.get("ngram_edit_auto")
    plain = dm["plain_tokens_per_second"] if dm else None
    sampled = (ng or {}).get("sampled") or {}
    sampled_tps = sampled.get("tokens_per_second")
    rows = [
        ("greedy (bench)", plain, peer.get("greedy"), ""),
        ("greedy (generate, one process per prompt)", rec.get("generate_greedy"), None, ""),
        ("sampled T=0.7 top-p 0.9 (bench)", sampled_tps, peer.get("sampled"),
         f"{sampled['over_greedy']:.2f}x greedy in the same passes"
         + (f", {sampled_tps / peer['sampled']:.2f}x mlx-lm" if peer.get("sampled") else "")
         if sampled_tps else ""),
        ("4-bit greedy", rec.get("generate_4bit"), peer.get("greedy_4bit"),
         f"{rec['generate_4bit'] / rec['generate_greedy']:.2f}x bf16"
         if rec.get("generate_4bit") and rec.get("generate_greedy") else ""),
        ("draft model, --max-draft auto", dm and dm["speculative_tokens_per_second"],
         peer.get("speculative_k4"),
         f"tau {dm['tau']:.2f}, {dm['speedup']:.2f}x plain; mlx-lm k=4" if dm else ""),
        ("n-gram, --max-draft auto", ng and ng["speculative_tokens_per_second"], None,
         f"tau {ng['tau']:.2f}, {ng['speedup']:.2f}x plain" if ng else ""),
        ("n-gram auto:16, long edit prompt", edit and edit["speculative_tokens_per_second"], None,
         f"tau {edit['tau']:.2f}, {edit['speedup']:.2f}x its plain "
         f"{edit['plain_tokens_per_second']:.1f}" if edit else ""),
    ]
    print(f"\ntarget {rec['target']}  draft {rec['draft']}  max tokens {rec['max_tokens']}")
    print(f"physical limit of plain decoding: {limit:.0f} tok/s (weights once per token)")
    print(f"{'line':<44} {'dspec':>8} {'mlx-lm':>8}  notes")
    for name, a, b, note in rows:
        print(f"{name:<44} {f(a):>8} {f(b):>8}  {note}")
    for report, name in ((dm, "draft model"), (ng, "n-gram"), (edit, "n-gram edit")):
        if report:
            print(f"{name}: near-ties {report.get('near_ties')}, real mismatches "
                  f"{report.get('real_mismatches')}")
    for row in ((dm or {}).get("prefill") or {}).get("rows", []):
        n = row["prompt_tokens"]
        theirs = peer.get("prefill", {}).get(str(n))
        print(f"prefill {n:>6} tokens: dspec {row['tokens_per_second']:.0f} tok/s warm "
              f"(first call {row['first_call_seconds']:.2f} s)"
              + (f", mlx-lm {theirs[0]:.0f} (first call {theirs[1]:.2f} s)" if theirs else ""))
    v = rec.get("verify")
    if v:
        cells = "  ".join(f"{k} {x['ms']:.2f} ms = {x['steps']:.2f} steps"
                          for k, x in v.items() if isinstance(x, dict) and x.get("ms"))
        print(f"verify, rounds read one by one (one decode step {v['step_ms']:.2f} ms): {cells}")
    print_kept("", rec.get("verify_kept"))


def print_kept(label, kept):
    if kept:
        cells = "  ".join(
            f"w {w}: {x['whole_steps']:.2f} whole / "
            + (f"{x['traced_steps']:.2f}" if x["traced_steps"] is not None else "-")
            + f" traced (tau {x['tau']:.2f}, {x['speedup']:.2f}x)"
            for w, x in kept.items() if x.get("whole_steps"))
        print(f"verify, rounds queued ahead with every draft kept, in plain steps of the same "
              f"process{', ' + label if label else ''}: {cells}")


if __name__ == "__main__":
    main()
