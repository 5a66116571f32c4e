# NCCL send/recv GPU 0 -> GPU 1 between two processes (torch.distributed), timed the way
# nccl-tests does: a warm-up, then N sends, stream-synchronised, per-operation time.
import os, sys, time
import torch, torch.distributed as dist, torch.multiprocessing as mp

SIZES = [8, 4096, 1 << 20, 8 << 20, 64 << 20, 256 << 20, 1 << 30]

def run(rank):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device(f"cuda:{rank}"))
    for size in SIZES:
        buf = torch.empty(size, dtype=torch.uint8, device=f"cuda:{rank}")
        iters = 200 if size <= 1 << 20 else 20
        for phase in ("warm", "timed"):
            n = 10 if phase == "warm" else iters
            dist.barrier(); torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(n):
                if rank == 0:
                    dist.send(buf, 1)
                else:
                    dist.recv(buf, 0)
            torch.cuda.synchronize()
            dt = (time.perf_counter() - t) / n
        if rank == 1:
            print(f"nccl {size:>11} bytes: {dt*1e6:9.1f} us/op  {size/dt/1e9:8.2f} GB/s", flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(run, nprocs=2)
