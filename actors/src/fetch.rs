//! Fetching what peers published, once for many callers (single flight).
//!
//! Concurrent fetches of one (peer, key, layout) on a node share one flight: the first
//! starts it, as a task of its own (so that cancelling any caller, the first included,
//! cancels no other), and every caller waits for its end. A flight that fails gives every
//! caller its error. One that lands gives each caller a handle on the landed buffer; a
//! caller that wants a buffer of its own and is not the last holder gets a copy made here
//! (into the memory it asked for), so the bytes cross the link once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use ferry_config::TransportName;
use ferry_transports::memory::{Buffer, MemoryKind};
use ferry_transports::wire::Layout;
use tokio::sync::watch;

use crate::error::Error;

/// Callers one flight takes at most; one more is refused (backpressure).
pub const MAX_JOINERS: usize = 4096;

/// What a fetch asks for. `Fetch::default()` fetches the whole buffer into the memory it
/// lands in, as a buffer of the caller's own, by the node's default deadline.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Fetch {
    /// Which bytes: the whole buffer ([`Layout::Contiguous`]) or some of it (a block list,
    /// rows); they arrive packed.
    pub layout: Layout,
    /// Where the caller wants the bytes: `None` takes them where they landed (the node's
    /// `memory.receive_into`); another kind (another GPU of this node, host memory) gets a
    /// copy there, made on this node from the one landing.
    pub into: Option<MemoryKind>,
    /// Take a read-only handle shared with the other callers of the same flight instead of
    /// a buffer of one's own (no copy; nothing may write it while others hold it).
    pub shared: bool,
    /// When the fetch must have ended; the node's default deadline when `None`.
    pub deadline: Option<Instant>,
}

/// A fetched buffer.
#[derive(Debug)]
pub struct Fetched {
    /// The bytes, packed as the fetch's layout names them.
    pub buffer: Buffer,
    /// The transport they came over.
    pub transport: TransportName,
    /// True when this fetch joined another's flight (its bytes did not cross the link
    /// again).
    pub joined: bool,
    /// The peer it came from.
    pub peer: String,
    /// The key it was published under.
    pub key: String,
    /// Which bytes of the published buffer, packed: the fetch's layout.
    pub layout: Layout,
}

/// A fetch's counters on the fetching node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FetchStats {
    /// Fetches asked for.
    pub fetches: u64,
    /// Flights started: fetches that crossed the link.
    pub flights: u64,
    /// Fetches that joined a flight already on its way.
    pub joined: u64,
    /// Bytes joined fetches got without crossing the link.
    pub bytes_saved: u64,
}

/// What a flight lands: the buffer and the transport it came over.
#[derive(Debug)]
pub struct Landed {
    /// The landed bytes.
    pub buffer: Buffer,
    /// The transport.
    pub transport: TransportName,
}

/// A landed flight, as its callers share it: each holds the `Arc` until it has what it
/// wants (a handle, or a copy of its own), and the last holder takes the landed buffer
/// itself ([`Share::into_sole`]).
#[derive(Debug)]
pub struct Share {
    landed: Landed,
}

impl Share {
    /// The transport the bytes came over.
    pub fn transport(&self) -> TransportName {
        self.landed.transport
    }

    /// The landed buffer, read-only while shared.
    pub fn buffer(&self) -> &Buffer {
        &self.landed.buffer
    }

    /// The landed buffer, for the caller that holds the last reference to the share while
    /// no read-only handle on the buffer is out (a caller that gone away holds none); else
    /// the share back. Ownership is decided this late, at each try, so callers that left
    /// never keep the others from taking the landing.
    ///
    /// # Errors
    /// The share, when another caller still holds it or a handle on its buffer is out.
    pub fn into_sole(share: Arc<Self>) -> Result<Buffer, Arc<Self>> {
        match Arc::try_unwrap(share) {
            Ok(s) if s.landed.buffer.is_exclusive() => Ok(s.landed.buffer),
            Ok(s) => Err(Arc::new(s)),
            Err(s) => Err(s),
        }
    }
}

type Outcome = Option<Result<Arc<Share>, Error>>;

/// Which flight: (peer, key, layout).
type FlightKey = (String, String, Layout);

struct Flight {
    done: watch::Sender<Outcome>,
    callers: usize,
}

/// A caller's place in a flight.
pub struct Seat {
    rx: watch::Receiver<Outcome>,
    /// True for the caller that must start the flight.
    pub leads: bool,
}

impl Seat {
    /// Waits for the flight to end, until `deadline`.
    ///
    /// # Errors
    /// The flight's error, or [`Error::DeadlineExceeded`].
    pub async fn landed(mut self, deadline: Instant) -> Result<Arc<Share>, Error> {
        let waited = tokio::time::timeout_at(deadline.into(), self.rx.wait_for(Option::is_some))
            .await
            .map_err(|_| Error::DeadlineExceeded)?;
        match waited.as_deref() {
            Ok(Some(outcome)) => outcome.clone(),
            // The flight task went away without an answer: the node is stopping.
            _ => Err(Error::ShuttingDown),
        }
    }
}

/// The flights of one node.
#[derive(Default)]
pub struct Flights {
    flights: Mutex<HashMap<FlightKey, Flight>>,
    fetches: AtomicU64,
    started: AtomicU64,
    joined: AtomicU64,
    bytes_saved: AtomicU64,
}

impl std::fmt::Debug for Flights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Flights")
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl Flights {
    /// Takes a seat in the flight for (`peer`, `key`, `layout`), starting one when none is
    /// on its way (the seat then `leads`: its caller starts the flight and ends it with
    /// [`Self::land`]).
    ///
    /// # Errors
    /// [`Error::QueueFull`] when the flight has [`MAX_JOINERS`] callers.
    pub fn seat(&self, peer: &str, key: &str, layout: &Layout) -> Result<Seat, Error> {
        self.fetches.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("ferry_fetches_total").increment(1);
        let mut flights = self.flights.lock().unwrap_or_else(|p| p.into_inner());
        let id = (peer.to_string(), key.to_string(), layout.clone());
        if let Some(flight) = flights.get_mut(&id) {
            if flight.callers >= MAX_JOINERS {
                return Err(Error::QueueFull(format!(
                    "{MAX_JOINERS} fetches of key {key:?} from {peer} wait already"
                )));
            }
            flight.callers += 1;
            self.joined.fetch_add(1, Ordering::Relaxed);
            metrics::counter!("ferry_fetches_joined_total").increment(1);
            return Ok(Seat {
                rx: flight.done.subscribe(),
                leads: false,
            });
        }
        let (done, rx) = watch::channel(None);
        flights.insert(id, Flight { done, callers: 1 });
        self.started.fetch_add(1, Ordering::Relaxed);
        Ok(Seat { rx, leads: true })
    }

    /// The flight for (`peer`, `key`, `layout`) ended with `outcome`: every caller gets it,
    /// and the next fetch starts a new flight. Counts the bytes its joiners saved.
    pub fn land(&self, peer: &str, key: &str, layout: &Layout, outcome: Result<Landed, Error>) {
        let id = (peer.to_string(), key.to_string(), layout.clone());
        let flight = self
            .flights
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id);
        let Some(flight) = flight else { return };
        if let Ok(landed) = &outcome {
            let saved = (flight.callers as u64 - 1) * landed.buffer.len() as u64;
            self.bytes_saved.fetch_add(saved, Ordering::Relaxed);
            metrics::counter!("ferry_fetch_bytes_saved_total").increment(saved);
        }
        let share = outcome.map(|landed| Arc::new(Share { landed }));
        // The sender goes with the flight: the value stays until the last caller took it.
        flight.done.send_replace(Some(share));
    }

    /// The node's fetch counters.
    pub fn stats(&self) -> FetchStats {
        FetchStats {
            fetches: self.fetches.load(Ordering::Relaxed),
            flights: self.started.load(Ordering::Relaxed),
            joined: self.joined.load(Ordering::Relaxed),
            bytes_saved: self.bytes_saved.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::publish::tests::buffer;

    fn far() -> Instant {
        Instant::now() + std::time::Duration::from_secs(5)
    }

    #[tokio::test]
    async fn one_flight_for_many_callers() {
        let flights = Flights::default();
        let seats: Vec<_> = (0..16)
            .map(|_| flights.seat("a", "k", &Layout::Contiguous).expect("seat"))
            .collect();
        assert_eq!(seats.iter().filter(|s| s.leads).count(), 1);
        let other = flights
            .seat("a", "k2", &Layout::Contiguous)
            .expect("another key");
        assert!(other.leads, "another key flies on its own");
        flights.land(
            "a",
            "k",
            &Layout::Contiguous,
            Ok(Landed {
                buffer: buffer(100),
                transport: TransportName::Tcp,
            }),
        );
        for seat in seats {
            let landed = seat.landed(far()).await.expect("landed");
            assert_eq!(landed.buffer().len(), 100);
        }
        let stats = flights.stats();
        assert_eq!((stats.fetches, stats.flights, stats.joined), (17, 2, 15));
        assert_eq!(stats.bytes_saved, 1500);
        assert!(
            flights
                .seat("a", "k", &Layout::Contiguous)
                .expect("seat")
                .leads,
            "after landing, the next fetch flies again"
        );
    }

    #[tokio::test]
    async fn a_failed_flight_fails_every_caller() {
        let flights = Flights::default();
        let seats: Vec<_> = (0..4)
            .map(|_| flights.seat("a", "k", &Layout::Contiguous).expect("seat"))
            .collect();
        flights.land(
            "a",
            "k",
            &Layout::Contiguous,
            Err(Error::Usage("no such key".into())),
        );
        for seat in seats {
            let e = seat.landed(far()).await.expect_err("failed");
            assert!(e.to_string().contains("no such key"), "{e}");
        }
        assert_eq!(flights.stats().bytes_saved, 0);
    }

    #[tokio::test]
    async fn a_caller_gives_up_alone() {
        let flights = Flights::default();
        let first = flights.seat("a", "k", &Layout::Contiguous).expect("seat");
        let second = flights.seat("a", "k", &Layout::Contiguous).expect("seat");
        let soon = Instant::now() + std::time::Duration::from_millis(20);
        assert!(matches!(
            second.landed(soon).await,
            Err(Error::DeadlineExceeded)
        ));
        flights.land(
            "a",
            "k",
            &Layout::Contiguous,
            Ok(Landed {
                buffer: buffer(8),
                transport: TransportName::Tcp,
            }),
        );
        assert!(
            first.landed(far()).await.is_ok(),
            "the other caller still lands"
        );
    }

    #[test]
    fn the_last_holder_takes_the_landing() {
        let share = Arc::new(Share {
            landed: Landed {
                buffer: buffer(8),
                transport: TransportName::Tcp,
            },
        });
        let other = Arc::clone(&share);
        let share = Share::into_sole(share).expect_err("another caller holds it");
        drop(other);
        let handle = share.buffer().read_only_handle();
        let share = Share::into_sole(share).expect_err("a shared handle is out");
        drop(handle);
        let landed = Share::into_sole(share).expect("the last holder");
        assert!(landed.is_exclusive());
    }
}
