/*
 * cubuf for distributed engines: memory handed to network cards (dma-buf),
 * what a registration cache keys on (base, extent, handle types, RDMA
 * capability), and descriptors fetched from another process by pid
 * (pidfd_getfd). Include <cubuf/dist.h> after (or instead of) <cubuf.h>.
 * docs/DISTRIBUTED.md shows how UCX, libfabric, MPI and NCCL use them.
 *
 * The general rules of <cubuf.h> hold: statuses returned, out-parameters
 * written only on success, struct_size rules for every struct here, and
 * every function thread-safe (it must not race with a close of the buffer
 * it is given).
 */
#ifndef CUBUF_DIST_H
#define CUBUF_DIST_H
#include <sys/types.h>

#include <cubuf.h>
#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------ */
/* What a device offers                                                      */
/* ------------------------------------------------------------------------ */

/** Device capabilities for distributed engines. Initialize with CUBUF_DIST_CAPS_INIT. */
typedef struct cubuf_dist_caps {
    size_t struct_size;
    bool dmabuf;              /**< device memory exports as dma-buf (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED) */
    bool dmabuf_host_alloc;   /**< cuMemHostAlloc memory too (CU_DEVICE_ATTRIBUTE_HOST_ALLOC_DMA_BUF_SUPPORTED) */
    bool gpu_direct_rdma;     /**< CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED */
    bool gpu_direct_rdma_vmm; /**< RDMA-capable VMM memory (CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED) */
    bool fabric_handles;      /**< the device knows fabric handles (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED);
                                   whether an IMEX channel lets this process create them shows
                                   only when memory is made (see cubuf_vmm_resource_create) */
} cubuf_dist_caps_t;

#define CUBUF_DIST_CAPS_INIT {sizeof(cubuf_dist_caps_t), false, false, false, false, false}

/** Size of the first released layout (up to fabric_handles). */
#define CUBUF_DIST_CAPS_SIZE_V1 (offsetof(cubuf_dist_caps_t, fabric_handles) + sizeof(bool))

/**
 * Fills *caps for device `ordinal` up to caps->struct_size (five
 * cuDeviceGetAttribute queries). Returns CUBUF_ERROR_INVALID_ARGUMENT (NULL,
 * struct_size below CUBUF_DIST_CAPS_SIZE_V1), CUBUF_ERROR_OUT_OF_RANGE (not
 * a device; the detail names the valid range), CUBUF_ERROR_NO_DRIVER,
 * CUBUF_ERROR_NO_DEVICE, CUBUF_ERROR_DRIVER.
 */
CUBUF_API cubuf_status_t cubuf_device_dist_caps(int ordinal, cubuf_dist_caps_t *caps);

/* ------------------------------------------------------------------------ */
/* dma-buf export                                                            */
/* ------------------------------------------------------------------------ */

/** Options of a dma-buf export. Initialize with CUBUF_DMABUF_OPTIONS_INIT. */
typedef struct cubuf_dmabuf_options {
    size_t struct_size;
    /** Map the dma-buf through the PCIe BAR1 aperture
     *  (CU_MEM_RANGE_FLAG_DMA_BUF_MAPPING_TYPE_PCIE); false (default): the
     *  driver's choice. Where the platform has no such mapping the export
     *  is refused (on the H200, driver 580: CUBUF_ERROR_NOT_SUPPORTED). */
    bool pcie_mapping;
} cubuf_dmabuf_options_t;

#define CUBUF_DMABUF_OPTIONS_INIT {sizeof(cubuf_dmabuf_options_t), false}

/** Size of the first released layout (up to pcie_mapping). */
#define CUBUF_DMABUF_OPTIONS_SIZE_V1 (offsetof(cubuf_dmabuf_options_t, pcie_mapping) + sizeof(bool))

/** An exported dma-buf. Initialize with CUBUF_DMABUF_INIT (sets struct_size). */
typedef struct cubuf_dmabuf {
    size_t struct_size;
    int fd;            /**< the dma-buf; owned by the caller, who closes it (close-on-exec) */
    uint64_t offset;   /**< where the buffer's first byte lies in the dma-buf */
    uint64_t size;     /**< bytes of the dma-buf (a multiple of the host page size;
                            lseek(fd, 0, SEEK_END) gives it too) */
    CUdeviceptr base;  /**< device address of the dma-buf's first byte (page aligned) */
} cubuf_dmabuf_t;

#define CUBUF_DMABUF_INIT {sizeof(cubuf_dmabuf_t), -1, 0, 0, 0}

/** Size of the first released layout (up to base). */
#define CUBUF_DMABUF_SIZE_V1 (offsetof(cubuf_dmabuf_t, base) + sizeof(CUdeviceptr))

/**
 * Exports the memory that holds `buf` as a dma-buf file descriptor
 * (cuMemGetHandleForAddressRange, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD), the
 * form in which RDMA engines register GPU memory with a network card
 * (ibv_reg_dmabuf_mr(pd, out->offset, size, iova, out->fd, access);
 * libfabric's fi_mr_regattr with FI_MR_DMABUF; UCT's uct_md_mem_reg with
 * dmabuf_fd and dmabuf_offset; see docs/DISTRIBUTED.md).
 *
 * What is exported: the page-aligned span of the memory the buffer lies in,
 * so that out->offset + cubuf_buffer_size(buf) <= out->size:
 *  - memory of an allocation the driver knows as one (cuMemAlloc, pool
 *    allocations, context buffers, views of them): the allocation
 *    (cuMemGetAddressRange; for pinned host memory, which it does not know,
 *    CU_POINTER_ATTRIBUTE_RANGE_START_ADDR / RANGE_SIZE), its start rounded
 *    down and its end rounded up to the host page size, as NCCL, UCX and
 *    libfabric do. For a small pool allocation that span can cover bytes of
 *    the neighbouring allocations of the same pool;
 *  - virtual memory (<cubuf/vmm.h>), slices included, and buffers of
 *    adaptors and caching resources over a VMM resource: the buffer's own
 *    mapping of every physical allocation it overlaps, as one dma-buf over
 *    the whole range (the driver accepts a range of several physical
 *    allocations, measured with two on the H200, driver 580). After a grow,
 *    export the new buffer again: the old dma-buf covers the old range only.
 * The fd is new and the caller's: close it when the engine no longer needs
 * it (an RDMA registration holds the dma-buf itself, so the fd may be closed
 * right after registering). Deregister before closing the buffer: the
 * driver does not document what a dma-buf of freed memory reaches. Each
 * call gives a new fd.
 * `options` may be NULL (defaults).
 *
 * Which memory: device memory of a device whose cubuf_dist_caps_t::dmabuf is
 * true; pinned host memory from cuMemHostAlloc (the legacy pinned resource)
 * where dmabuf_host_alloc is true, as the driver documents.
 *
 * Returns:
 *  - CUBUF_ERROR_INVALID_ARGUMENT: buf or out NULL, struct_size of options
 *    or out below its first layout, a buffer of size 0, memory no device
 *    can reach (pageable host memory the driver does not know, virtual
 *    memory made with owner_access NONE).
 *  - CUBUF_ERROR_CLOSED: buf is closed.
 *  - CUBUF_ERROR_NOT_SUPPORTED: managed memory (the driver documents no
 *    dma-buf of it); pinned host memory from a pool or from virtual memory
 *    (only cuMemHostAlloc memory is documented); the device lacks dma-buf
 *    support for the kind (the detail names the attribute); pcie_mapping
 *    where the platform has no PCIe mapping; a driver without
 *    cuMemGetHandleForAddressRange (before 11.7); a buffer that spans more
 *    than the one allocation the driver reports.
 *  - CUBUF_ERROR_SYSTEM: close-on-exec could not be set (the fd is closed).
 *  - CUBUF_ERROR_OUT_OF_MEMORY (virtual memory: the list of physical
 *    allocations), CUBUF_ERROR_NO_DRIVER, CUBUF_ERROR_DRIVER (the detail
 *    names the span).
 * On failure no fd is open. Thread-safe; must not race with a close of buf.
 */
CUBUF_API cubuf_status_t cubuf_buffer_export_dmabuf(const cubuf_buffer_t *buf,
                                                    const cubuf_dmabuf_options_t *options,
                                                    cubuf_dmabuf_t *out);

/* ------------------------------------------------------------------------ */
/* What a registration cache keys on                                         */
/* ------------------------------------------------------------------------ */

/**
 * The memory behind a buffer, as a registration cache sees it. Initialize
 * with CUBUF_MEMORY_INFO_INIT.
 *  - base, extent: the allocation the buffer lies in (for virtual memory:
 *    the buffer's own mapping of the physical allocations it overlaps); the
 *    buffer is [base + offset, base + offset + size). A VMM grow in place
 *    (cubuf_vmm_modify_allocation whose result has the old pointer) keeps
 *    base and the mapping of the old part: a registration of the old range
 *    stays valid, and the new buffer's extent adds the new part. A grow that
 *    moves gives another base.
 *  - handle_types: the CUmemAllocationHandleType bits every physical
 *    allocation of the span can be exported as
 *    (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, CU_MEM_HANDLE_TYPE_FABRIC;
 *    0: none). For virtual memory, the types its physical allocations were
 *    created with (after a fabric fallback: POSIX fd); for other memory,
 *    the driver's CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES.
 *  - gpu_direct_rdma: every physical allocation of the span is GPUDirect
 *    RDMA capable (VMM memory made with gpu_direct_rdma; other memory: the
 *    driver's CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE).
 *  - allocation_count: the physical allocations behind the span (VMM: one
 *    per cuMemCreate it overlaps; else 1), the indices
 *    cubuf_buffer_physical_allocation takes.
 *  - buffer_id: CU_POINTER_ATTRIBUTE_BUFFER_ID at the buffer's pointer: the
 *    driver's process-wide id of the allocation, which a new allocation at
 *    the same address does not repeat (0 where the driver gives none).
 */
typedef struct cubuf_memory_info {
    size_t struct_size;
    CUdeviceptr base;
    size_t extent;
    size_t offset;
    unsigned handle_types;
    bool gpu_direct_rdma;
    size_t allocation_count;
    unsigned long long buffer_id;
} cubuf_memory_info_t;

#define CUBUF_MEMORY_INFO_INIT {sizeof(cubuf_memory_info_t), 0, 0, 0, 0, false, 0, 0}

/** Size of the first released layout (up to buffer_id). */
#define CUBUF_MEMORY_INFO_SIZE_V1 \
    (offsetof(cubuf_memory_info_t, buffer_id) + sizeof(unsigned long long))

/**
 * Fills *info for `buf` up to info->struct_size (base and extent as
 * cubuf_buffer_export_dmabuf finds them, before the page rounding). One
 * cuPointerGetAttributes call; plus, for virtual memory, one
 * cuMemGetAllocationPropertiesFromHandle per physical allocation, else one
 * cuMemGetAddressRange and one cuPointerGetAttribute (RDMA capability).
 * Returns CUBUF_ERROR_INVALID_ARGUMENT (NULL, struct_size too small, a
 * buffer of size 0, host-only memory the driver does not know),
 * CUBUF_ERROR_CLOSED, CUBUF_ERROR_NOT_SUPPORTED (a driver without
 * cuMemGetAllocationPropertiesFromHandle, for virtual memory; a buffer that
 * spans more than the one allocation the driver reports),
 * CUBUF_ERROR_OUT_OF_MEMORY, CUBUF_ERROR_DRIVER. Thread-safe; must not race
 * with a close of buf.
 */
CUBUF_API cubuf_status_t cubuf_buffer_memory_info(const cubuf_buffer_t *buf, cubuf_memory_info_t *info);

/** One physical allocation behind a buffer. Initialize with CUBUF_PHYSICAL_INFO_INIT. */
typedef struct cubuf_physical_info {
    size_t struct_size;
    CUdeviceptr base;      /**< where the buffer's mapping has the allocation's first byte */
    size_t size;           /**< bytes of the allocation */
    unsigned handle_types; /**< as cubuf_memory_info_t, for this allocation */
    bool gpu_direct_rdma;  /**< as cubuf_memory_info_t, for this allocation */
} cubuf_physical_info_t;

#define CUBUF_PHYSICAL_INFO_INIT {sizeof(cubuf_physical_info_t), 0, 0, 0, false}

/** Size of the first released layout (up to gpu_direct_rdma). */
#define CUBUF_PHYSICAL_INFO_SIZE_V1 (offsetof(cubuf_physical_info_t, gpu_direct_rdma) + sizeof(bool))

/**
 * Fills *info for physical allocation `index` (0 .. allocation_count - 1 of
 * cubuf_buffer_memory_info, in address order) behind `buf`. For memory that
 * is not virtual memory, index 0 is the allocation itself (base and extent
 * of cubuf_buffer_memory_info). Statuses as cubuf_buffer_memory_info, and
 * CUBUF_ERROR_OUT_OF_RANGE for an index past the last allocation.
 */
CUBUF_API cubuf_status_t cubuf_buffer_physical_allocation(const cubuf_buffer_t *buf, size_t index,
                                                          cubuf_physical_info_t *info);

/* ------------------------------------------------------------------------ */
/* Fabric handles                                                            */
/* ------------------------------------------------------------------------ */

/**
 * Whether `res` was asked for fabric handles (cubuf_vmm_options_t::handle_type
 * FABRIC or POSIX_FD_FABRIC; a private pool's
 * cubuf_device_resource_options_t::fabric) and, because the device or the
 * driver refused them (no multi-node NVLink, no IMEX channel), makes its
 * memory with POSIX fd handles instead: *fell_back true. false for every
 * resource that got what it asked for, and for resources that cannot ask
 * (cuMemAlloc, managed, user resources, adaptors). Costs no driver call.
 * Returns CUBUF_ERROR_INVALID_ARGUMENT for NULL.
 */
CUBUF_API cubuf_status_t cubuf_resource_fabric_fallback(const cubuf_resource_t *res, bool *fell_back);

/* ------------------------------------------------------------------------ */
/* Descriptors fetched by pid                                                */
/* ------------------------------------------------------------------------ */

/**
 * Makes a descriptor from the wire format `bytes` (as
 * cubuf_ipc_descriptor_serialize wrote them in process `pid`) and the fd
 * numbers `fds` it wrote there, taking a copy of each fd out of process
 * `pid` with pidfd_getfd(2) instead of receiving them over a socket. The
 * exporter keeps its descriptor (whose fds these are) alive until the
 * importer has returned from this call; how the bytes, the fd numbers and
 * the pid travel is the caller's (a pipe, shared memory, MPI). The result
 * is then validated as by cubuf_ipc_descriptor_deserialize and owns the
 * fetched fds (close-on-exec); import it with
 * cubuf_buffer_from_ipc_descriptor.
 *
 * The kernel (Linux 5.6 or newer) allows pidfd_getfd where the caller may
 * ptrace `pid` (PTRACE_MODE_ATTACH_REALCREDS: the same user with
 * kernel.yama.ptrace_scope 0, the exporter's parent under scope 1, or
 * CAP_SYS_PTRACE). Many containers forbid it: then use cubuf_ipc_send /
 * cubuf_ipc_recv, which need no such permission.
 *
 * Returns:
 *  - CUBUF_ERROR_INVALID_ARGUMENT: out NULL, pid <= 0, NULL bytes with a
 *    length, NULL fds with a count.
 *  - CUBUF_ERROR_INVALID_DESCRIPTOR: what cubuf_ipc_descriptor_deserialize
 *    refuses, more than CUBUF_IPC_MAX_FDS fds, or an fd number that is not
 *    open in `pid` (the detail names it).
 *  - CUBUF_ERROR_SYSTEM: the kernel refuses (EPERM: no permission to take
 *    fds from `pid`, the detail says so and names the socket path; ESRCH:
 *    no such process) or a system call failed; the detail has strerror.
 *  - CUBUF_ERROR_NOT_SUPPORTED: the kernel (or a seccomp filter) has no
 *    pidfd_open/pidfd_getfd (ENOSYS).
 *  - CUBUF_ERROR_OUT_OF_MEMORY.
 * On failure every fd fetched so far is closed. No driver call is made.
 * Thread-safe.
 */
CUBUF_API cubuf_status_t cubuf_ipc_descriptor_from_pid(pid_t pid, const void *bytes, size_t len,
                                                       const int *fds, size_t nfds,
                                                       cubuf_ipc_descriptor_t **out);

#ifdef __cplusplus
}
#endif
#endif
