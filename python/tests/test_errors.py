"""Every error kind that can be provoked, raised as its own exception class."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

import ferry
from ferry import _ferry, errors
from conftest import start_peer


def test_every_rust_error_kind_has_its_class():
    kinds = set(_ferry._error_kinds())
    assert kinds == set(errors._BY_KIND), "a Rust ErrorKind without a Python class"
    for label, cls in errors._BY_KIND.items():
        assert issubclass(cls, ferry.FerryError) and cls.kind == label
    assert issubclass(ferry.DeadlineExceeded, TimeoutError)
    assert issubclass(ferry.PeerLost, ConnectionError)
    assert issubclass(ferry.UsageError, ValueError)


def test_every_refusal_reason_is_listed():
    reasons = _ferry._refusal_reasons()
    assert set(reasons) == set(errors.REFUSAL_REASONS) and len(reasons) == len(set(reasons))
    assert {"unknown_key", "not_allowed"} <= set(reasons)


def test_config_errors_name_the_cause(configs, tmp_path):
    with pytest.raises(ferry.ConfigError, match="limits") as info:
        ferry.Node(configs.toml("a", extra="[limits]\nno_such_key = 1"))
    assert info.value.kind == "config" and not info.value.transient
    with pytest.raises(ferry.ConfigError):
        ferry.Node("this is not toml")
    loose = tmp_path / "loose-secret"
    loose.write_text("a secret that others may read")
    os.chmod(loose, 0o644)
    text = configs.toml("a").replace(str(configs.secret), str(loose))
    with pytest.raises(ferry.ConfigError, match="loose-secret"):
        ferry.Node(text)
    with pytest.raises(ferry.ConfigError):
        ferry.Node(config_file=tmp_path / "missing.toml")
    with pytest.raises(ferry.UsageError):
        ferry.Node()


def test_a_dict_config_and_a_config_file_work(configs):
    as_dict = {
        "node": {"name": "d", "listen": ["127.0.0.1:0"]},
        "security": {"secret_file": configs.secret},
    }
    with ferry.Node(as_dict) as node:
        assert node.name == "d"
    with ferry.Node(config_file=configs.file("f")) as node:
        assert node.name == "f"


def test_start_error_when_the_port_is_taken(configs):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        text = configs.toml("a").replace("127.0.0.1:0", f"127.0.0.1:{port}")
        with pytest.raises(ferry.StartError, match=str(port)):
            ferry.Node(text)
    finally:
        taken.close()


def test_peer_unreachable(configs):
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    with ferry.Node(configs.toml("a", peers=(("gone", f"127.0.0.1:{port}"),))) as node:
        with pytest.raises(ferry.PeerUnreachable) as info:
            node.send("nobody", 1, b"x")
        assert "nobody" in str(info.value) and info.value.peer == "nobody"
        with pytest.raises(ferry.PeerUnreachable) as info:
            node.connect("gone")
        assert info.value.transient


def test_refused_too_large_names_the_reason(configs, node):
    echo = start_peer(configs, node, extra='[memory]\nhost = "1 MiB"')
    try:
        with pytest.raises(ferry.Refused) as info:
            node.send(echo.name, 1, bytes(2 << 20))
        assert info.value.reason == "too_large" and info.value.peer == echo.name
        assert "too large" in str(info.value)
    finally:
        echo.stop(node)


def test_deadline_exceeded(node):
    with pytest.raises(ferry.DeadlineExceeded) as info:
        node.recv(timeout=0.05)
    assert info.value.transient
    with pytest.raises(TimeoutError):
        node.recv("nobody", 3, timeout=0)


def test_no_route(configs):
    rules = '[[transport.rules]]\nname = "device-only"\nsrc = ["device"]\ntransports = ["ipc"]\n'
    with ferry.Node(configs.toml("a")) as a:
        with ferry.Node(configs.toml("b", peers=(("a", a.addresses[0]),), extra=rules)) as b:
            assert b.explain("a", 10)["transport"] is None
            with pytest.raises(ferry.NoRoute, match="no rule matches"):
                b.send("a", 1, b"bytes")


def test_queue_full_bounds_asynchronous_operations(configs):
    async def main(node):
        first = node.arecv(timeout=5.0)
        with pytest.raises(ferry.QueueFull) as info:
            node.arecv(timeout=5.0)
        assert info.value.transient
        first.cancel()

    with ferry.Node(configs.toml("a"), max_pending=1) as node:
        asyncio.run(main(node))


def test_no_memory_says_its_cause(configs):
    with ferry.Node(configs.toml("a", extra='[memory]\nhost = "1 MiB"')) as node:
        with pytest.raises(ferry.NoMemory) as info:
            node.alloc("host", 2 << 20)
        assert info.value.cause == "larger_than_budget"
        assert info.value.memory == "host" and info.value.nbytes == 2 << 20


def test_usage_errors(node):
    with pytest.raises(ferry.UsageError, match="layout"):
        node.send_layout("anyone", 1, bytes(100), rows=10, row_bytes=20, pitch=20)
    # Block lists are checked before anything moves, naming the block.
    with pytest.raises(ferry.UsageError, match="block 1 reaches byte 101"):
        node.send_layout("anyone", 1, bytes(100), blocks=[(0, 10), (90, 11)])
    with pytest.raises(ferry.UsageError, match="block 0 is empty"):
        node.send_layout("anyone", 1, bytes(100), blocks=[(5, 0)])
    with pytest.raises(ferry.UsageError, match="65537 blocks"):
        node.send_layout("anyone", 1, bytes(1 << 17), blocks=[(i, 1) for i in range(65537)])
    with pytest.raises(ferry.UsageError, match="not both"):
        node.send_layout("anyone", 1, bytes(100), blocks=[(0, 1)], rows=1, row_bytes=1, pitch=1)
    with pytest.raises(ferry.UsageError, match="needs blocks"):
        node.send_layout("anyone", 1, bytes(100), rows=1)
    with pytest.raises(ferry.UsageError, match="memory kind"):
        node.alloc("floppy", 10)


@pytest.mark.skipif(os.environ.get("FERRY_GPU_TESTS") == "1", reason="this machine has GPUs")
def test_unsupported_without_a_gpu(node):
    with pytest.raises(ferry.Unsupported, match="GPU 0"):
        node.alloc("cuda:0", 16)


def test_shutting_down_after_close(configs):
    node = ferry.Node(configs.toml("a"))
    node.close()
    assert node.closed
    with pytest.raises(ferry.ShuttingDown):
        node.recv(timeout=1.0)
    with pytest.raises(ferry.ShuttingDown):
        node.send("b", 1, b"x")
    node.close()  # twice: nothing happens


def test_close_wakes_a_waiting_receive(configs):
    import threading

    node = ferry.Node(configs.toml("a"))
    seen = []

    def wait():
        try:
            node.recv()
        except ferry.FerryError as e:
            seen.append(e)

    thread = threading.Thread(target=wait)
    thread.start()
    node.close()
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert isinstance(seen[0], ferry.ShuttingDown)
