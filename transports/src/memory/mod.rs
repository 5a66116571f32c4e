//! Memory kinds, buffers and leases.
//!
//! A [`Buffer`] is a lease on a region of one memory domain: `(kind, id, generation, len)`.
//! Addresses never identify a buffer. A buffer has one owner at a time; dropping it returns
//! its bytes to the domain's allocator through the [`Releaser`] it was granted with.
//! While a transport streams a buffer it holds a [`SharedBytes`] view, and the buffer cannot
//! be written or given back until that view is dropped.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use crate::wire::WireMemoryKind;

/// Where a buffer's bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MemoryKind {
    /// Pageable host memory.
    Host,
    /// Page-locked host memory (arrives with the GPU transports).
    PinnedHost,
    /// Memory of the GPU with this ordinal (arrives with the GPU transports).
    Device(u32),
}

impl MemoryKind {
    /// The wire form.
    pub fn to_wire(self) -> WireMemoryKind {
        match self {
            Self::Host => WireMemoryKind::Host,
            Self::PinnedHost => WireMemoryKind::PinnedHost,
            Self::Device(n) => WireMemoryKind::Device(n),
        }
    }

    /// From the wire form.
    pub fn from_wire(kind: WireMemoryKind) -> Self {
        match kind {
            WireMemoryKind::Host => Self::Host,
            WireMemoryKind::PinnedHost => Self::PinnedHost,
            WireMemoryKind::Device(n) => Self::Device(n),
        }
    }
}

impl fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Host => f.write_str("host"),
            Self::PinnedHost => f.write_str("pinned"),
            Self::Device(n) => write!(f, "device{n}"),
        }
    }
}

/// A buffer's id within its domain. Ids are never reused within a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BufferId(pub u64);

/// Bumped each time a domain hands out memory under an id, so a stale key is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Generation(pub u64);

/// What identifies a granted region of memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Lease {
    /// The domain the memory belongs to.
    pub kind: MemoryKind,
    /// The buffer's id.
    pub id: BufferId,
    /// The grant's generation.
    pub generation: Generation,
    /// Length in bytes.
    pub len: u64,
}

/// Gives a lease's memory back to its domain. Implemented by the allocator.
///
/// `release` is called exactly once per lease, from whatever thread drops the last view of
/// the buffer; it must not block.
pub trait Releaser: Send + Sync + 'static {
    /// Returns the lease's bytes to the domain's budget.
    fn release(&self, lease: &Lease);
}

/// Where a buffer can get memory in another tier: the node that granted it. Lets
/// [`Buffer::promote`] work without a handle to the node.
pub trait MemoryHome: Send + Sync + 'static {
    /// A buffer of `len` bytes of `kind` memory, waiting for budget until `deadline`
    /// (no spill: it lands in `kind` or fails).
    fn reserve(
        &self,
        kind: MemoryKind,
        len: u64,
        deadline: Instant,
    ) -> Pin<Box<dyn Future<Output = Result<Buffer, String>> + Send>>;
}

/// A promotion that did not happen; the buffer is given back untouched.
#[derive(Debug, thiserror::Error)]
#[error("cannot promote the buffer to {kind} memory: {reason}")]
pub struct PromoteError {
    /// The buffer, where it was.
    pub buffer: Buffer,
    /// The tier asked for.
    pub kind: MemoryKind,
    /// Why.
    pub reason: String,
}

struct Storage {
    lease: Lease,
    bytes: Box<[u8]>,
    releaser: Arc<dyn Releaser>,
    home: Option<Arc<dyn MemoryHome>>,
}

impl Drop for Storage {
    fn drop(&mut self) {
        self.releaser.release(&self.lease);
    }
}

/// A lease on memory, with the bytes it covers.
///
/// Moving a `Buffer` moves the lease; dropping it gives the memory back to its domain.
pub struct Buffer {
    storage: Arc<Storage>,
}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buffer")
            .field("lease", &self.storage.lease)
            .finish()
    }
}

impl Buffer {
    /// Wraps zeroed host memory of `lease.len` bytes granted under `lease`. Used by allocators.
    ///
    /// # Panics
    /// Never for lengths that fit the address space; the allocation itself aborts on
    /// exhaustion like any Rust allocation, which is why budgets are checked first.
    pub fn new_host(lease: Lease, releaser: Arc<dyn Releaser>) -> Self {
        Self::with_home(lease, releaser, None)
    }

    /// Like [`Self::new_host`], for a buffer that can be promoted through `home`.
    pub fn with_home(
        lease: Lease,
        releaser: Arc<dyn Releaser>,
        home: Option<Arc<dyn MemoryHome>>,
    ) -> Self {
        let len = usize::try_from(lease.len).unwrap_or(usize::MAX);
        Self {
            storage: Arc::new(Storage {
                lease,
                bytes: vec![0u8; len].into_boxed_slice(),
                releaser,
                home,
            }),
        }
    }

    /// Moves the bytes into `kind` memory (typically back from a tier it spilled to),
    /// waiting for that tier's budget until `deadline`. The copy is byte-exact and the old
    /// memory is released. A buffer already in `kind` comes back as it is.
    ///
    /// # Errors
    /// [`PromoteError`], with the buffer untouched, when the tier cannot grant in time, or
    /// the buffer did not come from a node (or is still shared with a transport).
    ///
    /// # Cancel safety
    /// Dropping the future drops the buffer (its memory is released).
    pub async fn promote(
        self,
        kind: MemoryKind,
        deadline: Instant,
    ) -> Result<Buffer, PromoteError> {
        if self.kind() == kind {
            return Ok(self);
        }
        let fail = |buffer: Buffer, reason: String| PromoteError {
            buffer,
            kind,
            reason,
        };
        let Some(home) = self.storage.home.clone() else {
            return Err(fail(self, "the buffer did not come from a node".into()));
        };
        match home.reserve(kind, self.len() as u64, deadline).await {
            Ok(mut target) => match target.as_mut_slice() {
                Some(dst) => {
                    dst.copy_from_slice(self.as_slice());
                    metrics::counter!("ferry_promoted_bytes_total").increment(dst.len() as u64);
                    Ok(target)
                }
                None => Err(fail(self, "the new buffer is shared".into())),
            },
            Err(reason) => Err(fail(self, reason)),
        }
    }

    /// The buffer's lease.
    pub fn lease(&self) -> Lease {
        self.storage.lease
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.storage.bytes.len()
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.storage.bytes.is_empty()
    }

    /// Where the bytes live.
    pub fn kind(&self) -> MemoryKind {
        self.storage.lease.kind
    }

    /// The bytes, for memory the CPU can read.
    pub fn as_slice(&self) -> &[u8] {
        &self.storage.bytes
    }

    /// The bytes, writable; `None` while a transport still holds a view of them.
    pub fn as_mut_slice(&mut self) -> Option<&mut [u8]> {
        Arc::get_mut(&mut self.storage).map(|s| &mut s.bytes[..])
    }

    /// A read-only view for a transport to stream from. The buffer stays unwritable until
    /// every view is dropped.
    pub fn share(&self) -> SharedBytes {
        SharedBytes {
            storage: Arc::clone(&self.storage),
        }
    }

    /// True when no [`SharedBytes`] view is alive, so nothing else can touch the bytes.
    pub fn is_exclusive(&self) -> bool {
        Arc::strong_count(&self.storage) == 1
    }
}

/// A read-only view of a buffer's bytes held by a transport while it streams them.
#[derive(Clone)]
pub struct SharedBytes {
    storage: Arc<Storage>,
}

impl SharedBytes {
    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.storage.bytes
    }
}

impl fmt::Debug for SharedBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedBytes")
            .field("lease", &self.storage.lease)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    #[derive(Default)]
    struct Count(AtomicU64);
    impl Releaser for Count {
        fn release(&self, lease: &Lease) {
            self.0.fetch_add(lease.len, Ordering::SeqCst);
        }
    }

    fn lease(len: u64) -> Lease {
        Lease {
            kind: MemoryKind::Host,
            id: BufferId(1),
            generation: Generation(1),
            len,
        }
    }

    #[test]
    fn released_once_after_last_view() {
        let count = Arc::new(Count::default());
        let mut buf = Buffer::new_host(lease(10), count.clone());
        let view = buf.share();
        assert!(
            buf.as_mut_slice().is_none(),
            "shared buffer must not be writable"
        );
        drop(buf);
        assert_eq!(
            count.0.load(Ordering::SeqCst),
            0,
            "a view still holds the bytes"
        );
        drop(view);
        assert_eq!(count.0.load(Ordering::SeqCst), 10);
    }
}
