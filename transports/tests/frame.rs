//! Frame encoding and decoding: round trips, and hostile input (every bit flip, every
//! truncation, absurd lengths, wrong versions, garbage, mismatched kinds).

use std::future::Future;
use std::io;
use std::pin::{Pin, pin};
use std::task::{Context, Poll, Waker};

use ferry_transports::wire::{
    Cancel, DataChunk, Done, FrameError, FrameHeader, FrameKind, FrameReader, Grant, HEADER_LEN,
    Hello, Message, Offer, PROTOCOL_VERSION, PutAck, PutChunk, ReadError, WireDirection,
    WireMemoryKind, WireReason, decode, encode, encode_into, parse_header, read_frame,
};
use tokio::io::{AsyncRead, AsyncWriteExt, ReadBuf};

const CAP: u32 = 1 << 20;

fn hello() -> Hello {
    Hello {
        node: "node-a".into(),
        version: PROTOCOL_VERSION,
        host_id: "0123456789abcdef".into(),
        pid: 4242,
        transports: vec!["tcp".into(), "ipc".into()],
        max_frame: CAP,
    }
}

/// One message of every variant, plus a few sizes of the variable-length ones.
fn corpus() -> Vec<Message> {
    vec![
        Message::Hello(hello()),
        Message::Offer(Offer {
            transfer: 1,
            tag: 0xfeed,
            len: 1 << 30,
            source: WireMemoryKind::Device(3),
            transport: "staged".into(),
            direction: WireDirection::Pull,
        }),
        Message::Grant(Grant {
            transfer: 1,
            landing: WireMemoryKind::PinnedHost,
        }),
        Message::Data(DataChunk {
            transfer: 2,
            offset: 0,
            bytes: Vec::new(),
        }),
        Message::Data(DataChunk {
            transfer: 2,
            offset: 4096,
            bytes: (0..4096u32).map(|i| (i * 31 % 251) as u8).collect(),
        }),
        Message::Done(Done { transfer: 2 }),
        Message::Cancel(Cancel {
            transfer: 3,
            reason: WireReason::DeadlineExceeded,
            detail: "deadline of 5s passed".into(),
        }),
        Message::Put(PutChunk {
            put: 9,
            region: 10,
            generation: 11,
            offset: 12,
            last: true,
            bytes: vec![0xab; 300],
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
    ]
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
    let msgs = corpus();
    let mut kinds: Vec<FrameKind> = msgs.iter().map(Message::kind).collect();
    kinds.dedup();
    let all = (0..=u16::MAX)
        .filter(|k| FrameKind::from_u16(*k).is_some())
        .count();
    assert_eq!(kinds.len(), all, "the corpus covers every variant");

    for msg in msgs {
        let bytes = must_encode(&msg);
        let (frame, used) = match decode(&bytes, CAP) {
            Ok(v) => v,
            Err(e) => panic!("decoding {msg:?}: {e}"),
        };
        assert_eq!(used, bytes.len());
        assert_eq!(frame.kind(), msg.kind());
        assert_eq!(frame.header().len as usize, bytes.len() - HEADER_LEN);
        assert_eq!(frame.header().version, PROTOCOL_VERSION);
        assert_eq!(frame.message().map(|m| m.kind()), Ok(msg.kind()));
        assert_eq!(frame.to_owned_message(), Ok(msg));
    }
}

#[test]
fn frames_decode_back_to_back() {
    let msgs = corpus();
    let mut stream = Vec::new();
    for msg in &msgs {
        assert_eq!(encode_into(msg, &mut stream), Ok(()));
    }
    let mut rest = &stream[..];
    for msg in &msgs {
        let (frame, used) = match decode(rest, CAP) {
            Ok(v) => v,
            Err(e) => panic!("{e}"),
        };
        assert_eq!(frame.to_owned_message().as_ref(), Ok(msg));
        rest = &rest[used..];
    }
    assert!(rest.is_empty());
}

#[test]
fn every_single_bit_flip_is_rejected() {
    for msg in corpus() {
        let good = must_encode(&msg);
        let mut bytes = good.clone();
        for byte in 0..bytes.len() {
            for bit in 0..8 {
                bytes[byte] ^= 1 << bit;
                if let Ok((frame, _)) = decode(&bytes, CAP) {
                    panic!(
                        "flip of bit {bit} of byte {byte} of {:?} accepted as {:?}",
                        msg.kind(),
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
    for msg in corpus() {
        let bytes = must_encode(&msg);
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
                Err(e) => assert_eq!(e, expected, "cut at {cut} of {:?}", msg.kind()),
                Ok(_) => panic!("prefix of {cut} bytes of {:?} accepted", msg.kind()),
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
    for msg in corpus() {
        let bytes = must_encode(&msg);
        let mut reader = OnlyThese { bytes, at: 0 };
        match read_frame(&mut reader, CAP).await {
            Ok(Some(frame)) => assert_eq!(frame.to_owned_message(), Ok(msg)),
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
    let msgs = corpus();
    let mut stream = Vec::new();
    for msg in &msgs {
        assert_eq!(encode_into(msg, &mut stream), Ok(()));
    }
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
                Poll::Ready(Ok(Some(frame))) => got.push(frame.to_owned_message()),
                Poll::Ready(other) => panic!("unexpected {other:?}"),
                Poll::Pending => break,
            }
        }
    }
    drop(tx);
    assert!(matches!(reader.read().await, Ok(None)));
    let expected: Vec<_> = msgs.into_iter().map(Ok).collect();
    assert_eq!(got, expected);
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
        which in 0usize..13,
        edits in proptest::collection::vec((proptest::prelude::any::<usize>(), proptest::prelude::any::<u8>()), 1..8),
    ) {
        let msgs = corpus();
        let msg = &msgs[which % msgs.len()];
        let bytes = must_encode(msg);
        let mut payload = bytes[HEADER_LEN..].to_vec();
        if payload.is_empty() {
            return Ok(());
        }
        for (at, value) in edits {
            let len = payload.len();
            payload[at % len] = value;
        }
        let forged = reframe(msg.kind() as u16, &payload);
        if let Ok((frame, _)) = decode(&forged, CAP) {
            let owned = frame.to_owned_message();
            proptest::prop_assert!(owned.is_ok(), "{owned:?}");
            if let Ok(owned) = owned {
                proptest::prop_assert!(encode(&owned).is_ok());
            }
        }
    }
}
