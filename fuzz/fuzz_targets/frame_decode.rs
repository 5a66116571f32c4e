//! Feeds arbitrary bytes to the frame decoder: it must never panic, and whatever it accepts
//! must read back, deserialize and re-encode to the same bytes.
#![no_main]

use ferry_transports::wire::{decode, encode};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok((frame, consumed)) = decode(data, 1 << 20) else {
        return;
    };
    assert!(consumed <= data.len());
    let archived = frame.message().expect("a decoded frame validates again");
    assert_eq!(archived.kind(), frame.kind());
    let owned = frame
        .to_owned_message()
        .expect("a validated frame deserializes");
    let again = encode(&owned).expect("a decoded message re-encodes");
    let (reread, _) = decode(&again, 1 << 20).expect("a re-encoded frame decodes");
    assert_eq!(reread.to_owned_message().ok(), Some(owned));
});
