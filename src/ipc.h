/* The IPC descriptor, shared by ipc_wire.c (bytes, fds, sockets; pure CPU)
 * and ipc.c (export and import through the driver). Private. */
#ifndef CUBUF_IPC_PRIVATE_H
#define CUBUF_IPC_PRIVATE_H

#include <stdint.h>

#include "internal.h"

enum {
    CUBUF__IPC_FLAG_HOST_ACCESSIBLE = 1u << 0,
    CUBUF__IPC_KNOWN_FLAGS = CUBUF__IPC_FLAG_HOST_ACCESSIBLE,
    CUBUF__IPC_HANDLE_POSIX_FD = 1, /* CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR on the wire */
    CUBUF__IPC_HANDLE_FABRIC = 8,   /* CU_MEM_HANDLE_TYPE_FABRIC on the wire (VMM only) */
    CUBUF__IPC_FABRIC_HANDLE_BYTES = 64, /* sizeof(CUmemFabricHandle) */
};

struct cubuf_ipc_descriptor {
    cubuf_ipc_mechanism_t mechanism;
    uint32_t flags;  /* CUBUF__IPC_FLAG_* */
    uint64_t size;   /* bytes of the buffer */
    uint64_t offset; /* start of the buffer within the extent */
    uint64_t extent; /* bytes opened or mapped by the importer */
    int *fds;        /* owned, closed on destroy */
    size_t nfds;
    uint32_t handle_type; /* pool and VMM: CUBUF__IPC_HANDLE_POSIX_FD */
    /* pool */
    uint8_t pool_id[16];
    uint8_t export_data[64]; /* CUmemPoolPtrExportData */
    /* VMM: chunk i is backed by fds[i] */
    uint64_t granularity;
    uint64_t *chunk_sizes; /* owned */
    size_t nchunks;
    /* VMM with handle_type CUBUF__IPC_HANDLE_FABRIC (and no fds): chunk i's
     * CUmemFabricHandle at fabric_handles + 64 * i (owned) */
    uint8_t *fabric_handles;
    /* legacy */
    uint8_t ipc_handle[64]; /* CUipcMemHandle */
};

/* A zeroed descriptor of `mechanism`, with room for `nfds` fds (all -1) and,
 * for VMM, `nfds` chunk sizes. */
cubuf_status_t cubuf__ipc_desc_new(cubuf_ipc_mechanism_t mechanism, size_t nfds,
                                   cubuf_ipc_descriptor_t **out);

/* A zeroed VMM descriptor with fabric handles: room for `nchunks` chunk
 * sizes and fabric handles, no fd. */
cubuf_status_t cubuf__ipc_desc_new_fabric(size_t nchunks, cubuf_ipc_descriptor_t **out);

/* One physical allocation's fabric handle, out of (export) and into
 * (import) the driver (fabric.c): cuMemExportToShareableHandle /
 * cuMemImportFromShareableHandle with CU_MEM_HANDLE_TYPE_FABRIC. */
cubuf_status_t cubuf__ipc_fabric_export(CUmemGenericAllocationHandle handle,
                                        uint8_t out[CUBUF__IPC_FABRIC_HANDLE_BYTES]);
cubuf_status_t cubuf__ipc_fabric_import(const uint8_t in[CUBUF__IPC_FABRIC_HANDLE_BYTES],
                                        CUmemGenericAllocationHandle *handle);

/* Checks every rule of the wire format on a descriptor (fields and fds).
 * Import runs it again on descriptors that did not come from the wire. */
cubuf_status_t cubuf__ipc_desc_validate(const cubuf_ipc_descriptor_t *desc);

/* The export_ipc entries of the resource vtables: a descriptor for
 * [offset, offset+size) of root through each mechanism. */
cubuf_status_t cubuf__ipc_export_pool(const cubuf_buffer_t *root, uint64_t offset, size_t size,
                                      cubuf_ipc_descriptor_t **out);
cubuf_status_t cubuf__ipc_export_vmm(const cubuf_buffer_t *root, uint64_t offset, size_t size,
                                     cubuf_ipc_descriptor_t **out);
cubuf_status_t cubuf__ipc_export_legacy(const cubuf_buffer_t *root, uint64_t offset, size_t size,
                                        cubuf_ipc_descriptor_t **out);

/* How many imports are waiting right now for a dying import of their pool
 * to be destroyed (ipc.c, import_pool). For tests: the moment an import
 * races a close. */
unsigned cubuf__ipc_pool_imports_waiting(void);

/* Marks an fd close-on-exec (the driver's fds are not; cubuf's are, so they
 * never leak into programs the caller starts); false, errno set, if fcntl
 * refuses. */
bool cubuf__set_cloexec(int fd);

#endif
