/*
 * cubuf — a C11 library for CUDA memory.
 *
 * This header is the manual. Every function documents its parameters, who
 * owns what, its thread-safety and every status it returns.
 *
 * General rules (they hold for every function unless its entry says more):
 *  - Every function returns a cubuf_status_t; results go through
 *    out-parameters, which are written only on CUBUF_SUCCESS.
 *  - On failure, cubuf_last_error() describes what happened on this thread
 *    (which driver call failed, its error name, the sizes involved), and
 *    cubuf_last_cuda_result() gives the CUresult when a driver call failed.
 *  - NULL where a handle or out-parameter is required gives
 *    CUBUF_ERROR_INVALID_ARGUMENT. destroy(NULL) and release(NULL) are no-ops.
 *  - No driver is linked: libcuda.so.1 is loaded at first use. Without one,
 *    every call that needs it returns CUBUF_ERROR_NO_DRIVER.
 *  - Work that needs a CUDA context runs with that context pushed and pops it
 *    afterwards: the caller's current context is the same after the call, on
 *    success and on failure.
 *  - A failed call leaves its inputs as they were and leaks nothing.
 *  - Structs that begin with `size_t struct_size` may grow: initialize them
 *    with their _INIT macro (which sets struct_size). Any struct_size from
 *    the type's first released layout (CUBUF_<TYPE>_SIZE_V1) up is accepted;
 *    below it is CUBUF_ERROR_INVALID_ARGUMENT, with a detail naming the type
 *    and the sizes. Options given with a smaller struct_size than this
 *    library's get the defaults for the fields they lack, and bytes past
 *    what this library knows are ignored; a struct the library fills is
 *    written only up to its struct_size. So a program built against an older
 *    or a newer header keeps working.
 *  - Functions are thread-safe unless their entry says otherwise; using one
 *    buffer from several threads while another thread closes it is the
 *    caller's race to prevent (as on the cuda.core page).
 *  - Resources, adaptors and the caching resource guard their counts with
 *    locks that cost no atomic instruction while one thread uses them; the
 *    first call from a second thread makes them shared for good, once, with
 *    membarrier(2) (a few microseconds). CUBUF_LOCK_BIAS=0 in the
 *    environment when cubuf loads (or a kernel without membarrier) makes
 *    every lock shared from the start. A process in which membarrier worked
 *    when cubuf loaded and fails later (a seccomp filter installed after)
 *    cannot share a lock safely: it stops with a message.
 *
 * Streams are plain CUstream values: 0 or CU_STREAM_LEGACY (the legacy
 * default stream), CU_STREAM_PER_THREAD, or a stream the caller created
 * (cubuf_stream_create in <cubuf/stream.h> makes one without linking
 * libcuda). A stream in capture mode plays the role of cuda.core's
 * GraphBuilder.
 *
 * Virtual memory (VirtualMemoryResource) is in <cubuf/vmm.h>, sharing between
 * processes in <cubuf/ipc.h>, streams and events in <cubuf/stream.h>; all are
 * included below.
 */
#ifndef CUBUF_H
#define CUBUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define CUBUF_API
#else
#define CUBUF_API __attribute__((visibility("default")))
#endif

/* ------------------------------------------------------------------------ */
/* Version                                                                   */
/* ------------------------------------------------------------------------ */

/* CUBUF_VERSION_MAJOR, _MINOR and _PATCH, generated from CMakeLists.txt. While
 * the major version is 0, every minor release may change the ABI (soname
 * libcubuf.so.0.MINOR); from 1.0 on only a major release does (libcubuf.so.MAJOR). */
#include <cubuf/version.h>
/** MAJOR*10000 + MINOR*100 + PATCH, as cubuf_version() returns it. */
#define CUBUF_VERSION \
    (CUBUF_VERSION_MAJOR * 10000 + CUBUF_VERSION_MINOR * 100 + CUBUF_VERSION_PATCH)

/** The version of the library loaded at run time (compare with CUBUF_VERSION). */
CUBUF_API int cubuf_version(void);
/** The same, as "MAJOR.MINOR.PATCH". The string is static. */
CUBUF_API const char *cubuf_version_string(void);

/* ------------------------------------------------------------------------ */
/* Status codes and errors                                                   */
/* ------------------------------------------------------------------------ */

/* X(name, value, description). Values never change and are never reused. */
#define CUBUF_STATUS_MAP(X)                                                      \
    X(SUCCESS, 0, "success")                                                     \
    X(ERROR_INVALID_ARGUMENT, 1, "invalid argument")                             \
    X(ERROR_OUT_OF_RANGE, 2, "value or position out of range")                   \
    X(ERROR_CLOSED, 3, "buffer is closed")                                       \
    X(ERROR_NOT_SUPPORTED, 4, "not supported by this driver or device")          \
    X(ERROR_STREAM_CAPTURING, 5, "not allowed while the stream is capturing")    \
    X(ERROR_INVALID_DESCRIPTOR, 6, "malformed or untrusted IPC descriptor")      \
    X(ERROR_DRIVER, 7, "CUDA driver call failed")                                \
    X(ERROR_OUT_OF_MEMORY, 8, "out of memory")                                   \
    X(ERROR_NO_DRIVER, 9, "no usable CUDA driver")                               \
    X(ERROR_NO_DEVICE, 10, "no CUDA device")                                     \
    X(ERROR_SYSTEM, 11, "operating-system call failed")                          \
    X(ERROR_BUSY, 12, "buffer is in use by open slices")

typedef enum cubuf_status {
#define CUBUF_STATUS_ENUM_(name, value, text) CUBUF_##name = value,
    CUBUF_STATUS_MAP(CUBUF_STATUS_ENUM_)
#undef CUBUF_STATUS_ENUM_
} cubuf_status_t;

/* Host memory: a function that makes an object (context, resource, buffer,
 * descriptor) or needs host scratch memory may also return
 * CUBUF_ERROR_OUT_OF_MEMORY when a host allocation fails, whether or not its
 * list below names it; it then returns no object, holds nothing and leaves
 * its inputs as they were. */

/** "CUBUF_ERROR_CLOSED" for CUBUF_ERROR_CLOSED; "CUBUF_UNKNOWN_STATUS" otherwise. Static. */
CUBUF_API const char *cubuf_status_name(cubuf_status_t status);
/** A sentence describing the status ("buffer is closed"). Static. */
CUBUF_API const char *cubuf_status_string(cubuf_status_t status);

/**
 * Detail of the most recent failure on the calling thread, like dlerror():
 * for example "cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY (size 1099511627776)".
 * Empty string if no call on this thread has failed yet. The pointer stays
 * valid until the next cubuf call on this thread.
 */
CUBUF_API const char *cubuf_last_error(void);

/** The CUresult of the most recent failed driver call on this thread (CUDA_SUCCESS if none). */
CUBUF_API CUresult cubuf_last_cuda_result(void);

/**
 * Receives failures that no call can return (the last release of a buffer
 * whose close failed, a deallocation stream skipped because synchronizing it
 * would disturb a capture): the analogue of cuda.core's CUDAWarning.
 * May run on any thread; must not call back into cubuf on the same buffer.
 */
typedef void (*cubuf_warning_fn)(cubuf_status_t status, const char *message, void *user);

/**
 * Installs the warning handler (NULL restores the default, which writes one
 * line "cubuf warning: ..." to stderr). Thread-safe.
 */
CUBUF_API void cubuf_set_warning_handler(cubuf_warning_fn fn, void *user);

/* ------------------------------------------------------------------------ */
/* Driver and devices                                                        */
/* ------------------------------------------------------------------------ */

/**
 * Loads the driver if needed and reports its CUDA version (13000 for 13.0).
 * The library is libcuda.so.1, or the file named by CUBUF_LIBCUDA.
 * cubuf needs a driver of at least cubuf_driver_min_version() and is tested
 * on 13.0; each entry point is called through the ABI of the version it was
 * resolved at (see docs/DESIGN.md).
 * Returns CUBUF_ERROR_NO_DRIVER when it cannot be loaded, is too old (the
 * detail names both versions), or cuInit fails for lack of a driver;
 * CUBUF_ERROR_INVALID_ARGUMENT for NULL.
 */
CUBUF_API cubuf_status_t cubuf_driver_version(int *version);

/**
 * The oldest CUDA driver cubuf loads with, as cuDriverGetVersion counts
 * (12020 for 12.2): the highest CUDA version among the driver entry points
 * the library needs. Features whose entry points a driver lacks return
 * CUBUF_ERROR_NOT_SUPPORTED naming the entry point. Needs no driver; never
 * fails; thread-safe.
 */
CUBUF_API int cubuf_driver_min_version(void);

/**
 * Number of CUDA devices (pyarrow's get_num_devices). A working driver with
 * no device gives 0 and CUBUF_SUCCESS. Returns CUBUF_ERROR_NO_DRIVER.
 */
CUBUF_API cubuf_status_t cubuf_device_count(int *count);

/** What `cubuf info` prints about one device. Fill with CUBUF_DEVICE_INFO_INIT. */
typedef struct cubuf_device_info {
    size_t struct_size;            /**< sizeof(cubuf_device_info_t), set by the _INIT macro */
    int ordinal;
    char name[256];
    size_t total_memory;           /**< bytes */
    int cc_major, cc_minor;        /**< compute capability */
    int pci_bus_id, pci_device_id, pci_domain_id;
    bool unified_addressing;
    bool managed_memory;
    bool concurrent_managed_access;
    bool vmm_supported;            /**< virtual memory management (cuMemCreate/cuMemMap) */
    size_t granularity_minimum;    /**< VMM granularity, device-located pinned allocation */
    size_t granularity_recommended;
    bool posix_fd_handles;         /**< VMM allocations exportable as POSIX fds */
    bool fabric_handles;
    bool gpu_direct_rdma_vmm;
    bool memory_pools;             /**< stream-ordered allocator */
    unsigned pool_handle_types;    /**< CUmemAllocationHandleType bits pools can export */
    bool host_register;
    bool can_map_host_memory;
} cubuf_device_info_t;

#define CUBUF_DEVICE_INFO_INIT                                                           \
    {sizeof(cubuf_device_info_t), 0, {0}, 0, 0, 0, 0, 0, 0, false, false, false, false, 0, 0, \
     false, false, false, false, 0, false, false}

/** Size of the first released layout (cubuf 0.1, up to can_map_host_memory):
 *  the least struct_size every later library accepts. */
#define CUBUF_DEVICE_INFO_SIZE_V1 \
    (offsetof(cubuf_device_info_t, can_map_host_memory) + sizeof(bool))

/**
 * Fills *info for device `ordinal`, up to info->struct_size (set by
 * CUBUF_DEVICE_INFO_INIT; at least CUBUF_DEVICE_INFO_SIZE_V1, else
 * CUBUF_ERROR_INVALID_ARGUMENT). Returns CUBUF_ERROR_OUT_OF_RANGE for a bad
 * ordinal (the detail names the valid range), CUBUF_ERROR_NO_DRIVER,
 * CUBUF_ERROR_NO_DEVICE, CUBUF_ERROR_DRIVER.
 */
CUBUF_API cubuf_status_t cubuf_device_get_info(int ordinal, cubuf_device_info_t *info);

/**
 * Whether device `ordinal` can access memory of device `peer` directly
 * (cuDeviceCanAccessPeer; a device can always access itself). Returns
 * CUBUF_ERROR_OUT_OF_RANGE for a bad ordinal, CUBUF_ERROR_NO_DRIVER.
 */
CUBUF_API cubuf_status_t cubuf_device_can_access_peer(int ordinal, int peer, bool *can_access);

/* ------------------------------------------------------------------------ */
/* Contexts (pyarrow.cuda.Context)                                           */
/* ------------------------------------------------------------------------ */

typedef struct cubuf_context cubuf_context_t;
typedef struct cubuf_buffer cubuf_buffer_t;
typedef struct cubuf_resource cubuf_resource_t;

/**
 * Creates a context for device `ordinal`: the device's primary context,
 * retained now and released when the context is destroyed (and the last
 * buffer made through it is gone). Returns CUBUF_ERROR_OUT_OF_RANGE for a
 * bad ordinal (the detail names the valid range), CUBUF_ERROR_NO_DRIVER,
 * CUBUF_ERROR_NO_DEVICE, CUBUF_ERROR_DRIVER. Destroy with cubuf_context_destroy.
 */
CUBUF_API cubuf_status_t cubuf_context_create(int ordinal, cubuf_context_t **out);

/**
 * Wraps an existing CUcontext made by another library ("shared context").
 * cubuf never releases or destroys `handle`; the caller keeps it alive
 * until the cubuf context and every buffer made through it are gone.
 * Returns CUBUF_ERROR_INVALID_ARGUMENT for a NULL handle, CUBUF_ERROR_DRIVER
 * if the driver rejects it.
 */
CUBUF_API cubuf_status_t cubuf_context_wrap(CUcontext handle, cubuf_context_t **out);

/**
 * Drops the caller's reference. Buffers made through the context keep it
 * alive until they are released; the primary context is released with the
 * last of them. NULL is a no-op.
 */
CUBUF_API void cubuf_context_destroy(cubuf_context_t *ctx);

/** Device ordinal of the context (pyarrow's device_number). */
CUBUF_API cubuf_status_t cubuf_context_device(const cubuf_context_t *ctx, int *ordinal);

/** The CUcontext handle (pyarrow's handle). Not a new reference. */
CUBUF_API cubuf_status_t cubuf_context_handle(const cubuf_context_t *ctx, CUcontext *handle);

/**
 * Blocks until the device has completed all preceding work in the context
 * (cuCtxSynchronize). Returns CUBUF_ERROR_DRIVER with the failing work's error.
 */
CUBUF_API cubuf_status_t cubuf_context_synchronize(cubuf_context_t *ctx);

/**
 * Live bytes of the buffers made through this context (new_buffer,
 * new_host_buffer, buffer_from_data, copy_to without destination of such a
 * buffer), exported ones included: rises by n on allocation and falls by n
 * when the buffer is closed. Views and imported buffers do not count. These
 * buffers come from the context's two pools (cubuf_buffer_resource of one of
 * them), so the figure is the live bytes of those pools: an allocation made
 * directly from such a pool counts too.
 */
CUBUF_API cubuf_status_t cubuf_context_bytes_allocated(const cubuf_context_t *ctx, size_t *bytes);

/* ------------------------------------------------------------------------ */
/* Default streams                                                           */
/* ------------------------------------------------------------------------ */

/*
 * One rule for 0, CU_STREAM_LEGACY and CU_STREAM_PER_THREAD, in every call
 * that takes a stream (allocate, wrap, set_deallocation_stream, close_on,
 * copies, fills, host copies): a default stream is that default stream *of
 * the context the memory belongs to*, never of whatever context the caller
 * has current. The context a buffer belongs to is
 *  - its resource's context for memory from a built-in resource (the
 *    device's primary context, or the context a context buffer was made
 *    in), for slices and based views their root's;
 *  - the context a view was made through (cubuf_context_foreign_buffer,
 *    cubuf_context_buffer_from_strided), and its slices', where their root
 *    has no context of its own;
 *  - none for cubuf_buffer_view / cubuf_buffer_wrap_external views and for
 *    user resources: then the caller's current context, which must exist.
 * The allocation, the work ordered on "stream 0" and the deallocation are
 * therefore on one stream, whichever context a framework left current; cubuf
 * makes the buffer's context current for the call and restores the
 * caller's. A copy between two buffers runs in the destination's context
 * (else the source's, else the current one), so "stream 0" there is the
 * destination context's default stream. A created stream is used as is: it
 * carries its context. The per-thread default stream is a different stream
 * on each thread.
 */

/* ------------------------------------------------------------------------ */
/* Buffers (cuda.core Buffer)                                                */
/* ------------------------------------------------------------------------ */

/** Called once when a buffer made by cubuf_buffer_wrap_external is closed. */
typedef void (*cubuf_owner_release_fn)(void *owner);

/**
 * A non-owning view of [ptr, ptr+size) (from_handle with neither resource
 * nor owner). Closing it never frees the memory. The device and the
 * accessibility flags are read from the driver (cuPointerGetAttributes);
 * memory the driver does not know (pageable host memory) is host accessible
 * with device_id -1. ptr 0 is allowed only with size 0.
 * Returns CUBUF_ERROR_INVALID_ARGUMENT, CUBUF_ERROR_NO_DRIVER.
 */
CUBUF_API cubuf_status_t cubuf_buffer_view(CUdeviceptr ptr, size_t size, cubuf_buffer_t **out);

/**
 * A buffer that owns [ptr, ptr+size) through `resource` (from_handle with mr):
 * closing it deallocates through the resource, ordered on the recorded
 * deallocation stream `stream` (see cubuf_buffer_set_deallocation_stream for
 * how default streams are recorded). The buffer retains the resource.
 * Resources whose deallocation needs state only their own allocations
 * carry cannot adopt memory: virtual-memory resources, the resources of
 * imported (IPC) buffers and the adaptors of cubuf/adaptor.h (which free
 * through their upstream's raw-pointer interface) are refused.
 * Returns CUBUF_ERROR_INVALID_ARGUMENT for NULL arguments, pointer 0 with a
 * size, a resource that cannot adopt memory (the message says why), or a
 * default stream that cannot be bound (a user resource with no current
 * context); CUBUF_ERROR_NO_DRIVER (a default
 * stream with a device-accessible resource needs the driver);
 * CUBUF_ERROR_DRIVER.
 */
CUBUF_API cubuf_status_t cubuf_buffer_wrap(CUdeviceptr ptr, size_t size, cubuf_resource_t *resource,
                                           CUstream stream, cubuf_buffer_t **out);

/**
 * A view of [ptr, ptr+size) that keeps an external owner alive (from_handle
 * with owner): release(owner) is called exactly once, when the buffer is
 * closed or its last reference released. release may be NULL.
 */
CUBUF_API cubuf_status_t cubuf_buffer_wrap_external(CUdeviceptr ptr, size_t size, void *owner,
                                                    cubuf_owner_release_fn release,
                                                    cubuf_buffer_t **out);

/**
 * A buffer over [offset, offset+size) of `parent`. The slice depends on the
 * buffer that owns the memory (the parent, or the parent's own root for a
 * slice of a slice): it keeps that root alive (retained) until the slice is
 * closed or released, and while the slice is open the root cannot be closed
 * (cubuf_buffer_close returns CUBUF_ERROR_BUSY and the root stays open), so
 * no slice ever reaches freed memory. Releasing the root's last handle
 * while slices are open is fine: the memory is freed when the last slice
 * goes, on the root's recorded deallocation stream, which must still exist
 * then (record a created stream that outlives the slices, or close the
 * root yourself after them, if they may be dropped on another thread or
 * after the stream is destroyed). Closing a slice closes only the slice.
 * Returns CUBUF_ERROR_INVALID_ARGUMENT (NULL), CUBUF_ERROR_CLOSED if the
 * parent is closed, CUBUF_ERROR_OUT_OF_RANGE if the range does not fit the
 * parent, CUBUF_ERROR_OUT_OF_MEMORY.
 * Thread-safety: slicing and closing the same parent from two threads at
 * once is the caller's race.
 */
CUBUF_API cubuf_status_t cubuf_buffer_slice(cubuf_buffer_t *parent, size_t offset, size_t size,
                                            cubuf_buffer_t **out);

/** Adds a reference. Returns `buf`. NULL is a no-op. */
CUBUF_API cubuf_buffer_t *cubuf_buffer_retain(cubuf_buffer_t *buf);

/**
 * Drops a reference. The last release of an open buffer closes it on its
 * recorded deallocation stream; failures on that path go to the warning
 * handler. NULL is a no-op.
 */
CUBUF_API void cubuf_buffer_release(cubuf_buffer_t *buf);

/**
 * Releases the memory now (Buffer.close() without a stream): deallocation is
 * ordered on the recorded deallocation stream. Afterwards is_closed is true,
 * the pointer 0 and the size 0; the handle stays valid until released.
 * Closing a closed buffer is a no-op returning CUBUF_SUCCESS.
 * Returns CUBUF_ERROR_BUSY while slices or based views of the buffer are
 * open (see cubuf_buffer_slice), leaving it open;
 * CUBUF_ERROR_STREAM_CAPTURING where the resource refuses a capturing
 * stream (virtual memory; see <cubuf/vmm.h>), leaving the buffer open;
 * CUBUF_ERROR_DRIVER.
 */
CUBUF_API cubuf_status_t cubuf_buffer_close(cubuf_buffer_t *buf);

/**
 * close(stream): `stream` replaces the recorded deallocation stream, then
 * the buffer is closed as by cubuf_buffer_close. A close that is refused
 * (CUBUF_ERROR_BUSY, CUBUF_ERROR_STREAM_CAPTURING) or fails leaves the
 * recorded stream as it was. Statuses as cubuf_buffer_close and
 * cubuf_buffer_set_deallocation_stream.
 */
CUBUF_API cubuf_status_t cubuf_buffer_close_on(cubuf_buffer_t *buf, CUstream stream);

/**
 * Changes the stream that orders the buffer's eventual deallocation. The
 * buffer stays open and usable. No synchronization and no dependency is
 * added: the caller orders allocation and every access before the
 * deallocation on `stream`. A default stream (0, CU_STREAM_LEGACY,
 * CU_STREAM_PER_THREAD) is bound to the context the buffer belongs to (see
 * "Default streams"; the current context only for memory of no context),
 * so that a later close from any thread runs it in the right context. The
 * per-thread default stream is a different stream on each thread: pass a
 * created stream if the buffer may be closed from another thread.
 * Returns CUBUF_ERROR_CLOSED for a closed buffer, CUBUF_ERROR_INVALID_ARGUMENT
 * when a default stream cannot be bound (memory of no context and no
 * current context), CUBUF_ERROR_NO_DRIVER (a default stream without a
 * driver), CUBUF_ERROR_DRIVER.
 * Thread-safety: may run while other buffers of the same memory (virtual
 * memory aliases) are closed on other threads; must not race with close of
 * the same buffer.
 */
CUBUF_API cubuf_status_t cubuf_buffer_set_deallocation_stream(cubuf_buffer_t *buf, CUstream stream);

/** Attributes. They never fail; a NULL buffer reads as closed (0, false, -1, NULL). */
CUBUF_API CUdeviceptr cubuf_buffer_ptr(const cubuf_buffer_t *buf);       /**< 0 after close */
CUBUF_API size_t cubuf_buffer_size(const cubuf_buffer_t *buf);           /**< 0 after close */
CUBUF_API int cubuf_buffer_device_id(const cubuf_buffer_t *buf);         /**< -1: no device; kept after close */
CUBUF_API bool cubuf_buffer_is_closed(const cubuf_buffer_t *buf);
CUBUF_API bool cubuf_buffer_is_device_accessible(const cubuf_buffer_t *buf);
CUBUF_API bool cubuf_buffer_is_host_accessible(const cubuf_buffer_t *buf);
CUBUF_API bool cubuf_buffer_is_managed(const cubuf_buffer_t *buf);
CUBUF_API bool cubuf_buffer_is_mapped(const cubuf_buffer_t *buf);        /**< imported through IPC */
/** The resource that owns the memory, NULL for views. Not a new reference. */
CUBUF_API cubuf_resource_t *cubuf_buffer_resource(const cubuf_buffer_t *buf);
/** The external owner given to cubuf_buffer_wrap_external, or the parent's for a slice; else NULL. */
CUBUF_API void *cubuf_buffer_owner(const cubuf_buffer_t *buf);
/** The root a slice or a based view depends on (not a new reference), else NULL. */
CUBUF_API cubuf_buffer_t *cubuf_buffer_parent(const cubuf_buffer_t *buf);

/* ------------------------------------------------------------------------ */
/* Copies and fills                                                          */
/* ------------------------------------------------------------------------ */

typedef enum cubuf_src_access_order {
    CUBUF_SRC_ACCESS_STREAM = 0,     /**< source read in stream order (default) */
    CUBUF_SRC_ACCESS_DURING_API_CALL, /**< source may be reused as soon as the call returns */
    CUBUF_SRC_ACCESS_ANY,            /**< source read at any time before the copy completes */
} cubuf_src_access_order_t;

typedef enum cubuf_location_hint {
    CUBUF_LOCATION_NONE = 0,   /**< no hint */
    CUBUF_LOCATION_DEVICE,     /**< the device given by the hint's id */
    CUBUF_LOCATION_HOST,
    CUBUF_LOCATION_HOST_NUMA,  /**< the NUMA node given by the hint's id */
} cubuf_location_hint_t;

/** Transfer hints (cuda.core CopyOptions). Initialize with CUBUF_COPY_OPTIONS_INIT. */
typedef struct cubuf_copy_options {
    size_t struct_size;
    cubuf_src_access_order_t src_access_order;
    cubuf_location_hint_t src_location;
    int src_location_id;
    cubuf_location_hint_t dst_location;
    int dst_location_id;
    bool prefer_overlap_with_compute; /**< CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE */
} cubuf_copy_options_t;

#define CUBUF_COPY_OPTIONS_INIT {sizeof(cubuf_copy_options_t), CUBUF_SRC_ACCESS_STREAM, \
                                 CUBUF_LOCATION_NONE, 0, CUBUF_LOCATION_NONE, 0, false}

/** Size of the first released layout (cubuf 0.1, up to prefer_overlap_with_compute). */
#define CUBUF_COPY_OPTIONS_SIZE_V1 \
    (offsetof(cubuf_copy_options_t, prefer_overlap_with_compute) + sizeof(bool))

/**
 * Copies src into dst asynchronously on `stream` (Buffer.copy_from).
 * The sizes must be equal (else CUBUF_ERROR_INVALID_ARGUMENT); size 0 is a
 * no-op that calls no driver.
 * The copy runs in the context dst belongs to, else src's, else the
 * caller's current context (see "Default streams"); `stream` must belong to
 * that context or be a default stream, which then is that context's. Without options it costs cuMemcpyAsync plus at most one
 * cuCtxGetCurrent; between device memory of two devices whose buffers both
 * belong to a context (resource or context buffers; pyarrow's copy from
 * another device) it is cuMemcpyPeerAsync with both contexts, which needs
 * no peer access granted. A view, or a copy with options, takes the plain
 * path, where the driver refuses pool memory of another device that was
 * not granted to the copying device (cubuf_resource_set_peer_access).
 * `options` may be NULL. With options the copy goes through the driver's
 * attributed copy (a batch of one through cuMemcpyBatchAsync with the 13.0 ABI):
 * options are refused with the legacy default stream (0 or
 * CU_STREAM_LEGACY; use CU_STREAM_PER_THREAD) and with a capturing stream
 * (CUBUF_ERROR_INVALID_ARGUMENT; pass NULL there), as are a struct_size
 * below the first released layout, an unknown enum value and a negative
 * device or NUMA id in a location hint. Where the driver has no attributed
 * copy, STREAM and ANY fall back to a plain copy. Location hints only
 * matter for managed and pageable memory; the driver ignores them
 * elsewhere.
 * DURING_API_CALL is kept by cubuf itself, at any size, whether or not the
 * driver has the attributed copy: the source is read before the call
 * returns (by the host for pageable memory; by the driver on a private
 * stream, synchronized, for pinned, device and managed memory) into a block
 * of pinned staging memory, and the copy to dst runs in stream order from
 * that block, which is freed on `stream` after it. The source may change as
 * soon as the call returns; the read does not wait for work pending on
 * `stream` (work there that writes the source is not seen: order it before
 * the call). For a device destination the call does not wait for `stream`;
 * for a host destination the driver makes the copy from the block
 * synchronous with the host, so the call then waits for `stream`. It costs
 * a private stream, a staging block of the copy's size from a per-device
 * host pool (kept for the process with a reference to the device's primary
 * context; it holds no memory between copies) and one host memcpy or one
 * synchronized device-to-host copy. Where the device has no host memory
 * pools (or the driver, before 12.6, cannot say) it is refused with
 * CUBUF_ERROR_NOT_SUPPORTED.
 * Returns CUBUF_ERROR_INVALID_ARGUMENT (NULL buffer), CUBUF_ERROR_CLOSED if
 * either is closed, CUBUF_ERROR_NOT_SUPPORTED and CUBUF_ERROR_OUT_OF_MEMORY
 * (the DURING_API_CALL staging), CUBUF_ERROR_DRIVER.
 * Thread-safety: as any use of a buffer; the caller orders the copy against
 * other work on the two buffers.
 */
CUBUF_API cubuf_status_t cubuf_buffer_copy_from(cubuf_buffer_t *dst, const cubuf_buffer_t *src,
                                                CUstream stream, const cubuf_copy_options_t *options);

/**
 * Copies src into dst asynchronously on `stream` (Buffer.copy_to(dst)):
 * exactly cubuf_buffer_copy_from(dst, src, stream, options), statuses
 * included.
 */
CUBUF_API cubuf_status_t cubuf_buffer_copy_to(const cubuf_buffer_t *src, cubuf_buffer_t *dst,
                                              CUstream stream, const cubuf_copy_options_t *options);

/**
 * Copies src into a new buffer (Buffer.copy_to() without dst): a buffer of
 * src's size is allocated from the resource that owns src's memory (a
 * slice's or a based view's root's) on `stream` (its deallocation stream is
 * `stream`), the copy is enqueued on `stream` (into the new buffer's first
 * src-size bytes where the resource rounds sizes up, as virtual memory does
 * to its granularity: the buffer's size is then the rounded one), and the new buffer is stored
 * in *out (written only on success; the caller releases it). When src is
 * counted in a context's bytes_allocated the new buffer is counted there
 * too. Options are checked before anything is allocated (their refusal of
 * a capturing stream included); if the copy fails, the new buffer is freed
 * again (on `stream`).
 * Returns CUBUF_ERROR_INVALID_ARGUMENT (NULL argument, or a source that no
 * resource owns: a view), CUBUF_ERROR_CLOSED, and what
 * cubuf_resource_allocate and cubuf_buffer_copy_from return.
 */
CUBUF_API cubuf_status_t cubuf_buffer_copy_to_new(const cubuf_buffer_t *src, CUstream stream,
                                                  const cubuf_copy_options_t *options,
                                                  cubuf_buffer_t **out);

/**
 * Copies bytes of `buf` from `position` into host memory (pyarrow's
 * copy_to_host): `nbytes` bytes, or with nbytes -1 as many as fit, the rest
 * of the buffer but at most host_size. The copy is ordered on `stream`
 * (after the work already there; a default stream is the buffer context's,
 * see "Default streams") and complete when the call returns (the stream is
 * synchronized). `host` may be pageable or pinned. *copied (may be NULL)
 * receives the byte count on success. nbytes 0 (or nothing to copy) calls
 * no driver.
 * Returns CUBUF_ERROR_INVALID_ARGUMENT (NULL buf, or NULL host with a
 * host_size), CUBUF_ERROR_CLOSED, CUBUF_ERROR_OUT_OF_RANGE (position < 0 or
 * past the buffer's size; nbytes below -1, past the rest of the buffer or
 * larger than host_size), CUBUF_ERROR_STREAM_CAPTURING (the stream
 * captures: synchronizing it would break the capture), CUBUF_ERROR_DRIVER
 * (the host bytes are then unspecified).
 * Thread-safety: as any use of a buffer.
 */
CUBUF_API cubuf_status_t cubuf_buffer_copy_to_host(const cubuf_buffer_t *buf, int64_t position,
                                                   int64_t nbytes, void *host, size_t host_size,
                                                   CUstream stream, size_t *copied);

/**
 * Copies host data into `buf` at `position` (pyarrow's copy_from_host):
 * `nbytes` bytes of data, or with nbytes -1 as many as fit, all of data but
 * at most the rest of the buffer. Ordered on `stream` and complete when the
 * call returns, as cubuf_buffer_copy_to_host; *copied (may be NULL)
 * receives the byte count on success.
 * Returns CUBUF_ERROR_INVALID_ARGUMENT (NULL buf, or NULL data with a
 * data_size), CUBUF_ERROR_CLOSED, CUBUF_ERROR_OUT_OF_RANGE (position < 0 or
 * past the buffer's size; nbytes below -1, larger than data_size or past
 * the rest of the buffer), CUBUF_ERROR_STREAM_CAPTURING, CUBUF_ERROR_DRIVER
 * (the buffer's bytes in the range are then unspecified).
 */
CUBUF_API cubuf_status_t cubuf_buffer_copy_from_host(cubuf_buffer_t *buf, const void *data,
                                                     size_t data_size, int64_t position,
                                                     int64_t nbytes, CUstream stream,
                                                     size_t *copied);

/** One copy of a batch: `size` bytes from src to dst (raw addresses). */
typedef struct cubuf_copy {
    CUdeviceptr dst;
    CUdeviceptr src;
    size_t size;
} cubuf_copy_t;

/**
 * Runs `count` copies in one call on `stream`, all with the same options
 * (NULL: default ordering), in the caller's current context. The copies of
 * a batch may run in any order and concurrently: none may write bytes
 * another reads or writes. Copies of size 0 are skipped; an address 0 with
 * a size is CUBUF_ERROR_INVALID_ARGUMENT before anything is enqueued.
 * Uses cuMemcpyBatchAsync where available, else one plain copy each;
 * without options it also uses plain copies for a single copy, on the
 * legacy default stream and on a capturing stream (13.0 drivers cannot
 * capture a batch). Same option rules as cubuf_buffer_copy_from, also for
 * DURING_API_CALL (every source read into one staging block during the call).
 * count 0 is a no-op. On failure, *failed_index (may be NULL; written on
 * failure only) is the index of the copy that failed, or count when the
 * batch as a whole was refused (bad options, or cuMemcpyBatchAsync failed);
 * after a plain copy failed, the copies before it may have been enqueued.
 * Returns CUBUF_ERROR_INVALID_ARGUMENT, CUBUF_ERROR_NOT_SUPPORTED and
 * CUBUF_ERROR_OUT_OF_MEMORY (the DURING_API_CALL staging; host arrays for a
 * large batch), CUBUF_ERROR_DRIVER.
 */
CUBUF_API cubuf_status_t cubuf_copy_batch(const cubuf_copy_t *copies, size_t count, CUstream stream,
                                          const cubuf_copy_options_t *options, size_t *failed_index);

/**
 * Fills the buffer with a repeating pattern of `pattern_size` bytes (1, 2 or
 * 4) read from `pattern`, asynchronously on `stream` (Buffer.fill): the
 * pattern's bytes repeat in memory in the order they lie at `pattern`.
 * Runs in the buffer's context as copies do (cuMemsetD8/D16/D32Async plus at
 * most one cuCtxGetCurrent). A buffer of size 0 is a no-op.
 * Returns CUBUF_ERROR_INVALID_ARGUMENT if buf or pattern is NULL, if
 * pattern_size is not 1, 2 or 4, if the buffer size is not a multiple of it,
 * or if the buffer's address is not aligned to it (a slice at an odd
 * offset); CUBUF_ERROR_CLOSED; CUBUF_ERROR_DRIVER.
 */
CUBUF_API cubuf_status_t cubuf_buffer_fill(cubuf_buffer_t *buf, const void *pattern,
                                           size_t pattern_size, CUstream stream);

/**
 * Fills with one byte (Buffer.fill(int)). `value` outside [0, 256) gives
 * CUBUF_ERROR_OUT_OF_RANGE (checked before whether the buffer is closed);
 * otherwise as cubuf_buffer_fill with a 1-byte pattern.
 */
CUBUF_API cubuf_status_t cubuf_buffer_fill_byte(cubuf_buffer_t *buf, long long value, CUstream stream);

/* ------------------------------------------------------------------------ */
/* Memory resources                                                          */
/* ------------------------------------------------------------------------ */

/** What a resource's memory is. */
typedef struct cubuf_resource_props {
    size_t struct_size;
    int device_id;            /**< -1: memory bound to no device */
    bool device_accessible;
    bool host_accessible;
    bool managed;
    bool ipc_enabled;
} cubuf_resource_props_t;

#define CUBUF_RESOURCE_PROPS_INIT {sizeof(cubuf_resource_props_t), -1, false, false, false, false}

/** Size of the first released layout (cubuf 0.1, up to ipc_enabled). */
#define CUBUF_RESOURCE_PROPS_SIZE_V1 (offsetof(cubuf_resource_props_t, ipc_enabled) + sizeof(bool))

/**
 * Usage of a resource, read by cubuf_resource_stats. Initialize with
 * CUBUF_RESOURCE_STATS_INIT. The first five figures are cubuf's own
 * counters of the buffers the resource allocated (or took over with
 * cubuf_buffer_wrap). The pool figures are the driver's, of the memory pool
 * behind a device pool or pinned pool resource (cuMemPoolGetAttribute): the
 * memory the pool holds from the system (reserved) and the part of it
 * allocations use now (used), each with its high-water mark since the pool
 * was made. For a device pool on the device's default pool they count every
 * user of that pool in the process. 0 for resources without a pool.
 */
typedef struct cubuf_resource_stats {
    size_t struct_size;
    size_t current_bytes;
    size_t peak_bytes;
    size_t current_count;
    size_t peak_count;
    uint64_t total_allocations;
    uint64_t pool_reserved_current; /**< CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT */
    uint64_t pool_reserved_high;    /**< CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH */
    uint64_t pool_used_current;     /**< CU_MEMPOOL_ATTR_USED_MEM_CURRENT */
    uint64_t pool_used_high;        /**< CU_MEMPOOL_ATTR_USED_MEM_HIGH */
} cubuf_resource_stats_t;

#define CUBUF_RESOURCE_STATS_INIT {sizeof(cubuf_resource_stats_t), 0, 0, 0, 0, 0, 0, 0, 0, 0}

/** Size of the first released layout (up to total_allocations): the
 *  counters only, which a stats call fills without asking the driver. */
#define CUBUF_RESOURCE_STATS_SIZE_V1 \
    (offsetof(cubuf_resource_stats_t, total_allocations) + sizeof(uint64_t))

#define CUBUF_RESOURCE_OPS_VERSION 1

/**
 * A user-defined resource. `version` is CUBUF_RESOURCE_OPS_VERSION; fields
 * are only ever appended with a new version.
 * allocate: size > 0; writes *ptr; may return any status (errors propagate).
 * deallocate: frees what allocate returned, ordered on `stream`.
 * destroy (may be NULL): called once when the resource's last reference goes.
 * The callbacks run without any cubuf lock held and may be called from any
 * thread.
 */
typedef struct cubuf_resource_ops {
    unsigned version;
    cubuf_status_t (*allocate)(void *state, size_t size, CUstream stream, CUdeviceptr *ptr);
    cubuf_status_t (*deallocate)(void *state, CUdeviceptr ptr, size_t size, CUstream stream);
    void (*destroy)(void *state);
} cubuf_resource_ops_t;

/** Bytes of an ops struct of version 1 (up to destroy): all a version-1 caller provides. */
#define CUBUF_RESOURCE_OPS_SIZE_V1 (offsetof(cubuf_resource_ops_t, destroy) + sizeof(void (*)(void *)))

/**
 * Creates a resource from user operations. `ops` is copied, as far as its
 * declared version reaches (fields of later versions are never read);
 * `props` (NULL: device memory of the current device, device accessible) is
 * copied as the struct_size rule says.
 * Returns CUBUF_ERROR_INVALID_ARGUMENT (missing callbacks, props->struct_size
 * too small), CUBUF_ERROR_NOT_SUPPORTED (ops version 0, or newer than this
 * library's CUBUF_RESOURCE_OPS_VERSION: callbacks it does not know may carry
 * duties it cannot honour). Release with cubuf_resource_release.
 */
CUBUF_API cubuf_status_t cubuf_resource_create(const cubuf_resource_ops_t *ops,
                                               const cubuf_resource_props_t *props, void *state,
                                               cubuf_resource_t **out);

/** Options for the stream-ordered device pool. Initialize with CUBUF_DEVICE_RESOURCE_OPTIONS_INIT. */
typedef struct cubuf_device_resource_options {
    size_t struct_size;
    bool private_pool;      /**< false: the device's default pool, shared */
    size_t max_size;        /**< private pool only; 0 = no limit */
    bool ipc_enabled;       /**< private pool only: exportable as POSIX fd */
    /** Bytes the pool keeps cached at a synchronization (SIZE_MAX: all).
     *  CUBUF_RELEASE_THRESHOLD_DEFAULT (the default): see cubuf_device_resource_create. */
    size_t release_threshold;
    /** private pool only (cubuf 0.5): ask for fabric handles too (multi-node
     *  NVLink, an IMEX channel needed). Where the driver refuses them
     *  (CUDA_ERROR_NOT_PERMITTED or NOT_SUPPORTED) the pool is made with
     *  POSIX fds instead, ipc_enabled reads true in its properties and
     *  cubuf_resource_fabric_fallback (cubuf/dist.h) says so. */
    bool fabric;
} cubuf_device_resource_options_t;

/** release_threshold: the default pool's threshold is left as it is; a
 *  private pool keeps all freed memory (until cubuf_resource_trim). */
#define CUBUF_RELEASE_THRESHOLD_DEFAULT (SIZE_MAX - 1)

#define CUBUF_DEVICE_RESOURCE_OPTIONS_INIT \
    {sizeof(cubuf_device_resource_options_t), false, 0, false, CUBUF_RELEASE_THRESHOLD_DEFAULT, false}

/** Size of the first released layout (cubuf 0.1, up to release_threshold). */
#define CUBUF_DEVICE_RESOURCE_OPTIONS_SIZE_V1 \
    (offsetof(cubuf_device_resource_options_t, release_threshold) + sizeof(size_t))

/*
 * The built-in resources below share these rules:
 *  - `ordinal` is validated (CUBUF_ERROR_OUT_OF_RANGE, the detail names the
 *    valid range); the resource keeps the device's primary context retained
 *    until its last reference is gone (buffers hold their resource).
 *  - A default stream (0, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD) given to
 *    cubuf_resource_allocate is the one of the context current at that
 *    moment, or of the resource's device's primary context when none is;
 *    stream-ordered allocations and the recorded deallocation stream both
 *    use it.
 *  - Thread-safe: one resource may allocate and free from many threads.
 *  - Every create returns CUBUF_ERROR_INVALID_ARGUMENT (out NULL),
 *    CUBUF_ERROR_OUT_OF_RANGE, CUBUF_ERROR_NO_DRIVER, CUBUF_ERROR_NO_DEVICE,
 *    CUBUF_ERROR_DRIVER, plus what its entry lists. Release the resource
 *    with cubuf_resource_release.
 */

/**
 * Stream-ordered device memory (cuMemAllocFromPoolAsync / cuMemFreeAsync) on
 * device `ordinal`; device accessible, device_id `ordinal`.
 * options NULL or private_pool false: the device's default pool, shared with
 * everyone else in the process (the CUDA runtime's cudaMallocAsync and the
 * frameworks' allocators use it too). Its release threshold is left as it
 * is (the driver's 0, which gives freed memory back at each
 * synchronization, unless someone changed it) unless release_threshold is
 * set to anything but CUBUF_RELEASE_THRESHOLD_DEFAULT: then it becomes that
 * value (SIZE_MAX: keep all), for every user of the pool, and stays after
 * the resource is gone. private_pool true: a new pool, destroyed with the
 * resource, with max_size (0: the driver's limit; an allocation beyond it
 * returns CUBUF_ERROR_OUT_OF_MEMORY), the release threshold set to
 * release_threshold (CUBUF_RELEASE_THRESHOLD_DEFAULT: keep all freed memory
 * cached, until cubuf_resource_trim or the resource goes), and POSIX-fd
 * export when ipc_enabled.
 * Allocation on a capturing stream returns CUBUF_ERROR_STREAM_CAPTURING and
 * leaves the capture intact (use cubuf_graph_resource_create inside capture).
 * Closing a buffer on a capturing stream fails with
 * CUBUF_ERROR_STREAM_CAPTURING and leaves it open: a graph cannot free pool
 * memory (the driver's refused free may invalidate that capture).
 * Returns CUBUF_ERROR_INVALID_ARGUMENT (options->struct_size below
 * CUBUF_DEVICE_RESOURCE_OPTIONS_SIZE_V1; max_size or ipc_enabled without
 * private_pool), CUBUF_ERROR_NOT_SUPPORTED
 * (no memory pools on the device, or no POSIX-fd pool export for IPC).
 */
CUBUF_API cubuf_status_t cubuf_device_resource_create(int ordinal,
                                                      const cubuf_device_resource_options_t *options,
                                                      cubuf_resource_t **out);

/**
 * Pinned host memory from a host-located stream-ordered pool that the
 * resource creates and destroys, with read-write device access granted to
 * `ordinal` (cuMemPoolSetAccess; without the grant device copies are staged
 * and run several times slower). Host and device accessible; device_id -1.
 * Allocations are stream ordered like the device pool's: the host may touch
 * the memory once the allocation has completed on its stream (synchronize
 * it first), and the capture rules are the device pool's. The pool keeps
 * freed memory cached (release threshold UINT64_MAX) until
 * cubuf_resource_trim gives it back or the resource goes; change that with
 * cubuf_resource_set_release_threshold.
 * ipc_enabled makes the pool exportable as POSIX fds; the driver allows that
 * only for a pool on a host NUMA node, so it is placed on the node closest
 * to the device (node 0 where the system has no NUMA).
 * Returns CUBUF_ERROR_NOT_SUPPORTED (no host memory pools on the device, or,
 * with ipc_enabled, no host NUMA pools or no POSIX-fd export).
 */
CUBUF_API cubuf_status_t cubuf_pinned_resource_create(int ordinal, bool ipc_enabled,
                                                      cubuf_resource_t **out);

/**
 * Managed memory (cuMemAllocManaged, global attach). preferred_location: a device ordinal, -1 for the
 * host, or -2 for none. For -1 or a device, each allocation is advised
 * (CU_MEM_ADVISE_SET_PREFERRED_LOCATION); for a device it is also
 * prefetched there on the allocating stream. Host and device accessible,
 * is_managed, device_id `ordinal`. Allocation on a capturing stream returns
 * CUBUF_ERROR_STREAM_CAPTURING. Closing synchronizes the deallocation stream,
 * then cuMemFree; on a capturing stream (or the legacy stream while a
 * capture depends on it) close returns CUBUF_ERROR_STREAM_CAPTURING and the
 * buffer stays open.
 * Returns CUBUF_ERROR_OUT_OF_RANGE (preferred_location below -2 or not a
 * device), CUBUF_ERROR_NOT_SUPPORTED (no managed memory on `ordinal`, or a
 * preferred device without concurrent managed access).
 */
CUBUF_API cubuf_status_t cubuf_managed_resource_create(int ordinal, int preferred_location,
                                                       cubuf_resource_t **out);

/**
 * Legacy pinned host memory (cuMemHostAlloc with CU_MEMHOSTALLOC_PORTABLE,
 * made in the device's primary context): the host pointer is also the
 * device address. Host and device accessible, device_id -1. Allocation is
 * synchronous; size 0 gives pointer 0 without a driver call. Closing
 * synchronizes the deallocation stream, then cuMemFreeHost, with the
 * capture rule of the managed resource.
 */
CUBUF_API cubuf_status_t cubuf_legacy_pinned_resource_create(int ordinal, cubuf_resource_t **out);

/**
 * Synchronous device memory (cuMemAlloc / cuMemFree in the device's primary
 * context). Device accessible, device_id `ordinal`. Buffers from it can be
 * shared with legacy IPC handles (cuIpcGetMemHandle), as pyarrow does.
 * Closing synchronizes the deallocation stream, then cuMemFree, with the
 * capture rule of the managed resource.
 */
CUBUF_API cubuf_status_t cubuf_sync_device_resource_create(int ordinal, cubuf_resource_t **out);

/**
 * Allocations inside stream capture (graph memory nodes, made from the
 * device's default pool's properties). cubuf_resource_allocate succeeds only
 * on a stream that is capturing; otherwise (including the legacy stream when
 * only another stream captures, and an invalidated capture) it returns
 * CUBUF_ERROR_INVALID_ARGUMENT, saying to use a pool resource. The pointer
 * is valid while the graph runs, between the allocation node and the free.
 * Closing on a capturing stream adds a free node; on any other stream it
 * frees the graph allocation in stream order (after the graph has run).
 * Device accessible, device_id `ordinal`.
 * Returns CUBUF_ERROR_NOT_SUPPORTED (no memory pools on the device).
 */
CUBUF_API cubuf_status_t cubuf_graph_resource_create(int ordinal, cubuf_resource_t **out);

/** Adds a reference; returns `res`. */
CUBUF_API cubuf_resource_t *cubuf_resource_retain(cubuf_resource_t *res);
/** Drops a reference; buffers hold their resource, so it lives until the last is gone. NULL is a no-op. */
CUBUF_API void cubuf_resource_release(cubuf_resource_t *res);

/**
 * Copies the resource's properties into *props, up to props->struct_size
 * (set by CUBUF_RESOURCE_PROPS_INIT; at least CUBUF_RESOURCE_PROPS_SIZE_V1).
 * Returns CUBUF_ERROR_INVALID_ARGUMENT for NULL or a struct_size too small.
 */
CUBUF_API cubuf_status_t cubuf_resource_props(const cubuf_resource_t *res, cubuf_resource_props_t *props);

/**
 * Reads the resource's usage into *stats, up to stats->struct_size (set by
 * CUBUF_RESOURCE_STATS_INIT; at least CUBUF_RESOURCE_STATS_SIZE_V1). Bytes
 * past struct_size are not touched. The counters are one consistent
 * snapshot and cost no driver call (peaks: see cubuf_statistics_t in
 * <cubuf/adaptor.h>). When struct_size covers the pool figures and the
 * resource is a device pool or pinned pool, or a logging, tracking or
 * failure-callback adaptor over one (which read their upstream's), they
 * cost four driver queries (cuMemPoolGetAttribute), made just before the
 * counters are read; callers that only need the counters on a hot path can
 * pass struct_size CUBUF_RESOURCE_STATS_SIZE_V1. Thread-safe.
 * Returns CUBUF_ERROR_INVALID_ARGUMENT (NULL, struct_size too small),
 * CUBUF_ERROR_DRIVER (a pool query failed; *stats is unchanged).
 */
CUBUF_API cubuf_status_t cubuf_resource_stats(const cubuf_resource_t *res, cubuf_resource_stats_t *stats);

/**
 * Gives the memory a pool resource keeps cached back to the system, keeping
 * at most `bytes_to_keep` bytes of it reserved (cuMemPoolTrimTo; 0: all it
 * can). Only memory no allocation uses can go: a buffer's memory goes once
 * its free has run on its deallocation stream, so synchronize that stream
 * (or the context) first. Device pool and pinned pool resources, a
 * context's pools included (cubuf_buffer_resource of one of their buffers);
 * on a device pool made on the device's default pool it trims that shared
 * pool. Thread-safe; the pool keeps serving allocations meanwhile.
 * Returns CUBUF_ERROR_INVALID_ARGUMENT (res NULL), CUBUF_ERROR_NOT_SUPPORTED
 * (every other resource kind: managed, legacy pinned, sync device, graph,
 * VMM, imported IPC and user resources hold no pool), CUBUF_ERROR_DRIVER.
 */
CUBUF_API cubuf_status_t cubuf_resource_trim(cubuf_resource_t *res, size_t bytes_to_keep);

/**
 * Sets how much freed memory the pool of a device pool or pinned pool
 * resource keeps cached when a stream, event or context synchronizes
 * (CU_MEMPOOL_ATTR_RELEASE_THRESHOLD): `bytes` (0: give everything back at
 * each synchronization; SIZE_MAX: keep everything, cubuf's choice for its
 * own pools). On a device pool made on the device's default pool this sets
 * the shared pool's threshold for every user in the process. Thread-safe.
 * Returns as cubuf_resource_trim.
 */
CUBUF_API cubuf_status_t cubuf_resource_set_release_threshold(cubuf_resource_t *res, size_t bytes);

/**
 * Grants (`grant` true: read-write) or revokes (`grant` false) access by
 * device `peer` to the memory of a pool resource (a device pool or a pinned
 * pool; cuMemPoolSetAccess). The grant covers the pool's existing and future
 * allocations. On a device pool made without a private pool this is the
 * device's default pool, shared with every user of it in the process.
 * A device pool's own device always has access and cannot be changed.
 * Returns CUBUF_ERROR_INVALID_ARGUMENT (NULL, a resource that is not a pool
 * resource, `peer` the device pool's own device), CUBUF_ERROR_OUT_OF_RANGE
 * (`peer` is not a device; the detail names the valid range),
 * CUBUF_ERROR_NOT_SUPPORTED (device `peer` cannot access the pool's device,
 * cuDeviceCanAccessPeer), CUBUF_ERROR_DRIVER.
 */
CUBUF_API cubuf_status_t cubuf_resource_set_peer_access(cubuf_resource_t *res, int peer, bool grant);

/**
 * Whether device `peer` has read-write access to the memory of a pool
 * resource (cuMemPoolGetAccess); a device pool's own device always has.
 * Returns as cubuf_resource_set_peer_access, without NOT_SUPPORTED.
 */
CUBUF_API cubuf_status_t cubuf_resource_peer_access(const cubuf_resource_t *res, int peer,
                                                    bool *granted);

/**
 * Allocates `size` bytes ordered on `stream` and returns a buffer that owns
 * them (deallocation stream: `stream`). Size 0 gives an open buffer of size 0
 * with pointer 0 and allocates nothing (a default stream is still recorded:
 * for a device-accessible resource that asks the driver which context is
 * current). Returns CUBUF_ERROR_INVALID_ARGUMENT (NULL, or a default stream
 * with no current context for a resource of no device), CUBUF_ERROR_NO_DRIVER,
 * CUBUF_ERROR_OUT_OF_MEMORY, CUBUF_ERROR_STREAM_CAPTURING (pool resources on a
 * capturing stream), CUBUF_ERROR_DRIVER, or what a user resource returns.
 */
CUBUF_API cubuf_status_t cubuf_resource_allocate(cubuf_resource_t *res, size_t size, CUstream stream,
                                                 cubuf_buffer_t **out);

/*
 * The raw-pointer interface: what resources layered over other resources
 * (the adaptors of cubuf/adaptor.h, a caching resource, a user resource)
 * ask of their upstream, and what a program that keeps its own pointers
 * uses. Every resource has it. A raw allocation is the same allocation
 * cubuf_resource_allocate makes (same driver calls, same default-stream
 * rule, counted in the resource's statistics), without a buffer object:
 *  - the caller keeps a reference to `res` until the last raw allocation
 *    of it is deallocated (buffers hold their resource; raw pointers do not);
 *  - deallocate with exactly the pointer and size allocate returned, once,
 *    ordered on `stream` (the memory may be reused by work ordered after
 *    that point of `stream`). A raw allocation stays one: handing its
 *    pointer to cubuf_buffer_wrap would count and free it a second time.
 * Resources whose allocations carry state (virtual memory, which grows and
 * aliases) keep a buffer per raw pointer and look it up on deallocate;
 * for them a pointer or size that is not one of theirs is
 * CUBUF_ERROR_INVALID_ARGUMENT. Thread-safe as the resource is.
 */

/**
 * Allocates `size` > 0 bytes ordered on `stream` into *ptr.
 * Returns CUBUF_ERROR_INVALID_ARGUMENT (NULL, size 0), and what
 * cubuf_resource_allocate returns; *ptr is untouched on failure.
 */
CUBUF_API cubuf_status_t cubuf_resource_allocate_raw(cubuf_resource_t *res, size_t size,
                                                     CUstream stream, CUdeviceptr *ptr);

/**
 * Deallocates what cubuf_resource_allocate_raw returned, ordered on `stream`
 * (a default stream means the resource's context's, as for allocation).
 * Returns CUBUF_ERROR_INVALID_ARGUMENT (NULL, pointer 0, a pointer or size
 * the resource knows is not one of its raw allocations), what the
 * resource's free returns (CUBUF_ERROR_STREAM_CAPTURING where it refuses a
 * capturing stream; the allocation then stays allocated), CUBUF_ERROR_DRIVER.
 */
CUBUF_API cubuf_status_t cubuf_resource_deallocate_raw(cubuf_resource_t *res, CUdeviceptr ptr,
                                                       size_t size, CUstream stream);

/** The `state` given to cubuf_resource_create; NULL for every other resource and for NULL. */
CUBUF_API void *cubuf_resource_user_state(const cubuf_resource_t *res);

/* ------------------------------------------------------------------------ */
/* Context buffers (pyarrow.cuda.Context)                                    */
/* ------------------------------------------------------------------------ */

/**
 * A new device buffer of `size` bytes (new_buffer), from the context's
 * device pool (a device resource the context makes on first use and keeps
 * until it is destroyed): a private pool exportable to other processes
 * (cubuf_buffer_ipc_descriptor, as pyarrow's export_for_ipc), or the
 * device's default pool where pools cannot be exported. Allocated and later
 * freed on the legacy default stream of the context: work the caller orders
 * on another stream must be ordered against that stream. Size 0 gives an
 * open buffer of size 0 with pointer 0. Counted in bytes_allocated until
 * closed; the buffer keeps the context alive. The caller releases the
 * buffer.
 * Returns CUBUF_ERROR_INVALID_ARGUMENT (NULL), CUBUF_ERROR_OUT_OF_MEMORY,
 * CUBUF_ERROR_NOT_SUPPORTED (no memory pools), CUBUF_ERROR_STREAM_CAPTURING
 * (a blocking stream of the context is capturing: allocating on the legacy
 * stream would break that capture), CUBUF_ERROR_DRIVER.
 */
CUBUF_API cubuf_status_t cubuf_context_new_buffer(cubuf_context_t *ctx, size_t size, cubuf_buffer_t **out);

/**
 * A new pinned host buffer (pyarrow's new_host_buffer) from a host-located
 * pool with device access granted (cubuf_pinned_resource_create, made on
 * first use): host and device accessible, device_id -1. Otherwise as
 * cubuf_context_new_buffer, statuses included.
 */
CUBUF_API cubuf_status_t cubuf_context_new_host_buffer(cubuf_context_t *ctx, size_t size,
                                                       cubuf_buffer_t **out);

/** Means "the rest of the data from offset" for cubuf_context_buffer_from_data's size. */
#define CUBUF_SIZE_REST ((int64_t)-1)

/**
 * A new device buffer holding a copy of data[offset, offset+size)
 * (buffer_from_data), made as by cubuf_context_new_buffer; the copy has
 * completed when the call returns (it runs on the context's legacy default
 * stream, which is synchronized). `data` may be host memory (pageable or
 * pinned), managed or device memory the context can reach.
 * size CUBUF_SIZE_REST (-1) means data_size - offset. As in pyarrow, the
 * offset must lie inside the data (offset < data_size), except that empty
 * data accepts offset 0 (and gives an empty buffer).
 * Returns CUBUF_ERROR_INVALID_ARGUMENT (NULL ctx or out, NULL data with a
 * size); CUBUF_ERROR_OUT_OF_RANGE for a negative offset, an offset at or
 * past data_size (data_size > 0) or above 0 (data_size 0), a negative size
 * other than -1, or offset+size past data_size; what
 * cubuf_context_new_buffer returns; CUBUF_ERROR_DRIVER for the copy (the
 * new buffer is freed again).
 */
CUBUF_API cubuf_status_t cubuf_context_buffer_from_data(cubuf_context_t *ctx, const void *data,
                                                        size_t data_size, int64_t offset, int64_t size,
                                                        cubuf_buffer_t **out);

/**
 * A view of [address, address+size) (foreign_buffer). address 0 with size 0
 * gives an empty buffer. The view belongs to ctx: it holds the context, and
 * its copies and fills run there (see "Default streams").
 * `base` (pyarrow's base; may be NULL) is a buffer that owns the memory: the
 * view depends on it as a slice does (cubuf_buffer_slice: it is kept alive,
 * and cannot be closed while the view is open); the range must lie inside
 * it (an empty one too: its address within [base, base + size]; address 0
 * with size 0 is inside any base). `owner` (may be NULL) is released
 * through `release` (may be NULL) exactly once, when the view closes or
 * its last reference goes (see cubuf_buffer_wrap_external); on failure
 * release is not called, base is not retained, and the caller keeps both. The address may be host or
 * device memory reachable from the device after
 * cubuf_context_device_address; it is described (device, accessibility)
 * with the context current and not otherwise checked. Views do not count
 * in bytes_allocated.
 * Returns CUBUF_ERROR_INVALID_ARGUMENT for NULL ctx or out and for address 0
 * with a size; CUBUF_ERROR_CLOSED (a closed base); CUBUF_ERROR_OUT_OF_RANGE
 * (the range is not inside base); CUBUF_ERROR_NO_DRIVER; CUBUF_ERROR_DRIVER.
 */
CUBUF_API cubuf_status_t cubuf_context_foreign_buffer(cubuf_context_t *ctx, CUdeviceptr address,
                                                      size_t size, cubuf_buffer_t *base,
                                                      void *owner, cubuf_owner_release_fn release,
                                                      cubuf_buffer_t **out);

/**
 * A view of strided memory (buffer_from_object): `ndim` dimensions of
 * shape[i] elements, strides[i] bytes apart (negative allowed), items of
 * itemsize bytes, starting at the element of index 0 at `address`. The view
 * is the contiguous span that holds every element, gaps included: from the
 * lowest to the highest byte any element touches. A dimension of length 0
 * gives an empty view at `address` (nothing else is checked then). ndim 0
 * is a scalar of itemsize bytes. A stride of 0 repeats an element. The
 * memory must be device accessible (device, pinned or managed); the view
 * keeps the address as given (for host memory registered with a separate
 * device alias, translate it with cubuf_context_device_address first).
 * `base`, `owner` and `release` as for cubuf_context_foreign_buffer (base
 * must hold the whole span).
 * Returns CUBUF_ERROR_INVALID_ARGUMENT (NULL ctx or out, ndim < 0 or > 64,
 * itemsize 0, NULL arrays with ndim > 0, a negative shape, address 0 with a
 * non-empty array, memory the device cannot reach: pageable host memory),
 * CUBUF_ERROR_OUT_OF_RANGE (the span's arithmetic overflows 64 bits, or the
 * span starts at or below address 0 or passes the end of the address
 * space, or the span is not inside base), CUBUF_ERROR_CLOSED (a closed base),
 * CUBUF_ERROR_DRIVER.
 */
CUBUF_API cubuf_status_t cubuf_context_buffer_from_strided(cubuf_context_t *ctx, CUdeviceptr address,
                                                           int ndim, const int64_t *shape,
                                                           const int64_t *strides, size_t itemsize,
                                                           cubuf_buffer_t *base, void *owner,
                                                           cubuf_owner_release_fn release,
                                                           cubuf_buffer_t **out);

/**
 * The device address of `address` in this context (get_device_address): a
 * device or managed pointer is returned as is, a pinned or mapped host
 * pointer gives its device alias (CU_POINTER_ATTRIBUTE_DEVICE_POINTER,
 * queried with the context current). Pageable memory the driver does not
 * know gives CUBUF_ERROR_INVALID_ARGUMENT with a message saying so, even
 * where the device could reach it through HMM (as cubuf_buffer_view calls it
 * host-only); so does pinned memory with no alias in this context. NULL
 * arguments give CUBUF_ERROR_INVALID_ARGUMENT; other driver failures
 * CUBUF_ERROR_DRIVER.
 */
CUBUF_API cubuf_status_t cubuf_context_device_address(cubuf_context_t *ctx, const void *address,
                                                      CUdeviceptr *device_address);

#ifdef __cplusplus
}
#endif

#include <cubuf/vmm.h>
#include <cubuf/ipc.h>
#include <cubuf/stream.h>
#include <cubuf/adaptor.h>

#endif /* CUBUF_H */
