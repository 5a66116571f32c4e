//! Streams and events, owned by RAII types that keep their device's context alive.

use std::sync::Arc;

use cudarc::driver::sys;

use super::device::Device;
use super::error::{CudaError, teardown_failed};
use super::raw;

/// A non-blocking CUDA stream on one device. Cheap to clone (clones share the stream).
///
/// Dropping the last clone destroys the stream; work already queued on it still runs to
/// completion (the driver defers the release), so dropping never blocks.
#[derive(Clone)]
pub struct Stream {
    inner: Arc<StreamInner>,
}

pub(super) struct StreamInner {
    device: Device,
    handle: sys::CUstream,
}

// SAFETY: a CUstream is a driver handle usable from any thread once its context is bound,
// which every use here does first; no Rust memory is reachable through it.
unsafe impl Send for StreamInner {}
// SAFETY: as for Send; the driver serialises calls on one stream internally.
unsafe impl Sync for StreamInner {}

impl Drop for StreamInner {
    fn drop(&mut self) {
        let done = self.device.bind().and_then(|()| {
            // SAFETY: the stream came from cuStreamCreate in this context, which `device`
            // keeps alive; this is the last reference, so no one uses the handle afterwards.
            unsafe { raw::stream_destroy(self.handle) }
        });
        if let Err(e) = done {
            teardown_failed!(e, "destroying a CUDA stream failed");
        }
    }
}

/// How long [`Stream::spin`] polls before it hands the wait to the driver.
pub const SPIN_LIMIT: std::time::Duration = std::time::Duration::from_micros(200);

impl Stream {
    /// Creates a non-blocking stream on `device` (it does not synchronise with the legacy
    /// default stream).
    ///
    /// # Errors
    /// A driver error.
    pub fn new(device: &Device) -> Result<Stream, CudaError> {
        device.bind()?;
        // SAFETY: the device's context is current (bound above).
        let handle = unsafe { raw::stream_create() }?;
        Ok(Stream {
            inner: Arc::new(StreamInner {
                device: device.clone(),
                handle,
            }),
        })
    }

    /// The device the stream runs on.
    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    /// Blocks the calling thread until everything queued on the stream has completed.
    ///
    /// # Errors
    /// A driver error, including one from earlier asynchronous work on the stream.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: the stream is alive for as long as `self`.
        unsafe { raw::stream_synchronize(self.inner.handle) }
    }

    /// Waits for everything queued on the stream by polling it from this thread
    /// (`cuStreamQuery` in a loop) for up to [`SPIN_LIMIT`], then in the driver
    /// ([`Self::synchronize`]): for work of a few microseconds, where a blocking wait's
    /// wake-up costs as much as the work, without burning a thread on long work.
    ///
    /// # Errors
    /// A driver error, including one from earlier asynchronous work on the stream.
    pub fn spin(&self) -> Result<(), CudaError> {
        self.bind()?;
        let started = std::time::Instant::now();
        // SAFETY: the stream is alive for as long as `self`.
        while !unsafe { raw::stream_query(self.inner.handle) }? {
            if started.elapsed() > SPIN_LIMIT {
                return self.synchronize();
            }
            std::hint::spin_loop();
        }
        Ok(())
    }

    /// Makes later work on this stream wait for the work `event` captured when it was last
    /// recorded (on any stream, of any device). Does not block the host.
    ///
    /// # Errors
    /// A driver error.
    pub fn wait(&self, event: &Event) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: both handles are alive for as long as `self` and `event`.
        unsafe { raw::stream_wait_event(self.inner.handle, event.handle) }
    }

    /// Binds the stream's device and returns the raw handle for one driver call.
    pub(super) fn bind(&self) -> Result<(), CudaError> {
        self.inner.device.bind()
    }

    pub(super) fn handle(&self) -> sys::CUstream {
        self.inner.handle
    }

    pub(super) fn shared(&self) -> Arc<StreamInner> {
        Arc::clone(&self.inner)
    }

    pub(super) fn from_shared(inner: Arc<StreamInner>) -> Stream {
        Stream { inner }
    }

    /// True when both values are the same stream.
    pub fn same_as(&self, other: &Stream) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner) || self.inner.handle == other.inner.handle
    }
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream")
            .field("device", &self.inner.device.ordinal())
            .field("handle", &self.inner.handle)
            .finish()
    }
}

/// A CUDA event (timing disabled: the cheap kind), for completion and cross-stream order.
pub struct Event {
    device: Device,
    handle: sys::CUevent,
}

// SAFETY: a CUevent is a driver handle usable from any thread once its context is bound,
// which every use here does first.
unsafe impl Send for Event {}
// SAFETY: as for Send; the driver makes concurrent record/query/synchronize safe.
unsafe impl Sync for Event {}

impl Drop for Event {
    fn drop(&mut self) {
        let done = self.device.bind().and_then(|()| {
            // SAFETY: created by cuEventCreate in this context, which `device` keeps alive;
            // not used afterwards. The driver defers the release past pending records.
            unsafe { raw::event_destroy(self.handle) }
        });
        if let Err(e) = done {
            teardown_failed!(e, "destroying a CUDA event failed");
        }
    }
}

impl Event {
    /// Creates an event on `device`.
    ///
    /// # Errors
    /// A driver error.
    pub fn new(device: &Device) -> Result<Event, CudaError> {
        device.bind()?;
        // SAFETY: the device's context is current (bound above).
        let handle = unsafe { raw::event_create() }?;
        Ok(Event {
            device: device.clone(),
            handle,
        })
    }

    /// Captures the work queued on `stream` so far; replaces an earlier capture.
    ///
    /// # Errors
    /// [`CudaError::Misuse`] when the stream is on another device; a driver error otherwise.
    pub fn record(&self, stream: &Stream) -> Result<(), CudaError> {
        if !stream.device().same_as(&self.device) {
            return Err(CudaError::Misuse(format!(
                "recording an event of GPU {} on a stream of GPU {}",
                self.device.ordinal(),
                stream.device().ordinal()
            )));
        }
        stream.bind()?;
        // SAFETY: both live, same context (checked above).
        unsafe { raw::event_record(self.handle, stream.handle()) }
    }

    /// Blocks until the captured work has completed (at once if never recorded).
    ///
    /// # Errors
    /// A driver error, including one from the captured work.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.device.bind()?;
        // SAFETY: live for as long as `self`.
        unsafe { raw::event_synchronize(self.handle) }
    }

    /// True when the captured work has completed; never blocks.
    ///
    /// # Errors
    /// A driver error, including one from the captured work.
    pub fn query(&self) -> Result<bool, CudaError> {
        self.device.bind()?;
        // SAFETY: live for as long as `self`.
        unsafe { raw::event_query(self.handle) }
    }

    /// The device the event belongs to.
    pub fn device(&self) -> &Device {
        &self.device
    }
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Event")
            .field("device", &self.device.ordinal())
            .field("handle", &self.handle)
            .finish()
    }
}
