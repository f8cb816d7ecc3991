"""Zero-copy interop with PyTorch, CuPy, Numba and JAX on a real GPU: writes
through the consumer seen through the cubuf buffer and the reverse,
lifetimes both ways, and the stream handoff of __dlpack__."""
import gc
import os
import sys
import time
import types

import pytest

import cubuf

np = pytest.importorskip("numpy")

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX must leave the device to the others

pytestmark = [pytest.mark.gpu, pytest.mark.interop]

N = 1 << 20


MR = None  # the resource every device_buffer comes from, made on the first test


def device_buffer(value, stream=None):
    s = stream or cubuf.default_stream()
    b = MR.allocate(N, stream=s)
    b.fill(value, stream=s)
    return b


def _count_drops_to(n, seconds=10):
    """Whether MR's count of live buffers falls to n or below within `seconds` (a framework may let
    go on a thread of its own)."""
    deadline = time.monotonic() + seconds
    while True:
        gc.collect()
        cubuf.default_stream().sync()
        if MR.stats["current_count"] <= n:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


@pytest.fixture(autouse=True)
def buffers_released(request):
    """Once a test that passed has let go of its objects, every buffer it made is released: a
    consumer's tensor, array or capsule, or a stream handoff, that kept one past its test would be a
    leak. Frameworks may let go on a thread of their own (JAX), so the check waits for that up to
    10 s. A test that failed or skipped is not checked: its frame, kept for the report, holds its
    buffers."""
    global MR
    if MR is None:
        MR = cubuf.DeviceMemoryResource(0)
    before = MR.stats["current_count"]  # what earlier, failed tests still hold
    yield
    # (conftest.py's pytest_runtest_call has cleared the test's frame if something kept it)
    if getattr(request.node, "cubuf_passed", False) and not _count_drops_to(before):
        left = MR.stats["current_count"] - before
        pytest.fail(f"{left} buffer(s) of the test still allocated; {_holders()}")


def _holders():
    """Who refers to the live Python buffers (for the message of a failed check)."""
    me = sys._getframe()
    held = [o for o in gc.get_objects() if issubclass(type(o), cubuf.Buffer)]
    lines = []
    for b in held:
        refs = []
        for r in gc.get_referrers(b):
            if r is held or r is me:
                continue
            refs.append(f"frame {r.f_code.co_name}:{r.f_lineno}" if type(r) is types.FrameType
                        else type(r).__name__)
        # getrefcount's argument, the loop's name and `held` are 3 of its references
        lines.append(f"{sys.getrefcount(b) - 3} reference(s) from {refs}")
    return f"{len(held)} live Python buffer(s): " + "; ".join(lines)


# ---- PyTorch ----------------------------------------------------------------------

def test_torch_from_dlpack_shares_memory():
    torch = pytest.importorskip("torch")
    b = device_buffer(3)
    t = torch.from_dlpack(b)
    assert t.device.type == "cuda" and t.dtype == torch.uint8 and t.shape == (N,)
    assert t.data_ptr() == b.handle
    assert int(t[:16].sum()) == 3 * 16          # the buffer's bytes
    t.fill_(9)                                   # a write through torch ...
    torch.cuda.synchronize()
    assert b.copy_to_host(0, 8) == b"\x09" * 8   # ... seen through cubuf
    b.fill(4, stream=cubuf.default_stream())     # and the reverse
    assert int(t[-4:].sum()) == 16
    with pytest.raises(RuntimeError, match="CUBUF_ERROR_BUSY"):
        b.close()                                # torch's tensor still uses the memory
    mr = b.memory_resource
    del b                                        # the tensor keeps it alive
    assert int(t[:2].sum()) == 8
    del t
    torch.cuda.synchronize()
    cubuf.default_stream().sync()
    assert mr.stats["current_count"] == 0


def test_torch_tensor_into_cubuf_keeps_it_alive():
    torch = pytest.importorskip("torch")
    t = torch.arange(256, dtype=torch.int32, device="cuda")
    ptr = t.data_ptr()
    b = cubuf.from_dlpack(t)
    assert (b.handle, b.size, b.device_id) == (ptr, 1024, 0)
    del t                                        # the buffer holds torch's tensor
    torch.cuda.synchronize()
    assert np.frombuffer(b.copy_to_host(), dtype=np.int32).tolist() == list(range(256))
    b.fill(0, stream=cubuf.default_stream())
    back = torch.from_dlpack(b)                  # torch's memory, through cubuf, back to torch
    assert back.data_ptr() == ptr and int(back.sum()) == 0
    b.close()  # a view of the imported tensor: the export holds the tensor, not the view
    assert int(back.sum()) == 0
    del back


def test_torch_stream_handoff():
    torch = pytest.importorskip("torch")
    s = cubuf.Stream(0)
    b = device_buffer(0, s)
    b.fill(7, stream=s)                          # queued on cubuf's stream
    ts = torch.cuda.Stream()
    with torch.cuda.stream(ts):
        t = torch.from_dlpack(b)                 # torch passes ts: ts waits for s
        total = int(t.sum())
    assert total == 7 * N
    s.sync()


def test_torch_cuda_array_interface():
    torch = pytest.importorskip("torch")
    b = device_buffer(2)
    t = torch.as_tensor(b, device="cuda")
    assert t.data_ptr() == b.handle and int(t[:4].sum()) == 8
    ctx = cubuf.Context(0)
    m = torch.zeros((8, 16), dtype=torch.uint8, device="cuda")
    col = ctx.buffer_from_object(m[:, 3])        # non-contiguous: the enclosing span
    assert col.handle == m.data_ptr() + 3 and col.size == 7 * 16 + 1 and col.owner is not None


# ---- CuPy ---------------------------------------------------------------------------

def test_cupy_both_ways():
    cp = pytest.importorskip("cupy")
    b = device_buffer(5)
    a = cp.from_dlpack(b)
    assert a.data.ptr == b.handle and int(a[:10].sum()) == 50
    c = cp.asarray(b)                            # through __cuda_array_interface__
    assert c.data.ptr == b.handle
    c[:] = 6
    cp.cuda.runtime.deviceSynchronize()
    assert b.copy_to_host(0, 4) == b"\x06" * 4
    del a, c
    x = cp.arange(64, dtype=cp.float32)
    xb = cubuf.from_dlpack(x)
    assert xb.handle == x.data.ptr and xb.size == 256
    del x
    assert np.frombuffer(xb.copy_to_host(), dtype=np.float32).tolist() == list(range(64))
    y = cp.zeros((4, 8), dtype=cp.uint16)
    v = cubuf.Context(0).buffer_from_object(y[:, ::2])
    assert v.handle == y.data.ptr and v.size == 3 * 16 + 6 * 2 + 2
    s = cp.cuda.Stream(non_blocking=True)
    assert cubuf._cubuf._stream_handle(s) == s.ptr
    b.fill(1, stream=s)
    s.synchronize()


# ---- Numba --------------------------------------------------------------------------

def test_numba_as_cuda_array():
    pytest.importorskip("numba.cuda")
    from numba import cuda
    if not cuda.is_available():
        pytest.skip("numba finds no CUDA device")
    b = device_buffer(8)
    d = cuda.as_cuda_array(b)
    assert d.__cuda_array_interface__["data"][0] == b.handle
    assert d.copy_to_host()[:4].tolist() == [8] * 4
    d.copy_to_device(np.full(N, 11, dtype=np.uint8))
    cuda.synchronize()
    assert b.copy_to_host(0, 4) == b"\x0b" * 4
    na = cuda.to_device(np.arange(16, dtype=np.int64))
    nb = cubuf.Context(0).buffer_from_object(na)
    assert nb.handle == na.__cuda_array_interface__["data"][0] and nb.size == 128
    assert np.frombuffer(nb.copy_to_host(), dtype=np.int64).tolist() == list(range(16))
    ctx = cubuf.Context.from_numba()
    assert ctx.handle == cubuf.Context(0).handle


# ---- JAX ------------------------------------------------------------------------------

def test_jax_from_dlpack():
    jax = pytest.importorskip("jax")
    import jax.dlpack
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        pytest.skip("JAX has no GPU backend")
    b = device_buffer(12)
    j = jax.dlpack.from_dlpack(b)
    assert j.shape == (N,) and int(j[:4].sum()) == 48
    assert j.unsafe_buffer_pointer() == b.handle  # the same memory, not a copy
    live = MR.stats["current_count"]
    del b                                          # JAX's array keeps the memory
    assert MR.stats["current_count"] == live and int(j[-4:].sum()) == 48
    j.delete()                                     # JAX lets go of it: cubuf's DLPack deleter runs
    assert _count_drops_to(live - 1), f"JAX's delete() left the buffer ({len(jax.live_arrays())} live arrays)"
    arr = jax.numpy.arange(32, dtype=jax.numpy.int32)
    jb = cubuf.from_dlpack(arr)
    assert np.frombuffer(jb.copy_to_host(), dtype=np.int32).tolist() == list(range(32))
