/* The host-backed test driver's internal header (tests/driver/): the
 * declarations every file of the fake libcuda shares. Never installed.
 *
 * Each entry point `cuX` of src/driver.h's table is implemented by a function
 * `td_cuX` with the exact signature of cudaTypedefs.h's PFN_cuX_v<version>
 * (declared below from the same X-macro list, so a mismatch does not
 * compile); proc.c hands them out through cuGetProcAddress_v2.
 * Files: proc.c (table), device.c, ctx.c, stream.c,
 * mem.c (core); pool.c, vmm.c, ipc.c (memory pools, VMM, legacy IPC).
 *
 * "Device memory" is host memory of this process (unified addressing). */
#ifndef CUBUF_TESTDRIVER_FAKE_H
#define CUBUF_TESTDRIVER_FAKE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cudaTypedefs.h>

#include "driver.h" /* CUBUF_DRIVER_ENTRIES only */

#define TD_API __attribute__((visibility("default")))

/* Every entry point, declared with its table signature. */
#define TD_DECLARE_(name, version) extern __typeof__(*(PFN_##name##_v##version)0) td_##name;
CUBUF_DRIVER_ENTRIES(TD_DECLARE_, TD_DECLARE_)
#undef TD_DECLARE_

/* ---- devices (device.c) ---- */
#define TD_DRIVER_VERSION 13000
#define TD_DEVICE_COUNT 2
#define TD_TOTAL_MEM ((size_t)8 << 30)       /* per device: room for the 4 GiB allocations tests make */
#define TD_GRANULARITY ((size_t)2 << 20)     /* VMM and pool granularity */

/* CUDA_ERROR_NOT_INITIALIZED before cuInit, else CUDA_SUCCESS. */
CUresult td_check_init(void);
/* CUDA_ERROR_INVALID_DEVICE unless 0 <= dev < TD_DEVICE_COUNT (after init). */
CUresult td_check_device(CUdevice dev);

/* Device memory accounting for cuMemGetInfo: every device allocation of any
 * kind (cuMemAlloc, pool reservations, VMM physical memory) charges its
 * device. td_mem_charge returns CUDA_ERROR_OUT_OF_MEMORY (charging nothing)
 * when the device's total would be exceeded. Thread-safe. */
CUresult td_mem_charge(int device, size_t bytes);
void td_mem_uncharge(int device, size_t bytes);
size_t td_mem_used(int device);

/* ---- contexts (ctx.c) ---- */
/* The calling thread's current context (NULL if none). */
CUcontext td_ctx_current(void);
/* The current context or CUDA_ERROR_INVALID_CONTEXT if none is current. */
CUresult td_ctx_require(CUcontext *ctx);
/* The device of a live context, or -1 for an invalid/destroyed one. */
int td_ctx_device(CUcontext ctx);

/* ---- streams and the op queue (stream.c) ---- */
/* An operation on a stream: fn(arg) runs on the stream's worker thread, in
 * order with the stream's other work and the legacy-stream rules. `arg`
 * points to the op's own copy of the bytes given to td_enqueue (so a
 * captured op can be replayed any number of times by cuGraphLaunch). */
typedef void (*td_op_fn)(void *arg);

/* Enqueues fn on hStream (0, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD or a
 * created stream), copying arg_size bytes of arg; if the stream is
 * capturing, records the op into the capture's graph instead. Returns
 * CUDA_ERROR_INVALID_CONTEXT (no context current for a default stream),
 * CUDA_ERROR_INVALID_HANDLE (destroyed stream), the
 * CUDA_ERROR_STREAM_CAPTURE_* errors of the real driver (implicit legacy
 * capture dependency, invalidated capture), CUDA_ERROR_OUT_OF_MEMORY. */
CUresult td_enqueue(CUstream hStream, td_op_fn fn, const void *arg, size_t arg_size);

/* A synchronous call (cuMemcpy, cuMemsetD8...): td_capture_unsafe_call's
 * check, then fn enqueued on hStream as by td_enqueue and waited for. */
CUresult td_enqueue_sync(CUstream hStream, td_op_fn fn, const void *arg, size_t arg_size);

/* The context of a stream (resolving the default stream handles). */
CUresult td_stream_ctx(CUstream hStream, CUcontext *ctx);
/* Whether hStream is capturing now: CU_STREAM_CAPTURE_STATUS_NONE, _ACTIVE
 * or _INVALIDATED. Errors as td_enqueue. */
CUresult td_stream_capture_status(CUstream hStream, CUstreamCaptureStatus *status);
/* Hands a resource to the graph being captured on hStream (a graph
 * allocation, as cuMemAllocFromPoolAsync makes during capture): release(arg)
 * runs once when the graph is destroyed (or at once, if the capture ends in
 * failure). CUDA_ERROR_ILLEGAL_STATE if hStream is not capturing. */
CUresult td_capture_own(CUstream hStream, void (*release)(void *arg), void *arg);
/* For a call the real driver forbids while a capture in global mode (any
 * thread) or thread-local mode (this thread) is active, unless this thread
 * is in relaxed mode: invalidates those captures and returns
 * CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED; CUDA_SUCCESS otherwise.
 * (cuMemAlloc, cuMemFree, synchronous copies, cuMemHostAlloc...) */
CUresult td_capture_unsafe_call(void);
/* Waits until all work enqueued so far on every stream of ctx (or of every
 * context when ctx is NULL) has run. */
void td_ctx_drain(CUcontext ctx);
/* cuCtxSynchronize of ctx: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (and the
 * captures invalidated) while a stream of ctx captures, else waits as
 * td_ctx_drain. */
CUresult td_ctx_synchronize(CUcontext ctx);
/* A context goes away (cuCtxDestroy, the last primary release): waits for
 * its streams' work, then destroys its streams (events stay valid). */
void td_ctx_streams_destroy(CUcontext ctx);

/* ---- memory (mem.c) ---- */
/* What an address range is. */
typedef enum td_kind {
    TD_KIND_DEVICE,     /* cuMemAlloc */
    TD_KIND_HOST,       /* cuMemAllocHost / cuMemHostAlloc */
    TD_KIND_REGISTERED, /* cuMemHostRegister */
    TD_KIND_MANAGED,    /* cuMemAllocManaged */
    TD_KIND_POOL,       /* pool allocation (device or host pool) */
    TD_KIND_VMM_RESERVE,/* cuMemAddressReserve (no memory behind it) */
    TD_KIND_VMM_MAP,    /* cuMemMap of a physical allocation */
    TD_KIND_IPC,        /* cuIpcOpenMemHandle / imported pool pointer */
} td_kind_t;

/* One registered address range. Ranges may nest (a VMM mapping inside its
 * reservation); lookups return the innermost one. */
typedef struct td_range {
    uintptr_t base;
    size_t size;
    td_kind_t kind;
    int device;          /* device ordinal; -1 for plain host memory */
    CUcontext ctx;       /* context that allocated it (NULL for pools/VMM) */
    int fd;              /* memfd behind it, or -1 */
    size_t fd_offset;    /* offset of base within the memfd */
    void *owner;         /* the pool (CUmemoryPool) or VMM handle, or NULL */
    bool host_memtype;   /* reports CU_MEMORYTYPE_HOST (host pools, host memory) */
    unsigned long long id; /* unique id (CU_POINTER_ATTRIBUTE_BUFFER_ID), set by td_range_add */
    unsigned flags;      /* cuMemHostAlloc / cuMemHostRegister flags (host kinds) */
    unsigned handle_types; /* CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES: a VMM mapping's
                              physical allocation's requestedHandleTypes; else 0 */
} td_range_t;

/* Adds a range (its id is assigned). CUDA_ERROR_OUT_OF_MEMORY if the
 * registry cannot grow. Thread-safe, like every td_range_* call. */
CUresult td_range_add(td_range_t *range);
/* The innermost range containing addr, copied to *out; false if none. */
bool td_range_find(uintptr_t addr, td_range_t *out);
/* Removes the range of this kind that starts exactly at base, copying it to
 * *out (may be NULL); false if there is none. */
bool td_range_remove(uintptr_t base, td_kind_t kind, td_range_t *out);


/* ---- pools, VMM and IPC (pool.c, vmm.c, ipc.c) ---- */
/* cuMemFree of stream-ordered memory (a TD_KIND_POOL range: a pool or graph
 * allocation; a TD_KIND_IPC range made by cuMemPoolImportPointer): waits
 * for all enqueued work, then frees it at once, as the real cuMemFree does.
 * CUDA_ERROR_INVALID_VALUE for any other range (a legacy IPC mapping is
 * closed with cuIpcCloseMemHandle). mem.c's cuMemFree calls it for ranges
 * of those two kinds. */
CUresult td_pool_free_sync(const td_range_t *range);
/* A memfd named "cubuf-td-<name>" of `size` bytes (close-on-exec), or -1
 * with errno. Memory other processes import is made with it, so that an
 * importer can tell the driver's fds from any other file. (ipc.c) */
int td_share_memfd(const char *name, size_t size);
/* The name given to td_share_memfd of the memfd behind fd ("pool:..."), in
 * name[cap]; false if fd is no such memfd. (ipc.c) */
bool td_share_name(int fd, char *name, size_t cap);

/* Exported besides cuGetProcAddress_v2: */
TD_API const char *cubuf_testdriver_name(void);

#endif
