"""A peer killed while a transfer to it is in flight: the send fails with PeerLost within
about two seconds."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

import ferry
from conftest import start_peer


def test_killed_peer_fails_the_send_quickly(configs, node):
    peer = start_peer(configs, node)
    # Stopped, it takes no more bytes: a large send cannot complete.
    os.kill(peer.process.pid, signal.SIGSTOP)
    outcome = {}
    # Allocated here, not copied from Python bytes inside the thread: on a loaded machine
    # that copy alone can outlast the wait below, and a send that starts after the kill
    # fails as PeerUnreachable (the link is gone), not PeerLost.
    payload = node.alloc("host", 256 << 20)

    def send():
        try:
            node.send(peer.name, 1, payload, timeout=30.0)
            outcome["error"] = None
        except ferry.FerryError as e:
            outcome["error"] = e
            outcome["at"] = time.monotonic()

    thread = threading.Thread(target=send)
    thread.start()
    thread.join(timeout=0.5)
    assert thread.is_alive(), f"the send ended before the peer was killed: {outcome}"
    killed = time.monotonic()
    peer.process.kill()
    peer.process.wait()
    thread.join(timeout=10)
    assert not thread.is_alive()
    error = outcome["error"]
    assert isinstance(error, ferry.PeerLost), repr(error)
    assert error.peer == peer.name and peer.name in str(error)
    assert outcome["at"] - killed < 2.0
