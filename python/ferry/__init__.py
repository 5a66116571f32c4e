"""ferry: move GPU and host buffers between processes and hosts.

A :class:`Node` joins a ferry deployment from a configuration (peers by name and address,
a shared secret) and sends and receives buffers by peer name and tag::

    import numpy as np
    import ferry

    with ferry.Node(config_file="a.toml") as node:
        node.send("b", 1, np.arange(1024, dtype=np.float32))   # returns once b holds it
        got = node.recv("b", 2, timeout=10.0)                   # a ferry.Buffer
        reply = np.frombuffer(got, dtype=np.float32)            # a view, no copy

What is sent: a :class:`Buffer` from :meth:`Node.alloc` (no copy), any C-contiguous object
with the buffer protocol or ``__dlpack__`` in host memory (one copy into ferry's pool), or a
CUDA tensor with ``__dlpack__`` / ``__cuda_array_interface__`` (registered in place, no
copy). What :meth:`Node.recv` returns is a :class:`Buffer`: ``numpy.asarray``,
``memoryview``, ``numpy.from_dlpack`` and ``torch.from_dlpack`` view it without a copy.

A node also publishes buffers under keys (:meth:`Node.publish`, :meth:`Node.unpublish`)
for its peers to fetch (:meth:`Node.fetch`: the whole buffer or blocks of it); concurrent
fetches of one key on one node share one transfer.

Every error is a :class:`FerryError`; see :mod:`ferry.errors`.
"""

from ferry._ferry import Buffer, Node, __version__
from ferry.errors import (
    Cancelled,
    ConfigError,
    DeadlineExceeded,
    FerryError,
    NoMemory,
    NoRoute,
    PeerLost,
    PeerUnreachable,
    QueueFull,
    Refused,
    ShuttingDown,
    StartError,
    TransportError,
    Unsupported,
    UsageError,
)

__all__ = [
    "Node",
    "Buffer",
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
    "__version__",
]
