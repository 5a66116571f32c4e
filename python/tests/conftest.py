"""Fixtures: secrets and configurations for nodes on loopback, and peer processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Tuple

import pytest

import ferry

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from peer import HELLO, STOP  # noqa: E402


def write_secret(path: Path, text: str = "correct horse battery staple 42") -> Path:
    """A secret file only its owner may read, as ferry demands."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


class Configs:
    """Writes node configurations that share one secret, in a scratch directory."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.secret = write_secret(directory / "secret")

    def toml(self, name: str, peers: Tuple[Tuple[str, str], ...] = (), extra: str = "") -> str:
        text = (
            f'[node]\nname = "{name}"\nlisten = ["127.0.0.1:0"]\n\n'
            f'[security]\nsecret_file = "{self.secret}"\n\n{extra}\n'
        )
        for peer, address in peers:
            text += f'[[peers]]\nname = "{peer}"\naddress = "{address}"\n\n'
        return text

    def file(self, name: str, peers: Tuple[Tuple[str, str], ...] = (), extra: str = "") -> Path:
        path = self.dir / f"{name}.toml"
        path.write_text(self.toml(name, peers, extra))
        return path


@pytest.fixture
def configs(tmp_path: Path) -> Configs:
    return Configs(tmp_path)


class Peer:
    """A ``peer.py`` echo node in a child process, greeting the node that started it."""

    def __init__(self, process: subprocess.Popen, name: str) -> None:
        self.process = process
        self.name = name

    def stop(self, node: ferry.Node) -> None:
        if self.process.poll() is None:
            try:
                node.send(self.name, STOP, b"")
                self.process.wait(timeout=10)
            except (ferry.FerryError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()


def start_peer(
    configs: Configs, node: ferry.Node, name: str = "peer", extra: str = ""
) -> Peer:
    """Starts an echo peer that knows `node`, and waits (10 s at most) for its greeting."""
    config = configs.file(name, peers=((node.name, node.addresses[0]),), extra=extra)
    process = subprocess.Popen(
        [sys.executable, str(HERE / "peer.py"), str(config), node.name],
        stdin=subprocess.DEVNULL,
    )
    try:
        hello = node.recv(name, HELLO, timeout=10.0)
    except BaseException:
        process.kill()
        process.wait()
        raise
    assert hello.tobytes() == b"hello"
    return Peer(process, name)


@pytest.fixture
def node(configs: Configs) -> Iterator[ferry.Node]:
    with ferry.Node(configs.toml("test")) as node:
        yield node


@pytest.fixture
def echo(configs: Configs, node: ferry.Node) -> Iterator[Peer]:
    peer = start_peer(configs, node)
    yield peer
    peer.stop(node)


def eventually(check: Callable[[], bool], limit: float = 5.0) -> bool:
    """Waits until `check()` holds, polling every 10 ms, for `limit` seconds at most."""
    deadline = time.monotonic() + limit
    while True:
        if check():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


def granted(node: ferry.Node, kind: str = "host") -> int:
    return node.memory(kind)["granted"]


def gpu_tests() -> Optional[str]:
    """Why GPU tests skip, or None when FERRY_GPU_TESTS=1 asks for them."""
    if os.environ.get("FERRY_GPU_TESTS") != "1":
        return "GPU tests run with FERRY_GPU_TESTS=1 (on a machine with a GPU and torch)"
    return None


__all__: List[str] = ["Configs", "Peer", "start_peer", "eventually", "granted", "gpu_tests"]
