//! Registered memory ([`MemoryHandle`]), its packed remote key, and regions of it that
//! operations can lend.

use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::error::UcxError;
use crate::result;
use crate::safe::context::Context;
use crate::safe::region::{MemoryType, Region, RegionMut};
use crate::sys;

/// Memory registered with a context (`ucp_mem_map`), so peers can reach it with a
/// remote key. Cheap to clone (shared); unmapped when the last clone and every
/// [`MappedRegion`] of it are gone. `Send` and `Sync`.
///
/// Unmapping does not revoke remote keys a peer already unpacked: the peer must stop using
/// them first (ferry's allocation generations), or, over shared memory, a late put could
/// land in memory that has been reused.
#[derive(Debug, Clone)]
pub struct MemoryHandle {
    inner: Arc<MemoryInner>,
}

#[derive(Debug)]
struct MemoryInner {
    context: Context,
    handle: NonNull<sys::ucp_mem>,
    address: NonNull<u8>,
    len: usize,
    memory_type: MemoryType,
}

// SAFETY: the memory handle is immutable after mapping; the context it belongs to locks
// its own state (`mt_workers_shared`), so packing keys and unmapping may happen on any
// thread. The memory itself is reached only through raw pointers (never a Rust
// reference that outlives a call), and unmapping happens once, in `Drop`.
unsafe impl Send for MemoryInner {}
// SAFETY: as above.
unsafe impl Sync for MemoryInner {}

impl Drop for MemoryInner {
    fn drop(&mut self) {
        // SAFETY: `handle` came from `mem_map` on this context and is unmapped once, here.
        // Regions and requests using the memory hold this `Arc`, so none is left. An error
        // cannot be reported from `drop`; UCX logs it.
        let _ =
            unsafe { result::mem_unmap(self.context.lib(), self.context.handle(), self.handle) };
    }
}

/// A packed remote key: bytes for a peer's [`crate::Endpoint::unpack_rkey`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedRkey(Vec<u8>);

impl PackedRkey {
    /// The bytes to send to a peer.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// A packed key received from a peer.
    ///
    /// # Safety
    ///
    /// UCX unpacks remote keys without fully validating them. `bytes` must be exactly what
    /// a peer's [`MemoryHandle::pack_rkey`] returned, carried over a channel that
    /// authenticates the peer and checks integrity, from a UCX of the same build.
    pub unsafe fn from_bytes(bytes: Vec<u8>) -> Self {
        Self(bytes)
    }
}

impl MemoryHandle {
    /// Allocates `len` bytes of host memory through UCX and registers it
    /// (`UCP_MEM_MAP_ALLOCATE`); UCX frees it on unmap. The contents start unspecified.
    ///
    /// # Errors
    ///
    /// [`UcxError::Misuse`] for `len == 0`; UCX's status.
    pub fn allocate(context: &Context, len: usize) -> Result<Self, UcxError> {
        if len == 0 {
            return Err(UcxError::Misuse("cannot map 0 bytes".into()));
        }
        let params = sys::ucp_mem_map_params_t {
            field_mask: sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH | sys::UCP_MEM_MAP_PARAM_FIELD_FLAGS,
            length: len,
            flags: sys::UCP_MEM_MAP_ALLOCATE,
            ..Default::default()
        };
        // SAFETY: the context is live; the mask names the two fields set; with ALLOCATE
        // UCX owns the memory.
        let handle = unsafe { result::mem_map(context.lib(), context.handle(), &params) }?;
        let mut attr = sys::ucp_mem_attr_t {
            field_mask: sys::UCP_MEM_ATTR_FIELD_ADDRESS | sys::UCP_MEM_ATTR_FIELD_LENGTH,
            ..Default::default()
        };
        // SAFETY: `handle` is live; `attr` asks for the two fields it has.
        let queried = unsafe { result::mem_query(context.lib(), handle, &mut attr) };
        let address = queried.and_then(|()| {
            NonNull::new(attr.address.cast::<u8>())
                .filter(|_| attr.length >= len)
                .ok_or_else(|| UcxError::Misuse("ucp_mem_query returned no memory".into()))
        });
        let address = match address {
            Ok(a) => a,
            Err(e) => {
                // SAFETY: `handle` is live and unmapped once, here, on the failure path.
                let _ = unsafe { result::mem_unmap(context.lib(), context.handle(), handle) };
                return Err(e);
            }
        };
        Ok(Self::wrap(context, handle, address, len, MemoryType::Host))
    }

    /// Registers `len` bytes at `address` of `memory_type` (host, or device memory where
    /// the loaded UCX supports it; [`MemoryType::Unknown`] lets UCX detect it).
    ///
    /// # Errors
    ///
    /// [`UcxError::Misuse`] for a null address or `len == 0`; UCX's status.
    ///
    /// # Safety
    ///
    /// The memory must stay allocated (not freed, unmapped or remapped) until the handle
    /// and every clone and [`MappedRegion`] of it are dropped, and must be of
    /// `memory_type`. Peers may write it through remote keys at any time while mapped;
    /// the caller's protocol decides when its contents may be read.
    pub unsafe fn map(
        context: &Context,
        address: *mut u8,
        len: usize,
        memory_type: MemoryType,
    ) -> Result<Self, UcxError> {
        let Some(address) = NonNull::new(address).filter(|_| len > 0) else {
            return Err(UcxError::Misuse(
                "cannot map a null address or 0 bytes".into(),
            ));
        };
        let mut params = sys::ucp_mem_map_params_t {
            field_mask: sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH,
            address: address.as_ptr().cast::<c_void>(),
            length: len,
            ..Default::default()
        };
        if let Some(raw) = memory_type.to_raw() {
            params.field_mask |= sys::UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
            params.memory_type = raw;
        }
        // SAFETY: the context is live; the mask names the fields set; the caller keeps the
        // memory allocated until the handle is gone (this function's contract).
        let handle = unsafe { result::mem_map(context.lib(), context.handle(), &params) }?;
        Ok(Self::wrap(context, handle, address, len, memory_type))
    }

    fn wrap(
        context: &Context,
        handle: NonNull<sys::ucp_mem>,
        address: NonNull<u8>,
        len: usize,
        memory_type: MemoryType,
    ) -> Self {
        Self {
            inner: Arc::new(MemoryInner {
                context: context.clone(),
                handle,
                address,
                len,
                memory_type,
            }),
        }
    }

    /// The memory's address, as a peer uses it in puts and gets (`remote_addr`).
    pub fn address(&self) -> u64 {
        self.inner.address.as_ptr() as u64
    }

    /// Start of the memory, for local use through raw pointers.
    pub fn as_ptr(&self) -> *mut u8 {
        self.inner.address.as_ptr()
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.inner.len
    }

    /// Whether the mapping is empty (never: 0-byte mappings are refused).
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// The memory's type.
    pub fn memory_type(&self) -> MemoryType {
        self.inner.memory_type
    }

    /// Packs a remote key for peers (`ucp_rkey_pack`); the bytes are copied out and UCX's
    /// buffer released.
    ///
    /// # Errors
    ///
    /// UCX's status.
    pub fn pack_rkey(&self) -> Result<PackedRkey, UcxError> {
        let lib = self.inner.context.lib();
        // SAFETY: context and memory handle are live while `self` is.
        let (buffer, size) =
            unsafe { result::rkey_pack(lib, self.inner.context.handle(), self.inner.handle) }?;
        // SAFETY: UCX returned `size` readable bytes at `buffer`, valid until released.
        let bytes =
            unsafe { std::slice::from_raw_parts(buffer.as_ptr().cast::<u8>(), size) }.to_vec();
        // SAFETY: `buffer` came from `rkey_pack` and is released once, here.
        unsafe { result::rkey_buffer_release(lib, buffer) };
        Ok(PackedRkey(bytes))
    }

    /// Copies `src` into the memory at `offset`. Host memory only.
    ///
    /// # Errors
    ///
    /// [`UcxError::Misuse`] for non-host memory or a range outside the mapping.
    ///
    /// # Safety
    ///
    /// Nothing else reads or writes the range while the copy runs: no local request lending
    /// a [`MappedRegion`] over it is in flight, and no peer accesses it through a remote key
    /// (the caller's protocol, e.g. ferry's grants, establishes that).
    pub unsafe fn write(&self, offset: usize, src: &[u8]) -> Result<(), UcxError> {
        let dst = self.host_range(offset, src.len())?;
        // SAFETY: `dst..dst+len` is inside the live host mapping (checked); `src` is a
        // Rust slice, which cannot overlap memory this crate never hands out references
        // to; nothing else accesses the range meanwhile (the caller's contract).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
        Ok(())
    }

    /// Copies the memory at `offset` into `dst`. Host memory only.
    ///
    /// # Errors
    ///
    /// [`UcxError::Misuse`] for non-host memory or a range outside the mapping.
    ///
    /// # Safety
    ///
    /// Nothing writes the range while the copy runs (no local get or receive into it in
    /// flight, no peer put): after the operation that filled it completed, or after the
    /// peer's flush, as the caller's protocol says.
    pub unsafe fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), UcxError> {
        let src = self.host_range(offset, dst.len())?;
        // SAFETY: as in `write`, with the roles swapped.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// `len` bytes at `offset` as a region an operation can lend (the source of a put or
    /// the destination of a get). Keeps the mapping alive.
    ///
    /// # Errors
    ///
    /// [`UcxError::Misuse`] for a range outside the mapping.
    pub fn region(&self, offset: usize, len: usize) -> Result<MappedRegion, UcxError> {
        self.check_range(offset, len)?;
        Ok(MappedRegion {
            memory: self.clone(),
            offset,
            len,
        })
    }

    fn check_range(&self, offset: usize, len: usize) -> Result<(), UcxError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.inner.len => Ok(()),
            _ => Err(UcxError::Misuse(format!(
                "range {offset}+{len} is outside the {}-byte mapping",
                self.inner.len
            ))),
        }
    }

    fn host_range(&self, offset: usize, len: usize) -> Result<*mut u8, UcxError> {
        if self.inner.memory_type != MemoryType::Host {
            return Err(UcxError::Misuse(format!(
                "{:?} memory cannot be copied by the CPU",
                self.inner.memory_type
            )));
        }
        self.check_range(offset, len)?;
        // SAFETY: `offset <= len` of the mapping (checked), so the result stays inside it.
        Ok(unsafe { self.as_ptr().add(offset) })
    }
}

/// Part of a [`MemoryHandle`]'s memory, lent to an operation. Keeps the mapping alive.
#[derive(Debug, Clone)]
pub struct MappedRegion {
    memory: MemoryHandle,
    offset: usize,
    len: usize,
}

impl MappedRegion {
    /// The mapping it is part of.
    pub fn memory(&self) -> &MemoryHandle {
        &self.memory
    }

    /// Offset in the mapping.
    pub fn offset(&self) -> usize {
        self.offset
    }
}

// SAFETY: the range lies inside the mapping (checked in `MemoryHandle::region`), which
// stays mapped and allocated while this value holds its `MemoryHandle` clone; pointer and
// length are fixed at creation and do not depend on where the value is moved; the memory
// type is the mapping's.
unsafe impl Region for MappedRegion {
    fn as_ptr(&self) -> *const u8 {
        // The offset is inside the mapping (checked at creation); wrapping_add avoids an
        // unsafe block for what is a plain address computation.
        self.memory.as_ptr().wrapping_add(self.offset)
    }
    fn len(&self) -> usize {
        self.len
    }
    fn memory_type(&self) -> MemoryType {
        self.memory.memory_type()
    }
}

// SAFETY: as for `Region`. This crate never creates a Rust reference to mapped memory
// (its reads and writes are raw-pointer copies whose callers promise no concurrent
// access), so UCX writing the range while a request owns this value aliases no reference.
unsafe impl RegionMut for MappedRegion {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.memory.as_ptr().wrapping_add(self.offset)
    }
}
