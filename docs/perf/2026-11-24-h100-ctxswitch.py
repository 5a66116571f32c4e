# Two processes on GPU 0: B times 8-byte copies out of A's memory (IPC) while A does
# nothing, stream-ordered alloc/free, small copies, or spins on cuStreamQuery.
import multiprocessing as mp, time, sys, statistics

def exporter(conn, mode, stop):
    import cupy as cp
    rt = cp.cuda.runtime
    buf = cp.zeros(1 << 20, dtype=cp.uint8)
    conn.send(rt.ipcGetMemHandle(buf.data.ptr))
    s = cp.cuda.Stream(non_blocking=True)
    a = cp.zeros(8, dtype=cp.uint8); b = cp.zeros(8, dtype=cp.uint8)
    while not stop.is_set():
        if mode == "alloc":
            p = rt.mallocAsync(256, s.ptr); rt.freeAsync(p, s.ptr); s.synchronize()
        elif mode == "copy":
            rt.memcpyAsync(b.data.ptr, a.data.ptr, 8, rt.memcpyDeviceToDevice, s.ptr); s.synchronize()
        elif mode == "query":
            rt.streamQuery(s.ptr)
        if mode != "query":
            time.sleep(0.00005)

def importer(handle, n):
    return [one(handle, n, spin) for spin in (True, False)]

def one(handle, n, spin):
    import cupy as cp
    rt = cp.cuda.runtime
    global SRC
    if "SRC" not in globals():
        SRC = rt.ipcOpenMemHandle(handle)
    src = SRC
    dst = cp.zeros(8, dtype=cp.uint8)
    s = cp.cuda.Stream(non_blocking=True)
    out = []
    for i in range(n + 100):
        t = time.perf_counter()
        rt.memcpyAsync(dst.data.ptr, src, 8, rt.memcpyDeviceToDevice, s.ptr)
        if spin:
            while rt.streamQuery(s.ptr) != 0:
                pass
        else:
            s.synchronize()
        if i >= 100:
            out.append((time.perf_counter() - t) * 1e6)
    out.sort()
    return out[len(out) // 2], out[int(len(out) * 0.99)]

if __name__ == "__main__":
    mp.set_start_method("spawn")
    for mode in ["idle", "alloc", "copy", "query"]:
        parent, child = mp.Pipe()
        stop = mp.Event()
        p = mp.Process(target=exporter, args=(child, mode, stop)); p.start()
        handle = parent.recv()
        with mp.get_context("spawn").Pool(1) as pool:
            for spin, (p50, p99) in zip([True, False], pool.apply(importer, (handle, 2000))):
                print(f"exporter {mode:6s} wait {'spin' if spin else 'sync'}: 8 B copy p50 {p50:7.1f} us p99 {p99:7.1f} us", flush=True)
        stop.set(); p.join()
