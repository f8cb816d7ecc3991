/*
 * cubuf IPC: sharing buffers between processes (cuda.core's
 * Buffer.ipc_descriptor / Buffer.from_ipc_descriptor and pyarrow's
 * Context.open_ipc_buffer). Included by <cubuf.h>.
 *
 * One descriptor type covers three mechanisms, chosen by the resource that
 * owns the exported buffer (a slice is exported through its root buffer and
 * keeps its offset):
 *
 *  - POOL: a stream-ordered pool made IPC-enabled (cubuf_device_resource_create
 *    with ipc_enabled, cubuf_pinned_resource_create with ipc_enabled). The
 *    descriptor carries the pool's POSIX fd (cuMemPoolExportToShareableHandle),
 *    the pointer's export data (cuMemPoolExportPointer) and a random 128-bit
 *    pool identity assigned by the exporting process. The importer imports
 *    each pool once per process, keyed by that identity, and each pointer once
 *    per pool: importing the same descriptor twice gives two buffers over one
 *    driver import, and the driver free happens when the last of them closes.
 *    The pool import is counted too: when the last buffer of an imported
 *    DEVICE pool closes, the process gives the pool import back
 *    (cuMemPoolDestroy), which closes the fd the driver holds for it and its
 *    mapping of the exporter's memory; a later descriptor of that pool
 *    imports it again. Imported PINNED (host) pools are different: they stay
 *    imported until the process exits (see "How long the memory lives").
 *  - VMM: virtual memory (<cubuf/vmm.h>) whose resource allows POSIX fd
 *    handles. The descriptor carries one fd per physical allocation that
 *    backs the buffer, in address order (cuMemExportToShareableHandle). The
 *    importer reserves one address range, maps every allocation at its offset
 *    and grants its device the access asked for in the import options.
 *  - LEGACY: cuMemAlloc memory (cubuf_sync_device_resource_create), shared
 *    with cuIpcGetMemHandle as pyarrow does, plus the buffer's offset within
 *    its allocation (pyarrow loses it). Opened with cuIpcOpenMemHandle
 *    (CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), closed with cuIpcCloseMemHandle.
 *
 * Imported buffers report cubuf_buffer_is_mapped(). They own no memory of
 * their own: they can be sliced, copied and filled, but not exported again
 * (CUBUF_ERROR_NOT_SUPPORTED; export from the process that allocated), and
 * their resource cannot allocate. They do not count in any context's
 * bytes_allocated.
 *
 * How long the memory lives (exporter E, importer I):
 *  - POOL: E's buffer owns the memory; I's buffer does not keep it alive.
 *    The driver requires every importer to close first: close I's buffer and
 *    let its deallocation stream reach the free (synchronize it) before E
 *    closes. If E closes first, E's pool may hand the same memory to its next
 *    allocation while I still reads and writes it. If E's process exits while
 *    I holds the buffer, I's close still returns (success or a driver error,
 *    never a hang), but the contents are no longer defined. I closing (or
 *    exiting) first leaves E's buffer and data intact.
 *    The pool import itself: closing I's last buffer of a device pool
 *    destroys I's import of that pool. An imported pinned pool (host memory,
 *    which I's device must be granted access to with cuMemPoolSetAccess)
 *    stays imported in I until I's process exits, even after E destroyed the
 *    pool or exited: I's pointers are still freed at each close, only the
 *    pool import stays (one driver fd plus the driver's bookkeeping per
 *    distinct exporter pool; on the H200 that bookkeeping includes device
 *    memory on both sides while the import lives: about 2 MiB in I and
 *    4 MiB in E for a 1 GiB pinned allocation, even after E destroyed its
 *    pool), and a later descriptor of the same pool reuses it. Why: with
 *    the driver this was built against (580, CUDA 13.0, H200), once a
 *    process destroys an imported pool its device was granted access to, the
 *    next pinned pool that process creates fails every allocation with
 *    CUDA_ERROR_OUT_OF_MEMORY (revoking the grant first does not help).
 *    Importing many short-lived pinned pools therefore costs an fd each: an
 *    exporter should share one long-lived pinned pool rather than create one
 *    per buffer.
 *  - VMM: the driver reference-counts physical allocations across processes;
 *    each process's mapping keeps them alive. Either order works: E closing
 *    or exiting first leaves I's mapping valid with its contents, and the
 *    memory is freed when the last process unmaps it. I closing first unmaps
 *    only I's mapping.
 *  - LEGACY: E must keep the allocation (the buffer) open until every
 *    importer has closed; the driver leaves an exporter-first cuMemFree
 *    undefined. I closing first is always safe. If E's process exits while I
 *    holds the buffer, I's close still returns, contents undefined.
 * In every mechanism the descriptor's fds are only needed until the import
 * returns: destroy the descriptor right after importing.
 *
 * Passing the fds: use cubuf_ipc_send / cubuf_ipc_recv over a Unix-domain
 * socket (SCM_RIGHTS), or hand the fds from cubuf_ipc_descriptor_serialize to
 * your own SCM_RIGHTS or pidfd_getfd(2) transport. Reopening
 * /proc/PID/fd/N does NOT work for these fds: the path names the device file,
 * not the exported object, and the import fails (on the H200 with
 * CUDA_ERROR_UNKNOWN). Sockets and pidfd_getfd pass the open file itself.
 *
 * Descriptors are untrusted input: cubuf_ipc_descriptor_deserialize and
 * cubuf_ipc_recv check every field and fd below before the descriptor
 * exists, and an import checks what only the local driver knows before it
 * maps anything. A failed import maps nothing and leaks nothing (one
 * exception, pinned pool imports: see cubuf_buffer_from_ipc_descriptor).
 */
#ifndef CUBUF_IPC_H
#define CUBUF_IPC_H
#include <sys/types.h>

#include <cubuf.h>
#ifdef __cplusplus
extern "C" {
#endif

/** What another process needs to map a buffer: bytes and owned fds. */
typedef struct cubuf_ipc_descriptor cubuf_ipc_descriptor_t;

typedef enum cubuf_ipc_mechanism {
    CUBUF_IPC_MECHANISM_POOL = 1,   /**< stream-ordered pool: pool fd + pointer export data */
    CUBUF_IPC_MECHANISM_VMM = 2,    /**< virtual memory: one fd per physical allocation */
    CUBUF_IPC_MECHANISM_LEGACY = 3, /**< cuIpcGetMemHandle of cuMemAlloc memory, no fd */
} cubuf_ipc_mechanism_t;

/*
 * Wire format, version 1. All integers little-endian; every offset below is
 * in bytes from the start of the byte string.
 *
 *  Header (48 bytes, all mechanisms)
 *     0  8  magic "CUBUFIPC" (43 55 42 55 46 49 50 43)
 *     8  2  version: 1
 *    10  2  mechanism: 1 pool, 2 vmm, 3 legacy
 *    12  4  total length of the byte string, header included
 *    16  4  number of fds that travel with it
 *    20  4  flags: bit 0 = host-accessible memory (pool only); other bits 0
 *    24  8  size: bytes of the buffer (1 .. CUBUF_IPC_MAX_EXTENT)
 *    32  8  offset: where the buffer starts within the extent
 *    40  8  extent: bytes the importer opens or maps (1 .. CUBUF_IPC_MAX_EXTENT);
 *           offset + size <= extent
 *  Pool body (total 136 bytes, 1 fd: the pool's handle)
 *    48 16  pool identity (not all zero)
 *    64  4  handle type: 1 (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
 *    68  4  reserved, 0
 *    72 64  CUmemPoolPtrExportData of the allocation; extent = its size
 *  VMM body (total 64 + 8 * count bytes, count fds: fd i is chunk i)
 *    48  4  handle type: 1 (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), or 8
 *           (CU_MEM_HANDLE_TYPE_FABRIC: the fabric variant below)
 *    52  4  count of physical allocations (chunks), 1 .. CUBUF_IPC_MAX_CHUNKS
 *    56  8  granularity: a power of two, CUBUF_IPC_MIN_GRANULARITY ..
 *           CUBUF_IPC_MAX_GRANULARITY
 *    64  8*count  chunk sizes in address order: each > 0, a multiple of
 *           the granularity, at most the extent; they add up to the extent
 *  VMM body with fabric handles (handle type 8; total 64 + 72 * count
 *  bytes, no fd): as above, then
 *    64+8*count  64*count  the CUmemFabricHandle of chunk i at
 *           64 + 8*count + 64*i, none all zero
 *  It carries no fd, so it can travel between nodes (an MPI message, a
 *  file); importing it needs an IMEX channel of the same NVLink domain.
 *  Legacy body (total 112 bytes, no fd)
 *    48 64  CUipcMemHandle of the allocation; extent = the allocation's size
 *
 * A byte string shorter or longer than its length field, a length other than
 * its mechanism's, an fd count other than the one given, a reserved field or
 * flag that is not 0, or any bound above broken: CUBUF_ERROR_INVALID_DESCRIPTOR,
 * with a detail naming the field. fds are checked too: each must be open,
 * distinct, and of a kind a CUDA handle can be (not a directory, FIFO,
 * socket, block device, O_PATH fd, or a regular file on a filesystem); the
 * detail names the chunk ("fd of chunk 3 of 5"). The driver rejects the rest
 * on import, with the same detail.
 */
#define CUBUF_IPC_WIRE_VERSION 1
#define CUBUF_IPC_HEADER_BYTES 48
#define CUBUF_IPC_POOL_BYTES 136
#define CUBUF_IPC_LEGACY_BYTES 112
#define CUBUF_IPC_VMM_BYTES(count) (64 + 8 * (size_t)(count))
#define CUBUF_IPC_VMM_FABRIC_BYTES(count) (64 + 72 * (size_t)(count))
#define CUBUF_IPC_MAX_CHUNKS 1024
#define CUBUF_IPC_MAX_BYTES CUBUF_IPC_VMM_FABRIC_BYTES(CUBUF_IPC_MAX_CHUNKS)
#define CUBUF_IPC_MAX_FDS CUBUF_IPC_MAX_CHUNKS
#define CUBUF_IPC_MAX_EXTENT ((uint64_t)1 << 44) /* 16 TiB */
#define CUBUF_IPC_MIN_GRANULARITY ((uint64_t)4096)
#define CUBUF_IPC_MAX_GRANULARITY ((uint64_t)1 << 30)

/**
 * Exports `buf` (Buffer.ipc_descriptor): *out receives a new descriptor that
 * owns fresh fds (close-on-exec) for the buffer's memory. A slice is
 * exported through its root buffer with its offset. The mechanism follows
 * the root buffer's resource: an IPC-enabled device or pinned pool, a VMM
 * resource whose handle types include POSIX fds, or the sync device resource.
 * Destroy with cubuf_ipc_descriptor_destroy.
 * Returns CUBUF_ERROR_INVALID_ARGUMENT (NULL, or a buffer of size 0),
 * CUBUF_ERROR_CLOSED (the buffer or its root is closed),
 * CUBUF_ERROR_NOT_SUPPORTED (a view, an imported buffer, a resource that is
 * not IPC-enabled or of a kind that cannot share: a user resource, the
 * caching resource, an adaptor even over a pool that can, whose detail
 * says to share a buffer of the upstream itself; a VMM buffer of more than
 * CUBUF_IPC_MAX_CHUNKS physical allocations), CUBUF_ERROR_SYSTEM (no random
 * bytes for the pool identity), CUBUF_ERROR_OUT_OF_MEMORY, CUBUF_ERROR_DRIVER.
 * Thread-safe; must not race with close of the buffer.
 */
CUBUF_API cubuf_status_t cubuf_buffer_ipc_descriptor(const cubuf_buffer_t *buf,
                                                     cubuf_ipc_descriptor_t **out);

/** Closes the descriptor's fds and frees it. NULL is a no-op. */
CUBUF_API void cubuf_ipc_descriptor_destroy(cubuf_ipc_descriptor_t *desc);

/** What a descriptor describes. Initialize with CUBUF_IPC_DESCRIPTOR_INFO_INIT. */
typedef struct cubuf_ipc_descriptor_info {
    size_t struct_size;
    cubuf_ipc_mechanism_t mechanism;
    size_t size;        /**< bytes of the buffer */
    size_t offset;      /**< start of the buffer within the extent */
    size_t extent;      /**< bytes the importer opens or maps */
    size_t fd_count;    /**< fds the descriptor owns */
    size_t chunk_count; /**< VMM: physical allocations; else 0 */
    bool host_accessible;
} cubuf_ipc_descriptor_info_t;

#define CUBUF_IPC_DESCRIPTOR_INFO_INIT {sizeof(cubuf_ipc_descriptor_info_t), CUBUF_IPC_MECHANISM_POOL, 0, 0, 0, 0, 0, false}

/** Size of the first released layout (cubuf 0.1, up to host_accessible). */
#define CUBUF_IPC_DESCRIPTOR_INFO_SIZE_V1 \
    (offsetof(cubuf_ipc_descriptor_info_t, host_accessible) + sizeof(bool))

/**
 * Fills *info up to info->struct_size (set by CUBUF_IPC_DESCRIPTOR_INFO_INIT).
 * Returns CUBUF_ERROR_INVALID_ARGUMENT for NULL or a struct_size below
 * CUBUF_IPC_DESCRIPTOR_INFO_SIZE_V1.
 */
CUBUF_API cubuf_status_t cubuf_ipc_descriptor_info(const cubuf_ipc_descriptor_t *desc,
                                                   cubuf_ipc_descriptor_info_t *info);

/** Access the importer's device gets to an imported VMM mapping. */
typedef enum cubuf_ipc_access {
    CUBUF_IPC_ACCESS_READ_WRITE = 0,
    CUBUF_IPC_ACCESS_READ = 1, /**< writes from the device fault */
} cubuf_ipc_access_t;

/** Import options. Initialize with CUBUF_IPC_IMPORT_OPTIONS_INIT. */
typedef struct cubuf_ipc_import_options {
    size_t struct_size;
    int device;                /**< device ordinal used when no context is given (default 0) */
    cubuf_ipc_access_t access; /**< VMM only; pools and legacy handles are always read-write */
} cubuf_ipc_import_options_t;

#define CUBUF_IPC_IMPORT_OPTIONS_INIT {sizeof(cubuf_ipc_import_options_t), 0, CUBUF_IPC_ACCESS_READ_WRITE}

/** Size of the first released layout (cubuf 0.1, up to access). */
#define CUBUF_IPC_IMPORT_OPTIONS_SIZE_V1 \
    (offsetof(cubuf_ipc_import_options_t, access) + sizeof(cubuf_ipc_access_t))

/**
 * Imports a buffer exported by another process (Buffer.from_ipc_descriptor).
 * `ctx` is the context to import into; NULL uses the primary context of
 * options->device. `options` may be NULL (defaults). `stream` becomes the
 * imported buffer's deallocation stream: closing an imported pool buffer
 * frees it with cuMemFreeAsync on that stream, and when it is the last
 * buffer of a device pool import, synchronizes the stream before giving the
 * pool import back (the driver never releases an imported pool destroyed
 * while a free into it is pending; a pinned pool import is kept, see above);
 * closing a VMM or legacy import synchronizes it,
 * then unmaps. A close on a capturing stream is refused with
 * CUBUF_ERROR_STREAM_CAPTURING and the buffer stays open (VMM and legacy: a
 * default stream whose synchronization would disturb a capture is skipped
 * with a warning instead). The descriptor is only read:
 * it keeps its fds, and may be imported again (a duplicate import is a second
 * buffer over the same memory; each closes on its own: a pool buffer's close
 * that leaves the memory imported for another buffer synchronizes its stream
 * instead of freeing, so that the last close's free, on its own stream, runs
 * after the work queued on each earlier close's).
 * *out is an open buffer of desc's size that reports is_mapped, device
 * accessible, with device_id the importing device (pinned pool memory: host
 * accessible too, and device_id -1 as on the exporter's side).
 * On failure nothing is imported, mapped or leaked, with one exception the
 * driver forces: a pinned pool import that was granted this device's access
 * before a later step failed stays imported, without pointers, as every
 * granted pinned pool import does (see above); a later descriptor of that
 * pool uses it.
 * Returns CUBUF_ERROR_INVALID_ARGUMENT (NULL desc or out, bad options),
 * CUBUF_ERROR_OUT_OF_RANGE (bad device ordinal), CUBUF_ERROR_INVALID_DESCRIPTOR
 * (what only the local driver can tell: a granularity this device cannot map,
 * a legacy allocation smaller than the descriptor claims, a pool pointer
 * whose memory is not the kind, device or pinned host, the descriptor says), CUBUF_ERROR_DRIVER
 * or CUBUF_ERROR_OUT_OF_MEMORY from the import steps (the detail names the
 * step and, for VMM, the chunk: "chunk 2 of 3"), CUBUF_ERROR_NO_DRIVER,
 * CUBUF_ERROR_NO_DEVICE. Thread-safe.
 */
CUBUF_API cubuf_status_t cubuf_buffer_from_ipc_descriptor(cubuf_context_t *ctx,
                                                          const cubuf_ipc_import_options_t *options,
                                                          const cubuf_ipc_descriptor_t *desc,
                                                          CUstream stream, cubuf_buffer_t **out);

/**
 * Opens any of the three mechanisms in `ctx` (pyarrow's open_ipc_buffer):
 * cubuf_buffer_from_ipc_descriptor with default options and the legacy
 * default stream as deallocation stream. Same statuses.
 */
CUBUF_API cubuf_status_t cubuf_context_open_ipc_buffer(cubuf_context_t *ctx,
                                                       const cubuf_ipc_descriptor_t *desc,
                                                       cubuf_buffer_t **out);

/**
 * Writes the descriptor as the wire format above plus its fds.
 * Query: with bytes and fds both NULL, *len and *nfds receive the sizes
 * needed and nothing else is written.
 * Otherwise *len is the capacity of `bytes` and *nfds that of `fds` (fds may
 * be NULL when the descriptor has none); on success they receive the sizes
 * used. The fd numbers written stay owned by the descriptor: they are valid
 * until it is destroyed; send them (SCM_RIGHTS) or dup them.
 * Returns CUBUF_ERROR_INVALID_ARGUMENT (NULL desc, len or nfds),
 * CUBUF_ERROR_OUT_OF_RANGE (a capacity too small; nothing is written).
 * Pure CPU; thread-safe.
 */
CUBUF_API cubuf_status_t cubuf_ipc_descriptor_serialize(const cubuf_ipc_descriptor_t *desc, void *bytes,
                                                        size_t *len, int *fds, size_t *nfds);

/**
 * Makes a descriptor from the wire format and `nfds` fds, validating every
 * field and fd first (see the wire format). On success the descriptor TAKES
 * OWNERSHIP of the fds (it closes them when destroyed); on failure the fds
 * stay the caller's, untouched and open. `fds` may be NULL when nfds is 0.
 * No driver call is made: it runs without a GPU or driver.
 * Returns CUBUF_ERROR_INVALID_DESCRIPTOR (the detail names the broken rule),
 * CUBUF_ERROR_INVALID_ARGUMENT (NULL out, NULL bytes with a length, NULL fds
 * with a count), CUBUF_ERROR_OUT_OF_MEMORY. Thread-safe.
 */
CUBUF_API cubuf_status_t cubuf_ipc_descriptor_deserialize(const void *bytes, size_t len, const int *fds,
                                                          size_t nfds, cubuf_ipc_descriptor_t **out);

/**
 * Sends the descriptor over a connected Unix-domain socket (SOCK_STREAM,
 * SOCK_SEQPACKET or SOCK_DGRAM): its bytes with its fds attached as
 * SCM_RIGHTS, at most CUBUF_IPC_FDS_PER_MESSAGE fds per sendmsg (larger
 * descriptors go in several pieces that cubuf_ipc_recv puts back together).
 * The kernel duplicates the fds: the descriptor keeps its own and stays
 * valid. Blocks until everything is queued; never raises SIGPIPE.
 * Returns CUBUF_ERROR_INVALID_ARGUMENT (NULL desc, negative socket),
 * CUBUF_ERROR_SYSTEM (sendmsg failed, e.g. EPIPE when the peer is gone; the
 * detail has strerror). Thread-safe, but concurrent sends on one stream
 * socket may interleave: serialize them.
 */
CUBUF_API cubuf_status_t cubuf_ipc_send(int socket, const cubuf_ipc_descriptor_t *desc);

#define CUBUF_IPC_FDS_PER_MESSAGE 250

/** Receive options. Initialize with CUBUF_IPC_RECV_OPTIONS_INIT. */
typedef struct cubuf_ipc_recv_options {
    size_t struct_size;
    int timeout_ms; /**< for the whole descriptor; -1 waits forever (default); 0 reads only what is already queued */
    bool check_uid; /**< require the peer's uid (SO_PEERCRED) to be `uid` */
    uid_t uid;
    bool check_pid; /**< require the peer's pid (SO_PEERCRED) to be `pid` */
    pid_t pid;
} cubuf_ipc_recv_options_t;

#define CUBUF_IPC_RECV_OPTIONS_INIT {sizeof(cubuf_ipc_recv_options_t), -1, false, 0, false, 0}

/** Size of the first released layout (cubuf 0.1, up to pid). */
#define CUBUF_IPC_RECV_OPTIONS_SIZE_V1 (offsetof(cubuf_ipc_recv_options_t, pid) + sizeof(pid_t))

/**
 * Receives one descriptor sent by cubuf_ipc_send and validates it as
 * cubuf_ipc_descriptor_deserialize does. `options` may be NULL (wait
 * forever, no credential check). The peer's credentials are those SO_PEERCRED
 * reports: the process that connected, or for socketpair() the process that
 * created the pair (for both ends). A credential mismatch reads nothing.
 * Received fds are close-on-exec; on every failure each fd received so far is
 * closed (no fd leaks on any path). A timeout before any of the descriptor
 * arrived consumes nothing (a timeout of 0 polls); a failure after part of
 * it was read (a timeout in the middle, malformed or truncated data) has
 * consumed that part, so a SOCK_STREAM connection is then at an unknown
 * place in its byte stream: close it rather than receive from it again.
 * Returns CUBUF_ERROR_INVALID_DESCRIPTOR (malformed or truncated data, more
 * fds than announced, credentials that do not match),
 * CUBUF_ERROR_SYSTEM (the peer closed the connection before sending anything
 * (detail "peer closed the connection"), the timeout passed (detail "timed
 * out"), or a socket call failed), CUBUF_ERROR_INVALID_ARGUMENT,
 * CUBUF_ERROR_OUT_OF_MEMORY. Thread-safe; one receiver per socket at a time.
 */
CUBUF_API cubuf_status_t cubuf_ipc_recv(int socket, const cubuf_ipc_recv_options_t *options,
                                        cubuf_ipc_descriptor_t **out);

#ifdef __cplusplus
}
#endif
#endif
