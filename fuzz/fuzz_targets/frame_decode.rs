//! Feeds arbitrary bytes to the frame decoder: it must never panic, and whatever it accepts
//! must read back and re-encode to the same frame: a message must deserialize and re-encode
//! to an equal message, a raw payload frame must re-encode to the same bytes.
#![no_main]

use ferry_transports::wire::{FrameKind, decode, encode, encode_payload};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok((frame, consumed)) = decode(data, 1 << 20) else {
        return;
    };
    assert!(consumed <= data.len());
    if frame.kind() == FrameKind::Payload {
        // Raw bytes: no message in them, and nothing to check but the CRC.
        assert!(frame.message().is_err(), "a payload frame carries no message");
        let again = encode_payload(frame.payload()).expect("a payload re-encodes");
        assert_eq!(&again[..], &data[..consumed]);
        return;
    }
    let archived = frame.message().expect("a decoded frame validates again");
    assert_eq!(archived.kind(), frame.kind());
    let owned = frame
        .to_owned_message()
        .expect("a validated frame deserializes");
    let again = encode(&owned).expect("a decoded message re-encodes");
    let (reread, _) = decode(&again, 1 << 20).expect("a re-encoded frame decodes");
    assert_eq!(reread.to_owned_message().ok(), Some(owned));
});
