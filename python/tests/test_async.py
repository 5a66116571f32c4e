"""The asyncio flavour: asend and arecv on a running event loop."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import ferry


def test_concurrent_asend_and_arecv(node, echo):
    async def main():
        arrays = [np.full(1000 + i, i, dtype=np.uint16) for i in range(50)]
        await asyncio.gather(*(node.asend(echo.name, i, a) for i, a in enumerate(arrays)))
        got = await asyncio.gather(*(node.arecv(echo.name, i, timeout=10.0) for i in range(50)))
        for i, buffer in enumerate(got):
            assert buffer.tag == i
            assert np.array_equal(np.frombuffer(buffer, dtype=np.uint16), arrays[i])

    asyncio.run(main())


def test_arecv_timeout_and_cancel_lose_nothing(node, echo):
    async def main():
        with pytest.raises(ferry.DeadlineExceeded):
            await node.arecv(echo.name, 77, timeout=0.05)
        waiting = asyncio.ensure_future(node.arecv(echo.name, 78))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        # Sent after the cancelled receive: the next receive gets it.
        await node.asend(echo.name, 78, b"after the cancel")
        got = await node.arecv(echo.name, 78, timeout=10.0)
        assert got.tobytes() == b"after the cancel"

    asyncio.run(main())


def test_async_errors_are_raised_by_await(node):
    async def main():
        with pytest.raises(ferry.PeerUnreachable):
            await node.asend("nobody", 1, b"x")

    asyncio.run(main())


def test_outside_an_event_loop_is_an_error(node):
    with pytest.raises(RuntimeError):
        node.arecv()
