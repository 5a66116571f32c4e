//! What a `ferry.Node` object owns ([`Core`]): the runtime, the node and the bookkeeping of
//! its receives, fetches and publications, with the operations its methods run (blocking
//! or as asyncio tasks) and the shutdown when it is collected.

use super::*;

/// What the Python object owns.
pub(super) struct Core {
    /// The runtime the node's futures run on: the node's own timers and the asyncio
    /// flavour's tasks. Shut down (in the background) by `close` or when collected.
    pub(super) runtime: Mutex<Option<Runtime>>,
    pub(super) handle: Handle,
    /// The node; `None` once closed.
    pub(super) node: Mutex<Option<Arc<ferry::Node>>>,
    /// Set by `close`: receives waiting end with `ShuttingDown`.
    pub(super) closing: watch::Sender<bool>,
    pub(super) name: String,
    pub(super) addresses: Vec<String>,
    pub(super) receive_class: MemoryClass,
    pub(super) default_deadline: Duration,
    /// Bounds the asynchronous operations in flight.
    pub(super) pending: Arc<Semaphore>,
    /// Buffers an `arecv` got after its caller cancelled it, oldest first: the next
    /// matching receive takes them before asking the node. At most `max_pending`.
    pub(super) unclaimed: Arc<Mutex<VecDeque<ferry::Received>>>,
    pub(super) max_pending: usize,
    /// The keys published through this object, with what to give back or keep alive until
    /// each is unpublished. Changed under its lock together with the node's own table.
    pub(super) published: Arc<Mutex<HashMap<String, Held>>>,
}

impl Core {
    pub(super) fn node(&self) -> PyResult<Arc<ferry::Node>> {
        self.node
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .ok_or_else(closed)
    }

    /// Runs `op` on this thread with the GIL released, checking for signals every
    /// [`SLICE`]. Interrupted (`KeyboardInterrupt`...), the operation is dropped when
    /// `on_cancel` says so (it is cancel safe), else it finishes as a task, and what must
    /// outlive it (a send's `Keep`, in its output) goes with it.
    pub(super) fn block<T, F>(&self, py: Python<'_>, op: F, on_cancel: OnCancel) -> PyResult<T>
    where
        F: Future<Output = T> + Send + 'static,
        T: Send + 'static,
    {
        let mut op = Box::pin(op);
        loop {
            let handle = &self.handle;
            // The timer is made inside the runtime's context (`block_on`), which it needs.
            let slice = py.detach(|| {
                handle.block_on(async { tokio::time::timeout(SLICE, op.as_mut()).await })
            });
            match slice {
                Ok(output) => return Ok(output),
                Err(_) => {
                    if let Err(signal) = py.check_signals() {
                        if on_cancel == OnCancel::Finish {
                            // Its Keep (inside the output) drops when the task ends.
                            self.handle.spawn(op);
                        }
                        return Err(signal);
                    }
                }
            }
        }
    }

    /// `op`, ended with `ShuttingDown` when the node is closed first.
    pub(super) fn until_closed<T, F>(
        &self,
        op: F,
    ) -> impl Future<Output = Result<T, Error>> + use<T, F>
    where
        F: Future<Output = Result<T, Error>>,
    {
        let mut closing = self.closing.subscribe();
        async move {
            tokio::select! {
                done = op => done,
                _ = closing.wait_for(|closed| *closed) => Err(Error::ShuttingDown),
            }
        }
    }

    /// A permit for one more asynchronous operation, or `QueueFull`.
    pub(super) fn permit(&self) -> PyResult<OwnedSemaphorePermit> {
        Arc::clone(&self.pending).try_acquire_owned().map_err(|_| {
            to_py(&Error::QueueFull(format!(
                "{} asynchronous operations are in flight on this Node (max_pending)",
                self.max_pending
            )))
        })
    }

    pub(super) fn arrival(&self, got: ferry::Received) -> Buffer {
        let spilled = convert::class_of(got.buffer.kind()) != self.receive_class;
        Buffer::received(
            got.buffer,
            Arrival {
                peer: got.peer,
                tag: Some(got.tag),
                key: None,
                joined: false,
                transport: got.transport,
                layout: got.layout,
                spilled,
            },
        )
    }

    /// A fetched buffer, with where it came from. Spilled: not in the memory class asked
    /// for (`into`, else the node's `receive_into`).
    pub(super) fn fetched(&self, ask: FetchAsk, got: ferry::Fetched) -> Buffer {
        let wanted = ask.into.map_or(self.receive_class, convert::class_of);
        let spilled = convert::class_of(got.buffer.kind()) != wanted;
        Buffer::received(
            got.buffer,
            Arrival {
                peer: ask.peer,
                tag: None,
                key: Some(ask.key),
                joined: got.joined,
                transport: got.transport,
                layout: ask.layout,
                spilled,
            },
        )
    }

    /// The future of a fetch: the bytes, `DeadlineExceeded` after `ask.timeout` (the
    /// node's default deadline when `None`), `ShuttingDown` when the node is closed
    /// meanwhile. Dropping it drops this caller's wait only (the transfer goes on for the
    /// others).
    pub(super) fn fetch_op(
        &self,
        ask: &FetchAsk,
    ) -> PyResult<impl Future<Output = Result<ferry::Fetched, Error>> + Send + 'static> {
        let node = self.node()?;
        let deadline = ask
            .timeout
            .map(duration)
            .transpose()?
            .map(|t| Instant::now() + t);
        let fetch = Fetch {
            layout: ask.layout.clone(),
            into: ask.into,
            shared: ask.shared,
            deadline,
        };
        let (peer, key) = (ask.peer.clone(), ask.key.clone());
        let mut closing = self.closing.subscribe();
        Ok(async move {
            tokio::select! {
                got = node.fetch(&peer, &key, fetch) => got,
                _ = closing.wait_for(|closed| *closed) => Err(Error::ShuttingDown),
            }
        })
    }

    /// Publishes `obj` under `key`: the plan (with the GIL), then the future that makes
    /// the buffer and publishes it, which yields what to drop after (with the GIL).
    pub(super) fn publish_op(
        &self,
        listing: source::Listing,
        obj: &Bound<'_, PyAny>,
    ) -> PyResult<
        impl Future<Output = (Result<Option<ferry::RegionKey>, Error>, Keep)> + Send + 'static,
    > {
        let node = self.node()?;
        let object = obj.cast::<Buffer>().ok().map(|b| b.clone().unbind());
        let (plan, keep) = source::plan(obj)?;
        let published = Arc::clone(&self.published);
        Ok(source::run_publish(
            node,
            published,
            listing,
            (plan, keep, object),
        ))
    }

    /// Unpublishes `key`: the binding's record taken out now (with the GIL), the wait for
    /// the readers in a task of its own, so that it ends (and gives the buffer back to its
    /// object) whatever happens to its caller; the future returned waits for that task up
    /// to `timeout`. With it, the `ferry.Buffer` object that was published, to return.
    #[allow(clippy::type_complexity)]
    pub(super) fn unpublish_op(
        &self,
        py: Python<'_>,
        (key, region): (String, Option<ferry::RegionKey>),
        timeout: Option<f64>,
    ) -> PyResult<(
        Option<Py<Buffer>>,
        impl Future<Output = Result<Unpublished, Error>> + Send + 'static,
    )> {
        let node = self.node()?;
        let timeout = timeout.map(duration).transpose()?;
        let held = self
            .published
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&key)
            .ok_or_else(|| match region {
                Some(r) => usage(format!(
                    "region {} is not registered through this Node (or was unregistered)",
                    r.region
                )),
                None => usage(format!("nothing is published under key {key:?}")),
            })?;
        let object = match &held {
            Held::Object(object) => Some(object.clone_ref(py)),
            _ => None,
        };
        let task = self
            .handle
            .spawn(source::run_unpublish(node, key, held, region));
        let wait = async move {
            // Fails only when the runtime stopped (the node was closed) before it ended.
            let joined = async { task.await.unwrap_or(Err(Error::ShuttingDown)) };
            match timeout {
                Some(t) => tokio::time::timeout(t, joined)
                    .await
                    .unwrap_or(Err(Error::DeadlineExceeded)),
                None => joined.await,
            }
        };
        Ok((object, wait))
    }

    /// The future of a receive: the oldest matching buffer, `DeadlineExceeded` after
    /// `timeout`, `ShuttingDown` when the node is closed meanwhile.
    pub(super) fn recv_op(
        &self,
        peer: Option<String>,
        tag: Option<u64>,
        timeout: Option<f64>,
    ) -> PyResult<impl Future<Output = Result<ferry::Received, Error>> + Send + 'static> {
        let node = self.node()?;
        let timeout = timeout.map(duration).transpose()?;
        let mut closing = self.closing.subscribe();
        let unclaimed = Arc::clone(&self.unclaimed);
        Ok(async move {
            if let Some(got) = take_unclaimed(&unclaimed, peer.as_deref(), tag) {
                return Ok(got);
            }
            let recv = node.recv(peer.as_deref(), tag);
            let bounded = async {
                match timeout {
                    Some(t) => tokio::time::timeout(t, recv)
                        .await
                        .unwrap_or(Err(Error::DeadlineExceeded)),
                    None => recv.await,
                }
            };
            tokio::select! {
                got = bounded => got,
                _ = closing.wait_for(|closed| *closed) => Err(Error::ShuttingDown),
            }
        })
    }

    /// Sends `obj`: the plan (with the GIL), then the future that moves the bytes, which
    /// yields the plan's [`Keep`] back with its result.
    pub(super) fn send_op(
        &self,
        peer: String,
        tag: u64,
        obj: &Bound<'_, PyAny>,
        layout: Layout,
        timeout: Option<f64>,
    ) -> PyResult<impl Future<Output = (Sent, Keep)> + Send + 'static> {
        let node = self.node()?;
        let deadline = timeout
            .map(duration)
            .transpose()?
            .map(|t| Instant::now() + t);
        let (plan, keep) = source::plan(obj)?;
        Ok(async move {
            let sent = source::run_send(node, peer, tag, plan, layout, deadline).await;
            if sent.keep_forever {
                // A peer may still read the memory: never let it go, whoever drops this.
                std::mem::forget(keep);
                return (sent, Keep::Nothing);
            }
            (sent, keep)
        })
    }
}

/// The oldest unclaimed buffer from `peer` (any when `None`) under `tag` (any when
/// `None`).
fn take_unclaimed(
    unclaimed: &Mutex<VecDeque<ferry::Received>>,
    peer: Option<&str>,
    tag: Option<u64>,
) -> Option<ferry::Received> {
    let mut unclaimed = unclaimed.lock().unwrap_or_else(PoisonError::into_inner);
    let at = unclaimed
        .iter()
        .position(|got| peer.is_none_or(|p| p == got.peer) && tag.is_none_or(|t| t == got.tag))?;
    unclaimed.remove(at)
}

/// The outcome of a send, with the GIL: its `Keep` dropped (the object's memory may be
/// freed now), its error raised.
pub(super) fn finish_send((sent, keep): (Sent, Keep)) -> PyResult<()> {
    drop(keep);
    sent.result.map_err(|e| to_py(&e))
}

/// The outcome of an unpublish, with the GIL: the `ferry.Buffer` object that was
/// published (its buffer back in it), a new `Buffer` holding the copy of a bytes-like
/// object's bytes, or `None` for a tensor registered in place (its keep dropped: the
/// tensor is its owner's alone again).
pub(super) fn finish_unpublish(
    py: Python<'_>,
    object: Option<Py<Buffer>>,
    out: Result<Unpublished, Error>,
) -> PyResult<Py<PyAny>> {
    match out.map_err(|e| to_py(&e))? {
        Unpublished::Returned => Ok(object.map_or_else(|| py.None(), Py::into_any)),
        Unpublished::Copy(buffer) => Ok(Py::new(py, Buffer::allocated(buffer))?.into_any()),
        Unpublished::Unregistered(keep) => {
            drop(keep);
            Ok(py.None())
        }
    }
}

/// What a fetch asks for, from its Python arguments.
pub(super) struct FetchAsk {
    peer: String,
    key: String,
    layout: Layout,
    into: Option<MemoryKind>,
    shared: bool,
    timeout: Option<f64>,
}

impl FetchAsk {
    pub(super) fn new(
        peer: String,
        key: String,
        layout: convert::LayoutArgs,
        into: Option<&str>,
        shared: bool,
        timeout: Option<f64>,
    ) -> PyResult<Self> {
        let layout = if layout.is_empty() {
            Layout::Contiguous
        } else {
            convert::layout_of("fetch", layout)?
        };
        Ok(Self {
            peer,
            key,
            layout,
            into: into.map(convert::parse_kind).transpose()?,
            shared,
            timeout,
        })
    }
}

fn duration(seconds: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(seconds.max(0.0))
        .map_err(|_| usage(format!("{seconds} is not a duration in seconds")))
}

impl Drop for Core {
    fn drop(&mut self) {
        let _ = self.closing.send(true);
        let node = self
            .node
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        drop(node);
        let runtime = self
            .runtime
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(runtime) = runtime {
            runtime.shutdown_background();
        }
    }
}
