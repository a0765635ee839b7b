//! `dspec generate` as 2 and 3 ranks of an MLX ring group on 127.0.0.1, started the way
//! `mlx.launch` starts them (`MLX_RANK`, `MLX_HOSTFILE`), against the same command in
//! one process: the same tokens, plain, with n-gram and draft-model speculation, and
//! sampled with a seed. And the failures: a rank that dies or hangs mid-generation, a
//! group that never forms, a model whose heads do not split: every rank exits with an
//! error within a bound, none hangs. Then `dspec serve` in a group: rank 0 answers what
//! one process answers, the ranks stay in step through cancelled requests, stop together,
//! end together when one dies, and sleep while the server is idle.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::channel;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use dspec_engine::tiny_model::write_tiny_model;

/// A tiny llama whose heads split over 2 and 3 ranks (12 query heads over 6 KV heads,
/// 96 MLP units), with every bias a split layer can have: q/k/v and gate/up biases are
/// split with their outputs, o and down biases added once after the all-sum. A long
/// context, so a generation can run long enough to be interrupted.
const SPLITTABLE: &str = r#"{"hidden_size": 48, "num_attention_heads": 12, "num_key_value_heads": 6,
    "head_dim": 8, "intermediate_size": 96, "attention_bias": true, "mlp_bias": true,
    "max_position_embeddings": 8192}"#;

const PROMPT: &str = "Rename x to y: def f(x): return x + x * x";

fn dspec() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_dspec"));
    // The ranks' environment comes from the test alone.
    for var in [
        "MLX_RANK",
        "MLX_HOSTFILE",
        "MLX_WORLD_SIZE",
        "OMPI_COMM_WORLD_SIZE",
    ] {
        cmd.env_remove(var);
    }
    cmd
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("utf-8 temp path")
}

/// A finished process: exit code (`None`: killed), stdout, stderr, time to exit.
struct Finished {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    seconds: f64,
}

/// A rank whose stdout is read as it comes (to see a generation start).
struct Rank {
    child: Child,
    stdout_bytes: Arc<AtomicUsize>,
    stdout: std::thread::JoinHandle<String>,
}

/// `n` ranks of `dspec ARGS` in a ring on free ports of 127.0.0.1.
struct Group {
    _dir: tempfile::TempDir,
    ranks: Vec<Rank>,
    started: Instant,
    ports: Vec<u16>,
}

/// Ports the kernel just handed out, released for the ranks to bind (a port taken in
/// between fails the test loudly, not silently).
fn free_ports(n: usize) -> Vec<u16> {
    let listeners: Vec<std::net::TcpListener> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port"))
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().expect("address").port())
        .collect()
}

impl Group {
    /// Starts ranks `ranks` (all of `0..n` usually) of an `n`-rank group, told their
    /// rank and hostfile through MLX's environment, as `mlx.launch` does.
    fn start(n: usize, ranks: std::ops::Range<usize>, args: &[&str]) -> Group {
        Self::start_as(n, ranks, args, false)
    }

    /// [`Group::start`], with `by_flags`: through `--mlx-hostfile` and `--mlx-rank`.
    fn start_as(n: usize, ranks: std::ops::Range<usize>, args: &[&str], by_flags: bool) -> Group {
        let dir = tempfile::tempdir().expect("temp dir");
        let ports = free_ports(n);
        let hosts: Vec<Vec<String>> = ports
            .iter()
            .map(|p| vec![format!("127.0.0.1:{p}")])
            .collect();
        let hostfile = dir.path().join("hosts.json");
        std::fs::write(&hostfile, serde_json::to_string(&hosts).expect("json")).expect("hostfile");
        let ranks = ranks
            .map(|rank| {
                let mut cmd = dspec();
                cmd.args(args);
                match by_flags {
                    true => cmd
                        .arg("--mlx-hostfile")
                        .arg(&hostfile)
                        .args(["--mlx-rank", &rank.to_string()]),
                    false => cmd
                        .env("MLX_RANK", rank.to_string())
                        .env("MLX_HOSTFILE", &hostfile),
                };
                let mut child = cmd
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .expect("spawn a rank");
                let mut out = child.stdout.take().expect("stdout");
                let stdout_bytes = Arc::new(AtomicUsize::new(0));
                let counter = stdout_bytes.clone();
                let stdout = std::thread::spawn(move || {
                    let mut all = Vec::new();
                    let mut buf = [0u8; 256];
                    while let Ok(n) = out.read(&mut buf) {
                        if n == 0 {
                            break;
                        }
                        all.extend_from_slice(&buf[..n]);
                        counter.fetch_add(n, Ordering::SeqCst);
                    }
                    String::from_utf8_lossy(&all).into_owned()
                });
                Rank {
                    child,
                    stdout_bytes,
                    stdout,
                }
            })
            .collect();
        Group {
            _dir: dir,
            ranks,
            started: Instant::now(),
            ports,
        }
    }

    /// Waits until rank `i` has printed something (its generation is streaming).
    fn wait_for_output(&self, i: usize, limit: Duration) {
        while self.ranks[i].stdout_bytes.load(Ordering::SeqCst) == 0 {
            assert!(
                self.started.elapsed() < limit,
                "rank {i} printed nothing within {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn pid(&self, i: usize) -> i32 {
        self.ranks[i].child.id() as i32
    }

    /// Waits for rank `i` to exit (up to `limit` after the start), then ends the others.
    fn finish_after(mut self, i: usize, limit: Duration) -> Vec<Finished> {
        while self.started.elapsed() < limit {
            if self.ranks[i]
                .child
                .try_wait()
                .expect("poll a rank")
                .is_some()
            {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let waited = self.started.elapsed();
        self.finish(waited)
    }

    /// Waits for every rank up to `limit` after the start, killing those still running
    /// then (they report `code: None`).
    fn finish(self, limit: Duration) -> Vec<Finished> {
        let started = self.started;
        let mut ranks: Vec<Option<Rank>> = self.ranks.into_iter().map(Some).collect();
        let mut done: Vec<Option<Finished>> = ranks.iter().map(|_| None).collect();
        while done.iter().any(Option::is_none) {
            for (i, slot) in ranks.iter_mut().enumerate() {
                let Some(rank) = slot else { continue };
                let exited = rank.child.try_wait().expect("poll a rank").is_some();
                if exited || started.elapsed() > limit {
                    let mut rank = slot.take().expect("rank");
                    let _ = rank.child.kill();
                    let status = rank.child.wait().expect("wait");
                    let mut stderr = String::new();
                    if let Some(mut e) = rank.child.stderr.take() {
                        let _ = e.read_to_string(&mut stderr);
                    }
                    done[i] = Some(Finished {
                        code: status.code(),
                        stdout: rank.stdout.join().unwrap_or_default(),
                        stderr,
                        seconds: started.elapsed().as_secs_f64(),
                    });
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        done.into_iter().map(|d| d.expect("finished")).collect()
    }
}

/// The generated token ids of a `--json` run.
fn tokens(json_text: &str, who: &str) -> Vec<u64> {
    let json: serde_json::Value = serde_json::from_str(json_text)
        .unwrap_or_else(|e| panic!("{who}: not JSON ({e}): {json_text}"));
    json["tokens"]
        .as_array()
        .unwrap_or_else(|| panic!("{who}: no tokens in {json_text}"))
        .iter()
        .map(|t| t.as_u64().expect("a token id"))
        .collect()
}

fn generate_args<'a>(target: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "generate",
        "--target",
        target,
        "--prompt",
        PROMPT,
        "--max-tokens",
        "24",
        "--json",
        "--distributed-timeout",
        "60",
    ];
    args.extend_from_slice(extra);
    args
}

/// A target whose heads split over 2 and 3 ranks, a draft model, and the `--drafter`
/// argument naming it.
fn target_and_draft() -> (tempfile::TempDir, tempfile::TempDir, String) {
    let target = tempfile::tempdir().expect("temp dir");
    write_tiny_model(target.path(), SPLITTABLE, 5).expect("target");
    let draft = tempfile::tempdir().expect("temp dir");
    write_tiny_model(draft.path(), "{}", 9).expect("draft model");
    let draft_arg = format!("model:{}", path_str(draft.path()));
    (target, draft, draft_arg)
}

/// The tentpole: rank 0 of a 2- and a 3-rank group prints exactly the tokens one
/// process generates (f32 on the CPU), the other ranks print nothing, for plain greedy
/// decoding, n-gram and draft-model speculation, and seeded sampling with a draft model
/// (every rank draws with the same seed from logits that are the same bits on every rank).
#[test]
fn two_and_three_ranks_generate_what_one_process_does() {
    let (target, _draft, draft_arg) = target_and_draft();
    let modes: Vec<(&str, Vec<&str>)> = vec![
        ("plain greedy", vec![]),
        ("n-gram", vec!["--drafter", "ngram", "--max-draft", "4"]),
        (
            "draft model",
            vec!["--drafter", &draft_arg, "--max-draft", "3"],
        ),
        (
            "sampled, draft model",
            vec![
                "--drafter",
                &draft_arg,
                "--max-draft",
                "3",
                "--temperature",
                "0.9",
                "--seed",
                "11",
            ],
        ),
    ];
    let t = path_str(target.path());
    for (mode, extra) in &modes {
        let args = generate_args(t, extra);
        let alone = dspec().args(&args).output().expect("run dspec");
        assert!(
            alone.status.success(),
            "{mode}, one process: {}",
            String::from_utf8_lossy(&alone.stderr)
        );
        let want = tokens(&String::from_utf8_lossy(&alone.stdout), mode);
        assert_eq!(want.len(), 24, "{mode}: generate the whole budget");
        for n in [2, 3] {
            let results = Group::start(n, 0..n, &args).finish(Duration::from_secs(60));
            for (rank, r) in results.iter().enumerate() {
                assert_eq!(r.code, Some(0), "{mode}, rank {rank} of {n}:\n{}", r.stderr);
                if rank > 0 {
                    assert!(
                        r.stdout.is_empty(),
                        "{mode}: rank {rank} printed {}",
                        r.stdout
                    );
                }
            }
            let got = tokens(&results[0].stdout, mode);
            assert_eq!(got, want, "{mode}: {n} ranks against one process");
            let json: serde_json::Value = serde_json::from_str(&results[0].stdout).expect("json");
            assert_eq!(json["model"]["ranks"], n, "{mode}");
        }
    }
}

/// Ranks started by hand with `--mlx-hostfile` and `--mlx-rank` (no launcher, no MLX
/// environment) form the same group and generate the same tokens.
#[test]
fn ranks_started_with_flags_generate_what_one_process_does() {
    let target = tempfile::tempdir().expect("temp dir");
    write_tiny_model(target.path(), SPLITTABLE, 6).expect("target");
    let args = generate_args(path_str(target.path()), &["--drafter", "ngram"]);
    let alone = dspec().args(&args).output().expect("run dspec");
    assert!(
        alone.status.success(),
        "{}",
        String::from_utf8_lossy(&alone.stderr)
    );
    let want = tokens(&String::from_utf8_lossy(&alone.stdout), "one process");
    let results = Group::start_as(2, 0..2, &args, true).finish(Duration::from_secs(60));
    for (rank, r) in results.iter().enumerate() {
        assert_eq!(r.code, Some(0), "rank {rank}:\n{}", r.stderr);
    }
    assert_eq!(tokens(&results[0].stdout, "rank 0"), want);
}

/// A long greedy generation, to be interrupted once it streams.
fn long_generation(target: &str, timeout: &'static str) -> Vec<String> {
    [
        "generate",
        "--target",
        target,
        "--prompt",
        PROMPT,
        "--no-chat-template",
        "--max-tokens",
        "6000",
        "--distributed-timeout",
        timeout,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// Killing rank 1 of 3 while they generate: ranks 0 and 2 exit non-zero within seconds
/// (well inside the watchdog's timeout), saying which rank they are and which connection
/// was lost; none hangs.
#[test]
fn a_rank_that_dies_mid_generation_makes_the_others_exit_with_an_error() {
    let target = tempfile::tempdir().expect("temp dir");
    write_tiny_model(target.path(), SPLITTABLE, 5).expect("target");
    let args = long_generation(path_str(target.path()), "20");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let group = Group::start(3, 0..3, &args);
    group.wait_for_output(0, Duration::from_secs(60));
    // SAFETY: signals a child this test started and has not reaped.
    unsafe { libc::kill(group.pid(1), libc::SIGKILL) };
    let killed_at = group.started.elapsed().as_secs_f64();
    let results = group.finish(Duration::from_secs(90));
    // The first to notice names rank 1; the other may notice that one leaving first.
    assert!(
        [0, 2].iter().any(|&r| results[r]
            .stderr
            .contains("connection to rank 1 (127.0.0.1:")),
        "{}\n{}",
        results[0].stderr,
        results[2].stderr
    );
    for rank in [0, 2] {
        let r = &results[rank];
        assert_eq!(r.code, Some(1), "rank {rank} should fail:\n{}", r.stderr);
        assert!(
            r.seconds - killed_at < 10.0,
            "rank {rank} took {:.1} s after the kill",
            r.seconds - killed_at
        );
        assert!(
            r.stderr.contains(&format!("rank {rank} of 3")),
            "rank {rank} names itself: {}",
            r.stderr
        );
        assert!(
            r.stderr.contains("the connection to rank") && r.stderr.contains("was lost"),
            "rank {rank}: {}",
            r.stderr
        );
        assert!(!r.stderr.contains("panicked"), "{}", r.stderr);
    }
}

/// A rank that stops answering without dying (SIGSTOP: its TCP connections stay open, so
/// MLX's ring would wait forever): the watchdog ends the other rank within its timeout,
/// naming the rank and address it waits on.
#[test]
fn a_hung_rank_trips_the_watchdog() {
    let target = tempfile::tempdir().expect("temp dir");
    write_tiny_model(target.path(), SPLITTABLE, 5).expect("target");
    let args = long_generation(path_str(target.path()), "3");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let group = Group::start(2, 0..2, &args);
    group.wait_for_output(0, Duration::from_secs(60));
    let (stopped, port) = (group.pid(1), group.ports[1]);
    // SAFETY: signals a child this test started and has not reaped.
    unsafe { libc::kill(stopped, libc::SIGSTOP) };
    let stopped_at = group.started.elapsed().as_secs_f64();
    // Rank 1 stays stopped until rank 0 has exited, then it is killed.
    let results = group.finish_after(0, Duration::from_secs(60));
    let r = &results[0];
    assert_eq!(r.code, Some(1), "rank 0 should give up:\n{}", r.stderr);
    let waited = r.seconds - stopped_at;
    assert!((2.5..20.0).contains(&waited), "gave up after {waited:.1} s");
    assert!(
        r.stderr.contains("rank 0 of 2: no progress for 3 s")
            && r.stderr.contains(&format!("rank 1 (127.0.0.1:{port})")),
        "{}",
        r.stderr
    );
}

/// Rank 1 of 2 never starts: rank 0 gives up once the bound passes, saying so.
#[test]
fn a_group_that_never_forms_times_out() {
    let target = tempfile::tempdir().expect("temp dir");
    write_tiny_model(target.path(), SPLITTABLE, 5).expect("target");
    let t = path_str(target.path());
    let mut args = generate_args(t, &[]);
    *args.last_mut().expect("timeout value") = "2";
    let results = Group::start(2, 0..1, &args).finish(Duration::from_secs(30));
    let r = &results[0];
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    assert!(r.seconds < 15.0, "took {:.1} s", r.seconds);
    assert!(
        r.stderr
            .contains("rank 0 of 2: the ring group did not form within 2 s"),
        "{}",
        r.stderr
    );
}

/// What a group cannot run is refused on every rank before any tensor moves: heads that
/// do not divide by the group size (the standard tiny llama has 4 query and 2 KV heads),
/// and draft lengths chosen from each rank's own timings, by `generate` and `serve` alike.
#[test]
fn what_a_group_cannot_run_is_refused_with_the_fix() {
    let plain = tempfile::tempdir().expect("temp dir");
    write_tiny_model(plain.path(), "{}", 5).expect("target");
    let t = path_str(plain.path());
    let results = Group::start(3, 0..3, &generate_args(t, &[])).finish(Duration::from_secs(60));
    for (rank, r) in results.iter().enumerate() {
        assert_eq!(r.code, Some(1), "rank {rank}: {}", r.stderr);
        assert!(
            r.stderr.contains(&format!("rank {rank} of 3"))
                && r.stderr.contains("llama cannot be split over 3 ranks")
                && r.stderr.contains("num_attention_heads is 4")
                && r.stderr.contains("run it on 2 ranks instead"),
            "rank {rank}: {}",
            r.stderr
        );
    }
    let auto = ["--drafter", "ngram", "--max-draft", "auto"];
    let mut serve = vec!["serve", "--target", t, "--port", "0"];
    serve.extend_from_slice(&auto);
    for args in [generate_args(t, &auto), serve] {
        let results = Group::start(2, 0..2, &args).finish(Duration::from_secs(60));
        for (rank, r) in results.iter().enumerate() {
            assert_eq!(r.code, Some(1), "{}, rank {rank}: {}", args[0], r.stderr);
            assert!(
                r.stderr.contains(&format!("rank {rank} of 2"))
                    && r.stderr.contains("give a fixed --max-draft N"),
                "{}, rank {rank}: {}",
                args[0],
                r.stderr
            );
        }
    }
}

/// `dspec serve` alone, or as the ranks of a group on 127.0.0.1, each rank's stderr read
/// as it comes; rank 0's HTTP address taken from its "serving ... on http://" line. Every
/// process still running is killed when it drops.
struct Serving {
    _dir: tempfile::TempDir,
    ranks: Vec<Child>,
    logs: Vec<Arc<Mutex<Vec<String>>>>,
    addr: String,
    started: Instant,
    ports: Vec<u16>,
}

impl Serving {
    /// One process, outside any group, serving one request at a time as a group does.
    /// A batching process draws a sampled request's tokens from the same distribution but
    /// not the same draws: which drafts a step verifies follows the load and the step
    /// timings, and the draws follow the drafts.
    fn alone(args: &[&str]) -> Serving {
        let mut args = args.to_vec();
        args.extend(["--max-batch", "1"]);
        Self::launch(1, &args)
    }

    /// `n` ranks started as `mlx.launch` starts them.
    fn group(n: usize, args: &[&str]) -> Serving {
        Self::launch(n, args)
    }

    fn launch(n: usize, args: &[&str]) -> Serving {
        let dir = tempfile::tempdir().expect("temp dir");
        let ports = free_ports(n);
        let hosts: Vec<Vec<String>> = ports
            .iter()
            .map(|p| vec![format!("127.0.0.1:{p}")])
            .collect();
        let hostfile = dir.path().join("hosts.json");
        std::fs::write(&hostfile, serde_json::to_string(&hosts).expect("json")).expect("hostfile");
        let mut ranks = Vec::new();
        let mut logs = Vec::new();
        let (addr_tx, addr_rx) = channel();
        for rank in 0..n {
            let mut cmd = dspec();
            cmd.args(args);
            if n > 1 {
                cmd.env("MLX_RANK", rank.to_string())
                    .env("MLX_HOSTFILE", &hostfile);
            }
            let mut child = cmd
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn dspec serve");
            let stderr = child.stderr.take().expect("piped stderr");
            let log = Arc::new(Mutex::new(Vec::new()));
            let (lines, addr_tx) = (log.clone(), addr_tx.clone());
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    if let Some(at) = line.find("http://") {
                        let addr = line[at + 7..].split_whitespace().next().unwrap_or("");
                        let _ = addr_tx.send(addr.to_string());
                    }
                    lines.lock().expect("log").push(line);
                }
            });
            ranks.push(child);
            logs.push(log);
        }
        // Only the readers' copies left: a rank 0 that exits ends the wait.
        drop(addr_tx);
        let addr = addr_rx
            .recv_timeout(Duration::from_secs(120))
            .unwrap_or_else(|_| {
                let said: Vec<_> = logs.iter().map(|l| l.lock().map(|l| l.clone())).collect();
                panic!("no address from rank 0; the ranks said {said:?}")
            });
        Serving {
            _dir: dir,
            ranks,
            logs,
            addr,
            started: Instant::now(),
            ports,
        }
    }

    fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let url = format!("http://{}{path}", self.addr);
        let response = match ureq::post(&url).send_json(body.clone()) {
            Ok(r) => r,
            Err(ureq::Error::Status(_, r)) => r,
            Err(e) => panic!("{path}: {e}; rank 0 said {:?}", self.log(0)),
        };
        let status = response.status();
        (status, response.into_json().expect("a JSON body"))
    }

    /// A completion that must succeed: its text and its count of generated tokens.
    fn complete(&self, body: &Value) -> (String, u64, Value) {
        let (status, answer) = self.post("/v1/completions", body);
        assert_eq!(status, 200, "{answer}");
        let text = answer["choices"][0]["text"].as_str().expect("text");
        let tokens = answer["usage"]["completion_tokens"]
            .as_u64()
            .expect("usage");
        (text.to_string(), tokens, answer)
    }

    fn log(&self, rank: usize) -> Vec<String> {
        self.logs[rank].lock().expect("log").clone()
    }

    /// Waits until a line of rank `rank`'s stderr contains `text`; returns it.
    fn wait_for_log(&self, rank: usize, text: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(line) = self.log(rank).into_iter().find(|l| l.contains(text)) {
                return line;
            }
            assert!(
                Instant::now() < deadline,
                "rank {rank} never said {text:?}: {:?}",
                self.log(rank)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn pid(&self, rank: usize) -> i32 {
        self.ranks[rank].id() as i32
    }

    fn signal(&self, rank: usize, signal: i32) {
        // SAFETY: signals a child this test started and has not reaped.
        unsafe { libc::kill(self.pid(rank), signal) };
    }

    /// Waits up to `limit` for rank `rank` to exit: its exit code (`None`: by a signal)
    /// and when it exited, in seconds since the start; `None` if it is still running.
    fn exit_of(&mut self, rank: usize, limit: Duration) -> Option<(Option<i32>, f64)> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.ranks[rank].try_wait().expect("poll a rank") {
                return Some((status.code(), self.started.elapsed().as_secs_f64()));
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Seconds of CPU time rank `rank` has used (user and system, all its threads).
    fn cpu_seconds(&self, rank: usize) -> f64 {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid(rank)))
            .expect("the rank's /proc stat");
        // The fields after the command name (which may hold spaces) start at its ')'.
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .expect("stat format")
            .1
            .split_whitespace()
            .collect();
        let ticks: f64 =
            fields[11].parse::<f64>().expect("utime") + fields[12].parse::<f64>().expect("stime");
        // SAFETY: sysconf only reads a system constant.
        ticks / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64
    }

    /// Sends a streamed completion on a raw socket and reads until its first text.
    fn open_stream(&self, body: &Value) -> TcpStream {
        let mut socket = TcpStream::connect(&self.addr).expect("connect");
        let payload = body.to_string();
        write!(
            socket,
            "POST /v1/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{payload}",
            self.addr,
            payload.len()
        )
        .expect("send");
        socket
            .set_read_timeout(Some(Duration::from_secs(60)))
            .expect("timeout");
        let mut seen = Vec::new();
        let mut buf = [0u8; 512];
        while !String::from_utf8_lossy(&seen).contains("\"text\"") {
            let n = socket.read(&mut buf).expect("read the stream");
            assert!(n > 0, "stream ended: {}", String::from_utf8_lossy(&seen));
            seen.extend_from_slice(&buf[..n]);
        }
        socket
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        for child in &mut self.ranks {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn serve_args<'a>(target: &'a str, drafter: &'a str, timeout: &'a str) -> Vec<&'a str> {
    vec![
        "serve",
        "--target",
        target,
        "--drafter",
        drafter,
        "--max-draft",
        "4",
        "--port",
        "0",
        "--distributed-timeout",
        timeout,
    ]
}

fn completion(prompt: &str, max_tokens: u64, sampling: Value) -> Value {
    let mut body = json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0});
    for (k, v) in sampling.as_object().expect("object") {
        body[k] = v.clone();
    }
    body
}

/// Two ranks of `dspec serve` (and three, with n-gram drafts: a follower may then be woken
/// by another follower) answer what one process answers, text and token count, with
/// n-gram and draft-model speculation: greedy, then a prompt extending the first (the
/// prompt cache hits, on every rank, or the ranks' check before generating fails), then
/// sampled with a seed. A sampled request without a seed works too (rank 0 picks the seed
/// every rank draws with; ranks with seeds of their own would fall out of step, which the
/// next request would find).
#[test]
fn ranks_serve_what_one_process_serves() {
    let (target, _draft, draft_arg) = target_and_draft();
    let t = path_str(target.path());
    let extended = format!("{PROMPT} and rename f to g too");
    let requests = [
        completion(PROMPT, 16, json!({})),
        completion(&extended, 16, json!({})),
        completion(PROMPT, 16, json!({"temperature": 0.9, "seed": 11})),
    ];
    for (drafter, n) in [("ngram", 2), ("ngram", 3), (draft_arg.as_str(), 2)] {
        let args = serve_args(t, drafter, "30");
        let alone = Serving::alone(&args);
        let group = Serving::group(n, &args);
        for (i, request) in requests.iter().enumerate() {
            let (want, want_tokens, _) = alone.complete(request);
            let (got, tokens, answer) = group.complete(request);
            assert!(want_tokens > 0, "{drafter}, request {i}");
            assert_eq!(
                (&got, tokens),
                (&want, want_tokens),
                "{drafter}, request {i}: {n} ranks against one process"
            );
            if i == 1 {
                assert_eq!(answer["dspec"]["prompt_cache"]["hit"], true, "{answer}");
            }
        }
        let unseeded = completion(PROMPT, 16, json!({"temperature": 1.0}));
        assert!(group.complete(&unseeded).1 > 0, "{drafter}");
        let (again, _, _) = group.complete(&requests[0]);
        assert_eq!(again, alone.complete(&requests[0]).0, "{drafter}: in step");
        for rank in 1..n {
            let following = format!("rank {rank} of {n}: following rank 0");
            assert!(
                group.log(rank).iter().any(|l| l.contains(&following)),
                "{:?}",
                group.log(rank)
            );
        }
    }
}

/// A streamed request whose client leaves after its first text stops on every rank at
/// the same round: the next request is answered as before. A follower that went on
/// generating would take rank 0's next job for activations, and it would fail or hang.
#[test]
fn a_client_that_leaves_stops_the_generation_on_every_rank() {
    let target = tempfile::tempdir().expect("temp dir");
    write_tiny_model(target.path(), SPLITTABLE, 5).expect("target");
    let args = serve_args(path_str(target.path()), "ngram", "30");
    let group = Serving::group(2, &args);
    let short = completion(PROMPT, 16, json!({}));
    let (before, _, _) = group.complete(&short);
    let mut long = completion("tell me everything", 6000, json!({}));
    long["stream"] = json!(true);
    let socket = group.open_stream(&long);
    let health = ureq::get(&format!("http://{}/health", group.addr)).call();
    assert_eq!(
        health.map(|r| r.status()).ok(),
        Some(200),
        "rank 0 answers while the ranks generate"
    );
    drop(socket);
    let line = group.wait_for_log(0, "generation cancelled after");
    let generated: usize = line
        .split("after ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("a token count in {line:?}"));
    assert!(generated < 6000, "{line}");
    let (after, _, _) = group.complete(&short);
    assert_eq!(after, before, "the ranks stayed in step");
}

/// The exit of a rank that must end the others, with an error naming it and within a
/// bound, however it goes: killed while the group generates or while it is idle.
fn expect_exit_naming(group: &mut Serving, survivor: usize, lost: usize, since: f64) {
    let exited = group.exit_of(survivor, Duration::from_secs(30));
    let log = group.log(survivor).join("\n");
    let (code, at) = exited.unwrap_or_else(|| panic!("rank {survivor} still runs:\n{log}"));
    assert_eq!(code, Some(1), "rank {survivor}:\n{log}");
    assert!(
        at - since < 15.0,
        "rank {survivor} took {:.1} s",
        at - since
    );
    let port = group.ports[lost];
    assert!(
        log.contains(&format!("rank {survivor} of 2"))
            && log.contains(&format!("connection to rank {lost} (127.0.0.1:{port})")),
        "rank {survivor}:\n{log}"
    );
    assert!(!log.contains("panicked"), "{log}");
}

/// A follower killed while rank 0 serves a request, or while the server is idle, ends
/// rank 0 with an error naming it: no hang, no more answers from a broken group. Rank 0
/// killed makes the follower exit with an error naming rank 0.
#[test]
fn a_rank_that_dies_ends_the_server() {
    let target = tempfile::tempdir().expect("temp dir");
    write_tiny_model(target.path(), SPLITTABLE, 5).expect("target");
    let args = serve_args(path_str(target.path()), "ngram", "30");
    let short = completion(PROMPT, 8, json!({}));
    let mut long = completion("tell me everything", 6000, json!({}));
    long["stream"] = json!(true);

    let mut serving = Serving::group(2, &args);
    serving.complete(&short);
    let _stream = serving.open_stream(&long);
    serving.signal(1, libc::SIGKILL);
    let killed_at = serving.started.elapsed().as_secs_f64();
    expect_exit_naming(&mut serving, 0, 1, killed_at);

    let mut idle = Serving::group(2, &args);
    idle.complete(&short);
    idle.signal(1, libc::SIGKILL);
    let killed_at = idle.started.elapsed().as_secs_f64();
    expect_exit_naming(&mut idle, 0, 1, killed_at);

    let mut leaderless = Serving::group(2, &args);
    leaderless.complete(&short);
    leaderless.signal(0, libc::SIGKILL);
    let killed_at = leaderless.started.elapsed().as_secs_f64();
    expect_exit_naming(&mut leaderless, 1, 0, killed_at);
}

/// SIGTERM to rank 0 stops the server gracefully, and rank 0 tells the follower to stop;
/// so does Ctrl-C in a terminal, which interrupts every rank started there (the follower
/// leaves it to rank 0). Every rank exits 0.
#[test]
fn stopping_rank_0_stops_every_rank() {
    let target = tempfile::tempdir().expect("temp dir");
    write_tiny_model(target.path(), SPLITTABLE, 5).expect("target");
    let args = serve_args(path_str(target.path()), "ngram", "30");
    for (signal, ranks) in [(libc::SIGTERM, &[0][..]), (libc::SIGINT, &[0, 1])] {
        let mut group = Serving::group(2, &args);
        group.complete(&completion(PROMPT, 8, json!({})));
        for &rank in ranks {
            group.signal(rank, signal);
        }
        for rank in [0, 1] {
            let exited = group.exit_of(rank, Duration::from_secs(30));
            let log = group.log(rank).join("\n");
            assert_eq!(
                exited.map(|e| e.0),
                Some(Some(0)),
                "signal {signal}, rank {rank}:\n{log}"
            );
        }
        group.wait_for_log(1, "rank 1 of 2: rank 0 stopped serving");
    }
}

/// Idle between requests for longer than --distributed-timeout, the group is neither
/// ended by the watchdog (it times computing, not waiting for clients) nor kept busy: the
/// follower sleeps until rank 0 sends a job (MLX's ring, waited in, would keep a core
/// spinning the whole time). Then it serves the next request.
#[test]
fn an_idle_group_waits_without_a_timeout_or_a_busy_core() {
    let target = tempfile::tempdir().expect("temp dir");
    write_tiny_model(target.path(), SPLITTABLE, 5).expect("target");
    // Long enough for the ring to form (MLX retries a connection after 1 s, then 2 s).
    let args = serve_args(path_str(target.path()), "ngram", "4");
    let mut group = Serving::group(2, &args);
    let request = completion(PROMPT, 8, json!({}));
    let (first, _, _) = group.complete(&request);
    let idle = Duration::from_secs(7);
    let before = group.cpu_seconds(1);
    std::thread::sleep(idle);
    let used = group.cpu_seconds(1) - before;
    for rank in [0, 1] {
        assert!(
            group.exit_of(rank, Duration::ZERO).is_none(),
            "rank {rank} ended while idle: {:?}",
            group.log(rank)
        );
    }
    assert!(
        used < 0.2 * idle.as_secs_f64(),
        "the idle follower used {used:.2} s of CPU in {idle:?}"
    );
    assert_eq!(group.complete(&request).0, first);
}
