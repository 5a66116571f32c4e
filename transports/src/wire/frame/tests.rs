use super::*;
use crate::wire::Done;

#[test]
fn header_round_trips() {
    let header = FrameHeader::for_payload(FrameKind::Data, b"abc").ok();
    let Some(header) = header else {
        panic!("encode failed")
    };
    assert_eq!(parse_header(&header.to_bytes(), 16), Ok(header));
}

#[test]
fn reasons_are_indexed_consistently() {
    let e = FrameError::KindMismatch {
        header: 1,
        payload: 2,
    };
    assert_eq!(e.reason(), "kind_mismatch");
    assert_eq!(FrameError::REASONS[e.reason_index()], e.reason());
}

#[test]
fn decode_reports_consumed() {
    let msg = Message::Done(Done { transfer: 7 });
    let mut bytes = encode(&msg).unwrap_or_default();
    let len = bytes.len();
    bytes.extend_from_slice(b"trailing");
    let (frame, used) = match decode(&bytes, 1024) {
        Ok(v) => v,
        Err(e) => panic!("{e}"),
    };
    assert_eq!(used, len);
    assert_eq!(frame.to_owned_message(), Ok(msg));
}
