"""ferry's exceptions: one class per kind of failure of the Rust library (``ErrorKind``).

Every exception ferry raises is a :class:`FerryError`. Its attributes say who is at fault
and whether a retry can help:

``kind``
    The stable label of the Rust ``ErrorKind`` (``"peer_lost"``, ``"deadline"``, ...).
``peer``
    The peer the error is about, or ``None``.
``transient``
    True when the same call may succeed later unchanged (backpressure, a deadline that was
    too short, a peer that may come back).

Catch a subclass to handle one kind; the message names the cause.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple, Type

__all__ = [
    "REFUSAL_REASONS",
    "FerryError",
    "ConfigError",
    "StartError",
    "PeerUnreachable",
    "PeerLost",
    "Refused",
    "DeadlineExceeded",
    "Cancelled",
    "NoRoute",
    "QueueFull",
    "NoMemory",
    "UsageError",
    "Unsupported",
    "ShuttingDown",
    "TransportError",
]


class FerryError(Exception):
    """Base class of every error ferry raises."""

    #: The stable label of the Rust error kind.
    kind: str = "unknown"
    #: The peer the error is about, if any.
    peer: Optional[str] = None
    #: Whether retrying the same call later may succeed.
    transient: bool = False


class ConfigError(FerryError):
    """The configuration is invalid (the message names the key and where it came from),
    or its secret file is missing or readable by others."""

    kind = "config"


class StartError(FerryError):
    """The node could not start: a listener could not bind, a thread could not start."""

    kind = "start"


class PeerUnreachable(FerryError, ConnectionError):
    """The peer is not in the configuration, or could not be reached (connection refused,
    authentication failed...)."""

    kind = "peer_unreachable"
    transient = True


class PeerLost(FerryError, ConnectionError):
    """The link to the peer broke, or the peer died, before the operation ended."""

    kind = "peer_lost"
    transient = True


class Refused(FerryError):
    """The peer refused the operation; ``reason`` says why, as the peer said it:
    ``"too_large"``, ``"deadline"``, ``"unsupported"``, ``"shutting_down"``,
    ``"cancelled"``, ``"protocol"`` or ``"stalled"``; for a fetch, ``"unknown_key"``
    (nothing is published under the key) or ``"not_allowed"`` (the key is published for
    other peers only); for a one-sided read or write, ``"stale_key"`` (the region key names
    no region registered there now) or ``"read_only"`` (a write into a region registered
    read-only). ``"other"`` for a reason newer than this package."""

    kind = "refused"
    #: The peer's reason, a stable label (see :data:`REFUSAL_REASONS`).
    reason: Optional[str] = None
    #: The peer's own words.
    detail: Optional[str] = None


class DeadlineExceeded(FerryError, TimeoutError):
    """The operation's deadline passed (``recv(timeout=...)`` included)."""

    kind = "deadline"
    transient = True


class Cancelled(FerryError):
    """The operation was cancelled."""

    kind = "cancelled"


class NoRoute(FerryError):
    """No route rule matches the transfer, or no transport of the matching rule can carry it
    (see ``Node.explain``)."""

    kind = "no_route"


class QueueFull(FerryError):
    """Backpressure: a bounded queue is full (receivers waiting on the node, or asynchronous
    operations in flight on this ``Node`` object). Retry later."""

    kind = "queue_full"
    transient = True


class NoMemory(FerryError):
    """Memory could not be granted; ``cause`` says why: ``"larger_than_budget"``,
    ``"deadline"``, ``"queue_full"``, ``"driver_refused"`` or ``"no_tier"``."""

    kind = "no_memory"
    transient = True
    #: Why, a stable label.
    cause: Optional[str] = None
    #: The memory asked for (``"host"``, ``"pinned"``, ``"cuda:0"``...).
    memory: Optional[str] = None
    #: Bytes asked for.
    nbytes: Optional[int] = None


class UsageError(FerryError, ValueError):
    """The API was used wrongly: a layout that does not fit its buffer, a buffer sent while
    views of it are alive, an unknown memory kind..."""

    kind = "usage"


class Unsupported(FerryError):
    """Not available in this build or on this machine (a GPU this node does not use)."""

    kind = "unsupported"


class ShuttingDown(FerryError):
    """The node is shutting down or has been closed."""

    kind = "shutting_down"


class TransportError(FerryError):
    """The transport failed to move the bytes (a copy into the peer's memory failed)."""

    kind = "transport"


_BY_KIND: Dict[str, Type[FerryError]] = {
    cls.kind: cls
    for cls in (
        ConfigError,
        StartError,
        PeerUnreachable,
        PeerLost,
        Refused,
        DeadlineExceeded,
        Cancelled,
        NoRoute,
        QueueFull,
        NoMemory,
        UsageError,
        Unsupported,
        ShuttingDown,
        TransportError,
    )
}


#: Every ``Refused.reason`` label (besides ``"other"``, for a reason newer than this
#: package).
REFUSAL_REASONS: Tuple[str, ...] = (
    "cancelled",
    "deadline",
    "too_large",
    "unsupported",
    "shutting_down",
    "protocol",
    "stalled",
    "unknown_key",
    "not_allowed",
    "stale_key",
    "read_only",
)
