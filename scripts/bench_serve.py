#!/usr/bin/env python3
"""Load benchmark of OpenAI-compatible chat servers: what many clients at once get.

For each server (one already running, --url; dspec serve, once per drafter of --drafter;
and mlx-lm's server; this script starts the last two one after the other, stopping each
before the next starts) and each concurrency N of --concurrency, N client threads each
send --requests-per-client streamed chat completions back to back (POST
/v1/chat/completions with "stream": true, greedy, --max-tokens, a fixed seed), after one
warm-up request per server. Each request opens its own connection (the first of each
client before the level's clock starts); from the request sent, it times the first token
(the first Server-Sent Events chunk with text) and the end of the stream, and takes the
completion tokens from the stream's `usage` (asked for with `stream_options:
{"include_usage": true}`; where a server sends none, the text chunks are counted instead
and the table says so). Per server and concurrency:
  - tok/s: every completion token of the level over the level's wall time (from all
    clients starting to the last answer's end);
  - per-user tok/s: the median over requests of tokens / (end - first token);
  - time to first token (TTFT), p50 and p99;
  - requests, and errors: an HTTP status other than 200, or a connection or stream that
    failed (shown, never fatal).
dspec serve is started with --queue-size of at least the highest concurrency, so that
requests wait for their turn rather than get 429, and with --max-batch when given.

--drafter takes a comma-separated list (default none,ngram): one dspec server per drafter,
labelled `dspec (DRAFTER)`, or `dspec (DRAFTER, batch N)` where --max-batch does not say
how many requests it decodes together (N is what the server reports: its default when
--max-batch is not given, 1 for a draft model). An unknown drafter is dspec
serve's own error, shown with its last lines. Ratio columns of aggregate tok/s at the same
concurrency: `speculation ×` for each drafter over `none` (plain decoding), when both were
measured; `/ mlx-lm` for each dspec server over mlx-lm's, when mlx-lm was measured; with
neither, the first of exactly two servers over the second.

Workloads (--workload): `chat`, a short writing request on a distinct topic per request;
`edit`, a code snippet of about 300 tokens per request (a different one each), to be given
back with one identifier renamed, so that most of the answer copies the prompt (where
n-gram lookup drafting pays). Each level sends prompts no earlier level sent, so a
server's prompt cache does not shorten their prefill.

--check-same-text: every level sends the same prompts instead, the lowest level (1) all
that the highest sends, and each prompt's greedy text must be the same at every level for
the same server: batching must not change outputs. Differences are listed (exit 1).

Prints a markdown table (rows: concurrency; columns per server, then the ratios). --json
FILE writes every request's numbers and text, the ratios, the prompts and the settings
(server command lines, drafters, the batch each dspec server reported, model directories,
workload, max tokens).

mlx-lm's server batches only requests without a seed (and without a draft model), so the
mlx-lm server started here gets none; at temperature 0 a seed changes nothing. Give
--seed none when --url is an mlx-lm server.

Usage: python3 scripts/bench_serve.py --url http://127.0.0.1:8080 [OPTIONS]
       python3 scripts/bench_serve.py --dspec BIN --target DIR [--drafter none,ngram]
           [--max-batch N] [--mlx-lm DIR [--mlx-lm-python PY] [--mlx-lm-args ARGS]]
           [OPTIONS] [-- MORE dspec serve ARGS]
OPTIONS: [--workload chat|edit] [--concurrency 1,4,8,16] [--requests-per-client 2]
         [--max-tokens 128] [--seed 0|none] [--model NAME] [--api-key KEY]
         [--check-same-text] [--json FILE] [--timeout 900] [--start-timeout 1800]
Exit status: 0; 1 when --check-same-text finds a difference or a started server died
while measured; 2 on bad arguments, or a server that does not start or fails its warm-up;
130 when interrupted (what was measured is still printed and written).
"""

import argparse
import collections
import datetime
import http.client
import json
import math
import os
import platform
import re
import shlex
import signal
import socket
import statistics
import string
import subprocess
import sys
import threading
import time
import urllib.parse

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MLX_LM_VENV_PYTHON = os.path.join(ROOT, "target", "mlx-lm-venv", "bin", "python")
# dspec serve prints the address it listens on (with --port 0, the port it got) in a line
# "[dspec] serving MODEL with drafter X on http://HOST:PORT (batch N, queue M)", N being
# how many requests it decodes together. The last " on http" of the line is taken, since
# MODEL and X are names a user chose; a line without the batch still gives the address.
LISTEN_LINE = re.compile(r"\[dspec\] serving .* on (https?://\S+)(?: \(batch (\d+)\b)?")
# dspec serve answers 429 beyond this many waiting requests unless told otherwise.
DSPEC_DEFAULT_QUEUE = 16
# Without --drafter: plain decoding, then n-gram lookup, to show what speculation gains.
DEFAULT_DRAFTERS = "none,ngram"
# dspec serve's range of --max-batch.
DSPEC_MAX_BATCH = 256
# The drafter that drafts nothing: plain decoding, the baseline of speculation.
NO_DRAFTER = "none"
# Heads the columns of a drafter's tok/s over plain decoding's.
SPECULATION = "speculation ×"


class UsageError(Exception):
    """Bad arguments, or a server that cannot be measured: one message, exit 2."""


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- prompts

CHAT_TOPICS = [
    "a lighthouse keeper who finds a message in a bottle", "a robot learning to paint",
    "the first day of spring in a mountain village", "a dragon afraid of heights",
    "a chess tournament in a small town", "a cat who runs a bakery",
    "a submarine crew that hears music from the deep", "a librarian who can enter books",
    "two rival street musicians", "a city where it never stops raining",
    "an astronaut growing tomatoes on Mars", "a detective who solves crimes by smell",
    "a lost umbrella travelling the world", "a night train across the desert",
    "a beekeeper and a storm", "a clockmaker who repairs time",
    "a kite that refuses to come down", "a fisherman who catches a star",
    "a garden that grows overnight", "a shy ghost in a busy hotel",
    "a mapmaker charting an island that moves", "a violin left on a park bench",
    "a snowman that wants to see summer", "a baker's race against the sunrise",
    "a village that forgot how to laugh", "a parrot that only tells the truth",
    "a bridge between two quarrelling towns", "a scientist who shrinks her lab",
    "a horse that wins an election", "a letter delivered fifty years late",
    "a pair of boots with a mind of their own", "the last bookshop on the moon",
]
CHAT_FORMS = [
    "Write a short story about {}.",
    "Write a poem about {}.",
    "Write the opening scene of a play about {}.",
    "Write a short news report about {}.",
    "Describe {} as a travel guide would.",
]

# Code for the edit workload: $Noun, $noun, $nouns and $limit vary per request, and the
# rename touches several lines, so the answer is mostly a copy of the prompt with edits.
EDIT_SNIPPETS = [
    ("Python", "the attribute `count`", "`size`", '''\
class ${Noun}Ledger:
    """Keeps $nouns by id and reports on them."""

    def __init__(self, limit=$limit):
        self.limit = limit
        self.items = {}
        self.count = 0

    def add(self, item_id, value):
        if item_id in self.items:
            raise KeyError(f"$noun {item_id} is already in the ledger")
        if self.count >= self.limit:
            raise OverflowError("the ledger is full")
        self.items[item_id] = value
        self.count += 1
        return self.count

    def total(self):
        total = 0
        for value in self.items.values():
            total += value
        return total

    def average(self):
        if self.count == 0:
            return 0.0
        return self.total() / self.count

    def largest(self, n=3):
        ranked = sorted(self.items.items(), key=lambda kv: kv[1], reverse=True)
        return [item_id for item_id, _ in ranked[:n]]

    def report(self):
        lines = [f"{len(self.items)} $nouns, limit {self.limit}"]
        for item_id in self.largest():
            lines.append(f"  {item_id}: {self.items[item_id]}")
        lines.append(f"average: {self.average():.2f}")
        return "\\n".join(lines)
'''),
    ("JavaScript", "the property `total`", "`totalSpent`", '''\
// Tracks $nouns and the time spent on each.
export class ${Noun}Tracker {
  constructor(limit = $limit) {
    this.limit = limit;
    this.entries = new Map();
    this.total = 0;
  }

  start(id, now) {
    if (this.entries.size >= this.limit) {
      throw new Error("too many $nouns in progress");
    }
    this.entries.set(id, { startedAt: now, spent: 0, done: false });
  }

  stop(id, now) {
    const entry = this.entries.get(id);
    if (!entry || entry.done) {
      throw new Error("unknown or finished $noun: " + id);
    }
    entry.spent += now - entry.startedAt;
    entry.done = true;
    this.total += entry.spent;
    return entry.spent;
  }

  busiest(n = 3) {
    return [...this.entries.entries()]
      .sort((a, b) => b[1].spent - a[1].spent)
      .slice(0, n)
      .map(([id]) => id);
  }

  summary() {
    const finished = [...this.entries.values()].filter((e) => e.done).length;
    const mean = finished === 0 ? 0 : this.total / finished;
    return {
      finished,
      open: this.entries.size - finished,
      total: this.total,
      mean: Math.round(mean * 100) / 100,
      busiest: this.busiest(),
    };
  }
}
'''),
    ("Rust", "the field `sum`", "`grand_total`", '''\
use std::collections::HashMap;

/// Counts $nouns per category and keeps the largest ones.
pub struct ${Noun}Stats {
    limit: usize,
    by_category: HashMap<String, Vec<u64>>,
    sum: u64,
}

impl ${Noun}Stats {
    pub fn new() -> Self {
        Self { limit: $limit, by_category: HashMap::new(), sum: 0 }
    }

    pub fn record(&mut self, category: &str, value: u64) -> Result<(), String> {
        let values = self.by_category.entry(category.to_string()).or_default();
        if values.len() >= self.limit {
            return Err(format!("category {category} already has {} $nouns", values.len()));
        }
        values.push(value);
        self.sum += value;
        Ok(())
    }

    pub fn mean(&self) -> f64 {
        let n: usize = self.by_category.values().map(Vec::len).sum();
        if n == 0 {
            return 0.0;
        }
        self.sum as f64 / n as f64
    }

    pub fn categories(&self) -> Vec<(String, u64)> {
        let mut totals: Vec<(String, u64)> = self
            .by_category
            .iter()
            .map(|(name, values)| (name.clone(), values.iter().sum()))
            .collect();
        totals.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        totals
    }
}
'''),
]
EDIT_NOUNS = [
    "order", "ticket", "sensor", "invoice", "parcel", "booking", "sample", "shipment",
    "request", "payment", "visitor", "vehicle", "patient", "student", "recipe", "device",
    "message", "flight", "account", "review", "task", "session", "container", "document",
    "sale", "player", "book", "job", "alert", "claim", "route", "reading",
]


def chat_prompt(n):
    """Prompt number n of the chat workload: a distinct one for every n."""
    topic = CHAT_TOPICS[n % len(CHAT_TOPICS)]
    form = CHAT_FORMS[(n // len(CHAT_TOPICS)) % len(CHAT_FORMS)]
    text = form.format(topic)
    take = n // (len(CHAT_TOPICS) * len(CHAT_FORMS))
    return text if take == 0 else f"{text} Make it version {take + 1}, unlike the others."


def edit_prompt(n):
    """Prompt number n of the edit workload: a snippet of its own (the noun and language
    vary, the limit is n's own) with a rename asked for."""
    noun = EDIT_NOUNS[n % len(EDIT_NOUNS)]
    language, old, new, template = EDIT_SNIPPETS[(n // len(EDIT_NOUNS)) % len(EDIT_SNIPPETS)]
    code = string.Template(template).substitute(
        Noun=noun.capitalize(), noun=noun, nouns=noun + "s", limit=10 + n)
    return (f"Rename {old} to {new} everywhere in this {language} code. Change nothing "
            f"else, and answer with the whole code in one code block and nothing else.\n\n"
            f"```\n{code}```")


PROMPTS = {"chat": chat_prompt, "edit": edit_prompt}


# ---------------------------------------------------------------------------- HTTP

class Endpoint:
    """A server's base address; paths such as /v1/chat/completions go under it."""

    def __init__(self, url, flag="--url"):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UsageError(f"{flag} {url}: give an http:// or https:// address, such as "
                             "http://127.0.0.1:8080")
        try:
            port = parts.port
        except ValueError:
            raise UsageError(f"{flag} {url}: the port is not a number from 0 to 65535") from None
        self.https = parts.scheme == "https"
        self.host = parts.hostname
        self.port = port or (443 if self.https else 80)
        # A base URL copied from an OpenAI client's settings ends in /v1, which the paths
        # here carry themselves.
        self.prefix = parts.path.rstrip("/").removesuffix("/v1")
        self.url = f"{parts.scheme}://{parts.netloc}{self.prefix}"

    def connect(self, timeout):
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=timeout)


# What a failed connection or stream raises: socket errors and timeouts (OSError), a
# malformed HTTP answer, or a chunk that is not JSON (ValueError).
REQUEST_ERRORS = (OSError, http.client.HTTPException, ValueError)


def describe(error, timeout=None):
    """A failed request's error in a few words."""
    if isinstance(error, ConnectionRefusedError):
        return "connection refused"
    if isinstance(error, TimeoutError):
        return f"nothing received for {timeout} s (--timeout)" if timeout else "timed out"
    return f"{type(error).__name__}: {error}"


def http_get(endpoint, path, timeout=10):
    """(status, body) of GET path; raises REQUEST_ERRORS when nothing answers."""
    conn = endpoint.connect(timeout)
    try:
        conn.request("GET", endpoint.prefix + path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode("utf-8", "replace")
    finally:
        conn.close()


def error_message(body):
    """The message of an OpenAI-style error body, or the body's start."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else str(body)
    try:
        err = json.loads(text)
    except ValueError:
        return text.strip()[:200]
    if isinstance(err, dict):
        inner = err.get("error", err.get("detail", err))
        if isinstance(inner, dict):
            inner = inner.get("message", inner)
        return str(inner)[:200]
    return text.strip()[:200]


def sse_data(resp):
    """The data of each Server-Sent Event of a response, as it arrives."""
    data = []
    while True:
        raw = resp.readline()
        if not raw:
            if data:
                yield "\n".join(data)
            return
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
            data = []
            continue
        field, _, value = line.partition(":")
        if field == "data":
            data.append(value[1:] if value.startswith(" ") else value)


def new_record(prompt):
    return {"prompt": prompt, "status": None, "error": None, "connect_s": None, "ttft_s": None,
            "seconds": None, "decode_s": None, "tokens": 0, "tokens_from": None,
            "finish_reason": None, "text": ""}


def read_stream(resp, rec, start):
    """Reads a chat completion stream into rec: text, first-token and end times, tokens."""
    pieces, chunks, first, usage, done = [], 0, None, None, False
    for data in sse_data(resp):
        if data.strip() == "[DONE]":
            done = True
            break
        event = json.loads(data)
        if not isinstance(event, dict):
            continue
        if event.get("error"):
            rec["error"] = f"error in the stream: {error_message(json.dumps(event))}"
            return
        for choice in event.get("choices") or []:
            text = (choice.get("delta") or {}).get("content") or ""
            if text:
                first = first or time.perf_counter()
                pieces.append(text)
                chunks += 1
            rec["finish_reason"] = choice.get("finish_reason") or rec["finish_reason"]
        if isinstance(event.get("usage"), dict):
            usage = event["usage"].get("completion_tokens", usage)
        if isinstance(event.get("dspec"), dict):
            rec["dspec"] = event["dspec"]
    end = time.perf_counter()
    rec["text"] = "".join(pieces)
    if not done:
        rec["error"] = "the stream ended before its `data: [DONE]`"
        return
    rec["tokens"], rec["tokens_from"] = (usage, "usage") if usage is not None else (chunks, "chunks")
    if first is not None:
        rec["ttft_s"] = first - start
        rec["decode_s"] = end - first
    rec["seconds"] = end - start


def drain(resp):
    """Reads what follows `data: [DONE]` (a chunked body's last chunk): closing with bytes
    unread would reset the connection, which a server may log as an error."""
    try:
        resp.read()
    except REQUEST_ERRORS:
        pass


def open_connection(endpoint, timeout):
    """A connected HTTP connection, and the seconds connecting took."""
    conn = endpoint.connect(timeout)
    began = time.perf_counter()
    conn.connect()
    return conn, time.perf_counter() - began


def chat_request(endpoint, body, headers, timeout, prompt, opened=None):
    """One streamed chat completion over a new connection (or `opened`), timed from the
    request sent, after connecting (timed apart). Never raises: a failure is the record's
    error."""
    rec = new_record(prompt)
    conn = None
    start = time.perf_counter()
    try:
        conn, rec["connect_s"] = opened or open_connection(endpoint, timeout)
        start = time.perf_counter()
        conn.request("POST", endpoint.prefix + "/v1/chat/completions", json.dumps(body), headers)
        resp = conn.getresponse()
        rec["status"] = resp.status
        if resp.status != 200:
            rec["error"] = f"HTTP {resp.status}: {error_message(resp.read())}"
        else:
            read_stream(resp, rec, start)
            drain(resp)
    except REQUEST_ERRORS as e:
        rec["error"] = describe(e, timeout)
    finally:
        if conn:
            conn.close()
    if rec["seconds"] is None:
        rec["seconds"] = time.perf_counter() - start
    return rec


# ---------------------------------------------------------------------------- servers

class Server:
    """A server to measure: its address and, when this script starts it, its process and
    the last lines it printed."""

    def __init__(self, name, kind, model_dir=None, send_seed=True, drafter=None,
                 drafter_label=None):
        self.name, self.kind, self.model_dir = name, kind, model_dir
        self.send_seed = send_seed
        # dspec serve's --drafter, its short name, and the batch it reported.
        self.drafter, self.drafter_label, self.batch = drafter, drafter_label, None
        self.command = None
        self.endpoint = None
        self.process = None
        self.output = collections.deque(maxlen=200)
        self.listening = threading.Event()

    def start(self, command, env=None, endpoint=None):
        """Starts command; endpoint None: the address is read from its output."""
        log("+ " + shlex.join(command))
        self.command, self.endpoint = command, endpoint
        try:
            self.process = subprocess.Popen(
                self.command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                # Its own session: Ctrl-C reaches this script alone, which stops the
                # server itself (and waits for it) rather than racing it.
                start_new_session=True)
        except OSError as e:
            raise UsageError(f"{self.name}: cannot run {self.command[0]}: {e.strerror}") from None
        threading.Thread(target=self._follow_output, daemon=True).start()

    def _follow_output(self):
        for raw in self.process.stdout:
            line = raw.decode("utf-8", "replace").rstrip()
            self.output.append(line)
            found = LISTEN_LINE.search(line)
            if self.endpoint is None and found:
                self.endpoint = Endpoint(found.group(1), self.name)
                self.batch = int(found.group(2)) if found.group(2) else None
                self.listening.set()
        self.listening.set()  # wakes a waiter when the process ends

    def exited(self):
        return self.process is not None and self.process.poll() is not None

    def exits_within(self, seconds):
        try:
            self.process.wait(seconds)
            return True
        except subprocess.TimeoutExpired:
            return False

    def last_lines(self, n=20):
        lines = list(self.output)[-n:]
        return "\n".join("    " + line for line in lines) if lines else "    (nothing)"

    def died(self, when):
        code = self.process.returncode
        how = f"was killed by signal {-code}" if code < 0 else f"exited (status {code})"
        return f"{self.name} {how} {when}; its last lines:\n{self.last_lines()}"

    def wait_ready(self, timeout):
        """Waits until the address is known and GET /health answers 200."""
        deadline = time.monotonic() + timeout
        if not self.listening.wait(timeout) or self.endpoint is None:
            if self.exits_within(5):
                raise UsageError(self.died("before it listened"))
            raise UsageError(f"{self.name} printed no address within {timeout} s "
                             f"(--start-timeout); its last lines:\n{self.last_lines()}")
        while True:
            if self.exited():
                raise UsageError(self.died("before /health answered"))
            try:
                if http_get(self.endpoint, "/health", timeout=5)[0] == 200:
                    return
            except REQUEST_ERRORS:
                pass
            if time.monotonic() > deadline:
                raise UsageError(f"{self.name}: GET {self.endpoint.url}/health did not answer "
                                 f"200 within {timeout} s (--start-timeout); its last "
                                 f"lines:\n{self.last_lines()}")
            time.sleep(0.5)

    def stop(self):
        if self.process is None or self.exited():
            return
        log(f"stopping {self.name}")
        # SIGTERM: dspec serve stops gracefully (requests in flight get 10 s); mlx-lm's
        # server just ends.
        self.process.terminate()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gives(serve_args, flag):
    """Whether the arguments for dspec serve set flag (as `FLAG V` or `FLAG=V`)."""
    return any(a == flag or a.startswith(flag + "=") for a in serve_args)


def dspec_command(args, drafter):
    cmd = [args.dspec, "serve", "--target", args.target, "--drafter", drafter,
           "--port", "0"]
    # Every client's request must wait its turn rather than get 429, however many the
    # server runs at once.
    if not gives(args.serve_args, "--queue-size"):
        cmd += ["--queue-size", str(max(DSPEC_DEFAULT_QUEUE, args.concurrency[-1]))]
    if args.max_batch is not None:
        cmd += ["--max-batch", str(args.max_batch)]
    return cmd + args.serve_args


def mlx_lm_command(args, port):
    return [args.mlx_lm_python, "-m", "mlx_lm.server", "--model", args.mlx_lm,
            "--host", "127.0.0.1", "--port", str(port)] + shlex.split(args.mlx_lm_args)


def openblas_env(dspec):
    """OPENBLAS_CORETYPE where dspec chose other OpenBLAS kernels for this CPU
    (scripts/openblas-coretype.sh), for mlx-lm's server: on a CPU both then compute with
    the same kernels. Nothing on a GPU machine, or when dspec says nothing."""
    try:
        out = subprocess.run(["bash", os.path.join(HERE, "openblas-coretype.sh"), dspec],
                             capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    found = re.search(r"export OPENBLAS_CORETYPE=(\w+)", out)
    return {"OPENBLAS_CORETYPE": found.group(1)} if found else {}


def start(server, args):
    """Starts a server of this script's and waits until it is ready."""
    if server.kind == "mlx-lm":
        port = free_port()
        env = openblas_env(args.dspec) if args.dspec else {}
        server.start(mlx_lm_command(args, port), env,
                     Endpoint(f"http://127.0.0.1:{port}", "--mlx-lm"))
        # mlx-lm's server answers /health at once; the warm-up request waits for the model.
        server.listening.set()
    else:
        server.start(dspec_command(args, server.drafter))
    server.wait_ready(args.start_timeout)
    if server.kind == "dspec":
        # Named before its levels are measured: results carry the name.
        server.name = dspec_name(server.drafter_label, server.batch, args.max_batch)
    log(f"{server.name} is listening on {server.endpoint.url}")


def check_url(server):
    """A running server given by --url must answer; /health is optional (not every
    OpenAI-compatible server has it)."""
    try:
        status, _ = http_get(server.endpoint, "/health")
    except REQUEST_ERRORS as e:
        raise UsageError(f"--url {server.endpoint.url}: nothing answers there "
                         f"({describe(e, 10)})") from None
    if status != 200:
        log(f"{server.name}: GET /health answered {status}; measuring anyway")


# ---------------------------------------------------------------------------- load

def request_body(args, server, prompt):
    body = {"messages": [{"role": "user", "content": prompt}],
            "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if args.model:
        body["model"] = args.model
    if server.send_seed and args.seed is not None:
        body["seed"] = args.seed
    return body


def request_headers(args):
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    return headers


def send(args, server, n, opened=None):
    prompt = PROMPTS[args.workload](n)
    return chat_request(server.endpoint, request_body(args, server, prompt),
                        request_headers(args), args.timeout, n, opened)


def level_plan(args):
    """(concurrency, requests per client, first prompt number) of each level. Client i
    sends prompts first + i * per_client onwards, so with the same first prompt every
    level sends a prefix of the same numbers."""
    plan, first = [], 0
    lowest, highest = args.concurrency[0], args.concurrency[-1]
    for c in args.concurrency:
        per_client = args.requests_per_client
        if args.check_same_text:
            if c == lowest:
                per_client *= math.ceil(highest / lowest)
            plan.append((c, per_client, 0))
        else:
            plan.append((c, per_client, first))
            first += c * per_client
    return plan


def warm_up_prompt(plan):
    """A prompt number no level sends."""
    return max(first + c * per_client for c, per_client, first in plan)


def warm_up(args, server, n):
    rec = send(args, server, n)
    if rec["error"]:
        extra = f"; its last lines:\n{server.last_lines()}" if server.process else ""
        raise UsageError(f"{server.name}: the warm-up request failed: {rec['error']}{extra}")
    log(f"{server.name}: warm-up: {rec['tokens']} tokens in {rec['seconds']:.2f} s")


def run_level(args, server, concurrency, per_client, first):
    """concurrency clients, each sending per_client requests back to back; the level's
    summary with every request's record."""
    records = [[] for _ in range(concurrency)]
    go = threading.Barrier(concurrency + 1)

    def client(i):
        # Connected before the clock starts: N connections opened at one instant overflow
        # a short listen backlog (Python's http.server, mlx-lm's, keeps 5), and the
        # dropped ones wait a second for TCP to try again.
        try:
            opened = open_connection(server.endpoint, args.timeout)
        except REQUEST_ERRORS:
            opened = None  # the request connects again, and fails there
        go.wait()
        for j in range(per_client):
            records[i].append(send(args, server, first + i * per_client + j,
                                   opened if j == 0 else None))

    threads = [threading.Thread(target=client, args=(i,), daemon=True)
               for i in range(concurrency)]
    for t in threads:
        t.start()
    go.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    flat = [r for per in records for r in per]
    return {"server": server.name, "concurrency": concurrency,
            "requests_per_client": per_client, "first_prompt": first,
            **summarize(flat, wall), "requests_detail": flat}


def percentile(values, q):
    """The q-th percentile, interpolated between the closest ranks (as numpy's default)."""
    s = sorted(values)
    if not s:
        return None
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(records, wall):
    ok = [r for r in records if r["error"] is None]
    tokens = sum(r["tokens"] for r in ok)
    per_user = [r["tokens"] / r["decode_s"] for r in ok if r["decode_s"]]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    return {
        "wall_s": wall,
        "requests": len(records),
        "errors": len(records) - len(ok),
        "error_kinds": dict(collections.Counter(r["error"] for r in records if r["error"])),
        "tokens": tokens,
        "tokens_from": sorted({r["tokens_from"] for r in ok}),
        "aggregate_tok_s": tokens / wall if wall > 0 else None,
        "per_user_tok_s_p50": statistics.median(per_user) if per_user else None,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
    }


def measure(args, server, plan, results):
    """The warm-up and every level on one server, appended to results as they finish.
    False when the server died on the way."""
    warm_up(args, server, warm_up_prompt(plan))
    for concurrency, per_client, first in plan:
        level = run_level(args, server, concurrency, per_client, first)
        results.append(level)
        log(f"{server.name}: concurrency {concurrency}: {level['requests']} requests, "
            f"{level['tokens']} tokens in {level['wall_s']:.1f} s, {level['errors']} errors")
        if server.exited():
            log(server.died(f"at concurrency {concurrency}") + "\nits remaining levels are skipped")
            return False
    return True


# ---------------------------------------------------------------------------- report

def fmt(x, spec=".1f"):
    return "–" if x is None else format(x, spec)


def fmt_ms(seconds):
    if seconds is None:
        return "–"
    ms = seconds * 1000
    return f"{ms:.1f}" if ms < 10 else f"{ms:.0f}"


def fmt_ratio(x):
    return "–" if x is None else f"{x:.2f}×"


def level_cells(level):
    if level is None:
        return ["–"] * 4
    mark = "*" if "chunks" in level["tokens_from"] else ""
    requests = str(level["requests"])
    if level["errors"]:
        requests += f" ({level['errors']} failed)"
    return [fmt(level["aggregate_tok_s"]) + mark, fmt(level["per_user_tok_s_p50"]) + mark,
            f"{fmt_ms(level['ttft_p50_s'])} / {fmt_ms(level['ttft_p99_s'])}", requests]


def ratio_columns(servers):
    """(header, server, over server) of each ratio column: each drafter's speed-up over
    plain decoding, each dspec server against mlx-lm's; with neither, the first of
    exactly two servers over the second."""
    dspec = [s for s in servers if s.kind == "dspec"]
    plain = [s for s in dspec if s.drafter == NO_DRAFTER]
    columns = [(f"{SPECULATION} {s.drafter_label}", s.name, plain[0].name)
               for s in dspec if plain and s.drafter != NO_DRAFTER]
    columns += [(f"{s.name} / mlx-lm", s.name, mlx.name)
                for mlx in servers if mlx.kind == "mlx-lm" for s in dspec]
    if not columns and len(servers) == 2:
        columns.append((f"tok/s {servers[0].name} / {servers[1].name}",
                        servers[0].name, servers[1].name))
    return columns


def ratio(by, concurrency, top, bottom):
    """top's aggregate tok/s over bottom's at one concurrency; None where either has none."""
    a, b = by.get((top, concurrency)), by.get((bottom, concurrency))
    if not (a and b and a["aggregate_tok_s"] and b["aggregate_tok_s"]):
        return None
    return a["aggregate_tok_s"] / b["aggregate_tok_s"]


def levels_by_server(results):
    return {(r["server"], r["concurrency"]): r for r in results}


def measured(servers, results):
    """The servers with a level measured: one that never started (its error is shown
    apart) gets no columns."""
    names = {r["server"] for r in results}
    return [s for s in servers if s.name in names]


def ratios(args, servers, results):
    """Every ratio column's values, for --json."""
    by = levels_by_server(results)
    servers = measured(servers, results)
    return [{"column": header, "server": top, "over": bottom,
             "aggregate_tok_s_ratio": [{"concurrency": c, "ratio": ratio(by, c, top, bottom)}
                                       for c in args.concurrency]}
            for header, top, bottom in ratio_columns(servers)]


def table_title(args):
    return (f"Workload {args.workload}, greedy, max tokens {args.max_tokens}, "
            f"{args.requests_per_client} requests per client"
            + (f", dspec --max-batch {args.max_batch}" if args.max_batch else "")
            + (", same prompts at every level" if args.check_same_text else "") + ".")


def table_notes(columns, results):
    lines = ["tok/s: every completion token of a level over its wall time; per user: "
             "median over requests of tokens / (end - first token); TTFT: from the request "
             "sent to its first token."]
    if columns:
        note = "Ratios: of aggregate tok/s at the same concurrency."
        if any(title.startswith(SPECULATION) for title, _, _ in columns):
            note += f" {SPECULATION}: a drafter's over plain decoding's (--drafter {NO_DRAFTER})."
        lines.append(note)
    if any("chunks" in r["tokens_from"] for r in results):
        lines.append("*: tokens counted as streamed text chunks (the server sent no usage).")
    return lines


def markdown_table(args, servers, results):
    by = levels_by_server(results)
    servers = measured(servers, results)
    names = [s.name for s in servers]
    columns = ratio_columns(servers)
    header = ["concurrency"]
    for name in names:
        header += [f"{name} tok/s", "per user tok/s", "TTFT p50 / p99 ms", "requests"]
    header += [title for title, _, _ in columns]
    lines = [table_title(args), "",
             "| " + " | ".join(header) + " |",
             "|" + "---:|" * len(header)]
    for c in args.concurrency:
        row = [str(c)]
        for name in names:
            row += level_cells(by.get((name, c)))
        row += [fmt_ratio(ratio(by, c, top, bottom)) for _, top, bottom in columns]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines + [""] + table_notes(columns, results))


def error_lines(results):
    lines = []
    for r in results:
        for kind, count in list(r["error_kinds"].items())[:3]:
            lines.append(f"- {r['server']}, concurrency {r['concurrency']}: {count} of "
                         f"{r['requests']} failed: {kind}")
    return lines


def connect_lines(results, slow=0.2):
    """Connections that took long to open: requests that did wait, outside their TTFT."""
    lines = []
    for r in results:
        waits = [rec["connect_s"] for rec in r["requests_detail"]
                 if rec["connect_s"] is not None and rec["connect_s"] > slow]
        if waits:
            lines.append(f"- {r['server']}, concurrency {r['concurrency']}: {len(waits)} "
                         f"connections took over {slow} s to open (at most {max(waits):.1f} s)")
    if lines:
        lines.insert(0, "Slow connections (their wait counts in tok/s, not in TTFT; a server "
                        "with a short listen backlog drops connections opened at once):")
    return lines


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def text_differences(results):
    """Each prompt's text at every level against its text at the lowest level that
    answered it, per server: (how many compared, the differences)."""
    compared, differences = 0, []
    reference = {}  # (server, prompt) -> (concurrency, text)
    for level in sorted(results, key=lambda r: r["concurrency"]):
        for rec in level["requests_detail"]:
            if rec["error"]:
                continue
            key = (level["server"], rec["prompt"])
            if key not in reference:
                reference[key] = (level["concurrency"], rec["text"])
                continue
            compared += 1
            ref_c, ref_text = reference[key]
            if rec["text"] != ref_text:
                at = first_difference(ref_text, rec["text"])
                differences.append({
                    "server": level["server"], "prompt": rec["prompt"],
                    "concurrency": level["concurrency"], "reference_concurrency": ref_c,
                    "at_char": at, "reference": ref_text[max(0, at - 20):at + 40],
                    "text": rec["text"][max(0, at - 20):at + 40]})
    return compared, differences


def same_text_lines(compared, differences):
    if not differences:
        return [f"Same text: {compared} answers matched the same prompt's answer at the "
                "lowest concurrency."]
    lines = [f"Different text: {len(differences)} of {compared} answers differ from the same "
             "prompt's answer at the lowest concurrency:"]
    shown = 20
    for d in differences[:shown]:
        lines.append(f"- {d['server']}, prompt {d['prompt']}: concurrency {d['concurrency']} "
                     f"against {d['reference_concurrency']}, from character {d['at_char']}: "
                     f"{d['reference']!r} vs {d['text']!r}")
    if len(differences) > shown:
        lines.append(f"- and {len(differences) - shown} more (--json has them all)")
    return lines


def settings(args, servers, plan):
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "workload": args.workload, "max_tokens": args.max_tokens, "temperature": 0,
        "seed": args.seed, "model": args.model, "concurrency": args.concurrency,
        "drafters": args.drafter, "max_batch": args.max_batch,
        "requests_per_client": args.requests_per_client,
        "check_same_text": args.check_same_text,
        "levels": [{"concurrency": c, "requests_per_client": k, "first_prompt": f}
                   for c, k, f in plan],
        "servers": [{"name": s.name, "url": s.endpoint.url if s.endpoint else None,
                     "command": s.command, "model_dir": s.model_dir,
                     "drafter": s.drafter, "batch": s.batch,
                     "sends_seed": s.send_seed, "output_tail": list(s.output)[-50:]}
                    for s in servers],
    }


def write_json(path, args, servers, plan, results, differences):
    used = sorted({rec["prompt"] for r in results for rec in r["requests_detail"]})
    doc = {"settings": settings(args, servers, plan), "results": results,
           "ratios": ratios(args, servers, results),
           "prompts": {n: PROMPTS[args.workload](n) for n in used}}
    if args.check_same_text:
        doc["same_text"] = {"compared": differences[0], "differences": differences[1]}
    try:
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
    except OSError as e:
        log(f"--json {path}: cannot write it: {e.strerror}")
        return False
    log(f"wrote {path}")
    return True


# ---------------------------------------------------------------------------- arguments

def concurrency_list(text):
    try:
        levels = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        levels = []
    if not levels or levels[0] < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give positive whole numbers separated by commas, such as 1,4,8,16")
    return levels


def positive(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of at least 1")
    return value


def drafter_list(text):
    drafters = [d.strip() for d in text.split(",")]
    if not all(drafters):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give drafters separated by commas, such as none,ngram")
    twice = next((d for i, d in enumerate(drafters) if d in drafters[:i]), None)
    if twice:
        raise argparse.ArgumentTypeError(f"{text!r}: {twice} is listed twice")
    return drafters


def batch_size(text):
    value = positive(text)
    if value > DSPEC_MAX_BATCH:
        raise argparse.ArgumentTypeError(f"{text!r}: dspec serve takes 1 to {DSPEC_MAX_BATCH}")
    return value


def seed(text):
    if text == "none":
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number from 0 to 2^64 - 1, "
                                         "or none")
    return value


def parser():
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        usage="%(prog)s (--url URL | --dspec BIN --target DIR | --mlx-lm DIR) [options] "
              "[-- more dspec serve args]",
        epilog="Arguments after -- go to dspec serve.")
    ap.add_argument("--url", action="append", default=[],
                    help="a server already running (may be given more than once)")
    ap.add_argument("--dspec", metavar="BIN", help="start BIN serve (e.g. target/release/dspec)")
    ap.add_argument("--target", metavar="DIR", help="the model dspec serves")
    ap.add_argument("--drafter", type=drafter_list, metavar="LIST",
                    help="dspec serve's --drafter, comma-separated: one server for each, "
                         f"one after another (default {DEFAULT_DRAFTERS})")
    ap.add_argument("--max-batch", type=batch_size, metavar="N",
                    help=f"dspec serve's --max-batch, 1 to {DSPEC_MAX_BATCH} (not passed when "
                         "not given: each server's default, shown in its label)")
    ap.add_argument("--mlx-lm", metavar="DIR", help="also start mlx-lm's server on this model")
    ap.add_argument("--mlx-lm-python", metavar="PY",
                    help="the Python with mlx-lm (default: target/mlx-lm-venv/bin/python "
                         "if it exists, else python3)")
    ap.add_argument("--mlx-lm-args", default="", metavar="ARGS",
                    help="more arguments for mlx_lm.server, in one string")
    ap.add_argument("--workload", choices=sorted(PROMPTS), default="chat",
                    help="chat: short writing requests; edit: renames in code snippets "
                         "(default chat)")
    ap.add_argument("--concurrency", type=concurrency_list, default=concurrency_list("1,4,8,16"),
                    metavar="LIST", help="client counts, comma-separated (default 1,4,8,16)")
    ap.add_argument("--requests-per-client", type=positive, default=2, metavar="N",
                    help="requests each client sends back to back (default 2)")
    ap.add_argument("--max-tokens", type=positive, default=128, metavar="N",
                    help="max_tokens of every request (default 128)")
    ap.add_argument("--seed", type=seed, default=0, metavar="N|none",
                    help="the requests' seed, or none (default 0; never sent to the "
                         "mlx-lm server started here)")
    ap.add_argument("--model", metavar="NAME", help="the `model` field of the requests (default: none sent)")
    ap.add_argument("--api-key", default=os.environ.get("DSPEC_API_KEY"), metavar="KEY",
                    help="sent as Authorization: Bearer KEY (default: $DSPEC_API_KEY)")
    ap.add_argument("--check-same-text", action="store_true",
                    help="the same prompts at every level; each prompt's text must not change")
    ap.add_argument("--json", metavar="FILE", help="write every number and the settings here")
    ap.add_argument("--timeout", type=positive, default=900, metavar="SECONDS",
                    help="seconds a request may wait for its next bytes (default 900)")
    ap.add_argument("--start-timeout", type=positive, default=1800, metavar="SECONDS",
                    help="seconds a started server has to load and listen (default 1800)")
    return ap


def parse_args(argv):
    ap = parser()
    serve_args = []
    if "--" in argv:
        at = argv.index("--")
        argv, serve_args = argv[:at], argv[at + 1:]
    args = ap.parse_args(argv)
    args.serve_args = serve_args
    if not (args.url or args.dspec or args.mlx_lm):
        ap.error("nothing to measure: give --url URL, or --dspec BIN --target DIR "
                 "(and/or --mlx-lm DIR)")
    if args.dspec:
        if not args.target:
            ap.error("--dspec needs --target DIR (the model dspec serve loads)")
        if not (os.path.isfile(args.dspec) and os.access(args.dspec, os.X_OK)):
            ap.error(f"--dspec {args.dspec}: no executable there (a release build is "
                     "target/release/dspec)")
        args.drafter = args.drafter or drafter_list(DEFAULT_DRAFTERS)
        # One server per drafter, with --max-batch in its label: dspec serve must not get
        # them twice.
        for flag in ("--drafter", "--max-batch"):
            if gives(serve_args, flag):
                ap.error(f"{flag}: give it before --, as this script's option")
    else:
        for flag, given in (("--target", args.target), ("--drafter", args.drafter),
                            ("--max-batch", args.max_batch),
                            ("-- (arguments for dspec serve)", serve_args)):
            if given:
                ap.error(f"{flag}: only with --dspec BIN")
    if args.mlx_lm:
        args.mlx_lm_python = args.mlx_lm_python or (
            MLX_LM_VENV_PYTHON if os.path.exists(MLX_LM_VENV_PYTHON) else "python3")
        try:
            shlex.split(args.mlx_lm_args)
        except ValueError as e:
            ap.error(f"--mlx-lm-args: {e}")
    elif args.mlx_lm_python or args.mlx_lm_args:
        ap.error("--mlx-lm-python and --mlx-lm-args go with --mlx-lm DIR")
    if args.json and not os.access(os.path.dirname(os.path.abspath(args.json)), os.W_OK):
        ap.error(f"--json {args.json}: its directory does not exist or is not writable")
    if args.check_same_text and len(args.concurrency) < 2:
        ap.error("--check-same-text compares levels: give --concurrency at least two, "
                 "such as 1,16")
    if args.check_same_text and args.concurrency[0] != 1:
        log(f"note: the lowest level is {args.concurrency[0]} clients, so texts are compared "
            "against batched ones; add 1 to --concurrency to compare against one at a time")
    return args


def check_mlx_lm(args):
    """mlx-lm must import in its Python before anything is measured."""
    py = args.mlx_lm_python
    try:
        out = subprocess.run([py, "-c", "import mlx_lm"], capture_output=True, text=True,
                             timeout=300)
    except OSError as e:
        raise UsageError(f"--mlx-lm-python {py}: cannot run it: {e.strerror}") from None
    except subprocess.TimeoutExpired:
        raise UsageError(f"--mlx-lm-python {py}: `import mlx_lm` did not finish in 300 s") from None
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no message"])[-1]
        raise UsageError(f"--mlx-lm-python {py}: cannot import mlx_lm ({last}); give a "
                         "Python with mlx-lm (scripts/bench-vs-mlx-lm.sh makes "
                         "target/mlx-lm-venv)")


# ---------------------------------------------------------------------------- main

def planned_servers(args):
    servers = []
    for url in args.url:
        server = Server(urllib.parse.urlsplit(url).netloc or url, "url")
        server.endpoint = Endpoint(url)
        servers.append(server)
    if args.dspec:
        for drafter, label in zip(args.drafter, drafter_labels(args.drafter)):
            servers.append(Server(dspec_name(label), "dspec", model_dir=args.target,
                                  drafter=drafter, drafter_label=label))
    if args.mlx_lm:
        # mlx-lm batches only requests without a seed (mlx_lm/server.py, _is_batchable).
        servers.append(Server("mlx-lm", "mlx-lm", model_dir=args.mlx_lm, send_seed=False))
    names = [s.name for s in servers]
    if len(set(names)) != len(names):
        raise UsageError(f"--url: the same server twice ({', '.join(names)})")
    return servers


def drafter_labels(drafters):
    """Each drafter's name in the table: a path by its last part, unless two drafters
    would then read the same."""
    short = [d.rstrip("/").rsplit("/", 1)[-1] for d in drafters]
    return [s if short.count(s) == 1 else d for s, d in zip(short, drafters)]


def dspec_name(label, batch=None, max_batch=None):
    """A dspec server's column label: its drafter, and the batch it reported where
    --max-batch does not say it (not given, or a drafter that runs requests one at a
    time)."""
    if batch is None or batch == max_batch:
        return f"dspec ({label})"
    return f"dspec ({label}, batch {batch})"


def run(args, servers, plan, results):
    """Measures each server in turn, a started one stopped before the next starts (so two
    models never share the machine). The exit status."""
    status = 0
    for server in servers:
        try:
            if server.kind == "url":
                check_url(server)
            else:
                start(server, args)
            if not measure(args, server, plan, results):
                status = 1
        finally:
            server.stop()
    return status


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    # A plain `kill` ends the run the way Ctrl-C does: servers stopped, results kept.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    plan = level_plan(args)
    results, servers, status = [], [], 0
    try:
        servers = planned_servers(args)
        if args.mlx_lm:
            check_mlx_lm(args)
        status = run(args, servers, plan, results)
    except UsageError as e:
        log(f"bench_serve: {e}")
        status = 2
    except KeyboardInterrupt:
        log("interrupted")
        status = 130
    finally:
        for server in servers:
            server.stop()
    if not results:
        return status
    print(markdown_table(args, servers, results))
    lines = error_lines(results)
    if lines:
        print("\nErrors:\n" + "\n".join(lines))
    lines = connect_lines(results)
    if lines:
        print("\n" + "\n".join(lines))
    differences = (0, [])
    if args.check_same_text:
        differences = text_differences(results)
        print("\n" + "\n".join(same_text_lines(*differences)))
        if differences[1] and status == 0:
            status = 1
    if args.json and not write_json(args.json, args, servers, plan, results, differences):
        status = status or 2
    return status


if __name__ == "__main__":
    sys.exit(main())
