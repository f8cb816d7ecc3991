"""cuda.core's Buffer page on every built-in resource: methods, attributes,
the exceptions the page names, and the bytes read back."""
import os
import subprocess
import sys

import pytest

import cubuf

pytestmark = pytest.mark.gpu

S = cubuf.default_stream()


def resources():
    return {
        "device": lambda: cubuf.DeviceMemoryResource(0),
        "device_private": lambda: cubuf.DeviceMemoryResource(0, cubuf.DeviceMemoryResourceOptions(max_size=1 << 26)),
        "pinned": lambda: cubuf.PinnedMemoryResource(),
        "managed": lambda: cubuf.ManagedMemoryResource(cubuf.ManagedMemoryResourceOptions(preferred_location=0)),
        "legacy_pinned": lambda: cubuf.LegacyPinnedMemoryResource(0),
        "sync_device": lambda: cubuf.SyncDeviceMemoryResource(0),
        "vmm": lambda: cubuf.VirtualMemoryResource(0),
        "caching": lambda: cubuf.CachingMemoryResource(cubuf.DeviceMemoryResource(0)),
    }


@pytest.mark.parametrize("kind", sorted(resources()))
def test_allocate_fill_copy_close(kind, stream):
    mr = resources()[kind]()
    b = mr.allocate(4096, stream=stream)
    assert type(b) is (cubuf.VirtualMemoryBuffer if kind == "vmm" else cubuf.Buffer)
    assert b.memory_resource is mr and b.owner is None and not b.is_closed and not b.is_mapped
    assert b.size >= 4096 and b.handle != 0
    host = kind in ("pinned", "managed", "legacy_pinned")
    assert b.is_host_accessible == host and b.is_device_accessible
    assert b.is_managed == (kind == "managed")
    assert b.device_id == (-1 if kind in ("pinned", "legacy_pinned") else 0)
    assert (mr.device_id, mr.is_host_accessible, mr.is_managed) == (b.device_id, host, kind == "managed")
    b.fill(0x5A, stream=stream)
    c = b.copy_to(stream=stream)  # a new buffer from the same resource
    assert type(c) is type(b) and c.memory_resource is mr and c.size == b.size and c.handle != b.handle
    c.fill(b"\x01\x02\x03\x04", stream=stream)
    b.copy_from(c, stream=stream)
    assert b.copy_to_host(0, 8, stream=stream) == b"\x01\x02\x03\x04" * 2
    assert c.copy_to(dst=b, stream=stream) is b
    before = mr.stats["current_bytes"]
    c.close(stream)
    assert c.is_closed and c.size == 0 and c.handle == 0
    stream.sync()
    assert mr.stats["current_bytes"] == before - b.size
    b.close()
    assert mr.stats["current_count"] == 0


def test_caching_resource_reuses_blocks(stream):
    up = cubuf.DeviceMemoryResource(0, cubuf.DeviceMemoryResourceOptions())
    mr = cubuf.CachingMemoryResource(up, cubuf.CachingMemoryResourceOptions(max_cached_size=1 << 20))
    a = mr.allocate(1000, stream=stream)
    ptr = a.handle
    a.close()
    b = mr.allocate(1000, stream=stream)  # the cached block again, same stream
    assert b.handle == ptr and up.stats["total_allocations"] == 1
    b.close()
    with pytest.raises(TypeError):
        cubuf.CachingMemoryResource(object())
    with pytest.raises(ValueError, match="CUBUF_ERROR_INVALID_ARGUMENT"):
        cubuf.CachingMemoryResource(up, cubuf.CachingMemoryResourceOptions(max_cached_size=1 << 40))


def test_caching_blocks_go_back_with_their_stream():
    # A cubuf.Stream destroyed (its last reference dropped) while a caching resource kept blocks
    # on it: the resource gave them back later on the destroyed handle, which failed with a
    # warning and lost them (or, on a handle a new stream got, ordered them on the wrong stream).
    import gc
    import warnings
    up = cubuf.DeviceMemoryResource(0, cubuf.DeviceMemoryResourceOptions())
    mr = cubuf.CachingMemoryResource(up)
    s = cubuf.Stream(0)
    for n in (1000, 5000, 70000):
        mr.allocate(n, stream=s).close()  # cached on s
    assert up.stats["current_count"] == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del s  # cuStreamDestroy, after the blocks went back
        gc.collect()
        assert up.stats["current_count"] == 0
        del mr
        gc.collect()
    assert up.stats["current_count"] == 0


def test_caching_trim_forget_stream_and_stats():
    up = cubuf.DeviceMemoryResource(0, cubuf.DeviceMemoryResourceOptions())
    mr = cubuf.CachingMemoryResource(up)
    s, t = cubuf.Stream(0), cubuf.Stream(0)
    for n in (1000, 5000, 70000):
        mr.allocate(n, stream=s).close()  # cached on s
    mr.allocate(3000, stream=t).close()
    st = mr.cache_stats
    assert (st["cached_count"], st["live_bytes"], st["misses"], st["hits"]) == (4, 0, 4, 0)
    assert st["held_bytes"] == st["cached_bytes"] == up.stats["current_bytes"]
    mr.forget_stream(s.handle)  # a handle, as another framework's stream would be given
    assert mr.cache_stats["cached_count"] == 1 and up.stats["current_count"] == 1
    mr.allocate(3000, stream=t).close()  # t's block again
    assert mr.cache_stats["hits"] == 1
    mr.trim(bytes_to_keep=1 << 20)  # keeps it
    assert mr.cache_stats["cached_count"] == 1
    mr.trim()
    assert mr.cache_stats["cached_count"] == 0 and up.stats["current_count"] == 0
    with pytest.raises(TypeError):
        mr.forget_stream("t")
    with pytest.raises((OverflowError, ValueError)):
        mr.trim(-1)
    with pytest.raises(TypeError):
        mr.trim(1, 2)


def test_fill_patterns_and_errors():
    mr = cubuf.DeviceMemoryResource(0)
    b = mr.allocate(12)
    b.fill(b"\xab\xcd", stream=S)
    assert b.copy_to_host() == b"\xab\xcd" * 6
    b.fill(memoryview(b"\x01\x02\x03\x04"), stream=S)
    assert b.copy_to_host() == b"\x01\x02\x03\x04" * 3
    b.fill(True, stream=S)
    assert b.copy_to_host() == b"\x01" * 12
    odd = mr.allocate(6)
    with pytest.raises(ValueError, match="CUBUF_ERROR_INVALID_ARGUMENT"):
        odd.fill(b"\x00\x00\x00\x00", stream=S)  # 6 is not a multiple of 4
    with pytest.raises(OverflowError):
        odd.fill(300, stream=S)
    odd.close()
    with pytest.raises(RuntimeError, match="CUBUF_ERROR_CLOSED"):
        odd.fill(1, stream=S)
    with pytest.raises(OverflowError):  # the range is checked before whether it is closed
        odd.fill(256, stream=S)


def test_copy_sizes_must_match_and_closed_is_runtime_error():
    mr = cubuf.DeviceMemoryResource(0)
    a, b = mr.allocate(64), mr.allocate(128)
    with pytest.raises(ValueError, match="CUBUF_ERROR_INVALID_ARGUMENT"):
        a.copy_from(b, stream=S)
    b.close()
    with pytest.raises(RuntimeError, match="CUBUF_ERROR_CLOSED"):
        a.copy_to(b, stream=S)
    with pytest.raises(RuntimeError, match="CUBUF_ERROR_CLOSED"):
        b.copy_to(stream=S)


def test_copy_options_rules(drv, stream):
    mr = cubuf.DeviceMemoryResource(0)
    a, b = mr.allocate(256, stream=stream), mr.allocate(256, stream=stream)
    a.fill(7, stream=stream)
    opts = cubuf.CopyOptions("stream")
    for legacy in (cubuf.LEGACY_DEFAULT_STREAM, 0, 1):
        with pytest.raises(TypeError, match="CUBUF_ERROR_INVALID_ARGUMENT"):
            b.copy_from(a, stream=legacy, options=opts)
    b.copy_from(a, stream=stream, options=opts)
    stream.sync()  # the per-thread default stream is not ordered after `stream`
    b.copy_from(a, stream=cubuf.PER_THREAD_DEFAULT_STREAM, options=cubuf.CopyOptions("any"))
    cubuf.PER_THREAD_DEFAULT_STREAM.sync()
    stream.sync()
    assert b.copy_to_host() == b"\x07" * 256
    with drv.capture(stream):
        with pytest.raises(TypeError):
            b.copy_from(a, stream=stream, options=opts)


def test_during_api_call_copy_or_runtime_error(stream):
    # DURING_API_CALL: cubuf stages the source during the call, or, where the
    # device has no host memory pools, refuses it (RuntimeError, as the page says).
    src = cubuf.PinnedMemoryResource().allocate(64, stream=stream)
    src.fill(9, stream=stream)
    stream.sync()
    dst = cubuf.DeviceMemoryResource(0).allocate(64, stream=stream)
    try:
        dst.copy_from(src, stream=stream, options=cubuf.CopyOptions("during_api_call"))
    except RuntimeError as e:
        assert "CUBUF_ERROR_NOT_SUPPORTED" in str(e)
        pytest.skip(str(e))  # the refusal was checked; the staging path did not run
    src.fill(1, stream=stream)  # after the call: the copy already read the source
    stream.sync()
    assert dst.copy_to_host(stream=stream) == b"\x09" * 64


def test_from_handle_three_modes(drv):
    ptr = drv.mem_alloc(1 << 16)
    mr = cubuf.SyncDeviceMemoryResource(0)
    owned = cubuf.Buffer.from_handle(ptr, 1 << 16, mr)  # mr frees it at close
    assert owned.memory_resource is mr and owned.device_id == 0 and owned.is_device_accessible
    owned.fill(3, stream=S)
    view = cubuf.Buffer.from_handle(ptr, 16)  # non-owning
    assert view.memory_resource is None and view.copy_to_host() == b"\x03" * 16
    view.close()  # frees nothing
    assert owned.copy_to_host(0, 4) == b"\x03" * 4
    keeper = bytearray(1)
    with_owner = cubuf.Buffer.from_handle(ptr, 32, owner=keeper)
    assert with_owner.owner is keeper and with_owner.memory_resource is None
    with_owner.close()
    assert mr.stats["current_count"] == 1
    owned.close()
    assert mr.stats["current_count"] == 0
    with pytest.raises(RuntimeError, match="CUBUF_ERROR_CLOSED"):
        owned.set_deallocation_stream(S)


def test_buffer_objects_reused_start_fresh(drv, stream):
    """Buffer objects are kept at their release for the next buffer: a reused
    one is tracked by the collector again, carries nothing of its last life
    (weak references, owner, resource), and subclasses are never reused."""
    import gc
    import weakref

    class Tagged(cubuf.Buffer):
        __slots__ = ("note", "__dict__")

    mr = cubuf.DeviceMemoryResource(0)
    vmr = cubuf.VirtualMemoryResource(0, cubuf.VirtualMemoryResourceOptions(handle_type="posix_fd"))
    keeper = bytearray(1)
    ptr = drv.mem_alloc(4096)
    for _ in range(3):  # fills the spares with buffers of both types and a view with an owner
        old = [mr.allocate(4096, stream=stream) for _ in range(40)] + [vmr.allocate(1 << 21)]
        refs = [weakref.ref(b) for b in old]
        view = cubuf.Buffer.from_handle(ptr, 64, owner=keeper)
        tagged = Tagged.from_ipc_descriptor(vmr, old[-1].ipc_descriptor, stream=stream)
        tagged.note, tagged.extra = "a slot", "the subclass's dict"
        tagged.close()
        for b in old:
            b.close()
        del old, b, view, tagged
        assert all(r() is None for r in refs)
        new = [mr.allocate(4096, stream=stream) for _ in range(40)]
        grown = vmr.allocate(1 << 21)
        bare = cubuf.Buffer.from_handle(ptr, 32)
        assert all(type(b) is cubuf.Buffer and gc.is_tracked(b) for b in new + [bare])
        assert type(grown) is cubuf.VirtualMemoryBuffer and gc.is_tracked(grown)
        assert all(b.memory_resource is mr and b.owner is None and b.size == 4096 for b in new)
        assert bare.owner is None and bare.memory_resource is None and bare.size == 32
        assert not hasattr(bare, "__dict__") and weakref.ref(new[0])() is new[0]
        assert len({b.handle for b in new}) == 40 and mr.stats["current_count"] == 40
        for b in new + [grown, bare]:
            b.close()
        del new, grown, bare
    assert mr.stats["current_count"] == 0 and vmr.stats["current_count"] == 0
    assert sys.getrefcount(keeper) == 2  # the view's owner reference went with it
    drv.mem_free(ptr)


SUBCLASS_FRESH = """
import cubuf
class Tagged(cubuf.Buffer):
    __slots__ = ("note", "__dict__")
vmr = cubuf.VirtualMemoryResource(0, cubuf.VirtualMemoryResourceOptions(handle_type="posix_fd"))
exporter = vmr.allocate(1 << 21)
for _ in range(4):
    t = Tagged.from_ipc_descriptor(vmr, exporter.ipc_descriptor, stream=cubuf.default_stream())
    try:
        t.note
        raise SystemExit("a slot never set has a value")
    except AttributeError:
        pass
    assert t.__dict__ == {}
    t.note = 1
    t.close()
exporter.close()
print("fresh")
"""


def test_subclass_objects_start_zeroed():
    """A Buffer subclass's object (from_ipc_descriptor on the subclass) comes
    zeroed: its slots and dict. Python's debug allocator fills new memory with
    0xCD, so a slot left unset would be a wild pointer there."""
    env = dict(os.environ, PYTHONMALLOC="debug")
    r = subprocess.run([sys.executable, "-c", SUBCLASS_FRESH], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "fresh", r.stderr[-2000:]


def test_from_handle_with_stream_records_it(drv, stream):
    mr = cubuf.SyncDeviceMemoryResource(0)
    adopted = cubuf.Buffer.from_handle(drv.mem_alloc(4096), 4096, mr, stream=stream)
    assert mr.stats["current_count"] == 1
    adopted.fill(2, stream=stream)
    adopted.close()  # on the recorded stream
    assert mr.stats["current_count"] == 0


def test_set_deallocation_stream_and_close_on_stream(stream):
    mr = cubuf.DeviceMemoryResource(0)
    b = mr.allocate(1024, stream=stream)
    b.set_deallocation_stream(stream)
    b.set_deallocation_stream(cubuf.PER_THREAD_DEFAULT_STREAM)
    b.fill(1, stream=stream)
    b.close(stream=stream)
    assert b.is_closed
    stream.sync()
    assert mr.stats["current_count"] == 0


def test_set_deallocation_stream_on_a_view(drv):
    b = cubuf.DeviceMemoryResource(0).allocate(256)
    view = cubuf.Buffer.from_handle(b.handle, 256)
    drv.clear_current()
    view.set_deallocation_stream(cubuf.default_stream())  # a view frees nothing: any stream will do
    view.set_deallocation_stream(stream=cubuf.Stream(0))
    view.close()
    with pytest.raises(RuntimeError, match="CUBUF_ERROR_CLOSED"):
        view.set_deallocation_stream(cubuf.default_stream())


def test_failed_last_release_is_a_cuda_warning(drv, stream):
    mr = cubuf.DeviceMemoryResource(0)
    b = mr.allocate(4096, stream=stream)
    ptr = b.handle
    with drv.capture(stream):
        with pytest.warns(cubuf.CUDAWarning, match="CUBUF_ERROR_STREAM_CAPTURING"):
            del b  # its close on the capturing stream is refused: the memory is lost, not freed into the graph
    # Lost to cubuf, not to the process: whoever kept the pointer can still free it.
    drv.mem_free_async(ptr, stream)
    stream.sync()


CLOSE_WAITS = """
import sys, time
sys.path.insert(0, {tests!r})
import cubuf
from conftest import Driver
drv = Driver()
s = cubuf.Stream(0)
b = {make}.allocate(64, s)
began = False
refused = []

class Marking:  # the stream given to close(): reading it marks the close as begun
    def __cuda_stream__(self):
        global began
        began = True  # no call from here to the C close: nothing lets the GIL go before it
        return (0, s.handle)

@Driver.HOST_FN
def gate(_):  # runs on s, which the close synchronizes; a Python callback: it needs the GIL
    while not began:
        time.sleep(0.001)
    try:
        b.close()  # a second close while the first one waits
    except RuntimeError as e:
        refused.append(str(e))

drv.launch_host_func(cubuf.Context(0), s, gate)
b.close(stream=Marking())  # holding the GIL while it waits for gate: a deadlock
assert b.is_closed and len(refused) == 1 and "being closed on another thread" in refused[0], refused
print("ok")
"""


@pytest.mark.parametrize("make", ["cubuf.SyncDeviceMemoryResource(0)", "cubuf.VirtualMemoryResource(0)"])
def test_close_that_waits_lets_the_gil_go(make):
    """A close that synchronizes its stream (a synchronous resource, virtual
    memory) waits without the GIL: work queued on that stream that needs the
    GIL (a Python host function) runs meanwhile instead of deadlocking, and
    a second close of the buffer meanwhile is refused. In a child process,
    which the deadlock would hang."""
    code = CLOSE_WAITS.format(tests=os.path.dirname(os.path.abspath(__file__)), make=make)
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("Buffer.close held the GIL while it waited for a stream (deadlock)")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr[-2000:]


def test_deallocate_refuses_pointer_0():
    with pytest.raises(ValueError, match="CUBUF_ERROR_INVALID_ARGUMENT"):
        cubuf.DeviceMemoryResource(0).deallocate(0, 16)
    with pytest.raises(TypeError):
        cubuf.DeviceMemoryResource(0).deallocate(0)


def test_ipc_descriptor_of_a_resource_that_cannot_share():
    b = cubuf.DeviceMemoryResource(0).allocate(4096)
    with pytest.raises(RuntimeError, match="CUBUF_ERROR_NOT_SUPPORTED"):
        b.ipc_descriptor


def test_graph_resource_needs_capture(drv, stream):
    g = cubuf.GraphMemoryResource(0)
    with pytest.raises(ValueError, match="CUBUF_ERROR_INVALID_ARGUMENT"):
        g.allocate(1024, stream=stream)
    with drv.capture(stream):
        b = g.allocate(1024, stream=stream)
        assert b.size == 1024 and b.memory_resource is g
        b.close(stream)


def test_pool_close_on_capturing_stream_raises_and_stays_open(drv, stream):
    mr = cubuf.DeviceMemoryResource(0)
    b = mr.allocate(1024, stream=stream)
    with drv.capture(stream):
        with pytest.raises(RuntimeError, match="CUBUF_ERROR_STREAM_CAPTURING"):
            b.close(stream)
        assert not b.is_closed
    b.close(stream)


def test_out_of_memory_is_cuda_error():
    mr = cubuf.DeviceMemoryResource(0, cubuf.DeviceMemoryResourceOptions(max_size=1 << 21))
    with pytest.raises(cubuf.CUDAError) as e:
        mr.allocate(1 << 40)
    assert e.value.result == "CUDA_ERROR_OUT_OF_MEMORY" and e.value.code == 2
    assert e.value.status == "CUBUF_ERROR_OUT_OF_MEMORY"


def test_benchmark_hook_reports_a_failed_allocation():
    """The benchmark's C loop (bench/bench_python.py) raises for an allocation
    that fails; it releases no buffer it never got."""
    from cubuf import _cubuf
    mr = cubuf.DeviceMemoryResource(0, cubuf.DeviceMemoryResourceOptions(max_size=1 << 21))
    for _ in range(3):
        with pytest.raises(cubuf.CUDAError, match="CUBUF_ERROR_OUT_OF_MEMORY"):
            _cubuf._bench_c_alloc_close(mr, 1 << 40, 1, cubuf.default_stream())
    assert _cubuf._bench_c_alloc_close(mr, 4096, 4, cubuf.default_stream()) > 0
    assert mr.stats["current_count"] == 0


def test_benchmark_hooks_refuse_no_iterations():
    """A time per iteration needs one: 0 or fewer iterations is a ValueError,
    not a division by zero (inf) or a negative time."""
    from cubuf import _cubuf
    mr = cubuf.DeviceMemoryResource(0)
    for n in (0, -1):
        with pytest.raises(ValueError, match="iterations"):
            _cubuf._bench_c_alloc_close(mr, 64, n, cubuf.default_stream())
        for kind in ("alloc_free", "memcpy", "memset"):
            with pytest.raises(ValueError, match="iterations"):
                _cubuf._bench_raw(kind, 64, n, cubuf.default_stream(), 0)
    assert _cubuf._bench_raw("memset", 64, 2, cubuf.default_stream(), 0) > 0
    assert mr.stats["current_count"] == 0


def test_resource_argument_errors():
    with pytest.raises(ValueError, match="CUBUF_ERROR_OUT_OF_RANGE"):
        cubuf.DeviceMemoryResource(999)
    with pytest.raises(TypeError):
        cubuf.DeviceMemoryResource("0")
    with pytest.raises(ValueError):
        cubuf.DeviceMemoryResource(-1)
    with pytest.raises(ValueError, match="CUBUF_ERROR_OUT_OF_RANGE"):
        cubuf.ManagedMemoryResource(cubuf.ManagedMemoryResourceOptions(preferred_location=-3))
    with pytest.raises(OverflowError):
        cubuf.DeviceMemoryResource(0).allocate(-1)
    with pytest.raises(ValueError, match="preferred_location"):  # not cut to int (2**32 would be device 0)
        cubuf.ManagedMemoryResource(cubuf.ManagedMemoryResourceOptions(preferred_location=2**32))


def test_stream_object_in_a_cycle_with_its_buffer_is_collected(stream):
    """The stream object a buffer keeps (its deallocation stream) is visited by
    the collector: a stream object that refers back to the buffer is no leak."""
    import gc
    import weakref

    class Wrapper:  # a framework's stream object, holding what was allocated on it
        def __init__(self):
            self.held = []

        def __cuda_stream__(self):
            return (0, stream.handle)

    mr = cubuf.DeviceMemoryResource(0)
    w = Wrapper()
    b = mr.allocate(256, stream=w)
    w.held.append(b)
    refs = weakref.ref(b), weakref.ref(w)
    del b, w
    gc.collect()
    assert refs[0]() is None and refs[1]() is None
    stream.sync()
    assert mr.stats["current_count"] == 0


def test_copy_to_host_nbytes_past_the_end_is_value_error():
    """An nbytes past the buffer is cubuf's OUT_OF_RANGE whatever its size,
    not a MemoryError for a bytes object of nbytes."""
    b = cubuf.DeviceMemoryResource(0).allocate(64)
    for n in (65, 2**40, 2**62):
        with pytest.raises(ValueError, match="CUBUF_ERROR_OUT_OF_RANGE"):
            b.copy_to_host(nbytes=n)
    with pytest.raises(ValueError, match="CUBUF_ERROR_OUT_OF_RANGE"):
        b.copy_to_host(position=2**40, nbytes=2**40)
    assert b.copy_to_host(position=60, nbytes=4) == b.copy_to_host()[60:]
    b.close()


def test_stream_objects(stream):
    assert stream.handle not in (0, 1, 2) and stream.__cuda_stream__() == (0, stream.handle)
    b = cubuf.DeviceMemoryResource(0).allocate(64, stream=stream)
    b.fill(4, stream=stream.handle)  # an int handle is a stream too
    stream.sync()
    assert stream.is_done
    assert b.copy_to_host(stream=stream) == b"\x04" * 64
    b.close()
    s2 = cubuf.Stream(0, non_blocking=False, priority=-1)
    s2.close()
    s2.close()
