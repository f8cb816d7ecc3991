"""What needs no GPU: the module's names, exceptions, argument checks made
before any driver call, option classes, stream arguments, descriptors."""
import os
import pickle
import struct
import subprocess
import sys

import pytest

import cubuf


def test_names_of_both_pages():
    for name in ("Buffer", "VirtualMemoryBuffer", "VirtualMemoryResource", "VirtualMemoryResourceOptions",
                 "CopyOptions", "DeviceMemoryResource", "PinnedMemoryResource", "ManagedMemoryResource",
                 "LegacyPinnedMemoryResource", "GraphMemoryResource", "SyncDeviceMemoryResource", "Context",
                 "IPCBufferDescriptor", "CUDAError", "Stream", "from_dlpack"):
        assert hasattr(cubuf, name), name
    for name in ("close", "copy_to", "copy_from", "fill", "from_handle", "from_ipc_descriptor",
                 "set_deallocation_stream", "__dlpack__", "__dlpack_device__"):
        assert callable(getattr(cubuf.Buffer, name)), name
    for name in ("device_id", "handle", "ipc_descriptor", "is_closed", "is_device_accessible",
                 "is_host_accessible", "is_managed", "is_mapped", "memory_resource", "owner", "size",
                 "__cuda_array_interface__"):
        assert isinstance(getattr(cubuf.Buffer, name), type(cubuf.Buffer.size)), name
    for name in ("get_num_devices", "new_buffer", "buffer_from_data", "buffer_from_object", "foreign_buffer",
                 "get_device_address", "open_ipc_buffer", "synchronize", "from_numba", "to_numba"):
        assert callable(getattr(cubuf.Context, name)), name
    for name in ("bytes_allocated", "device_number", "handle"):
        assert hasattr(cubuf.Context, name), name
    assert issubclass(cubuf.VirtualMemoryBuffer, cubuf.Buffer)
    assert issubclass(cubuf.VirtualMemoryResource, cubuf.MemoryResource)
    assert issubclass(cubuf.CUDAError, RuntimeError)
    assert cubuf.__version__.count(".") == 2


def test_buffer_cannot_be_instantiated():
    with pytest.raises(RuntimeError, match="cannot be instantiated"):
        cubuf.Buffer()
    with pytest.raises(TypeError):
        cubuf.MemoryResource()


def test_cuda_error_without_a_driver():
    # Without a driver the call fails before any CUresult exists: result None.
    # A driver that cannot be loaded is one this machine does not have, GPU or not.
    code = """if True:
        import cubuf
        try:
            cubuf.get_num_devices()
        except cubuf.CUDAError as e:
            assert e.status == "CUBUF_ERROR_NO_DRIVER", e.status
            assert e.result is None and e.code == 0, (e.result, e.code)
            assert "get_num_devices: CUBUF_ERROR_NO_DRIVER:" in str(e), str(e)
        else:
            raise AssertionError("no CUDAError without a driver")
    """
    env = dict(os.environ, CUBUF_LIBCUDA="/nonexistent/libcuda.so.1")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr


def test_empty_view_and_its_attributes():
    b = cubuf.Buffer.from_handle(0, 0)
    assert (b.size, b.handle, b.is_closed, b.memory_resource, b.owner) == (0, 0, False, None, None)
    assert b.device_id == -1 and not b.is_mapped and not b.is_managed
    b.close()
    assert b.is_closed and b.size == 0
    b.close()  # closing twice is a no-op


def test_from_handle_argument_errors():
    with pytest.raises(ValueError, match="owner and mr"):
        cubuf.Buffer.from_handle(0, 0, mr=object(), owner=object())
    with pytest.raises(TypeError, match="mr must be a cubuf memory resource"):
        cubuf.Buffer.from_handle(0, 0, mr=object())
    with pytest.raises(TypeError):
        cubuf.Buffer.from_handle("0", 0)
    with pytest.raises(TypeError):
        cubuf.Buffer.from_handle(1.5, 0)
    with pytest.raises(OverflowError):
        cubuf.Buffer.from_handle(0, -1)
    with pytest.raises(OverflowError):
        cubuf.Buffer.from_handle(-4096, 0)
    with pytest.raises(TypeError, match="missing required argument 'size'"):
        cubuf.Buffer.from_handle(0)
    with pytest.raises(TypeError, match="positional"):
        cubuf.Buffer.from_handle(0, 0, None, None, 0)  # stream is keyword-only
    with pytest.raises(ValueError):  # a pointer needs a size... and size a pointer
        cubuf.Buffer.from_handle(0, 16)


def test_owner_is_kept_and_released_once():
    import sys
    owner = object()
    before = sys.getrefcount(owner)
    b = cubuf.Buffer.from_handle(0, 0, owner=owner)
    assert b.owner is owner
    assert sys.getrefcount(owner) == before + 2  # the attribute and the C buffer's release
    b.close()
    assert sys.getrefcount(owner) == before + 1
    del b
    assert sys.getrefcount(owner) == before


def test_owner_that_holds_its_buffer_is_collected():
    """A cycle through the owner (the owner holds its Buffer, whose C buffer
    holds the owner) is collected: the GC sees the C buffer's reference."""
    import gc
    import weakref

    class Owner:
        pass

    o = Owner()
    o.buf = cubuf.Buffer.from_handle(0, 0, owner=o)
    refs = weakref.ref(o), weakref.ref(o.buf)
    del o
    gc.collect()
    assert refs[0]() is None and refs[1]() is None
    # Held by something else as well, the owner stays (and so does the buffer).
    o = Owner()
    o.buf = cubuf.Buffer.from_handle(0, 0, owner=o)
    keep = o
    del o
    gc.collect()
    assert keep.buf.owner is keep and not keep.buf.is_closed


def test_fill_checks_its_value_first():
    b = cubuf.Buffer.from_handle(0, 0)
    s = cubuf.default_stream()
    with pytest.raises(OverflowError):
        b.fill(256, stream=s)
    with pytest.raises(OverflowError):
        b.fill(-1, stream=s)
    with pytest.raises(OverflowError):
        b.fill(1 << 80, stream=s)
    with pytest.raises(TypeError, match="int or support the buffer protocol"):
        b.fill("a", stream=s)
    with pytest.raises(TypeError, match="int or support the buffer protocol"):
        b.fill(1.0, stream=s)
    with pytest.raises(ValueError, match="1, 2 or 4 bytes"):
        b.fill(b"abc", stream=s)
    with pytest.raises(TypeError, match="missing required keyword-only argument 'stream'"):
        b.fill(1)
    with pytest.raises(TypeError, match="must not be None"):
        b.fill(1, stream=None)


def test_copy_argument_errors():
    b = cubuf.Buffer.from_handle(0, 0)
    s = cubuf.default_stream()
    with pytest.raises(TypeError, match="missing required keyword-only argument 'stream'"):
        b.copy_to()
    with pytest.raises(TypeError, match="missing required keyword-only argument 'stream'"):
        b.copy_from(b)
    with pytest.raises(TypeError, match="expected a cubuf.Buffer"):
        b.copy_from(bytearray(1), stream=s)
    with pytest.raises(TypeError, match="expected a cubuf.Buffer"):
        b.copy_to(bytearray(1), stream=s)
    with pytest.raises(TypeError, match="options must be a cubuf.CopyOptions"):
        b.copy_from(b, stream=s, options={"src_access_order": "stream"})
    with pytest.raises(TypeError, match="options must be a cubuf.CopyOptions"):
        b.copy_to(b, stream=s, options="stream")


def test_set_deallocation_stream_refuses_none():
    b = cubuf.Buffer.from_handle(0, 0)
    with pytest.raises(TypeError):
        b.set_deallocation_stream(None)
    with pytest.raises(TypeError):
        b.set_deallocation_stream("stream")


class CoreStream:  # cuda.core's protocol
    def __init__(self, h):
        self.h = h

    def __cuda_stream__(self):
        return (0, self.h)


class TorchStream:
    cuda_stream = 0x1234


class ExternalStream:  # CuPy's name and attribute
    ptr = 0x5678


class BindingsHandle:  # cuda.bindings' CUstream: int() converts it
    def __int__(self):
        return 0x9abc


class MemoryPointer:  # has ptr but is no stream
    ptr = 1


def test_stream_arguments():
    h = cubuf._cubuf._stream_handle
    assert h(cubuf.LEGACY_DEFAULT_STREAM) == 1 and h(cubuf.PER_THREAD_DEFAULT_STREAM) == 2
    assert h(cubuf.default_stream()) == 1
    assert h(0) == 0 and h(2) == 2 and h(0xdead0000) == 0xdead0000
    assert h(CoreStream(0x42)) == 0x42
    assert h(TorchStream()) == 0x1234
    assert h(ExternalStream()) == 0x5678
    assert h(BindingsHandle()) == 0x9abc
    for bad in (None, "1", 1.0, MemoryPointer(), object()):
        with pytest.raises(TypeError):
            h(bad)
    with pytest.raises(OverflowError):
        h(-1)
    bad_proto = CoreStream(0)
    bad_proto.__cuda_stream__ = lambda: 5
    with pytest.raises(TypeError, match="version, handle"):
        h(bad_proto)


def test_device_and_numa_attribute_errors_propagate():
    """A device_id or numa_id property that raises is the caller's error to see;
    only a missing attribute (AttributeError) is "not a device" (TypeError)."""
    class DeviceRaises:
        @property
        def device_id(self):
            raise RuntimeError("device boom")

    class NumaRaises:
        @property
        def numa_id(self):
            raise KeyError("numa boom")

    with pytest.raises(RuntimeError, match="device boom"):
        cubuf.CopyOptions(src_location_hint=DeviceRaises())
    with pytest.raises(KeyError, match="numa boom"):
        cubuf.CopyOptions(dst_location_hint=NumaRaises())
    with pytest.raises(TypeError, match="device must be an int or have device_id"):
        cubuf.CopyOptions(src_location_hint=object())


def test_stream_protocol_errors_propagate():
    """Only a missing attribute (AttributeError) means "not this protocol, try the
    next"; any other error raised while reading a stream argument is the
    caller's to see, not a TypeError "not a stream"."""
    h = cubuf._cubuf._stream_handle

    class CoreRaises:
        @property
        def __cuda_stream__(self):
            raise RuntimeError("core boom")

    class TorchInterrupted:
        @property
        def cuda_stream(self):
            raise KeyboardInterrupt

    class CupyStream:  # a type named *Stream: its ptr is read
        @property
        def ptr(self):
            raise ValueError("cupy boom")

    class MethodRaises:
        def __cuda_stream__(self):
            raise RuntimeError("method boom")

    class MissingThenTorch:  # an AttributeError from the first protocol: the next one is read
        @property
        def __cuda_stream__(self):
            raise AttributeError("__cuda_stream__")
        cuda_stream = 0x77

    with pytest.raises(RuntimeError, match="core boom"):
        h(CoreRaises())
    with pytest.raises(KeyboardInterrupt):
        h(TorchInterrupted())
    with pytest.raises(ValueError, match="cupy boom"):
        h(CupyStream())
    with pytest.raises(RuntimeError, match="method boom"):
        h(MethodRaises())
    assert h(MissingThenTorch()) == 0x77
    b = cubuf.Buffer.from_handle(0, 0)  # the same through a method taking a stream
    with pytest.raises(RuntimeError, match="core boom"):
        b.fill(1, stream=CoreRaises())


def test_copy_options():
    o = cubuf.CopyOptions()
    assert (o.src_access_order, o.src_location_hint, o.dst_location_hint, o.overlap_mode) == \
        ("stream", None, None, "default")
    o = cubuf.CopyOptions("during_api_call", cubuf.Host(), 0, "prefer_overlap_with_compute")
    assert o.src_access_order == "during_api_call" and isinstance(o.src_location_hint, cubuf.Host)
    cubuf.CopyOptions(src_access_order="any", src_location_hint=cubuf.Host(1), dst_location_hint="host")
    with pytest.raises(ValueError):
        cubuf.CopyOptions("sometimes")
    with pytest.raises(ValueError):
        cubuf.CopyOptions(overlap_mode="always")
    with pytest.raises(TypeError):
        cubuf.CopyOptions(src_access_order=1)
    with pytest.raises(ValueError):
        cubuf.CopyOptions(src_location_hint=cubuf.Host(-1))
    with pytest.raises(ValueError, match="out of range"):  # not cut to int
        cubuf.CopyOptions(src_location_hint=cubuf.Host(2**32))
    with pytest.raises(ValueError):
        cubuf.CopyOptions(dst_location_hint="device")
    with pytest.raises(TypeError):
        cubuf.CopyOptions(dst_location_hint=object())
    with pytest.raises(AttributeError):
        o.overlap_mode = "default"


def test_options_dataclasses():
    o = cubuf.VirtualMemoryResourceOptions()
    assert (o.allocation_type, o.location_type, o.handle_type, o.granularity) == \
        ("pinned", "device", None, "recommended")
    assert cubuf.DeviceMemoryResourceOptions().max_size == 0
    assert cubuf.PinnedMemoryResourceOptions(ipc_enabled=True).ipc_enabled


def legacy_wire(size=4096, offset=0, extent=8192):
    head = b"CUBUFIPC" + struct.pack("<HHIIIQQQ", 1, 3, 112, 0, 0, size, offset, extent)
    return head + bytes(range(64))


def test_descriptor_from_wire_and_pickle():
    d = cubuf.IPCBufferDescriptor._from_wire(legacy_wire(), ())
    assert (d.mechanism, d.size, d.offset, d.extent, d.fd_count, d.is_host_accessible) == \
        ("legacy", 4096, 0, 8192, 0, False)
    d2 = pickle.loads(pickle.dumps(d))
    assert d2._serialize() == d._serialize() == (legacy_wire(), ())
    with pytest.raises(TypeError):
        cubuf.IPCBufferDescriptor()


def test_descriptor_from_bad_wire_is_value_error():
    bad = bytearray(legacy_wire())
    bad[0] = ord("X")
    with pytest.raises(ValueError, match="CUBUF_ERROR_INVALID_DESCRIPTOR"):
        cubuf.IPCBufferDescriptor._from_wire(bytes(bad), ())
    with pytest.raises(ValueError, match="CUBUF_ERROR_INVALID_DESCRIPTOR"):
        cubuf.IPCBufferDescriptor._from_wire(legacy_wire(size=0), ())
    with pytest.raises(ValueError):
        cubuf.IPCBufferDescriptor._from_wire(legacy_wire()[:100], ())


def test_descriptor_from_wire_closes_fds_it_refuses():
    import os
    r, w = os.pipe()
    os.close(w)
    with pytest.raises(ValueError):
        cubuf.IPCBufferDescriptor._from_wire(legacy_wire(), (r,))  # a legacy descriptor carries no fd
    with pytest.raises(OSError):
        os.fstat(r)  # closed by the refused import: it was given away


def test_descriptor_from_wire_closes_every_fd():
    """An item that is not an fd raises, and every fd given is closed (those
    after the bad item too); a refused list that repeats an fd closes it."""
    import os
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    with pytest.raises(TypeError):
        cubuf.IPCBufferDescriptor._from_wire(legacy_wire(), (r1, "x", r2))
    for fd in (r1, r2):
        with pytest.raises(OSError):
            os.fstat(fd)
    with pytest.raises(ValueError):
        cubuf.IPCBufferDescriptor._from_wire(legacy_wire(), (w1, w1))
    with pytest.raises(OSError):
        os.fstat(w1)
    os.close(w2)


def test_descriptor_from_wire_fd_values():
    """An fd outside int's range is refused (not cut to another, open, fd that
    the refused import would close), and a list of fds that an item's
    __index__ empties is read from a snapshot."""
    import os
    r, w = os.pipe()
    try:
        with pytest.raises(ValueError, match="not a file descriptor"):
            cubuf.IPCBufferDescriptor._from_wire(legacy_wire(), [r + 2**32])
        os.fstat(r)  # still open
        with pytest.raises(ValueError, match="not a file descriptor"):
            cubuf.IPCBufferDescriptor._from_wire(legacy_wire(), [-5])
    finally:
        os.close(r)
        os.close(w)
    fds, given = [], []

    class Fd:
        def __index__(self):
            fds.clear()
            r, w = os.pipe()
            os.close(w)
            given.append(r)
            return r  # given away: closed by the refused import

    fds.extend([Fd(), Fd(), Fd()])
    with pytest.raises(ValueError, match="CUBUF_ERROR_INVALID_DESCRIPTOR"):  # a legacy descriptor carries no fd
        cubuf.IPCBufferDescriptor._from_wire(legacy_wire(), fds)
    assert len(given) == 3
    for fd in given:
        with pytest.raises(OSError):
            os.fstat(fd)
