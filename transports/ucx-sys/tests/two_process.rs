//! Two processes on loopback: this test binary runs itself again as the peer
//! (`FERRY_UCX_CHILD=peer`), and the two exchange worker addresses and rkeys over the
//! child's stdin and stdout, as ferry would over its link. Then: 64 MiB gets and puts
//! checked byte for byte on both sides, tagged messages, and a peer killed mid-operation.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{DEADLINE, first_difference, hex, loopback_context, mbps, pattern, unhex};
use ucx_sys::testing::ucx_test;
use ucx_sys::{Endpoint, MemoryHandle, PackedRkey, RemoteKey, Worker, WorkerAddress};

const CHILD_ENV: &str = "FERRY_UCX_CHILD";
const LEN: usize = 64 << 20;
/// Tag of messages from the parent to the child.
const CONTROL: u64 = 1;
/// Tag of the child's answers.
const REPLY: u64 = 2;
/// The child's memory starts with this pattern.
const CHILD_SEED: u64 = 11;

/// The peer process's body; a no-op when run as an ordinary test.
#[test]
fn child_peer() {
    if std::env::var(CHILD_ENV).as_deref() != Ok("peer") {
        return;
    }
    let ucx = ucx_sys::Ucx::load(None).expect("the child loads the parent's UCX");
    let worker = loopback_context(&ucx, None).worker().expect("worker");
    let memory = MemoryHandle::allocate(worker.context(), LEN).expect("mem_map");
    // SAFETY: the rkey is not published yet, so nothing else touches the memory.
    unsafe { memory.write(0, &pattern(CHILD_SEED, LEN)) }.expect("fill");

    let mut out = std::io::stdout().lock();
    let address = worker.address().expect("address");
    let rkey = memory.pack_rkey().expect("rkey");
    writeln!(out, "UCX address {}", hex(address.as_bytes())).expect("stdout");
    writeln!(out, "UCX rkey {}", hex(rkey.as_bytes())).expect("stdout");
    writeln!(out, "UCX memory {}", memory.address()).expect("stdout");
    out.flush().expect("stdout");

    let mut line = String::new();
    std::io::stdin()
        .read_line(&mut line)
        .expect("the parent's address");
    let parent = line
        .trim()
        .strip_prefix("address ")
        .expect("an address line");
    // SAFETY: the bytes are the parent's `Worker::address`, passed intact through a pipe
    // this process inherited from it (the test's stand-in for ferry's link).
    let parent = unsafe { WorkerAddress::from_bytes(unhex(parent)) };
    let to_parent = worker.connect(&parent).expect("endpoint to the parent");

    let started = Instant::now();
    loop {
        let mut control = worker
            .tag_recv(vec![0u8; 64], CONTROL, u64::MAX)
            .expect("control receive");
        let got = loop {
            if let Some(outcome) = control.poll() {
                break outcome.expect("a control message");
            }
            worker.progress();
            assert!(to_parent.failure().is_none(), "the parent went away");
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "the child outlived its test"
            );
        };
        let message = control.into_buffer().expect("complete");
        let message = String::from_utf8_lossy(&message[..got.bytes]).into_owned();
        let answer = match message.split_once(' ') {
            Some(("check", seed)) => {
                let expected = pattern(seed.parse().expect("a seed"), LEN);
                let mut actual = vec![0u8; LEN];
                // SAFETY: the parent flushed its put before asking, and sends nothing
                // more until it has the answer.
                unsafe { memory.read(0, &mut actual) }.expect("read");
                match first_difference(&actual, &expected) {
                    None => "ok".to_owned(),
                    Some(at) => format!("differs at byte {at}"),
                }
            }
            _ if message == "exit" => break,
            _ => format!("unknown message {message:?}"),
        };
        let mut reply = to_parent
            .tag_send(answer.into_bytes(), REPLY)
            .expect("reply");
        reply.wait(DEADLINE).expect("the reply is sent");
    }
}

/// The parent's side of one child: its process and pipes, and the endpoint to it.
struct Peer {
    child: Child,
    stdin: ChildStdin,
    worker: Worker,
    endpoint: Endpoint,
    rkey: RemoteKey,
    memory: u64,
}

fn spawn_peer(ucx: &ucx_sys::Ucx) -> Peer {
    let mut child = Command::new(std::env::current_exe().expect("the test binary"))
        .args(["--exact", "child_peer", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, "peer")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("the child starts");
    let stdin = child.stdin.take().expect("stdin");
    let stdout: ChildStdout = child.stdout.take().expect("stdout");
    // A reader thread, so a child that never answers fails the test instead of hanging it.
    // It drains the pipe to the end, so libtest's report in the child never meets a closed
    // pipe (which makes the child exit with 101).
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            let _ = tx.send(line);
        }
    });
    let field = |name: &str| -> String {
        // libtest prints "test child_peer ... " before the child's first line, so the
        // marker is searched for, not expected at the start.
        let marker = format!("UCX {name} ");
        loop {
            match rx.recv_timeout(DEADLINE) {
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

    let worker = loopback_context(ucx, None).worker().expect("worker");
    // SAFETY: the child's `Worker::address`, intact through its stdout pipe.
    let address = unsafe { WorkerAddress::from_bytes(unhex(&address)) };
    let endpoint = worker.connect(&address).expect("endpoint to the child");
    // SAFETY: the child's `MemoryHandle::pack_rkey`, intact through its stdout pipe.
    let rkey = unsafe { PackedRkey::from_bytes(unhex(&rkey)) };
    let rkey = endpoint
        .unpack_rkey(&rkey)
        .expect("unpack the child's rkey");
    let memory = memory.parse().expect("an address");

    let mut peer = Peer {
        child,
        stdin,
        worker,
        endpoint,
        rkey,
        memory,
    };
    let mine = hex(peer.worker.address().expect("address").as_bytes());
    writeln!(peer.stdin, "address {mine}").expect("to the child");
    peer.stdin.flush().expect("to the child");
    peer
}

impl Peer {
    /// Sends a control message and waits for the child's answer.
    fn ask(&self, message: &str) -> String {
        let mut answer = self
            .worker
            .tag_recv(vec![0u8; 256], REPLY, u64::MAX)
            .expect("answer receive");
        let mut send = self
            .endpoint
            .tag_send(message.as_bytes().to_vec(), CONTROL)
            .expect("control send");
        send.wait(DEADLINE).expect("sent");
        let got = answer.wait(DEADLINE).expect("the child answers");
        let bytes = answer.into_buffer().expect("complete");
        String::from_utf8_lossy(&bytes[..got.bytes]).into_owned()
    }

    fn finish(mut self) {
        let mut send = self
            .endpoint
            .tag_send(b"exit".to_vec(), CONTROL)
            .expect("exit send");
        send.wait(DEADLINE).expect("sent");
        let status = wait_child(&mut self.child, DEADLINE);
        assert!(status.success(), "the child failed: {status}");
    }
}

fn wait_child(child: &mut Child, deadline: Duration) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return status;
        }
        if start.elapsed() > deadline {
            let _ = child.kill();
            panic!("the child did not exit within {deadline:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn two_processes_get_and_put_64_mib_byte_exact() {
    let Some(ucx) = ucx_test("two_processes_get_and_put_64_mib_byte_exact") else {
        return;
    };
    let peer = spawn_peer(&ucx);
    let expected = pattern(CHILD_SEED, LEN);
    let mut gets = Vec::new();
    let mut puts = Vec::new();
    for round in 0..3u64 {
        let start = Instant::now();
        let mut get = peer
            .endpoint
            .get(vec![0u8; LEN], peer.memory, &peer.rkey)
            .expect("get_nbx");
        get.wait(DEADLINE).expect("the get completes");
        gets.push(start.elapsed());
        let got = get.into_buffer().expect("complete");
        assert_eq!(
            first_difference(&got, &expected),
            None,
            "round {round}: get"
        );

        let seed = 100 + round;
        let data = pattern(seed, LEN);
        let start = Instant::now();
        let mut put = peer
            .endpoint
            .put(data, peer.memory, &peer.rkey)
            .expect("put_nbx");
        put.wait(DEADLINE).expect("the put completes");
        peer.endpoint
            .flush()
            .expect("flush")
            .wait(DEADLINE)
            .expect("flushed");
        puts.push(start.elapsed());
        assert_eq!(
            peer.ask(&format!("check {seed}")),
            "ok",
            "round {round}: put"
        );

        // Restore the child's pattern for the next round's get.
        let mut put = peer
            .endpoint
            .put(expected.clone(), peer.memory, &peer.rkey)
            .expect("put_nbx");
        put.wait(DEADLINE).expect("restored");
        peer.endpoint
            .flush()
            .expect("flush")
            .wait(DEADLINE)
            .expect("flushed");
    }
    let best = |v: &[Duration]| v.iter().min().copied().unwrap_or_default();
    let ms = |v: &[Duration]| {
        v.iter()
            .map(|d| format!("{:.1}", d.as_secs_f64() * 1e3))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!(
        "two processes, UCX {} TLS={}: get 64 MiB [{}] ms, best {:.0} MB/s; \
         put+flush 64 MiB [{}] ms, best {:.0} MB/s",
        ucx.version(),
        common::test_tls(),
        ms(&gets),
        mbps(LEN, best(&gets)),
        ms(&puts),
        mbps(LEN, best(&puts)),
    );
    peer.finish();
}

#[test]
fn a_killed_peer_fails_pending_requests_within_2_s() {
    let Some(ucx) = ucx_test("a_killed_peer_fails_pending_requests_within_2_s") else {
        return;
    };
    let mut peer = spawn_peer(&ucx);
    // Connected and working first: one small get.
    let mut warm = peer
        .endpoint
        .get(vec![0u8; 4096], peer.memory, &peer.rkey)
        .expect("get");
    warm.wait(DEADLINE).expect("the warm-up get completes");

    // Many megabytes in flight both ways, then the peer dies.
    const CHUNK: usize = 16 << 20;
    let mut pending = Vec::new();
    for i in 0..4u64 {
        let at = peer.memory + (i as usize * CHUNK) as u64;
        pending.push(
            peer.endpoint
                .get(vec![0u8; CHUNK], at, &peer.rkey)
                .expect("get"),
        );
        pending.push(
            peer.endpoint
                .put(pattern(i, CHUNK), at, &peer.rkey)
                .expect("put"),
        );
    }
    for _ in 0..10 {
        peer.worker.progress();
    }
    peer.child.kill().expect("SIGKILL the child");
    let killed = Instant::now();
    let _ = peer.child.wait();

    let mut outcomes: Vec<Option<Result<usize, ucx_sys::UcxError>>> = vec![None; pending.len()];
    while outcomes.iter().any(Option::is_none) && killed.elapsed() < Duration::from_secs(10) {
        peer.worker.progress();
        for (request, outcome) in pending.iter_mut().zip(outcomes.iter_mut()) {
            if outcome.is_none() {
                *outcome = request.poll().map(|r| r.map(|t| t.bytes));
            }
        }
    }
    let took = killed.elapsed();
    let failed: Vec<_> = outcomes
        .iter()
        .flatten()
        .filter_map(|o| o.as_ref().err())
        .collect();
    println!(
        "peer killed: {} of {} requests failed, all done {:.0} ms after the kill; first error: {}; \
         endpoint failure: {}",
        failed.len(),
        pending.len(),
        took.as_secs_f64() * 1e3,
        failed.first().map_or("none".into(), |e| e.to_string()),
        peer.endpoint
            .failure()
            .map_or("none".into(), |e| e.to_string()),
    );
    assert!(
        outcomes.iter().all(Option::is_some),
        "requests still pending {took:?} after the kill"
    );
    assert!(
        took <= Duration::from_secs(2),
        "took {took:?} to fail the requests"
    );
    assert!(
        !failed.is_empty(),
        "every request completed; the kill came too late"
    );
    assert!(
        failed
            .iter()
            .all(|e| e.is_peer_failure() || e.is_canceled()),
        "not a peer failure: {failed:?}"
    );
    assert!(peer.endpoint.failure().is_some_and(|e| e.is_peer_failure()));
    // A new operation on the failed endpoint is refused or fails. (UCX 1.22 refuses it at
    // once, and yet warns "1 pending operations were not flushed" when the worker is
    // destroyed: its own count, no request of ours is left.)
    match peer.endpoint.get(vec![0u8; 8], peer.memory, &peer.rkey) {
        Err(refused) => assert!(refused.error.is_peer_failure(), "{}", refused.error),
        Ok(mut r) => assert!(r.wait(DEADLINE).is_err()),
    }
    drop(pending);
}
