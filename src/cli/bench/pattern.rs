//! The bench's payload: bytes that depend only on the buffer's length, so the receiver can
//! check a buffer without being told what it should hold.

fn word(index: u64, len: u64) -> u64 {
    // splitmix64 of (index, len)
    let mut z = index
        .wrapping_add(len.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Fills `bytes` with the pattern of its length.
pub fn fill(bytes: &mut [u8]) {
    fill_at(bytes, 0, bytes.len() as u64);
}

/// Fills `buffer` with the pattern of its length, in place for host memory, through a host
/// copy for device memory.
///
/// # Errors
/// The copy into device memory failing.
pub fn fill_buffer(buffer: &mut ferry::Buffer) -> Result<(), ferry::MemoryError> {
    if let Some(bytes) = buffer.as_mut_slice() {
        fill(bytes);
        return Ok(());
    }
    let mut bytes = vec![0u8; buffer.len()];
    fill(&mut bytes);
    buffer.write(0, &bytes)
}

fn fill_at(bytes: &mut [u8], first_word: u64, len: u64) {
    let mut words = bytes.chunks_exact_mut(8);
    let mut k = first_word;
    for w in &mut words {
        w.copy_from_slice(&word(k, len).to_le_bytes());
        k += 1;
    }
    let tail = words.into_remainder();
    let last = word(k, len).to_le_bytes();
    tail.copy_from_slice(&last[..tail.len()]);
}

/// CRC32C of the pattern of `len` bytes, computed a piece at a time.
pub fn crc(len: usize) -> u32 {
    const PIECE: usize = 1 << 20;
    let mut piece = vec![0u8; PIECE.min(len)];
    let mut crc = 0;
    let mut done = 0;
    while done < len {
        let n = PIECE.min(len - done);
        fill_at(&mut piece[..n], (done / 8) as u64, len as u64);
        crc = crc32c::crc32c_append(crc, &piece[..n]);
        done += n;
    }
    crc
}

#[cfg(test)]
mod tests {
    #[test]
    fn piecewise_crc_matches_whole() {
        for len in [0, 1, 7, 8, 9, (1 << 20) + 13, 3 << 20] {
            let mut whole = vec![0u8; len];
            super::fill(&mut whole);
            assert_eq!(super::crc(len), crc32c::crc32c(&whole), "len {len}");
        }
    }
}
