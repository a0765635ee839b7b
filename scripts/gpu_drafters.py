#!/usr/bin/env python3
"""What a DFlash, a DSpark and a draft-model round cost in plain decoding steps, on a GPU.

Per target shape (Qwen3-4B, Qwen3-8B), in one invocation, with random weights (speed
depends on shapes, not values; the real checkpoints cannot reach the GPU machine):
  - writes the target, a DFlash drafter (5 layers, block 16) and a DSpark drafter (5
    layers, block 7, Markov rank 256, confidence head) of its shapes, and a
    Qwen3-0.6B-shaped draft model (all by scripts/random_weights.py);
  - runs `dspec bench --json` once per line, each its own process under a timeout:
    DFlash `--max-draft 15` (also with MLX's kernels only), DSpark `--max-draft 7` (bf16,
    its default on CUDA, and 4-bit with `--drafter-bits 4`), the draft model `--max-draft 4
    --draft-ahead off`;
  - runs one-shot `dspec generate --trace` with DFlash and DSpark: each round timed, the
    first ones apart (what a process pays once, which bench's warm-up hides);
  - takes each report's `round_cost` (medians over the rounds that drafted, against the
    plain step of the same process), tau and speedup;
  - times mlx-lm's plain greedy decoding of the same prompt ids, where mlx-lm imports.
Random drafts are almost never kept, so measured tau is about 1; the table gives, from
each line's round cost, the speedup a drafter that keeps more would give:
tau / (whole round in plain steps), at tau = 3, 5 and 6.5.

A mixture-of-experts shape (30b-a3b: Qwen3-30B-A3B; moe-tiny for a CPU check) runs lines
of its own (run_moe_shape). Its target is written straight in mlx-lm's 4-bit layout
(`random_weights.py --mlx-bits 4`: routers 8-bit, as mlx-lm's convert quantizes them; a
30B model built through transformers in bf16 would take far too long), with a twin whose
o_proj / down_proj are scaled by 1e-5 (`--scaled-twin`, sharing every other file) for the
kept-drafts lines. Each line its own `dspec bench --json` process:
  - n-gram `--max-draft auto` on the prompts: plain greedy tok/s and auto's speedup
    (lookups miss on random text, so it must stay at plain speed: at least 0.95x), and
    warm prefill at --prefill-lengths (1024, 4096);
  - verify cost by width with every draft kept: the twin's own `dspec generate --json`
    answer to the first prompt replayed (`--drafter replay:FILE`) at `--max-draft 1, 3, 7,
    15` (widths 2, 4, 8, 16; width 1 is the plain step), each report's round_cost in
    plain steps;
  - a DFlash drafter of the target's shape (5 layers, block 16), `--max-draft 15`;
  - mlx-lm's plain greedy decoding on the same checkpoint and prompt ids.
Its table adds dspec plain / mlx-lm, the auto speedup, verify in plain steps by width,
the DFlash round in plain steps and prefill tok/s; its physical limit counts the weights
a step reads (the top-k experts' share of the experts).

Writes $OUT/drafters-SHAPE.json (every report whole, the stderr tails, the table) and
$OUT/drafters-SHAPE.txt (the table) after every step, so a run cut short keeps what ran.

Usage: python3 scripts/gpu_drafters.py [--dspec /tmp/dspec] [--shapes 4b,8b|30b-a3b]
           [--out DIR] [--max-tokens 128] [--passes 3] [--timeout 300] [--skip-mlx-lm]
           [--mlx-lm-python PY] [--tokenizer DIR] [--models /tmp/models-drafters]
           [--lines dflash,dspark_4bit,...] [--no-first-rounds]
           [--prefill-lengths 1024,4096] [--prefill-runs 3] [--widths 2,4,8,16]
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from gpu_report import aggregate, mlx_lm_generate, mlx_lm_view, weight_bytes  # noqa: E402
import random_weights  # noqa: E402

SHAPES = {"4b": "qwen3-4b", "8b": "qwen3-8b", "30b-a3b": "qwen3-30b-a3b",
          "moe-tiny": "qwen3-moe-tiny"}
DISPLAY = {"qwen3-4b": "Qwen3-4B", "qwen3-8b": "Qwen3-8B", "qwen3-30b-a3b": "Qwen3-30B-A3B",
           "qwen3-moe-tiny": "Qwen3-MoE-tiny"}
# Mixture-of-experts targets are written straight in mlx-lm's 4-bit layout (a 30B model
# built in bf16 through transformers would take far too long), and measured by their own
# lines (run_moe_shape).
MOE_BITS = 4
# What the kept-drafts twin multiplies o_proj / down_proj by (as scripts/gpu-report.sh's
# scaled models): wide logit margins, so a replayed answer is the target's own in every row
# of a verify, as it is not at the near-ties of random weights in bf16.
KEPT_RESIDUAL_SCALE = "1e-5"
MOE_WIDTHS = (2, 4, 8, 16)
DRAFT_MODEL = "qwen3-0.6b"
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a "
    "docstring.",
    "Explain in a few sentences why the sky is blue.",
]
TAUS = (3.0, 5.0, 6.5)


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def prepared_config(args, name, work):
    """The shape's config.json with the Qwen3 tokenizer files beside it (from --tokenizer,
    as scripts/gpu-prepare.sh packs them), which random_weights.py copies into a model."""
    return random_weights.config_dir(name, args.tokenizer, os.path.join(work, "configs", name))


def write_model(out_dir, cmd, timings, key):
    """Runs a writer `cmd` into OUT.partial and renames it to `out_dir` when it succeeds,
    so a directory that exists is whole (reused on a warm machine)."""
    if os.path.exists(out_dir):
        timings[key] = "reused"
        return
    partial = out_dir + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    start = time.time()
    log("+ " + " ".join(cmd + [partial]))
    subprocess.run(cmd + [partial], check=True, stdout=sys.stderr)
    os.replace(partial, out_dir)
    timings[key] = round(time.time() - start, 1)


class Runs:
    """The dspec processes of a report: each killed past the timeout (exit 124, as
    timeout(1) reports it), its whole stderr appended to the log (this process's stderr),
    its exit code and seconds kept."""

    def __init__(self, args, work):
        self.args, self.work, self.count = args, work, 0

    def run(self, cmd, timeout=None, env=None):
        self.count += 1
        n = self.count
        timeout = timeout or self.args.timeout
        env = {**os.environ, **(env or {})}
        log(f"+ [run {n}] " + " ".join(cmd))
        start = time.time()
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
            code, stdout, stderr = out.returncode, out.stdout, out.stderr
        except subprocess.TimeoutExpired as e:
            code = 124
            stdout = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            stderr = (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
            log(f"HUNG: [run {n}] killed after {timeout} s")
        seconds = round(time.time() - start, 1)
        log(f"--- [run {n}] stderr (exit {code}, {seconds} s) ---")
        log(stderr.rstrip())
        rec = {"command": cmd, "exit": code, "seconds": seconds, "stderr_tail": stderr[-3000:]}
        if code == 124:
            rec["stall"] = True
        try:
            rec["output"] = json.loads(stdout)
        except json.JSONDecodeError:
            rec["output"] = None
            rec["stdout_tail"] = stdout[-2000:]
        return rec


def bench_lines(dflash, dspark, draft):
    """(key, label, drafter, max draft k, extra flags, environment) of each dspec line.
    `DSPEC_CUDA_KERNELS=0` turns dspec's CUDA kernels off, the drafter's and the
    verify's: MLX's own kernels only."""
    mlx_only = {"DSPEC_CUDA_KERNELS": "0"}
    return [
        ("dflash", "DFlash b16, k=15", dflash, 15, [], {}),
        ("dflash_mlx", "DFlash b16, k=15, MLX kernels only", dflash, 15, [], mlx_only),
        ("dspark_4bit", "DSpark b7, k=7, 4-bit", dspark, 7, ["--drafter-bits", "4"], {}),
        ("dspark_bf16", "DSpark b7, k=7, bf16", dspark, 7, ["--drafter-bits", "0"], {}),
        ("draft_model", "draft model 0.6B, k=4, ahead off", draft, 4, ["--draft-ahead", "off"],
         {}),
    ]


def allow_no_global_scale():
    """mlx-lm 0.32.2's quantized expert layer passes `global_scale=None` to mx.gather_qmm,
    a keyword mlx 0.32.2 (the release dspec builds on, whose wheel is carried) does not
    take: without this, mlx-lm fails on every quantized mixture-of-experts model. The
    keyword goes through only where it is set (nvfp4 checkpoints, which these are not)."""
    import mlx.core as mx

    gather_qmm = mx.gather_qmm

    def without_none(*args, global_scale=None, **kwargs):
        if global_scale is not None:
            kwargs["global_scale"] = global_scale
        return gather_qmm(*args, **kwargs)

    mx.gather_qmm = without_none


def mlx_lm_child(args):
    """Plain greedy decoding through mlx-lm, in a child process of its own so its GPU
    memory is given back before anything else runs: prints {tokens_per_second, ...}."""
    allow_no_global_scale()
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler

    with open(args.mlx_lm_child[1]) as f:
        prompts = json.load(f)
    model, tokenizer = load(mlx_lm_view(args.mlx_lm_child[0]))
    greedy = make_sampler(temp=0.0)
    # Warm-up on the first prompt, not timed (kernel builds, plans).
    mlx_lm_generate(stream_generate, model, tokenizer, prompts[0], 16, greedy)
    pairs = []
    for ids in prompts:
        tokens, tps, _ = mlx_lm_generate(stream_generate, model, tokenizer, ids,
                                         args.max_tokens, greedy)
        pairs.append((tps, max(len(tokens) - 1, 0)))
    print(json.dumps({"tokens_per_second": aggregate(pairs),
                      "per_prompt": [{"tokens_per_second": t, "decoded": n} for t, n in pairs]}))


def mlx_lm_greedy(args, runs, target, prompt_ids):
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False, dir=runs.work) as f:
        json.dump(prompt_ids, f)
    cmd = [args.mlx_lm_python or sys.executable, os.path.abspath(__file__),
           "--max-tokens", str(args.max_tokens), "--mlx-lm-child", target, f.name]
    env = {**os.environ, "MLX_CUDA_SDPA_CACHE_SIZE": "65536"}
    log("+ " + " ".join(cmd))
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env,
                             timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s"}
    log(out.stderr.rstrip()[-3000:])
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        return {"error": f"exit {out.returncode}", "stderr_tail": out.stderr[-2000:]}


def median_of(values):
    values = sorted(v for v in values if isinstance(v, (int, float)))
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def gpu_name():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return None


def fmt(x, spec=".2f", suffix=""):
    return f"{x:{spec}}{suffix}" if isinstance(x, (int, float)) else "-"


def table(rec):
    """The shape's table: per line its plain step, round parts in plain steps, measured
    tau and speedup, and tau / whole steps at the chosen taus."""
    lines = []
    limit = rec.get("physical_limit")
    head = rec.get("head") or (
        f"{rec['name']} shape, random weights; dspec bench --max-tokens {rec['max_tokens']} "
        f"--passes {rec['passes']} --prefill-runs 0, {len(PROMPTS)} prompts")
    lines.append(head + (f"; {rec['device']}" if rec.get("device") else ""))
    if limit:
        lines.append(f"physical limit of plain decoding: {limit['weight_gb']:.2f} GB of "
                     f"{limit.get('what', 'weights')} read per token / {limit['hbm_gbps']:.0f} "
                     f"GB/s = {limit['step_ms']:.2f} ms "
                     f"per step ({limit['tokens_per_second']:.0f} tok/s)")
    m = rec.get("mlx_lm_greedy") or {}
    if m.get("tokens_per_second"):
        lines.append(f"mlx-lm plain greedy: {1e3 / m['tokens_per_second']:.2f} ms per step "
                     f"({m['tokens_per_second']:.1f} tok/s)")
    elif m:
        lines.append(f"mlx-lm plain greedy: not measured ({m.get('skipped') or m.get('error')})")
    taus = "".join(f"{'at tau ' + format(t, 'g'):>11}" for t in TAUS)
    lines.append(f"{'line':<34}{'plain step':>11}{'drafting':>9}{'verify':>8}{'whole':>7}"
                 f"{'tau':>6}{'speedup':>9} |{taus}")
    lines.append(f"{'':<34}{'ms':>11}{'steps':>9}{'steps':>8}{'steps':>7}{'':>6}"
                 f"{'measured':>9} |")
    for key, label, *_ in rec["line_order"]:
        r = rec["lines"].get(key)
        if r is None:
            continue
        report = (r.get("output") or {}).get("report")
        if report is None:
            why = "hung" if r.get("stall") else f"exit {r['exit']}, no report"
            lines.append(f"{label:<34}  {why} (see the JSON's stderr_tail)")
            continue
        cost = report.get("round_cost") or {}
        steps = cost.get("in_plain_steps") or {}
        whole = steps.get("whole")
        cells = ""
        for t in TAUS:
            # A round commits at most k + 1 tokens.
            ok = whole and t <= report["max_draft"] + 1
            cells += f"{fmt(t / whole if ok else None, '.2f', 'x'):>11}"
        lines.append(f"{label:<34}{fmt(cost.get('plain_step_ms')):>11}"
                     f"{fmt(steps.get('draft')):>9}{fmt(steps.get('verify')):>8}"
                     f"{fmt(whole):>7}{fmt(report.get('tau')):>6}"
                     f"{fmt(report.get('speedup'), '.2f', 'x'):>9} |{cells}")
    lines.append("plain step: 1 / the plain passes' decode rate in that line's process; "
                 "drafting / verify / whole: medians over its rounds that drafted; "
                 "at tau T: T / whole steps ('-' where T > k + 1)")
    for key, first in (rec.get("first_rounds") or {}).items():
        rounds = "; ".join(f"draft {fmt(x['draft_ms'], '.1f')} + verify "
                           f"{fmt(x['verify_ms'], '.1f')} ms" for x in first["rounds"][:2])
        later = first.get("later_median") or {}
        lines.append(f"one-shot generate, {key}: decode "
                     f"{fmt(first.get('decode_tokens_per_second'), '.1f')} tok/s, prefill "
                     f"{fmt(first['prefill_seconds'], '.2f')} s; "
                     f"rounds 1-2: {rounds}; later rounds (median): draft "
                     f"{fmt(later.get('draft_ms'), '.2f')} + verify "
                     f"{fmt(later.get('verify_ms'), '.2f')} ms")
    if rec.get("kind") == "moe":
        lines.extend(moe_summary(rec))
    return "\n".join(lines)


def line_report(rec, key):
    return ((rec["lines"].get(key) or {}).get("output") or {}).get("report")


def moe_summary(rec):
    """A mixture-of-experts shape's own lines: dspec's plain greedy against mlx-lm's, the
    n-gram auto speedup (falling back to plain speed where lookups miss: at least 0.95x),
    verify cost by width with every draft kept, the DFlash round, prefill."""
    out = []
    ng = line_report(rec, "ngram_auto")
    m = rec.get("mlx_lm_greedy") or {}
    if ng:
        plain = ng["plain_tokens_per_second"]
        line = f"dspec plain greedy: {plain:.1f} tok/s ({1e3 / plain:.2f} ms per step)"
        if m.get("tokens_per_second"):
            line += (f"; mlx-lm {m['tokens_per_second']:.1f} tok/s; dspec / mlx-lm = "
                     f"{plain / m['tokens_per_second']:.2f}x")
        out.append(line)
        ok = "at least" if ng["speedup"] >= 0.95 else "BELOW"
        out.append(f"n-gram --max-draft auto: {ng['speedup']:.2f}x plain (tau {ng['tau']:.2f}, "
                   f"near-ties {ng.get('near_ties')}, real mismatches "
                   f"{ng.get('real_mismatches')}): {ok} 0.95x")
    cells = ["w1 1.00 (the plain step)"]
    for w in rec.get("widths", []):
        r = line_report(rec, f"replay_w{w}")
        if r is not None:
            steps = (r.get("round_cost") or {}).get("in_plain_steps") or {}
            cells.append(f"w{w} {fmt(steps.get('verify'))} (tau {r['tau']:.2f})")
    answer = rec.get("replay_answer") or {}
    if answer and not answer.get("tokens"):
        out.append(f"verify with every draft kept: no answer to replay (generate exit "
                   f"{answer.get('exit')}; see the JSON's replay_answer)")
    if len(cells) > 1:
        out.append("verify with every draft kept (replay, residual-scaled twin), in plain "
                   "steps of its own process: " + ", ".join(cells))
    d = line_report(rec, "dflash")
    if d:
        steps = (d.get("round_cost") or {}).get("in_plain_steps") or {}
        out.append(f"DFlash b16 k=15 round: {fmt(steps.get('whole'))} plain steps (drafting "
                   f"{fmt(steps.get('draft'))} + verify {fmt(steps.get('verify'))}): pays "
                   f"off from tau {fmt(steps.get('break_even_tau'))}")
    for row in ((ng or {}).get("prefill") or {}).get("rows", []):
        if row.get("prompt") is None:
            out.append(f"prefill {row['prompt_tokens']:>5} tokens: "
                       f"{row['tokens_per_second']:.0f} tok/s warm (first call "
                       f"{row['first_call_seconds']:.2f} s)")
    return out


def run_shape(args, shape, runs, work, device):
    name = SHAPES[shape]
    if random_weights.SHAPES[name]["model_type"] == "qwen3_moe":
        return run_moe_shape(args, shape, runs, work, device)
    root = args.models
    rec = {"shape": shape, "name": DISPLAY[name],
           "max_tokens": args.max_tokens, "passes": args.passes, "device": device,
           "lines": {}, "write_seconds": {}}
    json_path = os.path.join(args.out, f"drafters-{shape}.json")
    txt_path = os.path.join(args.out, f"drafters-{shape}.txt")

    def save():
        with open(json_path, "w") as f:
            json.dump(rec, f, indent=1)
        if rec.get("line_order"):
            with open(txt_path, "w") as f:
                f.write(table(rec) + "\n")

    cfg = prepared_config(args, name, work)
    draft_cfg = prepared_config(args, DRAFT_MODEL, work)
    target = os.path.join(root, name)
    dflash = os.path.join(root, f"{name}-dflash")
    dspark = os.path.join(root, f"{name}-dspark")
    draft = os.path.join(root, DRAFT_MODEL)
    py = sys.executable
    w = rec["write_seconds"]
    # random_weights.py takes its output directory last (write_model appends it).
    writer = os.path.join(HERE, "random_weights.py")
    write_model(target, [py, writer, cfg, "--seed", "0"], w, "target")
    for kind, out in (("dflash", dflash), ("dspark", dspark)):
        write_model(out, [py, writer, cfg, "--drafter", kind, "--layers",
                          str(args.drafter_layers), "--seed", "2"], w, kind)
    write_model(draft, [py, writer, draft_cfg, "--seed", "1"], w, "draft_model")
    wb = weight_bytes(target)
    step_s = wb / (args.hbm_gbps * 1e9)
    rec["physical_limit"] = {"weight_gb": wb / 1e9, "hbm_gbps": args.hbm_gbps,
                             "step_ms": step_s * 1e3, "tokens_per_second": 1 / step_s}
    rec["weight_gb"] = {k: weight_bytes(d) / 1e9 for k, d in
                        (("target", target), ("dflash", dflash), ("dspark", dspark),
                         ("draft_model", draft))}
    save()

    prompts = os.path.join(work, "prompts.txt")
    with open(prompts, "w") as f:
        f.write("\n".join(PROMPTS) + "\n")
    rec["line_order"] = [line for line in bench_lines(dflash, dspark, draft)
                         if not args.lines or line[0] in args.lines.split(",")]
    prompt_ids = None
    for key, label, drafter, k, extra, env in rec["line_order"]:
        cmd = [args.dspec, "bench", "--target", target, "--drafter", drafter,
               "--max-draft", str(k), "--max-tokens", str(args.max_tokens),
               "--passes", str(args.passes), "--prefill-runs", "0", "--prompts", prompts,
               "--json", *extra]
        r = runs.run(cmd, env=env)
        rec["lines"][key] = r
        report = (r.get("output") or {}).get("report")
        if report is not None:
            prompt_ids = prompt_ids or [row["prompt_ids"] for row in report["rows"]]
            rec["device"] = rec["device"] or r["output"].get("device")
            log(f"{label}: plain {report['plain_tokens_per_second']:.1f} tok/s, "
                f"tau {report['tau']:.2f}, speedup {report['speedup']:.2f}x, "
                f"round cost {json.dumps(report.get('round_cost'))}")
        save()

    # A one-shot generation's rounds, the first apart: what a process pays once (bench
    # warms up before it times).
    # One-shot generations, each round timed, the first ones apart: what a process pays
    # (bench repeats its prompts, so a build that plans per context length finds its
    # plans built in every pass after the first, as no one-shot generation does).
    rec["first_rounds"] = {}
    binaries = [("new", args.dspec)]
    if args.no_first_rounds:
        binaries = []
    for (build, binary), (kind, drafter, k) in [
        (b, d) for b in binaries for d in (("dflash", dflash, 15), ("dspark_4bit", dspark, 7))
    ]:
        key = f"{build}_{kind}"
        trace = os.path.join(runs.work, f"trace-{key}.jsonl")
        cmd = [binary, "generate", "--target", target, "--drafter", drafter,
               "--max-draft", str(k), "--max-tokens", "96", "--prompt", PROMPTS[0],
               "--trace", trace, "--json"]
        r = runs.run(cmd)
        rounds = []
        if os.path.exists(trace):
            with open(trace) as f:
                rounds = [json.loads(line) for line in f if line.strip()]
        out = r.get("output") or {}
        stats = out.get("stats") or {}
        rec["first_rounds"][key] = {
            "exit": r["exit"], "prefill_seconds": stats.get("prefill_seconds"),
            "decode_tokens_per_second": stats.get("decode_tokens_per_second"),
            "round_cost": (out.get("speculative") or {}).get("round_cost"),
            "rounds": [{k2: x.get(k2) for k2 in ("draft_ms", "verify_ms", "accepted")}
                       for x in rounds[:4]],
            "later_median": {k2: median_of([x[k2] for x in rounds[2:]])
                             for k2 in ("draft_ms", "verify_ms")} if len(rounds) > 2 else None,
        }
        log(f"first rounds {key}: {json.dumps(rec['first_rounds'][key])}")
        save()

    return finish_shape(args, runs, rec, target, prompt_ids, save)


def finish_shape(args, runs, rec, target, prompt_ids, save):
    """mlx-lm's plain greedy line on the prompt ids a dspec report gave, then the table."""
    if args.skip_mlx_lm:
        rec["mlx_lm_greedy"] = {"skipped": args.skip_mlx_lm_note}
    elif prompt_ids is None:
        rec["mlx_lm_greedy"] = {"skipped": "no dspec report gave the prompt ids"}
    else:
        rec["mlx_lm_greedy"] = mlx_lm_greedy(args, runs, target, prompt_ids)
    save()
    text = table(rec)
    print(text + "\n", flush=True)
    return rec


def active_weight_bytes(model_dir):
    """Bytes of weights one plain decode step of a mixture-of-experts model reads: every
    tensor, the experts' stacks (switch_mlp) at top-k / experts of their size, and the
    embedding table not at all where a separate lm_head does the output (one row is
    gathered)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    share = cfg["num_experts_per_tok"] / cfg["num_experts"]
    total = embed = 0.0
    head = False
    for name in os.listdir(model_dir):
        if not name.endswith(".safetensors"):
            continue
        header, _ = random_weights.read_header(os.path.join(model_dir, name))
        for tensor, info in header.items():
            if tensor == "__metadata__":
                continue
            start, end = info["data_offsets"]
            n = (end - start) * (share if ".switch_mlp." in tensor else 1)
            embed += n if tensor.startswith("model.embed_tokens.") else 0
            head = head or tensor.startswith("lm_head.")
            total += n
    return total - (embed if head else 0)


def moe_lines(args, target, kept, dflash, prompts, prompt0, answer):
    """(key, label, target, drafter, max draft, extra flags, prompts file) of each dspec
    bench line of a mixture-of-experts shape."""
    lines = [("ngram_auto", "n-gram, --max-draft auto (+ prefill)", target, "ngram", "auto",
              ["--prefill-runs", str(args.prefill_runs), "--prefill-lengths",
               args.prefill_lengths], prompts)]
    for w in args.widths:
        lines.append((f"replay_w{w}", f"replay, all kept, width {w}", kept, f"replay:{answer}",
                      str(w - 1), ["--prefill-runs", "0"], prompt0))
    lines.append(("dflash", "DFlash b16, k=15", target, dflash, "15", ["--prefill-runs", "0"],
                  prompts))
    if args.lines:
        keys = args.lines.split(",")
        lines = [x for x in lines if x[0] in keys or x[0].split("_w")[0] in keys]
    return lines


def run_moe_shape(args, shape, runs, work, device):
    """A mixture-of-experts target in mlx-lm's 4-bit layout: plain greedy and n-gram auto
    (with prefill at --prefill-lengths), verify cost by width with every draft kept (its
    own answer replayed on a residual-scaled twin of the target), a DFlash drafter's round,
    and mlx-lm's plain greedy on the same checkpoint and prompt ids."""
    name = SHAPES[shape]
    root = args.models
    rec = {"shape": shape, "name": DISPLAY[name], "kind": "moe", "max_tokens": args.max_tokens,
           "passes": args.passes, "device": device, "widths": list(args.widths),
           "lines": {}, "write_seconds": {}}
    rec["head"] = (f"{rec['name']} shape, random weights, mlx-lm {MOE_BITS}-bit layout (routers "
                   f"8-bit); dspec bench --max-tokens {args.max_tokens} --passes {args.passes}; "
                   f"n-gram and DFlash on {len(PROMPTS)} prompts, replay on the first")
    json_path = os.path.join(args.out, f"drafters-{shape}.json")
    txt_path = os.path.join(args.out, f"drafters-{shape}.txt")

    def save():
        with open(json_path, "w") as f:
            json.dump(rec, f, indent=1)
        if rec.get("line_order"):
            with open(txt_path, "w") as f:
                f.write(table(rec) + "\n")

    cfg = prepared_config(args, name, work)
    target = os.path.join(root, f"{name}-{MOE_BITS}bit")
    kept = f"{target}-kept"
    dflash = os.path.join(root, f"{name}-dflash")
    py, writer, w = sys.executable, os.path.join(HERE, "random_weights.py"), rec["write_seconds"]
    # Each writer takes its output directory last (write_model appends it).
    write_model(target, [py, writer, cfg, "--mlx-bits", str(MOE_BITS), "--seed", "0"], w,
                "target")
    write_model(kept, [py, writer, target, "--scaled-twin", "--residual-scale",
                       KEPT_RESIDUAL_SCALE], w, "kept_target")
    write_model(dflash, [py, writer, cfg, "--drafter", "dflash", "--layers",
                         str(args.drafter_layers), "--seed", "2"], w, "dflash")
    wb = active_weight_bytes(target)
    step_s = wb / (args.hbm_gbps * 1e9)
    rec["physical_limit"] = {"weight_gb": wb / 1e9, "hbm_gbps": args.hbm_gbps,
                             "step_ms": step_s * 1e3, "tokens_per_second": 1 / step_s,
                             "what": "active weights (top-k experts)"}
    rec["weight_gb"] = {"target": weight_bytes(target) / 1e9, "target_active": wb / 1e9,
                        "dflash": weight_bytes(dflash) / 1e9}
    save()

    prompts = os.path.join(work, "prompts.txt")
    with open(prompts, "w") as f:
        f.write("\n".join(PROMPTS) + "\n")
    prompt0 = os.path.join(work, "prompt0.txt")
    with open(prompt0, "w") as f:
        f.write(PROMPTS[0] + "\n")
    # The answer replayed: the kept twin's own greedy answer to the first prompt, through
    # the chat template as bench feeds it.
    answer = os.path.join(work, f"answer-{shape}.json")
    rec["line_order"] = moe_lines(args, target, kept, dflash, prompts, prompt0, answer)
    if any(x[0].startswith("replay_") for x in rec["line_order"]):
        r = runs.run([args.dspec, "generate", "--target", kept, "--prompt", PROMPTS[0],
                      "--max-tokens", str(args.max_tokens), "--json"])
        rec["replay_answer"] = {k: r.get(k) for k in ("command", "exit", "seconds")}
        if r.get("output"):
            with open(answer, "w") as f:
                json.dump(r["output"], f)
            rec["replay_answer"]["tokens"] = len(r["output"].get("tokens") or [])
        else:
            rec["replay_answer"]["stderr_tail"] = r.get("stderr_tail")
    save()
    prompt_ids = None
    for key, label, model, drafter, k, extra, prompt_file in rec["line_order"]:
        if drafter.startswith("replay:") and not os.path.exists(answer):
            continue
        cmd = [args.dspec, "bench", "--target", model, "--drafter", drafter, "--max-draft", k,
               "--max-tokens", str(args.max_tokens), "--passes", str(args.passes),
               "--prompts", prompt_file, "--json", *extra]
        r = runs.run(cmd)
        rec["lines"][key] = r
        report = (r.get("output") or {}).get("report")
        if report is not None:
            if prompt_file == prompts:
                prompt_ids = prompt_ids or [row["prompt_ids"] for row in report["rows"]]
            rec["device"] = rec["device"] or r["output"].get("device")
            log(f"{label}: plain {report['plain_tokens_per_second']:.1f} tok/s, "
                f"tau {report['tau']:.2f}, speedup {report['speedup']:.2f}x, "
                f"round cost {json.dumps(report.get('round_cost'))}")
        save()

    return finish_shape(args, runs, rec, target, prompt_ids, save)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dspec", default="/tmp/dspec")
    ap.add_argument("--shapes", default="4b,8b",
                    help=f"comma-separated: {', '.join(SHAPES)}")
    ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/gpu-drafters")
    ap.add_argument("--models", default="/tmp/models-drafters",
                    help="where the random models go (a whole one is reused)")
    ap.add_argument("--tokenizer", default=".gpu/bench/qwen3-tokenizer",
                    help="holds the Qwen3 tokenizer.json.xz and tokenizer_config.json")
    ap.add_argument("--lines", help="comma-separated keys of the bench lines to run "
                    "(default: all): dflash, dflash_mlx, dspark_4bit, dspark_bf16, draft_model; "
                    "for a mixture-of-experts shape ngram_auto, replay (every width) or "
                    "replay_wN, dflash")
    ap.add_argument("--no-first-rounds", action="store_true",
                    help="skip the one-shot generations that time each round")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--drafter-layers", type=int, default=5)
    ap.add_argument("--timeout", type=int, default=300,
                    help="seconds each dspec (and the mlx-lm) process may run")
    ap.add_argument("--hbm-gbps", type=float,
                    help="GPU memory bandwidth for the physical limit (default: 4800 on an "
                         "H200, else 3350, an H100 SXM's)")
    ap.add_argument("--prefill-lengths", default="1024,4096",
                    help="mixture-of-experts shapes: synthetic prefill lengths (n-gram line)")
    ap.add_argument("--prefill-runs", type=int, default=3,
                    help="mixture-of-experts shapes: warm prefills timed per length")
    ap.add_argument("--widths", default=",".join(map(str, MOE_WIDTHS)),
                    help="mixture-of-experts shapes: verify widths (max draft + 1) replayed")
    ap.add_argument("--mlx-lm-python", help="the Python that runs the mlx-lm child "
                    "(default: this one)")
    ap.add_argument("--skip-mlx-lm", action="store_true")
    ap.add_argument("--skip-mlx-lm-note", default="--skip-mlx-lm given")
    ap.add_argument("--mlx-lm-child", nargs=2, metavar=("TARGET", "PROMPT_IDS_JSON"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mlx_lm_child:
        mlx_lm_child(args)
        return
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    bad = [s for s in shapes if s not in SHAPES]
    if bad or not shapes:
        ap.error(f"--shapes: {bad or shapes} (choose from {', '.join(SHAPES)})")
    args.widths = [int(w) for w in args.widths.split(",") if w.strip()]
    if not args.skip_mlx_lm:
        check = subprocess.run([args.mlx_lm_python or sys.executable, "-c", "import mlx_lm"],
                               capture_output=True, text=True)
        if check.returncode != 0:
            args.skip_mlx_lm = True
            why = (check.stderr.strip().splitlines() or ["?"])[-1]
            args.skip_mlx_lm_note = f"mlx-lm does not import here ({why})"
            log(f"note: {args.skip_mlx_lm_note}; its line is skipped")
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.models, exist_ok=True)
    work = tempfile.mkdtemp(prefix="gpu-drafters-")
    runs = Runs(args, work)
    device = gpu_name()
    if args.hbm_gbps is None:
        # The device call may land on either card.
        args.hbm_gbps = 4800.0 if device and "H200" in device else 3350.0
    for shape in shapes:
        rec = run_shape(args, shape, runs, work, device)
        device = rec.get("device")


if __name__ == "__main__":
    main()
