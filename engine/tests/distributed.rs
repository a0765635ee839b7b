//! `dspec generate` as 2 and 3 ranks of an MLX ring group on 127.0.0.1, started the way
//! `mlx.launch` starts them (`MLX_RANK`, `MLX_HOSTFILE`), against the same command in
//! one process: the same tokens, plain, with n-gram and draft-model speculation, and
//! sampled with a seed. And the failures: a rank that dies or hangs mid-generation, a
//! group that never forms, a model whose heads do not split: every rank exits with an
//! error within a bound, none hangs.

use std::io::Read;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

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

/// The tentpole: rank 0 of a 2- and a 3-rank group prints exactly the tokens one
/// process generates (f32 on the CPU), the other ranks print nothing, for plain greedy
/// decoding, n-gram and draft-model speculation, and seeded sampling with a draft model
/// (every rank draws with the same seed from logits that are the same bits on every rank).
#[test]
fn two_and_three_ranks_generate_what_one_process_does() {
    let target = tempfile::tempdir().expect("temp dir");
    write_tiny_model(target.path(), SPLITTABLE, 5).expect("target");
    let draft = tempfile::tempdir().expect("temp dir");
    write_tiny_model(draft.path(), "{}", 9).expect("draft model");
    let draft_arg = format!("model:{}", path_str(draft.path()));
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
/// and draft lengths chosen from each rank's own timings.
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
    let args = generate_args(t, &["--drafter", "ngram", "--max-draft", "auto"]);
    let results = Group::start(2, 0..2, &args).finish(Duration::from_secs(60));
    for (rank, r) in results.iter().enumerate() {
        assert_eq!(r.code, Some(1), "rank {rank}: {}", r.stderr);
        assert!(
            r.stderr.contains("give a fixed --max-draft N"),
            "{}",
            r.stderr
        );
    }
}
