//! Helpers shared by the integration tests.

#![allow(dead_code)] // each test file uses a different subset

use std::time::Duration;

use ucx_sys::{Context, Features, Ucx};

/// A generous deadline for operations that take milliseconds when healthy.
pub const DEADLINE: Duration = Duration::from_secs(30);

/// The transports the tests allow: `FERRY_UCX_TEST_TLS`, else `tcp,self`.
pub fn test_tls() -> String {
    std::env::var("FERRY_UCX_TEST_TLS").unwrap_or_else(|_| "tcp,self".into())
}

/// A context for loopback tests: TAG + RMA (+ `extra`), the test transports, only `lo`.
pub fn loopback_context(ucx: &Ucx, extra: Option<Features>) -> Context {
    loopback_context_over(ucx, extra, &test_tls())
}

/// [`loopback_context`] over the transports `tls`.
pub fn loopback_context_over(ucx: &Ucx, extra: Option<Features>, tls: &str) -> Context {
    let features = match extra {
        Some(f) => Features::TAG | Features::RMA | f,
        None => Features::TAG | Features::RMA,
    };
    ucx.context()
        .features(features)
        .set("TLS", tls)
        .set("NET_DEVICES", "lo")
        .name("ucx-sys-test")
        .build()
        .expect("a loopback context")
}

/// `len` bytes of a pattern that differs per `seed` and per position (xorshift64).
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
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

/// Where two buffers first differ, for a readable failure.
pub fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    if a.len() != b.len() {
        return Some(a.len().min(b.len()));
    }
    if a == b {
        return None;
    }
    a.iter().zip(b).position(|(x, y)| x != y)
}

/// Lower-case hex.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Bytes from lower-case hex.
pub fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

/// MB/s (10^6 bytes per second) of `bytes` in `elapsed`.
pub fn mbps(bytes: usize, elapsed: Duration) -> f64 {
    bytes as f64 / elapsed.as_secs_f64() / 1e6
}
