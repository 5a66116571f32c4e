"""Host memory between two Python processes: what can be sent, and what comes back."""

from __future__ import annotations

import array

import numpy as np
import pytest

import ferry
from conftest import Peer, eventually, granted


def round_trip(node: ferry.Node, echo: Peer, tag: int, obj) -> ferry.Buffer:
    node.send(echo.name, tag, obj)
    return node.recv(echo.name, tag, timeout=10.0)


@pytest.mark.parametrize(
    "array_",
    [
        np.zeros(0, dtype=np.uint8),
        np.array([7], dtype=np.uint8),
        np.arange(1024, dtype=np.float32),
        np.arange(3 * 5 * 7, dtype=np.int64).reshape(3, 5, 7),
        np.random.default_rng(1).standard_normal((1 << 20) + 3),
        np.random.default_rng(2).integers(0, 255, 16 << 20, dtype=np.uint8),
    ],
    ids=["0B", "1B", "4KiB-f32", "3d-i64", "8MiB-f64", "16MiB-u8"],
)
def test_numpy_arrays_come_back_byte_exact(node, echo, array_):
    got = round_trip(node, echo, 11, array_)
    assert got.peer == echo.name and got.tag == 11
    assert got.nbytes == array_.nbytes == len(got)
    assert got.kind == "host" and got.device is None and not got.spilled
    # Host memory between two processes of one host: shm, read in place.
    assert got.transport == "shm"
    back = np.frombuffer(got, dtype=array_.dtype).reshape(array_.shape)
    assert np.array_equal(back, array_)


def test_bytes_like_objects_are_sent(node, echo):
    for i, obj in enumerate(
        [b"plain bytes", bytearray(b"a bytearray"), memoryview(b"a memoryview"), array.array("i", [1, 2, 3])]
    ):
        got = round_trip(node, echo, 100 + i, obj)
        assert got.tobytes() == bytes(obj)


def test_dlpack_and_array_interface_sources(node, echo):
    source = np.arange(100, dtype=np.int16)

    class OnlyDlpack:
        """A host tensor known by DLPack alone, like a torch CPU tensor."""

        def __dlpack__(self, stream=None):
            return source.__dlpack__(stream=stream)

        def __dlpack_device__(self):
            return source.__dlpack_device__()

    class OnlyArrayInterface:
        __array_interface__ = source.__array_interface__

    for tag, obj in [(1, OnlyDlpack()), (2, OnlyArrayInterface())]:
        got = round_trip(node, echo, tag, obj)
        assert np.array_equal(np.frombuffer(got, dtype=np.int16), source)


def test_non_contiguous_and_unknown_objects_are_refused(node):
    strided = np.arange(100, dtype=np.float64)[::2]
    with pytest.raises(ferry.UsageError, match="C-contiguous"):
        node.send("anyone", 1, strided)
    with pytest.raises(ferry.UsageError, match="cannot send a object"):
        node.send("anyone", 1, object())


def test_an_allocated_buffer_is_filled_in_place_and_sent_without_copy(node, echo):
    buf = node.alloc("host", 4096)
    assert buf.kind == "host" and buf.peer is None and buf.tag is None
    view = np.frombuffer(buf, dtype=np.uint32)
    view[:] = np.arange(1024, dtype=np.uint32)
    del view
    node.send(echo.name, 5, buf)
    # The buffer came back to its object: it can be read, changed and sent again.
    assert np.array_equal(np.frombuffer(buf, dtype=np.uint32), np.arange(1024, dtype=np.uint32))
    got = node.recv(echo.name, 5, timeout=10.0)
    assert np.array_equal(np.frombuffer(got, dtype=np.uint32), np.arange(1024))
    # A received buffer is forwarded as it is, too.
    np.asarray(got)[:4] = 9
    node.send(echo.name, 6, got)
    again = node.recv(echo.name, 6, timeout=10.0)
    assert again.tobytes()[:4] == b"\x09" * 4


def test_send_layout_sends_rows_and_says_how_they_lay(node, echo):
    matrix = np.arange(8 * 16, dtype=np.uint8).reshape(8, 16)
    node.send_layout(echo.name, 3, matrix, rows=8, row_bytes=4, pitch=16)
    got = node.recv(echo.name, 3, timeout=10.0)
    # The echo forwards the packed rows without a layout; check the packed bytes.
    assert np.array_equal(np.frombuffer(got, dtype=np.uint8).reshape(8, 4), matrix[:, :4])


def test_received_layout_is_reported(configs):
    with ferry.Node(configs.toml("a")) as a:
        with ferry.Node(configs.toml("b", peers=(("a", a.addresses[0]),))) as b:
            matrix = np.arange(4 * 10, dtype=np.uint8).reshape(4, 10)
            b.send_layout("a", 9, matrix, rows=4, row_bytes=3, pitch=10)
            got = a.recv("b", 9, timeout=10.0)
            assert got.layout == {"rows": 4, "row_bytes": 3, "pitch": 10}
            assert np.array_equal(np.asarray(got).reshape(4, 3), matrix[:, :3])


def test_send_layout_sends_blocks_packed_in_their_order(node, echo):
    pool = np.arange(256, dtype=np.uint8)
    # Pages of a pool in any order; the first two overlap (read twice, harmless).
    blocks = [(200, 16), (0, 8), (4, 8), (100, 1)]
    node.send_layout(echo.name, 4, pool, blocks=blocks)
    got = node.recv(echo.name, 4, timeout=10.0)
    want = np.concatenate([pool[o : o + n] for o, n in blocks])
    assert np.array_equal(np.frombuffer(got, dtype=np.uint8), want)


def test_send_layout_of_a_host_array_moves_only_the_blocks_it_names(configs):
    # A 64 MiB array and a 16 MiB host budget: copying the array whole into ferry's pool
    # (as before) cannot fit; the blocks near its start can.
    array = np.zeros(64 << 20, dtype=np.uint8)
    blocks = [(1 << 20, 4096), (0, 4096), (3 << 20, 100)]
    for i, (at, n) in enumerate(blocks):
        array[at : at + n] = i + 1
    with ferry.Node(configs.toml("a")) as a:
        extra = '[memory]\nhost = "16 MiB"'
        with ferry.Node(configs.toml("b", peers=(("a", a.addresses[0]),), extra=extra)) as b:
            b.send_layout("a", 5, array, blocks=blocks)
            got = a.recv("b", 5, timeout=10.0)
            want = np.concatenate([array[o : o + n] for o, n in blocks])
            assert np.array_equal(np.asarray(got), want)
            assert b.memory("host")["granted"] == 0


def test_received_block_list_is_reported(configs):
    with ferry.Node(configs.toml("a")) as a:
        with ferry.Node(configs.toml("b", peers=(("a", a.addresses[0]),))) as b:
            pool = np.arange(64, dtype=np.uint8)
            b.send_layout("a", 10, pool, blocks=[(32, 4), (8, 2)])
            got = a.recv("b", 10, timeout=10.0)
            assert got.layout == {"blocks": [(32, 4), (8, 2)]}
            assert list(np.asarray(got)) == [32, 33, 34, 35, 8, 9]


def test_many_round_trips_give_every_byte_back(node, echo):
    for i in range(300):
        data = np.full(1 + (i * 7919) % 70000, i % 251, dtype=np.uint8)
        got = round_trip(node, echo, i, data)
        assert got.nbytes == data.nbytes and got.tobytes()[:1] == bytes([i % 251])
        del got
    assert eventually(lambda: granted(node) == 0), node.memory()


def test_explain_memory_and_peers(node, echo):
    explanation = node.explain(echo.name, 1 << 20)
    assert explanation["transport"] == "shm"
    assert explanation["locality"] == "same-host"
    assert "chose shm" in explanation["summary"]
    stats = node.memory()
    assert {"host", "pinned"} <= set(stats)
    assert set(stats["host"]) >= {"capacity", "granted", "free", "waiting"}
    assert echo.name in node.connected_peers()
    assert node.receive_into == "host"
