"""pyarrow.cuda's Context page: every method and attribute."""
import ctypes

import pytest

import cubuf

pytestmark = pytest.mark.gpu


def test_context_attributes(ctx):
    assert cubuf.Context.get_num_devices() == cubuf.get_num_devices() >= 1
    assert ctx.device_number == 0 and ctx.handle != 0
    assert cubuf.Context().handle == ctx.handle  # the primary context
    wrapped = cubuf.Context(handle=ctx.handle)
    assert wrapped.handle == ctx.handle and wrapped.device_number == 0
    with pytest.raises(ValueError, match="belongs to device 0"):
        cubuf.Context(1, handle=ctx.handle)
    with pytest.raises(ValueError, match="CUBUF_ERROR_OUT_OF_RANGE"):
        cubuf.Context(999)
    with pytest.raises(ValueError):
        cubuf.Context(handle=0)
    with pytest.raises(TypeError):
        cubuf.Context(handle="x")


def test_new_buffer_and_bytes_allocated(ctx):
    base = ctx.bytes_allocated
    b = ctx.new_buffer(1000)
    assert b.size == 1000 and b.device_id == 0 and b.is_device_accessible and not b.is_host_accessible
    assert ctx.bytes_allocated == base + 1000
    assert b.memory_resource is not None and b.memory_resource.device_id == 0
    c = b.copy_to(stream=cubuf.default_stream())  # counted too
    assert ctx.bytes_allocated == base + 2000
    b.close()
    c.close()
    assert ctx.bytes_allocated == base
    assert ctx.new_buffer(0).size == 0
    assert ctx.new_buffer(nbytes=8).size == 8
    with pytest.raises(OverflowError):
        ctx.new_buffer(-1)


def test_buffer_from_data(ctx):
    data = bytes(range(200))
    b = ctx.buffer_from_data(data)
    assert b.size == 200 and b.copy_to_host() == data
    assert ctx.buffer_from_data(data, 50).copy_to_host() == data[50:]
    assert ctx.buffer_from_data(data, 10, 5).copy_to_host() == data[10:15]
    assert ctx.buffer_from_data(bytearray(data), size=3).copy_to_host() == data[:3]
    import numpy as np
    assert ctx.buffer_from_data(np.arange(4, dtype=np.uint16)).copy_to_host() == np.arange(4, dtype=np.uint16).tobytes()
    again = ctx.buffer_from_data(b)  # from a device buffer
    assert again.copy_to_host() == data and again.handle != b.handle
    with pytest.raises(ValueError, match="CUBUF_ERROR_OUT_OF_RANGE"):
        ctx.buffer_from_data(data, 200)
    with pytest.raises(ValueError, match="CUBUF_ERROR_OUT_OF_RANGE"):
        ctx.buffer_from_data(data, 10, 191)
    with pytest.raises(ValueError, match="CUBUF_ERROR_OUT_OF_RANGE"):
        ctx.buffer_from_data(data, -1)
    with pytest.raises(TypeError):
        ctx.buffer_from_data("text")
    b.close()
    with pytest.raises(RuntimeError, match="closed"):
        ctx.buffer_from_data(b)


class CloseFromHostFn:
    """A Python host function, queued on ctx's legacy stream, that waits until
    `began` is set and then tries to close `buf`, recording what happened
    (`close`: "closed" or the RuntimeError's text). `mark(value)` returns an
    object whose __index__ sets `began` and gives value: the argument a call
    reads last, after which it keeps the GIL until its copy waits."""

    def __init__(self, ctx, drv, buf):
        import time
        self.began, self.close = False, None

        @drv.HOST_FN
        def gate(_):
            deadline = time.monotonic() + 30
            while not self.began and time.monotonic() < deadline:
                time.sleep(0.001)
            try:
                buf.close()
                self.close = "closed"
            except RuntimeError as e:
                self.close = str(e)

        self.fn = gate  # kept alive while the driver may call it
        drv.launch_host_func(ctx, cubuf.LEGACY_DEFAULT_STREAM, gate)

    def mark(self, value):
        outer = self

        class Mark:
            def __index__(self):
                outer.began = True
                return value
        return Mark()


def test_buffer_from_data_holds_a_buffer_source_while_it_copies(ctx, drv):
    """The copy from a cubuf Buffer runs without the GIL: meanwhile the source
    is held open, so that a close on another thread is refused (BUSY) rather
    than freeing the memory being read. A Python host function on the legacy
    stream, which the copy waits behind, tries that close."""
    src = ctx.new_buffer(64)
    src.fill(0x5a, stream=cubuf.default_stream())
    ctx.synchronize()
    gate = CloseFromHostFn(ctx, drv, src)
    out = ctx.buffer_from_data(src, gate.mark(0))
    ctx.synchronize()
    assert "CUBUF_ERROR_BUSY" in gate.close, gate.close
    assert out.copy_to_host() == b"\x5a" * 64
    src.close()  # the copy is done: nothing holds it now
    out.close()


def test_foreign_buffer_and_base(ctx):
    owner = ctx.new_buffer(256)
    owner.fill(9, stream=cubuf.default_stream())
    v = ctx.foreign_buffer(owner.handle + 16, 32, owner)
    assert v.size == 32 and v.owner is owner and v.memory_resource is None
    assert v.copy_to_host() == b"\x09" * 32
    with pytest.raises(RuntimeError, match="CUBUF_ERROR_BUSY"):
        owner.close()  # the view depends on it
    v.close()
    owner.close()
    assert ctx.foreign_buffer(0, 0).size == 0
    with pytest.raises(ValueError):
        ctx.foreign_buffer(0, 16)
    keep = [1, 2]
    other = ctx.new_buffer(64)
    w = ctx.foreign_buffer(other.handle, 64, base=keep)
    assert w.owner is keep
    with pytest.raises(ValueError, match="CUBUF_ERROR_OUT_OF_RANGE"):
        ctx.foreign_buffer(other.handle, 128, other)


def test_owner_cycles_are_collected(ctx):
    """foreign_buffer's base and buffer_from_object's object may hold the view
    made of them: the cycle is collected, the base kept while it is in use."""
    import gc
    import weakref

    b = ctx.new_buffer(64)

    class Holder:
        def __init__(self, ptr):
            self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (64,), "typestr": "|u1",
                                             "version": 3, "stream": None}

    h = Holder(b.handle)
    h.view = ctx.buffer_from_object(h)
    k = Holder(b.handle)
    k.view = ctx.foreign_buffer(b.handle, 64, base=k)
    refs = [weakref.ref(x) for x in (h, h.view, k, k.view)]
    del h, k
    gc.collect()
    assert all(r() is None for r in refs)
    # A DLPack capsule holds the view: nothing is collected, the view stays open.
    k = Holder(b.handle)
    k.view = ctx.foreign_buffer(b.handle, 64, base=k)
    capsule = k.view.__dlpack__(stream=-1)
    ref = weakref.ref(k)
    del k
    gc.collect()
    assert ref() is not None and not ref().view.is_closed
    del capsule
    gc.collect()
    assert ref() is None
    b.close()


def test_get_device_address(ctx):
    b = ctx.new_buffer(64)
    assert ctx.get_device_address(b.handle) == b.handle
    pinned = cubuf.LegacyPinnedMemoryResource(0).allocate(64)
    assert ctx.get_device_address(pinned.handle) != 0
    page = ctypes.create_string_buffer(64)
    with pytest.raises(ValueError, match="CUBUF_ERROR_INVALID_ARGUMENT"):
        ctx.get_device_address(ctypes.addressof(page))


def test_buffer_from_object(ctx):
    b = ctx.new_buffer(128)
    v = ctx.buffer_from_object(b)
    assert (v.handle, v.size, v.owner) == (b.handle, 128, b)

    class Strided:  # a column of a 4x8 uint32 array: the span holds the gaps
        def __init__(self, ptr):
            self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (4,), "strides": (32,),
                                             "typestr": "<u4", "version": 3, "stream": None}
    s = Strided(b.handle + 4)
    col = ctx.buffer_from_object(s)
    assert col.handle == b.handle + 4 and col.size == 3 * 32 + 4 and col.owner is s
    c_order = type("C", (), {"__cuda_array_interface__": {"data": (b.handle, False), "shape": (2, 3),
                                                            "typestr": "<f8", "version": 2}})()
    assert ctx.buffer_from_object(c_order).size == 48
    with pytest.raises(ValueError, match="mask"):
        ctx.buffer_from_object(type("M", (), {"__cuda_array_interface__": {
            "data": (b.handle, False), "shape": (2,), "typestr": "<u1", "version": 3, "mask": object()}})())
    pinned = cubuf.LegacyPinnedMemoryResource(0).allocate(64)
    host_view = (ctypes.c_char * 64).from_address(pinned.handle)
    hv = ctx.buffer_from_object(host_view)  # pinned host memory through the buffer protocol
    assert hv.size == 64 and hv.owner is host_view
    with pytest.raises(ValueError, match="CUBUF_ERROR_INVALID_ARGUMENT"):
        ctx.buffer_from_object(bytearray(64))  # pageable: not device accessible
    with pytest.raises(TypeError):
        ctx.buffer_from_object(object())


def _dlpack_flags(cap):
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    return ctypes.c_uint64.from_address(get(cap, b"dltensor_versioned") + 24).value


def test_buffer_from_object_keeps_read_only(ctx):
    """A read-only producer's memory stays read-only in the view's exports,
    through a view of the view too; a writable one stays writable."""
    b = ctx.new_buffer(64)

    class Array:
        def __init__(self, ro):
            self.__cuda_array_interface__ = {"data": (b.handle, ro), "shape": (64,), "typestr": "|u1",
                                             "version": 3, "stream": None}
    ro, rw = ctx.buffer_from_object(Array(True)), ctx.buffer_from_object(Array(False))
    assert ro.__cuda_array_interface__["data"] == (b.handle, True)
    assert rw.__cuda_array_interface__["data"] == (b.handle, False)
    assert _dlpack_flags(ro.__dlpack__(max_version=(1, 0))) & 1
    assert not _dlpack_flags(rw.__dlpack__(max_version=(1, 0))) & 1
    with pytest.raises(BufferError):
        ro.__dlpack__()  # an unversioned tensor cannot carry the flag
    again = ctx.buffer_from_object(ro)
    assert again.__cuda_array_interface__["data"] == (b.handle, True)
    assert ctx.buffer_from_object(rw).__cuda_array_interface__["data"][1] is False
    pinned = cubuf.LegacyPinnedMemoryResource(0).allocate(64)
    host = (ctypes.c_char * 64).from_address(pinned.handle)
    assert ctx.buffer_from_object(memoryview(host).toreadonly()).__cuda_array_interface__["data"][1] is True
    assert ctx.buffer_from_object(memoryview(host)).__cuda_array_interface__["data"][1] is False
    with pytest.raises(ValueError):  # data[1] is read as a truth value
        class Bad:
            def __bool__(self):
                raise ValueError("no truth")
        ctx.buffer_from_object(type("B", (), {"__cuda_array_interface__": {
            "data": (b.handle, Bad()), "shape": (1,), "typestr": "|u1", "version": 3}})())


@pytest.mark.parametrize("direction", ["to_host", "from_host"])
def test_host_copies_hold_the_buffer_while_they_copy(ctx, drv, direction):
    """copy_to_host and copy_from_host run without the GIL: meanwhile the buffer
    is held open, so that a close on another thread is refused (BUSY) rather
    than freeing the memory being copied. A Python host function on the legacy
    stream, which the copy waits behind, tries that close."""
    b = ctx.new_buffer(64)
    b.fill(0x5a, stream=cubuf.default_stream())
    ctx.synchronize()
    gate = CloseFromHostFn(ctx, drv, b)
    if direction == "to_host":
        assert b.copy_to_host(0, gate.mark(64)) == b"\x5a" * 64
    else:
        assert b.copy_from_host(b"\x33" * 64, 0, gate.mark(64)) == 64
    ctx.synchronize()
    assert "CUBUF_ERROR_BUSY" in gate.close, gate.close
    assert b.copy_to_host() == (b"\x5a" if direction == "to_host" else b"\x33") * 64
    b.close()  # the copy is done: nothing holds it now


def registered_bytearray(drv, cls, size):
    """A bytearray (or subclass) of `size` bytes registered with the driver, and its address."""
    data = cls(b"\x07" * size)
    address = ctypes.addressof((ctypes.c_char * size).from_buffer(data))  # that export ends with the temporary
    drv.host_register(address, size)
    return data, address


def test_buffer_from_object_holds_the_export(ctx, drv):
    """A view of host memory through the buffer protocol holds the export while
    it is open: a registered bytearray cannot resize (which would move the
    memory the view reaches) until the view is closed."""
    data, address = registered_bytearray(drv, bytearray, 8192)
    try:
        v = ctx.buffer_from_object(data)
        assert v.size == 8192 and v.owner is data and v.copy_to_host(0, 4) == b"\x07" * 4
        with pytest.raises(BufferError):
            data.extend(bytes(1 << 20))
        v.close()
    finally:
        drv.host_unregister(address)
    data.extend(bytes(1 << 20))  # closed: the export is released


def test_buffer_from_object_export_cycle_is_collected(ctx, drv):
    """An exporter that holds the view made of it is collected: the GC sees the
    reference the view's export holds."""
    import gc
    import weakref

    class Exporter(bytearray):
        pass

    # Made here, not by registered_bytearray: under compute-sanitizer a finished
    # function's frame stays alive with its locals (conftest.py), and would hold data.
    data = Exporter(b"\x07" * 8192)
    anchor = (ctypes.c_char * 8192).from_buffer(data)
    address = ctypes.addressof(anchor)
    del anchor  # its export of data ends
    drv.host_register(address, 8192)
    try:
        data.view = ctx.buffer_from_object(data)
        refs = weakref.ref(data), weakref.ref(data.view)
        del data
        gc.collect()
        assert refs[0]() is None and refs[1]() is None
    finally:
        drv.host_unregister(address)


CAI_CHANGED = """
import cubuf
ctx = cubuf.Context(0)
b = ctx.new_buffer(256)
class Ptr:
    def __init__(self, owner):
        self.owner = owner
    def __int__(self):
        self.owner.cai.clear()  # frees the shape and strides the dict held
        return b.handle
class Producer:
    @property
    def __cuda_array_interface__(self):
        self.cai = {"data": (Ptr(self), False), "shape": tuple([4, 8]), "strides": tuple([64, 4]),
                    "typestr": "<u4", "version": 3, "stream": None}
        return self.cai
v = ctx.buffer_from_object(Producer())
assert (v.handle, v.size) == (b.handle, 3 * 64 + 8 * 4), (v.handle, v.size)
v.close()
b.close()
ctx.synchronize()  # freed before exit: the sanitizer's leak check runs this test too
print("ok")
"""


def test_buffer_from_object_reads_a_dict_the_producer_changes():
    """The __cuda_array_interface__ dict is read from a copy: converting its
    data pointer (__int__) may change the producer's dict. Under the debug
    allocator a freed shape tuple would be read as 0xDD bytes."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, PYTHONMALLOC="debug")
    r = subprocess.run([sys.executable, "-c", CAI_CHANGED], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_open_ipc_buffer_type_error(ctx):
    with pytest.raises(TypeError):
        ctx.open_ipc_buffer(b"handle")


def test_synchronize(ctx):
    b = ctx.new_buffer(1 << 20)
    b.fill(1, stream=cubuf.default_stream())
    ctx.synchronize()
    assert b.copy_to_host(0, 4) == b"\x01" * 4


@pytest.mark.interop
def test_numba_contexts(ctx):
    pytest.importorskip("numba.cuda")
    from numba import cuda
    if not cuda.is_available():
        pytest.skip("numba finds no CUDA device")
    c = cubuf.Context.from_numba()
    assert c.handle == ctx.handle and c.device_number == 0
    nctx = ctx.to_numba()
    assert int(getattr(nctx.handle, "value", None) or nctx.handle) == ctx.handle
    assert cubuf.Context.from_numba(nctx).handle == ctx.handle
