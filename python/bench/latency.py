"""8 B one-way latency from Python, to set beside ``ferry bench -b 8 -e 8 --pingpong``,
and what the host copy of ``send(numpy_array)`` costs at 64 MiB.

    python bench/latency.py [--ferry PATH_TO_FERRY_BINARY] [--count N]

A ``ferry serve --role echo`` process (the Rust binary) sends every buffer back; this
process sends 8 bytes, waits for them to come back, and records half of each round trip,
as the Rust bench does. Three ways: ``send`` of a ``bytes`` object (one copy into ferry's
pool), ``send`` of a ``ferry.Buffer`` re-sent as received (no copy), and ``asend`` /
``arecv`` on an asyncio loop. Then the time of ``send`` (until the peer holds every byte)
for a 64 MiB numpy array (copied once into ferry's pool) against a 64 MiB ``ferry.Buffer``
from ``alloc`` (no copy), and a plain 64 MiB numpy copy for scale.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time

import ferry


def secret(directory: str) -> str:
    path = os.path.join(directory, "secret")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"bench secret, long enough 0123456789")
    os.close(fd)
    return path


def config(name: str, secret_file: str, peer: str = "") -> str:
    text = (
        f'[node]\nname = "{name}"\nlisten = ["127.0.0.1:0"]\n'
        f'[security]\nsecret_file = "{secret_file}"\n'
    )
    if peer:
        text += f'[[peers]]\nname = "echo"\naddress = "{peer}"\n'
    return text


def summary(label: str, samples: list) -> None:
    samples.sort()
    n = len(samples)
    print(
        f"{label:<34} p50 {samples[n // 2]:7.1f} us   p99 {samples[n * 99 // 100]:7.1f} us   "
        f"mean {sum(samples) / n:7.1f} us"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ferry", default="target/release/ferry")
    parser.add_argument("--count", type=int, default=20000)
    args = parser.parse_args()
    scratch = tempfile.mkdtemp(prefix="ferry-bench-")
    key = secret(scratch)
    echo_config = os.path.join(scratch, "echo.toml")
    with open(echo_config, "w") as f:
        f.write(config("echo", key))
    echo = subprocess.Popen(
        [args.ferry, "serve", "--config", echo_config, "--role", "echo"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "RUST_LOG": "warn"},
    )
    try:
        ready = echo.stdout.readline()
        address = ready.split("tcp ")[1].split(",")[0].strip()
        with ferry.Node(config("py", key, address)) as node:
            node.connect("echo")
            payload = b"8 bytes!"
            for _ in range(2000):  # warm-up
                node.send("echo", 1, payload)
                node.recv("echo", 1)
            samples = []
            for _ in range(args.count):
                t = time.perf_counter()
                node.send("echo", 1, payload)
                node.recv("echo", 1)
                samples.append((time.perf_counter() - t) * 1e6 / 2)
            summary("send(bytes) + recv", samples)

            buffer = node.alloc("host", 8)
            samples = []
            for _ in range(args.count):
                t = time.perf_counter()
                node.send("echo", 2, buffer)
                buffer = node.recv("echo", 2)
                samples.append((time.perf_counter() - t) * 1e6 / 2)
            summary("send(ferry.Buffer) + recv", samples)

            async def pingpong() -> list:
                out = []
                for _ in range(args.count):
                    t = time.perf_counter()
                    await node.asend("echo", 3, payload)
                    await node.arecv("echo", 3)
                    out.append((time.perf_counter() - t) * 1e6 / 2)
                return out

            summary("asend + arecv (asyncio)", asyncio.run(pingpong()))

            import numpy as np

            size = 64 << 20
            array = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
            owned = node.alloc("host", size)
            np.frombuffer(owned, dtype=np.uint8)[:] = array
            timings = {"send(numpy 64 MiB): one copy": [], "send(ferry.Buffer 64 MiB): no copy": []}
            for _ in range(10):
                for label, obj in zip(timings, (array, owned)):
                    t = time.perf_counter()
                    node.send("echo", 4, obj)
                    timings[label].append((time.perf_counter() - t) * 1e3)
                    node.recv("echo", 4).release()
            target = np.empty_like(array)
            copies = []
            for _ in range(10):
                t = time.perf_counter()
                np.copyto(target, array)
                copies.append((time.perf_counter() - t) * 1e3)
            for label, ms in list(timings.items()) + [("numpy copy of 64 MiB", copies)]:
                ms.sort()
                print(f"{label:<34} p50 {ms[len(ms) // 2]:7.1f} ms  ({size / ms[len(ms) // 2] / 1e6:5.2f} GB/s)")
    finally:
        echo.kill()
        echo.wait()


if __name__ == "__main__":
    sys.exit(main())
