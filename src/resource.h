/* Resources: the vtable every resource implements, the one allocation path, statistics (resource.c). Private: never installed. */
#ifndef CUBUF_RESOURCE_H
#define CUBUF_RESOURCE_H

#include "context.h"
#include "stream_token.h"

/* ---- the vtable ---------------------------------------------------------- */

struct cubuf_ipc_descriptor;

/* What one allocation or free moved, for the statistics: bytes and
 * allocations the resource took from (or gave back to) what is below it.
 * The path presets {size, 1}; a resource whose memory differs from the
 * request says so (virtual memory rounds to its granularity and counts
 * physical allocations; an adaptor passes on what its upstream reported). */
typedef struct cubuf_charge {
    size_t bytes;
    size_t count;
} cubuf_charge_t;

/* What a resource is: every operation that differs between resource kinds
 * is an entry here, so a new kind touches no other code.
 *
 * allocate: the one allocation path's resource step. buf is the allocation
 * record: a buffer object, or for a raw allocation a record on the caller's
 * stack (see raw_keeps_buffer). It sets buf->ptr (and buf->impl) for
 * buf->size > 0 bytes ordered on `stream`; buf->dealloc already holds the
 * stream with a default stream bound to its context, and `in_ctx` says
 * that context (or, for a user stream, the caller's) is current. On
 * failure it leaves nothing allocated.
 * deallocate: frees buf's memory ordered on `token`. It may refuse (the
 * allocation stays) by returning an error before changing anything.
 * Both may change *charge (preset to {buf->size, 1}). */
typedef struct cubuf_resource_vtbl {
    const char *name; /* "device pool", ...: for messages */
    cubuf_status_t (*allocate)(cubuf_resource_t *res, cubuf_buffer_t *buf, CUstream stream,
                               bool in_ctx, cubuf_charge_t *charge);
    cubuf_status_t (*deallocate)(cubuf_resource_t *res, cubuf_buffer_t *buf,
                                 const cubuf_stream_token_t *token, cubuf_charge_t *charge);
    /* Optional: frees the resource's own state when its last reference goes. */
    void (*destroy)(cubuf_resource_t *res);
    /* Optional: stores a new deallocation token where other threads may read
     * it (VMM aliases read each other's under the range lock). NULL: a plain
     * store into buf->dealloc. */
    void (*set_token)(cubuf_resource_t *res, cubuf_buffer_t *buf, const cubuf_stream_token_t *token);
    /* Optional: an IPC descriptor for [offset, offset+size) of root, a
     * buffer this resource allocated (ipc.c has the mechanisms). NULL: the
     * memory cannot be shared, for the reason in no_export (NULL: the
     * general one). */
    cubuf_status_t (*export_ipc)(const cubuf_buffer_t *root, uint64_t offset, size_t size,
                                 struct cubuf_ipc_descriptor **out);
    const char *no_export;
    /* Why cubuf_buffer_wrap cannot hand this resource memory it did not
     * allocate (its deallocate needs state only its own allocations carry);
     * NULL: it can. */
    const char *no_adopt;
    /* Allocations carry state a (pointer, size) cannot give back (buf->impl),
     * so a raw allocation keeps a buffer object, found again by pointer on
     * deallocate (resource.c); without it a raw allocation is a record on
     * the stack and costs no more than the buffer path. */
    bool raw_keeps_buffer;
    /* Optional: the CUmemoryPool behind the resource (pool resources). */
    CUmemoryPool (*pool)(const cubuf_resource_t *res);
    /* An adaptor that keeps no statistics of its own (logging, tracking,
     * the failure callback): its allocations are counted by its upstream,
     * whose figures reading its statistics gives (cubuf__stats_owner). */
    bool passes_stats;
} cubuf_resource_vtbl_t;

/* ---- the resource ---------------------------------------------------------- */

/* Usage counters. Signed: a statistics scope (adaptor.h) sees frees of
 * allocations made before it was pushed. */
typedef struct cubuf_tally {
    int64_t bytes, peak_bytes, count, peak_count; /* current and high-water, allocated bytes */
    int64_t req_bytes, peak_req_bytes;            /* the same of requested bytes */
    uint64_t total_count, total_bytes, total_req_bytes;
} cubuf_tally_t;

/* A pushed statistics scope (adaptor_stats.c): counts what happens after
 * its push; the innermost one is updated with the resource's tally. */
typedef struct cubuf_scope {
    cubuf_tally_t tally;
    struct cubuf_scope *outer;
} cubuf_scope_t;

struct cubuf_raw_map; /* resource.c: raw allocations of raw_keeps_buffer resources */

struct cubuf_resource {
    const cubuf_resource_vtbl_t *vt;
    cubuf_resource_props_t props;
    cubuf_context_t *ctx; /* device context (retained), NULL for user resources */
    /* References, statistics and the cap, under one spin lock (resource.c
     * says why): *lock, which is own_lock for a resource over nothing and
     * its upstream's for an adaptor, so one critical section counts a whole
     * stack of them. */
    cubuf_lock_t *lock;
    cubuf_lock_t own_lock;
    cubuf_resource_t *upstream; /* adaptors: the resource below (retained by the adaptor) */
    size_t refs; /* holders: callers and open buffers */
    cubuf_tally_t tally;
    cubuf_scope_t *scope; /* innermost pushed scope or NULL (statistics adaptors) */
    size_t cap;           /* requested bytes the resource may hold; SIZE_MAX: no cap (limiting adaptors) */
    size_t admitted;      /* capped: bytes of requests admitted and not yet made or failed */
    struct cubuf_raw_map *raw;
    bool fabric_fallback; /* asked for fabric handles, made with POSIX fds (pools; VMM keeps its own) */
    void *impl; /* kind-specific state */
    unsigned char ipc_pool_id[16]; /* pools: IPC identity, random, set on first export (ipc.c) */
};

/* Allocates a zeroed resource with one reference, holding `ctx` (NULL for
 * none), and `impl_size` zeroed bytes of state in the same allocation
 * (res->impl points there; 0: impl NULL, for the resource to set). */
cubuf_status_t cubuf__resource_new(const cubuf_resource_vtbl_t *vt, cubuf_context_t *ctx,
                                   size_t impl_size, cubuf_resource_t **out);
/* The resource lock (resource.c says why one lock), shared by an adaptor
 * and everything below it. Never held while taking another. */
static inline void cubuf__resource_lock(cubuf_resource_t *res) { cubuf__lock(res->lock); }
static inline void cubuf__resource_unlock(cubuf_resource_t *res) { cubuf__unlock(res->lock); }

/* The counting: the only code that changes a tally. `sign` +1 for an
 * allocation of `requested` bytes that moved `charge`, -1 for its free. The
 * lock is held. */
static inline int64_t cubuf__tally_add(int64_t v, int sign, uint64_t d)
{
    /* Modulo 2^64 (a size past INT64_MAX from a user resource must not
     * overflow a signed count); back to exact when the free comes. */
    return (int64_t)((uint64_t)v + (sign > 0 ? d : (uint64_t)0 - d));
}
static inline void cubuf__tally_move(cubuf_tally_t *t, int sign, size_t requested,
                                     const cubuf_charge_t *charge)
{
    t->bytes = cubuf__tally_add(t->bytes, sign, charge->bytes);
    t->count = cubuf__tally_add(t->count, sign, charge->count);
    t->req_bytes = cubuf__tally_add(t->req_bytes, sign, requested);
    if (sign > 0) {
        t->total_count += charge->count;
        t->total_bytes += charge->bytes;
        t->total_req_bytes += requested;
        if (t->bytes > t->peak_bytes) t->peak_bytes = t->bytes;
        if (t->count > t->peak_count) t->peak_count = t->count;
        if (t->req_bytes > t->peak_req_bytes) t->peak_req_bytes = t->req_bytes;
    }
}
static inline void cubuf__count_locked(cubuf_resource_t *res, int sign, size_t requested,
                                       const cubuf_charge_t *charge)
{
    cubuf__tally_move(&res->tally, sign, requested, charge);
    if (__builtin_expect(res->scope != NULL, 0))
        cubuf__tally_move(&res->scope->tally, sign, requested, charge);
}
/* The same, taking the lock: memory a resource makes or drops outside the
 * allocation path (a VMM grow, an IPC import). */
void cubuf__resource_count(cubuf_resource_t *res, int sign, size_t requested,
                           const cubuf_charge_t *charge);

/* Frees a resource whose last reference is gone. */
void cubuf__resource_destroy(cubuf_resource_t *res);
/* Drops a reference taken with cubuf_resource_retain or by a buffer. */
static inline void cubuf__resource_unref(cubuf_resource_t *res)
{
    if (!res) return;
    cubuf__resource_lock(res);
    bool last = --res->refs == 0;
    cubuf__resource_unlock(res);
    if (last) cubuf__resource_destroy(res);
}

/* ---- the one allocation path (resource.c) ------------------------------------ */

/* cubuf_resource_allocate for callers that already made `current` current
 * (a default stream then binds to it with no driver query); NULL: unknown. */
cubuf_status_t cubuf__resource_allocate(cubuf_resource_t *res, size_t size, CUstream stream,
                                        CUcontext current, cubuf_buffer_t **out);
/* The free of a buffer's memory (close): the resource's deallocate, then the
 * statistics and the buffer's reference on the resource. On failure nothing
 * changed. */
cubuf_status_t cubuf__resource_free_buffer(cubuf_resource_t *res, cubuf_buffer_t *buf);
/* The buffer a raw_keeps_buffer resource keeps for its raw allocation at
 * `ptr` (what it gave an adaptor or a caching resource above it), or NULL
 * (another kind of resource, no such allocation). Valid while that
 * allocation is live. */
cubuf_buffer_t *cubuf__raw_kept_buffer(cubuf_resource_t *res, CUdeviceptr ptr);

/* Takes over [ptr, ptr+size) for buf (cubuf_buffer_wrap): counted, held. */
void cubuf__resource_adopt(cubuf_resource_t *res, cubuf_buffer_t *buf);

/* The resource whose figures res's statistics are: res, or for an adaptor
 * that passes them on, the first upstream that keeps its own. */
static inline cubuf_resource_t *cubuf__stats_owner(const cubuf_resource_t *res)
{
    while (res->vt->passes_stats) res = res->upstream;
    return (cubuf_resource_t *)res;
}

/* One layer down, for adaptors: the allocation of rec->size bytes on
 * rec->dealloc (bound already) by `res`, the adaptor's upstream, into
 * rec->ptr, rec being the caller's own record (a buffer object or a raw
 * record), which the upstream only reads size and stream from and writes
 * the pointer to; and its free. Uncounted: the call at the top of the stack
 * counts every layer it passed once the allocation is made (or freed), in
 * one critical section of their shared lock (a raw_keeps_buffer upstream
 * counts itself). A cap below holds the bytes from the layer's step until
 * then. `in_ctx` as for vtbl allocate; *charge receives what the upstream
 * moved. */
cubuf_status_t cubuf__layer_allocate(cubuf_resource_t *res, cubuf_buffer_t *rec, bool in_ctx,
                                     cubuf_charge_t *charge);
cubuf_status_t cubuf__layer_free(cubuf_resource_t *res, cubuf_buffer_t *rec,
                                 const cubuf_stream_token_t *token, cubuf_charge_t *charge);
/* Gives back what cubuf__layer_allocate made for an adaptor that fails
 * after it (nothing then counts it): freed on rec->dealloc, and the caps
 * below let go of the bytes they held for it. */
void cubuf__layer_undo(cubuf_resource_t *res, cubuf_buffer_t *rec);

#endif
