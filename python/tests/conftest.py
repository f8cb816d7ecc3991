"""Shared fixtures of the cubuf pytest suite.

Tests that need a CUDA device carry the `gpu` marker (most modules set
pytestmark) and skip without one; tests that hand memory to PyTorch, CuPy,
Numba or JAX carry `interop` too and skip on cubuf's host-backed test
driver (CUBUF_LIBCUDA), whose memory no framework can use. `drv` calls the
driver directly (through cuGetProcAddress of the driver cubuf loads) for
what cubuf's API does not do: stream capture, raw allocations.
"""
import contextlib
import ctypes
import gc
import os
import types

import pytest

import cubuf


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (or cubuf's test driver)")
    config.addinivalue_line("markers", "interop: hands cubuf memory to a framework (needs a real GPU)")
    config.addinivalue_line("markers", "two_devices: needs two CUDA devices (the test driver has two)")


def _devices():
    try:
        return cubuf.get_num_devices(), ""
    except cubuf.CUDAError as e:
        return 0, str(e)


NUM_DEVICES, NO_DEVICE_WHY = _devices()
TEST_DRIVER = bool(os.environ.get("CUBUF_LIBCUDA"))


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") and NUM_DEVICES == 0:
        pytest.skip(f"needs a CUDA device: {NO_DEVICE_WHY or 'none found'}")
    if item.get_closest_marker("two_devices") and NUM_DEVICES < 2:
        pytest.skip(f"needs 2 CUDA devices, {NUM_DEVICES} found")
    if item.get_closest_marker("interop") and TEST_DRIVER:
        pytest.skip("interop needs a real GPU: CUBUF_LIBCUDA names cubuf's host-backed test driver")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """After a test function that passed, its own frame lets go of its locals, and the item records
    that it passed (item.cubuf_passed, for checks made at teardown). Under compute-sanitizer the
    finished test's frame stays alive with no Python object referring to it (likely the sanitizer's
    own doing: it records Python frames in its host backtraces), and with it the test's buffers,
    which the sanitizer then lists as leaked at exit; plain pytest keeps none. Clearing the frame
    drops what returning from the test drops; a failed test keeps its frame for the report."""
    outcome = yield
    item.cubuf_passed = outcome.excinfo is None
    code = getattr(getattr(item, "function", None), "__code__", None)
    if item.cubuf_passed and code is not None:
        for f in [o for o in gc.get_objects() if type(o) is types.FrameType and o.f_code is code]:
            try:
                f.clear()
            except RuntimeError:  # still executing (a recursive call): it is not the finished one
                pass


class Driver:
    """Driver entry points by name and ABI version (the ones src/driver.h uses)."""

    def __init__(self):
        self.lib = ctypes.CDLL(os.environ.get("CUBUF_LIBCUDA") or "libcuda.so.1")
        gpa = self.lib.cuGetProcAddress_v2
        gpa.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64,
                        ctypes.c_void_p]
        self._gpa = gpa
        self._cache = {}

    def fn(self, name, version, *argtypes):
        key = (name, version)
        if key not in self._cache:
            p = ctypes.c_void_p()
            r = self._gpa(name.encode(), ctypes.byref(p), version, 0, None)
            assert r == 0 and p.value, f"cuGetProcAddress({name}, {version}) failed: {r}"
            self._cache[key] = ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(p.value)
        return self._cache[key]

    def check(self, r, what):
        assert r == 0, f"{what} failed: CUresult {r}"

    def begin_capture(self, stream):
        f = self.fn("cuStreamBeginCapture", 10010, ctypes.c_void_p, ctypes.c_int)
        self.check(f(stream.handle, 2), "cuStreamBeginCapture")  # CU_STREAM_CAPTURE_MODE_RELAXED

    def end_capture(self, stream):
        graph = ctypes.c_void_p()
        f = self.fn("cuStreamEndCapture", 10000, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p))
        self.check(f(stream.handle, ctypes.byref(graph)), "cuStreamEndCapture")
        if graph.value:
            self.fn("cuGraphDestroy", 10000, ctypes.c_void_p)(graph)

    @contextlib.contextmanager
    def capture(self, stream):
        """Stream capture for the block; ended (the graph dropped) whatever the block raises."""
        self.begin_capture(stream)
        try:
            yield
        finally:
            self.end_capture(stream)

    def set_current(self, context):
        self.check(self.fn("cuCtxSetCurrent", 4000, ctypes.c_void_p)(context.handle), "cuCtxSetCurrent")

    def clear_current(self):
        self.check(self.fn("cuCtxSetCurrent", 4000, ctypes.c_void_p)(None), "cuCtxSetCurrent")

    def mem_alloc(self, size):
        """cuMemAlloc in device 0's primary context (made current on this thread)."""
        self.set_current(cubuf.Context(0))
        p = ctypes.c_uint64()
        self.check(self.fn("cuMemAlloc", 3020, ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t)(ctypes.byref(p), size),
                   "cuMemAlloc")
        return p.value

    HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)  # CUhostFn

    def launch_host_func(self, context, stream, fn):
        """cuLaunchHostFunc of fn (a HOST_FN, kept alive by the caller) on `stream` (a cubuf.Stream or
        a handle; a default stream is `context`'s): fn runs in order with the stream's work, on the
        driver's thread."""
        self.set_current(context)
        f = self.fn("cuLaunchHostFunc", 10000, ctypes.c_void_p, self.HOST_FN, ctypes.c_void_p)
        self.check(f(getattr(stream, "handle", stream), fn, None), "cuLaunchHostFunc")

    def host_register(self, address, size):
        """cuMemHostRegister (flags 0) in device 0's primary context (made current on this thread)."""
        self.set_current(cubuf.Context(0))
        f = self.fn("cuMemHostRegister", 6050, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint)
        self.check(f(address, size, 0), "cuMemHostRegister")

    def host_unregister(self, address):
        self.check(self.fn("cuMemHostUnregister", 4000, ctypes.c_void_p)(address), "cuMemHostUnregister")

    def mem_free(self, ptr):
        self.check(self.fn("cuMemFree", 3020, ctypes.c_uint64)(ptr), "cuMemFree")

    def mem_free_async(self, ptr, stream):
        """cuMemFreeAsync of pool memory on a cubuf stream, in device 0's primary context."""
        self.set_current(cubuf.Context(0))
        f = self.fn("cuMemFreeAsync", 11020, ctypes.c_uint64, ctypes.c_void_p)
        self.check(f(ptr, stream.handle), "cuMemFreeAsync")


@pytest.fixture
def drv():
    return Driver()


@pytest.fixture
def ctx():
    return cubuf.Context(0)


@pytest.fixture
def stream():
    s = cubuf.Stream(0)
    yield s
    s.sync()  # not closed: buffers a failed test left behind hold it until they are released
