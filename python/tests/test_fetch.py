"""Publish and fetch: a node publishes buffers under keys, its peers fetch them by key; the
fetches of one key on one node share one transfer (single flight)."""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Iterator, List, Tuple

import numpy as np
import pytest

import ferry
from conftest import Configs, eventually, granted
from peer import FETCH

#: The fetcher's host budget in the single-flight test (see there).
BUDGET = 16 << 20


@pytest.fixture
def pair(configs: Configs) -> Iterator[Tuple[ferry.Node, ferry.Node]]:
    """Two nodes on loopback: ``a`` publishes, ``b`` (which knows ``a``) fetches."""
    extra = f'[memory]\nhost = "{BUDGET >> 20} MiB"\n'
    with ferry.Node(configs.toml("a")) as a:
        with ferry.Node(configs.toml("b", peers=(("a", a.addresses[0]),), extra=extra)) as b:
            yield a, b


def test_concurrent_fetches_of_one_key_cross_the_link_once(pair):
    a, b = pair
    data = np.random.default_rng(7).integers(0, 255, 1 << 20, dtype=np.uint8)
    a.publish("weights", data)
    # The flight must not land before every caller joined it: the fetcher's whole budget is
    # held, so the transfer waits for memory at b until the 8 callers sit in its flight.
    # (Sized for 8 buffers of the fetchers' own plus the landing, which stays until every
    # caller took its copy.)
    hold = b.alloc("host", BUDGET)
    got: List[object] = [None] * 8

    def fetch(i: int) -> None:
        try:
            got[i] = b.fetch("a", "weights", timeout=30.0)
        except BaseException as e:  # noqa: BLE001 - reported by the assertions below
            got[i] = e

    threads = [threading.Thread(target=fetch, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    try:
        assert eventually(lambda: b.fetch_stats()["fetches"] == 8, limit=10.0), b.fetch_stats()
    finally:
        hold.release()
        for thread in threads:
            thread.join(timeout=30.0)
    assert all(isinstance(g, ferry.Buffer) for g in got), got
    for buffer in got:
        assert buffer.tobytes() == data.tobytes()
        assert buffer.peer == "a" and buffer.key == "weights" and buffer.tag is None
        assert buffer.transport == "shm" and buffer.kind == "host" and not buffer.spilled
    assert sorted(buffer.joined for buffer in got) == [False] + [True] * 7
    assert a.publication("weights")["served"] == 1
    stats = b.fetch_stats()
    assert stats["joined"] == 7 and stats["flights"] == 1 and stats["fetches"] == 8
    assert stats["bytes_saved"] == 7 * data.nbytes
    # Each caller holds a buffer of its own: writing one leaves the others alone.
    np.asarray(got[0])[:] = 0
    assert got[1].tobytes() == data.tobytes()


def test_a_block_list_is_fetched_packed(pair):
    a, b = pair
    pool = np.arange(256, dtype=np.uint8)
    a.publish("pool", pool)
    blocks = [(200, 16), (0, 8), (4, 8), (100, 1)]
    got = b.fetch("a", "pool", blocks=blocks, timeout=10.0)
    want = np.concatenate([pool[o : o + n] for o, n in blocks])
    assert np.array_equal(np.asarray(got), want)
    assert got.layout == {"blocks": blocks}
    assert not got.joined and got.key == "pool"
    # Rows at a pitch too, as send_layout takes them.
    rows = b.fetch("a", "pool", rows=4, row_bytes=3, pitch=64, timeout=10.0)
    assert np.array_equal(np.asarray(rows).reshape(4, 3), pool.reshape(4, 64)[:, :3])
    assert rows.layout == {"rows": 4, "row_bytes": 3, "pitch": 64}
    # A layout that does not fit the published buffer: refused by the exporter, counted.
    with pytest.raises(ferry.UsageError, match="256 bytes"):
        b.fetch("a", "pool", blocks=[(250, 10)], timeout=10.0)
    assert a.publication("pool")["refused"] == 1
    with pytest.raises(ferry.UsageError, match="not both"):
        b.fetch("a", "pool", blocks=[(0, 1)], rows=1, row_bytes=1, pitch=1)


def test_an_unknown_key_is_refused_with_its_reason(pair):
    a, b = pair
    with pytest.raises(ferry.Refused) as info:
        b.fetch("a", "nothing-here", timeout=10.0)
    assert info.value.reason == "unknown_key" and info.value.peer == "a"
    assert "unknown key" in str(info.value) and "nothing-here" in str(info.value)
    assert not info.value.transient


def test_a_key_published_for_other_peers_is_refused(pair):
    a, b = pair
    a.publish("for-c", b"secret of c", peers=["c"])
    a.publish("for-b", b"for b alone", peers=["b"])
    with pytest.raises(ferry.Refused) as info:
        b.fetch("a", "for-c", timeout=10.0)
    assert info.value.reason == "not_allowed"
    assert a.publication("for-c")["refused"] == 1
    assert b.fetch("a", "for-b", timeout=10.0).tobytes() == b"for b alone"


def test_unpublish_gives_the_buffer_back(pair):
    a, b = pair
    buf = a.alloc("host", 4096)
    np.frombuffer(buf, dtype=np.uint32)[:] = np.arange(1024, dtype=np.uint32)
    a.publish("page", buf)
    # Published as it is: the object holds nothing meanwhile.
    assert buf.released
    with pytest.raises(ferry.UsageError, match="published"):
        a.send("b", 1, buf)
    assert a.published_keys() == ["page"]
    assert a.publication("page")["len"] == 4096
    got = b.fetch("a", "page", timeout=10.0)
    assert np.array_equal(np.frombuffer(got, dtype=np.uint32), np.arange(1024))
    back = a.unpublish("page", timeout=10.0)
    assert back is buf and not buf.released
    assert np.array_equal(np.frombuffer(buf, dtype=np.uint32), np.arange(1024))
    assert a.published_keys() == [] and a.publication("page") is None
    with pytest.raises(ferry.Refused) as info:
        b.fetch("a", "page", timeout=10.0)
    assert info.value.reason == "unknown_key"
    with pytest.raises(ferry.UsageError, match="nothing is published"):
        a.unpublish("page")
    # A bytes-like object is copied once: unpublish hands the copy over, as a Buffer.
    a.publish("copied", bytearray(b"0123456789"))
    copy = a.unpublish("copied")
    assert isinstance(copy, ferry.Buffer) and copy.tobytes() == b"0123456789"
    del copy, back, buf, got
    assert eventually(lambda: granted(a) == 0), a.memory("host")


def test_publishing_a_key_twice_is_refused(pair):
    a, _ = pair
    a.publish("once", b"first")
    with pytest.raises(ferry.UsageError, match="published already"):
        a.publish("once", b"second")
    # A ferry.Buffer refused goes back to its object.
    buf = a.alloc("host", 16)
    with pytest.raises(ferry.UsageError, match="published already"):
        a.publish("once", buf)
    assert not buf.released and buf.nbytes == 16
    with pytest.raises(ferry.UsageError, match="empty"):
        a.publish("", b"x")
    with pytest.raises(ferry.UsageError, match="1024 bytes"):
        a.publish("k" * 1025, b"x")
    # A buffer with a live view cannot be published (as it cannot be sent).
    view = memoryview(buf)
    with pytest.raises(ferry.UsageError, match="live view"):
        a.publish("viewed", buf)
    del view
    assert a.published_keys() == ["once"]
    assert a.unpublish("once").tobytes() == b"first"


def test_fetch_into_another_memory_kind_and_shared(pair):
    a, b = pair
    a.publish("k", b"x" * 1000)
    pinned = b.fetch("a", "k", into="pinned", timeout=10.0)
    assert pinned.kind == "pinned" and not pinned.spilled
    assert pinned.tobytes() == b"x" * 1000
    shared = b.fetch("a", "k", shared=True, timeout=10.0)
    assert shared.tobytes() == b"x" * 1000
    with pytest.raises(ferry.UsageError, match="memory kind"):
        b.fetch("a", "k", into="floppy")


def test_afetch_and_aunpublish(pair):
    a, b = pair

    async def main():
        buf = a.alloc("host", 1 << 16)
        np.asarray(buf)[:] = 3
        a.publish("async", buf)
        got = await asyncio.gather(*(b.afetch("a", "async", timeout=10.0) for _ in range(4)))
        for buffer in got:
            assert buffer.tobytes() == b"\x03" * (1 << 16) and buffer.key == "async"
        with pytest.raises(ferry.Refused) as info:
            await b.afetch("a", "missing", timeout=10.0)
        assert info.value.reason == "unknown_key"
        back = await a.aunpublish("async", timeout=10.0)
        assert back is buf and not buf.released
        with pytest.raises(ferry.UsageError):
            await a.aunpublish("async")

    asyncio.run(main())


def test_aunpublish_outside_an_event_loop_unpublishes_nothing(pair):
    a, _ = pair
    a.publish("stays", b"x")
    with pytest.raises(RuntimeError):
        a.aunpublish("stays")
    with pytest.raises(RuntimeError):
        a.afetch("a", "stays")
    assert a.published_keys() == ["stays"]


def test_a_peer_process_fetches_what_this_node_publishes(node, echo):
    data = np.random.default_rng(3).integers(0, 255, (4 << 20) + 5, dtype=np.uint8)
    node.publish("shared/model", data)
    node.send(echo.name, FETCH, b"shared/model")
    got = node.recv(echo.name, FETCH, timeout=20.0)
    assert got.tobytes() == data.tobytes()
    assert node.publication("shared/model")["served"] == 1
    node.send(echo.name, FETCH, b"no/such/key")
    assert node.recv(echo.name, FETCH, timeout=20.0).tobytes() == b"error: unknown_key"
    assert node.unpublish("shared/model", timeout=10.0).tobytes() == data.tobytes()


def test_close_ends_publications_and_fetches(configs):
    a = ferry.Node(configs.toml("a"))
    buf = a.alloc("host", 64)
    a.publish("k", buf)
    a.close()
    with pytest.raises(ferry.ShuttingDown):
        a.unpublish("k")
    with pytest.raises(ferry.ShuttingDown):
        a.fetch("b", "k")
    assert buf.released


@pytest.mark.skipif(os.environ.get("FERRY_GPU_TESTS") == "1", reason="this machine has GPUs")
def test_fetch_into_a_gpu_this_node_does_not_use(pair):
    a, b = pair
    a.publish("k", b"bytes")
    with pytest.raises(ferry.Unsupported, match="GPU 0"):
        b.fetch("a", "k", into="cuda:0")
