//! ferry's buffers through the engine, without `unsafe` at the caller: a registration that
//! keeps its buffer's memory allocated for as long as peers may read it, and a get that
//! owns the buffer it lands in until UCX is done with it.

use ferry_config::{Direction, Locality, MemoryClass, TransportName};

use super::UcxSource;
use super::{Engine, Operation, Registration, RemoteKey, UcxPeer, UcxTransportError};
use crate::cuda::DeviceMemory as _;
use crate::memory::{Buffer, SharedBytes};
use crate::transport::{Capabilities, Carrier, Viability};
use crate::wire::Layout;
use ucx_sys::MemoryType;

/// The ucx transport's declaration: host memory of a peer on another host (or this one),
/// pulled by the receiver (`ucp_get`) out of the sender's registered buffer (the preferred
/// direction), or pushed by the sender (`ucp_put` + a flush) into a buffer the receiver
/// registered and lent in its grant, where a rule asks for push.
///
/// Device memory too where the UCX this process loads moves it ([`moves_cuda`]: a UCX
/// built with CUDA, such as the `libucx-cu12`/`-cu13` wheels', on a machine with the
/// driver). Whether the peer's UCX does is its hello's say.
pub fn capabilities() -> Capabilities {
    const HOST: &[MemoryClass] = &[MemoryClass::Host, MemoryClass::Pinned];
    const ALL: &[MemoryClass] = &[MemoryClass::Host, MemoryClass::Pinned, MemoryClass::Device];
    let memory = if moves_cuda() { ALL } else { HOST };
    Capabilities {
        name: TransportName::Ucx,
        sources: memory,
        memory,
        localities: &[Locality::SameHost, Locality::Remote],
        directions: &[Direction::Pull, Direction::Push],
        needs_fd_passing: false,
        one_sided_put: false,
        carrier: Carrier::Memory,
        per_peer_setup: false,
        opt_in: true,
        lane: false,
        device_path: crate::transport::DevicePath::Rdma,
        library: Some(crate::transport::Library::Ucx),
    }
}

/// Whether the UCX this process loads moves CUDA device memory (its context lists the CUDA
/// memory type); `false` when it does not load.
pub fn moves_cuda() -> bool {
    probe().is_ok_and(|p| p.cuda)
}

/// What the UCX this process loads can do.
#[derive(Debug, Clone)]
struct Probe {
    /// It moves CUDA device memory.
    cuda: bool,
}

/// Loads UCX (`FERRY_UCX_LIBRARY`, else the system's `libucp.so.0`) and asks a context
/// which memory it moves; once per process.
fn probe() -> Result<Probe, ucx_sys::UcxError> {
    static PROBE: std::sync::OnceLock<Result<Probe, ucx_sys::UcxError>> =
        std::sync::OnceLock::new();
    PROBE
        .get_or_init(|| {
            let ucx = ucx_sys::Ucx::load(None)?;
            let cuda = super::loaded::context_moves_cuda(ucx);
            Ok(Probe { cuda })
        })
        .clone()
}

/// Whether UCX loads in this process. Whether a node uses it is its configuration's say
/// (`transport.ucx.enabled`).
pub fn viability() -> Viability {
    match probe() {
        Ok(_) => Viability::Viable,
        Err(why) => Viability::NotViable(format!("UCX does not load: {why}")),
    }
}

/// Why device memory cannot go over the loaded UCX.
const NO_CUDA: &str =
    "the loaded UCX does not move device memory (built without CUDA, or no driver)";

/// Where a buffer's bytes are, and of which type: host memory's address, or device
/// memory's (where `engine` moves it) once its writes are complete (UCX copies on a stream
/// of its own, which knows nothing of the buffer's).
fn span_of(
    engine: &Engine,
    bytes: &SharedBytes,
) -> Result<(MemoryType, *mut u8, usize), UcxTransportError> {
    settle(bytes)?;
    span_moved(engine.moves(MemoryType::Cuda), bytes)
}

/// Waits until the writes queued on a device buffer's stream are complete (blocks; nothing
/// to wait for in host memory).
fn settle(bytes: &SharedBytes) -> Result<(), UcxTransportError> {
    match bytes.device_memory() {
        Some(device) => device
            .stream()
            .synchronize()
            .map_err(UcxTransportError::Cuda),
        None => Ok(()),
    }
}

/// Where a buffer's bytes are, and of which type (device memory only where the engine
/// moves it, `moves_cuda`), as they are now: see [`span_of`].
fn span_moved(
    moves_cuda: bool,
    bytes: &SharedBytes,
) -> Result<(MemoryType, *mut u8, usize), UcxTransportError> {
    if let Some(host) = bytes.as_slice() {
        return Ok((MemoryType::Host, host.as_ptr().cast_mut(), host.len()));
    }
    let Some(device) = bytes.device_memory() else {
        return Err(UcxTransportError::Misuse("memory of no kind UCX can read"));
    };
    if !moves_cuda {
        return Err(UcxTransportError::Misuse(NO_CUDA));
    }
    Ok((MemoryType::Cuda, device.address() as *mut u8, device.len()))
}

/// A buffer registered for peers to read: what it holds keeps the memory allocated until
/// the registration is gone (dropped first: fields drop in order).
#[derive(Debug)]
pub struct Exported {
    registration: Registration,
    keep: Kept,
}

/// What an [`Exported`] registration covers (held for its memory, never read).
#[derive(Debug)]
#[expect(dead_code, reason = "the memory is held alive, not read")]
enum Kept {
    /// The sender's buffer itself.
    View(SharedBytes),
    /// A packed copy of the layout's bytes of it.
    Packed(Box<[u8]>),
}

impl Exported {
    /// What the receiver needs to pull it: the address, the packed key, and whether it is
    /// the layout's bytes packed.
    pub fn source(&self) -> UcxSource {
        UcxSource {
            address: self.registration.address(),
            rkey: self.registration.rkey().to_vec(),
            packed: matches!(self.keep, Kept::Packed(_)),
        }
    }
}

/// The most bytes a sender packs for a pull (a larger layout is read a get per row).
pub const PACK_MAX: u64 = 64 << 20;

/// Rows shorter than this on average are packed: measured on the development machine
/// (UCX 1.13 over tcp, 1–16 MiB in all), a get per row of 4 KiB read at 0.32–0.47 GB/s and
/// of 256 B at 0.04 GB/s, against 0.75–0.94 contiguous, while a host gather copies at
/// several GB/s.
pub const PACK_ROWS_BELOW: u64 = 64 << 10;

impl Engine {
    /// Registers `view`'s memory for peers to read.
    ///
    /// # Errors
    /// As [`Engine::register`]; [`UcxTransportError::Misuse`] for memory of no kind UCX
    /// can read.
    pub fn export(&self, view: SharedBytes) -> Result<Exported, UcxTransportError> {
        let (memory, ptr, len) = span_of(self, &view)?;
        // SAFETY: `view` keeps the memory allocated (it is a share of the buffer, which is
        // freed only when its last share goes), and `Exported` holds it until after the
        // registration was dropped, which unmaps before it returns. Peers only read it.
        let registration = unsafe { self.register_in(memory, ptr, len) }?;
        Ok(Exported {
            registration,
            keep: Kept::View(view),
        })
    }

    /// Registers `view`'s bytes that `layout` describes for a peer to read: host memory in
    /// short rows (or blocks), at most [`PACK_MAX`] of them, is first gathered into one
    /// packed buffer, registered in its place (the receiver then reads it as one run,
    /// [`UcxSource::packed`]); anything else is registered as it is ([`Engine::export`]).
    /// Blocks for the copy and the registration.
    ///
    /// # Errors
    /// As [`Engine::export`]; [`UcxTransportError::Misuse`] for a layout that does not fit
    /// the buffer.
    pub fn export_layout(
        &self,
        view: SharedBytes,
        layout: &Layout,
    ) -> Result<Exported, UcxTransportError> {
        let Some(host) = view.as_slice().filter(|_| !layout.is_contiguous()) else {
            return self.export(view);
        };
        let packed = layout
            .check(host.len() as u64)
            .map_err(|_| UcxTransportError::Misuse("the layout does not fit the buffer"))?;
        let runs = layout.runs(host.len() as u64).count() as u64;
        if packed == 0 || packed > PACK_MAX || packed / runs.max(1) >= PACK_ROWS_BELOW {
            return self.export(view);
        }
        let mut out = vec![0u8; packed as usize].into_boxed_slice();
        layout
            .gather(host, 0, &mut out)
            .map_err(|_| UcxTransportError::Misuse("the layout does not fit the buffer"))?;
        // SAFETY: `out` is host memory that `Exported` owns (a boxed slice never moves its
        // bytes) and keeps until after the registration was dropped; peers only read it.
        let registration = unsafe { self.register(out.as_mut_ptr(), out.len()) }?;
        Ok(Exported {
            registration,
            keep: Kept::Packed(out),
        })
    }
}

/// A receiver's buffer lent to a peer's push: registered for the peer to write until
/// [`Lent::give_back`] (the registration is dropped before the buffer: fields drop in
/// order).
#[derive(Debug)]
pub struct Lent {
    registration: Registration,
    buffer: Buffer,
}

impl Engine {
    /// Registers `buffer` (host memory, or device memory where this engine moves it) for a
    /// peer's push to write into. Blocks for the registration.
    ///
    /// # Errors
    ///
    /// As [`Engine::register`], and [`UcxTransportError::Misuse`] for memory UCX cannot
    /// write (the buffer is dropped).
    pub fn lend(&self, mut buffer: Buffer) -> Result<Lent, UcxTransportError> {
        let (memory, ptr, len) = landing_of(&mut buffer, self.moves(MemoryType::Cuda))?;
        // SAFETY: `Lent` owns the buffer, so its memory stays allocated and nothing in this
        // process reads or writes it until the registration is gone: `give_back` drops
        // the registration (which unmaps before it returns) before it hands the buffer
        // out, and a dropped `Lent` drops its registration first. Only the peer writes it.
        let registration = unsafe { self.register_in(memory, ptr, len) }?;
        Ok(Lent {
            registration,
            buffer,
        })
    }
}

impl Lent {
    /// The memory it is.
    pub fn kind(&self) -> crate::memory::MemoryKind {
        self.buffer.kind()
    }

    /// What the sender needs to write it: the address and the packed key.
    pub fn target(&self) -> UcxSource {
        UcxSource {
            address: self.registration.address(),
            rkey: self.registration.rkey().to_vec(),
            packed: false,
        }
    }

    /// Unregisters the buffer (blocks until UCX let go of it) and hands it back.
    pub fn give_back(self) -> Buffer {
        let Self {
            registration,
            buffer,
        } = self;
        drop(registration);
        buffer
    }
}

/// Most gets of one pull in UCX at once (the engine queues 1024 from every caller, and a
/// node has up to `pipeline_depth` pulls per peer).
const ROWS_IN_FLIGHT: usize = 32;

/// The most one get reads: a contiguous pull (or a long row or block) is read in pieces of
/// this size, so that each finishes well within the engine's operation timeout however large
/// the transfer.
const PIECE: u64 = 16 << 20;

impl UcxPeer {
    /// Reads the peer's bytes described by `source` (its registered buffer; `layout`'s
    /// rows, packed, or `dst.len()` bytes from its start) into `dst`, and gives `dst` back
    /// with the outcome. If this future is dropped early, the drop waits until UCX no
    /// longer writes into `dst` (bounded by the engine's operation timeout).
    pub async fn get_into(
        &self,
        mut dst: Buffer,
        source: &UcxSource,
        layout: &Layout,
    ) -> (Buffer, Result<(), UcxTransportError>) {
        // A packed source holds the layout's bytes as one run.
        let layout = if source.packed {
            &Layout::Contiguous
        } else {
            layout
        };
        let got = self.get_rows(&mut dst, source, layout).await;
        (dst, got)
    }

    async fn get_rows(
        &self,
        dst: &mut Buffer,
        source: &UcxSource,
        layout: &Layout,
    ) -> Result<(), UcxTransportError> {
        let len = dst.len();
        if len == 0 {
            return Ok(());
        }
        let rkey = self.remote_key(source.rkey.clone())?;
        let rows = rows_of(layout, len as u64)?;
        for batch in rows.chunks(ROWS_IN_FLIGHT) {
            completed(self.start_gets(dst, source.address, &rkey, batch)?).await?;
        }
        Ok(())
    }

    /// Starts one get per row of `batch` (offset at the peer from `remote`, offset in
    /// `dst`, bytes). On an error, the gets started so far are waited for (by their drop)
    /// before it returns.
    fn start_gets(
        &self,
        dst: &mut Buffer,
        remote: u64,
        rkey: &RemoteKey,
        batch: &[(u64, u64, u64)],
    ) -> Result<Vec<Operation>, UcxTransportError> {
        let (memory, base, room) = landing_of(dst, self.moves(MemoryType::Cuda))?;
        let local = Span { memory, base, room };
        let rows = batch.iter().map(|&(theirs, ours, n)| (ours, theirs, n));
        // SAFETY: `dst` is borrowed mutably until every operation returned here has
        // completed: `get_rows` awaits each, and if its future is dropped, `Operation`'s
        // drop waits for UCX to let go of the memory before the borrow (and the buffer)
        // can end. Nothing else reads or writes it meanwhile.
        unsafe { self.start_rows(Way::Get, local, remote, rkey, rows) }
    }

    /// Starts one get or put (`way`) per row: (offset in `local`, offset at the peer
    /// from `remote`, bytes), each row checked to lie inside `local`. On an error, the
    /// operations started so far are waited for (by their drop) before it returns.
    ///
    /// # Safety
    ///
    /// `local` is memory of its type that stays allocated, and that nothing else writes
    /// (nor, for gets, reads), until every operation returned has completed.
    unsafe fn start_rows(
        &self,
        way: Way,
        local: Span,
        remote: u64,
        rkey: &RemoteKey,
        rows: impl Iterator<Item = (u64, u64, u64)>,
    ) -> Result<Vec<Operation>, UcxTransportError> {
        let mut ops: Vec<Operation> = Vec::new();
        for (ours, theirs, bytes) in rows {
            if ours
                .checked_add(bytes)
                .is_none_or(|e| e > local.room as u64)
            {
                return Err(UcxTransportError::Misuse(
                    "a row past the end of the local buffer",
                ));
            }
            let at = remote
                .checked_add(theirs)
                .ok_or(UcxTransportError::Misuse("a remote address overflows"))?;
            let ptr = local.base.wrapping_add(ours as usize);
            let (memory, len) = (local.memory, bytes as usize);
            // SAFETY: the row lies inside `local` (checked above), which the caller keeps
            // valid and unshared until the operations complete (this function's contract).
            let op = match way {
                Way::Put => unsafe { self.put_in(memory, ptr, len, at, rkey) },
                Way::Get => unsafe { self.get_in(memory, ptr, len, at, rkey) },
            }?;
            ops.push(op);
        }
        Ok(ops)
    }
}

impl UcxPeer {
    /// Writes the bytes of `source` that `layout` describes (`packed` of them, packed)
    /// into the peer's buffer lent as `target`, then flushes the endpoint: when this
    /// returns `Ok`, every byte is in place and visible at the peer, and the sender may
    /// say so (`Written`). A device source's queued writes complete first (its stream is
    /// synchronized on a blocking thread). `stop`, set, ends it between batches of puts
    /// (with an error); the endpoint is flushed whatever the outcome.
    ///
    /// If the future is dropped early, the drop waits until UCX no longer reads `source`
    /// (bounded by the engine's operation timeout).
    pub async fn put_from(
        &self,
        source: SharedBytes,
        layout: &Layout,
        packed: u64,
        target: &UcxSource,
        stop: &std::sync::atomic::AtomicBool,
    ) -> Result<(), UcxTransportError> {
        if packed == 0 {
            return Ok(());
        }
        let source = if source.device_memory().is_some() {
            let settled = tokio::task::spawn_blocking(move || settle(&source).map(|()| source));
            settled
                .await
                .map_err(|_| UcxTransportError::EngineStopped { op: None })??
        } else {
            source
        };
        let rkey = self.remote_key(target.rkey.clone())?;
        let rows = rows_of(layout, packed)?;
        let put = self
            .put_rows(&source, &rows, target.address, &rkey, stop)
            .await;
        // A put completes when its source may be reused, not when its bytes are at the
        // peer: the flush waits for that, so `Written` (on another connection) cannot
        // overtake them. Also after a failure: the receiver frees its buffer when it
        // hears `Written`, and puts completed here may not have landed there yet.
        let flushed = match self.flush() {
            Ok(flush) => flush.await,
            Err(e) => Err(e),
        };
        put.and(flushed)
    }

    /// Puts `rows` of `source` (see [`rows_of`]) at `remote` in batches, until the first
    /// failure, or until `stop` is set between batches.
    async fn put_rows(
        &self,
        source: &SharedBytes,
        rows: &[(u64, u64, u64)],
        remote: u64,
        rkey: &RemoteKey,
        stop: &std::sync::atomic::AtomicBool,
    ) -> Result<(), UcxTransportError> {
        for batch in rows.chunks(ROWS_IN_FLIGHT) {
            if stop.load(std::sync::atomic::Ordering::Relaxed) {
                return Err(UcxTransportError::Misuse("the push was stopped"));
            }
            completed(self.start_puts(source, remote, rkey, batch)?).await?;
        }
        Ok(())
    }
}

impl UcxPeer {
    /// Starts one put per row of `batch` (offset in `source`, offset at the peer from
    /// `remote`, bytes). On an error, the puts started so far are waited for (by their
    /// drop) before it returns.
    fn start_puts(
        &self,
        source: &SharedBytes,
        remote: u64,
        rkey: &RemoteKey,
        batch: &[(u64, u64, u64)],
    ) -> Result<Vec<Operation>, UcxTransportError> {
        let (memory, base, room) = span_moved(self.moves(MemoryType::Cuda), source)?;
        let local = Span { memory, base, room };
        // SAFETY: `source` keeps the memory allocated; nothing writes it while the
        // transfer holds the buffer, and `put_from` awaits every operation returned here
        // (or its drop waits for it) before `source` can go.
        unsafe { self.start_rows(Way::Put, local, remote, rkey, batch.iter().copied()) }
    }
}

/// Waits for every one of `ops` to complete; the first failure, if any.
async fn completed(ops: Vec<Operation>) -> Result<(), UcxTransportError> {
    let mut first_error = None;
    for op in ops {
        if let Err(e) = op.await {
            first_error.get_or_insert(e);
        }
    }
    first_error.map_or(Ok(()), Err)
}

/// Which way rows move: into our memory (get) or out of it (put).
#[derive(Clone, Copy)]
enum Way {
    Get,
    Put,
}

/// Local memory that gets land in or puts read from.
#[derive(Clone, Copy)]
struct Span {
    memory: MemoryType,
    base: *mut u8,
    room: usize,
}

/// (offset in the buffer that `layout` describes, offset in the packed bytes, bytes) of
/// each row or block, a long one in pieces: one get or put each.
fn rows_of(layout: &Layout, packed: u64) -> Result<Vec<(u64, u64, u64)>, UcxTransportError> {
    match layout.extent() {
        Ok(None) => Ok(pieces(0, 0, packed).collect()),
        Ok(Some(span)) => Ok(layout
            .boxes(span, 0, packed)
            .map_err(|_| UcxTransportError::Misuse("the offer's layout does not fit"))?
            .iter()
            .flat_map(|b| b.rows().collect::<Vec<_>>())
            .flat_map(|(theirs, ours, n)| pieces(theirs, ours, n))
            .collect()),
        Err(_) => Err(UcxTransportError::Misuse("the offer's layout is invalid")),
    }
}

/// `n` bytes from `theirs` at the peer to `ours` here, as gets of at most [`PIECE`] bytes.
fn pieces(theirs: u64, ours: u64, n: u64) -> impl Iterator<Item = (u64, u64, u64)> {
    (0..n)
        .step_by(PIECE as usize)
        .map(move |at| (theirs + at, ours + at, PIECE.min(n - at)))
}

/// Where `dst`'s bytes go, and of which type. Device memory only where the engine moves it
/// (`moves_cuda`; a UCX without CUDA would `memcpy` into a device address). A landing
/// buffer's allocation is complete when the allocator hands it out (it waits for its
/// stream).
fn landing_of(
    dst: &mut Buffer,
    moves_cuda: bool,
) -> Result<(MemoryType, *mut u8, usize), UcxTransportError> {
    if let Some(device) = dst.device_memory_mut() {
        if !moves_cuda {
            return Err(UcxTransportError::Misuse(NO_CUDA));
        }
        return Ok((MemoryType::Cuda, device.address() as *mut u8, device.len()));
    }
    match dst.as_mut_slice() {
        Some(host) => Ok((MemoryType::Host, host.as_mut_ptr(), host.len())),
        None => Err(UcxTransportError::Misuse(
            "the landing buffer is shared: it cannot be written",
        )),
    }
}
