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
    h = hashlib.sha256()
    for i in range(200):
        n = int(rng.integers(1, 1 << 16))
        a = cupy.asarray(rng.standard_normal(n, dtype=numpy.float32))
        b = cupy.asarray(rng.standard_normal(n, dtype=numpy.float32))
        c = cupy.sin(a) * b + cupy.sqrt(cupy.abs(a))
        h.update(cupy.asnumpy(c).tobytes())
        h.update(cupy.asnumpy(cupy.sort(c)).tobytes())
        h.update(cupy.asnumpy(cupy.cumsum(c)).tobytes())
        if i % 10 == 0:
            k = 64 + i
            x = cupy.asarray(rng.standard_normal((k, k)))
            h.update(cupy.asnumpy(x @ x.T).tobytes())
            h.update(cupy.asnumpy(cupy.fft.fft(x[0])).tobytes())
        del a, b, c
    cupy.cuda.Device(0).synchronize()
    out = {"digest": h.hexdigest()}
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
    for mode in ("native", "cubuf"):
        p = subprocess.run([sys.executable, __file__, lib, mode], capture_output=True, text=True,
                           timeout=500)
        if p.returncode != 0:
            print("%s run failed (%d):\n%s%s" % (mode, p.returncode, p.stdout, p.stderr))
            return 1
        runs[mode] = json.loads(p.stdout.strip().splitlines()[-1])
    s = runs["cubuf"]["stats"]
    print("digest %s (native) / %s (cubuf)" % (runs["native"]["digest"], runs["cubuf"]["digest"]))
    print("cubuf: %d hits, %d misses, %d live, %d cached bytes" %
          (s["hits"], s["misses"], s["live_count"], s["cached_bytes"]))
    ok = runs["native"]["digest"] == runs["cubuf"]["digest"] and s["hits"] > 100 and s["misses"] > 0
    print("same results" if ok else "FAIL: the results differ or cubuf did not serve the run")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
