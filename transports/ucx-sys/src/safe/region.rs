//! Memory that an operation may read or write while it is in flight.

/// Where bytes live, as UCX classifies memory (`ucs_memory_type_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MemoryType {
    /// Ordinary host memory.
    Host,
    /// CUDA device memory.
    Cuda,
    /// CUDA managed (unified) memory.
    CudaManaged,
    /// ROCm device memory.
    Rocm,
    /// ROCm managed memory.
    RocmManaged,
    /// Not said: UCX detects it (its memory-type cache), at some cost per operation.
    /// Also what a query reports for types newer than UCX 1.13's table.
    Unknown,
}

impl MemoryType {
    /// The `ucs_memory_type_t` value, or `None` for [`MemoryType::Unknown`], which is never
    /// passed to UCX (its number differs between versions: 5 in 1.13, 10 in 1.22).
    pub fn to_raw(self) -> Option<crate::sys::ucs_memory_type_t> {
        use crate::sys::*;
        Some(match self {
            MemoryType::Host => UCS_MEMORY_TYPE_HOST,
            MemoryType::Cuda => UCS_MEMORY_TYPE_CUDA,
            MemoryType::CudaManaged => UCS_MEMORY_TYPE_CUDA_MANAGED,
            MemoryType::Rocm => UCS_MEMORY_TYPE_ROCM,
            MemoryType::RocmManaged => UCS_MEMORY_TYPE_ROCM_MANAGED,
            MemoryType::Unknown => return None,
        })
    }

    /// The type for a `ucs_memory_type_t` value; values past 1.13's table are `Unknown`.
    pub fn from_raw(raw: crate::sys::ucs_memory_type_t) -> Self {
        use crate::sys::*;
        match raw {
            UCS_MEMORY_TYPE_HOST => MemoryType::Host,
            UCS_MEMORY_TYPE_CUDA => MemoryType::Cuda,
            UCS_MEMORY_TYPE_CUDA_MANAGED => MemoryType::CudaManaged,
            UCS_MEMORY_TYPE_ROCM => MemoryType::Rocm,
            UCS_MEMORY_TYPE_ROCM_MANAGED => MemoryType::RocmManaged,
            _ => MemoryType::Unknown,
        }
    }

    /// The types whose bits are set in a `memory_types` mask (bit `n` = value `n`).
    pub fn from_mask(mask: u64) -> Vec<MemoryType> {
        (0..5)
            .filter(|bit| mask & (1 << bit) != 0)
            .map(MemoryType::from_raw)
            .collect()
    }
}

/// Bytes an operation reads while in flight (the source of a put or a send).
///
/// An operation takes its region by value and gives it back when UCX can no longer touch
/// it (the lease rule: one owner at a time). A request that is leaked (or dropped while
/// UCX cannot finish it) leaks the region too, so its memory is never freed under UCX.
///
/// # Safety
///
/// An implementation promises that, for as long as the value exists and however it is
/// moved, `as_ptr()` and `len()` keep returning the same values and those `len()` bytes
/// stay allocated, of [`Region::memory_type`], and readable by UCX. `Vec<u8>` qualifies
/// (moving a `Vec` does not move its heap block, and no `&mut` to it can exist while a
/// request owns it); a stack array does not.
pub unsafe trait Region {
    /// Start of the bytes.
    fn as_ptr(&self) -> *const u8;
    /// Number of bytes.
    fn len(&self) -> usize;
    /// Whether there are no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// What kind of memory the bytes are; [`MemoryType::Unknown`] lets UCX detect it.
    fn memory_type(&self) -> MemoryType {
        MemoryType::Host
    }
}

/// Bytes an operation writes while in flight (the destination of a get or a receive).
///
/// # Safety
///
/// As [`Region`], and: UCX may write the bytes while a request owns the value, so no Rust
/// reference to them may exist during that time other than through this value (which the
/// request holds), and `as_mut_ptr()` equals `as_ptr()`.
pub unsafe trait RegionMut: Region {
    /// Start of the bytes, for writing.
    fn as_mut_ptr(&mut self) -> *mut u8;
}

// SAFETY: a Vec's heap block does not move when the Vec moves; while a request owns the
// Vec nothing can resize it, so pointer and length stay fixed; host memory.
unsafe impl Region for Vec<u8> {
    fn as_ptr(&self) -> *const u8 {
        <[u8]>::as_ptr(self)
    }
    fn len(&self) -> usize {
        <[u8]>::len(self)
    }
}

// SAFETY: as for `Region`; the request owning the Vec is the only way to reach its bytes.
unsafe impl RegionMut for Vec<u8> {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        <[u8]>::as_mut_ptr(self)
    }
}

// SAFETY: a boxed slice's heap block does not move when the Box moves and cannot resize.
unsafe impl Region for Box<[u8]> {
    fn as_ptr(&self) -> *const u8 {
        <[u8]>::as_ptr(self)
    }
    fn len(&self) -> usize {
        <[u8]>::len(self)
    }
}

// SAFETY: as for `Region`; the request owning the Box is the only way to reach its bytes.
unsafe impl RegionMut for Box<[u8]> {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        <[u8]>::as_mut_ptr(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_types_round_trip_and_unknown_is_never_sent() {
        for t in [
            MemoryType::Host,
            MemoryType::Cuda,
            MemoryType::CudaManaged,
            MemoryType::Rocm,
            MemoryType::RocmManaged,
        ] {
            let raw = t.to_raw().expect("a known type has a value");
            assert_eq!(MemoryType::from_raw(raw), t);
        }
        assert_eq!(MemoryType::Unknown.to_raw(), None);
        // 1.22's UCS_MEMORY_TYPE_RDMA (5) and later are not in the 1.13 table.
        assert_eq!(MemoryType::from_raw(5), MemoryType::Unknown);
        assert_eq!(
            MemoryType::from_mask(0b11),
            vec![MemoryType::Host, MemoryType::Cuda]
        );
    }

    #[test]
    fn a_moved_vec_keeps_its_address() {
        let v = vec![1u8, 2, 3];
        let before = Region::as_ptr(&v);
        let moved = v;
        assert_eq!(Region::as_ptr(&moved), before);
        assert_eq!(Region::len(&moved), 3);
    }
}
