"""A prefill process hands a request's KV cache to a decode process, layer by layer.

    python kv_cache.py          # numpy, host memory
    python kv_cache.py --gpu    # torch tensors on GPU 0: sent in place, received on the GPU
"""

import multiprocessing as mp
import sys

import numpy as np

import ferry
from _setup import config, secret_file

LAYERS, SHAPE = 4, (2, 8, 512, 64)  # per layer: K and V, heads, tokens, head dim


def decode(secret: str, prefill_address: str, gpu: bool, sent) -> None:
    where = "device" if gpu else "host"
    with ferry.Node(config("decode", secret, ("prefill", prefill_address), where)) as node:
        node.send("prefill", 0, b"ready")  # opens the link; prefill can now send to us
        for layer in range(LAYERS):
            got = node.recv("prefill", 1 + layer, timeout=30.0)
            if gpu:
                import torch

                kv = torch.from_dlpack(got).view(torch.float16).view(SHAPE)  # stays on the GPU
            else:
                kv = np.frombuffer(got, dtype=np.float16).reshape(SHAPE)  # no copy
            print(f"decode: layer {layer} {tuple(kv.shape)} in {got.kind} via {got.transport}"
                  f"{' (spilled)' if got.spilled else ''}, mean {float(kv.float().mean() if gpu else kv.mean()):.1f}")
        sent.wait(30.0)  # close only after prefill's last send returned


def prefill(gpu: bool) -> None:
    secret = secret_file()
    with ferry.Node(config("prefill", secret)) as node:
        context = mp.get_context("spawn")
        sent = context.Event()
        worker = context.Process(target=decode, args=(secret, node.addresses[0], gpu, sent))
        worker.start()
        node.recv("decode", 0, timeout=30.0)
        for layer in range(LAYERS):
            if gpu:
                import torch

                kv = torch.full(SHAPE, layer, dtype=torch.float16, device="cuda:0")
            else:
                kv = np.full(SHAPE, layer, dtype=np.float16)
            node.send("decode", 1 + layer, kv)  # returns once decode holds every byte
        sent.set()
        worker.join()


if __name__ == "__main__":
    prefill(gpu="--gpu" in sys.argv)
