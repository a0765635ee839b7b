//! Joining an MLX distributed group, so that a target runs tensor-parallel across
//! processes: MLX's launch environment (as `mlx.launch` sets it) or explicit flags, the
//! group formed under a bounded wait, agreement on what every rank generates, and a
//! watchdog that turns a peer that stopped answering into an error instead of a hang.
//!
//! Every rank runs the whole decode loop (drafter, sampling, acceptance) on logits that
//! are the same bits on every rank (see `dspec_adapters::tensor_parallel`), so every
//! decision is the same without being sent around; only rank 0 prints.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mlx_rs::Array;

use dspec_runtime::distributed::{init, is_available, Group, BACKENDS};
use dspec_runtime::files::fnv1a;

use crate::error::EngineError;
use crate::runtime::exit_process;

/// Whether to join a group (`--distributed`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Join when MLX's launch environment (or `--mlx-hostfile`) describes a group of
    /// more than one process.
    Auto,
    /// Run alone whatever the environment says.
    Off,
    /// Join, and fail when there is no group to join.
    On,
}

/// How to join, from the command line.
#[derive(Debug, Clone)]
pub struct Settings {
    pub mode: Mode,
    /// `any` or one of MLX's backends.
    pub backend: String,
    /// The ring backend's hostfile (what `MLX_HOSTFILE` names), instead of the environment.
    pub hostfile: Option<PathBuf>,
    /// This process's rank (what `MLX_RANK` says), instead of the environment.
    pub rank: Option<i32>,
    /// Longest wait for the group to form, and longest time without progress while
    /// computing with it, before a rank gives up with an error.
    pub timeout: Duration,
}

/// A group described by the environment, as far as dspec needs to know it before MLX
/// joins it.
#[derive(Debug, Clone, PartialEq)]
pub struct Launch {
    /// The backend whose variables are set.
    pub backend: &'static str,
    /// The `ip:port`s of every rank, for the ring backend.
    pub addresses: Vec<Vec<String>>,
    pub rank: Option<i32>,
    pub size: Option<usize>,
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// Reads the ring backend's hostfile: a JSON list with, per rank, the list of `ip:port`
/// it listens on (`[["10.0.0.1:5000"], ["10.0.0.2:5000"]]`). An empty file is a group of
/// one: what `mlx.launch` writes for a single process.
pub fn read_ring_hostfile(path: &Path, from: &str) -> Result<Vec<Vec<String>>, EngineError> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        EngineError::Invalid(format!(
            "reading the ring hostfile {} (from {from}): {e}",
            path.display()
        ))
    })?;
    if text.trim().is_empty() {
        return Ok(Vec::new());
    }
    let bad = |why: String| {
        EngineError::Invalid(format!(
            "the ring hostfile {} (from {from}) {why}; it must be a JSON list with, per rank, \
             the list of \"ip:port\" it listens on, e.g. [[\"127.0.0.1:5000\"], [\"127.0.0.1:5001\"]] \
             (mlx.launch writes it)",
            path.display()
        ))
    };
    let hosts: Vec<Vec<String>> =
        serde_json::from_str(&text).map_err(|e| bad(format!("is not valid: {e}")))?;
    for (rank, addresses) in hosts.iter().enumerate() {
        if addresses.is_empty() {
            return Err(bad(format!("lists no address for rank {rank}")));
        }
        for address in addresses {
            let port_ok = address
                .rsplit_once(':')
                .is_some_and(|(ip, port)| !ip.is_empty() && port.parse::<u16>().is_ok());
            if !port_ok {
                return Err(bad(format!(
                    "gives rank {rank} the address {address:?}, not ip:port"
                )));
            }
        }
    }
    Ok(hosts)
}

/// The group MLX's launch environment describes, if any: ring (`MLX_RANK` and
/// `MLX_HOSTFILE`, as `mlx.launch --backend ring` sets them), nccl (`MLX_RANK`,
/// `MLX_WORLD_SIZE`, `NCCL_HOST_IP`, `NCCL_PORT`), jaccl (`MLX_RANK`, `MLX_IBV_DEVICES`)
/// or an MPI launcher's `OMPI_COMM_WORLD_SIZE`/`PMI_SIZE`.
pub fn launch_environment() -> Result<Option<Launch>, EngineError> {
    let rank = match var("MLX_RANK") {
        Some(r) => Some(r.trim().parse::<i32>().map_err(|_| {
            EngineError::Invalid(format!(
                "MLX_RANK is {r:?}; it must be this process's rank, 0 for the first"
            ))
        })?),
        None => None,
    };
    if let (Some(rank), Some(hostfile)) = (rank, var("MLX_HOSTFILE")) {
        let hosts = read_ring_hostfile(Path::new(&hostfile), "MLX_HOSTFILE")?;
        return Ok(Some(Launch {
            backend: "ring",
            size: Some(hosts.len().max(1)),
            addresses: hosts,
            rank: Some(rank),
        }));
    }
    if let (Some(rank), Some(size)) = (rank, var("MLX_WORLD_SIZE")) {
        if var("NCCL_HOST_IP").is_some() && var("NCCL_PORT").is_some() {
            let size = size.trim().parse::<usize>().map_err(|_| {
                EngineError::Invalid(format!("MLX_WORLD_SIZE is {size:?}; it must be a count"))
            })?;
            return Ok(Some(Launch {
                backend: "nccl",
                addresses: Vec::new(),
                rank: Some(rank),
                size: Some(size),
            }));
        }
    }
    if rank.is_some() && var("MLX_IBV_DEVICES").is_some() {
        return Ok(Some(Launch {
            backend: "jaccl",
            addresses: Vec::new(),
            rank,
            size: None,
        }));
    }
    let mpi_size = var("OMPI_COMM_WORLD_SIZE").or_else(|| var("PMI_SIZE"));
    if let Some(size) = mpi_size.and_then(|s| s.trim().parse::<usize>().ok()) {
        return Ok(Some(Launch {
            backend: "mpi",
            addresses: Vec::new(),
            rank: None,
            size: Some(size),
        }));
    }
    Ok(None)
}

/// What the watchdog watches.
struct Watch {
    armed: AtomicBool,
    /// Set once the last collective (the closing barrier) starts: from then on a peer
    /// that has finished and closed its connections is no failure.
    finishing: AtomicBool,
    /// Set while waiting for the slowest rank to finish loading (see
    /// [`Distributed::rendezvous`]): no timeout then, only the connection watch.
    patient: AtomicBool,
    group: Group,
    timeout: Duration,
    /// Said when it fires: where this rank waits and on whom.
    context: String,
    /// The ring's TCP connections: (file descriptor, peer rank, peer address).
    connections: Vec<(i32, i32, String)>,
}

impl Watch {
    /// Which ring connection has closed, if one has, as a sentence.
    fn lost_connection(&self) -> Option<String> {
        let (_, peer, address) = self
            .connections
            .iter()
            .find(|(fd, _, _)| !connection_is_open(*fd))?;
        Some(format!(
            "the connection to rank {peer} ({address}) was lost: that rank exited or its \
             machine became unreachable; check its output"
        ))
    }
}

/// This process's place in a distributed group, with the watchdog that bounds every
/// wait on the other ranks.
pub struct Distributed {
    group: Group,
    watch: Arc<Watch>,
}

/// Arms the watchdog while it lives (see [`Distributed::watch`]).
pub struct WatchGuard {
    watch: Arc<Watch>,
}

impl Drop for WatchGuard {
    fn drop(&mut self) {
        self.watch.armed.store(false, Ordering::SeqCst);
    }
}

/// Watches the ring's connections, but not progress, while it lives (see
/// [`Distributed::idle`]).
pub struct IdleGuard {
    watch: Arc<Watch>,
}

impl Drop for IdleGuard {
    fn drop(&mut self) {
        self.watch.armed.store(false, Ordering::SeqCst);
        self.watch.patient.store(false, Ordering::SeqCst);
    }
}

/// The watchdog thread: while armed, a rank that builds no collective for `timeout` is
/// waiting on a peer that is not coming (stopped, hung, or cut off without the TCP
/// connection closing, where MLX's ring would wait forever); it exits with an error.
/// A peer that died is reported sooner by MLX itself ("connection to a peer was lost").
fn spawn_watchdog(watch: Arc<Watch>) {
    let tick = (watch.timeout / 10).clamp(Duration::from_millis(50), Duration::from_secs(1));
    std::thread::spawn(move || {
        let mut seen = watch.group.collectives_built();
        let mut since = Instant::now();
        loop {
            std::thread::sleep(tick);
            let checking =
                watch.armed.load(Ordering::SeqCst) && !watch.finishing.load(Ordering::SeqCst);
            if let Some(lost) = watch.lost_connection().filter(|_| checking) {
                eprintln!(
                    "error: rank {} of {}: {lost}",
                    watch.group.rank(),
                    watch.group.size()
                );
                exit_process(1);
            }
            let built = watch.group.collectives_built();
            let timing =
                watch.armed.load(Ordering::SeqCst) && !watch.patient.load(Ordering::SeqCst);
            if built != seen || !timing {
                seen = built;
                since = Instant::now();
                continue;
            }
            if since.elapsed() >= watch.timeout {
                eprintln!(
                    "error: rank {} of {}: no progress for {} s {}; check the other ranks' \
                     output. If one step of this model legitimately takes longer, raise \
                     --distributed-timeout.",
                    watch.group.rank(),
                    watch.group.size(),
                    watch.timeout.as_secs(),
                    watch.context,
                );
                exit_process(1);
            }
        }
    });
}

impl Distributed {
    pub fn group(&self) -> &Group {
        &self.group
    }

    pub fn rank(&self) -> i32 {
        self.group.rank()
    }

    pub fn size(&self) -> i32 {
        self.group.size()
    }

    /// Rank 0 prints and reports; the others compute in silence.
    pub fn is_root(&self) -> bool {
        self.group.rank() == 0
    }

    /// `rank R of N` for messages.
    pub fn describe(&self) -> String {
        format!("rank {} of {}", self.rank(), self.size())
    }

    /// Context for an error of this rank: `rank R of N`, and the ring connection that
    /// closed, if one did (MLX itself says only that "a peer" was lost).
    pub fn describe_failure(&self) -> String {
        match self.watch.lost_connection() {
            Some(lost) => format!("{}: {lost}", self.describe()),
            None => self.describe(),
        }
    }

    /// Arms the watchdog until the guard drops: around work that waits on the other
    /// ranks (a generation), not around work each rank does alone (loading).
    pub fn watch(&self) -> WatchGuard {
        self.watch.armed.store(true, Ordering::SeqCst);
        WatchGuard {
            watch: self.watch.clone(),
        }
    }

    /// Watches for a peer that dies, but not for progress, until the guard drops: around
    /// a wait that may last as long as a server has no request, and which a follower
    /// spends without building a collective.
    pub fn idle(&self) -> IdleGuard {
        self.watch.patient.store(true, Ordering::SeqCst);
        self.watch.armed.store(true, Ordering::SeqCst);
        IdleGuard {
            watch: self.watch.clone(),
        }
    }

    /// Sleeps until rank 0 starts the next collective, however long that takes: a
    /// follower of `dspec serve` waiting for the next request. MLX's ring backend
    /// waits for a transfer by retrying a non-blocking `recv` in a loop (`ring.cpp`'s
    /// `SocketThread`), so a rank that waited inside the collective would keep a core
    /// busy for as long as the server is idle. Instead this waits in poll(2) on the
    /// ring's connections until a neighbour's first bytes arrive (rank 0 starting the
    /// collective, or a follower it woke passing them on) or a connection closes (which
    /// the watch reports), and reads nothing: the collective that follows reads them.
    /// Without the ring's connections (other backends, other systems) it returns at
    /// once, and the wait happens inside the collective, as the backend waits.
    pub fn wait_for_root(&self) {
        wait_readable(&self.watch.connections);
    }

    /// Waits for every rank to be ready (done loading, which takes as long as the
    /// slowest disk): under the watch of the ring's connections, so a rank that died
    /// while loading is reported, but not under the timeout, which is for steps that
    /// the ranks compute together.
    pub fn rendezvous(&self) -> Result<(), EngineError> {
        let _idle = self.idle();
        Ok(self.group.barrier()?)
    }

    /// The sampling seed every rank uses: the one given, else one rank 0 draws and
    /// sends (a seed drawn per rank would sample different tokens on each).
    pub fn shared_seed(&self, seed: Option<u64>) -> Result<u64, EngineError> {
        if let Some(seed) = seed {
            return Ok(seed);
        }
        let drawn: u64 = rand::random();
        let halves = [drawn as u32, (drawn >> 32) as u32];
        let root = self
            .group
            .broadcast_from_root(&Array::from_slice(&halves, &[2]))?;
        root.eval()?;
        let got = root
            .try_as_slice::<u32>()
            .map_err(|e| EngineError::Mlx(e.to_string()))?;
        Ok(got[0] as u64 | (got[1] as u64) << 32)
    }

    /// Checks that every rank was given the same `what` (a description, such as the
    /// prompt's tokens and the decoding settings): ranks that generate different things
    /// would exchange mismatched tensors. Names the ranks that differ from rank 0.
    pub fn check_same(&self, what: &str, fingerprint: &[u8]) -> Result<(), EngineError> {
        let hash = fnv1a(fingerprint);
        let mine = Array::from_slice(&[hash as u32, (hash >> 32) as u32], &[1, 2]);
        let all = self.group.all_gather(&mine)?;
        all.eval()?;
        let all = all
            .try_as_slice::<u32>()
            .map_err(|e| EngineError::Mlx(e.to_string()))?;
        let differing: Vec<String> = all
            .chunks(2)
            .enumerate()
            .filter(|(_, h)| h != &&all[..2])
            .map(|(rank, _)| rank.to_string())
            .collect();
        if differing.is_empty() {
            return Ok(());
        }
        Err(EngineError::Invalid(format!(
            "rank(s) {} were given different {what} than rank 0; every rank must run the same \
             command (same prompt, model, drafter and decoding flags)",
            differing.join(", ")
        )))
    }

    /// Waits until every rank has finished (a rank that failed makes this fail).
    pub fn finish(&self) -> Result<(), EngineError> {
        self.watch.finishing.store(true, Ordering::SeqCst);
        let _watch = self.watch();
        Ok(self.group.barrier()?)
    }
}

/// This process's TCP connections of the ring (`hosts`: every rank's `ip:port`s), with
/// the rank at the other end: those whose peer is a rank's listening address (this rank
/// connected to its right neighbour), and those accepted on this rank's own address
/// (from its left neighbour). Found among the process's open sockets once the group has
/// formed: MLX keeps its sockets to itself, and a dead peer's closed connection is the
/// one sign of death MLX's ring does not pass on (its socket thread fails the
/// transfer in flight and stops, so the next transfer on that socket waits forever).
#[cfg(target_os = "linux")]
fn ring_connections(hosts: &[Vec<String>], rank: i32) -> Vec<(i32, i32, String)> {
    use std::net::SocketAddr;
    let parse = |a: &String| a.parse::<SocketAddr>().ok();
    let size = hosts.len() as i32;
    let own: Vec<SocketAddr> = hosts
        .get(rank as usize)
        .map(|h| h.iter().filter_map(parse).collect())
        .unwrap_or_default();
    let left = (rank + size - 1) % size.max(1);
    let Ok(fds) = std::fs::read_dir("/proc/self/fd") else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for entry in fds.flatten() {
        let Some(fd) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        let is_socket = std::fs::read_link(entry.path())
            .is_ok_and(|l| l.to_string_lossy().starts_with("socket:"));
        if !is_socket {
            continue;
        }
        let (Some(local), Some(peer)) = (socket_address(fd, false), socket_address(fd, true))
        else {
            continue;
        };
        let connected_to = hosts
            .iter()
            .enumerate()
            .find(|(r, h)| *r as i32 != rank && h.iter().filter_map(parse).any(|a| a == peer));
        if let Some((r, _)) = connected_to {
            found.push((fd, r as i32, peer.to_string()));
        } else if own.iter().any(|a| a.port() == local.port()) {
            let address = hosts
                .get(left as usize)
                .map(|h| h.join(", "))
                .unwrap_or_else(|| peer.to_string());
            found.push((fd, left, address));
        }
    }
    found
}

#[cfg(not(target_os = "linux"))]
fn ring_connections(_hosts: &[Vec<String>], _rank: i32) -> Vec<(i32, i32, String)> {
    // Elsewhere the watchdog's timeout alone bounds the wait on a dead peer.
    Vec::new()
}

/// The local (`peer: false`) or remote address of socket `fd`, if it is a connected
/// IPv4 or IPv6 socket (std's socket calls read the address; any other descriptor
/// answers an error).
#[cfg(target_os = "linux")]
fn socket_address(fd: i32, peer: bool) -> Option<std::net::SocketAddr> {
    use std::os::fd::FromRawFd;
    // SAFETY: the descriptor is this process's own and stays open while it is borrowed
    // here; ManuallyDrop keeps the stream from closing it.
    let stream = std::mem::ManuallyDrop::new(unsafe { std::net::TcpStream::from_raw_fd(fd) });
    match peer {
        true => stream.peer_addr().ok(),
        false => stream.local_addr().ok(),
    }
}

/// Socket `fd` of this process, to be watched while it stays open.
#[cfg(target_os = "linux")]
fn borrowed(fd: i32) -> rustix::fd::BorrowedFd<'static> {
    // SAFETY: the ring's sockets stay open as long as the group, which outlives every
    // watch of them; they are only polled, never read or closed here.
    unsafe { rustix::fd::BorrowedFd::borrow_raw(fd) }
}

/// Whether TCP socket `fd` is still a connection both ends hold open: not closed by its
/// peer (which reads as a hang-up of the peer's half), reset, or in error.
#[cfg(target_os = "linux")]
fn connection_is_open(fd: i32) -> bool {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let fd = borrowed(fd);
    let mut fds = [PollFd::new(&fd, PollFlags::RDHUP)];
    let now = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    match poll(&mut fds, Some(&now)) {
        Ok(_) => !fds[0]
            .revents()
            .intersects(PollFlags::RDHUP | PollFlags::HUP | PollFlags::ERR | PollFlags::NVAL),
        Err(_) => false,
    }
}

#[cfg(not(target_os = "linux"))]
fn connection_is_open(_fd: i32) -> bool {
    true
}

/// Blocks until one of `connections` has bytes to read or has closed; at once when there
/// are none.
#[cfg(target_os = "linux")]
fn wait_readable(connections: &[(i32, i32, String)]) {
    use rustix::event::{poll, PollFd, PollFlags};
    if connections.is_empty() {
        return;
    }
    let fds: Vec<_> = connections.iter().map(|(fd, _, _)| borrowed(*fd)).collect();
    let mut watched: Vec<PollFd<'_>> = fds
        .iter()
        .map(|fd| PollFd::new(fd, PollFlags::IN | PollFlags::RDHUP))
        .collect();
    // A signal interrupts the wait; anything else ends it (the watch then looks).
    while let Err(rustix::io::Errno::INTR) = poll(&mut watched, None) {}
}

#[cfg(not(target_os = "linux"))]
fn wait_readable(_connections: &[(i32, i32, String)]) {}

/// Joins the group `settings` and the environment describe; `None` to run alone.
///
/// Call it first thing, before other threads use MLX. The wait for the other ranks to
/// connect is bounded by `settings.timeout`.
pub fn join(settings: &Settings) -> Result<Option<Distributed>, EngineError> {
    if settings.mode == Mode::Off {
        return Ok(None);
    }
    if settings.backend != "any" && !BACKENDS.contains(&settings.backend.as_str()) {
        return Err(EngineError::Invalid(format!(
            "--distributed-backend {}: MLX's backends are any, {}",
            settings.backend,
            BACKENDS.join(", ")
        )));
    }
    if settings.rank.is_some() != settings.hostfile.is_some() {
        return Err(EngineError::Invalid(
            "--mlx-rank and --mlx-hostfile go together: the hostfile lists every rank's \
             address and the rank says which one is this process"
                .into(),
        ));
    }
    if let (Some(rank), Some(hostfile)) = (settings.rank, &settings.hostfile) {
        // MLX's ring backend reads these two variables and nothing else.
        std::env::set_var("MLX_RANK", rank.to_string());
        std::env::set_var("MLX_HOSTFILE", hostfile);
    }
    let from_flags = settings.hostfile.is_some();
    let launch = match launch_environment() {
        Ok(l) => l,
        Err(e) if from_flags => {
            return Err(EngineError::Invalid(format!(
                "{e} (set from --mlx-rank/--mlx-hostfile)"
            )))
        }
        Err(e) => return Err(e),
    };
    let Some(launch) = launch else {
        if settings.mode == Mode::On {
            return Err(EngineError::Invalid(
                "--distributed on: no group to join: start the ranks with mlx.launch (which sets \
                 MLX_RANK and MLX_HOSTFILE), or give --mlx-hostfile FILE and --mlx-rank N"
                    .into(),
            ));
        }
        return Ok(None);
    };
    if launch.size == Some(1) {
        return Ok(None);
    }
    if let (Some(rank), Some(size)) = (launch.rank, launch.size) {
        if rank < 0 || rank as usize >= size {
            return Err(EngineError::Invalid(format!(
                "MLX_RANK is {rank} but the group has {size} ranks (0 to {})",
                size - 1
            )));
        }
    }
    let backend = match settings.backend.as_str() {
        "any" => launch.backend,
        chosen => BACKENDS
            .iter()
            .copied()
            .find(|b| *b == chosen)
            .unwrap_or(launch.backend),
    };
    if !is_available(backend) {
        return Err(EngineError::Invalid(format!(
            "the loaded libmlx has no `{backend}` distributed backend (dspec --version says which \
             libmlx is loaded); the CPU build has ring and mpi, the CUDA build adds nccl"
        )));
    }
    // MLX's ring backend waits in accept() for its left neighbour with no bound: a rank
    // that never starts would hang this one. The watchdog bounds the wait.
    let forming = Arc::new(AtomicBool::new(true));
    {
        let forming = forming.clone();
        let (timeout, rank) = (settings.timeout, launch.rank);
        let peers = match launch.addresses.is_empty() {
            true => String::new(),
            false => format!(" at {}", launch.addresses.concat().join(" ")),
        };
        let size = launch.size.map(|s| s.to_string()).unwrap_or("?".into());
        std::thread::spawn(move || {
            let start = Instant::now();
            while forming.load(Ordering::SeqCst) {
                if start.elapsed() >= timeout {
                    eprintln!(
                        "error: rank {} of {size}: the {backend} group did not form within {} s: \
                         some rank did not start or cannot be reached{peers}; start every rank \
                         with the same hostfile, or raise --distributed-timeout",
                        rank.map(|r| r.to_string()).unwrap_or("?".into()),
                        timeout.as_secs()
                    );
                    exit_process(1);
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
    }
    let joined = init(backend, true);
    forming.store(false, Ordering::SeqCst);
    let group = joined.map_err(|e| {
        EngineError::Invalid(format!(
            "joining the {backend} group failed: {} (environment: MLX_RANK={}, MLX_HOSTFILE={})",
            e.what(),
            var("MLX_RANK").unwrap_or_default(),
            var("MLX_HOSTFILE").unwrap_or_default()
        ))
    })?;
    if group.size() == 1 {
        return Ok(None);
    }
    let (rank, size) = (group.rank(), group.size());
    let address = |r: i32| {
        launch
            .addresses
            .get(r as usize)
            .map(|a| format!(" ({})", a.join(", ")))
            .unwrap_or_default()
    };
    let (left, right) = ((rank + size - 1) % size, (rank + 1) % size);
    let context = match backend {
        "ring" => format!(
            "waiting on the ring: this rank exchanges data with rank {left}{} and rank {right}{}, \
             one of which (or a rank beyond) has stopped, hung or become unreachable",
            address(left),
            address(right)
        ),
        _ => format!(
            "waiting on the {backend} group: another rank has stopped, hung or become unreachable"
        ),
    };
    let connections = match backend {
        "ring" => ring_connections(&launch.addresses, rank),
        _ => Vec::new(),
    };
    let distributed = Distributed {
        watch: Arc::new(Watch {
            armed: AtomicBool::new(false),
            finishing: AtomicBool::new(false),
            patient: AtomicBool::new(false),
            group: group.clone(),
            timeout: settings.timeout,
            context,
            connections,
        }),
        group,
    };
    spawn_watchdog(distributed.watch.clone());
    Ok(Some(distributed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_hostfiles_are_read_and_bad_ones_named() {
        let dir = tempfile::tempdir().expect("temp dir");
        let write = |text: &str| {
            let path = dir.path().join("hosts.json");
            std::fs::write(&path, text).expect("write");
            path
        };
        let hosts = read_ring_hostfile(
            &write(r#"[["127.0.0.1:5000"], ["127.0.0.1:5001", "10.0.0.2:5001"]]"#),
            "test",
        )
        .expect("valid");
        assert_eq!(hosts.len(), 2);
        assert_eq!(hosts[1][1], "10.0.0.2:5001");
        assert!(read_ring_hostfile(&write("\n"), "test")
            .expect("mlx.launch's file for one process")
            .is_empty());
        for (bad, says) in [
            (r#"{"hosts": []}"#, "is not valid"),
            (r#"[["127.0.0.1"]]"#, "not ip:port"),
            (r#"[[]]"#, "no address for rank 0"),
        ] {
            let err = read_ring_hostfile(&write(bad), "MLX_HOSTFILE").expect_err(bad);
            let text = err.to_string();
            assert!(
                text.contains(says) && text.contains("MLX_HOSTFILE"),
                "{text}"
            );
        }
    }
}
