"""Registered regions and one-sided reads and writes: each node registers memory once, and
block lists move between the regions (scattered at both ends), with a notification after
the data; stale keys and read-only regions are refused with their reasons."""

from __future__ import annotations

import asyncio
from typing import Iterator, Tuple

import numpy as np
import pytest

import ferry
from conftest import Configs

PAGE = 4096
PAGES = 64


@pytest.fixture
def pair(configs: Configs) -> Iterator[Tuple[ferry.Node, ferry.Node]]:
    """Two nodes on loopback: ``b`` knows ``a``."""
    with ferry.Node(configs.toml("a")) as a:
        with ferry.Node(configs.toml("b", peers=(("a", a.addresses[0]),))) as b:
            yield a, b


def pool(node: ferry.Node, seed: int) -> Tuple[ferry.Buffer, np.ndarray]:
    """A host buffer of ferry's pool holding random pages, and a copy of its bytes."""
    buf = node.alloc("host", PAGE * PAGES)
    data = np.random.default_rng(seed).integers(0, 255, PAGE * PAGES, dtype=np.uint8)
    np.frombuffer(buf, dtype=np.uint8)[:] = data
    return buf, data


def pages(slots, shift: int = 0):
    return [(s * PAGE + shift, PAGE) for s in slots]


def test_blocks_are_read_and_written_between_regions(pair):
    a, b = pair
    abuf, adata = pool(a, 1)
    bbuf, bdata = pool(b, 2)
    # Region ids count from 1 on each node: one more on a, so that the keys differ (a
    # binding that swapped them would fail).
    spare = a.register(b"spare")
    akey = a.register(abuf, writable=True)
    bkey = b.register(bbuf, writable=True)
    assert isinstance(akey, bytes) and len(akey) == 24 and akey != bkey
    assert abuf.released
    # b reads scattered pages of a's region into other places of its own.
    there, here = pages([7, 3, 40, 11]), pages([0, 20, 5, 63])
    over = b.read("a", akey, bkey, remote_blocks=there, local_blocks=here, timeout=10.0)
    assert over in ("tcp", "shm"), over
    # b writes pages of its own into a's region, then a hears of it.
    mine, theirs = pages([1, 2]), pages([50, 9], shift=16)
    b.write("a", bkey, akey, local_blocks=mine, remote_blocks=theirs, notify=(7, b"done"), timeout=10.0)
    note = a.recv("b", 7, timeout=10.0)
    assert note.tobytes() == b"done"
    back = a.unregister(akey, timeout=10.0)
    assert back is abuf and not abuf.released
    want_a = adata.copy()
    for (src, n), (dst, _) in zip(mine, theirs):
        want_a[dst : dst + n] = bdata[src : src + n]
    assert np.array_equal(np.frombuffer(abuf, dtype=np.uint8), want_a)
    back = b.unregister(bkey, timeout=10.0)
    assert back is bbuf
    want_b = bdata.copy()
    for (src, n), (dst, _) in zip(there, here):
        want_b[dst : dst + n] = adata[src : src + n]
    assert np.array_equal(np.frombuffer(bbuf, dtype=np.uint8), want_b)
    assert a.unregister(spare, timeout=10.0).tobytes() == b"spare"


def test_stale_keys_and_read_only_regions_are_refused(pair):
    a, b = pair
    akey = a.register(b"x" * 8192)  # read-only; a copy in ferry's pool
    bkey = b.register(bytearray(8192), writable=True)
    with pytest.raises(ferry.Refused) as info:
        b.write("a", bkey, akey, local_blocks=[(0, 16)], remote_blocks=[(0, 16)], timeout=10.0)
    assert info.value.reason == "read_only"
    b.read("a", akey, bkey, timeout=10.0)
    back = a.unregister(akey, timeout=10.0)
    assert back.tobytes() == b"x" * 8192
    with pytest.raises(ferry.Refused) as info:
        b.read("a", akey, bkey, timeout=10.0)
    assert info.value.reason == "stale_key"
    with pytest.raises(ferry.UsageError, match="hold"):
        b.read("a", akey, bkey, remote_blocks=[(0, 16)], local_blocks=[(0, 17)])
    with pytest.raises(ferry.UsageError, match="24 bytes"):
        b.read("a", b"short", bkey)
    assert b.unregister(bkey, timeout=10.0).tobytes() == b"x" * 8192
    with pytest.raises(ferry.UsageError, match="not registered"):
        b.unregister(bkey)


def test_the_coroutine_twins(pair):
    a, b = pair
    abuf, adata = pool(a, 3)
    akey = a.register(abuf, writable=True)
    bkey = b.register(b.alloc("host", PAGE * PAGES), writable=True)

    async def main() -> str:
        got = await b.aread("a", akey, bkey, remote_blocks=pages([4]), local_blocks=pages([0]))
        await b.awrite("a", bkey, akey, local_blocks=pages([0]), remote_blocks=pages([9]))
        return got

    assert asyncio.run(main()) in ("tcp", "shm")
    back = np.frombuffer(a.unregister(akey, timeout=10.0), dtype=np.uint8)
    assert np.array_equal(back[9 * PAGE : 10 * PAGE], adata[4 * PAGE : 5 * PAGE])
    b.unregister(bkey, timeout=10.0)
