"""Child side of test_ipc.py (imported by spawned processes): imports a
buffer from a descriptor, checks the exporter's bytes, writes its own,
closes, and reports through a queue."""
import cubuf


def import_and_write(desc, mr_kind, expect, write, results, via_context=False):
    try:
        if not isinstance(desc, cubuf.IPCBufferDescriptor):  # sent through the queue instead
            desc = desc.get(timeout=60)
        s = cubuf.Stream(0)
        if via_context:
            b = cubuf.Context(0).open_ipc_buffer(desc)
        else:
            mr = {"device": lambda: cubuf.DeviceMemoryResource(0),
                  "pinned": lambda: cubuf.PinnedMemoryResource(),
                  "sync": lambda: cubuf.SyncDeviceMemoryResource(0),
                  "vmm": lambda: cubuf.VirtualMemoryResource(0)}[mr_kind]()
            b = cubuf.Buffer.from_ipc_descriptor(mr, desc, stream=s)
        seen = b.copy_to_host(0, 4, stream=s)
        mapped = b.is_mapped
        b.fill(write, stream=s)
        s.sync()
        b.close()
        s.sync()
        del desc
        results.put(("ok", seen == bytes([expect]) * 4, mapped))
    except BaseException as e:  # report, never hang the parent
        results.put(("error", repr(e), False))
