"""IPC descriptors between processes through multiprocessing, for each
mechanism (pool, VMM, legacy): as a Process argument (fds duplicated for the
spawned child) and through a Queue (fds passed by multiprocessing's resource
sharer); plain pickle for descriptors without fds."""
import multiprocessing as mp
import os
import pickle

import pytest

import cubuf

import ipc_child

pytestmark = pytest.mark.gpu


def exporters():
    return {
        "pool": ("device", lambda: cubuf.DeviceMemoryResource(0, cubuf.DeviceMemoryResourceOptions(ipc_enabled=True))),
        "pinned_pool": ("pinned", lambda: cubuf.PinnedMemoryResource(cubuf.PinnedMemoryResourceOptions(ipc_enabled=True))),
        "vmm": ("vmm", lambda: cubuf.VirtualMemoryResource(0, cubuf.VirtualMemoryResourceOptions(handle_type="posix_fd"))),
        "legacy": ("sync", lambda: cubuf.SyncDeviceMemoryResource(0)),
    }


def make(kind):
    mr_kind, factory = exporters()[kind]
    try:
        mr = factory()
    except RuntimeError as e:
        if "CUBUF_ERROR_NOT_SUPPORTED" in str(e):
            pytest.skip(f"{kind} IPC: {e}")
        raise
    return mr_kind, mr


def run_child(desc_or_queue, mr_kind, expect, write, via_context=False):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    p = ctx.Process(target=ipc_child.import_and_write, args=(desc_or_queue, mr_kind, expect, write, results, via_context))
    p.start()
    return p, results


@pytest.mark.parametrize("route", ["argument", "queue"])
@pytest.mark.parametrize("kind", sorted(exporters()))
def test_ipc_through_multiprocessing(kind, route):
    mr_kind, mr = make(kind)
    s = cubuf.Stream(0)
    b = mr.allocate(1 << 16, stream=s)
    b.fill(0x3C, stream=s)
    s.sync()
    desc = b.ipc_descriptor
    assert desc is b.ipc_descriptor  # cached
    assert desc.size == b.size and desc.mechanism == {"legacy": "legacy", "vmm": "vmm"}.get(kind, "pool")
    assert (desc.fd_count == 0) == (kind == "legacy")
    if route == "argument":
        p, results = run_child(desc, mr_kind, 0x3C, 0x77)
    else:
        q = mp.get_context("spawn").Queue()
        p, results = run_child(q, mr_kind, 0x3C, 0x77)
        q.put(desc)
    status, seen_ok, mapped = results.get(timeout=120)
    p.join(60)
    assert status == "ok", seen_ok
    assert seen_ok and mapped and p.exitcode == 0
    assert b.copy_to_host(0, 8, stream=s) == b"\x77" * 8  # the child's write
    b.close(s)
    s.sync()


def test_descriptor_owns_its_fds():
    _, mr = make("vmm")
    b = mr.allocate(1)
    desc = b.ipc_descriptor
    data, fds = desc._serialize()
    assert len(fds) == desc.fd_count >= 1
    ids = [os.fstat(fd).st_ino for fd in fds]
    del b, desc  # the buffer held the cached descriptor: both gone, the fds are closed
    for fd, ino in zip(fds, ids):
        try:
            assert os.fstat(fd).st_ino != ino
        except OSError:
            pass


def test_open_ipc_buffer_in_a_child_context():
    _, mr = make("pool")
    b = mr.allocate(4096)
    b.fill(0x10, stream=cubuf.default_stream())
    cubuf.default_stream().sync()
    p, results = run_child(b.ipc_descriptor, "device", 0x10, 0x20, via_context=True)
    status, seen_ok, mapped = results.get(timeout=120)
    p.join(60)
    assert status == "ok" and seen_ok and mapped, seen_ok
    assert b.copy_to_host(0, 4) == b"\x20" * 4


def test_pickle_needs_multiprocessing_for_fds():
    _, mr = make("pool")
    b = mr.allocate(4096)
    with pytest.raises(TypeError, match="file descriptor"):
        pickle.dumps(b.ipc_descriptor)
    legacy = cubuf.SyncDeviceMemoryResource(0).allocate(4096)
    d = pickle.loads(pickle.dumps(legacy.ipc_descriptor))
    assert d._serialize() == legacy.ipc_descriptor._serialize()


def test_import_in_the_same_process_is_mapped():
    _, mr = make("vmm")
    b = mr.allocate(1)
    b.fill(0x42, stream=cubuf.default_stream())
    imp = cubuf.Buffer.from_ipc_descriptor(mr, b.ipc_descriptor, stream=cubuf.default_stream())
    assert imp.is_mapped and imp.memory_resource is mr and imp.copy_to_host(0, 2) == b"\x42\x42"
    imp.close()
    with pytest.raises(TypeError):
        cubuf.Buffer.from_ipc_descriptor(object(), b.ipc_descriptor, stream=0)
    with pytest.raises(TypeError):
        cubuf.Buffer.from_ipc_descriptor(mr, b"x", stream=0)
    with pytest.raises(TypeError, match="stream"):
        cubuf.Buffer.from_ipc_descriptor(mr, b.ipc_descriptor)


def test_closed_buffer_has_no_descriptor():
    # Buffer.ipc_descriptor returned its cached descriptor after close (one of freed
    # memory), while a buffer closed before the first ask raised
    mr = cubuf.DeviceMemoryResource(0, cubuf.DeviceMemoryResourceOptions(ipc_enabled=True))
    b = mr.allocate(64)
    assert b.ipc_descriptor is b.ipc_descriptor
    b.close()
    with pytest.raises(RuntimeError, match="closed"):
        b.ipc_descriptor
