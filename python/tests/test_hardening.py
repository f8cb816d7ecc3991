"""Lifetimes and misuse at the edges of the Python layer: a buffer's
destructor (the C buffer it released is not read again; a warning turned
into an error does not leak out of it), pinned memory exported through
DLPack outliving its Buffer and its stream, uses of a buffer while another
thread closes it without the GIL, work streams and closed streams, default
streams queried with no context current, and CUDA Array Interface strides
that overflow. Each test failed before its fix (the first only in the
CUBUF_SANITIZE=address build, where the released buffer's reuse shows)."""
import gc
import threading
import time
import warnings

import pytest

import cubuf
from conftest import Driver

pytestmark = pytest.mark.gpu


def test_dealloc_does_not_read_released_buffer():
    # Buffer_dealloc -> cubuf_buffer_release (frees the C object once the per-thread
    # cache of 32 is full) -> Buffer_clear -> owner_ref_is_ours(self->buf): use after free.
    # Fails (heap-use-after-free) under CUBUF_SANITIZE=address,undefined.
    base = cubuf.DeviceMemoryResource(0).allocate(4096)
    o = object()
    bufs = [cubuf.Buffer.from_handle(base.handle, 64, owner=o) for _ in range(80)]
    del bufs
    gc.collect()


def _exported_pinned_buffer():
    mr = cubuf.PinnedMemoryResource()
    s = cubuf.Stream(0)
    holder = [mr.allocate(64, stream=s)]
    cap = holder[0].__dlpack__()
    return mr, holder, cap


def test_dealloc_warning_as_error_is_not_left_set():
    mr, holder, cap = _exported_pinned_buffer()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        holder.clear()  # SystemError: list.clear returned a result with an exception set
    del cap


def test_exported_pinned_buffer_is_freed_after_its_stream_goes():
    mr, holder, cap = _exported_pinned_buffer()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        holder.clear()
        gc.collect()
        del cap  # CUDAWarning: cuMemFreeAsync on the destroyed stream, memory lost
        gc.collect()
    cubuf.Context(0).synchronize()
    assert mr.stats["current_count"] == 0


def test_no_export_while_a_gil_free_close_runs(drv):
    mr = cubuf.SyncDeviceMemoryResource(0)
    s = cubuf.Stream(0)
    b = mr.allocate(4096, stream=s)
    ev = threading.Event()
    fn = Driver.HOST_FN(lambda _: ev.wait())
    drv.launch_host_func(cubuf.Context(0), s, fn)
    t = threading.Thread(target=b.close)
    t.start()
    time.sleep(0.3)  # b.close() now waits for s without the GIL
    try:
        with pytest.raises(RuntimeError, match="being closed"):
            b.__dlpack__(stream=-1)  # else a tensor over memory freed a moment later
        with pytest.raises(RuntimeError, match="being closed"):
            cubuf.Context(0).buffer_from_object(b)
        with pytest.raises(RuntimeError, match="being closed"):
            b.fill(0, stream=cubuf.default_stream())
        with pytest.raises(RuntimeError, match="being closed"):
            b.__cuda_array_interface__
    finally:
        ev.set()
        t.join()
    assert b.is_closed


def test_export_after_the_work_stream_is_gone():
    b = cubuf.DeviceMemoryResource(0).allocate(64)
    s = cubuf.Stream(0)
    b.fill(1, stream=s)
    del s
    gc.collect()
    cap = b.__dlpack__(stream=1)  # CUDAError: cuStreamQuery on the destroyed stream
    del cap
    assert cubuf.from_dlpack(b).size == 64


def test_closed_stream_is_refused():
    s = cubuf.Stream(0)
    s.close()
    b = cubuf.DeviceMemoryResource(0).allocate(64)
    with pytest.raises(RuntimeError, match="closed"):
        b.fill(1, stream=s)  # it ran on the NULL (legacy) stream
    with pytest.raises(RuntimeError, match="closed"):
        s.sync()
    with pytest.raises(RuntimeError, match="closed"):
        s.is_done


def test_default_stream_is_done():
    out = []

    def query():  # a new thread: no current context (sync() copes with that, is_done does not)
        try:
            out.append((cubuf.LEGACY_DEFAULT_STREAM.is_done, cubuf.PER_THREAD_DEFAULT_STREAM.is_done))
        except Exception as e:
            out.append(e)

    t = threading.Thread(target=query)
    t.start()
    t.join()
    assert not isinstance(out[0], Exception), out[0]
    assert all(isinstance(v, bool) for v in out[0])


def test_cai_default_strides_do_not_overflow():
    # interop.c: `s *= shape[i]` signed overflow (UBSan aborts); must be a clean error
    b = cubuf.DeviceMemoryResource(0).allocate(64)

    class A:
        __cuda_array_interface__ = {"data": (b.handle, False), "shape": (4, 2**62), "typestr": "<f8",
                                    "version": 3}

    with pytest.raises(ValueError, match="overflows"):
        cubuf.Context(0).buffer_from_object(A())


def test_int_deallocation_stream_lets_the_kept_stream_go():
    # The destructor orders a free it must defer (an exported buffer) after the
    # kept stream object: after set_deallocation_stream(int) that object is no
    # longer the deallocation stream and must not be kept (nor waited for).
    import sys
    s = cubuf.Stream(0)
    b = cubuf.DeviceMemoryResource(0).allocate(64, stream=s)
    before = sys.getrefcount(s)
    b.set_deallocation_stream(1)  # the legacy stream, as an int
    assert sys.getrefcount(s) == before - 1
    b.set_deallocation_stream(s)
    assert sys.getrefcount(s) == before
    b.close(stream=1)
    assert sys.getrefcount(s) == before - 1



# A child process runs each GIL deadlock check, so that a deadlock fails the test. The
# host function on s waits for ev without the GIL; once ev is set it needs the GIL back
# to return, which it gets only when this thread lets it go (the switch interval is long).
_GIL_WAIT = r'''
import sys, threading, time
import cubuf
from conftest import Driver
drv = Driver()
sys.setswitchinterval(1.0)
s = cubuf.Stream(0)
ev = threading.Event()
def gate():
    fn = Driver.HOST_FN(lambda _: ev.wait())
    drv.launch_host_func(cubuf.Context(0), s, fn)
    time.sleep(0.3)
    ev.set()
    return fn
'''


def _no_gil_deadlock(body, **extra_env):
    import os
    import subprocess
    import sys
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), **extra_env)
    try:
        r = subprocess.run([sys.executable, "-c", _GIL_WAIT + body + "\nprint('done')\n"],
                           cwd=os.path.dirname(__file__), env=env, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("deadlocked on the GIL")
    assert r.returncode == 0 and r.stdout.strip() == "done", r.stderr


def test_destructor_close_that_waits_lets_the_gil_go():
    # Buffer_dealloc closed a synchronous resource's buffer holding the GIL: the close
    # waited for s, whose host function waited for the GIL (Buffer.close let it go already).
    _no_gil_deadlock("b = cubuf.SyncDeviceMemoryResource(0).allocate(4096, stream=s)\n"
                     "fn = gate()\n"
                     "del b\n")


def test_deallocate_lets_the_gil_go():
    # MemoryResource.deallocate of a synchronous resource (cuMemFree waits for the device)
    _no_gil_deadlock("mr = cubuf.SyncDeviceMemoryResource(0)\n"
                     "ptr = drv.mem_alloc(4096)\n"
                     "fn = gate()\n"
                     "mr.deallocate(ptr, 4096, stream=s)\n")


@pytest.mark.parametrize("end", ["del t", "t.close()", "mr.forget_stream(t)", "mr.trim()"])
def test_cached_blocks_given_back_let_the_gil_go(end):
    # A stream's end gives back the blocks a caching resource keeps on it, and a synchronous
    # upstream's free waits for the device: Stream's destructor and close held the GIL.
    _no_gil_deadlock("mr = cubuf.CachingMemoryResource(cubuf.SyncDeviceMemoryResource(0))\n"
                     "t = cubuf.Stream(0)\n"
                     "mr.allocate(4096, stream=t).close()\n"
                     "fn = gate()\n"
                     f"{end}\n"
                     "assert mr.cache_stats['cached_count'] == 0\n")


def test_caching_allocate_out_of_memory_lets_the_gil_go():
    # A caching resource that the upstream tells out of memory gives its blocks back and
    # synchronizes their streams before it retries: MemoryResource.allocate held the GIL
    # through that, while s's host function waited for it.
    _no_gil_deadlock("mr = cubuf.CachingMemoryResource(cubuf.SyncDeviceMemoryResource(0))\n"
                     "mr.allocate(4096, stream=s).close()\n"
                     "fn = gate()\n"
                     "try:\n"
                     "    mr.allocate(1 << 50, stream=s)\n"
                     "except cubuf.CUDAError as e:\n"
                     "    assert 'OUT_OF_MEMORY' in str(e), e\n"
                     "else:\n"
                     "    raise SystemExit('1 PiB was allocated')\n"
                     "assert mr.cache_stats['cached_count'] == 0\n")


@pytest.mark.parametrize("call", ["mr.allocate(4096, stream=u)", "src.copy_to(stream=u)"])
def test_caching_allocate_during_a_give_back_lets_the_gil_go(call):
    # trim() lets the GIL go and holds the cache's lock across the synchronous upstream's
    # free, which waits for s's host function; an allocation on a stream the cache has not
    # seen takes that lock, and held the GIL while it waited for it. A copy into new
    # memory allocates from its source's resource: over a synchronous upstream it let the
    # GIL go already (its source's close may wait); over a pool only an out-of-memory
    # release waits, which no test here provokes.
    _no_gil_deadlock("mr = cubuf.CachingMemoryResource(cubuf.SyncDeviceMemoryResource(0))\n"
                     "t, u = cubuf.Stream(0), cubuf.Stream(0)\n"
                     "src = mr.allocate(8192, stream=t)\n"
                     "mr.allocate(4096, stream=t).close()\n"
                     "fn = Driver.HOST_FN(lambda _: ev.wait())\n"
                     "drv.launch_host_func(cubuf.Context(0), s, fn)\n"
                     "a = threading.Thread(target=mr.trim)\n"
                     "a.start()\n"
                     "time.sleep(0.3)\n"
                     "ev.set()\n"
                     f"b = {call}\n"
                     "a.join()\n"
                     "b.close()\n"
                     "src.close()\n")


def test_host_export_racing_a_close_that_waits():
    # __dlpack__ for a host consumer waits for the work stream without the GIL; a close that
    # waits (cuMemFreeHost) claimed the buffer meanwhile, and the export went on with memory
    # the close then freed: both succeeded, and the consumer read unmapped memory. One of
    # the two must fail now.
    _no_gil_deadlock("s2 = cubuf.Stream(0)\n"
                     "b = cubuf.LegacyPinnedMemoryResource(0).allocate(4096, stream=s)\n"
                     "ev2 = threading.Event()\n"
                     "f1 = Driver.HOST_FN(lambda _: ev.wait())\n"
                     "drv.launch_host_func(cubuf.Context(0), s, f1)\n"
                     "f2 = Driver.HOST_FN(lambda _: ev2.wait())\n"
                     "drv.launch_host_func(cubuf.Context(0), s2, f2)\n"
                     "out = {}\n"
                     "def export():\n"
                     "    try:\n"
                     "        out['cap'] = b.__dlpack__(dl_device=(1, 0))\n"
                     "    except RuntimeError as e:\n"
                     "        out['export'] = str(e)\n"
                     "def close():\n"
                     "    try:\n"
                     "        b.close()\n"
                     "        out['closed'] = True\n"
                     "    except cubuf.CUDAError as e:\n"
                     "        out['close'] = str(e)\n"
                     "t1 = threading.Thread(target=export)\n"
                     "t1.start()\n"
                     "time.sleep(0.3)\n"  # t1 waits for s without the GIL
                     "t2 = threading.Thread(target=close)\n"
                     "t2.start()\n"
                     "time.sleep(0.3)\n"  # t2 claimed b and waits in cuMemFreeHost for s2
                     "ev.set()\n"
                     "t1.join()\n"
                     "ev2.set()\n"
                     "t2.join()\n"
                     "assert ('cap' in out) != out.get('closed', False), out\n"
                     "assert 'being closed' in out.get('export', 'being closed'), out\n")


@pytest.mark.parametrize("call", ["b.copy_to(stream=s)", "b.__dlpack__(stream=-1, copy=True)"])
def test_failed_copy_to_new_lets_the_gil_go(call):
    # A copy into new memory that fails after allocating frees the new buffer: a
    # synchronous resource's free waits for s, whose host function waits for the GIL.
    # The stand-in libcuda (tests/shim_libcuda.c) fails the process's first
    # cuMemcpyAsync, forwarding everything else to the driver in use.
    import os
    shim = os.environ.get("CUBUF_TEST_SHIM")
    if not shim:
        pytest.skip("CUBUF_TEST_SHIM (the build's stand-in libcuda) is not set: run through ctest")
    _no_gil_deadlock("b = cubuf.SyncDeviceMemoryResource(0).allocate(4096, stream=s)\n"
                     "fn = gate()\n"
                     "try:\n"
                     f"    {call}\n"
                     "except Exception as e:\n"
                     "    assert 'cuMemcpyAsync' in str(e), e\n"
                     "else:\n"
                     "    raise SystemExit('the copy did not fail')\n",
                     CUBUF_LIBCUDA=shim, CUBUF_SHIM_TARGET=os.environ.get("CUBUF_LIBCUDA", "libcuda.so.1"),
                     CUBUF_SHIM_FAIL_COPY="1")


@pytest.mark.parametrize("max_version", [None, (1, 0)])
def test_unconsumed_capsule_lets_the_gil_go(max_version):
    # interop.c: a DLPack capsule nobody consumed ran its tensor's deleter holding the GIL;
    # with the Buffer gone that release closes the buffer, which waited for s.
    _no_gil_deadlock("b = cubuf.SyncDeviceMemoryResource(0).allocate(4096, stream=s)\n"
                     f"cap = b.__dlpack__(stream=-1, max_version={max_version!r})\n"
                     "del b\n"
                     "fn = gate()\n"
                     "del cap\n")


@pytest.mark.parametrize("end", ["del v", "v.close()"])
def test_from_dlpack_view_lets_the_gil_go(end):
    # from_dlpack's view releases the imported tensor, whose deleter (cubuf's own here)
    # drops the producer's last reference: the view's close counted as one that cannot
    # wait (a plain view) and kept the GIL while the synchronous resource's close waited.
    _no_gil_deadlock("b = cubuf.SyncDeviceMemoryResource(0).allocate(4096, stream=s)\n"
                     "v = cubuf.from_dlpack(b)\n"
                     "del b\n"
                     "fn = gate()\n"
                     + end + "\n")


_CONSUME = r'''
import ctypes
api = ctypes.pythonapi
api.PyCapsule_GetPointer.restype = ctypes.c_void_p
api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
def consume(cap, versioned):
    name = b"dltensor_versioned" if versioned else b"dltensor"
    t = api.PyCapsule_GetPointer(cap, name)
    api.PyCapsule_SetName(cap, b"used_" + name)
    off = 16 if versioned else 56  # the deleter: after version and manager_ctx, or after the DLTensor
    fp = ctypes.c_void_p.from_address(t + off).value
    # PYFUNCTYPE: the call keeps the GIL, as a consumer's destructor (torch's) does
    return lambda: ctypes.PYFUNCTYPE(None, ctypes.c_void_p)(fp)(t)
'''


@pytest.mark.parametrize("versioned", [True, False])
def test_consumer_deleting_a_tensor_with_the_gil_lets_it_go(versioned):
    # A consumer that deletes a tensor holding the GIL (a torch tensor's destructor)
    # ran cubuf's deleter with it: with the Buffer gone the release closes the buffer,
    # which waited for s.
    mv = (1, 0) if versioned else None
    _no_gil_deadlock(_CONSUME + "b = cubuf.SyncDeviceMemoryResource(0).allocate(4096, stream=s)\n"
                     f"delete = consume(b.__dlpack__(stream=-1, max_version={mv!r}), {versioned})\n"
                     "del b\n"
                     "fn = gate()\n"
                     "delete()\n")
