"""Reference lifetimes: a received buffer stays put while a view or DLPack consumer holds
it, and goes back to the pool when the last one lets go."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import ferry
from conftest import eventually, granted, start_peer

SIZE = 1 << 20


def receive(node, echo, tag, fill):
    node.send(echo.name, tag, np.full(SIZE, fill, dtype=np.uint8))
    return node.recv(echo.name, tag, timeout=10.0)


def test_a_numpy_view_keeps_the_buffer(node, echo):
    got = receive(node, echo, 1, 1)
    view = np.asarray(got)
    del got
    gc.collect()
    assert granted(node) >= SIZE, "the view's memory went back to the pool"
    # More traffic while the view is held: its bytes are never reused.
    for i in range(20):
        del_me = receive(node, echo, 100 + i, 200)
        del del_me
    assert (view == 1).all()
    del view
    assert eventually(lambda: granted(node) == 0), node.memory("host")


def test_a_dlpack_consumer_keeps_the_buffer(node, echo):
    got = receive(node, echo, 2, 2)
    consumer = np.from_dlpack(got)
    del got
    gc.collect()
    for i in range(20):
        other = receive(node, echo, 200 + i, 100)
        del other
    assert granted(node) >= SIZE
    assert (consumer == 2).all() and consumer.shape == (SIZE,)
    del consumer
    assert eventually(lambda: granted(node) == 0), node.memory("host")


def test_an_unconsumed_capsule_gives_the_buffer_back(node, echo):
    got = receive(node, echo, 3, 3)
    capsule = got.__dlpack__()
    versioned = got.__dlpack__(max_version=(1, 0))
    del got, capsule, versioned
    gc.collect()
    assert eventually(lambda: granted(node) == 0), node.memory("host")


def test_a_buffer_with_views_is_neither_sent_nor_released(node, echo):
    got = receive(node, echo, 4, 4)
    view = memoryview(got)
    with pytest.raises(ferry.UsageError, match="live view"):
        node.send(echo.name, 5, got)
    with pytest.raises(ferry.UsageError, match="live view"):
        got.release()
    view.release()
    got.release()
    assert got.released
    with pytest.raises(BufferError):
        memoryview(got)
    with pytest.raises(ferry.UsageError):
        node.send(echo.name, 5, got)
    assert eventually(lambda: granted(node) == 0)


def test_with_block_releases_at_its_end(node, echo):
    with receive(node, echo, 6, 6) as got:
        assert got.tobytes()[:1] == b"\x06"
        assert granted(node) >= SIZE
    assert got.released
    assert eventually(lambda: granted(node) == 0)


def test_dlpack_device_and_refusals(node, echo):
    got = receive(node, echo, 7, 7)
    assert got.__dlpack_device__() == (1, 0)
    with pytest.raises(BufferError):
        got.__dlpack__(copy=True)
    with pytest.raises(BufferError):
        got.__dlpack__(dl_device=(2, 0))


def test_kept_memory_is_reported_and_goes_back_once_unused(configs):
    """A received buffer's memory, dropped, is kept for the next receive of its size, shows
    as ``kept`` and goes back once unused for ``memory.keep_idle``. (Heap memory: with shm
    on, host memory comes from its pool, which takes a dropped buffer back at once.)"""
    extra = '[memory]\nkeep_idle = "300ms"\n\n[transport.shm]\nenabled = false\n'
    with ferry.Node(configs.toml("test", extra=extra)) as node:
        peer = start_peer(configs, node)
        try:
            got = receive(node, peer, 7, 7)
            del got
            gc.collect()
            # The peer's echo and the node's own send both dropped a 1 MiB buffer.
            assert eventually(lambda: node.memory("host")["kept"] >= SIZE, 1.0), node.memory()
            assert eventually(lambda: node.memory("host")["kept"] == 0), node.memory()
            again = receive(node, peer, 8, 8)
            assert again.tobytes()[:1] == b"\x08"
            del again
        finally:
            peer.stop(node)
        assert {"kept", "reused"} <= set(node.memory("host"))
