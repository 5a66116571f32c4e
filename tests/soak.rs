//! Soak, on loopback with host memory: many verified transfers of mixed sizes between a node
//! in this process (the hub) and three `ferry serve --role echo` processes, which are
//! SIGKILLed and restarted at random moments. Every byte that comes back is checked; a
//! transfer that a kill interrupts must end with an error by its deadline; at the end the
//! hub's memory (ferry's budget and the process's RSS) and its file descriptors are back at
//! the baseline measured after a warm-up. Ignored: it runs for a minute or more.
//!
//! ```sh
//! cargo test --release --test soak -- --ignored --nocapture
//! ```
//!
//! Settings, from the environment:
//! - `FERRY_SOAK_TRANSFERS` (100000): transfers to issue, each a send and its echo.
//! - `FERRY_SOAK_SECONDS` (300): the bound on the whole run; transfers stop being issued
//!   30 s before it (leaving time to wind down), and the summary says so.
//! - `FERRY_SOAK_SEED` (0x5eed20261124, printed): sizes, contents and peer choices of
//!   every transfer, and the gaps between kills, derive from it. Kill moments fall where
//!   the clock puts them, so a replay repeats the traffic, not every interleaving.
//! - `FERRY_SOAK_RSS_SLACK_MIB` (64): how far the RSS may end above its baseline. The
//!   allocator keeps some freed memory (16 MiB buffers, a few of them), so this bound is
//!   loose; ferry's own host-memory counters, which must come back exactly, are the strict
//!   check.

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{Scratch, Served, eventually};
use ferry::{MemoryKind, Node, Received};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::watch;

/// Echo peers.
const PEERS: usize = 3;
/// Transfers in flight at once.
const WORKERS: u64 = 16;
/// A transfer's deadline: its send, and the wait for its echo.
const DEADLINE: Duration = Duration::from_secs(10);
/// How long past its deadline a transfer may take to end before it counts as a hang.
const HANG_SLACK: Duration = Duration::from_secs(2);
/// After its peer was killed, how long a transfer still waits for an echo already on its way.
const KILL_GRACE: Duration = Duration::from_secs(2);
/// Time kept back at the end of the run to wind down.
const WIND_DOWN: Duration = Duration::from_secs(30);
/// Tags of the soak start here (the echo's control tags are near `u64::MAX`).
const TAG_BASE: u64 = 1 << 32;
/// Tags of the warm-up and the settle rounds start here.
const TAG_WARM: u64 = 1 << 48;
/// File descriptors the hub may end above its baseline.
const FD_SLACK: usize = 2;
const MIB: usize = 1 << 20;

struct Settings {
    transfers: u64,
    seconds: u64,
    seed: u64,
    rss_slack: u64,
}

impl Settings {
    fn from_env() -> Self {
        let var = |name: &str, default: u64| -> u64 {
            match std::env::var(name) {
                Ok(text) => {
                    let text = text.trim();
                    let parsed = match text.strip_prefix("0x") {
                        Some(hex) => u64::from_str_radix(hex, 16),
                        None => text.parse(),
                    };
                    parsed.unwrap_or_else(|e| panic!("{name}={text:?}: {e}"))
                }
                Err(_) => default,
            }
        };
        Self {
            transfers: var("FERRY_SOAK_TRANSFERS", 100_000),
            seconds: var("FERRY_SOAK_SECONDS", 300),
            seed: var("FERRY_SOAK_SEED", 0x5EED_2026_1124),
            rss_slack: var("FERRY_SOAK_RSS_SLACK_MIB", 64) << 20,
        }
    }
}

/// A length of the mix: empty, one byte, odd sizes small and mid, 4 KiB, 64 KiB, a chunk
/// (1 MiB) and one byte either side of it, and now and then 16 MiB.
fn pick_len(rng: &mut StdRng) -> usize {
    match rng.random_range(0..1000) {
        0..100 => 0,
        100..200 => 1,
        200..450 => rng.random_range(1..2048usize) * 2 + 1,
        450..650 => 4096,
        650..800 => 64 << 10,
        800..940 => rng.random_range(2049..131_072usize) * 2 + 1,
        940..998 => MIB - 1 + rng.random_range(0..3usize),
        _ => 16 * MIB,
    }
}

/// Fills `bytes` with a pattern that derives from `seed`, eight bytes at a time.
fn fill(bytes: &mut [u8], seed: u64) {
    let mut x = seed | 1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut words = bytes.chunks_exact_mut(8);
    for word in &mut words {
        word.copy_from_slice(&next().to_le_bytes());
    }
    let rest = words.into_remainder();
    let last = next().to_le_bytes();
    rest.copy_from_slice(&last[..rest.len()]);
}

/// Open file descriptors of this process.
fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count().saturating_sub(1))
        .unwrap_or(0)
}

/// Resident memory of this process, bytes.
fn resident() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4096)
}

/// Threads of this process.
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count())
}

/// One echo peer: a `ferry serve` process that comes back on the same port after a kill.
struct Peer {
    name: String,
    port: u16,
    config: PathBuf,
    log: PathBuf,
    process: Mutex<Option<Served>>,
    up: AtomicBool,
    /// Bumped before every kill, so transfers can tell a failure a kill caused.
    generation: watch::Sender<u64>,
}

impl Peer {
    fn is_up(&self) -> bool {
        self.up.load(Ordering::Acquire)
    }

    /// Starts the process and waits for its ready line. A port another socket holds for a
    /// moment makes it try again (every 250 ms, 40 times). Blocks. Returns the tries taken.
    fn start(&self) -> Result<u32, String> {
        let mut last = String::new();
        for attempt in 1..=40 {
            match self.spawn() {
                Ok(served) => {
                    *self.process.lock().expect("peer lock") = Some(served);
                    self.up.store(true, Ordering::Release);
                    return Ok(attempt);
                }
                Err(e) => last = e,
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        Err(format!("{} did not start in 40 tries: {last}", self.name))
    }

    fn spawn(&self) -> Result<Served, String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(|e| format!("log {}: {e}", self.log.display()))?;
        let addr = format!("127.0.0.1:{}", self.port);
        let mut child = Command::new(common::ferry_bin())
            .args(["serve", "--config"])
            .arg(&self.config)
            .args(["--role", "echo", "--listen", &addr])
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("spawn ferry serve: {e}"))?;
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx.recv_timeout(Duration::from_secs(10)).unwrap_or_default();
        let served = Served {
            child,
            addr,
            ready: line,
        };
        if served.ready.contains(" ready on ") {
            Ok(served)
        } else {
            // Dropping it kills it; its log says why.
            Err(format!(
                "no ready line (got {:?}; see {})",
                served.ready,
                self.log.display()
            ))
        }
    }

    /// Marks the peer down, bumps its generation and SIGKILLs it. Blocks until it is reaped.
    fn kill(&self) {
        self.up.store(false, Ordering::Release);
        self.generation.send_modify(|g| *g += 1);
        if let Some(served) = self.process.lock().expect("peer lock").take() {
            nix::sys::signal::kill(served.pid(), nix::sys::signal::Signal::SIGKILL)
                .expect("SIGKILL");
            drop(served); // reaps it
        }
    }
}

/// Loopback ports below the kernel's ephemeral range, free now: a restarted peer binds its
/// port again, and no outgoing connection can have taken it meanwhile.
fn free_ports(n: usize) -> Vec<u16> {
    let start = 20_000 + (std::process::id() % 8_000) as u16;
    let mut held = Vec::new();
    for port in (start..32_000).chain(20_000..start) {
        if let Ok(l) = std::net::TcpListener::bind(("127.0.0.1", port)) {
            held.push((port, l));
            if held.len() == n {
                break;
            }
        }
    }
    assert_eq!(held.len(), n, "no {n} free ports in 20000..32000");
    held.into_iter().map(|(p, _)| p).collect()
}

/// What the wait for an echo saw first.
enum Wait {
    Echo(Result<Received, ferry::Error>),
    Deadline,
    Killed,
}

/// How one transfer ended.
enum Outcome {
    Verified {
        bytes: u64,
    },
    /// An error, or no echo. `expected` when the peer was down when it began or was killed
    /// while it ran.
    Failed {
        what: String,
        expected: bool,
        detail: String,
    },
    Mismatch(String),
    /// It outlived its deadline by more than [`HANG_SLACK`].
    Hang(String),
}

#[derive(Default)]
struct Tally {
    issued: u64,
    verified: u64,
    bytes: u64,
    expected: BTreeMap<String, u64>,
    unexpected: Vec<String>,
    mismatches: Vec<String>,
    hangs: Vec<String>,
    longest: Duration,
}

impl Tally {
    fn record(&mut self, outcome: Outcome, took: Duration) {
        self.issued += 1;
        self.longest = self.longest.max(took);
        match outcome {
            Outcome::Verified { bytes } => {
                self.verified += 1;
                self.bytes += bytes;
            }
            Outcome::Failed {
                what,
                expected: true,
                ..
            } => *self.expected.entry(what).or_default() += 1,
            Outcome::Failed { what, detail, .. } => {
                self.unexpected.push(format!("{what}: {detail}"));
            }
            Outcome::Mismatch(m) => self.mismatches.push(m),
            Outcome::Hang(h) => self.hangs.push(h),
        }
    }

    fn failed(&self) -> u64 {
        self.expected.values().sum::<u64>() + self.unexpected.len() as u64
    }
}

/// Kills and restarts.
#[derive(Default)]
struct Chaos {
    kills: AtomicU64,
    restarts: AtomicU64,
    /// Starts that needed another try (the port still held).
    retries: AtomicU64,
    /// The longest restart, ms.
    slowest_ms: AtomicU64,
}

struct Soak {
    node: Node,
    peers: Vec<Arc<Peer>>,
    seed: u64,
    chaos: Chaos,
}

impl Soak {
    /// A peer for a transfer: the one drawn, unless it is down, then (nine times in ten)
    /// one that is up.
    fn pick_peer(&self, rng: &mut StdRng) -> usize {
        let first = rng.random_range(0..self.peers.len());
        if self.peers[first].is_up() || rng.random_bool(0.1) {
            return first;
        }
        let up: Vec<usize> = (0..self.peers.len())
            .filter(|&p| self.peers[p].is_up())
            .collect();
        if up.is_empty() {
            first
        } else {
            up[rng.random_range(0..up.len())]
        }
    }

    /// Transfer `index`: a buffer of a size and contents drawn from the seed and `index`,
    /// sent to a peer with a deadline; its echo received and checked.
    async fn transfer(&self, index: u64, tag: u64) -> Outcome {
        let mut rng = StdRng::seed_from_u64(self.seed ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let len = pick_len(&mut rng);
        let contents: u64 = rng.random();
        let p = self.pick_peer(&mut rng);
        let peer = &self.peers[p];
        let name = peer.name.as_str();
        let started = Instant::now();
        let deadline = started + DEADLINE;
        let mut generation = peer.generation.subscribe();
        let generation_then = *generation.borrow_and_update();
        let up_then = peer.is_up();
        let ours = format!("transfer {index} (tag {tag}, {len} bytes, {name})");
        let run = async {
            let mut buffer = match self.node.alloc(MemoryKind::Host, len).await {
                Ok(b) => b,
                Err(e) => return Err(("alloc".to_string(), e.label(), e.to_string())),
            };
            fill(buffer.as_mut_slice().expect("fresh buffer"), contents);
            let crc = crc32c::crc32c(buffer.as_slice().expect("host"));
            let back = match self.node.send_by(name, tag, buffer, deadline).await {
                Ok(b) => b,
                Err(e) => {
                    // The buffer comes back unchanged (or not at all if the node stopped).
                    if let Some(b) = &e.buffer
                        && crc32c::crc32c(b.as_slice().expect("host")) != crc
                    {
                        return Ok(Some(format!("{ours}: the failed send changed its buffer")));
                    }
                    return Err(("send".into(), e.error.label(), e.error.to_string()));
                }
            };
            if back.len() != len || crc32c::crc32c(back.as_slice().expect("host")) != crc {
                return Ok(Some(format!("{ours}: the sent buffer changed")));
            }
            drop(back);
            let echo = self.node.recv(Some(name), Some(tag));
            tokio::pin!(echo);
            let killed = async {
                if generation.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            };
            let first = tokio::select! {
                r = &mut echo => Wait::Echo(r),
                () = tokio::time::sleep_until(deadline.into()) => Wait::Deadline,
                () = killed => Wait::Killed,
            };
            let got = match first {
                Wait::Echo(r) => Some(r),
                Wait::Deadline => None,
                Wait::Killed => {
                    // What was already on its way may still land.
                    let until = deadline.min(Instant::now() + KILL_GRACE);
                    tokio::time::timeout_at(until.into(), &mut echo).await.ok()
                }
            };
            let got = match got {
                Some(Ok(r)) => r,
                Some(Err(e)) => return Err(("recv".into(), e.label(), e.to_string())),
                None => return Err(("echo".into(), "lost", "no echo by its deadline".into())),
            };
            let bytes = got.buffer.as_slice().expect("host");
            if got.peer != name || bytes.len() != len || crc32c::crc32c(bytes) != crc {
                let mut want = vec![0u8; len];
                fill(&mut want, contents);
                let first_bad = bytes.iter().zip(&want).position(|(a, b)| a != b);
                return Ok(Some(format!(
                    "{ours}: echo from {} of {} bytes, first differing byte {first_bad:?}",
                    got.peer,
                    bytes.len()
                )));
            }
            Ok(None)
        };
        let ended = tokio::time::timeout(DEADLINE + HANG_SLACK, run).await;
        let took = started.elapsed();
        let outcome = match ended {
            Err(_) => return Outcome::Hang(format!("{ours}: still running after {took:?}")),
            Ok(Ok(None)) => Outcome::Verified { bytes: len as u64 },
            Ok(Ok(Some(mismatch))) => Outcome::Mismatch(mismatch),
            Ok(Err((phase, kind, detail))) => {
                let killed = *peer.generation.borrow() != generation_then;
                let cause = match (up_then, killed) {
                    (false, _) => "peer down",
                    (true, true) => "peer killed",
                    (true, false) => "peer up",
                };
                Outcome::Failed {
                    what: format!("{phase} {kind} ({cause})"),
                    expected: !up_then || killed,
                    detail: format!("{ours}: {detail}"),
                }
            }
        };
        if took > DEADLINE + HANG_SLACK {
            return Outcome::Hang(format!("{ours}: ended after {took:?}"));
        }
        outcome
    }

    /// Runs transfers `first..first + count` with [`WORKERS`] in flight, until `stop_at`.
    /// Returns whether the time bound stopped it.
    async fn run(
        &self,
        first: u64,
        count: u64,
        tags: u64,
        stop_at: Instant,
        tally: &Mutex<Tally>,
    ) -> bool {
        let next = AtomicU64::new(first);
        let bounded = AtomicBool::new(false);
        let worker = async || {
            loop {
                if Instant::now() >= stop_at {
                    bounded.store(true, Ordering::Relaxed);
                    return;
                }
                let index = next.fetch_add(1, Ordering::Relaxed);
                if index >= first + count {
                    return;
                }
                let started = Instant::now();
                let outcome = self.transfer(index, tags + index).await;
                tally
                    .lock()
                    .expect("tally lock")
                    .record(outcome, started.elapsed());
            }
        };
        futures::future::join_all((0..WORKERS).map(|_| worker())).await;
        bounded.load(Ordering::Relaxed)
    }

    /// One verified transfer to each peer (a few tries each: a link may be redialing).
    async fn settle(&self, round: u64) {
        for (p, peer) in self.peers.iter().enumerate() {
            let mut last = String::new();
            let ok = 'tries: {
                for attempt in 0..5u64 {
                    let tag = TAG_WARM + (1 << 40) + round * 1000 + p as u64 * 10 + attempt;
                    let mut b = self
                        .node
                        .alloc(MemoryKind::Host, 4096)
                        .await
                        .expect("alloc");
                    fill(b.as_mut_slice().expect("fresh"), tag);
                    let crc = crc32c::crc32c(b.as_slice().expect("host"));
                    let deadline = Instant::now() + DEADLINE;
                    match self.node.send_by(&peer.name, tag, b, deadline).await {
                        Ok(_) => {}
                        Err(e) => {
                            last = e.to_string();
                            tokio::time::sleep(Duration::from_millis(200)).await;
                            continue;
                        }
                    }
                    let echo =
                        tokio::time::timeout(DEADLINE, self.node.recv(Some(&peer.name), Some(tag)));
                    match echo.await {
                        Ok(Ok(r)) => {
                            assert_eq!(
                                crc32c::crc32c(r.buffer.as_slice().expect("host")),
                                crc,
                                "settle echo from {}",
                                peer.name
                            );
                            break 'tries true;
                        }
                        Ok(Err(e)) => last = e.to_string(),
                        Err(_) => last = "no echo in 10 s".into(),
                    }
                }
                false
            };
            assert!(ok, "settle: {} does not answer: {last}", peer.name);
        }
    }

    /// Kills a random peer that is up (never the last one), restarts it after a random
    /// downtime, and again, until `stop` turns true. Waits for the restarts it started.
    async fn chaos(self: Arc<Self>, stop: Arc<AtomicBool>) {
        let mut rng = StdRng::seed_from_u64(self.seed ^ 0xC4A0_5C4A_05C4_A05C);
        let mut restarts = Vec::new();
        while !stop.load(Ordering::Acquire) {
            let gap = Duration::from_millis(rng.random_range(200..2500));
            let down = Duration::from_millis(rng.random_range(0..1500));
            let pick: usize = rng.random_range(0..self.peers.len());
            tokio::time::sleep(gap).await;
            if stop.load(Ordering::Acquire) {
                break;
            }
            let up: Vec<usize> = (0..self.peers.len())
                .filter(|&p| self.peers[p].is_up())
                .collect();
            if up.len() < 2 {
                continue;
            }
            let peer = Arc::clone(&self.peers[up[pick % up.len()]]);
            let soak = Arc::clone(&self);
            restarts.push(tokio::spawn(async move {
                let p = Arc::clone(&peer);
                tokio::task::spawn_blocking(move || p.kill())
                    .await
                    .expect("kill");
                soak.chaos.kills.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(down).await;
                let (tries, took) = Self::restart(peer).await;
                let c = &soak.chaos;
                c.restarts.fetch_add(1, Ordering::Relaxed);
                c.retries.fetch_add(u64::from(tries - 1), Ordering::Relaxed);
                c.slowest_ms
                    .fetch_max(took.as_millis() as u64, Ordering::Relaxed);
            }));
            restarts.retain(|r| !r.is_finished());
        }
        for r in restarts {
            r.await.expect("restart");
        }
    }

    /// Restarts `peer`; returns the tries it took (more than one when its port was still
    /// held) and how long.
    async fn restart(peer: Arc<Peer>) -> (u32, Duration) {
        let began = Instant::now();
        let tries = tokio::task::spawn_blocking(move || peer.start())
            .await
            .expect("start")
            .unwrap_or_else(|e| panic!("restart: {e}"));
        (tries, began.elapsed())
    }
}

/// Host memory granted and waiting, as ferry counts them, and exported or quarantined.
async fn ferry_memory(node: &Node) -> (u64, usize, u64) {
    let m = node.memory(MemoryKind::Host).await.expect("memory stats");
    (
        m.budget.granted,
        m.budget.waiting,
        m.exports.exported + m.exports.quarantined,
    )
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / MIB as f64)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a soak of minutes: cargo test --release --test soak -- --ignored --nocapture"]
async fn transfers_survive_peers_killed_at_random_and_resources_return() {
    let settings = Settings::from_env();
    let began = Instant::now();
    let bound = began + Duration::from_secs(settings.seconds);
    let issue_until = bound
        .checked_sub(WIND_DOWN)
        .filter(|t| *t > began)
        .unwrap_or(bound);
    println!(
        "soak: {} transfers, {} s at most, seed {:#x} (FERRY_SOAK_SEED replays it)",
        settings.transfers, settings.seconds, settings.seed
    );

    // Three echo peers on fixed ports, and the hub that knows them.
    let scratch = Scratch::new();
    let ports = free_ports(PEERS);
    let peers: Vec<Arc<Peer>> = ports
        .iter()
        .enumerate()
        .map(|(i, &port)| {
            let name = format!("p{i}");
            Arc::new(Peer {
                config: scratch.write(&format!("{name}.toml"), &scratch.toml(&name, &[], "")),
                log: scratch.path().join(format!("{name}.log")),
                name,
                port,
                process: Mutex::new(None),
                up: AtomicBool::new(false),
                generation: watch::Sender::new(0),
            })
        })
        .collect();
    for peer in &peers {
        peer.start().unwrap_or_else(|e| panic!("{e}"));
    }
    let addresses: Vec<(String, String)> = peers
        .iter()
        .map(|p| (p.name.clone(), format!("127.0.0.1:{}", p.port)))
        .collect();
    let named: Vec<(&str, &str)> = addresses
        .iter()
        .map(|(n, a)| (n.as_str(), a.as_str()))
        .collect();
    let node = Node::start(scratch.config("hub", &named, ""))
        .await
        .expect("hub starts");
    let soak = Arc::new(Soak {
        node,
        peers,
        seed: settings.seed,
        chaos: Chaos::default(),
    });

    // Warm-up: every size, every peer, and one kill and restart of each, so that what grows
    // once (pools, maps, the allocator's arenas) has grown before the baseline.
    let warm = Mutex::new(Tally::default());
    let far = Instant::now() + Duration::from_secs(3600);
    soak.run(0, 1000, TAG_WARM, far, &warm).await;
    for peer in &soak.peers {
        let p = Arc::clone(peer);
        tokio::task::spawn_blocking(move || p.kill())
            .await
            .expect("kill");
        Soak::restart(Arc::clone(peer)).await;
    }
    soak.run(1000, 1000, TAG_WARM, far, &warm).await;
    soak.settle(0).await;
    {
        let w = warm.lock().expect("tally lock");
        assert!(
            w.mismatches.is_empty() && w.hangs.is_empty() && w.unexpected.is_empty(),
            "warm-up: mismatches {:?}, hangs {:?}, unexpected failures {:?}",
            w.mismatches,
            w.hangs,
            w.unexpected
        );
        println!(
            "warm-up: {} transfers, {} verified, {} in {:.1} s",
            w.issued,
            w.verified,
            mib(w.bytes),
            began.elapsed().as_secs_f64()
        );
    }
    assert!(
        eventually(Duration::from_secs(10), async || {
            ferry_memory(&soak.node).await == (0, 0, 0)
        })
        .await,
        "warm-up: host memory still granted: {:?}",
        ferry_memory(&soak.node).await
    );
    let base_fds = open_fds();
    let base_rss = resident();
    let base_threads = threads();
    let base_memory = ferry_memory(&soak.node).await;
    println!(
        "baseline: {base_fds} fds, RSS {}, {base_threads} threads, ferry host granted {}",
        mib(base_rss),
        base_memory.0
    );

    // The soak: transfers from WORKERS tasks while peers die and come back.
    let stop = Arc::new(AtomicBool::new(false));
    let chaos = tokio::spawn(Arc::clone(&soak).chaos(Arc::clone(&stop)));
    let tally = Arc::new(Mutex::new(Tally::default()));
    let soak_began = Instant::now();
    let mut rss_samples = Vec::new();
    let progress = {
        let (soak, tally, stop) = (Arc::clone(&soak), Arc::clone(&tally), Arc::clone(&stop));
        tokio::spawn(async move {
            let mut samples = Vec::new();
            let mut last = Instant::now();
            while !stop.load(Ordering::Acquire) {
                tokio::time::sleep(Duration::from_secs(1)).await;
                let rss = resident();
                samples.push(rss);
                if last.elapsed() < Duration::from_secs(10) {
                    continue;
                }
                last = Instant::now();
                let (issued, verified, failed) = {
                    let t = tally.lock().expect("tally lock");
                    (t.issued, t.verified, t.failed())
                };
                println!(
                    "  {:>5.0} s: {issued} issued, {verified} verified, {failed} failed, {} kills, \
                     RSS {}, {} fds",
                    soak_began.elapsed().as_secs_f64(),
                    soak.chaos.kills.load(Ordering::Relaxed),
                    mib(rss),
                    open_fds(),
                );
            }
            samples
        })
    };
    let time_bounded = soak
        .run(0, settings.transfers, TAG_BASE, issue_until, &tally)
        .await;
    let soak_took = soak_began.elapsed();
    stop.store(true, Ordering::Release);
    chaos.await.expect("chaos");
    rss_samples.extend(progress.await.expect("progress"));

    // Wind down: every peer up, a link to each again, nothing left in the inbox.
    for peer in &soak.peers {
        assert!(
            peer.is_up(),
            "{} is still down after the chaos ended",
            peer.name
        );
    }
    soak.settle(1).await;
    let mut late = 0;
    while let Ok(r) =
        tokio::time::timeout(Duration::from_millis(500), soak.node.recv(None, None)).await
    {
        drop(r.expect("recv"));
        late += 1;
    }
    let memory_back = eventually(Duration::from_secs(10), async || {
        ferry_memory(&soak.node).await == base_memory
    })
    .await;
    let end_memory = ferry_memory(&soak.node).await;
    let fds_back = eventually(Duration::from_secs(10), async || {
        open_fds() <= base_fds + FD_SLACK
    })
    .await;
    let end_fds = open_fds();
    let end_rss = resident();
    let end_threads = threads();

    let t = std::mem::take(&mut *tally.lock().expect("tally lock"));
    let c = &soak.chaos;
    let secs = soak_took.as_secs_f64();
    println!("\nsoak summary (seed {:#x})", settings.seed);
    println!("| | |\n| --- | ---: |");
    println!("| transfers asked | {} |", settings.transfers);
    println!(
        "| transfers issued | {}{} |",
        t.issued,
        if time_bounded {
            format!(" (stopped by the time bound, {} s)", settings.seconds)
        } else {
            String::new()
        }
    );
    println!(
        "| verified (send + echo, every byte checked) | {} |",
        t.verified
    );
    println!(
        "| verified bytes, one way | {} ({:.2} GB) |",
        mib(t.bytes),
        t.bytes as f64 / 1e9
    );
    println!("| soak time | {secs:.1} s |");
    println!(
        "| rate | {:.0} transfers/s, {:.1} MB/s each way |",
        t.verified as f64 / secs,
        t.bytes as f64 / secs / 1e6
    );
    println!(
        "| kills (SIGKILL) / restarts | {} / {} (restart retries {}, slowest {} ms) |",
        c.kills.load(Ordering::Relaxed),
        c.restarts.load(Ordering::Relaxed),
        c.retries.load(Ordering::Relaxed),
        c.slowest_ms.load(Ordering::Relaxed)
    );
    println!(
        "| failed, expected (peer down or killed) | {} |",
        t.failed() - t.unexpected.len() as u64
    );
    for (what, n) in &t.expected {
        println!("| &nbsp;&nbsp;{what} | {n} |");
    }
    println!("| failed, unexpected | {} |", t.unexpected.len());
    println!("| checksum mismatches | {} |", t.mismatches.len());
    println!(
        "| hangs (past deadline + {} s) | {} |",
        HANG_SLACK.as_secs(),
        t.hangs.len()
    );
    println!(
        "| longest transfer (deadline {} s) | {:.2} s |",
        DEADLINE.as_secs(),
        t.longest.as_secs_f64()
    );
    println!("| late echoes drained at the end | {late} |");
    println!("| fds baseline → end | {base_fds} → {end_fds} |");
    // Ten samples spread over the run show a trend: a leak climbs, an allocator levels off.
    let step = rss_samples.len().div_ceil(10).max(1);
    println!(
        "| RSS baseline → end | {} → {} (during, MiB, every {step} s: {}; peak {}) |",
        mib(base_rss),
        mib(end_rss),
        rss_samples
            .iter()
            .step_by(step)
            .map(|r| format!("{:.0}", *r as f64 / MIB as f64))
            .collect::<Vec<_>>()
            .join(", "),
        mib(rss_samples.iter().copied().max().unwrap_or(0))
    );
    println!("| threads baseline → end | {base_threads} → {end_threads} |");
    println!(
        "| ferry host memory granted, waiting, exported: baseline → end | {:?} → {:?} |",
        base_memory, end_memory
    );
    let show = |list: &[String]| {
        list.iter()
            .take(10)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n  ")
    };
    assert!(
        t.mismatches.is_empty(),
        "checksum mismatches (seed {:#x}):\n  {}",
        settings.seed,
        show(&t.mismatches)
    );
    assert!(
        t.hangs.is_empty(),
        "transfers outlived their deadline (seed {:#x}):\n  {}",
        settings.seed,
        show(&t.hangs)
    );
    assert!(
        t.unexpected.is_empty(),
        "failures with no kill to explain them (seed {:#x}):\n  {}",
        settings.seed,
        show(&t.unexpected)
    );
    if !time_bounded {
        assert_eq!(
            t.issued, settings.transfers,
            "every transfer asked was issued"
        );
    }
    assert!(
        t.verified * 10 >= t.issued * 9,
        "only {} of {} transfers verified",
        t.verified,
        t.issued
    );
    assert!(
        memory_back,
        "ferry's host memory did not return: {base_memory:?} → {end_memory:?}"
    );
    assert!(fds_back, "fds did not return: {base_fds} → {end_fds}");
    assert!(
        end_rss <= base_rss + settings.rss_slack,
        "RSS grew from {} to {} (more than FERRY_SOAK_RSS_SLACK_MIB)",
        mib(base_rss),
        mib(end_rss)
    );
    if let Ok(soak) = Arc::try_unwrap(soak) {
        soak.node.shutdown().await;
    }
}
