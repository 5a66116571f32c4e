//! Control links over real sockets: handshakes that succeed and fail, hostile raw peers,
//! bad frames after authentication, and ordered delivery.

use std::sync::Arc;
use std::time::Duration;

use ferry_transports::link::{
    Endpoint, Link, LinkCounters, LinkError, LinkOptions, Listener, Secret, accept_handshake, dial,
    host_id, local_hello,
};
use ferry_transports::wire::{
    DataChunk, FrameError, FrameHeader, FrameKind, HEADER_LEN, Message, PROTOCOL_VERSION, PutChunk,
    encode, encode_payload, read_frame,
};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;

const CAP: u32 = 1 << 20;
/// Long enough never to fire in a passing test, short enough to end a hung one.
const PATIENT: Duration = Duration::from_secs(20);
const SHORT: Duration = Duration::from_millis(200);

fn options(timeout: Duration) -> LinkOptions {
    LinkOptions {
        max_frame: CAP,
        handshake_timeout: timeout,
        stall_timeout: timeout,
        counters: Arc::new(LinkCounters::new()),
    }
}

fn secret() -> Secret {
    Secret::new(b"correct horse battery staple".to_vec())
}

async fn tcp_listener() -> (Listener, Endpoint) {
    let listener = match Listener::bind_tcp("127.0.0.1:0").await {
        Ok(l) => l,
        Err(e) => panic!("bind: {e}"),
    };
    let endpoint = match listener.endpoint() {
        Ok(e) => e,
        Err(e) => panic!("local addr: {e}"),
    };
    (listener, endpoint)
}

fn tcp_addr(endpoint: &Endpoint) -> String {
    match endpoint {
        Endpoint::Tcp(addr) => addr.clone(),
        Endpoint::Unix(_) => panic!("not tcp"),
    }
}

/// Accepts one connection and runs the acceptor's handshake in a task.
fn serve_one(
    listener: Listener,
    secret: Secret,
    opts: LinkOptions,
) -> JoinHandle<Result<Link, LinkError>> {
    tokio::spawn(async move {
        let (accepted, _peer) = listener.accept().await?;
        let hello = local_hello(
            "server",
            vec![ferry_config::TransportName::Tcp],
            opts.max_frame,
        );
        accept_handshake(accepted, &secret, hello, &opts).await
    })
}

async fn joined(task: JoinHandle<Result<Link, LinkError>>) -> Result<Link, LinkError> {
    match task.await {
        Ok(result) => result,
        Err(e) => panic!("server task: {e}"),
    }
}

async fn connected_pair(endpoint: Endpoint, listener: Listener) -> (Link, Link) {
    let (client, server, _) = connected_pair_counted(endpoint, listener).await;
    (client, server)
}

/// Like [`connected_pair`], also returning the server's counters.
async fn connected_pair_counted(
    endpoint: Endpoint,
    listener: Listener,
) -> (Link, Link, Arc<LinkCounters>) {
    let server_opts = options(PATIENT);
    let counters = server_opts.counters.clone();
    let server = serve_one(listener, secret(), server_opts);
    let client_opts = options(PATIENT);
    let hello = local_hello(
        "client",
        vec![
            ferry_config::TransportName::Tcp,
            ferry_config::TransportName::Ipc,
        ],
        CAP,
    );
    let client = dial(&endpoint, &secret(), hello, &client_opts).await;
    let server = joined(server).await;
    match (client, server) {
        (Ok(c), Ok(s)) => (c, s, counters),
        (c, s) => panic!("handshake failed: client {c:?}, server {s:?}"),
    }
}

fn check_hellos(client: &Link, server: &Link) {
    assert_eq!(client.peer_hello.node, "server");
    assert_eq!(server.peer_hello.node, "client");
    assert_eq!(
        server.peer_hello.served().collect::<Vec<_>>(),
        vec![
            ferry_config::TransportName::Tcp,
            ferry_config::TransportName::Ipc
        ]
    );
    assert_eq!(server.peer_hello.version, PROTOCOL_VERSION);
    assert_eq!(server.peer_hello.host_id, host_id());
    assert_eq!(server.peer_hello.pid, std::process::id());
    assert_eq!(client.writer.peer_max_frame(), CAP);
}

#[tokio::test]
async fn tcp_handshake_exchanges_hello() {
    let (listener, endpoint) = tcp_listener().await;
    let (client, server) = connected_pair(endpoint, listener).await;
    check_hellos(&client, &server);
    assert!(server.peer.starts_with("tcp:127.0.0.1:"), "{}", server.peer);
}

#[tokio::test]
async fn unix_handshake_exchanges_hello() {
    let dir = match tempfile::tempdir() {
        Ok(d) => d,
        Err(e) => panic!("{e}"),
    };
    let path = dir.path().join("ferry.sock");
    let listener = match Listener::bind_unix(&path).await {
        Ok(l) => l,
        Err(e) => panic!("bind: {e}"),
    };
    let (client, server) = connected_pair(Endpoint::Unix(path.clone()), listener).await;
    check_hellos(&client, &server);
    assert!(server.peer.contains(&format!("pid {}", std::process::id())));
    // Dropping the last listener removed the socket file.
    assert!(!path.exists());
}

#[tokio::test]
async fn unix_bind_replaces_a_stale_socket_but_not_a_live_one() {
    let Ok(dir) = tempfile::tempdir() else {
        panic!("tempdir")
    };
    let path = dir.path().join("stale.sock");
    // A socket file nobody listens on, as a crashed process leaves behind.
    let stale = std::os::unix::net::UnixListener::bind(&path);
    assert!(stale.is_ok());
    drop(stale);
    assert!(path.exists());

    let live = Listener::bind_unix(&path).await;
    assert!(live.is_ok(), "{live:?}");
    match Listener::bind_unix(&path).await {
        Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::AddrInUse),
        Ok(_) => panic!("bound over a live listener"),
    }
    let file = dir.path().join("plain");
    assert!(std::fs::write(&file, b"x").is_ok());
    match Listener::bind_unix(&file).await {
        Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::AlreadyExists),
        Ok(_) => panic!("replaced a regular file"),
    }
}

async fn handshake_with(
    client_secret: Secret,
    server_secret: Secret,
) -> (LinkError, LinkError, u64, u64) {
    let (listener, endpoint) = tcp_listener().await;
    let server_opts = options(PATIENT);
    let server = serve_one(listener, server_secret, server_opts.clone());
    let client_opts = options(PATIENT);
    let hello = local_hello("client", vec![], CAP);
    let client = dial(&endpoint, &client_secret, hello, &client_opts).await;
    let server = joined(server).await;
    match (client, server) {
        (Err(c), Err(s)) => (
            c,
            s,
            client_opts.counters.auth_failures(),
            server_opts.counters.auth_failures(),
        ),
        (c, s) => panic!("expected both to fail: client {c:?}, server {s:?}"),
    }
}

#[tokio::test]
async fn wrong_secret_fails_on_both_sides() {
    let (client, server, client_count, server_count) =
        handshake_with(Secret::new(b"guess".to_vec()), secret()).await;
    assert!(matches!(client, LinkError::AuthFailed { .. }), "{client:?}");
    assert!(matches!(server, LinkError::AuthFailed { .. }), "{server:?}");
    assert!(server.is_peer_fault());
    assert_eq!(server_count, 1);
    assert_eq!(client_count, 1);
}

#[tokio::test]
async fn insecure_and_secure_nodes_refuse_each_other() {
    for (client_secret, server_secret) in [
        (Secret::insecure(), secret()),
        (secret(), Secret::insecure()),
    ] {
        let (client, server, _, server_count) = handshake_with(client_secret, server_secret).await;
        assert!(matches!(client, LinkError::AuthFailed { .. }), "{client:?}");
        assert!(matches!(server, LinkError::AuthFailed { .. }), "{server:?}");
        assert_eq!(server_count, 1);
    }
}

#[tokio::test]
async fn two_insecure_nodes_connect() {
    let (listener, endpoint) = tcp_listener().await;
    let server = serve_one(listener, Secret::insecure(), options(PATIENT));
    let hello = local_hello("client", vec![], CAP);
    let client = dial(&endpoint, &Secret::insecure(), hello, &options(PATIENT)).await;
    assert!(client.is_ok(), "{client:?}");
    assert!(joined(server).await.is_ok());
}

#[test]
fn secret_debug_does_not_leak() {
    let text = format!("{:?}", Secret::new(b"hunter2".to_vec()));
    assert!(!text.contains("hunter2"), "{text}");
    assert!(!text.contains("104"), "{text}"); // 'h' as a number
    assert_eq!(format!("{:?}", Secret::insecure()), "Secret(insecure)");
}

/// Accepts one connection with a short handshake timeout and returns the acceptor's
/// result and counters, while `client` plays the peer on a raw socket.
async fn accept_from_raw<F, Fut>(client: F) -> (Result<Link, LinkError>, Arc<LinkCounters>)
where
    F: FnOnce(TcpStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = TcpStream> + Send + 'static,
{
    let (listener, endpoint) = tcp_listener().await;
    let opts = options(SHORT);
    let counters = opts.counters.clone();
    let server = serve_one(listener, secret(), opts);
    let stream = match TcpStream::connect(tcp_addr(&endpoint)).await {
        Ok(s) => s,
        Err(e) => panic!("{e}"),
    };
    // The raw peer keeps its socket open until the server has decided.
    let raw = tokio::spawn(client(stream));
    let result = joined(server).await;
    drop(raw.await);
    (result, counters)
}

#[tokio::test]
async fn silent_peer_times_out_and_is_counted() {
    let (result, counters) = accept_from_raw(|s| async move { s }).await;
    match result {
        Err(LinkError::HandshakeTimeout { peer }) => assert!(peer.starts_with("tcp:")),
        other => panic!("expected timeout, got {other:?}"),
    }
    assert_eq!(counters.auth_failures(), 1);
}

#[tokio::test]
async fn garbage_preamble_is_refused_and_counted() {
    let (result, counters) = accept_from_raw(|mut s| async move {
        let garbage = b"GET / HTTP/1.1\r\nHost: example\r\nAccept: */*\r\n\r\n";
        assert!(s.write_all(garbage).await.is_ok());
        s
    })
    .await;
    match result {
        Err(LinkError::AuthFailed { detail, .. }) => {
            assert!(detail.contains("not a ferry peer"), "{detail}")
        }
        other => panic!("expected AuthFailed, got {other:?}"),
    }
    assert_eq!(counters.auth_failures(), 1);
}

#[tokio::test]
async fn short_garbage_then_hang_up_is_refused() {
    let (result, counters) = accept_from_raw(|mut s| async move {
        assert!(s.write_all(b"hello?").await.is_ok());
        assert!(s.shutdown().await.is_ok());
        s
    })
    .await;
    assert!(
        matches!(result, Err(LinkError::AuthFailed { .. })),
        "{result:?}"
    );
    assert_eq!(counters.auth_failures(), 1);
}

type HmacSha256 = Hmac<Sha256>;

/// A dialer written from the protocol description, for playing a hostile peer.
struct RawDialer {
    version: u16,
    role: u8,
    key: Vec<u8>,
}

impl RawDialer {
    fn honest() -> Self {
        Self {
            version: PROTOCOL_VERSION,
            role: 0,
            key: b"correct horse battery staple".to_vec(),
        }
    }

    async fn authenticate(&self, s: &mut TcpStream) -> std::io::Result<()> {
        let nonce: [u8; 32] = rand::random();
        let mut preamble = b"FERRYAUT".to_vec();
        preamble.extend_from_slice(&self.version.to_le_bytes());
        preamble.push(self.role);
        preamble.extend_from_slice(&nonce);
        s.write_all(&preamble).await?;
        let mut theirs = [0u8; 43];
        s.read_exact(&mut theirs).await?;
        let Ok(mut mac) = HmacSha256::new_from_slice(&self.key) else {
            panic!("hmac key")
        };
        mac.update(b"ferry-auth-v1");
        mac.update(&[self.role]);
        mac.update(&nonce);
        mac.update(&theirs[11..]);
        s.write_all(&mac.finalize().into_bytes()).await?;
        let mut proof = [0u8; 32];
        s.read_exact(&mut proof).await?;
        Ok(())
    }

    /// Authenticates and exchanges `Hello`s, leaving `s` ready for raw frames.
    async fn open(&self, s: &mut TcpStream) {
        assert!(self.authenticate(s).await.is_ok());
        let hello = Message::Hello(local_hello("raw", vec![], CAP));
        let Ok(bytes) = encode(&hello) else {
            panic!("encode")
        };
        assert!(s.write_all(&bytes).await.is_ok());
        match read_frame(s, CAP).await {
            Ok(Some(frame)) => assert_eq!(frame.kind(), FrameKind::Hello),
            other => panic!("server hello: {other:?}"),
        }
    }
}

#[tokio::test]
async fn raw_dialer_speaking_the_protocol_is_accepted() {
    let (result, counters) = accept_from_raw(|mut s| async move {
        RawDialer::honest().open(&mut s).await;
        s
    })
    .await;
    match result {
        Ok(link) => assert_eq!(link.peer_hello.node, "raw"),
        Err(e) => panic!("{e}"),
    }
    assert_eq!(counters.auth_failures(), 0);
}

#[tokio::test]
async fn reflected_role_is_refused() {
    let (result, counters) = accept_from_raw(|mut s| async move {
        let raw = RawDialer {
            role: 1, // claims to be the acceptor, like the server
            ..RawDialer::honest()
        };
        let _ = raw.authenticate(&mut s).await;
        s
    })
    .await;
    match result {
        Err(LinkError::AuthFailed { detail, .. }) => assert!(detail.contains("role"), "{detail}"),
        other => panic!("expected AuthFailed, got {other:?}"),
    }
    assert_eq!(counters.auth_failures(), 1);
}

#[tokio::test]
async fn other_protocol_version_is_refused_naming_both() {
    let theirs = PROTOCOL_VERSION + 1;
    let (result, counters) = accept_from_raw(move |mut s| async move {
        let raw = RawDialer {
            version: theirs,
            ..RawDialer::honest()
        };
        let _ = raw.authenticate(&mut s).await;
        s
    })
    .await;
    match result {
        Err(e @ LinkError::VersionMismatch { .. }) => {
            let text = e.to_string();
            assert!(text.contains(&PROTOCOL_VERSION.to_string()), "{text}");
            assert!(text.contains(&theirs.to_string()), "{text}");
        }
        other => panic!("expected VersionMismatch, got {other:?}"),
    }
    assert_eq!(counters.auth_failures(), 1);
}

#[tokio::test]
async fn a_hello_that_is_not_a_hello_is_refused() {
    let (result, counters) = accept_from_raw(|mut s| async move {
        assert!(RawDialer::honest().authenticate(&mut s).await.is_ok());
        let Ok(bytes) = encode(&Message::Ping(1)) else {
            panic!("encode")
        };
        assert!(s.write_all(&bytes).await.is_ok());
        s
    })
    .await;
    assert!(
        matches!(
            result,
            Err(LinkError::UnexpectedMessage {
                expected: FrameKind::Hello,
                got: FrameKind::Ping
            })
        ),
        "{result:?}"
    );
    assert_eq!(counters.auth_failures(), 1);
}

fn frame_bytes(msg: &Message) -> Vec<u8> {
    match encode(msg) {
        Ok(b) => b,
        Err(e) => panic!("{e}"),
    }
}

/// After a good handshake the raw peer sends `bad`; returns what the server's reader says
/// and its counters.
async fn server_reads_after(
    bad: Vec<u8>,
    close: bool,
) -> (Vec<Result<Option<Message>, LinkError>>, Arc<LinkCounters>) {
    let (listener, endpoint) = tcp_listener().await;
    let opts = options(PATIENT);
    let counters = opts.counters.clone();
    let server = serve_one(listener, secret(), opts);
    let Ok(mut stream) = TcpStream::connect(tcp_addr(&endpoint)).await else {
        panic!("connect")
    };
    RawDialer::honest().open(&mut stream).await;
    let mut link = match joined(server).await {
        Ok(l) => l,
        Err(e) => panic!("{e}"),
    };
    assert!(stream.write_all(&bad).await.is_ok());
    if close {
        assert!(stream.shutdown().await.is_ok());
    }
    let mut results = Vec::new();
    for _ in 0..2 {
        let r = link.reader.next().await;
        results.push(r.map(|f| f.map(|f| f.to_owned_message().unwrap_or(Message::Goodbye))));
    }
    (results, counters)
}

fn assert_frame_error(result: &Result<Option<Message>, LinkError>, reason: &str) {
    match result {
        Err(LinkError::Frame(e)) => assert_eq!(e.reason(), reason, "{e}"),
        other => panic!("expected a {reason} frame error, got {other:?}"),
    }
}

#[tokio::test]
async fn garbage_frame_is_rejected_and_counted() {
    let (results, counters) = server_reads_after(b"definitely not a frame!".to_vec(), false).await;
    assert_frame_error(&results[0], "bad_magic");
    // Out of sync: the same error again, counted once.
    assert_frame_error(&results[1], "bad_magic");
    assert_eq!(counters.frames_rejected("bad_magic"), 1);
    assert_eq!(counters.frames_rejected_total(), 1);
    assert_eq!(counters.frames_ok(), 1); // the Hello
}

#[tokio::test]
async fn truncated_frame_is_rejected_and_counted() {
    let frame = frame_bytes(&Message::Ping(9));
    let (results, counters) = server_reads_after(frame[..frame.len() - 3].to_vec(), true).await;
    assert_frame_error(&results[0], "truncated");
    assert_eq!(counters.frames_rejected("truncated"), 1);
}

#[tokio::test]
async fn oversized_frame_is_rejected_before_its_payload() {
    let mut header = frame_bytes(&Message::Ping(9))[..HEADER_LEN].to_vec();
    header[8..12].copy_from_slice(&(CAP + 1).to_le_bytes());
    // Only the header is sent and the socket stays open: the reader must decide on it alone.
    let (results, counters) = server_reads_after(header, false).await;
    match &results[0] {
        Err(LinkError::Frame(FrameError::TooLong { len, cap })) => {
            assert_eq!((*len, *cap), (u64::from(CAP) + 1, u64::from(CAP)))
        }
        other => panic!("expected TooLong, got {other:?}"),
    }
    assert_eq!(counters.frames_rejected("too_long"), 1);
}

#[tokio::test]
async fn bit_flipped_frame_ends_the_link() {
    let mut bytes = frame_bytes(&Message::Ping(9));
    let last = bytes.len() - 1;
    bytes[last] ^= 0x04;
    bytes.extend(frame_bytes(&Message::Pong(10)));
    let (results, counters) = server_reads_after(bytes, false).await;
    assert_frame_error(&results[0], "crc");
    // The sound frame behind it is never handed out: a byte stream that carried one bad
    // frame is not trusted for the next.
    assert_frame_error(&results[1], "crc");
    assert_eq!(counters.frames_rejected("crc"), 1);
    // The Hello only.
    assert_eq!(counters.frames_ok(), 1);
}

#[tokio::test]
async fn frame_with_another_kinds_payload_is_rejected() {
    let ping = frame_bytes(&Message::Ping(9));
    let Ok(header) = FrameHeader::for_payload(FrameKind::Done, &ping[HEADER_LEN..]) else {
        panic!("header")
    };
    let mut forged = header.to_bytes().to_vec();
    forged.extend_from_slice(&ping[HEADER_LEN..]);
    let (results, counters) = server_reads_after(forged, true).await;
    assert_frame_error(&results[0], "kind_mismatch");
    // The link is done, even though the stream is in step.
    assert_frame_error(&results[1], "kind_mismatch");
    assert_eq!(counters.frames_rejected("kind_mismatch"), 1);
}

#[tokio::test]
async fn frame_of_another_version_is_a_version_mismatch() {
    let mut bytes = frame_bytes(&Message::Ping(9));
    bytes[4..6].copy_from_slice(&(PROTOCOL_VERSION + 1).to_le_bytes());
    let (results, counters) = server_reads_after(bytes, false).await;
    assert!(
        matches!(results[0], Err(LinkError::VersionMismatch { .. })),
        "{:?}",
        results[0]
    );
    assert_eq!(counters.frames_rejected("version"), 1);
}

#[tokio::test]
async fn thousand_frames_arrive_in_order_both_ways() {
    let (listener, endpoint) = tcp_listener().await;
    let (client, server) = connected_pair(endpoint, listener).await;
    let Link {
        reader: mut client_reader,
        writer: mut client_writer,
        ..
    } = client;
    let Link {
        reader: mut server_reader,
        writer: mut server_writer,
        ..
    } = server;

    let sender = tokio::spawn(async move {
        for i in 0..1000u64 {
            let bytes = vec![(i % 251) as u8; (i as usize * 37) % 3000];
            let msg = Message::Data(DataChunk {
                transfer: 1,
                offset: i * 100,
                len: bytes.len() as u32,
            });
            // Alternate chunks, flushing sends and buffered feeds.
            let sent = match i % 3 {
                0 => client_writer.send(&msg).await,
                1 => client_writer.feed(&msg).await,
                _ => client_writer.feed_chunk(&msg, &bytes).await,
            };
            assert!(sent.is_ok(), "{sent:?}");
        }
        assert!(client_writer.send(&Message::Goodbye).await.is_ok());
        assert!(client_writer.shutdown().await.is_ok());
    });

    for i in 0..1000u64 {
        let frame = match server_reader.next().await {
            Ok(Some(f)) => f,
            other => panic!("frame {i}: {other:?}"),
        };
        let len = match frame.message() {
            Ok(ferry_transports::wire::ArchivedMessage::Data(chunk)) => {
                assert_eq!(chunk.offset, i * 100);
                assert_eq!(chunk.len, ((i * 37) % 3000) as u32);
                chunk.len.to_native() as usize
            }
            other => panic!("frame {i}: {other:?}"),
        };
        if i % 3 == 2 {
            let mut bytes = vec![0xffu8; len];
            let read = server_reader.read_payload_into(&mut bytes).await;
            assert!(read.is_ok(), "payload {i}: {read:?}");
            assert!(bytes.iter().all(|b| *b == (i % 251) as u8));
        }
        // Echo the offset back.
        assert!(server_writer.feed(&Message::Pong(i)).await.is_ok());
    }
    assert!(server_writer.flush().await.is_ok());
    assert!(matches!(
        server_reader.next().await.map(|f| f.map(|f| f.kind())),
        Ok(Some(FrameKind::Goodbye))
    ));
    assert!(matches!(server_reader.next().await, Ok(None)));
    assert!(sender.await.is_ok());

    for i in 0..1000u64 {
        match client_reader
            .next()
            .await
            .map(|f| f.map(|f| f.to_owned_message()))
        {
            Ok(Some(Ok(Message::Pong(n)))) => assert_eq!(n, i),
            other => panic!("pong {i}: {other:?}"),
        }
    }
}

#[tokio::test]
async fn sending_more_than_the_peer_accepts_is_refused_locally() {
    let (listener, endpoint) = tcp_listener().await;
    let (mut client, mut server) = connected_pair(endpoint, listener).await;
    let bytes = vec![0; CAP as usize + 1];
    let big = Message::Data(DataChunk {
        transfer: 1,
        offset: 0,
        len: bytes.len() as u32,
    });
    match client.writer.feed_chunk(&big, &bytes).await {
        Err(e @ LinkError::Send(FrameError::TooLong { .. })) => assert!(!e.is_peer_fault()),
        other => panic!("expected Send(TooLong), got {other:?}"),
    }
    let Ok(encoded) = encode_payload(&bytes) else {
        panic!("encode")
    };
    assert!(matches!(
        client.writer.send_encoded(&encoded).await,
        Err(LinkError::Send(FrameError::TooLong { .. }))
    ));
    assert!(matches!(
        client.writer.send_encoded(&encoded[..40]).await,
        Err(LinkError::Send(FrameError::Truncated { .. }))
    ));
    // Nothing was written: the link still works, also for pre-encoded frames.
    let Ok(ping) = encode(&Message::Ping(3)) else {
        panic!("encode")
    };
    assert!(client.writer.send_encoded(&ping).await.is_ok());
    match server.reader.next().await {
        Ok(Some(f)) => assert_eq!(f.to_owned_message(), Ok(Message::Ping(3))),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_stalled_handshake_does_not_block_others() {
    let (listener, endpoint) = tcp_listener().await;
    let opts = options(PATIENT);
    let server = tokio::spawn(async move {
        let mut handshakes = Vec::new();
        for _ in 0..2 {
            let Ok((accepted, _)) = listener.accept().await else {
                panic!("accept")
            };
            let opts = opts.clone();
            handshakes.push(tokio::spawn(async move {
                let hello = local_hello("server", vec![], CAP);
                accept_handshake(accepted, &secret(), hello, &opts).await
            }));
        }
        handshakes
    });
    // The first connection never says anything.
    let Ok(_silent) = TcpStream::connect(tcp_addr(&endpoint)).await else {
        panic!("connect")
    };
    let hello = local_hello("client", vec![], CAP);
    let dialed = tokio::time::timeout(
        PATIENT / 2,
        dial(&endpoint, &secret(), hello, &options(PATIENT)),
    )
    .await;
    assert!(matches!(dialed, Ok(Ok(_))), "{dialed:?}");
    let Ok(handshakes) = server.await else {
        panic!("server")
    };
    for h in handshakes {
        h.abort();
    }
}

#[tokio::test]
async fn a_chunk_whose_header_does_not_announce_it_is_refused_locally() {
    let (listener, endpoint) = tcp_listener().await;
    let (mut client, mut server) = connected_pair(endpoint, listener).await;
    let header = Message::Put(PutChunk {
        put: 1,
        region: 2,
        generation: 3,
        offset: 0,
        len: 10,
        last: true,
    });
    for (msg, bytes) in [
        (&header, &[0u8; 9][..]),
        (&Message::Ping(1), &[0u8; 10][..]),
    ] {
        assert!(matches!(
            client.writer.feed_chunk(msg, bytes).await,
            Err(LinkError::Send(FrameError::Encode(_)))
        ));
    }
    // Nothing was written: the next chunk arrives intact.
    assert!(
        client
            .writer
            .feed_chunk(&header, b"0123456789")
            .await
            .is_ok()
    );
    assert!(client.writer.flush().await.is_ok());
    expect_chunk(&mut server, header, b"0123456789").await;
}

/// The next frames `server` reads are `header`, then a payload of exactly `bytes`.
async fn expect_chunk(server: &mut Link, header: Message, bytes: &[u8; 10]) {
    match server.reader.next().await {
        Ok(Some(f)) => assert_eq!(f.to_owned_message(), Ok(header)),
        other => panic!("{other:?}"),
    }
    let mut dst = [0u8; 10];
    assert!(server.reader.read_payload_into(&mut dst).await.is_ok());
    assert_eq!(&dst, bytes);
}

#[tokio::test]
async fn a_chunk_framed_ahead_goes_out_with_its_header_and_another_is_refused_locally() {
    let (listener, endpoint) = tcp_listener().await;
    let (mut client, mut server) = connected_pair(endpoint, listener).await;
    let header = Message::Data(DataChunk {
        transfer: 1,
        offset: 0,
        len: 10,
    });
    let bytes = b"0123456789";
    let framed = |kind, payload: &[u8]| match FrameHeader::for_payload(kind, payload) {
        Ok(h) => h,
        Err(e) => panic!("{e}"),
    };
    for wrong in [
        framed(FrameKind::Payload, b"012345678"),
        framed(FrameKind::Data, bytes),
    ] {
        assert!(matches!(
            client.writer.feed_chunk_framed(&header, bytes, wrong).await,
            Err(LinkError::Send(FrameError::Encode(_)))
        ));
    }
    // Nothing was written: the chunk framed for these bytes arrives intact.
    let right = framed(FrameKind::Payload, bytes);
    assert!(
        client
            .writer
            .feed_chunk_framed(&header, bytes, right)
            .await
            .is_ok()
    );
    assert!(client.writer.flush().await.is_ok());
    expect_chunk(&mut server, header, bytes).await;
}

#[tokio::test]
async fn a_damaged_payload_is_counted_and_ends_the_link() {
    let bytes = vec![7u8; 3000];
    let header = frame_bytes(&Message::Data(DataChunk {
        transfer: 1,
        offset: 0,
        len: 3000,
    }));
    let Ok(mut payload) = encode_payload(&bytes) else {
        panic!("encode")
    };
    payload[HEADER_LEN + 100] ^= 0x20;
    let mut stream = header.clone();
    stream.extend(&payload);
    stream.extend(&header);
    stream.extend(encode_payload(&bytes).unwrap_or_default());

    let (listener, endpoint) = tcp_listener().await;
    let (mut client, mut server, counters) = connected_pair_counted(endpoint, listener).await;
    assert!(client.writer.danger_send_raw(&stream).await.is_ok());
    let mut dst = vec![0u8; 3000];
    assert!(matches!(server.reader.next().await, Ok(Some(f)) if f.kind() == FrameKind::Data));
    let read = server.reader.read_payload_into(&mut dst).await;
    assert!(
        matches!(read, Err(LinkError::Frame(FrameError::CrcMismatch { .. }))),
        "{read:?}"
    );
    // Nothing more is read from this link, however sound the frames behind it.
    assert!(matches!(
        server.reader.next().await,
        Err(LinkError::Frame(FrameError::CrcMismatch { .. }))
    ));
    assert!(server.reader.discard_payload(3000).await.is_err());
    assert_eq!(counters.frames_rejected("crc"), 1);
    // The Hello and the first header.
    assert_eq!(counters.frames_ok(), 2);
}

/// A link accepted with a stall timeout of [`SHORT`], and the raw socket of its honest
/// (hand-driven) dialer.
async fn raw_peer_with_short_stall() -> (TcpStream, Link, Arc<LinkCounters>) {
    let (listener, endpoint) = tcp_listener().await;
    let mut opts = options(PATIENT);
    opts.stall_timeout = SHORT;
    let counters = opts.counters.clone();
    let server = serve_one(listener, secret(), opts);
    let Ok(mut stream) = TcpStream::connect(tcp_addr(&endpoint)).await else {
        panic!("connect")
    };
    RawDialer::honest().open(&mut stream).await;
    match joined(server).await {
        Ok(link) => (stream, link, counters),
        Err(e) => panic!("{e}"),
    }
}

#[tokio::test]
async fn a_frame_begun_and_left_unfinished_ends_the_link_after_the_stall_timeout() {
    let (mut stream, mut link, counters) = raw_peer_with_short_stall().await;
    // Half a frame, then nothing, with the connection held open.
    let ping = frame_bytes(&Message::Ping(3));
    assert!(stream.write_all(&ping[..ping.len() / 2]).await.is_ok());
    let started = std::time::Instant::now();
    let read = tokio::time::timeout(PATIENT, link.reader.next()).await;
    let Ok(read) = read else {
        panic!("the reader waited past {PATIENT:?} for a stalled frame")
    };
    assert!(
        matches!(read, Err(LinkError::Frame(FrameError::Stalled { .. }))),
        "{read:?}"
    );
    assert!(started.elapsed() < SHORT * 10, "{:?}", started.elapsed());
    assert_eq!(counters.frames_rejected("stalled"), 1);
    drop(stream);
}

#[tokio::test]
async fn an_idle_link_is_not_a_stalled_one() {
    let (mut stream, mut link, _) = raw_peer_with_short_stall().await;
    // Quiet between frames for several stall timeouts, then a whole frame.
    let idle = tokio::time::timeout(SHORT * 4, link.reader.next()).await;
    assert!(idle.is_err(), "something arrived on an idle link: {idle:?}");
    assert!(
        stream
            .write_all(&frame_bytes(&Message::Ping(5)))
            .await
            .is_ok()
    );
    match link.reader.next().await {
        Ok(Some(f)) => assert_eq!(f.to_owned_message(), Ok(Message::Ping(5))),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_peer_that_stops_reading_fails_our_write_after_the_stall_timeout() {
    let (stream, mut link, _) = raw_peer_with_short_stall().await;
    // The peer never reads: chunks fill both socket buffers, then the write stalls.
    let chunk = vec![1u8; 512 << 10];
    let started = std::time::Instant::now();
    let mut failed = None;
    for i in 0..1000u64 {
        let header = Message::Data(DataChunk {
            transfer: 1,
            offset: i * chunk.len() as u64,
            len: chunk.len() as u32,
        });
        let sent = tokio::time::timeout(PATIENT, async {
            link.writer.feed_chunk(&header, &chunk).await?;
            link.writer.flush().await
        })
        .await;
        match sent {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                failed = Some(e);
                break;
            }
            Err(_) => panic!("a write waited past {PATIENT:?} on a peer that stopped reading"),
        }
    }
    match failed {
        Some(LinkError::Io(e)) => assert_eq!(e.kind(), std::io::ErrorKind::TimedOut, "{e}"),
        other => panic!("expected a timed-out write, got {other:?}"),
    }
    assert!(started.elapsed() < PATIENT);
    drop(stream);
}

#[tokio::test]
async fn a_payload_of_the_wrong_length_breaks_the_link() {
    let (listener, endpoint) = tcp_listener().await;
    let (mut client, mut server) = connected_pair(endpoint, listener).await;
    let Ok(payload) = encode_payload(&[1u8; 20]) else {
        panic!("encode")
    };
    assert!(client.writer.danger_send_raw(&payload).await.is_ok());
    assert!(client.writer.send(&Message::Ping(1)).await.is_ok());
    let mut dst = [0u8; 21];
    assert!(matches!(
        server.reader.read_payload_into(&mut dst).await,
        Err(LinkError::Frame(FrameError::Invalid(_)))
    ));
    // Out of sync for good: the ping behind it is never read.
    assert!(server.reader.next().await.is_err());
    assert!(server.reader.discard_payload(20).await.is_err());
}
