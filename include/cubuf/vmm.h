/*
 * cubuf virtual memory: VirtualMemoryResource and VirtualMemoryBuffer.
 * Included by <cubuf.h>; see the general rules at the top of that header.
 *
 * A virtual memory (VMM) resource allocates with the driver's virtual memory
 * management: it reserves addresses (cuMemAddressReserve), creates physical
 * allocations (cuMemCreate), maps them (cuMemMap) and grants access
 * (cuMemSetAccess). Its buffers can grow without copying:
 * cubuf_vmm_modify_allocation maps new physical memory right after the old
 * range when those addresses are free, and otherwise maps the existing
 * physical allocations again into a larger range elsewhere.
 *
 * Ranges and aliasing. A buffer made by the resource, and every buffer
 * cubuf_vmm_modify_allocation makes from it (directly or from one of those),
 * share one reference-counted range: the reservations, physical allocations
 * and mappings behind all of them. modify_allocation never changes or closes
 * the buffer it is given; the new buffer aliases it:
 *  - grown in place, the new buffer has the same pointer and maps the same
 *    physical memory at the same addresses, plus the new part after it;
 *  - grown by moving, the new buffer has another pointer and maps the same
 *    physical memory again at its new addresses; the old buffer keeps its
 *    own mapping. A write through either is seen through the other.
 * Each mapping and reservation lives while a buffer that covers it is open;
 * a physical allocation is freed when the last buffer that maps it closes.
 *
 * Close rules (cubuf_buffer_close, cubuf_buffer_close_on, the last
 * cubuf_buffer_release). Unmapping is synchronous and cannot be captured:
 *  - A close whose deallocation stream (recorded, or given to close_on) is
 *    not a default stream and is capturing fails with
 *    CUBUF_ERROR_STREAM_CAPTURING and leaves the buffer open, as it was.
 *  - A close that unmaps nothing (other open buffers still map all of its
 *    memory, as for the old buffer after a grow in place) does not wait on
 *    the host: it records an event on its deallocation stream, and the work
 *    queued there before the close is waited for by the close that later
 *    unmaps that memory. The stream may be destroyed right after the close.
 *  - A close that releases memory (the last buffer over a mapping) waits
 *    (cuStreamSynchronize) for its deallocation stream, for the deallocation
 *    streams recorded by the other open buffers of the range, and for the
 *    work the range's earlier closes recorded, before it unmaps. A
 *    non-default stream among the open buffers' that is capturing makes the
 *    close fail with CUBUF_ERROR_STREAM_CAPTURING, leaving everything as it
 *    was.
 *  - A default stream (0, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD) whose use
 *    would disturb a capture in its context is neither synchronized nor
 *    recorded: the warning handler receives CUBUF_ERROR_STREAM_CAPTURING
 *    with a message, and the memory is unmapped without waiting for the
 *    work on that stream. A default stream is checked when memory is
 *    released: a close that unmaps nothing and cannot record its default
 *    stream warns of nothing and leaves it to the closes that later unmap,
 *    each of which synchronizes it if no capture is in the way by then
 *    (else warns, as above), until one has.
 *  - Unmapping runs with the calling thread's capture mode relaxed, so that a
 *    capture in progress elsewhere in the process is not invalidated by it.
 *  - A failed close leaves the buffer open and its data intact: every
 *    mapping it removed is restored. Once the mappings are gone, releasing
 *    the physical allocations and reservations can no longer fail the close
 *    (a failing call is tried again, then reported to the warning handler).
 *  - When the last cubuf_buffer_release cannot close a buffer (a capturing
 *    stream), the warning handler is told and the buffer leaves its range.
 *    Its address space stays mapped (work on that stream may still use it),
 *    and what it maps is lost: memory only it mapped, and memory a buffer
 *    grown from it by moving maps too (which stays allocated, and counted,
 *    after that buffer closes). Where the buffers share one space (a grow in
 *    place), the memory is freed when the last of them closes. Nothing else
 *    is kept: cubuf frees its bookkeeping of the lost space and releases the
 *    physical allocations' handles once no other space maps them (the
 *    driver frees such memory when its mappings go, which cubuf never does).
 *
 * Statistics (cubuf_resource_stats) count physical memory, which aliases
 * share: current_bytes is the size of the live physical allocations,
 * current_count their number, total_allocations the number of physical
 * allocations made for buffers so far. A buffer that aliases another adds
 * nothing.
 *
 * Sizes are rounded up to the resource's granularity (cubuf_vmm_granularity);
 * a buffer reports its rounded size. Allocating size 0 gives an open, empty
 * buffer and makes no driver call. The resource reserves more address space
 * than it maps (at least 4 GiB, and room to double), so that most grows need
 * no new reservation; this costs address space only, never memory, but it
 * bounds the number of live VMM buffers: about 30000 small ones fill the
 * 128 TiB of address space a process has.
 *
 * Deallocation streams order nothing here (virtual memory operations are
 * synchronous): they are the streams whose work an unmap waits for.
 * cubuf_buffer_set_deallocation_stream may be called on a buffer while its
 * aliases are closed from other threads.
 *
 * cubuf_buffer_wrap(ptr, size, vmm_resource, ...) is refused with
 * CUBUF_ERROR_INVALID_ARGUMENT, changing nothing: the resource frees only
 * ranges it allocated, since a close must know which aliases still map the
 * memory. Wrap memory mapped elsewhere with cubuf_buffer_wrap_external.
 */
#ifndef CUBUF_VMM_H
#define CUBUF_VMM_H
#include <cubuf.h>
#ifdef __cplusplus
extern "C" {
#endif

/** The most peer devices one options struct can name. */
#define CUBUF_VMM_MAX_PEERS 16

/** Means "the natural id for the location" in cubuf_vmm_options_t::location_id. */
#define CUBUF_VMM_LOCATION_ID_DEFAULT (-1)

/** What kind of physical memory backs the buffer. */
typedef enum cubuf_vmm_allocation_type {
    CUBUF_VMM_ALLOCATION_PINNED = 0, /**< pinned: never migrates (CU_MEM_ALLOCATION_TYPE_PINNED) */
    CUBUF_VMM_ALLOCATION_MANAGED,    /**< managed (CU_MEM_ALLOCATION_TYPE_MANAGED, CUDA 13); host accessible */
} cubuf_vmm_allocation_type_t;

/** Where the physical memory lives. */
typedef enum cubuf_vmm_location {
    CUBUF_VMM_LOCATION_DEVICE = 0,        /**< the resource's device; location_id: -1 or that ordinal */
    CUBUF_VMM_LOCATION_HOST,              /**< host memory, no NUMA node; location_id: -1 */
    CUBUF_VMM_LOCATION_HOST_NUMA,         /**< host NUMA node location_id; -1: the node closest to the device */
    CUBUF_VMM_LOCATION_HOST_NUMA_CURRENT, /**< the NUMA node of the thread that allocates; location_id: -1 */
} cubuf_vmm_location_t;

/** How physical allocations can be exported to other processes. */
typedef enum cubuf_vmm_handle_type {
    CUBUF_VMM_HANDLE_NONE = 0,  /**< not exportable */
    CUBUF_VMM_HANDLE_POSIX_FD,  /**< one POSIX file descriptor per allocation (see <cubuf/ipc.h>) */
    CUBUF_VMM_HANDLE_FABRIC,    /**< fabric handles (multi-node NVLink; needs an IMEX channel) */
    CUBUF_VMM_HANDLE_POSIX_FD_FABRIC, /**< both (what NCCL's ncclMemAlloc asks for) */
} cubuf_vmm_handle_type_t;

/** Which granularity sizes and addresses are rounded to. */
typedef enum cubuf_vmm_granularity_kind {
    CUBUF_VMM_GRANULARITY_RECOMMENDED = 0, /**< CU_MEM_ALLOC_GRANULARITY_RECOMMENDED */
    CUBUF_VMM_GRANULARITY_MINIMUM,         /**< CU_MEM_ALLOC_GRANULARITY_MINIMUM */
} cubuf_vmm_granularity_kind_t;

/** Access a device gets to the mappings. */
typedef enum cubuf_vmm_access {
    CUBUF_VMM_ACCESS_READ_WRITE = 0, /**< CU_MEM_ACCESS_FLAGS_PROT_READWRITE */
    CUBUF_VMM_ACCESS_READ,           /**< CU_MEM_ACCESS_FLAGS_PROT_READ */
    CUBUF_VMM_ACCESS_NONE,           /**< no access is granted */
} cubuf_vmm_access_t;

/**
 * Options of a virtual memory resource (cuda.core VirtualMemoryResourceOptions).
 * Initialize with CUBUF_VMM_OPTIONS_INIT and change the fields you need.
 */
typedef struct cubuf_vmm_options {
    size_t struct_size;                      /**< sizeof(cubuf_vmm_options_t), set by the _INIT macro */
    cubuf_vmm_allocation_type_t allocation_type; /**< default PINNED */
    cubuf_vmm_location_t location;           /**< default DEVICE */
    int location_id;                         /**< see cubuf_vmm_location_t; default -1 */
    cubuf_vmm_handle_type_t handle_type;     /**< default NONE; POSIX_FD to share buffers (ipc.h) */
    cubuf_vmm_granularity_kind_t granularity; /**< default RECOMMENDED */
    bool gpu_direct_rdma;                    /**< request GPUDirect RDMA capable memory */
    CUdeviceptr address_hint;                /**< where to try to reserve; 0: anywhere. A multiple of the granularity */
    size_t address_alignment;                /**< 0 or a power of two; never less than the granularity */
    int peers[CUBUF_VMM_MAX_PEERS];          /**< other devices granted peer_access */
    unsigned peer_count;                     /**< entries of peers used, at most CUBUF_VMM_MAX_PEERS */
    cubuf_vmm_access_t owner_access;         /**< the resource's device; default READ_WRITE */
    cubuf_vmm_access_t peer_access;          /**< each peer; default READ_WRITE */
} cubuf_vmm_options_t;

#define CUBUF_VMM_OPTIONS_INIT                                                              \
    {sizeof(cubuf_vmm_options_t), CUBUF_VMM_ALLOCATION_PINNED, CUBUF_VMM_LOCATION_DEVICE,   \
     CUBUF_VMM_LOCATION_ID_DEFAULT, CUBUF_VMM_HANDLE_NONE, CUBUF_VMM_GRANULARITY_RECOMMENDED, \
     false, 0, 0, {0}, 0, CUBUF_VMM_ACCESS_READ_WRITE, CUBUF_VMM_ACCESS_READ_WRITE}

/** Size of the first released layout (cubuf 0.1, up to peer_access). */
#define CUBUF_VMM_OPTIONS_SIZE_V1 \
    (offsetof(cubuf_vmm_options_t, peer_access) + sizeof(cubuf_vmm_access_t))

/**
 * Creates a virtual memory resource for device `ordinal`
 * (cuda.core VirtualMemoryResource). `options` may be NULL (defaults:
 * pinned device memory, not exportable, recommended granularity, read-write
 * for the device). The options are copied and validated, each field with a
 * message naming it.
 *
 * What the buffers are: device memory is device accessible (device_id is
 * `ordinal`); memory at a host location is host accessible and, through the
 * mapping granted to `ordinal`, device accessible (device_id -1); managed
 * memory is managed, host and device accessible. A buffer is device
 * accessible only if owner_access is not NONE. Buffers are IPC-enabled when
 * handle_type is not NONE.
 *
 * Fabric fallback: where handle_type asks for fabric handles (FABRIC or
 * POSIX_FD_FABRIC) and the device or the driver refuses them (no multi-node
 * NVLink: CUDA_ERROR_NOT_SUPPORTED; no IMEX channel:
 * CUDA_ERROR_NOT_PERMITTED, as on an H200), the resource is made with POSIX
 * fd handles instead, as NCCL does: cubuf_vmm_resource_options then reports
 * handle_type POSIX_FD, cubuf_resource_fabric_fallback (<cubuf/dist.h>) says
 * true, and the warning handler is not called. Pass those options (or NULL)
 * to cubuf_vmm_modify_allocation. Where POSIX fds are refused too, creation
 * fails with CUBUF_ERROR_NOT_SUPPORTED.
 *
 * Release with cubuf_resource_release; buffers keep their resource alive.
 * Thread-safety: the resource may be used from any number of threads.
 *
 * Returns:
 *  - CUBUF_ERROR_INVALID_ARGUMENT: out is NULL; options->struct_size is
 *    below CUBUF_VMM_OPTIONS_SIZE_V1; an enum field out of
 *    range; peer_count above CUBUF_VMM_MAX_PEERS; a peer equal to `ordinal`
 *    or named twice; address_alignment not a power of two; address_hint not
 *    a multiple of the granularity; a location_id the location does not
 *    take; handle_type other than NONE with the HOST location.
 *  - CUBUF_ERROR_OUT_OF_RANGE: `ordinal` or a peer is not a device (the
 *    message names the valid range).
 *  - CUBUF_ERROR_NOT_SUPPORTED: the device lacks virtual memory management;
 *    gpu_direct_rdma, POSIX fd handles, or the host location are not
 *    supported by the device, or the driver refuses them (managed
 *    allocations the driver cannot create; fabric handles fall back, see
 *    above);
 *    a peer cannot access the device's memory.
 *  - CUBUF_ERROR_NO_DRIVER, CUBUF_ERROR_NO_DEVICE, CUBUF_ERROR_OUT_OF_MEMORY,
 *    CUBUF_ERROR_DRIVER.
 */
CUBUF_API cubuf_status_t cubuf_vmm_resource_create(int ordinal, const cubuf_vmm_options_t *options,
                                                   cubuf_resource_t **out);

/**
 * Returns, in *out, a new buffer of at least `new_size` bytes that aliases
 * `buf` (VirtualMemoryResource.modify_allocation). `buf` stays open, is not
 * changed and keeps working; see "Ranges and aliasing" above. The data of
 * `buf` is never copied.
 *  - new_size (rounded up to the granularity) at most buf's size: the new
 *    buffer covers exactly what `buf` covers (same pointer, same size); no
 *    reservation, allocation or mapping is made. Options, when given, are
 *    still checked first, and checking peers queries the devices.
 *  - larger: the new part is new physical memory of (new_size rounded) minus
 *    buf's size bytes. If the addresses right after `buf` are free (already
 *    reserved by the range, or reservable there now), only the new part is
 *    mapped and only it is granted access: the cost follows the new part,
 *    not the total. Otherwise a larger range is reserved elsewhere, every
 *    physical allocation of `buf` is mapped into it, followed by the new
 *    part, and access is set on that whole range.
 *  - `buf` empty (size 0): a fresh allocation of new_size bytes (or another
 *    empty buffer for new_size 0).
 * The new buffer has buf's deallocation stream and is released by the
 * caller (cubuf_buffer_release).
 *
 * `options` may be NULL (the resource's). Given, it applies to the new part
 * alone: gpu_direct_rdma, owner_access, peers and peer_access for the new
 * physical memory, address_hint and address_alignment for a range reserved
 * elsewhere. Its allocation_type, location, location_id, handle_type and
 * granularity must be the resource's (a range has one kind of memory and
 * one granularity); existing memory keeps the access it was given.
 *
 * Thread-safety: buffers that alias one another may be grown and closed from
 * different threads at once; `buf` itself must not be closed meanwhile.
 *
 * Returns:
 *  - CUBUF_ERROR_INVALID_ARGUMENT: a NULL argument; `res` is not a virtual
 *    memory resource; `buf` was not made by `res` (another resource, a
 *    slice, a view); options invalid (as for cubuf_vmm_resource_create) or
 *    changing what must stay the resource's.
 *  - CUBUF_ERROR_CLOSED: `buf` is closed.
 *  - CUBUF_ERROR_OUT_OF_RANGE: new_size rounded up to the granularity does
 *    not fit in size_t; a peer is not a device.
 *  - CUBUF_ERROR_NOT_SUPPORTED: gpu_direct_rdma without device support; a
 *    peer cannot access the memory.
 *  - CUBUF_ERROR_OUT_OF_MEMORY (physical memory or address space),
 *    CUBUF_ERROR_DRIVER. On any error nothing was reserved, created or
 *    mapped, and `buf` is as it was.
 */
CUBUF_API cubuf_status_t cubuf_vmm_modify_allocation(cubuf_resource_t *res, cubuf_buffer_t *buf,
                                                     size_t new_size,
                                                     const cubuf_vmm_options_t *options,
                                                     cubuf_buffer_t **out);

/**
 * The granularity (bytes) the resource rounds sizes and addresses to.
 * Returns CUBUF_ERROR_INVALID_ARGUMENT for NULL arguments or a resource that
 * is not a virtual memory resource.
 */
CUBUF_API cubuf_status_t cubuf_vmm_granularity(const cubuf_resource_t *res, size_t *granularity);

/**
 * Copies the resource's options into *options as the resource applies them:
 * location_id resolved (the device ordinal for DEVICE, the NUMA node for
 * HOST_NUMA, -1 otherwise) and address_alignment at least the granularity, up to
 * options->struct_size (set by CUBUF_VMM_OPTIONS_INIT). Returns
 * CUBUF_ERROR_INVALID_ARGUMENT for NULL arguments, a struct_size below
 * CUBUF_VMM_OPTIONS_SIZE_V1, or a resource that is not a virtual
 * memory resource.
 */
CUBUF_API cubuf_status_t cubuf_vmm_resource_options(const cubuf_resource_t *res,
                                                    cubuf_vmm_options_t *options);

#ifdef __cplusplus
}
#endif
#endif
