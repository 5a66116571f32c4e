"""Type stubs of the extension module ``ferry._ferry`` (re-exported by ``ferry``)."""

from __future__ import annotations

import os
from types import TracebackType
from typing import Any, Awaitable, List, Literal, Mapping, Optional, Tuple, TypedDict, Union

__version__: str

#: A memory kind: ``"host"``, ``"pinned"``, ``"cuda"`` / ``"device"`` (GPU 0), ``"cuda:N"``.
MemoryKindName = str
#: A memory class of route rules: ``"host"``, ``"pinned"`` or ``"device"``.
MemoryClassName = Literal["host", "pinned", "device"]
#: What ``send`` takes: a ``Buffer``, a C-contiguous object with the buffer protocol, or a
#: tensor with ``__dlpack__`` / ``__cuda_array_interface__`` / ``__array_interface__``.
Sendable = Any

class Layout(TypedDict, total=False):
    """How the rows (or blocks) of a buffer sent with ``send_layout`` lay at the sender."""

    rows: int
    row_bytes: int
    pitch: int
    depth: int
    plane_rows: int
    blocks: List[Tuple[int, int]]

class Explanation(TypedDict):
    """``Node.explain``'s answer."""

    summary: str
    bytes: int
    locality: Literal["same-process", "same-host", "remote"]
    src: MemoryClassName
    dst: MemoryClassName
    dst_from: str
    rule: Optional[str]
    rule_index: Optional[int]
    skipped: List[Tuple[str, str]]
    transport: Optional[str]
    direction: Optional[Literal["push", "pull"]]
    landing: Optional[MemoryClassName]

class MemoryStats(TypedDict):
    """One memory domain's counters (``Node.memory``)."""

    capacity: int
    granted: int
    free: int
    waiting: int
    peak_waiting: int
    exported: int
    quarantined: int
    kept: int
    """Bytes of dropped buffers kept for later receives (``memory.keep_idle``, ``keep_max``)."""
    reused: int
    """Grants served from kept memory since the node started."""

class PublicationStats(TypedDict):
    """What a published key has served (``Node.publication``)."""

    len: int
    served: int
    bytes_served: int
    refused: int
    reading: int

class FetchStats(TypedDict):
    """A node's fetch counters (``Node.fetch_stats``)."""

    fetches: int
    flights: int
    joined: int
    bytes_saved: int

class Buffer:
    """A ferry buffer: memory from ferry's pools, on the host or a GPU.

    Views (``memoryview``, ``numpy.asarray``, ``numpy.from_dlpack``, ``torch.from_dlpack``)
    are zero-copy and one-dimensional ``uint8``. The memory returns to ferry's pool when the
    last reference and the last view are gone, or with ``release()``.
    """

    @property
    def nbytes(self) -> int:
        """Length in bytes."""
    @property
    def kind(self) -> str:
        """``"host"``, ``"pinned"`` or ``"cuda:N"``."""
    @property
    def device(self) -> Optional[int]:
        """The GPU's CUDA ordinal, or ``None`` for host memory."""
    @property
    def peer(self) -> Optional[str]:
        """The sender, or the exporter of a fetched buffer (``None`` for a buffer from
        ``alloc``)."""
    @property
    def tag(self) -> Optional[int]:
        """The tag it was sent under (``None`` for a buffer from ``alloc`` or ``fetch``)."""
    @property
    def key(self) -> Optional[str]:
        """The key it was fetched by (``None`` unless it came from ``fetch``)."""
    @property
    def joined(self) -> bool:
        """For a fetched buffer: it shared another fetch's transfer (single flight)."""
    @property
    def transport(self) -> Optional[str]:
        """The transport that carried it (``"tcp"``, ``"ipc"``, ``"staged"``, ``"ucx"``)."""
    @property
    def spilled(self) -> bool:
        """True when it landed in another memory tier than the node receives into."""
    @property
    def layout(self) -> Optional[Layout]:
        """The sender's layout, for a buffer sent with ``send_layout`` or fetched with a
        layout."""
    @property
    def released(self) -> bool:
        """True once released (or while being sent, or published)."""
    def release(self) -> None:
        """Gives the memory back now; ``UsageError`` while views of it are alive."""
    def tobytes(self) -> bytes:
        """A copy of the bytes, whatever memory they live in."""
    def __len__(self) -> int: ...
    def __enter__(self) -> Buffer: ...
    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __dlpack__(
        self,
        *,
        stream: Optional[Any] = None,
        max_version: Optional[Tuple[int, int]] = None,
        dl_device: Optional[Tuple[int, int]] = None,
        copy: Optional[bool] = None,
    ) -> Any:
        """A DLPack capsule of the bytes (zero-copy)."""
    def __dlpack_device__(self) -> Tuple[int, int]:
        """``(1, 0)`` for host memory, ``(2, N)`` for GPU N."""

class Node:
    """A ferry node: sends and receives buffers by peer name and tag, publishes buffers
    under keys and fetches what peers publish.

    ``Node(config)`` with TOML text or a dict, or ``Node(config_file=path)``; use it as a
    context manager or call ``close()``.
    """

    def __init__(
        self,
        config: Union[str, Mapping[str, Any], None] = None,
        *,
        config_file: Union[str, os.PathLike[str], None] = None,
        max_pending: int = 1024,
    ) -> None: ...
    @property
    def name(self) -> str:
        """The node's name."""
    @property
    def addresses(self) -> List[str]:
        """The TCP addresses it listens on."""
    @property
    def receive_into(self) -> MemoryClassName:
        """The memory class received buffers land in first."""
    @property
    def closed(self) -> bool:
        """True once closed."""
    def send(self, peer: str, tag: int, obj: Sendable, *, timeout: Optional[float] = None) -> None:
        """Sends ``obj``; returns once the peer holds every byte."""
    def send_layout(
        self,
        peer: str,
        tag: int,
        obj: Sendable,
        *,
        rows: Optional[int] = None,
        row_bytes: Optional[int] = None,
        pitch: Optional[int] = None,
        depth: Optional[int] = None,
        plane_rows: Optional[int] = None,
        blocks: Optional[List[Tuple[int, int]]] = None,
    ) -> None:
        """Sends rows of ``obj`` at a pitch (planes of them with ``depth``), or the
        ``(offset, length)`` blocks of ``blocks``, packed. Of a host array only the bytes
        the layout names are copied, never the whole array."""
    def recv(
        self, peer: Optional[str] = None, tag: Optional[int] = None, *, timeout: Optional[float] = None
    ) -> Buffer:
        """The oldest matching buffer, waiting up to ``timeout`` seconds."""
    def asend(
        self, peer: str, tag: int, obj: Sendable, *, timeout: Optional[float] = None
    ) -> Awaitable[None]:
        """Coroutine twin of ``send``."""
    def arecv(
        self, peer: Optional[str] = None, tag: Optional[int] = None, *, timeout: Optional[float] = None
    ) -> Awaitable[Buffer]:
        """Coroutine twin of ``recv``."""
    def publish(self, key: str, obj: Sendable, peers: Optional[List[str]] = None) -> None:
        """Publishes ``obj`` under ``key`` for peers to fetch (``peers`` only, when given),
        until ``unpublish``; a ``ferry.Buffer`` is published as it is (released meanwhile),
        other host objects are copied once, CUDA tensors registered in place."""
    def unpublish(self, key: str, *, timeout: Optional[float] = None) -> Optional[Buffer]:
        """Ends the publication once no peer reads it: the published ``Buffer`` object
        back, a new ``Buffer`` with the copy of a bytes-like object, ``None`` for a CUDA
        tensor registered in place."""
    def aunpublish(
        self, key: str, *, timeout: Optional[float] = None
    ) -> Awaitable[Optional[Buffer]]:
        """Coroutine twin of ``unpublish``."""
    def register(self, obj: Sendable, *, writable: bool = False) -> bytes:
        """Registers ``obj`` as a region peers ``read`` (and, ``writable``, ``write``) until
        ``unregister``; its 24-byte key, to give the peer. Taken as ``publish`` takes it."""
    def unregister(self, key: bytes, *, timeout: Optional[float] = None) -> Optional[Buffer]:
        """Ends a region once no peer reads it; returns what ``unpublish`` would."""
    def read(
        self,
        peer: str,
        remote: bytes,
        local: bytes,
        *,
        remote_blocks: Optional[List[Tuple[int, int]]] = None,
        local_blocks: Optional[List[Tuple[int, int]]] = None,
        notify: Optional[Tuple[int, bytes]] = None,
        timeout: Optional[float] = None,
    ) -> str:
        """Reads blocks of ``peer``'s region into places of ours; the transport's name."""
    def aread(
        self,
        peer: str,
        remote: bytes,
        local: bytes,
        *,
        remote_blocks: Optional[List[Tuple[int, int]]] = None,
        local_blocks: Optional[List[Tuple[int, int]]] = None,
        notify: Optional[Tuple[int, bytes]] = None,
        timeout: Optional[float] = None,
    ) -> Awaitable[str]:
        """Coroutine twin of ``read``."""
    def write(
        self,
        peer: str,
        local: bytes,
        remote: bytes,
        *,
        local_blocks: Optional[List[Tuple[int, int]]] = None,
        remote_blocks: Optional[List[Tuple[int, int]]] = None,
        notify: Optional[Tuple[int, bytes]] = None,
        timeout: Optional[float] = None,
    ) -> None:
        """Writes blocks of our region into places of ``peer``'s (registered writable)."""
    def awrite(
        self,
        peer: str,
        local: bytes,
        remote: bytes,
        *,
        local_blocks: Optional[List[Tuple[int, int]]] = None,
        remote_blocks: Optional[List[Tuple[int, int]]] = None,
        notify: Optional[Tuple[int, bytes]] = None,
        timeout: Optional[float] = None,
    ) -> Awaitable[None]:
        """Coroutine twin of ``write``."""
    def publication(self, key: str) -> Optional[PublicationStats]:
        """What ``key`` has served while published here, or ``None``."""
    def published_keys(self) -> List[str]:
        """The keys this node publishes now, sorted."""
    def fetch(
        self,
        peer: str,
        key: str,
        *,
        rows: Optional[int] = None,
        row_bytes: Optional[int] = None,
        pitch: Optional[int] = None,
        depth: Optional[int] = None,
        plane_rows: Optional[int] = None,
        blocks: Optional[List[Tuple[int, int]]] = None,
        into: Optional[MemoryKindName] = None,
        shared: bool = False,
        timeout: Optional[float] = None,
    ) -> Buffer:
        """What ``peer`` published under ``key`` (or the blocks / rows named, packed);
        concurrent fetches of one key and layout share one transfer."""
    def afetch(
        self,
        peer: str,
        key: str,
        *,
        rows: Optional[int] = None,
        row_bytes: Optional[int] = None,
        pitch: Optional[int] = None,
        depth: Optional[int] = None,
        plane_rows: Optional[int] = None,
        blocks: Optional[List[Tuple[int, int]]] = None,
        into: Optional[MemoryKindName] = None,
        shared: bool = False,
        timeout: Optional[float] = None,
    ) -> Awaitable[Buffer]:
        """Coroutine twin of ``fetch``."""
    def fetch_stats(self) -> FetchStats:
        """This node's fetch counters."""
    def alloc(self, kind: MemoryKindName, nbytes: int) -> Buffer:
        """``nbytes`` of ``kind`` memory from ferry's pool, to fill in place and send."""
    def explain(
        self, peer: str, nbytes: int, src: MemoryClassName = "host", dst: Optional[MemoryClassName] = None
    ) -> Explanation:
        """How a transfer would be routed, and why."""
    def memory(self, kind: Optional[MemoryKindName] = None) -> Any:
        """``Dict[str, MemoryStats]`` by domain, or one ``MemoryStats`` with ``kind``."""
    def connect(self, peer: str) -> None:
        """Connects to ``peer`` now."""
    def connected_peers(self) -> List[str]:
        """Peers with a live link."""
    def close(self) -> None:
        """Stops the node; idempotent."""
    def __enter__(self) -> Node: ...
    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool: ...

def _error_kinds() -> List[str]: ...
def _refusal_reasons() -> List[str]: ...

__all__ = ["Node", "Buffer"]
