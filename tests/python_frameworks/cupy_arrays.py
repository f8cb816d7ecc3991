"""CuPy with cubuf as its allocator (CFunctionAllocator over cubuf_cupy_malloc
/ cubuf_cupy_free) computes the same bytes as with CuPy's own memory pool:
elementwise work, reductions, matrix products, sorts and FFTs over many
arrays allocated and freed in a loop. Each run is its own process.

usage: cupy_arrays.py LIBCUBUF  (exit 0 same results, 1 different, 77 skipped)
"""
import ctypes
import hashlib
import json
import os
import subprocess
import sys


PARTS = ("elementwise", "sort", "cumsum", "matmul", "fft")


def work(mode, lib):
    import cupy
    import numpy
    if mode == "cubuf":
        handle = ctypes.CDLL(lib)
        m = ctypes.cast(handle.cubuf_cupy_malloc, ctypes.c_void_p).value
        f = ctypes.cast(handle.cubuf_cupy_free, ctypes.c_void_p).value
        allocator = cupy.cuda.memory.CFunctionAllocator(0, m, f, handle)
        cupy.cuda.set_allocator(allocator.malloc)
    rng = numpy.random.default_rng(7)
    h = {part: hashlib.sha256() for part in PARTS}
    for i in range(200):
        n = int(rng.integers(1, 1 << 16))
        a = cupy.asarray(rng.standard_normal(n, dtype=numpy.float32))
        b = cupy.asarray(rng.standard_normal(n, dtype=numpy.float32))
        c = cupy.sin(a) * b + cupy.sqrt(cupy.abs(a))
        h["elementwise"].update(cupy.asnumpy(c).tobytes())
        h["sort"].update(cupy.asnumpy(cupy.sort(c)).tobytes())
        # An integer scan: CUB's float scan sums in an order that varies
        # from run to run (seen on the H200), an integer one is exact.
        h["cumsum"].update(cupy.asnumpy(cupy.cumsum((c * 4096).astype(cupy.int64))).tobytes())
        if i % 10 == 0:
            k = 64 + i
            x = cupy.asarray(rng.standard_normal((k, k)))
            h["matmul"].update(cupy.asnumpy(x @ x.T).tobytes())
            h["fft"].update(cupy.asnumpy(cupy.fft.fft(x[0])).tobytes())
        del a, b, c
    cupy.cuda.Device(0).synchronize()
    out = {"digest": {part: h[part].hexdigest() for part in PARTS}}
    if mode == "cubuf":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import cubuf_stats
        out["stats"] = cubuf_stats.read(lib, 0)
    print(json.dumps(out))


def main():
    if len(sys.argv) == 3:
        work(sys.argv[2], sys.argv[1])
        return 0
    lib = os.path.abspath(sys.argv[1])
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - no cupy or no device: skipped
        print("SKIP: cupy does not import or sees no device: %s" % e)
        return 77
    runs = {}
    # Native twice: a part whose results differ between two native runs is
    # not deterministic on this machine, and cannot tell anything of cubuf.
    for mode in ("native", "native2", "cubuf"):
        p = subprocess.run([sys.executable, __file__, lib, mode.rstrip("2")], capture_output=True,
                           text=True, timeout=500)
        if p.returncode != 0:
            print("%s run failed (%d):\n%s%s" % (mode, p.returncode, p.stdout, p.stderr))
            return 1
        runs[mode] = json.loads(p.stdout.strip().splitlines()[-1])
    s = runs["cubuf"]["stats"]
    same = True
    compared = set()
    for part in PARTS:
        n1, n2, c = (runs[m]["digest"][part] for m in ("native", "native2", "cubuf"))
        if n1 != n2:  # a library kernel whose float results vary between runs
            print("%-12s not deterministic natively (%s / %s): not compared" % (part, n1[:16], n2[:16]))
            continue
        print("%-12s %s (native) / %s (cubuf)%s" % (part, n1[:16], c[:16], "" if n1 == c else "  DIFFERENT"))
        same = same and n1 == c
        compared.add(part)
    # The element-wise results, the sorts and the integer scans are deterministic: they must be compared.
    same = same and {"elementwise", "sort", "cumsum"} <= compared
    print("cubuf: %d hits, %d misses, %d live, %d cached bytes" %
          (s["hits"], s["misses"], s["live_count"], s["cached_bytes"]))
    ok = same and s["hits"] > 100 and s["misses"] > 0
    print("same results" if ok else "FAIL: the results differ or cubuf did not serve the run")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
