"""torch tensors between two processes on GPU 0. Run with FERRY_GPU_TESTS=1 on a machine
with a GPU and torch; skipped otherwise, saying so."""

from __future__ import annotations

import gc

import pytest

from conftest import eventually, gpu_tests, start_peer
from peer import FETCH

reason = gpu_tests()
pytestmark = pytest.mark.skipif(reason is not None, reason=reason or "")

import ferry  # noqa: E402

DEVICE_NODE = '[gpu]\ndevices = [0]\n\n[memory]\nreceive_into = "device"\n'


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


@pytest.fixture
def gpu_node(configs):
    with ferry.Node(configs.toml("test", extra=DEVICE_NODE)) as node:
        yield node


def test_a_torch_tensor_goes_and_comes_back_on_gpu0(torch, configs, gpu_node):
    peer = start_peer(configs, gpu_node, extra=DEVICE_NODE)
    try:
        for tag, n in enumerate([1, 4096, (16 << 20) + 7]):
            tensor = torch.arange(n, dtype=torch.int32, device="cuda:0")
            gpu_node.send(peer.name, tag, tensor)  # registered in place, no copy
            got = gpu_node.recv(peer.name, tag, timeout=30.0)
            assert got.kind == "cuda:0" and got.device == 0 and not got.spilled
            assert got.nbytes == tensor.numel() * 4
            back = torch.from_dlpack(got).view(torch.int32)
            assert back.device == tensor.device
            assert torch.equal(back, tensor)
    finally:
        peer.stop(gpu_node)


def test_a_torch_consumer_keeps_a_device_buffer(torch, configs, gpu_node):
    peer = start_peer(configs, gpu_node, extra=DEVICE_NODE)
    try:
        gpu_node.send(peer.name, 1, torch.full((1 << 20,), 3, dtype=torch.uint8, device="cuda:0"))
        got = gpu_node.recv(peer.name, 1, timeout=30.0)
        held = torch.from_dlpack(got)
        del got
        gc.collect()
        assert gpu_node.memory("cuda:0")["granted"] >= 1 << 20
        assert int(held.sum()) == 3 << 20
        del held
        gc.collect()
        assert eventually(lambda: gpu_node.memory("cuda:0")["granted"] == 0)
    finally:
        peer.stop(gpu_node)


def test_an_allocated_device_buffer_is_filled_through_dlpack(torch, configs, gpu_node):
    peer = start_peer(configs, gpu_node, extra=DEVICE_NODE)
    try:
        buf = gpu_node.alloc("cuda:0", 1024)
        view = torch.from_dlpack(buf)
        view.fill_(5)
        del view
        gpu_node.send(peer.name, 2, buf)
        got = gpu_node.recv(peer.name, 2, timeout=30.0)
        assert torch.from_dlpack(got).eq(5).all()
    finally:
        peer.stop(gpu_node)


def test_a_published_tensor_is_fetched_in_place_and_unpublished(torch, configs, gpu_node):
    peer = start_peer(configs, gpu_node, extra=DEVICE_NODE)
    try:
        tensor = torch.arange(1 << 20, dtype=torch.int32, device="cuda:0")
        gpu_node.publish("tensor", tensor)  # registered in place, no copy
        gpu_node.send(peer.name, FETCH, b"tensor")  # the peer fetches it, sends it back
        got = gpu_node.recv(peer.name, FETCH, timeout=30.0)
        assert got.kind == "cuda:0"
        assert torch.equal(torch.from_dlpack(got).view(torch.int32), tensor)
        assert gpu_node.publication("tensor")["served"] == 1
        # Unregistered once no peer reads it: the tensor is the caller's alone again.
        assert gpu_node.unpublish("tensor", timeout=30.0) is None
    finally:
        peer.stop(gpu_node)
