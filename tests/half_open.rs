//! Half-open links: two real nodes on loopback, the sender dialing the receiver through a
//! TCP proxy that forwards both directions and can be made to swallow one (it reads that
//! direction's bytes and drops them) while both sockets stay open, as a path that lost one
//! direction holds them. Whichever direction goes silent, the side that waits on its peer
//! hears nothing from it and ends the link within the stall timeout: every send ends once,
//! `PeerLost`, long before its deadline, and the memory comes back on both nodes. A link
//! with nothing outstanding stays up however long it is quiet, and so does one whose peer
//! is quiet but there (it answers the keepalives).

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{Scratch, eventually, patterned};
use ferry::{ErrorKind, Node};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const STALL: Duration = Duration::from_secs(1);
/// The sends' deadline: an end by it, rather than by the stall timeout, is the bug.
const DEADLINE: Duration = Duration::from_secs(20);
/// The bytes must cross the proxied link: shm (which would read them out of the sender's
/// memory beside it) is off.
const LIMITS: &str = "[transport.shm]\nenabled = false\n\n\
                      [limits]\nstall_timeout = \"1s\"\ndefault_deadline = \"20s\"\n";
const SENDS: u64 = 4;
const LEN: usize = 32 << 20;
/// Bytes toward the receiver before a direction goes silent mid-transfer: the offers and
/// grants have crossed, and the first transfer's bytes are streaming.
const MID_TRANSFER: u64 = 8 << 20;

/// A direction through the proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Way {
    /// From the dialer (the sender) to the node it dials (the receiver).
    ToReceiver,
    /// Back.
    ToSender,
}

impl Way {
    fn index(self) -> usize {
        self as usize
    }
}

/// What the proxy's pumps share.
#[derive(Default)]
struct ProxyState {
    accepted: AtomicUsize,
    silent: [AtomicBool; 2],
    /// Bytes forwarded each way, over every connection.
    forwarded: [AtomicU64; 2],
    /// Once this many bytes went toward the receiver in all, this way goes silent.
    trigger: Mutex<Option<(u64, Way)>>,
    /// Bytes per second toward the receiver, at most (0: as fast as it goes).
    rate: AtomicU64,
}

impl ProxyState {
    /// Of `n` bytes just read going `way`, how many to forward (the rest are swallowed).
    fn admit(&self, way: Way, n: usize) -> usize {
        let mut trigger = self.trigger.lock().expect("trigger lock");
        if self.silent[way.index()].load(Ordering::SeqCst) {
            return 0;
        }
        let mut keep = n as u64;
        let before = self.forwarded[way.index()].load(Ordering::SeqCst);
        if way == Way::ToReceiver
            && let Some((after, silent)) = *trigger
            && before + keep >= after
        {
            self.silent[silent.index()].store(true, Ordering::SeqCst);
            *trigger = None;
            if silent == way {
                keep = after - before;
            }
        }
        self.forwarded[way.index()].fetch_add(keep, Ordering::SeqCst);
        keep as usize
    }
}

/// A TCP proxy in front of one listener, serving any number of connections.
struct Proxy {
    addr: String,
    state: Arc<ProxyState>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    async fn start(target: String) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let state = Arc::new(ProxyState::default());
        let shared = Arc::clone(&state);
        let task = tokio::spawn(async move {
            while let Ok((dialer, _)) = listener.accept().await {
                shared.accepted.fetch_add(1, Ordering::SeqCst);
                let Ok(node) = TcpStream::connect(&target).await else {
                    continue;
                };
                let _ = (dialer.set_nodelay(true), node.set_nodelay(true));
                let (from_dialer, to_dialer) = dialer.into_split();
                let (from_node, to_node) = node.into_split();
                tokio::spawn(pump(Way::ToReceiver, from_dialer, to_node, shared.clone()));
                tokio::spawn(pump(Way::ToSender, from_node, to_dialer, shared.clone()));
            }
        });
        Self { addr, state, task }
    }

    /// `way` goes silent now.
    fn silence(&self, way: Way) {
        self.state.silent[way.index()].store(true, Ordering::SeqCst);
    }

    /// `way` goes silent once `bytes` more have gone toward the receiver.
    fn silence_after(&self, bytes: u64, way: Way) {
        let mut trigger = self.state.trigger.lock().expect("trigger lock");
        let sent = self.state.forwarded[Way::ToReceiver.index()].load(Ordering::SeqCst);
        *trigger = Some((sent + bytes, way));
    }

    /// Forwards at most `bytes_per_second` toward the receiver from now on.
    fn throttle(&self, bytes_per_second: u64) {
        self.state.rate.store(bytes_per_second, Ordering::SeqCst);
    }

    fn accepted(&self) -> usize {
        self.state.accepted.load(Ordering::SeqCst)
    }

    fn forwarded(&self) -> u64 {
        self.state
            .forwarded
            .iter()
            .map(|f| f.load(Ordering::SeqCst))
            .sum()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Copies one direction of a connection. When its source ends, the end is passed on,
/// unless the direction is silent: then both sockets stay open (the task holds them until
/// the test's runtime ends), as a path that lost one direction holds them.
async fn pump(
    way: Way,
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    state: Arc<ProxyState>,
) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let keep = state.admit(way, n);
        if keep > 0 && to.write_all(&buf[..keep]).await.is_err() {
            return;
        }
        let rate = state.rate.load(Ordering::SeqCst);
        if way == Way::ToReceiver && rate > 0 {
            // Shapes the traffic (it times no event).
            tokio::time::sleep(Duration::from_secs_f64(keep as f64 / rate as f64)).await;
        }
    }
    if state.silent[way.index()].load(Ordering::SeqCst) {
        let _held = (from, to);
        std::future::pending::<()>().await
    } else {
        let _ = to.shutdown().await;
    }
}

/// The receiver `b`, the proxy in front of it, and the sender `a` linked to `b` through it.
struct Bed {
    _scratch: Scratch,
    a: Node,
    b: Node,
    proxy: Proxy,
}

impl Bed {
    async fn new(receiver_extra: &str) -> Self {
        let scratch = Scratch::new();
        let b = Node::start(scratch.config("b", &[], &format!("{LIMITS}{receiver_extra}")))
            .await
            .expect("b starts");
        let proxy = Proxy::start(b.tcp_addrs()[0].clone()).await;
        let a = Node::start(scratch.config("a", &[("b", &proxy.addr)], LIMITS))
            .await
            .expect("a starts");
        a.connect("b")
            .await
            .expect("a links to b through the proxy");
        Self {
            _scratch: scratch,
            a,
            b,
            proxy,
        }
    }

    async fn shutdown(self) {
        self.a.shutdown().await;
        self.b.shutdown().await;
    }
}

async fn host_granted(node: &Node) -> u64 {
    node.host_memory().await.expect("stats").granted
}

/// Four 32 MiB sends from `a` to `b` at once while `silence` makes one direction go quiet;
/// each must end `PeerLost`, saying the peer went silent or left, within three stall
/// timeouts of the sends' start (their deadline is 20), and nothing may hang. Gives the
/// buffers back, by tag.
async fn sends_end_lost(bed: &Bed, silence: impl FnOnce(&Proxy)) -> Vec<ferry::Buffer> {
    let mut buffers = Vec::new();
    for tag in 0..SENDS {
        buffers.push(patterned(&bed.a, LEN, tag).await);
    }
    silence(&bed.proxy);
    let started = Instant::now();
    let sends = buffers.into_iter().enumerate().map(|(tag, buffer)| {
        let a = &bed.a;
        async move { (a.send("b", tag as u64, buffer).await, started.elapsed()) }
    });
    let ended = tokio::time::timeout(DEADLINE + STALL * 10, futures::future::join_all(sends))
        .await
        .expect("every send ends");
    let mut sent = Vec::new();
    for (tag, (result, took)) in ended.into_iter().enumerate() {
        let error = result.expect_err("a send over a half-open link cannot complete");
        eprintln!("send {tag} ended after {took:?}: {error}");
        assert_eq!(
            error.kind(),
            ErrorKind::PeerLost,
            "send {tag} ended after {took:?}: {error}"
        );
        assert!(
            took < STALL * 3,
            "send {tag} ended after {took:?} (stall timeout {STALL:?}, deadline {DEADLINE:?}): \
             {error}"
        );
        sent.push(error.buffer.expect("the buffer comes back"));
    }
    sent
}

/// Waits until `node` holds `baseline` bytes of host memory again.
async fn memory_back(node: &Node, baseline: u64, what: &str) {
    let back = eventually(STALL * 5, async || host_granted(node).await == baseline).await;
    assert!(
        back,
        "{what} still holds {} bytes of host memory, {baseline} before",
        host_granted(node).await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_receiver_to_sender_direction_mid_transfer_ends_the_sends_by_the_stall_timeout() {
    // The grants have crossed and the bytes stream; the receiver's Done frames are lost.
    let bed = Bed::new("").await;
    let (a0, b0) = (host_granted(&bed.a).await, host_granted(&bed.b).await);
    let sent = sends_end_lost(&bed, |p| p.silence_after(MID_TRANSFER, Way::ToSender)).await;
    // What crossed whole before the sender gave up (all of it, unless the machine is so
    // loaded that 128 MiB take a stall timeout to stream) was delivered, byte-exact.
    let mut delivered = 0;
    for (tag, sent) in sent.iter().enumerate() {
        let got = tokio::time::timeout(STALL, bed.b.recv(Some("a"), Some(tag as u64))).await;
        let Ok(got) = got else { continue };
        let got = got.expect("delivered");
        assert!(
            got.buffer.to_vec().expect("host") == sent.to_vec().expect("host"),
            "transfer {tag} arrived damaged"
        );
        delivered += 1;
    }
    eprintln!("the receiver has {delivered} of the {SENDS} transfers whose Done was lost");
    drop(sent);
    memory_back(&bed.a, a0, "the sender").await;
    memory_back(&bed.b, b0, "the receiver").await;
    bed.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_receiver_to_sender_direction_before_the_grants_ends_the_sends_by_the_stall_timeout()
 {
    // The receiver reserves and grants; the grants are lost.
    let bed = Bed::new("").await;
    let (a0, b0) = (host_granted(&bed.a).await, host_granted(&bed.b).await);
    let sent = sends_end_lost(&bed, |p| p.silence(Way::ToSender)).await;
    drop(sent);
    memory_back(&bed.a, a0, "the sender").await;
    memory_back(&bed.b, b0, "the receiver").await;
    bed.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_sender_to_receiver_direction_mid_transfer_ends_the_sends_by_the_stall_timeout() {
    // The receiver has granted and waits for the rest of the bytes.
    let bed = Bed::new("").await;
    let (a0, b0) = (host_granted(&bed.a).await, host_granted(&bed.b).await);
    let sent = sends_end_lost(&bed, |p| p.silence_after(MID_TRANSFER, Way::ToReceiver)).await;
    drop(sent);
    memory_back(&bed.a, a0, "the sender").await;
    memory_back(&bed.b, b0, "the receiver").await;
    bed.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_sender_to_receiver_direction_before_the_offers_ends_the_sends_by_the_stall_timeout()
 {
    // The offers are lost: the receiver never hears of the sends, and has nothing to say.
    let bed = Bed::new("").await;
    let a0 = host_granted(&bed.a).await;
    let sent = sends_end_lost(&bed, |p| p.silence(Way::ToReceiver)).await;
    drop(sent);
    memory_back(&bed.a, a0, "the sender").await;
    bed.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_link_through_the_proxy_stays_up_and_quiet() {
    let bed = Bed::new("").await;
    let before = bed.proxy.forwarded();
    // Nothing outstanding for several stall timeouts: a window in which nothing may happen.
    tokio::time::sleep(STALL * 5).await;
    assert_eq!(
        bed.proxy.forwarded(),
        before,
        "an idle link exchanged bytes (keepalives are for links that wait on the peer)"
    );
    let buffer = patterned(&bed.a, 1 << 20, 1).await;
    bed.a
        .send("b", 1, buffer)
        .await
        .expect("the link still works");
    let got = bed.b.recv(Some("a"), Some(1)).await.expect("delivered");
    assert_eq!(got.buffer.len(), 1 << 20);
    assert_eq!(
        bed.proxy.accepted(),
        1,
        "the idle link was ended and dialed again"
    );
    bed.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_is_quiet_but_there_keeps_the_link_while_a_send_waits_on_it() {
    // The receiver takes one 1 MiB transfer at a time from a peer: the second waits for the
    // application to take the first, and the sender waits for its grant, hearing nothing
    // but the answers to its keepalives, for several stall timeouts.
    let bed = Bed::new("peer_inbound_bytes = \"1MiB\"\n").await;
    let first = patterned(&bed.a, 1 << 20, 1).await;
    bed.a.send("b", 1, first).await.expect("the first fits");
    let second = patterned(&bed.a, 1 << 20, 2).await;
    let mut second = Box::pin(bed.a.send("b", 2, second));
    let before = bed.proxy.forwarded();
    let waited = tokio::time::timeout(STALL * 5, second.as_mut()).await;
    assert!(
        waited.is_err(),
        "the second send ended while the first was not taken: {waited:?}"
    );
    assert!(
        bed.proxy.forwarded() > before,
        "no keepalive crossed the link while the send waited"
    );
    let got = bed.b.recv(Some("a"), Some(1)).await.expect("delivered");
    drop(got);
    tokio::time::timeout(STALL * 5, second)
        .await
        .expect("the second send ends once there is room")
        .expect("the second send completes on the same link");
    assert_eq!(
        bed.proxy.accepted(),
        1,
        "the link was ended while a send waited"
    );
    bed.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_longer_than_the_stall_timeout_to_a_quiet_receiver_keeps_the_link() {
    // 48 MiB at 16 MiB/s: three stall timeouts of streaming, during which the receiver,
    // only reading, has nothing to send but its answers to the keepalives, which must
    // overtake the stream to reach it.
    let bed = Bed::new("").await;
    bed.proxy.throttle(16 << 20);
    let buffer = patterned(&bed.a, 48 << 20, 7).await;
    let started = Instant::now();
    bed.a
        .send("b", 7, buffer)
        .await
        .expect("the slow stream completes");
    let took = started.elapsed();
    assert!(
        took > STALL * 2,
        "the stream took {took:?}: not slower than the stall timeout"
    );
    let got = bed.b.recv(Some("a"), Some(7)).await.expect("delivered");
    assert_eq!(got.buffer.len(), 48 << 20);
    assert_eq!(
        bed.proxy.accepted(),
        1,
        "the link was ended while it streamed"
    );
    bed.shutdown().await;
}
