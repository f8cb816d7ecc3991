"""DLPack and the CUDA Array Interface on cubuf buffers themselves: capsules,
devices, the array API's stream and copy rules, lifetimes both ways."""
import sys

import pytest

import cubuf

np = pytest.importorskip("numpy")

pytestmark = pytest.mark.gpu

S = cubuf.default_stream()


def test_dlpack_device_per_kind():
    assert cubuf.DeviceMemoryResource(0).allocate(64).__dlpack_device__() == (2, 0)   # kDLCUDA
    assert cubuf.PinnedMemoryResource().allocate(64).__dlpack_device__() == (3, 0)     # kDLCUDAHost
    assert cubuf.LegacyPinnedMemoryResource(0).allocate(64).__dlpack_device__() == (3, 0)
    assert cubuf.ManagedMemoryResource().allocate(64).__dlpack_device__() == (13, 0)   # kDLCUDAManaged
    closed = cubuf.DeviceMemoryResource(0).allocate(64)
    closed.close()
    with pytest.raises(RuntimeError, match="CUBUF_ERROR_CLOSED"):
        closed.__dlpack_device__()
    with pytest.raises(RuntimeError, match="CUBUF_ERROR_CLOSED"):
        closed.__dlpack__()


def test_capsule_kinds():
    b = cubuf.DeviceMemoryResource(0).allocate(64)
    assert "dltensor_versioned" in repr(b.__dlpack__(max_version=(1, 0)))
    assert '"dltensor"' in repr(b.__dlpack__())
    assert '"dltensor"' in repr(b.__dlpack__(max_version=(0, 8)))
    b.close()  # the capsules above were never consumed: their tensors are gone


def test_round_trip_shares_memory_and_blocks_close():
    mr = cubuf.DeviceMemoryResource(0)
    b = mr.allocate(4096)
    b.fill(1, stream=S)
    imp = cubuf.from_dlpack(b)
    assert (imp.handle, imp.size, imp.device_id) == (b.handle, b.size, 0)
    assert imp.memory_resource is None
    imp.fill(2, stream=S)
    assert b.copy_to_host(0, 4) == b"\x02" * 4
    with pytest.raises(RuntimeError, match="CUBUF_ERROR_BUSY"):
        b.close()  # the consumer's tensor (imp) still uses it
    assert not b.is_closed
    imp.close()  # drops the tensor
    b.close()
    assert mr.stats["current_count"] == 0


def test_consumer_keeps_memory_alive():
    mr = cubuf.DeviceMemoryResource(0)
    b = mr.allocate(256)
    b.fill(0x33, stream=S)
    imp = cubuf.from_dlpack(b, stream=cubuf.Stream(0))
    del b  # the Python object goes; the tensor keeps the memory
    assert imp.copy_to_host(0, 4) == b"\x33" * 4
    assert mr.stats["current_count"] == 1
    del imp
    S.sync()
    assert mr.stats["current_count"] == 0


def test_reexport_of_an_import_outlives_its_view():
    mr = cubuf.DeviceMemoryResource(0)
    b = mr.allocate(4096)
    b.fill(0x61, stream=S)
    imp = cubuf.from_dlpack(b)
    back = cubuf.from_dlpack(imp)  # imp exported again: its tensor holds b's tensor
    assert back.handle == b.handle
    imp.close()  # the view closes; the memory stays with the export
    assert back.copy_to_host(0, 2) == b"aa"
    with pytest.raises(RuntimeError, match="CUBUF_ERROR_BUSY"):
        b.close()
    back.close()
    b.close()
    assert mr.stats["current_count"] == 0


@pytest.mark.two_devices
def test_managed_import_belongs_to_its_device(drv):
    """DLPack names managed memory (kDLCUDAManaged, 0) whichever device made
    it; the import belongs to the device the memory reports (device_id), so
    its work on a default stream runs in that device's context: device 0's
    legacy stream, held up by a host function until the copy has returned,
    does not hold it up."""
    import time
    m = cubuf.ManagedMemoryResource(device=1).allocate(64)
    m.fill(3, stream=S)
    m.copy_to_host()  # complete on return
    assert m.__dlpack_device__() == (13, 0) and m.device_id == 1
    v = cubuf.from_dlpack(m)
    assert v.device_id == 1 and v.is_managed
    state = {"done": False, "timed_out": None}

    @drv.HOST_FN
    def gate(_):
        deadline = time.monotonic() + 10
        while not state["done"] and time.monotonic() < deadline:
            time.sleep(0.001)
        state["timed_out"] = not state["done"]

    ctx0 = cubuf.Context(0)
    drv.launch_host_func(ctx0, cubuf.LEGACY_DEFAULT_STREAM, gate)
    assert v.copy_to_host(0, 4) == b"\x03" * 4  # on device 1's legacy stream
    state["done"] = True
    ctx0.synchronize()
    assert state["timed_out"] is False
    v.close()
    m.close()


def test_array_api_arguments():
    b = cubuf.DeviceMemoryResource(0).allocate(64)
    b.__dlpack__(stream=0)  # disallowed by the array API as ambiguous; taken as the legacy stream
    with pytest.raises(ValueError, match="not a stream"):
        b.__dlpack__(stream=-2)
    with pytest.raises(BufferError):
        b.__dlpack__(dl_device=(1, 0))
    b.__dlpack__(dl_device=(2, 0), stream=-1)
    b.__dlpack__(stream=2)
    s = cubuf.Stream(0)
    b.__dlpack__(stream=s.handle, max_version=(1, 2))
    with pytest.raises(TypeError):
        b.__dlpack__(1)  # keyword-only
    with pytest.raises(TypeError):
        b.__dlpack__(max_version=1)
    with pytest.raises(TypeError, match="dl_device"):  # not SystemError
        b.__dlpack__(dl_device=[2, 0])
    with pytest.raises(TypeError, match="__dlpack_device__"):
        cubuf.from_dlpack(type("P", (), {"__dlpack__": lambda self, **kw: b.__dlpack__(**kw),
                                           "__dlpack_device__": lambda self: [2, 0]})())
    s.sync()


def test_copy_true_exports_a_copy():
    mr = cubuf.DeviceMemoryResource(0)
    b = mr.allocate(64)
    b.fill(5, stream=S)
    c = cubuf.from_dlpack(type("P", (), {"__dlpack__": lambda self, **kw: b.__dlpack__(copy=True, **kw),
                                           "__dlpack_device__": lambda self: b.__dlpack_device__()})())
    assert c.handle != b.handle and c.size == 64
    assert c.copy_to_host() == b"\x05" * 64
    assert mr.stats["current_bytes"] == 128  # b and its copy, from b's resource
    b.close()  # a copy holds no slice of b
    assert mr.stats["current_bytes"] == 64
    c.close()  # the view lets go of the tensor, whose deleter frees the copy
    assert mr.stats["current_bytes"] == 0 and mr.stats["current_count"] == 0


@pytest.mark.parametrize("kind", ["device", "pinned, a host consumer", "caching", "virtual memory view"])
def test_copy_true_without_a_stream_outlives_the_work_stream(drv, kind):
    # A copy for a consumer without a stream (-1; a host consumer) is made on the buffer's work
    # stream, and the consumer may keep the tensor after that stream's Python object (and the
    # stream) is gone. It was freed on that stream then: the free failed, with a warning, and the
    # copy's memory was lost. A caching resource's memory has no context of its own, and a virtual
    # memory copy is rounded up (the tensor holds a slice of it): both moved nothing at first.
    import warnings
    n, dl = 4096, (2, 0)
    drv.set_current(cubuf.Context(0))  # for the allocation's legacy stream (a caching resource has no device)
    s = cubuf.Stream(0)
    if kind == "pinned, a host consumer":
        mr, dl = cubuf.PinnedMemoryResource(), (3, 0)
    elif kind == "caching":
        mr = cubuf.CachingMemoryResource(cubuf.DeviceMemoryResource(0))
    elif kind == "virtual memory view":
        mr, n = cubuf.VirtualMemoryResource(0), 100
    else:
        mr = cubuf.DeviceMemoryResource(0)
    b = mr.allocate(mr.granularity if n == 100 else n)  # closed on the legacy stream, as the copy must be
    v = cubuf.Context(0).foreign_buffer(b.handle, n, base=b) if n == 100 else b
    v.fill(9, stream=s)  # s: the work stream
    drv.clear_current()  # the export makes the context it needs current
    cap = v.__dlpack__(max_version=(1, 0), copy=True, **({} if dl == (3, 0) else {"stream": -1}))
    assert mr.stats["current_count"] == 2
    v.close()
    b.close()
    s.sync()
    del b, v, s  # the stream's last reference: destroyed
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = cubuf.from_dlpack(type("P", (), {"__dlpack__": lambda self, **kw: cap,
                                               "__dlpack_device__": lambda self: dl})())
        assert c.size == n and c.copy_to_host() == b"\x09" * n
        del cap
        c.close()  # the tensor's deleter frees the copy
        cubuf.Context(0).synchronize()
    assert mr.stats["current_bytes"] == 0 and mr.stats["current_count"] == 0


def test_copy_true_without_a_stream_while_the_work_stream_captures(drv):
    # The legacy stream cannot wait for a capturing stream (it would join the capture): the copy
    # stays freed on the work stream, and legacy work after it is not captured.
    mr = cubuf.SyncDeviceMemoryResource(0)  # allocating is allowed in a relaxed capture
    b, other = mr.allocate(4096), mr.allocate(64)
    other.fill(0, stream=S)
    cubuf.Context(0).synchronize()
    s = cubuf.Stream(0)
    with drv.capture(s):
        b.fill(7, stream=s)
        cap = b.__dlpack__(max_version=(1, 0), copy=True, stream=-1)
        other.fill(5, stream=S)  # unrelated work on the legacy stream
    cubuf.Context(0).synchronize()
    assert other.copy_to_host() == b"\x05" * 64  # it ran: it was not captured
    assert mr.stats["current_count"] == 3
    del cap  # freed on s, which still lives
    s.sync()
    b.close()
    other.close()
    assert mr.stats["current_count"] == 0


def test_numpy_host_memory_round_trip():
    a = np.arange(32, dtype=np.uint8)
    before = sys.getrefcount(a)
    imp = cubuf.from_dlpack(a)  # numpy's unversioned __dlpack__: the fallback path
    assert imp.handle == a.ctypes.data and imp.size == 32 and imp.is_host_accessible and imp.device_id == -1
    assert sys.getrefcount(a) > before  # its tensor holds the array
    assert imp.__dlpack_device__() == (1, 0)
    assert not hasattr(imp, "__cuda_array_interface__")  # pageable memory: no CUDA array
    del a
    assert imp.copy_to_host() == bytes(range(32))
    back = np.from_dlpack(imp)
    assert back.tobytes() == bytes(range(32))
    with pytest.raises(TypeError, match="not a DLPack producer"):
        cubuf.from_dlpack(object())


def test_read_only_import_stays_read_only():
    a = np.arange(16, dtype=np.uint8)
    a.flags.writeable = False
    try:
        imp = cubuf.from_dlpack(a)
    except (BufferError, TypeError) as e:  # a numpy that exports no read-only arrays
        pytest.skip(f"numpy {np.__version__}: {e}")
    cap = imp.__dlpack__(max_version=(1, 0))
    import ctypes
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    flags = ctypes.c_uint64.from_address(get(cap, b"dltensor_versioned") + 24).value
    assert flags & 1  # DLPACK_FLAG_BITMASK_READ_ONLY passed on
    with pytest.raises(BufferError):
        imp.__dlpack__()  # an unversioned tensor cannot carry the flag


def test_cuda_array_interface():
    s = cubuf.Stream(0)
    b = cubuf.DeviceMemoryResource(0).allocate(100, stream=s)
    cai = b.__cuda_array_interface__
    assert cai == {"shape": (100,), "typestr": "|u1", "data": (b.handle, False), "version": 3,
                   "strides": None, "stream": s.handle}
    b.fill(1, stream=cubuf.PER_THREAD_DEFAULT_STREAM)
    assert b.__cuda_array_interface__["stream"] == 2
    b.fill(1, stream=0)
    assert b.__cuda_array_interface__["stream"] == 1
    # a cubuf view of a CUDA-array object
    v = cubuf.Context(0).buffer_from_object(b)
    assert v.__cuda_array_interface__["data"][0] == b.handle
    v.close()
    cubuf.default_stream().sync()  # the fills on the default streams, before the free on s
    b.close()
    assert not hasattr(b, "__cuda_array_interface__")
    s.sync()


def test_copy_true_of_a_virtual_memory_view_has_its_size():
    # copy_to_new rounds a virtual memory copy up to the granularity: the tensor
    # was of the rounded size (2 MiB for a 100-byte view), past the bytes copied
    vmm = cubuf.VirtualMemoryResource(0)
    b = vmm.allocate(vmm.granularity)
    v = cubuf.Context(0).foreign_buffer(b.handle, 100, base=b)
    v.fill(7, stream=S)
    c = cubuf.from_dlpack(type("P", (), {"__dlpack__": lambda self, **kw: v.__dlpack__(copy=True, **kw),
                                           "__dlpack_device__": lambda self: v.__dlpack_device__()})())
    assert c.handle != v.handle and c.size == 100
    assert c.copy_to_host() == b"\x07" * 100
    c.close()  # the tensor's deleter frees the copy
    v.close()
    b.close()
    assert vmm.stats["current_count"] == 0


def _tensor_data(cap):
    """The data pointer and DLPack device of a capsule's tensor (versioned or not)."""
    import ctypes
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    versioned = "dltensor_versioned" in repr(cap)
    # DLManagedTensorVersioned: version, manager_ctx, deleter, flags, then the DLTensor; the
    # unversioned DLManagedTensor starts with its DLTensor (data, then the device's two int32).
    t = get(cap, b"dltensor_versioned" if versioned else b"dltensor") + (32 if versioned else 0)
    return (ctypes.c_void_p.from_address(t).value,
            (ctypes.c_int32.from_address(t + 8).value, ctypes.c_int32.from_address(t + 12).value))


class _HeldFill:
    """A fill of buf with value on a new stream, behind a host function that waits for open():
    the fill cannot run before it."""

    def __init__(self, drv, buf, value):
        import threading
        from conftest import Driver
        self.stream = cubuf.Stream(0)
        self.gate = threading.Event()
        self.fn = Driver.HOST_FN(lambda _: self.gate.wait(20))  # kept alive while the driver may call it
        drv.launch_host_func(cubuf.Context(0), self.stream, self.fn)
        buf.fill(value, stream=self.stream)

    def open(self):
        self.gate.set()
        self.stream.sync()


def _pinned(n, value):
    b = cubuf.PinnedMemoryResource().allocate(n)
    b.fill(value, stream=S)
    cubuf.Context(0).synchronize()
    return b


@pytest.mark.parametrize("kw", [{}, {"max_version": (1, 0)}, {"max_version": (1, 0), "copy": True},
                                {"max_version": (1, 0), "dl_device": (1, 0)},
                                {"max_version": (1, 0), "dl_device": (1, 0), "stream": -1, "copy": True}])
def test_pinned_memory_to_a_host_consumer_waits_for_its_work(drv, kw):
    # A host consumer (stream None: numpy, the CPU) reads pinned memory as soon as it has the tensor and
    # cannot wait on a stream: __dlpack__ waits for the work queued through the buffer (the copy's too).
    # So does a copy for the CPU with stream -1: that stream cannot cover work the producer queued.
    import ctypes
    import threading
    b = _pinned(4096, 0)
    held = _HeldFill(drv, b, 7)
    threading.Timer(0.3, held.gate.set).start()
    cap = b.__dlpack__(**kw)  # returns once the fill (and the copy) has run
    data, dev = _tensor_data(cap)
    assert (data == b.handle) != bool(kw.get("copy"))
    assert dev == ((1, 0) if "dl_device" in kw else (3, 0))
    assert ctypes.string_at(data, 4096) == bytes([7]) * 4096  # read as the host reads it: no stream
    held.open()
    del cap
    cubuf.Context(0).synchronize()
    b.close()


def test_pinned_memory_to_a_stream_or_to_no_one(drv):
    # A consumer's stream is handed the work (it waits, the host does not); stream -1 asks for nothing.
    import ctypes
    b = _pinned(4096, 0)
    held = _HeldFill(drv, b, 7)
    cap = b.__dlpack__(max_version=(1, 0), stream=-1)  # at once, the fill still held back
    assert ctypes.string_at(b.handle, 4096) == bytes(4096)
    consumer = cubuf.Stream(0)
    cap2 = b.__dlpack__(max_version=(1, 0), stream=consumer.handle)  # at once too
    assert ctypes.string_at(b.handle, 4096) == bytes(4096)
    held.gate.set()
    consumer.sync()  # waits for the fill through the handoff
    assert ctypes.string_at(b.handle, 4096) == bytes([7]) * 4096
    held.open()
    del cap, cap2
    b.close()


def test_pinned_memory_while_its_stream_captures(drv):
    # A host consumer cannot wait for work a capture holds (a synchronization would invalidate the
    # capture): BufferError, the capture intact (drv.capture checks that it ends cleanly).
    b = _pinned(4096, 0)
    s = cubuf.Stream(0)
    with drv.capture(s):
        b.fill(7, stream=s)
        with pytest.raises(BufferError, match="capturing"):
            b.__dlpack__()
    cubuf.Context(0).synchronize()
    b.close()


def test_handoff_from_a_capturing_stream_keeps_the_capture(drv):
    # The producer's stream captures: the consumer joins the capture (a record and a wait), where a
    # query of the producer would invalidate it.
    import ctypes
    b = cubuf.DeviceMemoryResource(0).allocate(4096)
    s, consumer = cubuf.Stream(0), cubuf.Stream(0)
    ev = ctypes.c_void_p()
    drv.check(drv.fn("cuEventCreate", 2000, ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint)(ctypes.byref(ev), 2),
              "cuEventCreate")
    with drv.capture(s):
        b.fill(7, stream=s)
        cap = b.__dlpack__(max_version=(1, 0), stream=consumer.handle)
        # the consumer's fork joins back into s
        drv.check(drv.fn("cuEventRecord", 2000, ctypes.c_void_p, ctypes.c_void_p)(ev, consumer.handle),
                  "cuEventRecord")
        drv.check(drv.fn("cuStreamWaitEvent", 3020, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)(s.handle, ev, 0),
                  "cuStreamWaitEvent")
    drv.check(drv.fn("cuEventDestroy", 4000, ctypes.c_void_p)(ev), "cuEventDestroy")
    del cap
    cubuf.Context(0).synchronize()
    b.close()


def test_pinned_memory_as_the_cpus():
    # numpy asks for dl_device=(kDLCPU, 0): pinned memory is the CPU's too, exported without a copy.
    b = _pinned(64, 5)
    cap = b.__dlpack__(max_version=(1, 0), dl_device=(1, 0))
    assert _tensor_data(cap) == (b.handle, (1, 0))
    a = np.from_dlpack(type("P", (), {"__dlpack__": lambda self, **k: b.__dlpack__(**k),
                                      "__dlpack_device__": lambda self: (1, 0)})())
    assert a.ctypes.data == b.handle and a.tobytes() == bytes([5]) * 64
    with pytest.raises(BufferError, match="stream None or -1"):
        b.__dlpack__(max_version=(1, 0), dl_device=(1, 0), stream=1)
    with pytest.raises(OverflowError):
        b.__dlpack__(max_version=(1, 0), dl_device=(1, 0), stream=2**70)
    assert _tensor_data(b.__dlpack__(max_version=(1, 0), dl_device=(1, 0), stream=-1)) == (b.handle, (1, 0))
    with pytest.raises(BufferError, match="DLPack device"):
        cubuf.DeviceMemoryResource(0).allocate(64).__dlpack__(dl_device=(1, 0))  # device memory is not the CPU's
    del a, cap
    b.close()
