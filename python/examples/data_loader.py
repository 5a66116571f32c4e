"""A data loader ships batches to a trainer; a few sends stay in flight (asyncio), and the
trainer views each batch in place.

    python data_loader.py
"""

import asyncio
import multiprocessing as mp

import numpy as np

import ferry
from _setup import config, secret_file

BATCHES, BATCH, IMAGE = 32, 64, (3, 32, 32)
IN_FLIGHT = 4


def trainer(secret: str, loader_address: str, sent) -> None:
    with ferry.Node(config("trainer", secret, ("loader", loader_address))) as node:
        node.send("loader", 0, b"ready")
        seen = 0
        for step in range(BATCHES):
            images = np.frombuffer(node.recv("loader", 1 + step, timeout=30.0), dtype=np.uint8)
            labels = np.frombuffer(node.recv("loader", 10_000 + step, timeout=30.0), dtype=np.int64)
            images = images.reshape(BATCH, *IMAGE)
            assert (labels == step % 10).all() and images[0, 0, 0, 0] == step % 256
            seen += len(labels)
        print(f"trainer: {BATCHES} batches, {seen} samples")
        sent.wait(30.0)  # close only after the loader's last send returned (README, Python)


async def load(node: ferry.Node) -> None:
    slots = asyncio.Semaphore(IN_FLIGHT)

    async def ship(step: int) -> None:
        async with slots:
            images = np.full((BATCH, *IMAGE), step % 256, dtype=np.uint8)  # "decode" a batch
            labels = np.full(BATCH, step % 10, dtype=np.int64)
            await node.asend("trainer", 1 + step, images)
            await node.asend("trainer", 10_000 + step, labels)

    await asyncio.gather(*(ship(step) for step in range(BATCHES)))


def main() -> None:
    secret = secret_file()
    with ferry.Node(config("loader", secret)) as node:
        context = mp.get_context("spawn")
        sent = context.Event()
        worker = context.Process(target=trainer, args=(secret, node.addresses[0], sent))
        worker.start()
        node.recv("trainer", 0, timeout=30.0)
        asyncio.run(load(node))
        sent.set()
        worker.join()
        print(f"loader: host memory granted now {node.memory('host')['granted']} bytes")


if __name__ == "__main__":
    main()
