"""VirtualMemoryResource and VirtualMemoryBuffer: growth, aliasing, options, close rules."""
import pytest

import cubuf

pytestmark = pytest.mark.gpu


def test_allocate_rounds_to_granularity():
    mr = cubuf.VirtualMemoryResource(0)
    g = mr.granularity
    assert g > 0 and g & (g - 1) == 0
    b = mr.allocate(1, stream=None)
    assert isinstance(b, cubuf.VirtualMemoryBuffer) and b.size == g and b.memory_resource is mr
    empty = mr.allocate(0)
    assert empty.size == 0 and not empty.is_closed
    assert mr.config is None


def test_grow_aliases_and_keeps_data():
    mr = cubuf.VirtualMemoryResource(0)
    g = mr.granularity
    a = mr.allocate(g)
    a.fill(0x11, stream=cubuf.default_stream())
    b = mr.modify_allocation(a, 3 * g)
    assert isinstance(b, cubuf.VirtualMemoryBuffer) and b.size == 3 * g and not a.is_closed
    assert b.copy_to_host(0, 16) == b"\x11" * 16  # the old bytes, not copied
    b.fill(0x22, stream=cubuf.default_stream())
    assert a.copy_to_host(0, 16) == b"\x22" * 16  # a write through either is seen through the other
    same = mr.modify_allocation(b, g)  # not larger: the same range
    assert (same.handle, same.size) == (b.handle, b.size)
    a.close()  # the grown buffer still maps the memory
    assert b.copy_to_host(0, 4) == b"\x22" * 4
    same.close()
    b.close()
    assert mr.stats["current_bytes"] == 0


def test_modify_allocation_errors():
    mr = cubuf.VirtualMemoryResource(0)
    other = cubuf.DeviceMemoryResource(0).allocate(4096)
    with pytest.raises(ValueError, match="CUBUF_ERROR_INVALID_ARGUMENT"):
        mr.modify_allocation(other, 1 << 22)
    with pytest.raises(TypeError):
        mr.modify_allocation(bytearray(1), 1 << 22)
    a = mr.allocate(1)
    a.close()
    with pytest.raises(RuntimeError, match="CUBUF_ERROR_CLOSED"):
        mr.modify_allocation(a, 1 << 22)
    b = mr.allocate(1)
    with pytest.raises(ValueError, match="CUBUF_ERROR_INVALID_ARGUMENT"):
        mr.modify_allocation(b, 1 << 22, cubuf.VirtualMemoryResourceOptions(granularity="minimum",
                                                                              location_type="host"))
    grown = mr.modify_allocation(b, 1 << 22, cubuf.VirtualMemoryResourceOptions(peer_access="r"))
    assert grown.size >= 1 << 22


def test_options_are_checked():
    O = cubuf.VirtualMemoryResourceOptions
    for bad in (O(allocation_type="paged"), O(location_type="gpu"), O(handle_type="win32"),
                O(granularity="huge"), O(self_access="w")):
        with pytest.raises(ValueError):
            cubuf.VirtualMemoryResource(0, bad)
    with pytest.raises(TypeError):
        cubuf.VirtualMemoryResource(0, O(allocation_type=1))
    with pytest.raises(ValueError, match="CUBUF_ERROR_INVALID_ARGUMENT"):
        cubuf.VirtualMemoryResource(0, O(addr_align=3))
    with pytest.raises(ValueError, match="CUBUF_ERROR_INVALID_ARGUMENT"):
        cubuf.VirtualMemoryResource(0, O(peers=(0,)))  # its own device
    with pytest.raises(ValueError, match="location_id"):  # not cut to int
        cubuf.VirtualMemoryResource(0, O(location_type="host_numa", location_id=2**32))
    with pytest.raises(ValueError, match="CUBUF_ERROR_OUT_OF_RANGE"):
        cubuf.VirtualMemoryResource(999)
    cfg = O(granularity="minimum", handle_type="posix_fd")
    mr = cubuf.VirtualMemoryResource(0, cfg)
    assert mr.config is cfg and mr.is_ipc_enabled


def test_peers_list_changed_while_it_is_read():
    """Reading a peer (its device_id) runs Python code, which may empty the
    list the options hold: the devices are read from a snapshot."""
    peers = []

    class Dev:
        @property
        def device_id(self):
            peers.clear()
            return 0

    peers.extend([Dev(), Dev(), Dev()])
    with pytest.raises(ValueError, match="CUBUF_ERROR_INVALID_ARGUMENT"):  # device 0 is its own device
        cubuf.VirtualMemoryResource(0, cubuf.VirtualMemoryResourceOptions(peers=peers))
    assert peers == []


def test_host_location_is_host_accessible():
    try:
        mr = cubuf.VirtualMemoryResource(0, cubuf.VirtualMemoryResourceOptions(location_type="host_numa"))
    except RuntimeError as e:  # a device or driver without host VMM locations says so
        assert "CUBUF_ERROR_NOT_SUPPORTED" in str(e)
        pytest.skip(str(e))
    b = mr.allocate(1)
    assert b.is_host_accessible and b.is_device_accessible and b.device_id == -1


def test_close_on_capturing_stream_raises_and_stays_open(drv, stream):
    mr = cubuf.VirtualMemoryResource(0)
    b = mr.allocate(1)
    b.fill(5, stream=stream)
    with drv.capture(stream):
        with pytest.raises(RuntimeError, match="CUBUF_ERROR_STREAM_CAPTURING"):
            b.close(stream)
        assert not b.is_closed
    assert b.copy_to_host(0, 2, stream=stream) == b"\x05\x05"
    b.close(stream)
    assert b.is_closed and mr.stats["current_bytes"] == 0


def test_vmm_buffer_cannot_be_adopted():
    mr = cubuf.VirtualMemoryResource(0)
    b = mr.allocate(1)
    with pytest.raises(ValueError, match="CUBUF_ERROR_INVALID_ARGUMENT"):
        cubuf.Buffer.from_handle(b.handle, b.size, mr)
