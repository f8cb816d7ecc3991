"""The statistics of the caching resource serving a device for the framework
entry points (cubuf_framework_resource, cubuf_caching_stats), read through
ctypes from the libcubuf the framework loaded."""
import ctypes


class CachingStats(ctypes.Structure):
    # cubuf_caching_stats_t (include/cubuf/caching.h), in order
    _fields_ = [("struct_size", ctypes.c_size_t)] + [
        (n, ctypes.c_size_t)
        for n in ("live_bytes", "requested_bytes", "internal_waste_bytes", "cached_bytes",
                  "held_bytes", "peak_held_bytes", "largest_free_bytes")
    ] + [("fragmentation", ctypes.c_double), ("live_count", ctypes.c_size_t),
         ("cached_count", ctypes.c_size_t)] + [
        (n, ctypes.c_uint64)
        for n in ("hits", "cross_stream_reuses", "misses", "upstream_allocations",
                  "upstream_deallocations", "oom_retries")
    ]


def read(lib_path, device=0):
    lib = ctypes.CDLL(lib_path)
    lib.cubuf_framework_resource.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)]
    lib.cubuf_caching_stats.argtypes = [ctypes.c_void_p, ctypes.POINTER(CachingStats)]
    res = ctypes.c_void_p()
    st = lib.cubuf_framework_resource(device, ctypes.byref(res))
    if st != 0:
        raise RuntimeError("cubuf_framework_resource returned %d" % st)
    s = CachingStats()
    s.struct_size = ctypes.sizeof(CachingStats)
    st = lib.cubuf_caching_stats(res, ctypes.byref(s))
    if st != 0:
        raise RuntimeError("cubuf_caching_stats returned %d" % st)
    return {n: getattr(s, n) for n, _ in CachingStats._fields_}
