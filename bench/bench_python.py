#!/usr/bin/env python3
"""cubuf from Python against the raw driver, the C library, cuda.core and CuPy, in one run.

    python3 bench/bench_python.py [--iterations N]

with cubuf importable (pip-installed, or PYTHONPATH=BUILD/python). Each row
prints cubuf's time per operation next to the raw driver's (a C loop in the
same process) and, where installed, cuda.core's and CuPy's, with the ratios.
Rows: allocate + close of 4 KiB over the device's default pool (also against
the C library's own allocate + close pair), copy and fill of 4 KiB on a
stream, a VMM grow step, and DLPack export + torch.from_dlpack (then its two
parts: torch's current-stream query and the capsule exchange alone). Times are
the best of several repeats, in microseconds. Needs a GPU.
"""
import argparse
import gc
import time

import cubuf

KIB4 = 4096


def best(fn, iterations, repeats=5):
    """Best time per iteration of fn(iterations) (which runs the loop itself), in us."""
    fn(max(1, iterations // 10))  # warm up
    times = []
    for _ in range(repeats):
        gc.disable()
        t0 = time.perf_counter_ns()
        fn(iterations)
        times.append((time.perf_counter_ns() - t0) / iterations / 1000)
        gc.enable()
    return min(times)


def optional(name, make):
    try:
        return make(), ""
    except Exception as e:  # not installed, or no GPU for it: the row says so
        return None, f"{name}: n/a ({type(e).__name__}: {str(e).splitlines()[0][:60]})"


def row(name, cubuf_us, others):
    parts = [f"{name:<34} cubuf {cubuf_us:8.3f} us"]
    for label, us, note in others:
        if us is None:
            parts.append(note)
        else:
            parts.append(f"{label} {us:8.3f} us (cubuf/{label} {cubuf_us / us:5.2f}x)")
    print("  ".join(parts), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=20000)
    n = ap.parse_args().iterations
    stream = cubuf.Stream(0)
    raw = cubuf._cubuf._bench_raw

    core, core_note = optional("cuda.core", lambda: __import__("cuda.core", fromlist=["Device"]))
    cdev = cstream = None
    if core:
        try:
            cdev = core.Device(0)
            cdev.set_current()
            cstream = cdev.create_stream()
        except Exception as e:
            core, core_note = None, f"cuda.core: n/a ({e})"
    cp, cp_note = optional("cupy", lambda: __import__("cupy"))
    print(f"cubuf {cubuf.__version__}, driver {cubuf.driver_version()}, {n} iterations; "
          f"cuda.core {getattr(core, '__version__', '-')}, cupy {getattr(cp, '__version__', '-')}")

    # ---- allocate + close, 4 KiB, the device's default pool ----------------------
    mr = cubuf.DeviceMemoryResource(0)

    def cubuf_alloc(k):
        alloc = mr.allocate
        for _ in range(k):
            alloc(KIB4, stream).close()
    py = best(cubuf_alloc, n)
    c_pair = min(cubuf._cubuf._bench_c_alloc_close(mr, KIB4, n, stream) for _ in range(5)) / 1000
    drv = min(raw("alloc_free", KIB4, n, stream, 0) for _ in range(5)) / 1000
    others = [("driver", drv, ""), ("C", c_pair, "")]
    if core:
        cmr = core.DeviceMemoryResource(0)

        def core_alloc(k):
            for _ in range(k):
                cmr.allocate(KIB4, stream=cstream).close()
        others.append(("cuda.core", best(core_alloc, n), ""))
    else:
        others.append(("cuda.core", None, core_note))
    if cp:
        pool = cp.cuda.MemoryPool()

        def cupy_alloc(k):
            malloc = pool.malloc
            for _ in range(k):
                p = malloc(KIB4)
                del p
        others.append(("cupy", best(cupy_alloc, n), ""))
    else:
        others.append(("cupy", None, cp_note))
    row("allocate + close 4 KiB", py, others)
    print(f"{'':<34} Python layer over the C pair: {(py - c_pair) * 1000:+.0f} ns per allocate + close")

    # ---- copy and fill, 4 KiB, on a stream ---------------------------------------------
    a, b = mr.allocate(KIB4, stream), mr.allocate(KIB4, stream)

    def cubuf_copy(k):
        copy = b.copy_from
        for _ in range(k):
            copy(a, stream=stream)
        stream.sync()

    def cubuf_fill(k):
        fill = a.fill
        for _ in range(k):
            fill(7, stream=stream)
        stream.sync()
    for name, fn, kind in (("copy 4 KiB (device to device)", cubuf_copy, "memcpy"),
                           ("fill 4 KiB", cubuf_fill, "memset")):
        others = [("driver", min(raw(kind, KIB4, n, stream, 0) for _ in range(5)) / 1000, "")]
        if core:
            cmr = core.DeviceMemoryResource(0)
            ca, cb = cmr.allocate(KIB4, stream=cstream), cmr.allocate(KIB4, stream=cstream)

            def core_op(k, kind=kind, ca=ca, cb=cb):
                for _ in range(k):
                    if kind == "memcpy":
                        cb.copy_from(ca, stream=cstream)
                    else:
                        ca.fill(7, stream=cstream)
                cstream.sync()
            others.append(("cuda.core", best(core_op, n), ""))
            ca.close()  # here, while their stream lives (not at exit, where cuda.core warns)
            cb.close()
        else:
            others.append(("cuda.core", None, core_note))
        row(name, best(fn, n), others)
    stream.sync()
    a.close()
    b.close()

    # ---- a VMM grow step: modify_allocation by one granule, close the old buffer ---------
    vmr = cubuf.VirtualMemoryResource(0)
    g = vmr.granularity
    steps = min(n, 200)
    holder = [vmr.allocate(g)]

    def cubuf_grow(k):
        buf = holder[0]
        for _ in range(k):
            nxt = vmr.modify_allocation(buf, buf.size + g)
            buf.close()
            buf = nxt
            if buf.size >= 256 * g:  # start again, so each step grows a small buffer
                buf.close()
                buf = vmr.allocate(g)
        holder[0] = buf
    others = [("driver", None, "driver: see bench/bench_vmm (C)")]
    if core and hasattr(core, "VirtualMemoryResource"):
        try:
            cvmr = core.VirtualMemoryResource(0)
            cholder = [cvmr.allocate(g, stream=cstream)]

            def core_grow(k):
                buf = cholder[0]
                for _ in range(k):
                    nxt = cvmr.modify_allocation(buf, buf.size + g)
                    if nxt is not buf:
                        buf.close()
                    buf = nxt
                    if buf.size >= 256 * g:
                        buf.close()
                        buf = cvmr.allocate(g, stream=cstream)
                cholder[0] = buf
            others.append(("cuda.core", best(core_grow, steps), ""))
        except Exception as e:
            others.append(("cuda.core", None, f"cuda.core: n/a ({type(e).__name__}: {e})"))
    else:
        others.append(("cuda.core", None, core_note or "cuda.core: n/a (no VirtualMemoryResource)"))
    row(f"VMM grow step (+{g >> 20} MiB)", best(cubuf_grow, steps), others)
    holder[0].close()

    # ---- DLPack export + torch.from_dlpack ---------------------------------------------------
    torch, torch_note = optional("torch", lambda: __import__("torch"))
    if torch:
        buf = mr.allocate(KIB4)  # on the legacy default stream, torch's current stream: no handoff
        cubuf.default_stream().sync()

        def cubuf_dlpack(k):
            from_dlpack = torch.from_dlpack
            for _ in range(k):
                from_dlpack(buf)
        others = []
        tt = torch.empty(KIB4, dtype=torch.uint8, device="cuda")

        def torch_self(k):
            from_dlpack = torch.from_dlpack
            for _ in range(k):
                from_dlpack(tt)  # the same call on torch's own tensor: the consumer's floor
        others.append(("torch(tensor)", best(torch_self, n), ""))
        if core:
            cbuf = core.DeviceMemoryResource(0).allocate(KIB4, stream=cdev.default_stream)
            cdev.sync()

            def core_dlpack(k):
                from_dlpack = torch.from_dlpack
                for _ in range(k):
                    from_dlpack(cbuf)
            others.append(("cuda.core", best(core_dlpack, n), ""))
        else:
            others.append(("cuda.core", None, core_note))
        row("DLPack export + torch.from_dlpack", best(cubuf_dlpack, n), others)

        # What of that call is torch's own, whatever the producer: its current-stream query
        # (a new torch.cuda.Stream object each call) and the capsule's import.
        def torch_stream(k):
            current = torch.cuda.current_stream
            for _ in range(k):
                current("cuda:0")
        stream_query = best(torch_stream, n)

        def capsule_loop(x):  # the same exchange without torch's stream query
            def run(k):
                from_dlpack, export = torch.from_dlpack, x.__dlpack__
                for _ in range(k):
                    from_dlpack(export(stream=1, max_version=(1, 0)))
            return run
        try:
            capsule_others = [("cuda.core", best(capsule_loop(cbuf), n), "")] if core else []
            row("  capsule only (no stream query)", best(capsule_loop(buf), n), capsule_others)
        except Exception as e:  # a torch that takes no versioned capsule: the row says so
            print(f"{'  capsule only (no stream query)':<34} n/a ({type(e).__name__}: {e})")
        print(f"{'  torch.cuda.current_stream()':<34} {stream_query:8.3f} us: torch.from_dlpack(x) makes this "
              "query for every CUDA producer before it asks x for a capsule", flush=True)
        buf.close()
        if core:
            cbuf.close()
    else:
        print(f"{'DLPack export + torch.from_dlpack':<34} {torch_note}")
    stream.sync()


if __name__ == "__main__":
    main()
