/* Private structures and helpers shared by the cubuf sources. Never installed. */
#ifndef CUBUF_INTERNAL_H
#define CUBUF_INTERNAL_H

#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cubuf.h"
#include "abi.h"
#include "alloc.h"
#include "driver.h"

/* ---- errors (error.c) ---------------------------------------------------- */

/* Records a formatted detail as this thread's last error and returns st. */
cubuf_status_t cubuf__fail(cubuf_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* Appends " (...)" to the last error: the sizes or objects involved. */
void cubuf__detail_append(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Sends a message to the warning handler. */
void cubuf__warn(cubuf_status_t st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Remembers the CUresult of a failed driver call for cubuf_last_cuda_result. */
void cubuf__set_last_cu(CUresult r);

/* The checking macro: run a status-returning expression, unwind on failure.
 * Functions using it declare `cubuf_status_t st` and a `fail:` label. */
#define CHECK(expr)                                                                 \
    do {                                                                            \
        st = (expr);                                                                \
        if (st != CUBUF_SUCCESS) goto fail;                                         \
    } while (0)

#define CHECK_ARG(cond, ...)                                                        \
    do {                                                                            \
        if (!(cond)) return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT, __VA_ARGS__); \
    } while (0)

/* ---- contexts (context.c) -------------------------------------------------- */

struct cubuf_context {
    atomic_int refs;  /* every holder: the users together count once, each resource once */
    atomic_int users; /* public references (create, wrap); the last one drops the pools */
    CUcontext handle;
    CUdevice device;
    int ordinal;
    bool primary;                 /* retained primary context: release at the end */
    /* The context's pools, made on first use. Each holds the context, so
     * buffers from them keep it alive; bytes_allocated is their live bytes. */
    atomic_uintptr_t device_pool; /* cubuf_resource_t*, made on first new_buffer */
    atomic_uintptr_t host_pool;   /* cubuf_resource_t*, made on first new_host_buffer */
};

/* Internal references, taken by buffers and resources. */
cubuf_context_t *cubuf__context_retain(cubuf_context_t *ctx);
void cubuf__context_release(cubuf_context_t *ctx);
/* A retained context for device `ordinal` (its primary context). Validates
 * the ordinal with a message naming the valid range. */
cubuf_status_t cubuf__context_for_device(int ordinal, cubuf_context_t **out);

/* Validates a device ordinal (the message names the valid range). */
cubuf_status_t cubuf__device_get(int ordinal, CUdevice *dev);
/* One device attribute; *value is 0 when the query fails. */
cubuf_status_t cubuf__device_attr(CUdevice dev, CUdevice_attribute attr, int *value);

/* Makes `ctx` current for a while; restores the caller's context on pop.
 * Skips the push when ctx is already current (the common, fast case), and
 * does nothing at all for a NULL ctx (a user stream's token, a view). */
typedef struct cubuf_ctx_guard {
    bool pushed;
} cubuf_ctx_guard_t;
cubuf_status_t cubuf__ctx_push_nonnull(CUcontext ctx, cubuf_ctx_guard_t *guard);
static inline cubuf_status_t cubuf__ctx_push(CUcontext ctx, cubuf_ctx_guard_t *guard)
{
    guard->pushed = false;
    return ctx ? cubuf__ctx_push_nonnull(ctx, guard) : CUBUF_SUCCESS;
}
void cubuf__ctx_pop_pushed(cubuf_ctx_guard_t *guard);
static inline void cubuf__ctx_pop(cubuf_ctx_guard_t *guard)
{
    if (guard->pushed) cubuf__ctx_pop_pushed(guard);
}

/* ---- streams (stream.c) ---------------------------------------------------- */

/* A recorded deallocation stream. A default stream is bound to a context. */
typedef struct cubuf_stream_token {
    CUstream stream;
    CUcontext ctx; /* for default streams: the context they were bound in; else NULL */
} cubuf_stream_token_t;

static inline bool cubuf__stream_is_default(CUstream s)
{
    return s == NULL || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD;
}
/* Records `s`. A default stream binds to `own`, the context the memory
 * belongs to (cubuf__buffer_exec_ctx), and only when there is none to the
 * caller's current context; the work a caller orders on "stream 0" runs in
 * that same context (cubuf.h, "Default streams"). Returns
 * CUBUF_ERROR_INVALID_ARGUMENT when neither exists, CUBUF_ERROR_NO_DRIVER. */
cubuf_status_t cubuf__stream_record(cubuf_stream_token_t *t, CUstream s, CUcontext own);
/* Capture status of a stream (default streams queried inside `ctx`). A
 * default stream whose query reports an implicit dependency on a capturing
 * stream reads as CU_STREAM_CAPTURE_STATUS_ACTIVE. */
cubuf_status_t cubuf__stream_capture_status(CUstream s, CUcontext ctx, CUstreamCaptureStatus *status);
/* CUBUF_ERROR_STREAM_CAPTURING if s is capturing (naming `what`), else success. */
cubuf_status_t cubuf__stream_refuse_capture(CUstream s, CUcontext ctx, const char *what);
/* Synchronizes a recorded stream in its context. */
cubuf_status_t cubuf__stream_sync(const cubuf_stream_token_t *t);
/* Before a synchronous free: synchronizes the deallocation stream, after
 * refusing (CUBUF_ERROR_STREAM_CAPTURING, naming a `kind` buffer) a stream
 * that captures or that a capture depends on, since synchronizing it would
 * invalidate the capture. The buffer then stays open. */
cubuf_status_t cubuf__stream_sync_for_free(const cubuf_stream_token_t *t, const char *kind);

/* ---- resources (resource.c) ----------------------------------------------- */

typedef enum cubuf_resource_kind {
    CUBUF_RES_USER,
    CUBUF_RES_DEVICE_POOL,
    CUBUF_RES_PINNED_POOL,
    CUBUF_RES_MANAGED,
    CUBUF_RES_LEGACY_PINNED,
    CUBUF_RES_SYNC_DEVICE,
    CUBUF_RES_GRAPH,
    CUBUF_RES_VMM,
    CUBUF_RES_IMPORTED, /* owns imported IPC mappings */
} cubuf_resource_kind_t;

/* Operations of the built-in resources. allocate sets buf->ptr (and
 * buf->impl) for buf->size > 0 bytes; `in_ctx` says the context a default
 * stream is bound to (buf->dealloc.ctx) is already current. deallocate frees
 * them, ordered on the token, and may refuse (buffer stays open) by
 * returning an error before changing anything. */
typedef struct cubuf_resource_vtbl {
    cubuf_status_t (*allocate)(cubuf_resource_t *res, cubuf_buffer_t *buf, CUstream stream,
                               bool in_ctx);
    cubuf_status_t (*deallocate)(cubuf_resource_t *res, cubuf_buffer_t *buf,
                                 const cubuf_stream_token_t *token);
    void (*destroy)(cubuf_resource_t *res);
    /* true: the resource keeps its own statistics (VMM aliases share memory) */
    bool manages_stats;
    /* Optional, the allocation hot path in one function: a whole buffer of
     * size > 0 (object, memory, statistics, the resource held) on a user
     * stream (bound NULL) or on a default stream whose context `bound` the
     * caller made current. */
    cubuf_status_t (*allocate_buffer)(cubuf_resource_t *res, size_t size, CUstream stream,
                                      CUcontext bound, cubuf_buffer_t **out);
    /* Optional: stores a new deallocation token where other threads may read
     * it (VMM aliases read each other's under the range lock). NULL: a plain
     * store into buf->dealloc. */
    void (*set_token)(cubuf_resource_t *res, cubuf_buffer_t *buf, const cubuf_stream_token_t *token);
    /* Why cubuf_buffer_wrap cannot hand this resource memory it did not
     * allocate (its deallocate needs state only its own allocations carry);
     * NULL: it can. */
    const char *no_adopt;
} cubuf_resource_vtbl_t;

struct cubuf_resource {
    const cubuf_resource_vtbl_t *vt;
    cubuf_resource_kind_t kind;
    cubuf_resource_props_t props;
    cubuf_context_t *ctx; /* device context (retained), NULL for user resources */
    /* References and statistics, under one spin lock (resource.c says why). */
    atomic_bool lock;
    size_t refs; /* holders: callers and open buffers */
    size_t cur_bytes, peak_bytes, cur_count, peak_count;
    uint64_t total;
    /* user resources */
    cubuf_resource_ops_t user_ops;
    void *user_state;
    /* kind-specific state */
    void *impl;
    unsigned char ipc_pool_id[16]; /* pools: IPC identity, random, set on first export (ipc.c) */
};

/* Allocates a zeroed resource with one reference. */
cubuf_status_t cubuf__resource_new(const cubuf_resource_vtbl_t *vt, cubuf_resource_kind_t kind,
                                   cubuf_context_t *ctx, cubuf_resource_t **out);
/* The resource lock (resource.c says why one lock). Inline: it sits on the
 * allocation hot path. The slow path spins, then yields. */
void cubuf__resource_lock_wait(cubuf_resource_t *res);
static inline void cubuf__resource_lock(cubuf_resource_t *res)
{
    if (atomic_exchange_explicit(&res->lock, true, memory_order_acquire))
        cubuf__resource_lock_wait(res);
}
static inline void cubuf__resource_unlock(cubuf_resource_t *res)
{
    atomic_store_explicit(&res->lock, false, memory_order_release);
}

/* Statistics of one allocation of `bytes` > 0 made or freed; the lock is held. */
static inline void cubuf__stats_add_locked(cubuf_resource_t *res, size_t bytes)
{
    res->cur_bytes += bytes;
    res->cur_count++;
    res->total++;
    if (res->cur_bytes > res->peak_bytes) res->peak_bytes = res->cur_bytes;
    if (res->cur_count > res->peak_count) res->peak_count = res->cur_count;
}
static inline void cubuf__stats_sub_locked(cubuf_resource_t *res, size_t bytes)
{
    res->cur_bytes -= bytes;
    res->cur_count--;
}
/* The same, taking the lock (no reference). */
void cubuf__stats_add(cubuf_resource_t *res, size_t bytes);
void cubuf__stats_sub(cubuf_resource_t *res, size_t bytes);

/* Frees a resource whose last reference is gone. */
void cubuf__resource_destroy(cubuf_resource_t *res);

/* A buffer's hold on its resource: one reference, and, for bytes > 0, the
 * allocation in the statistics, in one critical section. drop releases the
 * reference (destroying the resource when it was the last). */
static inline void cubuf__resource_hold(cubuf_resource_t *res, size_t bytes)
{
    cubuf__resource_lock(res);
    res->refs++;
    if (bytes) cubuf__stats_add_locked(res, bytes);
    cubuf__resource_unlock(res);
}
static inline void cubuf__resource_drop(cubuf_resource_t *res, size_t bytes)
{
    if (!res) return;
    cubuf__resource_lock(res);
    if (bytes) cubuf__stats_sub_locked(res, bytes);
    bool last = --res->refs == 0;
    cubuf__resource_unlock(res);
    if (last) cubuf__resource_destroy(res);
}
/* cubuf_resource_allocate for callers that already made `current` current
 * (a default stream then binds to it with no driver query); NULL: unknown. */
cubuf_status_t cubuf__resource_allocate(cubuf_resource_t *res, size_t size, CUstream stream,
                                        CUcontext current, cubuf_buffer_t **out);

/* ---- buffers (buffer.c) ---------------------------------------------------- */

enum {
    CUBUF__DEVICE_ACCESSIBLE = 1u << 0,
    CUBUF__HOST_ACCESSIBLE = 1u << 1,
    CUBUF__MANAGED = 1u << 2,
    CUBUF__MAPPED = 1u << 3,
};

struct cubuf_buffer {
    atomic_int refs;
    bool closed;
    CUdeviceptr ptr;
    size_t size;
    int device_id;
    unsigned flags;
    cubuf_resource_t *resource; /* owning resource (retained) or NULL */
    cubuf_stream_token_t dealloc;
    void *owner;
    cubuf_owner_release_fn owner_release;
    cubuf_buffer_t *parent;     /* slices and views with a base: the retained root buffer */
    cubuf_context_t *view_ctx;  /* views made through a context: that context (retained) */
    atomic_int open_slices;     /* roots: open buffers whose parent this is (close refuses) */
    void *impl;                 /* resource-private (a VMM range, an IPC import) */
};

/* Buffer objects are recycled through a small per-thread cache (buffer.c
 * says why); its fast paths are inline, for the allocation hot path. */
#define CUBUF__BUFFER_CACHE_MAX 32
typedef struct cubuf__buffer_cache {
    cubuf_buffer_t *objs[CUBUF__BUFFER_CACHE_MAX];
    unsigned n;
} cubuf__buffer_cache_t;
/* The default TLS model on purpose: initial-exec would mark the shared
 * library STATIC_TLS, and a late dlopen (Python's ctypes) of its 1 KiB of
 * thread-local data can then fail for want of static TLS space. */
extern _Thread_local cubuf__buffer_cache_t *cubuf__tls_cache;

cubuf_status_t cubuf__buffer_new_slow(cubuf_buffer_t **out);
void cubuf__buffer_discard_slow(cubuf_buffer_t *buf);

/* Fills a fresh buffer object: open, one reference, owning nothing. Field
 * by field: the compiler turns a memset or a struct assignment into
 * `rep stos`, whose start-up costs more than these stores. */
static inline void cubuf__buffer_init(cubuf_buffer_t *buf)
{
    atomic_init(&buf->refs, 1);
    buf->closed = false;
    buf->ptr = 0;
    buf->size = 0;
    buf->device_id = -1;
    buf->flags = 0;
    buf->resource = NULL;
    buf->dealloc.stream = NULL;
    buf->dealloc.ctx = NULL;
    buf->owner = NULL;
    buf->owner_release = NULL;
    buf->parent = NULL;
    buf->view_ctx = NULL;
    atomic_init(&buf->open_slices, 0);
    buf->impl = NULL;
}

/* A zeroed open buffer with one reference. */
static inline cubuf_status_t cubuf__buffer_new(cubuf_buffer_t **out)
{
    cubuf__buffer_cache_t *c = cubuf__tls_cache;
    if (!c || !c->n) return cubuf__buffer_new_slow(out);
    cubuf_buffer_t *buf = c->objs[--c->n];
    cubuf__buffer_init(buf);
    *out = buf;
    return CUBUF_SUCCESS;
}

/* Frees the struct of a buffer that owns nothing (any more). */
static inline void cubuf__buffer_discard(cubuf_buffer_t *buf)
{
    cubuf__buffer_cache_t *c = cubuf__tls_cache;
    if (c && c->n < CUBUF__BUFFER_CACHE_MAX) c->objs[c->n++] = buf;
    else cubuf__buffer_discard_slow(buf);
}
/* Sets device_id and flags from the resource's properties. */
static inline void cubuf__buffer_take_props(cubuf_buffer_t *buf, const cubuf_resource_t *res)
{
    buf->device_id = res->props.device_id;
    buf->flags = (res->props.device_accessible ? CUBUF__DEVICE_ACCESSIBLE : 0) |
                 (res->props.host_accessible ? CUBUF__HOST_ACCESSIBLE : 0) |
                 (res->props.managed ? CUBUF__MANAGED : 0);
}
/* Returns CUBUF_ERROR_CLOSED (naming `what`) if buf is closed. */
cubuf_status_t cubuf__buffer_check_open(const cubuf_buffer_t *buf, const char *what);

/* ---- staging (staging.c) ---------------------------------------------------- */

/* The pinned pool that DURING_API_CALL copies read their sources into, for
 * the current context's device (made on first use, kept for the process).
 * CUBUF_ERROR_NOT_SUPPORTED where the device has no host memory pools. */
cubuf_status_t cubuf__staging_pool(CUmemoryPool *out);

/* Records `t` as buf's deallocation stream (through the resource's
 * set_token where it has one). */
void cubuf__buffer_set_token(cubuf_buffer_t *buf, const cubuf_stream_token_t *t);
/* Makes `buf` a dependent of `root` (a slice, or a view with a base): buf
 * retains root and counts as one of its open slices until buf closes. */
void cubuf__buffer_attach(cubuf_buffer_t *buf, cubuf_buffer_t *root);

/* The context a buffer belongs to: its resource's (for a slice or a view
 * with a base: its root's), else the context a view was made through; NULL
 * for views of no context and user resources. Work on the buffer runs in
 * it and a default stream means that context's default stream (cubuf.h,
 * "Default streams"). Inline: every copy and fill asks. */
static inline CUcontext cubuf__buffer_exec_ctx(const cubuf_buffer_t *buf)
{
    const cubuf_buffer_t *root = buf->parent ? buf->parent : buf; /* parents are roots */
    if (root->resource && root->resource->ctx) return root->resource->ctx->handle;
    if (root->view_ctx) return root->view_ctx->handle;
    return buf->view_ctx ? buf->view_ctx->handle : NULL;
}

#endif
