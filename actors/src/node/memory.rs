//! A node's memory: its domains and their tiers, allocations from them, device memory
//! allocated outside ferry registered as buffers of its own, and each domain's stats.

use super::*;

impl Node {
    pub(super) fn domain(&self, kind: MemoryKind) -> Result<&DomainHandle, Error> {
        match kind {
            MemoryKind::Host => Ok(&self.host),
            MemoryKind::PinnedHost => Ok(&self.pinned),
            MemoryKind::Device(n) => self.gpus.domain(n).ok_or_else(|| {
                Error::unsupported(format!(
                    "GPU {n} is not one of this node's GPUs ({:?}; see gpu.devices)",
                    self.gpus
                ))
            }),
            other => Err(Error::unsupported(format!(
                "{other} memory is not served here"
            ))),
        }
    }

    /// Allocates `len` bytes of `kind` memory under the domain's budget, waiting for
    /// budget up to the default deadline.
    ///
    /// # Errors
    /// [`Error::NoMemory`] when it does not fit in time; [`Error::Unsupported`] for a kind
    /// this build cannot allocate.
    pub async fn alloc(&self, kind: MemoryKind, len: usize) -> Result<Buffer, Error> {
        let mut parts = self.alloc_parts(kind, &[len as u64]).await?;
        parts.pop().ok_or(Error::ShuttingDown)
    }

    /// Allocates every part at once or none, in `kind` memory, waiting for budget up to the
    /// default deadline. A waiting request holds nothing, so callers that each need several
    /// parts never hold some while waiting for the rest.
    ///
    /// # Errors
    /// As [`Self::alloc`].
    pub async fn alloc_parts(&self, kind: MemoryKind, parts: &[u64]) -> Result<Vec<Buffer>, Error> {
        reserve_in_tiers(&[self.tier(kind)?], parts, self.default_deadline()).await
    }

    /// The tier of `kind` memory: its domain's allocator.
    pub(super) fn tier(&self, kind: MemoryKind) -> Result<Tier, Error> {
        Ok(self.domain(kind)?.tier())
    }

    /// Makes device memory the caller allocated outside ferry (`cudaMalloc`, a framework's
    /// tensor: described by an [`ExternalMemory`], whose unsafe constructor is the promise
    /// that it stays allocated) a buffer that can be sent. Same-host peers read it through
    /// a legacy CUDA IPC handle, which they keep open (cached by allocation identity, never
    /// by address) for the next transfer of the same allocation. It counts against no budget,
    /// and cannot be received into.
    ///
    /// End the registration with [`Self::unregister_external`], not by dropping the buffer:
    /// only its answer says when the memory may be freed.
    ///
    /// # Errors
    /// [`Error::Unsupported`] for a GPU this node does not use; [`Error::Usage`] for memory
    /// the driver does not know, a range past its allocation's end, memory of another GPU,
    /// or memory legacy IPC cannot export (pool or VMM allocations).
    pub fn register_external(&self, memory: ExternalMemory) -> Result<Buffer, Error> {
        let n = memory.device();
        let gpu = self.gpus.get(n).ok_or_else(|| {
            Error::unsupported(format!(
                "GPU {n} is not one of this node's GPUs ({:?}; see gpu.devices)",
                self.gpus
            ))
        })?;
        let device = DeviceBuffer::register_external(memory, &gpu.device, &gpu.copy_stream)
            .map_err(|e| Error::Usage(format!("cannot register the memory: {e}")))?;
        let lease = Lease {
            kind: MemoryKind::Device(n),
            id: BufferId(EXTERNAL_IDS.fetch_add(1, Ordering::Relaxed)),
            generation: Generation(0),
            len: memory.len() as u64,
        };
        Ok(Buffer::new_device(
            lease,
            device,
            Arc::new(Unbudgeted),
            None,
        ))
    }

    /// Ends the registration of [`Self::register_external`]: drops `buffer` and waits until
    /// nothing uses the memory any more (ferry's copies done, every peer's mapping of it
    /// closed). After `Ok` the caller may free the memory. A peer that does not unmap in
    /// time loses its link (`memory.export_lease_timeout`), so this ends within the default
    /// deadline plus that timeout.
    ///
    /// # Errors
    /// [`Error::Usage`] for a buffer that is not registered memory (it is dropped, which
    /// frees it as usual); [`Error::DeadlineExceeded`] when the memory is still in use at
    /// the end: do not free it then.
    pub async fn unregister_external(&self, buffer: Buffer) -> Result<(), Error> {
        let signal = buffer
            .device_memory()
            .and_then(|m| m.release_signal())
            .ok_or_else(|| Error::Usage("the buffer is not registered memory".into()))?;
        drop(buffer);
        let wait = self.config.limits.default_deadline + self.config.memory.export_lease_timeout;
        tokio::time::timeout(wait, signal.wait())
            .await
            .map_err(|_| Error::DeadlineExceeded)
    }

    /// A memory domain's counters: budget, granted, exported, quarantined, waiting, and the
    /// memory of dropped buffers it keeps for later grants (`kept`: bytes now, and how many
    /// grants reused such memory; `memory.keep_idle`, `memory.keep_max`).
    ///
    /// # Errors
    /// [`Error::Unsupported`] for a GPU the node does not use; [`Error::ShuttingDown`] once
    /// the node stopped.
    pub async fn memory(&self, kind: MemoryKind) -> Result<DomainStats, Error> {
        self.domain(kind)?
            .actor
            .send(Stats)
            .await
            .map_err(|_| Error::ShuttingDown)
    }
}

/// Ids of registered memory: a range of their own (top bit set), so they never meet the ids
/// a GPU domain's allocator hands out under the same memory kind.
static EXTERNAL_IDS: AtomicU64 = AtomicU64::new(1 << 63);

/// Registered memory counts against no budget: its release gives nothing back.
struct Unbudgeted;

impl Releaser for Unbudgeted {
    fn release(&self, _: &Lease) {}
}
