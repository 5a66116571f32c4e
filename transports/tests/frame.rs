//! Frame encoding and decoding: round trips, and hostile input (every bit flip, every
//! truncation, absurd lengths, wrong versions, garbage, mismatched kinds).

use std::future::Future;
use std::io;
use std::pin::{Pin, pin};
use std::task::{Context, Poll, Waker};

use ferry_transports::wire::{
    Announce, Cancel, DataChunk, Descriptor, Done, Frame, FrameError, FrameHeader, FrameKind,
    FrameReader, Grant, HEADER_LEN, Hello, HelloPurpose, Message, Offer, PROTOCOL_VERSION, PutAck,
    PutChunk, ReadError, TransportMessage, WireDirection, WireMemoryKind, WireReason,
    WireTransport, decode, encode, encode_payload, parse_header, read_frame,
};
use tokio::io::{AsyncRead, AsyncWriteExt, ReadBuf};

const CAP: u32 = 1 << 20;

fn hello() -> Hello {
    Hello {
        node: "node-a".into(),
        version: PROTOCOL_VERSION,
        host_id: "0123456789abcdef".into(),
        pid: 4242,
        transports: vec![
            Announce {
                transport: WireTransport::Tcp,
                terms: vec![1; 16],
            },
            Announce {
                transport: WireTransport::Ucx,
                terms: vec![3; 40],
            },
            Announce {
                transport: WireTransport::Ipc,
                terms: Vec::new(),
            },
        ],
        max_frame: CAP,
        receives: WireMemoryKind::Device(1),
        purpose: HelloPurpose::LinkTo("b".into()),
    }
}

/// One frame of the corpus: a message, or the raw bytes of a chunk.
#[derive(Debug, Clone, PartialEq)]
enum Item {
    Msg(Box<Message>),
    Payload(Vec<u8>),
}

impl Item {
    fn kind(&self) -> FrameKind {
        match self {
            Self::Msg(msg) => msg.kind(),
            Self::Payload(_) => FrameKind::Payload,
        }
    }

    fn encode(&self) -> Vec<u8> {
        let encoded = match self {
            Self::Msg(msg) => encode(msg),
            Self::Payload(bytes) => encode_payload(bytes),
        };
        match encoded {
            Ok(bytes) => bytes,
            Err(e) => panic!("encoding {self:?}: {e}"),
        }
    }

    /// Panics unless `frame` carries exactly this item.
    fn check(&self, frame: &Frame) {
        assert_eq!(frame.kind(), self.kind());
        match self {
            Self::Msg(msg) => {
                assert_eq!(frame.message().map(|m| m.kind()), Ok(msg.kind()));
                assert_eq!(frame.to_owned_message().as_ref(), Ok(&**msg));
            }
            Self::Payload(bytes) => {
                assert_eq!(frame.payload(), &bytes[..]);
                assert!(
                    matches!(frame.message(), Err(FrameError::Invalid(_))),
                    "a payload frame carries no message"
                );
            }
        }
    }
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 31 % 251) as u8).collect()
}

/// One message of every variant, plus a few sizes of the variable-length ones, and payload
/// frames of a few sizes (empty included).
fn corpus() -> Vec<Item> {
    let msgs = vec![
        Message::Hello(hello()),
        Message::Offer(Offer {
            eager: false,
            fetch: None,
            into: None,
            transfer: 1,
            tag: 0xfeed,
            len: 1 << 30,
            source: WireMemoryKind::Device(3),
            transport: WireTransport::Ipc,
            direction: WireDirection::Pull,
            pull: Some(Descriptor(vec![7; 130])),
            layout: ferry_transports::wire::Layout::Strided3D {
                depth: 2,
                rows: 3,
                row_bytes: 4096,
                pitch: 8192,
                plane_rows: 4,
            },
        }),
        // A block list: its blocks travel in the offer (a shared list in the archive).
        Message::Offer(Offer {
            eager: false,
            fetch: None,
            into: None,
            transfer: 2,
            tag: 7,
            len: 4096 + 1 + 300,
            source: WireMemoryKind::Host,
            transport: WireTransport::Tcp,
            direction: WireDirection::Push,
            pull: None,
            layout: ferry_transports::wire::Layout::blocks([(8192, 4096), (5, 1), (0, 300)]),
        }),
        Message::Transport(TransportMessage {
            transport: WireTransport::Ipc,
            body: vec![2; 90],
        }),
        Message::Transport(TransportMessage {
            transport: WireTransport::Staged,
            body: Vec::new(),
        }),
        Message::Grant(Grant {
            transfer: 1,
            landing: WireMemoryKind::PinnedHost,
            lent: None,
        }),
        Message::Grant(Grant {
            transfer: 4,
            landing: WireMemoryKind::Device(1),
            lent: Some(Descriptor(vec![5; 120])),
        }),
        Message::Written(ferry_transports::wire::Written {
            transfer: 4,
            error: None,
        }),
        Message::Written(ferry_transports::wire::Written {
            transfer: 5,
            error: Some("importing the receiver's buffer: invalid value".into()),
        }),
        Message::Fetch(ferry_transports::wire::FetchAsk {
            fetch: 1,
            key: "kv/17".into(),
            layout: ferry_transports::wire::Layout::blocks([(0, 4096), (8192, 16)]),
        }),
        Message::FetchRefused(ferry_transports::wire::FetchRefused {
            fetch: 1,
            reason: ferry_transports::wire::FetchRefusal::UnknownKey,
            detail: "nothing is published under key \"kv/17\"".into(),
        }),
        Message::Data(DataChunk {
            transfer: 2,
            offset: 0,
            len: 0,
        }),
        Message::Data(DataChunk {
            transfer: 2,
            offset: 4096,
            len: 4096,
        }),
        Message::Done(Done { transfer: 2 }),
        Message::Cancel(Cancel {
            transfer: 3,
            by_receiver: false,
            reason: WireReason::DeadlineExceeded,
            detail: "deadline of 5s passed".into(),
        }),
        Message::Put(PutChunk {
            put: 9,
            region: 10,
            generation: 11,
            offset: 12,
            len: 300,
            last: true,
        }),
        Message::PutAck(PutAck {
            put: 9,
            error: None,
        }),
        Message::PutAck(PutAck {
            put: 9,
            error: Some("stale region generation".into()),
        }),
        Message::Ping(u64::MAX),
        Message::Pong(0),
        Message::Goodbye,
        Message::Welcome,
    ];
    let mut items: Vec<Item> = msgs.into_iter().map(|m| Item::Msg(Box::new(m))).collect();
    items.extend(
        [Vec::new(), pattern(4096), vec![0xab; 300]]
            .into_iter()
            .map(Item::Payload),
    );
    items
}

fn must_encode(msg: &Message) -> Vec<u8> {
    match encode(msg) {
        Ok(bytes) => bytes,
        Err(e) => panic!("encoding {msg:?}: {e}"),
    }
}

fn header_of(bytes: &[u8]) -> [u8; HEADER_LEN] {
    match bytes.first_chunk::<HEADER_LEN>() {
        Some(h) => *h,
        None => panic!("frame shorter than a header"),
    }
}

#[test]
fn every_variant_round_trips() {
    let items = corpus();
    let mut kinds: Vec<FrameKind> = items.iter().map(Item::kind).collect();
    kinds.dedup();
    let all = (0..=u16::MAX)
        .filter(|k| FrameKind::from_u16(*k).is_some())
        .count();
    assert_eq!(kinds.len(), all, "the corpus covers every kind");

    for item in items {
        let bytes = item.encode();
        let (frame, used) = match decode(&bytes, CAP) {
            Ok(v) => v,
            Err(e) => panic!("decoding {item:?}: {e}"),
        };
        assert_eq!(used, bytes.len());
        assert_eq!(frame.header().len as usize, bytes.len() - HEADER_LEN);
        assert_eq!(frame.header().version, PROTOCOL_VERSION);
        item.check(&frame);
    }
}

#[test]
fn frames_decode_back_to_back() {
    let items = corpus();
    let stream: Vec<u8> = items.iter().flat_map(Item::encode).collect();
    let mut rest = &stream[..];
    for item in &items {
        let (frame, used) = match decode(rest, CAP) {
            Ok(v) => v,
            Err(e) => panic!("{e}"),
        };
        item.check(&frame);
        rest = &rest[used..];
    }
    assert!(rest.is_empty());
}

#[test]
fn every_single_bit_flip_is_rejected() {
    for item in corpus() {
        let good = item.encode();
        let mut bytes = good.clone();
        for byte in 0..bytes.len() {
            for bit in 0..8 {
                bytes[byte] ^= 1 << bit;
                if let Ok((frame, _)) = decode(&bytes, CAP) {
                    panic!(
                        "flip of bit {bit} of byte {byte} of {:?} accepted as {:?} {:?}",
                        item.kind(),
                        frame.kind(),
                        frame.to_owned_message()
                    );
                }
                bytes[byte] ^= 1 << bit;
            }
        }
        assert_eq!(bytes, good);
    }
}

#[test]
fn every_truncation_is_rejected() {
    for item in corpus() {
        let bytes = item.encode();
        for cut in 0..bytes.len() {
            let expected = if cut < HEADER_LEN {
                FrameError::Truncated {
                    needed: HEADER_LEN,
                    got: cut,
                }
            } else {
                FrameError::Truncated {
                    needed: bytes.len(),
                    got: cut,
                }
            };
            match decode(&bytes[..cut], CAP) {
                Err(e) => assert_eq!(e, expected, "cut at {cut} of {:?}", item.kind()),
                Ok(_) => panic!("prefix of {cut} bytes of {:?} accepted", item.kind()),
            }
        }
    }
}

fn header_with_len(len: u32) -> [u8; HEADER_LEN] {
    let mut header = header_of(&must_encode(&Message::Ping(1)));
    header[8..12].copy_from_slice(&len.to_le_bytes());
    header
}

#[test]
fn absurd_lengths_are_too_long_before_truncation() {
    for (len, cap) in [(u32::MAX, CAP), (CAP + 1, CAP), (1, 0)] {
        let header = header_with_len(len);
        let expected = FrameError::TooLong {
            len: u64::from(len),
            cap: u64::from(cap),
        };
        // Only a header: if the length were not checked first, this would be Truncated.
        assert_eq!(decode(&header, cap).err(), Some(expected.clone()));
        assert_eq!(parse_header(&header, cap).err(), Some(expected.clone()));
        assert_eq!(expected.reason(), "too_long");
    }
    // At the cap exactly the length is fine (the input is then merely short).
    let header = header_with_len(CAP);
    assert!(matches!(
        decode(&header, CAP),
        Err(FrameError::Truncated { .. })
    ));
}

/// Serves the given bytes and panics if asked for anything past them: proves a reader never
/// reads (or sizes a buffer for) more than it was given.
struct OnlyThese {
    bytes: Vec<u8>,
    at: usize,
}

impl AsyncRead for OnlyThese {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let left = self.bytes.len() - self.at;
        assert!(
            buf.remaining() <= left,
            "reader asked for {} bytes, only {left} may be read",
            buf.remaining()
        );
        let at = self.at;
        buf.put_slice(&self.bytes[at..at + buf.remaining()]);
        self.at += buf.filled().len();
        Poll::Ready(Ok(()))
    }
}

#[tokio::test]
async fn read_frame_refuses_absurd_length_after_reading_only_the_header() {
    for len in [u32::MAX, CAP + 1] {
        let mut reader = OnlyThese {
            bytes: header_with_len(len).to_vec(),
            at: 0,
        };
        match read_frame(&mut reader, CAP).await {
            Err(ReadError::Frame(FrameError::TooLong { len: l, cap })) => {
                assert_eq!((l, cap), (u64::from(len), u64::from(CAP)));
            }
            other => panic!("expected TooLong, got {other:?}"),
        }
        assert_eq!(reader.at, HEADER_LEN);
    }
}

#[tokio::test]
async fn read_frame_reads_exactly_one_frame() {
    for item in corpus() {
        let bytes = item.encode();
        let mut reader = OnlyThese { bytes, at: 0 };
        match read_frame(&mut reader, CAP).await {
            Ok(Some(frame)) => item.check(&frame),
            other => panic!("expected a frame, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn read_frame_eof_at_boundary_is_none_and_inside_is_truncated() {
    let mut empty: &[u8] = &[];
    assert!(matches!(read_frame(&mut empty, CAP).await, Ok(None)));

    let bytes = must_encode(&Message::Ping(7));
    for cut in 1..bytes.len() {
        let mut short = &bytes[..cut];
        match read_frame(&mut short, CAP).await {
            Err(ReadError::Frame(e @ FrameError::Truncated { .. })) => {
                assert_eq!(e.reason(), "truncated")
            }
            other => panic!("cut at {cut}: expected Truncated, got {other:?}"),
        }
    }
}

#[test]
fn version_mismatch_names_both_versions() {
    let mut bytes = must_encode(&Message::Goodbye);
    let theirs = PROTOCOL_VERSION + 41;
    bytes[4..6].copy_from_slice(&theirs.to_le_bytes());
    let err = match decode(&bytes, CAP) {
        Err(e) => e,
        Ok(_) => panic!("foreign version accepted"),
    };
    assert_eq!(
        err,
        FrameError::VersionMismatch {
            ours: PROTOCOL_VERSION,
            theirs
        }
    );
    let text = err.to_string();
    assert!(text.contains(&PROTOCOL_VERSION.to_string()), "{text}");
    assert!(text.contains(&theirs.to_string()), "{text}");
    assert_eq!(err.reason(), "version");
}

#[test]
fn garbage_is_rejected() {
    let inputs: Vec<Vec<u8>> = vec![
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
        vec![0; 64],
        vec![0xff; 64],
        b"FRY\x01".to_vec(),
        (0..=255u8).collect(),
    ];
    for input in inputs {
        assert!(decode(&input, CAP).is_err(), "{input:?} accepted");
    }
    assert!(matches!(
        decode(&[0u8; 32], CAP),
        Err(FrameError::BadMagic([0, 0, 0, 0]))
    ));
}

/// Puts `payload` under a fresh, correctly CRC'd header of `kind`.
fn reframe(kind_raw: u16, payload: &[u8]) -> Vec<u8> {
    let Some(kind) = FrameKind::from_u16(kind_raw) else {
        panic!("kind {kind_raw}")
    };
    let header = match FrameHeader::for_payload(kind, payload) {
        Ok(h) => h,
        Err(e) => panic!("{e}"),
    };
    let mut out = header.to_bytes().to_vec();
    out.extend_from_slice(payload);
    out
}

#[test]
fn payload_under_another_kinds_header_is_rejected() {
    let ping = must_encode(&Message::Ping(5));
    let forged = reframe(FrameKind::Pong as u16, &ping[HEADER_LEN..]);
    let err = decode(&forged, CAP).err();
    assert_eq!(
        err,
        Some(FrameError::KindMismatch {
            header: FrameKind::Pong as u16,
            payload: FrameKind::Ping as u16,
        })
    );
    assert_eq!(err.map(|e| e.reason()), Some("kind_mismatch"));
}

#[test]
fn correctly_crcd_garbage_payload_is_invalid() {
    for payload in [&[][..], &[0xffu8; 8][..], &[0x55u8; 40][..]] {
        let forged = reframe(FrameKind::Hello as u16, payload);
        match decode(&forged, CAP) {
            Err(e @ FrameError::Invalid(_)) => assert_eq!(e.reason(), "invalid"),
            Err(FrameError::KindMismatch { .. }) => {}
            other => panic!("{payload:?}: expected Invalid, got {other:?}"),
        }
    }
}

#[test]
fn unknown_kind_is_rejected() {
    let mut bytes = must_encode(&Message::Goodbye);
    bytes[6..8].copy_from_slice(&999u16.to_le_bytes());
    assert_eq!(
        decode(&bytes, CAP).err(),
        Some(FrameError::UnknownKind(999))
    );
}

fn poll_once<F: Future>(fut: Pin<&mut F>) -> Poll<F::Output> {
    fut.poll(&mut Context::from_waker(Waker::noop()))
}

#[tokio::test]
async fn frame_reader_is_cancel_safe() {
    let items = corpus();
    let stream: Vec<u8> = items.iter().flat_map(Item::encode).collect();
    let (mut tx, rx) = tokio::io::duplex(64 * 1024);
    let mut reader = FrameReader::new(rx, CAP);
    let mut got = Vec::new();
    // Feed the stream in odd-sized pieces; after each, poll a fresh `read` future once and
    // drop it if it is not ready (a cancellation, as in `select!`).
    for piece in stream.chunks(37) {
        assert!(tx.write_all(piece).await.is_ok());
        loop {
            let fut = pin!(reader.read());
            match poll_once(fut) {
                Poll::Ready(Ok(Some(frame))) => got.push(frame),
                Poll::Ready(other) => panic!("unexpected {other:?}"),
                Poll::Pending => break,
            }
        }
    }
    drop(tx);
    assert!(matches!(reader.read().await, Ok(None)));
    assert_eq!(got.len(), items.len());
    for (frame, item) in got.iter().zip(&items) {
        item.check(frame);
    }
}

#[tokio::test]
async fn frame_reader_skips_a_bad_crc_frame_and_stops_at_bad_magic() {
    let mut stream = must_encode(&Message::Ping(1));
    let last = stream.len() - 1;
    stream[last] ^= 0x10; // payload damage: recoverable
    stream.extend(must_encode(&Message::Ping(2)));
    stream.extend(b"XXXXXXXXXXXXXXXXXXXX"); // out of sync: fatal
    stream.extend(must_encode(&Message::Ping(3)));
    let mut reader = FrameReader::new(&stream[..], CAP);

    assert!(matches!(
        reader.read().await,
        Err(ReadError::Frame(FrameError::CrcMismatch { .. }))
    ));
    match reader.read().await {
        Ok(Some(frame)) => assert_eq!(frame.to_owned_message(), Ok(Message::Ping(2))),
        other => panic!("{other:?}"),
    }
    for _ in 0..2 {
        assert!(matches!(
            reader.read().await,
            Err(ReadError::Frame(FrameError::BadMagic(_)))
        ));
    }
}

proptest::proptest! {
    /// The CRC hides most damage from the validator; re-CRC'd mutations reach rkyv's
    /// validation and the kind check, which must reject or accept without panicking, and
    /// whatever they accept must deserialize and re-encode.
    #[test]
    fn recrcd_mutations_never_panic(
        which in 0usize..17,
        edits in proptest::collection::vec((proptest::prelude::any::<usize>(), proptest::prelude::any::<u8>()), 1..8),
    ) {
        let items = corpus();
        let item = &items[which % items.len()];
        let bytes = item.encode();
        let mut payload = bytes[HEADER_LEN..].to_vec();
        if payload.is_empty() {
            return Ok(());
        }
        for (at, value) in edits {
            let len = payload.len();
            payload[at % len] = value;
        }
        let forged = reframe(item.kind() as u16, &payload);
        if item.kind() == FrameKind::Payload {
            // Raw bytes: whatever their CRC vouches for is accepted, as it is.
            let decoded = decode(&forged, CAP);
            proptest::prop_assert!(matches!(&decoded, Ok((f, _)) if f.payload() == &payload[..]));
        } else if let Ok((frame, _)) = decode(&forged, CAP) {
            let owned = frame.to_owned_message();
            proptest::prop_assert!(owned.is_ok(), "{owned:?}");
            if let Ok(owned) = owned {
                proptest::prop_assert!(encode(&owned).is_ok());
            }
        }
    }
}

/// A `Data` header announcing `bytes`, then `bytes` as a payload frame.
fn chunk_frames(bytes: &[u8]) -> Vec<u8> {
    let header = Message::Data(DataChunk {
        transfer: 5,
        offset: 0,
        len: bytes.len() as u32,
    });
    let mut out = must_encode(&header);
    out.extend(encode_payload(bytes).unwrap_or_default());
    out
}

#[tokio::test]
async fn a_payload_is_read_into_the_callers_memory_and_the_stream_goes_on() {
    for len in [0, 1, 4096, 300_000] {
        let bytes = pattern(len);
        let mut stream = chunk_frames(&bytes);
        stream.extend(must_encode(&Message::Ping(8)));
        let mut reader = FrameReader::new(&stream[..], CAP);
        match reader.read().await {
            Ok(Some(frame)) => assert_eq!(frame.kind(), FrameKind::Data),
            other => panic!("{other:?}"),
        }
        let mut dst = vec![0u8; len];
        assert!(reader.read_payload_into(&mut dst).await.is_ok());
        assert_eq!(dst, bytes);
        match reader.read().await {
            Ok(Some(frame)) => assert_eq!(frame.to_owned_message(), Ok(Message::Ping(8))),
            other => panic!("{other:?}"),
        }
        assert!(matches!(reader.read().await, Ok(None)));
    }
}

#[tokio::test]
async fn a_discarded_payload_is_read_past_in_pieces() {
    // Larger than the discard buffer, so it takes several reads.
    let bytes = pattern(300_000);
    let mut stream = encode_payload(&bytes).unwrap_or_default();
    stream.extend(must_encode(&Message::Ping(9)));
    let mut reader = FrameReader::new(&stream[..], CAP);
    assert!(reader.discard_payload(bytes.len()).await.is_ok());
    match reader.read().await {
        Ok(Some(frame)) => assert_eq!(frame.to_owned_message(), Ok(Message::Ping(9))),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_payload_header_is_refused_before_a_payload_byte_is_read() {
    let payload_header = |len: u32, kind: FrameKind| {
        let mut header = header_of(&encode_payload(&[]).unwrap_or_default());
        header[6..8].copy_from_slice(&(kind as u16).to_le_bytes());
        header[8..12].copy_from_slice(&len.to_le_bytes());
        header
    };
    let cases = [
        (
            payload_header(100, FrameKind::Ping),
            100,
            FrameError::KindMismatch {
                header: FrameKind::Ping as u16,
                payload: FrameKind::Payload as u16,
            },
        ),
        (
            payload_header(CAP + 1, FrameKind::Payload),
            CAP as usize + 1,
            FrameError::TooLong {
                len: u64::from(CAP) + 1,
                cap: u64::from(CAP),
            },
        ),
        (
            payload_header(100, FrameKind::Payload),
            99,
            FrameError::Invalid(String::new()),
        ),
        (*b"XXXXXXXXXXXXXXXX", 100, FrameError::BadMagic(*b"XXXX")),
    ];
    for (header, want, expected) in cases {
        // Only the header is there: reading one payload byte would panic.
        let mut reader = FrameReader::new(
            OnlyThese {
                bytes: header.to_vec(),
                at: 0,
            },
            CAP,
        );
        let mut dst = vec![0u8; want];
        let err = match reader.read_payload_into(&mut dst).await {
            Err(ReadError::Frame(e)) => e,
            other => panic!("expected {expected:?}, got {other:?}"),
        };
        match (&err, &expected) {
            (FrameError::Invalid(_), FrameError::Invalid(_)) => {}
            _ => assert_eq!(err, expected),
        }
        // The payload was not consumed: the stream is out of sync for good.
        assert!(reader.read().await.is_err());
        assert!(reader.discard_payload(want).await.is_err());
    }
}

#[tokio::test]
async fn a_damaged_payload_is_a_crc_mismatch_and_the_stream_stays_in_step() {
    let bytes = pattern(5000);
    let mut stream = encode_payload(&bytes).unwrap_or_default();
    stream[HEADER_LEN + 1234] ^= 0x01;
    stream.extend(encode_payload(&bytes).unwrap_or_default());
    stream.extend(encode_payload(&bytes).unwrap_or_default());
    let last = stream.len() - 1;
    stream[last] ^= 0x80;
    stream.extend(must_encode(&Message::Ping(1)));
    let mut reader = FrameReader::new(&stream[..], CAP);
    let mut dst = vec![0u8; bytes.len()];
    assert!(matches!(
        reader.read_payload_into(&mut dst).await,
        Err(ReadError::Frame(FrameError::CrcMismatch { .. }))
    ));
    assert!(reader.read_payload_into(&mut dst).await.is_ok());
    assert_eq!(dst, bytes);
    assert!(matches!(
        reader.discard_payload(bytes.len()).await,
        Err(ReadError::Frame(FrameError::CrcMismatch { .. }))
    ));
    match reader.read().await {
        Ok(Some(frame)) => assert_eq!(frame.to_owned_message(), Ok(Message::Ping(1))),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_truncated_payload_is_truncated() {
    let bytes = pattern(1000);
    let frame = encode_payload(&bytes).unwrap_or_default();
    for cut in [0, 5, HEADER_LEN, HEADER_LEN + 999] {
        let mut reader = FrameReader::new(&frame[..cut], CAP);
        let mut dst = vec![0u8; bytes.len()];
        assert!(
            matches!(
                reader.read_payload_into(&mut dst).await,
                Err(ReadError::Frame(FrameError::Truncated { .. }))
            ),
            "cut at {cut}"
        );
    }
}

#[tokio::test]
async fn a_payload_read_dropped_midway_fails_every_later_read() {
    let bytes = pattern(1000);
    let frame = encode_payload(&bytes).unwrap_or_default();
    let (mut tx, rx) = tokio::io::duplex(64 * 1024);
    assert!(tx.write_all(&frame[..500]).await.is_ok());
    let mut reader = FrameReader::new(rx, CAP);
    let mut dst = vec![0u8; bytes.len()];
    {
        let fut = pin!(reader.read_payload_into(&mut dst));
        assert!(poll_once(fut).is_pending());
    }
    assert!(tx.write_all(&frame[500..]).await.is_ok());
    assert!(matches!(reader.read().await, Err(ReadError::Io(_))));
    assert!(reader.read_payload_into(&mut dst).await.is_err());
}

#[test]
fn lane_records_round_trip_and_garbage_is_refused() {
    let record = ferry_transports::ipc::LaneRecord {
        tag: 7,
        len: 8,
        source: ferry_transports::ipc::IpcSource {
            device_uuid: "GPU-1".into(),
            pool: "GPU-1#0".into(),
            buffer: 3,
            generation: 4,
            offset: 0,
            export: vec![9; 64],
            legacy: None,
        },
    };
    let bytes = record.encode().expect("encode");
    assert_eq!(
        ferry_transports::ipc::LaneRecord::decode(&bytes).expect("decode"),
        record
    );
    assert!(ferry_transports::ipc::LaneRecord::decode(&bytes[..bytes.len() / 2]).is_err());
    assert!(ferry_transports::ipc::LaneRecord::decode(&[0xff; 64]).is_err());
}
