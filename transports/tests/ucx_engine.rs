//! The UCX engine on the real library: two engines in one process over tcp loopback, and
//! a peer in another process (this test binary run again with `FERRY_UCX_ENGINE_CHILD=peer`)
//! that is killed or stopped mid-transfer.
//!
//! Each test skips, saying why, where UCX does not load, unless `FERRY_UCX_TESTS=1`.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ferry_transports::ucx::{
    Engine, OpKind, Operation, PeerFailure, Registration, RemoteKey, RmaPath, UcxPeer, UcxSettings,
    UcxTransportError,
};
use ucx_sys::testing::ucx_test;

const CHILD_ENV: &str = "FERRY_UCX_ENGINE_CHILD";
/// Set (to `get` or `put`) in a child that loops over the parent's memory.
const CLIENT_ENV: &str = "FERRY_UCX_ENGINE_CLIENT";
/// The child's registered memory.
const CHILD_LEN: usize = 64 << 20;
const CHILD_SEED: u64 = 11;
/// A deadline for things that take milliseconds when healthy.
const PATIENT: Duration = Duration::from_secs(30);

/// Loopback over tcp (`FERRY_UCX_TEST_TLS` overrides the transports).
fn settings() -> UcxSettings {
    let mut s = UcxSettings::default();
    s.tls = Some(std::env::var("FERRY_UCX_TEST_TLS").unwrap_or_else(|_| "tcp".into()));
    s.options = vec![("NET_DEVICES".into(), "lo".into())];
    s
}

fn engine(s: &UcxSettings) -> Engine {
    Engine::start(s).expect("the engine starts")
}

/// `len` bytes that differ per `seed` and position (xorshift64).
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + 8);
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    if a.len() != b.len() {
        return Some(a.len().min(b.len()));
    }
    a.iter().zip(b).position(|(x, y)| x != y)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn mbps(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e6
}

/// Host memory registered with an engine. The registration is dropped before the bytes
/// (fields drop in declaration order).
struct Exposed {
    registration: Option<Registration>,
    bytes: Vec<u8>,
}

impl Exposed {
    fn new(engine: &Engine, bytes: Vec<u8>) -> Self {
        let mut bytes = bytes;
        // SAFETY: `bytes` is owned by the returned value and is neither moved (its heap
        // block stays put) nor freed before the registration, which `Drop` drops first.
        let registration =
            unsafe { engine.register(bytes.as_mut_ptr(), bytes.len()) }.expect("register");
        Self {
            registration: Some(registration),
            bytes,
        }
    }

    fn registration(&self) -> &Registration {
        self.registration.as_ref().expect("registered")
    }

    fn key(&self, peer: &UcxPeer) -> RemoteKey {
        peer.remote_key(self.registration().rkey().to_vec())
            .expect("a key of our own engine")
    }

    fn address(&self, offset: usize) -> u64 {
        self.registration().address() + offset as u64
    }
}

/// Gets `len` bytes at `remote` into a new vector.
fn get(
    peer: &UcxPeer,
    len: usize,
    remote: u64,
    key: &RemoteKey,
) -> Result<Vec<u8>, UcxTransportError> {
    let mut local = vec![0u8; len];
    // SAFETY: `local` lives until `wait` returns, which is when UCX is done with it.
    unsafe { peer.get(local.as_mut_ptr(), len, remote, key) }?.wait()?;
    Ok(local)
}

/// Puts `data` at `remote` and flushes.
fn put_flushed(
    peer: &UcxPeer,
    data: &[u8],
    remote: u64,
    key: &RemoteKey,
) -> Result<(), UcxTransportError> {
    // SAFETY: `data` outlives `wait`, which returns when UCX is done with it.
    unsafe { peer.put(data.as_ptr(), data.len(), remote, key) }?.wait()?;
    peer.flush()?.wait()
}

#[test]
fn two_engines_get_and_put_byte_exact_from_0_b_to_64_mib() {
    if ucx_test("two_engines_get_and_put_byte_exact_from_0_b_to_64_mib").is_none() {
        return;
    }
    let s = settings();
    let (a, b) = (engine(&s), engine(&s));
    let to_b = a.connect(b.address()).expect("connect");
    let mut report = Vec::new();
    for (i, len) in [0usize, 1, 4096, 1 << 20, 64 << 20].into_iter().enumerate() {
        let seed = 100 + i as u64;
        let exposed = Exposed::new(&b, pattern(seed, len));
        let key = exposed.key(&to_b);
        let mut gets = Vec::new();
        let mut puts = Vec::new();
        for round in 0..3u64 {
            let start = Instant::now();
            let got = get(&to_b, len, exposed.address(0), &key).expect("get");
            gets.push(start.elapsed());
            assert_eq!(
                first_difference(&got, &pattern(seed, len)),
                None,
                "get of {len} B, round {round}"
            );
            let data = pattern(seed + 1000 + round, len);
            let start = Instant::now();
            put_flushed(&to_b, &data, exposed.address(0), &key).expect("put");
            puts.push(start.elapsed());
            assert_eq!(
                first_difference(&exposed.bytes, &data),
                None,
                "put of {len} B, round {round}"
            );
            // Back to the pattern for the next round's get.
            put_flushed(&to_b, &pattern(seed, len), exposed.address(0), &key).expect("restore");
        }
        let best = |v: &[Duration]| v.iter().copied().min().unwrap_or_default();
        report.push(format!(
            "{len} B: get {:.3} ms, put+flush {:.3} ms{}",
            ms(best(&gets)),
            ms(best(&puts)),
            if len >= 1 << 20 {
                format!(
                    " ({:.0} / {:.0} MB/s)",
                    mbps(len, best(&gets)),
                    mbps(len, best(&puts))
                )
            } else {
                String::new()
            }
        ));
    }
    println!(
        "two engines in one process, UCX {}, best of 3: {}",
        a.ucx_version(),
        report.join("; ")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_operations_from_tasks_then_a_flush() {
    if ucx_test("many_concurrent_operations_from_tasks_then_a_flush").is_none() {
        return;
    }
    const CHUNK: usize = 32 << 10;
    const CHUNKS: usize = 512;
    let s = settings();
    let (a, b) = (engine(&s), engine(&s));
    let to_b = std::sync::Arc::new(a.connect(b.address()).expect("connect"));
    let exposed = Exposed::new(&b, vec![0u8; CHUNK * CHUNKS]);
    let key = exposed.key(&to_b);
    let source = std::sync::Arc::new(pattern(7, CHUNK * CHUNKS));

    // Puts of every chunk from 8 tasks at once.
    let start = Instant::now();
    let mut tasks = Vec::new();
    for t in 0..8 {
        let (to_b, key, source) = (to_b.clone(), key.clone(), source.clone());
        let base = exposed.address(0);
        tasks.push(tokio::spawn(async move {
            let mut ops: Vec<Operation> = Vec::new();
            for c in (t..CHUNKS).step_by(8) {
                let at = c * CHUNK;
                // SAFETY: `source` is kept alive by this task until every operation on
                // it has completed (awaited below).
                ops.push(
                    unsafe { to_b.put(source[at..].as_ptr(), CHUNK, base + at as u64, &key) }
                        .expect("queued"),
                );
            }
            for op in ops {
                op.await.expect("put");
            }
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    to_b.flush().expect("queued").await.expect("flush");
    let puts = start.elapsed();
    assert_eq!(first_difference(&exposed.bytes, &source), None);

    // Gets of every chunk at once, into one buffer.
    let mut back = vec![0u8; CHUNK * CHUNKS];
    let start = Instant::now();
    let mut ops = Vec::new();
    for c in 0..CHUNKS {
        // SAFETY: `back` outlives the operations, all awaited below; chunks are disjoint.
        ops.push(
            unsafe {
                to_b.get(
                    back.as_mut_ptr().add(c * CHUNK),
                    CHUNK,
                    exposed.address(c * CHUNK),
                    &key,
                )
            }
            .expect("queued"),
        );
    }
    for op in ops {
        op.await.expect("get");
    }
    let gets = start.elapsed();
    assert_eq!(first_difference(&back, &source), None);

    // Small-operation latency, one at a time.
    let mut lat = Vec::new();
    let mut small = [0u8; 8];
    for _ in 0..2000 {
        let start = Instant::now();
        // SAFETY: `small` outlives the awaited operation.
        unsafe { to_b.get(small.as_mut_ptr(), 8, exposed.address(0), &key) }
            .expect("queued")
            .await
            .expect("small get");
        lat.push(start.elapsed());
    }
    lat.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!(
        "{CHUNKS} concurrent ops of {CHUNK} B: puts from 8 tasks + flush {:.1} ms, gets {:.1} ms; \
         8 B get round trip (async, 2000 in a row): p50 {:.1} us, p99 {:.1} us, max {:.1} us",
        ms(puts),
        ms(gets),
        us(lat[lat.len() / 2]),
        us(lat[lat.len() * 99 / 100]),
        us(lat[lat.len() - 1]),
    );
    assert_eq!(&small, &source[..8]);
}

#[test]
fn blocking_small_gets_from_a_plain_thread() {
    if ucx_test("blocking_small_gets_from_a_plain_thread").is_none() {
        return;
    }
    let s = settings();
    let (a, b) = (engine(&s), engine(&s));
    let to_b = a.connect(b.address()).expect("connect");
    let exposed = Exposed::new(&b, pattern(3, 4096));
    let key = exposed.key(&to_b);
    let mut lat = Vec::new();
    for _ in 0..2000 {
        let start = Instant::now();
        let got = get(&to_b, 8, exposed.address(8), &key).expect("get");
        lat.push(start.elapsed());
        assert_eq!(&got[..], &exposed.bytes[8..16]);
    }
    lat.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!(
        "8 B get round trip (blocking wait, 2000 in a row): p50 {:.1} us, p99 {:.1} us",
        us(lat[lat.len() / 2]),
        us(lat[lat.len() * 99 / 100]),
    );
}

/// Over tcp alone, a peer's endpoint names its lanes (`tcp` on `lo`), when created and
/// again after its first get, and is judged emulated; a UCX older than 1.14 says it cannot
/// tell, and the endpoint works all the same.
#[test]
fn an_endpoint_over_tcp_names_its_lanes_and_is_judged_emulated() {
    let Some(ucx) = ucx_test("an_endpoint_over_tcp_names_its_lanes_and_is_judged_emulated") else {
        return;
    };
    let mut s = settings();
    s.tls = Some("tcp".into());
    let (a, b) = (engine(&s), engine(&s));
    let to_b = a.connect(b.address()).expect("connect");
    let chosen = to_b.lanes();
    assert!(!chosen.after_first_use, "{chosen:?}");
    let exposed = Exposed::new(&b, pattern(7, 4096));
    let got = get(&to_b, 4096, exposed.address(0), &exposed.key(&to_b)).expect("get");
    assert_eq!(got, pattern(7, 4096));
    let used = to_b.lanes();
    println!(
        "UCX {}: created: {chosen}; after a get: {used}",
        ucx.version()
    );
    assert!(used.after_first_use, "{used:?}");
    if ucx.version() < ucx_sys::result::EP_TRANSPORTS_SINCE {
        assert_eq!(used.rma(), None, "{used:?}");
        assert!(!used.emulated());
        assert!(
            used.to_string().starts_with("unknown (UCX < 1.14"),
            "{used}"
        );
        return;
    }
    for lanes in [&chosen, &used] {
        let entries = lanes.lanes.as_ref().expect("UCX >= 1.14 names the lanes");
        assert!(!entries.is_empty(), "{lanes}");
        assert!(
            entries
                .iter()
                .all(|e| e.transport == "tcp" && e.device == "lo"),
            "{lanes}"
        );
        assert_eq!(lanes.rma(), Some(RmaPath::EmulatedOverTcp), "{lanes}");
        assert!(lanes.emulated());
    }
}

#[test]
fn a_forgotten_rkey_unpacks_again_and_the_cache_stays_bounded() {
    if ucx_test("a_forgotten_rkey_unpacks_again_and_the_cache_stays_bounded").is_none() {
        return;
    }
    let mut s = settings();
    s.rkey_cache = 2;
    let (a, b) = (engine(&s), engine(&s));
    let to_b = a.connect(b.address()).expect("connect");
    let exposed = Exposed::new(&b, pattern(5, 4096));
    let key = exposed.key(&to_b);
    assert_eq!(
        get(&to_b, 16, exposed.address(0), &key).expect("get"),
        &exposed.bytes[..16]
    );
    to_b.forget_rkey(&key).expect("forget");
    // The same bytes again: unpacked anew.
    assert_eq!(
        get(&to_b, 16, exposed.address(16), &key).expect("get"),
        &exposed.bytes[16..32]
    );

    // The remote registration goes away and comes back over the same memory.
    to_b.forget_rkey(&key).expect("forget");
    let Exposed {
        mut registration,
        mut bytes,
    } = exposed;
    drop(registration.take());
    // SAFETY: `bytes` outlives `again`, dropped at the end of this test before it.
    let again = unsafe { b.register(bytes.as_mut_ptr(), bytes.len()) }.expect("register");
    let key2 = to_b.remote_key(again.rkey().to_vec()).expect("key");
    assert_eq!(
        get(&to_b, 16, again.address() + 32, &key2).expect("get with the new key"),
        &bytes[32..48]
    );

    // More live keys than the cache holds, used round-robin: each eviction is a
    // destroy and a later re-unpack, and every get still works.
    let more: Vec<Exposed> = (0..5)
        .map(|i| Exposed::new(&b, pattern(20 + i, 64)))
        .collect();
    let keys: Vec<RemoteKey> = more.iter().map(|e| e.key(&to_b)).collect();
    for round in 0..4 {
        for (e, k) in more.iter().zip(&keys) {
            assert_eq!(
                get(&to_b, 64, e.address(0), k).expect("get"),
                e.bytes,
                "round {round}"
            );
        }
    }
    drop(again);
    drop(bytes);
}

#[test]
fn zero_length_registrations_and_operations_need_no_ucx() {
    if ucx_test("zero_length_registrations_and_operations_need_no_ucx").is_none() {
        return;
    }
    let s = settings();
    let (a, b) = (engine(&s), engine(&s));
    let to_b = a.connect(b.address()).expect("connect");
    // SAFETY: zero bytes: nothing is mapped.
    let empty = unsafe { b.register(std::ptr::null_mut(), 0) }.expect("register");
    assert!(empty.rkey().is_empty() && empty.is_empty());
    let key = to_b
        .remote_key(empty.rkey().to_vec())
        .expect("an empty key");
    assert!(
        get(&to_b, 0, empty.address(), &key)
            .expect("a 0-byte get")
            .is_empty()
    );
    // SAFETY: zero bytes are read.
    unsafe { to_b.put(std::ptr::null(), 0, 0, &key) }
        .expect("queued")
        .wait()
        .expect("a 0-byte put");
    let mut one = [0u8; 1];
    // SAFETY: refused before anything starts.
    let refused = unsafe { to_b.get(one.as_mut_ptr(), 1, 0, &key) };
    assert!(
        matches!(refused, Err(UcxTransportError::Misuse(_))),
        "{refused:?}"
    );
    // SAFETY: refused: null with a length.
    assert!(matches!(
        unsafe { b.register(std::ptr::null_mut(), 8) },
        Err(UcxTransportError::Misuse(_))
    ));
}

#[test]
fn garbage_addresses_and_keys_are_errors() {
    if ucx_test("garbage_addresses_and_keys_are_errors").is_none() {
        return;
    }
    let s = settings();
    let (a, b) = (engine(&s), engine(&s));
    let real = b.address();
    let mut flipped = real.clone();
    let last = flipped.len() - 1;
    flipped[last] ^= 0x40;
    let exposed = Exposed::new(&b, vec![1u8; 64]);
    let garbage: Vec<(&str, Vec<u8>)> = vec![
        ("empty", Vec::new()),
        ("random", pattern(99, 300)),
        ("zeros", vec![0; 4096]),
        ("truncated", real[..real.len() / 2].to_vec()),
        ("one bit flipped", flipped),
        ("a remote key", exposed.registration().rkey().to_vec()),
    ];
    for (what, bytes) in garbage {
        match a.connect(bytes) {
            Err(UcxTransportError::InvalidAddress(e)) => println!("{what}: {e}"),
            Err(other) => panic!("{what}: the wrong error: {other}"),
            Ok(_) => panic!("{what}: connected to garbage"),
        }
    }
    assert!(matches!(
        a.remote_key(pattern(98, 100)),
        Err(UcxTransportError::InvalidRkey(_))
    ));
    assert!(matches!(
        a.remote_key(real.clone()),
        Err(UcxTransportError::InvalidRkey(_))
    ));
    // The engine is unharmed.
    let to_b = a.connect(real).expect("connect");
    let key = exposed.key(&to_b);
    assert_eq!(
        get(&to_b, 64, exposed.address(0), &key).expect("get"),
        vec![1u8; 64]
    );
}

#[test]
fn dropping_the_engine_fails_what_is_pending_and_does_not_hang() {
    if ucx_test("dropping_the_engine_fails_what_is_pending_and_does_not_hang").is_none() {
        return;
    }
    const LEN: usize = 32 << 20;
    let mut s = settings();
    // Two in UCX, the rest queued when the engine goes.
    s.max_in_flight = 2;
    let (a, b) = (engine(&s), engine(&s));
    let to_b = a.connect(b.address()).expect("connect");
    let exposed = Exposed::new(&b, pattern(1, LEN));
    let key = exposed.key(&to_b);
    get(&to_b, 4096, exposed.address(0), &key).expect("warm-up");
    let mut locals: Vec<Vec<u8>> = (0..16).map(|_| vec![0u8; LEN]).collect();
    let mut ops = Vec::new();
    for local in &mut locals {
        // SAFETY: `locals` outlives every operation: each is waited on below, before
        // `locals` is dropped.
        ops.push(
            unsafe { to_b.get(local.as_mut_ptr(), LEN, exposed.address(0), &key) }.expect("queued"),
        );
    }
    let start = Instant::now();
    drop(a);
    let stopping = start.elapsed();
    let outcomes: Vec<_> = ops.into_iter().map(Operation::wait).collect();
    let stopped = outcomes
        .iter()
        .filter(|o| {
            matches!(
                o,
                Err(UcxTransportError::EngineStopped {
                    op: Some(OpKind::Get(LEN))
                })
            )
        })
        .count();
    let ok = outcomes.iter().filter(|o| o.is_ok()).count();
    println!(
        "engine dropped with 16 gets of 32 MiB pending: the drop took {:.1} ms; {ok} completed, \
         {stopped} failed with: {}",
        ms(stopping),
        outcomes
            .iter()
            .find_map(|o| o.as_ref().err())
            .map_or("-".into(), |e| e.to_string())
    );
    assert_eq!(ok + stopped, 16, "{outcomes:?}");
    assert!(stopped > 0, "every get finished before the drop");
    assert!(
        stopping < Duration::from_secs(5),
        "the drop took {stopping:?}"
    );
    for (local, o) in locals.iter().zip(&outcomes) {
        if o.is_ok() {
            assert_eq!(first_difference(local, &exposed.bytes), None);
        }
    }
    // The peer handle outlives its engine: new operations are refused, dropping is fine.
    let mut one = [0u8; 1];
    // SAFETY: refused before anything starts.
    let late = unsafe { to_b.get(one.as_mut_ptr(), 1, exposed.address(0), &key) };
    assert!(
        matches!(late, Err(UcxTransportError::EngineStopped { .. })),
        "{late:?}"
    );
    drop(to_b);
}

/// The peer process's body; a no-op when run as an ordinary test. It exposes
/// [`CHILD_LEN`] bytes of pattern [`CHILD_SEED`] and serves until stdin closes.
#[test]
fn child_engine() {
    if std::env::var(CHILD_ENV).as_deref() != Ok("peer") {
        return;
    }
    let engine = engine(&settings());
    let exposed = Exposed::new(&engine, pattern(CHILD_SEED, CHILD_LEN));
    let mut out = std::io::stdout().lock();
    writeln!(out, "UCX address {}", hex(&engine.address())).expect("stdout");
    writeln!(out, "UCX rkey {}", hex(exposed.registration().rkey())).expect("stdout");
    writeln!(out, "UCX memory {}", exposed.address(0)).expect("stdout");
    out.flush().expect("stdout");
    drop(out);
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
}

/// The parent's side of a child engine.
struct ChildPeer {
    child: Child,
    peer: UcxPeer,
    key: RemoteKey,
    memory: u64,
}

impl Drop for ChildPeer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn_child(engine: &Engine) -> ChildPeer {
    let mut child = Command::new(std::env::current_exe().expect("the test binary"))
        .args(["--exact", "child_engine", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, "peer")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("the child starts");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            let _ = tx.send(line);
        }
    });
    let field = |name: &str| -> String {
        let marker = format!("UCX {name} ");
        loop {
            match rx.recv_timeout(PATIENT) {
                // libtest prints "test child_engine ... " before the first line.
                Ok(line) => {
                    if let Some(at) = line.find(&marker) {
                        return line[at + marker.len()..].trim().to_owned();
                    }
                }
                Err(e) => panic!("no {name} from the child: {e}"),
            }
        }
    };
    let (address, rkey, memory) = (field("address"), field("rkey"), field("memory"));
    let peer = engine
        .connect(unhex(&address))
        .expect("connect to the child");
    let key = peer.remote_key(unhex(&rkey)).expect("the child's key");
    ChildPeer {
        child,
        peer,
        key,
        memory: memory.parse().expect("an address"),
    }
}

/// CPU time (user + system, in clock ticks) of the thread named `ferry-ucx` in process
/// `pid`.
fn progress_thread_ticks(pid: u32) -> u64 {
    let mut total = 0;
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("the child's threads");
    for task in tasks.flatten() {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            continue;
        };
        // "tid (comm) state ..." with utime and stime the 14th and 15th fields.
        let Some((head, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        if !head.ends_with("(ferry-ucx") {
            continue;
        }
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let tick = |i: usize| {
            fields
                .get(i)
                .and_then(|f| f.parse::<u64>().ok())
                .unwrap_or(0)
        };
        total += tick(11) + tick(12);
    }
    total
}

#[test]
fn an_idle_engine_sleeps_and_a_peer_wakes_it() {
    if ucx_test("an_idle_engine_sleeps_and_a_peer_wakes_it").is_none() {
        return;
    }
    let a = engine(&settings());
    let c = spawn_child(&a);
    let pid = c.child.id();
    // Serve something first, so the child's thread has been busy and must go back to sleep.
    get(&c.peer, 1 << 20, c.memory, &c.key).expect("get");
    let window = Duration::from_secs(1);
    let before = progress_thread_ticks(pid);
    std::thread::sleep(window);
    let idle = progress_thread_ticks(pid) - before;
    // Each get needs the sleeping child to wake up on its socket.
    let mut lat = Vec::new();
    for _ in 0..100 {
        std::thread::sleep(Duration::from_millis(2));
        let start = Instant::now();
        get(&c.peer, 8, c.memory, &c.key).expect("a get wakes the child");
        lat.push(start.elapsed());
    }
    lat.sort();
    println!(
        "idle child engine: {idle} clock ticks of CPU in {window:?}; 8 B get with both \
         engines asleep: p50 {:.0} us, p90 {:.0} us",
        lat[50].as_secs_f64() * 1e6,
        lat[90].as_secs_f64() * 1e6
    );
    assert!(
        idle <= 5,
        "the idle progress thread used {idle} ticks in {window:?}"
    );
}

#[test]
fn a_killed_peer_process_fails_every_operation_within_2_s() {
    if ucx_test("a_killed_peer_process_fails_every_operation_within_2_s").is_none() {
        return;
    }
    let a = engine(&settings());
    let mut c = spawn_child(&a);
    let pid = c.child.id();

    // Healthy first: 64 MiB from the other process, byte for byte.
    let start = Instant::now();
    let got = get(&c.peer, CHILD_LEN, c.memory, &c.key).expect("64 MiB get");
    let took = start.elapsed();
    assert_eq!(
        first_difference(&got, &pattern(CHILD_SEED, CHILD_LEN)),
        None
    );
    let data = pattern(12, CHILD_LEN);
    let start = Instant::now();
    put_flushed(&c.peer, &data, c.memory, &c.key).expect("64 MiB put");
    let put_took = start.elapsed();
    println!(
        "from another process over tcp loopback: get 64 MiB {:.1} ms ({:.0} MB/s), \
         put+flush 64 MiB {:.1} ms ({:.0} MB/s)",
        ms(took),
        mbps(CHILD_LEN, took),
        ms(put_took),
        mbps(CHILD_LEN, put_took)
    );

    // Many megabytes in flight both ways, then the peer dies.
    const CHUNK: usize = 16 << 20;
    let mut gets: Vec<Vec<u8>> = (0..4).map(|_| vec![0u8; CHUNK]).collect();
    let mut ops = Vec::new();
    for (i, local) in gets.iter_mut().enumerate() {
        let at = c.memory + (i * CHUNK) as u64;
        // SAFETY: `gets` and `data` outlive the operations, all waited on below.
        unsafe {
            ops.push(
                c.peer
                    .get(local.as_mut_ptr(), CHUNK, at, &c.key)
                    .expect("queued"),
            );
            ops.push(
                c.peer
                    .put(data.as_ptr(), CHUNK, at, &c.key)
                    .expect("queued"),
            );
        }
    }
    c.child.kill().expect("SIGKILL the child");
    let killed = Instant::now();
    let _ = c.child.wait();
    let outcomes: Vec<_> = ops.into_iter().map(Operation::wait).collect();
    let all_done = killed.elapsed();
    let failed: Vec<&UcxTransportError> =
        outcomes.iter().filter_map(|o| o.as_ref().err()).collect();
    println!(
        "child killed with 8 x 16 MiB in flight: {} of 8 failed, all done {:.0} ms after the \
         kill; first error: {}",
        failed.len(),
        ms(all_done),
        failed.first().map_or("none".into(), |e| e.to_string())
    );
    assert!(all_done <= Duration::from_secs(2), "took {all_done:?}");
    assert!(
        !failed.is_empty(),
        "every operation completed: the kill came too late"
    );
    for e in &failed {
        assert!(e.is_peer_failure(), "not a peer failure: {e}");
        let text = e.to_string();
        assert!(
            text.contains(&format!("pid {pid}")),
            "the error names the peer: {text}"
        );
        assert!(
            text.contains("16777216 B"),
            "the error names the operation: {text}"
        );
    }
    // Later operations fail at once, without UCX.
    let start = Instant::now();
    let late = get(&c.peer, 8, c.memory, &c.key).expect_err("the peer is gone");
    assert!(
        matches!(late, UcxTransportError::PeerFailed { .. }),
        "{late}"
    );
    assert!(start.elapsed() < Duration::from_millis(100));
    assert!(c.peer.flush().expect("queued").wait().is_err());
}

#[test]
fn a_stopped_peer_process_times_out_and_the_endpoint_is_closed() {
    if ucx_test("a_stopped_peer_process_times_out_and_the_endpoint_is_closed").is_none() {
        return;
    }
    let mut s = settings();
    s.op_timeout = Duration::from_secs(1);
    let a = engine(&s);
    let c = spawn_child(&a);
    get(&c.peer, 4096, c.memory, &c.key).expect("warm-up");
    let pid = nix::unistd::Pid::from_raw(i32::try_from(c.child.id()).expect("a pid"));
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).expect("SIGSTOP");
    let stopped = Instant::now();
    let mut local = vec![0u8; 16 << 20];
    let mut small = [0u8; 8];
    // SAFETY: `local` and `small` outlive the operations, waited on below.
    let (big, tiny) = unsafe {
        (
            c.peer
                .get(local.as_mut_ptr(), local.len(), c.memory, &c.key)
                .expect("queued"),
            c.peer
                .get(small.as_mut_ptr(), 8, c.memory, &c.key)
                .expect("queued"),
        )
    };
    let big = big.wait();
    let tiny = tiny.wait();
    let took = stopped.elapsed();
    println!(
        "stopped child, op_timeout 1 s: failed after {:.0} ms: {}; the other: {}",
        ms(took),
        big.as_ref().err().map_or("ok".into(), |e| e.to_string()),
        tiny.as_ref().err().map_or("ok".into(), |e| e.to_string()),
    );
    assert!(
        matches!(
            big,
            Err(UcxTransportError::TimedOut {
                op: OpKind::Get(_),
                ..
            })
        ),
        "{big:?}"
    );
    assert!(
        matches!(
            tiny,
            Err(UcxTransportError::TimedOut { .. })
                | Err(UcxTransportError::PeerFailed {
                    cause: PeerFailure::TimedOut { .. },
                    ..
                })
        ),
        "{tiny:?}"
    );
    assert!(
        took >= Duration::from_secs(1) && took < Duration::from_secs(3),
        "{took:?}"
    );
    // SIGKILL ends a stopped process too (ChildPeer's drop).
}

/// A child that gets from (or puts to) the parent's memory in a loop, until killed. It
/// reads the parent's address, key and memory address from stdin, and says "UCX busy"
/// after its first operation.
#[test]
fn child_client() {
    let Ok(mode) = std::env::var(CLIENT_ENV) else {
        return;
    };
    let engine = engine(&settings());
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).expect("stdin");
    let fields: Vec<&str> = line.split_whitespace().collect();
    let [address, rkey, memory] = fields[..] else {
        panic!("expected address, key and memory: {line:?}");
    };
    let peer = engine.connect(unhex(address)).expect("connect");
    let key = peer.remote_key(unhex(rkey)).expect("key");
    let memory: u64 = memory.parse().expect("memory");
    let mut buf = vec![0u8; CHILD_LEN];
    for round in 0.. {
        // SAFETY: `buf` outlives each wait.
        let op = unsafe {
            if mode == "put" {
                peer.put(buf.as_ptr(), CHILD_LEN, memory, &key)
            } else {
                peer.get(buf.as_mut_ptr(), CHILD_LEN, memory, &key)
            }
        };
        op.and_then(Operation::wait).expect("the parent serves");
        if round == 0 {
            println!("UCX busy");
        }
    }
}

/// Kills a child that is in the middle of a `mode` on this process's memory, then checks
/// that this process's engine still works.
fn killed_client_leaves_us_standing(mode: &str) {
    let a = engine(&settings());
    let exposed = Exposed::new(&a, pattern(1, CHILD_LEN));
    let mut child = Command::new(std::env::current_exe().expect("the test binary"))
        .args(["--exact", "child_client", "--nocapture", "--test-threads=1"])
        .env(CLIENT_ENV, mode)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("the child starts");
    let mut stdin = child.stdin.take().expect("stdin");
    writeln!(
        stdin,
        "{} {} {}",
        hex(&a.address()),
        hex(exposed.registration().rkey()),
        exposed.address(0)
    )
    .expect("to the child");
    stdin.flush().expect("to the child");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    while let Some(Ok(line)) = lines.next() {
        if line.contains("UCX busy") {
            break;
        }
    }
    child.kill().expect("SIGKILL the child");
    let _ = child.wait();
    // This process serves the dead child's last operations from its progress thread; it
    // must survive that, and keep working.
    let b = engine(&settings());
    let to_a = b.connect(a.address()).expect("connect");
    let key = exposed.key(&to_a);
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(2) {
        get(&to_a, 4096, exposed.address(0), &key).expect("the engine still works");
    }
}

#[test]
#[ignore = "UCX over tcp aborts this process: ucp_put_handler's completion meets the \
            failed endpoint (ucs_fatal 'unexpected error: Endpoint timeout'); measured \
            2026-11-24: 1.13 in 4 runs of 6, the 1.22 wheel in 1 of 6. Why a ucx push lends \
            memory only where writes are one-sided (transport.ucx.emulated_push)"]
fn a_client_killed_mid_put_to_us_leaves_us_standing() {
    if ucx_test("a_client_killed_mid_put_to_us_leaves_us_standing").is_none() {
        return;
    }
    killed_client_leaves_us_standing("put");
}

#[test]
#[ignore = "UCX 1.13 over tcp can abort this process the same way from ucp_get_req_handler \
            (seen with a forced close mid-get; a killed client survived 7 runs of 7)"]
fn a_client_killed_mid_get_from_us_leaves_us_standing() {
    if ucx_test("a_client_killed_mid_get_from_us_leaves_us_standing").is_none() {
        return;
    }
    killed_client_leaves_us_standing("get");
}

#[test]
fn handles_cross_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Engine>();
    send_sync::<UcxPeer>();
    send_sync::<Registration>();
    send_sync::<RemoteKey>();
    fn send<T: Send>() {}
    send::<Operation>();
}

/// What one registration costs (`ucp_mem_map` + packing its key, then `ucp_mem_unmap`),
/// the price of registering every transfer's buffer afresh: printed, not asserted (a
/// measurement; run with `--ignored --nocapture`).
#[test]
#[ignore = "a measurement: run with --ignored --nocapture"]
fn registration_cost() {
    if ucx_test("registration_cost").is_none() {
        return;
    }
    let a = engine(&settings());
    for len in [4 << 10, 1 << 20, 64 << 20] {
        let mut bytes = pattern(1, len);
        let rounds = 50u32;
        let mut mapped = Duration::ZERO;
        let mut unmapped = Duration::ZERO;
        for _ in 0..rounds {
            let t = Instant::now();
            // SAFETY: `bytes` outlives the registration, dropped in this iteration.
            let r = unsafe { a.register(bytes.as_mut_ptr(), bytes.len()) }.expect("register");
            mapped += t.elapsed();
            let t = Instant::now();
            drop(r);
            unmapped += t.elapsed();
        }
        println!(
            "{len} bytes: register {:?}, unregister {:?} (mean of {rounds})",
            mapped / rounds,
            unmapped / rounds
        );
    }
}
