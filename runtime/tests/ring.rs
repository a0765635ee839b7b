//! MLX's ring backend through dspec's [`Group`] on 127.0.0.1: this test binary starts
//! copies of itself as the ranks (the way `mlx.launch` would, through `MLX_RANK` and
//! `MLX_HOSTFILE`), and each rank checks the collectives against values it computes
//! alone; a rank that dies makes its peers fail with MLX's error, not hang.

use std::io::Write;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use mlx_rs::{Array, Dtype};

use dspec_runtime::distributed::{init, Group};

/// Set in a child: which scenario the rank runs.
const ROLE: &str = "DSPEC_RING_TEST_ROLE";

/// Free ports on 127.0.0.1, one per rank (the listener is dropped before MLX binds
/// the port again: a port another process takes in between fails the test loudly).
fn free_ports(n: usize) -> Vec<u16> {
    let listeners: Vec<std::net::TcpListener> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port"))
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().expect("address").port())
        .collect()
}

/// Starts `n` ranks of this test binary running `test` with `role`.
fn spawn_ranks(n: usize, test: &str, role: &str) -> (tempfile::TempDir, Vec<Child>) {
    let dir = tempfile::tempdir().expect("temp dir");
    let hosts: Vec<Vec<String>> = free_ports(n)
        .into_iter()
        .map(|p| vec![format!("127.0.0.1:{p}")])
        .collect();
    let hostfile = dir.path().join("hosts.json");
    let mut f = std::fs::File::create(&hostfile).expect("hostfile");
    f.write_all(serde_json::to_string(&hosts).expect("json").as_bytes())
        .expect("write hostfile");
    let children = (0..n)
        .map(|rank| {
            Command::new(std::env::current_exe().expect("test binary"))
                .args([test, "--exact", "--nocapture", "--test-threads=1"])
                .env(ROLE, role)
                .env("MLX_RANK", rank.to_string())
                .env("MLX_HOSTFILE", &hostfile)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn a rank")
        })
        .collect();
    (dir, children)
}

/// Waits for every child up to `limit`, killing those still running then.
fn wait_all(children: Vec<Child>, limit: Duration) -> Vec<(Option<i32>, String)> {
    let start = Instant::now();
    let mut children: Vec<Option<Child>> = children.into_iter().map(Some).collect();
    let mut results = vec![None; children.len()];
    while results.iter().any(Option::is_none) {
        for (i, slot) in children.iter_mut().enumerate() {
            if let Some(child) = slot {
                if child.try_wait().expect("poll child").is_some() || start.elapsed() > limit {
                    let _ = child.kill();
                    let out = slot
                        .take()
                        .expect("child")
                        .wait_with_output()
                        .expect("output");
                    let text = String::from_utf8_lossy(&out.stdout).into_owned()
                        + &String::from_utf8_lossy(&out.stderr);
                    results[i] = Some((out.status.code(), text));
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    results.into_iter().map(|r| r.expect("result")).collect()
}

fn role() -> Option<String> {
    std::env::var(ROLE).ok()
}

fn join() -> Group {
    let group = init("ring", true).expect("join the ring");
    eprintln!("rank {} of {}", group.rank(), group.size());
    group
}

/// The collectives tensor parallelism uses, checked on every rank.
fn run_collectives(group: &Group) {
    let (rank, size) = (group.rank(), group.size());
    // Sizes below and above the group size (MLX's ring pads the small ones), f32 and int.
    for n in [1, 2, 7, 4096 + 3] {
        let x: Vec<f32> = (0..n).map(|i| (rank * 1000 + i) as f32 * 0.5).collect();
        let summed = group
            .all_sum(&Array::from_slice(&x, &[n]))
            .expect("all_sum");
        let expected: Vec<f32> = (0..n)
            .map(|i| (0..size).map(|r| (r * 1000 + i) as f32 * 0.5).sum())
            .collect();
        assert_eq!(
            summed.as_slice::<f32>(),
            expected.as_slice(),
            "all_sum of {n}"
        );
    }
    let ids = Array::from_slice(&[rank as u32 + 10, 7], &[1, 2]);
    let gathered = group.all_gather(&ids).expect("all_gather");
    assert_eq!(gathered.shape(), &[size, 2]);
    let want: Vec<u32> = (0..size).flat_map(|r| [r as u32 + 10, 7]).collect();
    assert_eq!(gathered.as_slice::<u32>(), want.as_slice());
    let root = group
        .broadcast_from_root(&Array::from_slice(&[rank as u32 + 41], &[1]))
        .expect("broadcast");
    assert_eq!(root.as_slice::<u32>(), &[41]);
    // Rank 0's message reaches every rank whatever the others pass, whether it is
    // empty, shorter than the group (MLX's ring pads those) or long.
    let long: Vec<u8> = (0..100_003u32).map(|i| (i * 7 % 251) as u8).collect();
    for message in [&b""[..], &b"a"[..], br#"{"job": [1, 2, 3]}"#, &long] {
        let own = match rank {
            0 => message.to_vec(),
            _ => vec![0xff; rank as usize * 5],
        };
        let got = group.broadcast_bytes(&own).expect("broadcast_bytes");
        assert_eq!(got.len(), message.len());
        assert!(got == message, "rank {rank} got another message");
    }
    // One rank's flag is every rank's answer.
    assert!(group.any(rank == size - 1).expect("any"));
    assert!(!group.any(false).expect("any"));
    // Around the ring: each rank sends to its right neighbour and receives from its left.
    let right = (rank + 1) % size;
    let left = (rank + size - 1) % size;
    let sent = group
        .send(&Array::from_slice(&[rank as f32; 3], &[3]), right)
        .expect("send");
    let got = group.recv(&[3], Dtype::Float32, left).expect("recv");
    // One at a time: evaluated together, MLX may run the receive first on both ranks,
    // and each would wait for the other's send.
    sent.eval().expect("send");
    got.eval().expect("recv");
    assert_eq!(got.as_slice::<f32>(), &[left as f32; 3]);
    group.barrier().expect("barrier");
}

#[test]
fn ring_collectives_on_two_and_three_local_ranks() {
    if role().as_deref() == Some("collectives") {
        run_collectives(&join());
        return;
    }
    if role().is_some() {
        return;
    }
    for n in [2, 3] {
        let (_dir, children) = spawn_ranks(
            n,
            "ring_collectives_on_two_and_three_local_ranks",
            "collectives",
        );
        for (rank, (code, out)) in wait_all(children, Duration::from_secs(60))
            .into_iter()
            .enumerate()
        {
            assert_eq!(code, Some(0), "rank {rank} of {n}:\n{out}");
            assert!(out.contains(&format!("rank {rank} of {n}")), "{out}");
        }
    }
}

/// Rank 1 exits right after joining; rank 0's next collective must fail with an error
/// (MLX reports the lost connection), well within the bound, instead of waiting forever.
#[test]
fn a_dead_rank_fails_its_peers_collectives() {
    match role().as_deref() {
        Some("dies") => {
            let group = join();
            if group.rank() == 1 {
                std::process::exit(3);
            }
            std::thread::sleep(Duration::from_millis(300));
            let x = Array::from_slice(&[1.0f32; 64], &[64]);
            let result = group.all_sum(&x).and_then(|s| {
                s.eval()?;
                Ok(s)
            });
            match result {
                Ok(_) => panic!("an all_sum with a dead peer succeeded"),
                Err(e) => {
                    eprintln!("collective failed: {}", e.what());
                    std::process::exit(7);
                }
            }
        }
        Some(_) => return,
        None => {}
    }
    let (_dir, children) = spawn_ranks(2, "a_dead_rank_fails_its_peers_collectives", "dies");
    let results = wait_all(children, Duration::from_secs(30));
    assert_eq!(results[1].0, Some(3), "{}", results[1].1);
    let (code, out) = &results[0];
    assert_eq!(*code, Some(7), "rank 0 should fail its all_sum:\n{out}");
    assert!(out.contains("collective failed"), "{out}");
}
