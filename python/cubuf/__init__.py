"""cubuf for Python: CUDA memory through libcubuf.

The classes follow two reference APIs name by name: cuda.core's Buffer,
VirtualMemoryBuffer and memory resources, and pyarrow.cuda's Context. Every
method is one call into the C extension (cubuf._cubuf); this file only adds
the option classes, which are read once when a resource is made, and the
reduction that lets multiprocessing carry an IPCBufferDescriptor's file
descriptors.
"""
from dataclasses import dataclass, field
from typing import Iterable, Optional
import multiprocessing.reduction as _mpr

from ._cubuf import (  # noqa: F401
    CUDAError, CUDAWarning, Stream, LEGACY_DEFAULT_STREAM, PER_THREAD_DEFAULT_STREAM, default_stream,
    Buffer, VirtualMemoryBuffer, MemoryResource, DeviceMemoryResource, PinnedMemoryResource,
    ManagedMemoryResource, LegacyPinnedMemoryResource, SyncDeviceMemoryResource,
    GraphMemoryResource, CachingMemoryResource, VirtualMemoryResource, Context, IPCBufferDescriptor, CopyOptions,
    from_dlpack, get_num_devices, driver_version, __version__,
)


@dataclass
class DeviceMemoryResourceOptions:
    """Options of a private stream-ordered pool (DeviceMemoryResource(device, options)).

    max_size 0 means the driver's limit; release_threshold None keeps every freed byte cached."""
    ipc_enabled: bool = False
    max_size: int = 0
    release_threshold: Optional[int] = None


@dataclass
class PinnedMemoryResourceOptions:
    """Options of PinnedMemoryResource: ipc_enabled makes the pool exportable."""
    ipc_enabled: bool = False


@dataclass
class ManagedMemoryResourceOptions:
    """Options of ManagedMemoryResource: preferred_location a device, -1 the host, None none."""
    preferred_location: Optional[int] = None


@dataclass
class CachingMemoryResourceOptions:
    """Options of CachingMemoryResource: max_cached_size 0 means cubuf's default (64 MiB);
    release_threshold None keeps every cached byte; cross_stream reuses blocks across streams."""
    max_cached_size: int = 0
    release_threshold: Optional[int] = None
    cross_stream: bool = True


@dataclass
class VirtualMemoryResourceOptions:
    """Options of VirtualMemoryResource (cuda.core's names; cubuf's defaults).

    allocation_type: "pinned" or "managed"; location_type: "device", "host", "host_numa" or
    "host_numa_current" (location_id: the NUMA node, None for the natural one); handle_type:
    None, "posix_fd" (to share buffers with other processes) or "fabric"; granularity:
    "recommended" or "minimum"; self_access and peer_access: "rw", "r" or "none"; peers:
    devices granted peer_access."""
    allocation_type: str = "pinned"
    location_type: str = "device"
    handle_type: Optional[str] = None
    granularity: str = "recommended"
    gpu_direct_rdma: bool = False
    addr_hint: Optional[int] = 0
    addr_align: Optional[int] = None
    peers: Iterable[int] = field(default_factory=tuple)
    self_access: str = "rw"
    peer_access: str = "rw"
    location_id: Optional[int] = None


class Host:
    """A host location hint for CopyOptions: numa_id None for the host, an int for a NUMA node."""
    __slots__ = ("numa_id",)

    def __init__(self, numa_id: Optional[int] = None):
        self.numa_id = numa_id

    def __repr__(self):
        return f"cubuf.Host(numa_id={self.numa_id!r})"


def _rebuild_descriptor(data, dupfds):
    fds = [d.detach() for d in dupfds]
    return IPCBufferDescriptor._from_wire(data, fds)


def _reduce_descriptor(desc):
    # multiprocessing duplicates each fd for the receiver (DupFd: passed to a
    # child being spawned, or through its resource sharer afterwards).
    data, fds = desc._serialize()
    return _rebuild_descriptor, (data, [_mpr.DupFd(fd) for fd in fds])


_mpr.ForkingPickler.register(IPCBufferDescriptor, _reduce_descriptor)
