//! Test and bench helpers: fill device memory with a known pattern and checksum it back.
//! Host round trips through pageable memory: for correctness checks, not for speed.

use super::copy::{DeviceMemory, copy_from_host, copy_to_host};
use super::error::CudaError;
use super::stream::Stream;

/// `len` bytes of a deterministic pattern for `seed` (a xorshift sequence: neighbouring
/// bytes and different seeds differ, so a shifted or stale copy does not match).
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed ^ 0x9e37_79b9_7f4a_7c15;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// The checksum these helpers use (CRC-32C).
pub fn checksum(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

/// Writes [`pattern`]`(seed, dst.len())` over the whole buffer and returns its checksum.
/// Blocks until the write has completed.
///
/// # Errors
/// A driver error.
pub fn fill_pattern(
    dst: &mut impl DeviceMemory,
    seed: u64,
    stream: &Stream,
) -> Result<u32, CudaError> {
    let bytes = pattern(seed, dst.len());
    copy_from_host(dst, 0, &bytes, stream)?;
    Ok(checksum(&bytes))
}

/// Reads the whole buffer back to the host and returns its checksum. Blocks.
///
/// # Errors
/// A driver error.
pub fn device_checksum(src: &impl DeviceMemory, stream: &Stream) -> Result<u32, CudaError> {
    let mut bytes = vec![0u8; src.len()];
    copy_to_host(&mut bytes, src, 0, stream)?;
    Ok(checksum(&bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_is_deterministic_and_seed_dependent() {
        assert_eq!(pattern(7, 1000), pattern(7, 1000));
        assert_ne!(pattern(7, 1000), pattern(8, 1000));
        assert_eq!(pattern(7, 13), pattern(7, 1000)[..13]);
        assert!(pattern(1, 0).is_empty());
    }
}
