//! The handles callers hold: [`Engine`], [`UcxPeer`] and [`Registration`].

use std::sync::Arc;
use std::sync::mpsc;
use std::thread::JoinHandle;

use tokio::sync::oneshot;
use ucx_sys::{MemoryType, Ucx, Version};

use super::envelope::{self, EnvelopeKind};
use super::error::{OpKind, PeerName, UcxTransportError};
use super::lanes::{EndpointLanes, LaneSlot};
use super::operation::{Operation, block_on};
use super::queue::{Command, Control, LocalBuffer, OpCommand, Shared};
use super::rkeys::RemoteKey;
use super::settings::UcxSettings;
use super::thread;
use super::wake::Wake;

/// The node's UCX engine: one UCX context and worker, owned by the progress thread
/// `ferry-ucx` (see the [module documentation](super) for the threading model).
///
/// Dropping it stops the thread: operations still queued fail with
/// [`UcxTransportError::EngineStopped`]; every endpoint is closed (in flush mode while the
/// peer is healthy); operations already in UCX get [`UcxSettings::close_timeout`] to
/// finish (with their usual outcome) and then fail with `EngineStopped` too, once the
/// worker is destroyed and UCX can no longer touch their memory; every registration is
/// unmapped. The drop blocks until that is done: at most `close_timeout` plus UCX's
/// teardown.
#[derive(Debug)]
pub struct Engine {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    address: Vec<u8>,
    ucx: Ucx,
    moves_cuda: bool,
}

impl Engine {
    /// Loads UCX (the configured library, else `FERRY_UCX_LIBRARY`, else the system's
    /// `libucp.so.0`) and starts the progress thread, which creates the context (features
    /// RMA and WAKEUP) and the worker. Blocks until the worker exists (tens of
    /// milliseconds).
    ///
    /// # Errors
    ///
    /// [`UcxTransportError::Load`] when UCX does not load; [`UcxTransportError::Misuse`]
    /// for an out-of-range setting; [`UcxTransportError::Setup`] when UCX refuses a
    /// setting or cannot create its context or worker (e.g. no transport in `UCX_TLS`
    /// exists here); [`UcxTransportError::Thread`] when the thread cannot start;
    /// [`UcxTransportError::Cuda`] when [`UcxSettings::cuda_device`] cannot be made current.
    pub fn start(settings: &UcxSettings) -> Result<Engine, UcxTransportError> {
        settings.validate()?;
        let ucx = Ucx::load(settings.library.as_deref())?;
        let wake = Wake::new().map_err(|e| UcxTransportError::Thread(Arc::new(e)))?;
        let shared = Arc::new(Shared::new(settings.queue_depth, wake));
        let (started_tx, started_rx) = mpsc::sync_channel(1);
        let thread = std::thread::Builder::new()
            .name("ferry-ucx".into())
            .spawn({
                let shared = shared.clone();
                let settings = settings.clone();
                move || thread::run(ucx, settings, shared, started_tx)
            })
            .map_err(|e| UcxTransportError::Thread(Arc::new(e)))?;
        let started = started_rx
            .recv()
            .unwrap_or(Err(UcxTransportError::EngineStopped { op: None }));
        match started {
            Ok((address, moves_cuda)) => Ok(Engine {
                shared,
                thread: Some(thread),
                address,
                ucx,
                moves_cuda,
            }),
            Err(e) => {
                let _ = thread.join();
                Err(e)
            }
        }
    }

    /// This engine's worker address, for a peer's [`Engine::connect`]. Send it over
    /// ferry's authenticated link: UCX trusts what an address says.
    pub fn address(&self) -> Vec<u8> {
        self.address.clone()
    }

    /// Whether this engine's UCX moves memory of `memory`'s type: host memory always,
    /// CUDA device memory when the loaded UCX was built with CUDA and found the driver.
    pub fn moves(&self, memory: MemoryType) -> bool {
        moves(self.moves_cuda, memory)
    }

    /// The loaded UCX's release. Peers must run the same UCX build.
    pub fn ucx_version(&self) -> Version {
        self.ucx.version()
    }

    /// Checks a peer's worker address without connecting: what it is, its length, its
    /// CRC32C and the UCX release that made it (peers must load the same UCX build).
    ///
    /// # Errors
    ///
    /// [`UcxTransportError::InvalidAddress`] naming the failed check (for another release:
    /// both versions).
    pub fn check_address(&self, peer_worker_address: &[u8]) -> Result<(), UcxTransportError> {
        envelope::open(
            EnvelopeKind::WorkerAddress,
            self.ucx.version(),
            peer_worker_address,
        )
        .map(|_| ())
        .map_err(UcxTransportError::InvalidAddress)
    }

    /// Creates an endpoint to the peer whose [`Engine::address`] this is, in error
    /// handling mode PEER: if the peer dies, every operation to it fails (within about a
    /// second over tcp; see [`UcxSettings::op_timeout`] for a peer that hangs). Blocks
    /// until the progress thread has created the endpoint (microseconds); the connection
    /// itself is made by the first operation.
    ///
    /// The bytes are checked first (what they are, their length, a CRC32C, the UCX
    /// release that made them), so garbage, truncation and a peer on another UCX release
    /// are errors. An authenticated peer can still craft bytes that pass the checks and
    /// crash UCX: take addresses only from ferry's authenticated link.
    ///
    /// # Errors
    ///
    /// [`UcxTransportError::InvalidAddress`] for bytes that fail the checks;
    /// [`UcxTransportError::Connect`] when UCX refuses the address (e.g.
    /// `UCS_ERR_UNREACHABLE`: no allowed transport reaches the peer);
    /// [`UcxTransportError::EngineStopped`].
    ///
    /// [`Engine::check_address`] runs the same checks without connecting.
    pub fn connect(&self, peer_worker_address: Vec<u8>) -> Result<UcxPeer, UcxTransportError> {
        let opened = envelope::open(
            EnvelopeKind::WorkerAddress,
            self.ucx.version(),
            &peer_worker_address,
        )
        .map_err(UcxTransportError::InvalidAddress)?;
        let origin: Arc<str> = String::from_utf8_lossy(opened.label).into();
        let address = opened.payload.to_vec();
        let (reply, rx) = oneshot::channel();
        let request = Control::Connect {
            address,
            origin: origin.clone(),
            reply,
        };
        self.shared
            .control(request)
            .map_err(|_| UcxTransportError::EngineStopped { op: None })?;
        let (id, lanes, keys) =
            block_on(rx).unwrap_or(Err(UcxTransportError::EngineStopped { op: None }))?;
        Ok(UcxPeer {
            shared: self.shared.clone(),
            name: PeerName { id, origin },
            ucx: self.ucx.version(),
            moves_cuda: self.moves_cuda,
            lanes,
            keys,
        })
    }

    /// Registers `len` bytes at `ptr` with UCX (`ucp_mem_map`) and packs their remote key,
    /// so peers can get from and put to them. Blocks until the progress thread has done it
    /// (microseconds for host memory over tcp; pinning can take milliseconds per GiB on
    /// RDMA transports).
    ///
    /// A zero-length registration needs no UCX mapping and makes none: its
    /// [`Registration::rkey`] is empty, and peers may use it only for zero-length
    /// operations (which complete without UCX). `ptr` may then be null.
    ///
    /// Unmapping does not stop a peer that still uses the key (over tcp UCX does not even
    /// check keys at the target): ferry's protocol must make peers stop first.
    ///
    /// # Safety
    ///
    /// `ptr..ptr+len` must be host memory (device memory goes through
    /// [`Engine::register_in`]: UCX is told host memory here and copies with the CPU) and
    /// must stay allocated until the [`Registration`] is dropped (its drop waits for the
    /// unmap). While it is registered, peers may read and write it at any
    /// time through the key; when its contents may be read is the caller's protocol.
    ///
    /// # Errors
    ///
    /// [`UcxTransportError::Misuse`] for a null `ptr` with `len > 0`;
    /// [`UcxTransportError::Register`] with UCX's status;
    /// [`UcxTransportError::EngineStopped`].
    pub unsafe fn register(
        &self,
        ptr: *mut u8,
        len: usize,
    ) -> Result<Registration, UcxTransportError> {
        // SAFETY: the caller's contract, which is this function's.
        unsafe { self.register_in(MemoryType::Host, ptr, len) }
    }

    /// As [`Engine::register`], for memory of the given type: device memory
    /// ([`MemoryType::Cuda`]) where the loaded UCX moves it ([`Engine::moves`]). The type
    /// is told to UCX, not detected: UCX's detection misses memory of a CUDA pool made
    /// before UCX loaded and would take it for host memory.
    ///
    /// # Safety
    ///
    /// As [`Engine::register`], and `ptr..ptr+len` is memory of type `memory`.
    ///
    /// # Errors
    ///
    /// As [`Engine::register`].
    pub unsafe fn register_in(
        &self,
        memory: MemoryType,
        ptr: *mut u8,
        len: usize,
    ) -> Result<Registration, UcxTransportError> {
        if len == 0 {
            return Ok(Registration {
                shared: self.shared.clone(),
                id: None,
                address: ptr as u64,
                len: 0,
                rkey: Vec::new(),
            });
        }
        if ptr.is_null() {
            return Err(UcxTransportError::Misuse(
                "cannot register a null pointer with a length",
            ));
        }
        let (reply, rx) = oneshot::channel();
        let request = Control::Register {
            memory: LocalBuffer { ptr, len, memory },
            reply,
        };
        self.shared
            .control(request)
            .map_err(|_| UcxTransportError::EngineStopped { op: None })?;
        let (id, rkey) =
            block_on(rx).unwrap_or(Err(UcxTransportError::EngineStopped { op: None }))?;
        Ok(Registration {
            shared: self.shared.clone(),
            id: Some(id),
            address: ptr as u64,
            len,
            rkey,
        })
    }

    /// Checks a peer's packed key (its [`Registration::rkey`]) for use in
    /// [`UcxPeer::get`] and [`UcxPeer::put`]. Same as [`UcxPeer::remote_key`].
    ///
    /// # Errors
    ///
    /// [`UcxTransportError::InvalidRkey`] for bytes that are not a key packed by a ferry
    /// engine on this UCX release.
    pub fn remote_key(&self, bytes: impl Into<Arc<[u8]>>) -> Result<RemoteKey, UcxTransportError> {
        RemoteKey::new(self.ucx.version(), bytes)
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.shared.control(Control::Stop);
        if let Some(thread) = self.thread.take() {
            // The thread answers everything before it ends; a panic there was already
            // reported by the panic hook, and its state's drop released UCX.
            let _ = thread.join();
        }
    }
}

/// Whether an engine whose UCX moves CUDA memory (`cuda`) or not moves memory of
/// `memory`'s type: host memory always.
fn moves(cuda: bool, memory: MemoryType) -> bool {
    match memory {
        MemoryType::Host => true,
        MemoryType::Cuda => cuda,
        _ => false,
    }
}

/// An endpoint to one peer's engine, in error handling mode PEER. `Send` and `Sync`;
/// operations from several threads are queued in the order their calls took the queue.
///
/// Dropping it closes the endpoint on the progress thread without blocking: once the
/// operations in flight to the peer have completed, its keys are destroyed and the
/// endpoint closed (in flush mode while the peer is healthy, forced once it failed).
#[derive(Debug)]
pub struct UcxPeer {
    shared: Arc<Shared>,
    name: PeerName,
    ucx: Version,
    moves_cuda: bool,
    lanes: Arc<LaneSlot>,
    keys: Arc<std::sync::atomic::AtomicUsize>,
}

impl UcxPeer {
    /// How many of the peer's keys this endpoint holds unpacked (cached, or in use by an
    /// operation after [`UcxPeer::forget_rkey`]): each is UCX state about a registration of
    /// the peer's. Read without waiting for the progress thread, so it may lag a forget
    /// queued just before.
    pub fn unpacked_keys(&self) -> usize {
        self.keys.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How errors name this peer.
    pub fn name(&self) -> &PeerName {
        &self.name
    }

    /// The endpoint's lanes: the UCX transport and device of each, and whether UCX moves
    /// gets and puts over them one-sided or emulates them over tcp
    /// ([`EndpointLanes::rma`]). Asked of UCX when the endpoint was created, and again
    /// once its first get, put or flush completed ([`EndpointLanes::after_first_use`]);
    /// on a UCX older than 1.14 they are unknown, and say so. Never blocks on UCX (a lock
    /// the progress thread holds for a copy).
    pub fn lanes(&self) -> EndpointLanes {
        self.lanes.get()
    }

    /// Whether the engine this endpoint belongs to moves memory of `memory`'s type (as
    /// [`Engine::moves`]).
    pub fn moves(&self, memory: MemoryType) -> bool {
        moves(self.moves_cuda, memory)
    }

    /// Checks a peer's packed key (its [`Registration::rkey`]) for use in
    /// [`UcxPeer::get`] and [`UcxPeer::put`].
    ///
    /// # Errors
    ///
    /// [`UcxTransportError::InvalidRkey`] for bytes that are not a key packed by a ferry
    /// engine on this UCX release.
    pub fn remote_key(&self, bytes: impl Into<Arc<[u8]>>) -> Result<RemoteKey, UcxTransportError> {
        RemoteKey::new(self.ucx, bytes)
    }

    /// Reads `len` bytes at `remote_address` of the peer's memory (inside the registration
    /// `rkey` belongs to) into `local`. Never blocks; the returned [`Operation`] completes
    /// when the bytes are in `local`, or fails. Zero-length gets complete without UCX.
    ///
    /// # Safety
    ///
    /// `local..local+len` must be host memory (device memory goes through
    /// [`UcxPeer::get_in`]), valid for writes and not read or written by anything
    /// else until the returned [`Operation`] has completed (awaited or waited to its end;
    /// dropping it waits for that too). If the `Operation` is leaked (`mem::forget`), the
    /// memory must stay valid until the engine is dropped. On `Err`, nothing was started.
    ///
    /// # Errors
    ///
    /// At once: [`UcxTransportError::Misuse`] for a null `local` with `len > 0` or an
    /// empty key with `len > 0`; [`UcxTransportError::Saturated`];
    /// [`UcxTransportError::EngineStopped`]. The `Operation` fails with
    /// [`UcxTransportError::PeerFailed`], [`UcxTransportError::TimedOut`],
    /// [`UcxTransportError::Unpack`], [`UcxTransportError::Operation`] or
    /// [`UcxTransportError::EngineStopped`].
    pub unsafe fn get(
        &self,
        local: *mut u8,
        len: usize,
        remote_address: u64,
        rkey: &RemoteKey,
    ) -> Result<Operation, UcxTransportError> {
        let kind = OpKind::Get(len);
        self.rma(kind, MemoryType::Host, local, len, remote_address, rkey)
    }

    /// As [`UcxPeer::get`], into memory of the given type (device memory where the loaded
    /// UCX moves it; see [`Engine::register_in`]).
    ///
    /// # Safety
    ///
    /// As [`UcxPeer::get`], and `local..local+len` is memory of type `memory`.
    ///
    /// # Errors
    ///
    /// As [`UcxPeer::get`].
    pub unsafe fn get_in(
        &self,
        memory: MemoryType,
        local: *mut u8,
        len: usize,
        remote_address: u64,
        rkey: &RemoteKey,
    ) -> Result<Operation, UcxTransportError> {
        self.rma(OpKind::Get(len), memory, local, len, remote_address, rkey)
    }

    /// Writes `len` bytes from `local` to `remote_address` of the peer's memory (inside
    /// the registration `rkey` belongs to). Never blocks; the returned [`Operation`]
    /// completes when `local` may be reused. The bytes are visible at the peer once a
    /// later [`UcxPeer::flush`] completes. Zero-length puts complete without UCX.
    ///
    /// # Safety
    ///
    /// `local..local+len` must be host memory, valid for reads and not written by anything
    /// else until the returned [`Operation`] has completed (as for [`UcxPeer::get`]).
    ///
    /// # Errors
    ///
    /// As [`UcxPeer::get`].
    pub unsafe fn put(
        &self,
        local: *const u8,
        len: usize,
        remote_address: u64,
        rkey: &RemoteKey,
    ) -> Result<Operation, UcxTransportError> {
        self.rma(
            OpKind::Put(len),
            MemoryType::Host,
            local.cast_mut(),
            len,
            remote_address,
            rkey,
        )
    }

    /// As [`UcxPeer::put`], from memory of the given type (device memory where the loaded
    /// UCX moves it; see [`Engine::register_in`]).
    ///
    /// # Safety
    ///
    /// As [`UcxPeer::put`], and `local..local+len` is memory of type `memory`.
    ///
    /// # Errors
    ///
    /// As [`UcxPeer::get`].
    pub unsafe fn put_in(
        &self,
        memory: MemoryType,
        local: *const u8,
        len: usize,
        remote_address: u64,
        rkey: &RemoteKey,
    ) -> Result<Operation, UcxTransportError> {
        let local = local.cast_mut();
        self.rma(OpKind::Put(len), memory, local, len, remote_address, rkey)
    }

    fn rma(
        &self,
        kind: OpKind,
        memory: MemoryType,
        local: *mut u8,
        len: usize,
        remote: u64,
        rkey: &RemoteKey,
    ) -> Result<Operation, UcxTransportError> {
        if len > 0 && local.is_null() {
            return Err(UcxTransportError::Misuse(
                "a null local buffer with a length",
            ));
        }
        if len > 0 && rkey.is_empty() {
            return Err(UcxTransportError::Misuse(
                "an empty remote key (a zero-length registration's) covers no bytes",
            ));
        }
        self.submit(
            kind,
            LocalBuffer {
                ptr: local,
                len,
                memory,
            },
            remote,
            Some(rkey.clone()),
        )
    }

    /// Completes when every get and put issued to this peer before it has completed at
    /// the peer (puts are then visible there). Never blocks.
    ///
    /// # Errors
    ///
    /// At once: [`UcxTransportError::Saturated`], [`UcxTransportError::EngineStopped`];
    /// the `Operation` fails as a get's does.
    pub fn flush(&self) -> Result<Operation, UcxTransportError> {
        let none = LocalBuffer {
            ptr: std::ptr::null_mut(),
            len: 0,
            memory: MemoryType::Host,
        };
        self.submit(OpKind::Flush, none, 0, None)
    }

    fn submit(
        &self,
        kind: OpKind,
        local: LocalBuffer,
        remote: u64,
        rkey: Option<RemoteKey>,
    ) -> Result<Operation, UcxTransportError> {
        let (reply, rx) = oneshot::channel();
        self.shared.push(Command::Op(OpCommand {
            peer: self.name.id,
            kind,
            local,
            remote,
            rkey,
            reply,
        }))?;
        Ok(Operation::new(kind, rx))
    }

    /// Destroys this endpoint's unpacked copy of `rkey`, after the operations queued
    /// before this call that use it. Call it when the peer says the registration is gone;
    /// using the same bytes again afterwards unpacks them again. Never blocks.
    ///
    /// # Errors
    ///
    /// [`UcxTransportError::Saturated`], [`UcxTransportError::EngineStopped`].
    pub fn forget_rkey(&self, rkey: &RemoteKey) -> Result<(), UcxTransportError> {
        if rkey.is_empty() {
            return Ok(());
        }
        self.shared.push(Command::Forget {
            peer: self.name.id,
            key: rkey.clone(),
        })
    }
}

impl Drop for UcxPeer {
    fn drop(&mut self) {
        // Fails only when the engine stopped, which closed every endpoint already.
        let _ = self.shared.push(Command::DropPeer { peer: self.name.id });
    }
}

/// Memory registered with the engine's UCX context, reachable by peers through its
/// [`Registration::rkey`]. `Send` and `Sync`.
///
/// Dropping it unmaps the memory on the progress thread and blocks until that is done
/// (microseconds), so the memory may be freed right after. If the engine is stopping,
/// the drop waits until it has stopped (the engine unmaps everything).
#[derive(Debug)]
pub struct Registration {
    shared: Arc<Shared>,
    /// `None` for a zero-length registration (nothing mapped).
    id: Option<u64>,
    address: u64,
    len: usize,
    rkey: Vec<u8>,
}

impl Registration {
    /// The packed remote key to send to peers (over ferry's authenticated link); empty
    /// for a zero-length registration.
    pub fn rkey(&self) -> &[u8] {
        &self.rkey
    }

    /// The memory's address, as peers name it in gets and puts.
    pub fn address(&self) -> u64 {
        self.address
    }

    /// Bytes registered.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether this is a zero-length registration.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let Some(id) = self.id else { return };
        let (done, rx) = oneshot::channel();
        match self.shared.control(Control::Unregister { id, done }) {
            // Answered once unmapped. Dropped unanswered only if the thread is ending
            // abnormally: then wait until it has released everything.
            Ok(()) => {
                if block_on(rx).is_err() {
                    self.shared.wait_finished();
                }
            }
            Err(_) => self.shared.wait_finished(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer on another UCX release is named as such before anything connects; our own
    /// address passes. Skips (saying so) where UCX does not load, unless FERRY_UCX_TESTS=1.
    #[test]
    fn another_ucx_release_is_refused_by_name() {
        let engine = match Engine::start(&UcxSettings::default()) {
            Ok(engine) => engine,
            Err(e) => {
                assert_ne!(
                    std::env::var("FERRY_UCX_TESTS").as_deref(),
                    Ok("1"),
                    "FERRY_UCX_TESTS=1 but UCX does not start: {e}"
                );
                println!("skipped: UCX does not start here: {e}");
                return;
            }
        };
        engine
            .check_address(&engine.address())
            .expect("our own address");
        let ours = engine.ucx_version();
        let other = Version {
            major: ours.major,
            minor: ours.minor + 1,
            release: 0,
        };
        let foreign = envelope::seal(EnvelopeKind::WorkerAddress, other, "peer", &[1, 2, 3]);
        let err = engine.check_address(&foreign).expect_err("another release");
        let text = err.to_string();
        assert!(
            text.contains(&other.to_string()) && text.contains(&ours.to_string()),
            "{text}"
        );
    }
}
