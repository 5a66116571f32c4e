//! Host memory of a buffer: the heap's, or a mapping lent by a source a transport offers
//! the node (a shared-memory pool that same-host peers map), behind one type that derefs to
//! `[u8]`. The memory module and the allocator name no source: a domain takes its host
//! memory from the [`HostSource`] the node gives it, and the heap where the source has
//! none.

use std::any::Any;
use std::fmt;
use std::ops::{Deref, DerefMut};

use super::Fill;

/// Host memory lent by a [`HostSource`] (a range of a mapping): readable and writable in
/// place, given back to its source when dropped. `Any` lets the source recognise its own
/// memory in a buffer ([`HostBytes::mapped`]).
pub trait MappedHost: Send + Sync + Any {
    /// The bytes, all of them.
    fn bytes(&self) -> &[u8];

    /// The bytes, writable.
    fn bytes_mut(&mut self) -> &mut [u8];

    /// Itself, for a source to look at its own memory.
    fn as_any(&self) -> &dyn Any;
}

/// Where a domain's host memory comes from before the heap: memory a transport makes
/// shareable (the node gives the host domain the source a transport offers).
pub trait HostSource: Send + Sync + 'static {
    /// `len` bytes (zeroed when `fill` is [`Fill::Zeroed`]), or `None` when the source has
    /// no room for them (the domain then takes the heap's). Called on whatever thread grants;
    /// must not block on anything but a short lock.
    fn take(&self, len: usize, fill: Fill) -> Option<Box<dyn MappedHost>>;

    /// Gives what no buffer holds back to the system (the domain asks once no memory went
    /// back to the source for `memory.keep_idle`); called off any actor's thread. Nothing
    /// by default.
    fn trim(&self) {}
}

/// A host buffer's bytes: the heap's, or a source's mapping, of which the first `len`
/// bytes are visible.
pub enum HostBytes {
    /// Heap memory.
    Heap(Box<[u8]>),
    /// Memory a [`HostSource`] lent, the first `len` bytes of it visible.
    Mapped {
        /// The memory.
        memory: Box<dyn MappedHost>,
        /// Bytes visible.
        len: usize,
    },
}

impl HostBytes {
    /// A source's memory, all of it visible.
    pub fn mapped(memory: Box<dyn MappedHost>) -> Self {
        let len = memory.bytes().len();
        Self::Mapped { memory, len }
    }

    /// The source's memory this is, if it is a source's.
    pub fn source_memory(&self) -> Option<&dyn MappedHost> {
        match self {
            Self::Heap(_) => None,
            Self::Mapped { memory, .. } => Some(&**memory),
        }
    }

    /// Keeps only the first `len` bytes visible (at most the current length).
    pub(super) fn truncate(&mut self, len: usize) {
        match self {
            Self::Heap(b) => {
                let mut v = std::mem::take(b).into_vec();
                v.truncate(len);
                *b = v.into_boxed_slice();
            }
            Self::Mapped { len: visible, .. } => *visible = len.min(*visible),
        }
    }
}

impl Default for HostBytes {
    fn default() -> Self {
        Self::Heap(Box::default())
    }
}

impl Deref for HostBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Self::Heap(b) => b,
            Self::Mapped { memory, len } => &memory.bytes()[..*len],
        }
    }
}

impl DerefMut for HostBytes {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            Self::Heap(b) => b,
            Self::Mapped { memory, len } => &mut memory.bytes_mut()[..*len],
        }
    }
}

impl fmt::Debug for HostBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Heap(b) => write!(f, "Heap({} bytes)", b.len()),
            Self::Mapped { len, .. } => write!(f, "Mapped({len} bytes)"),
        }
    }
}
