/* The resource interface: references, properties, statistics, the one
 * allocation path (buffers and raw pointers alike), and user-defined
 * resources. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "abi.h"
#include "internal.h"
#include "ptrmap.h"
#include "resource_pool.h"

/* References and statistics change with every allocation and free, from
 * any thread. They share one spin lock rather than being separate atomics:
 * an allocate + free then pays two atomic read-modify-writes (one per lock)
 * where separate counters cost seven (reference, bytes, count, total, peaks,
 * and back), and readers get a consistent snapshot. An adaptor shares the
 * lock of its upstream, so an allocation through a stack of them counts
 * every layer in one critical section, and a layer costs no atomic of its
 * own (one atomic read-modify-write is about 9 ns on the H200's host; the
 * stack's threads meet at its bottom resource anyway). A critical section is
 * a few additions (the biased spin lock, lock.h: the owner of a lock pays no
 * atomic at all). */

/* The resource and its state in one block; the state keeps max_align_t's alignment. */
typedef struct resource_block {
    cubuf_resource_t res;
    max_align_t impl[];
} resource_block_t;

cubuf_status_t cubuf__resource_new(const cubuf_resource_vtbl_t *vt, cubuf_context_t *ctx,
                                   size_t impl_size, cubuf_resource_t **out)
{
    resource_block_t *block = cubuf__calloc(1, sizeof *block + impl_size);
    if (!block) return cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "cannot allocate a resource");
    cubuf_resource_t *res = &block->res;
    if (impl_size) res->impl = block->impl;
    res->lock = &res->own_lock;
    res->refs = 1;
    res->vt = vt;
    res->ctx = ctx;
    res->cap = SIZE_MAX;
    res->props = (cubuf_resource_props_t)CUBUF_RESOURCE_PROPS_INIT;
    if (ctx) res->props.device_id = ctx->ordinal;
    *out = res;
    return CUBUF_SUCCESS;
}

static void raw_map_free(struct cubuf_raw_map *m);

void cubuf__resource_destroy(cubuf_resource_t *res)
{
    if (res->vt->destroy) res->vt->destroy(res);
    raw_map_free(res->raw);
    cubuf__context_release(res->ctx);
    free(res);
}

cubuf_resource_t *cubuf_resource_retain(cubuf_resource_t *res)
{
    if (!res) return NULL;
    cubuf__resource_lock(res);
    res->refs++;
    cubuf__resource_unlock(res);
    return res;
}

void cubuf_resource_release(cubuf_resource_t *res) { cubuf__resource_unref(res); }

void cubuf__resource_count(cubuf_resource_t *res, int sign, size_t requested,
                           const cubuf_charge_t *charge)
{
    cubuf__resource_lock(res);
    cubuf__count_locked(res, sign, requested, charge);
    cubuf__resource_unlock(res);
}

static size_t clamp0(int64_t v) { return v > 0 ? (size_t)v : 0; }

cubuf_status_t cubuf_resource_props(const cubuf_resource_t *res, cubuf_resource_props_t *props)
{
    CHECK_ARG(res && props, "cubuf_resource_props: NULL argument");
    cubuf_status_t st = cubuf__struct_check("cubuf_resource_props", "cubuf_resource_props_t",
                                            props->struct_size, CUBUF_RESOURCE_PROPS_SIZE_V1,
                                            sizeof *props);
    if (st != CUBUF_SUCCESS) return st;
    cubuf__struct_out(props, &res->props, sizeof *props);
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf_resource_stats(const cubuf_resource_t *res, cubuf_resource_stats_t *stats)
{
    static const char fn[] = "cubuf_resource_stats";
    CHECK_ARG(res && stats, "cubuf_resource_stats: NULL argument");
    cubuf_status_t st = cubuf__struct_check(fn, "cubuf_resource_stats_t", stats->struct_size,
                                            CUBUF_RESOURCE_STATS_SIZE_V1, sizeof *stats);
    if (st != CUBUF_SUCCESS) return st;
    cubuf_resource_stats_t s = CUBUF_RESOURCE_STATS_INIT;
    /* An adaptor that keeps no statistics reads its upstream's, the pool
     * figures included (the lock is not part of the value). */
    cubuf_resource_t *r = cubuf__stats_owner(res);
    /* The pool figures are driver queries: made only for a caller with room for them. */
    if (stats->struct_size > CUBUF_RESOURCE_STATS_SIZE_V1 &&
        (st = cubuf__pool_usage(r, &s)) != CUBUF_SUCCESS)
        return st;
    cubuf__resource_lock(r);
    cubuf_tally_t t = r->tally;
    cubuf__resource_unlock(r);
    s.current_bytes = clamp0(t.bytes);
    s.peak_bytes = clamp0(t.peak_bytes);
    s.current_count = clamp0(t.count);
    s.peak_count = clamp0(t.peak_count);
    s.total_allocations = t.total_count;
    cubuf__struct_out(stats, &s, sizeof s);
    return CUBUF_SUCCESS;
}

/* ---- the one allocation path ------------------------------------------------- */

/* The stream an allocation is ordered on, as recorded for its free. A
 * default stream is the default stream of the resource's context (of the
 * caller's current context for a resource of none): the allocation, the
 * work the caller orders on "stream 0" (copies and fills run in the
 * resource's context too) and the free share one stream, whatever the
 * caller has current (cubuf.h, "Default streams"). *in_ctx: that context
 * is current, so the resource need not push it. */
static inline __attribute__((always_inline)) cubuf_status_t
bind_stream(const cubuf_resource_t *res, CUstream stream, CUcontext current, cubuf_stream_token_t *t,
            bool *in_ctx)
{
    t->stream = stream;
    t->ctx = NULL;
    *in_ctx = true;
    if (!res->props.device_accessible || !cubuf__stream_is_default(stream)) return CUBUF_SUCCESS;
    cubuf_status_t st;
    if (!current) {
        if ((st = cubuf__driver_load()) != CUBUF_SUCCESS) return st;
        if ((st = CU(cuCtxGetCurrent, &current)) != CUBUF_SUCCESS) return st;
    }
    t->ctx = res->ctx ? res->ctx->handle : current;
    if (!t->ctx)
        return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,
                           "cubuf_resource_allocate: a default stream needs a context: the "
                           "resource belongs to no device and no CUDA context is current");
    *in_ctx = t->ctx == current;
    return CUBUF_SUCCESS;
}

/* A capped resource (a limiting adaptor) holds a request's bytes from the
 * moment it admits it (res->admitted), so concurrent requests cannot pass
 * the cap together; the request is counted once it is made (the peaks then
 * see only allocations that happened). The cap is of requested bytes. Kept
 * out of the hot path of the others. */
static __attribute__((noinline)) cubuf_status_t admit(cubuf_resource_t *res, size_t size)
{
    cubuf__resource_lock(res);
    /* Modulo 2^64, as the tally counts (cubuf__tally_add): a capped layer's
     * requested bytes never go below 0, but they may pass INT64_MAX. */
    size_t used = (size_t)(uint64_t)res->tally.req_bytes + res->admitted;
    bool fits = used <= res->cap && size <= res->cap - used;
    if (fits) res->admitted += size;
    cubuf__resource_unlock(res);
    if (fits) return CUBUF_SUCCESS;
    return cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY,
                       "limiting adaptor: an allocation of %zu bytes would pass the cap of %zu "
                       "bytes (%zu bytes allocated through it now)",
                       size, res->cap, used);
}

/* Lets go of bytes admit() held for a request that failed (or was undone). */
static __attribute__((noinline)) void unadmit(cubuf_resource_t *res, size_t size)
{
    cubuf__resource_lock(res);
    res->admitted -= size;
    cubuf__resource_unlock(res);
}

/* The counting of one allocation (sign +1, of `asked` bytes, rec->size now
 * `size`) or its free (-1) through `res`: res and, below an adaptor, each
 * upstream down to the first that is not an adaptor or counts itself (a
 * raw_keeps_buffer one, whose raw path is a buffer of its own). They share
 * res's lock, which is held. A capped layer's admitted bytes become counted
 * ones. */
static inline __attribute__((always_inline)) void count_layers_locked(cubuf_resource_t *res, int sign,
                                                                      size_t asked, size_t size,
                                                                      const cubuf_charge_t *charge)
{
    for (cubuf_resource_t *r = res;;) {
        if (!r->vt->passes_stats) {
            const bool capped = r->cap != SIZE_MAX;
            if (capped && sign > 0) r->admitted -= asked;
            cubuf__count_locked(r, sign, capped && sign > 0 ? asked : size, charge);
        }
        r = r->upstream;
        if (!r || r->vt->raw_keeps_buffer) return;
    }
}

/* One layer's step of an allocation, uncounted: a cap's admission, then the
 * resource's allocate. rec->size > 0 and rec->dealloc are set. */
static inline __attribute__((always_inline)) cubuf_status_t
allocate_step(cubuf_resource_t *res, cubuf_buffer_t *rec, CUstream stream, bool in_ctx,
              cubuf_charge_t *charge)
{
    const size_t asked = rec->size;
    const bool capped = res->cap != SIZE_MAX;
    cubuf_status_t st;
    if (__builtin_expect(capped, 0) && (st = admit(res, asked)) != CUBUF_SUCCESS) return st;
    *charge = (cubuf_charge_t){asked, 1};
    st = res->vt->allocate(res, rec, stream, in_ctx, charge);
    if (__builtin_expect(st != CUBUF_SUCCESS && capped, 0)) unadmit(res, asked);
    return st;
}

/* An allocation at the top of a stack: the steps down it, then the counting
 * of every layer (and, `hold`: rec is a buffer, a reference on res) in one
 * critical section. */
static inline __attribute__((always_inline)) cubuf_status_t
allocate_counted(cubuf_resource_t *res, cubuf_buffer_t *rec, CUstream stream, bool in_ctx, bool hold,
                 cubuf_charge_t *charge)
{
    const size_t asked = rec->size;
    cubuf_status_t st = allocate_step(res, rec, stream, in_ctx, charge);
    if (__builtin_expect(st != CUBUF_SUCCESS, 0)) return st;
    cubuf__resource_lock(res);
    count_layers_locked(res, +1, asked, rec->size, charge);
    res->refs += hold;
    cubuf__resource_unlock(res);
    return CUBUF_SUCCESS;
}

/* A free at the top of a stack, counted the same way; nothing changes on
 * failure. `unhold`: drops rec's (a buffer's) reference on res. */
static inline __attribute__((always_inline)) cubuf_status_t
free_counted(cubuf_resource_t *res, cubuf_buffer_t *rec, const cubuf_stream_token_t *token, bool unhold,
             cubuf_charge_t *charge)
{
    const size_t size = rec->size;
    *charge = (cubuf_charge_t){size, 1};
    cubuf_status_t st = res->vt->deallocate(res, rec, token, charge);
    if (st != CUBUF_SUCCESS) return st;
    cubuf__resource_lock(res);
    count_layers_locked(res, -1, size, size, charge);
    bool last = unhold && --res->refs == 0;
    cubuf__resource_unlock(res);
    if (last) cubuf__resource_destroy(res);
    return CUBUF_SUCCESS;
}

static cubuf_status_t allocate_buffer(cubuf_resource_t *res, size_t size, CUstream stream,
                                      CUcontext current, cubuf_buffer_t **out, cubuf_charge_t *charge)
{
    bool in_ctx;
    cubuf_stream_token_t t;
    cubuf_status_t st = bind_stream(res, stream, current, &t, &in_ctx);
    if (__builtin_expect(st != CUBUF_SUCCESS, 0)) return st;
    cubuf_buffer_t *buf = NULL;
    if (__builtin_expect((st = cubuf__buffer_new(&buf)) != CUBUF_SUCCESS, 0)) return st;
    buf->size = size;
    cubuf__buffer_take_props(buf, res);
    /* Field by field: a struct assignment reads the token as one 16-byte
     * load of the two 8-byte stores just made, which the CPU cannot forward
     * (a stall of a dozen cycles, seen with perf; CMakeLists.txt). */
    buf->dealloc.stream = t.stream;
    buf->dealloc.ctx = t.ctx;
    buf->resource = res;
    *charge = (cubuf_charge_t){0, 0};
    if (size) {
        st = allocate_counted(res, buf, stream, in_ctx, true, charge);
    } else {
        cubuf__resource_lock(res);
        res->refs++;
        cubuf__resource_unlock(res);
    }
    if (__builtin_expect(st != CUBUF_SUCCESS, 0)) {
        cubuf__buffer_discard(buf);
        return st;
    }
    *out = buf;
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf__resource_allocate(cubuf_resource_t *res, size_t size, CUstream stream,
                                        CUcontext current, cubuf_buffer_t **out)
{
    cubuf_charge_t ch;
    return allocate_buffer(res, size, stream, current, out, &ch);
}

cubuf_status_t cubuf_resource_allocate(cubuf_resource_t *res, size_t size, CUstream stream,
                                       cubuf_buffer_t **out)
{
    CHECK_ARG(res && out, "cubuf_resource_allocate: NULL argument");
    return cubuf__resource_allocate(res, size, stream, NULL, out);
}

cubuf_status_t cubuf__resource_free_buffer(cubuf_resource_t *res, cubuf_buffer_t *buf)
{
    cubuf_charge_t ch;
    if (buf->ptr) return free_counted(res, buf, &buf->dealloc, true, &ch);
    cubuf__resource_unref(res);
    return CUBUF_SUCCESS;
}

void cubuf__resource_adopt(cubuf_resource_t *res, cubuf_buffer_t *buf)
{
    /* As the close will count it back: an allocation wherever there is a pointer. */
    const cubuf_charge_t ch = {buf->size, 1};
    cubuf__resource_lock(res);
    if (buf->ptr) cubuf__count_locked(res, +1, buf->size, &ch);
    res->refs++;
    cubuf__resource_unlock(res);
}

/* ---- raw pointers ------------------------------------------------------------------ */

/* The raw allocations of a raw_keeps_buffer resource: pointer -> the buffer
 * that owns it (entry a) and the size the caller asked for, under a mutex
 * of their own (these allocations are synchronous virtual-memory work, far
 * slower than the lookup). */
struct cubuf_raw_map {
    pthread_mutex_t lock;
    cubuf_ptrmap_t map;
    size_t reserved; /* inserts of allocations under way, room made for each */
};

static void raw_map_free(struct cubuf_raw_map *m)
{
    if (!m) return; /* empty: each kept buffer holds the resource */
    pthread_mutex_destroy(&m->lock);
    cubuf__ptrmap_free(&m->map);
    free(m);
}

/* The map, made on first use (under the resource lock, so one is made). */
static struct cubuf_raw_map *raw_map(cubuf_resource_t *res)
{
    cubuf__resource_lock(res);
    struct cubuf_raw_map *m = res->raw;
    cubuf__resource_unlock(res);
    if (m) return m;
    m = cubuf__calloc(1, sizeof *m);
    if (!m) return NULL;
    pthread_mutex_init(&m->lock, NULL);
    cubuf__resource_lock(res);
    struct cubuf_raw_map *won = res->raw ? res->raw : (res->raw = m);
    cubuf__resource_unlock(res);
    if (won != m) raw_map_free(m);
    return won;
}

/* A raw allocation of a raw_keeps_buffer resource: a buffer, kept in the map. */
static cubuf_status_t raw_keep_allocate(cubuf_resource_t *res, size_t size,
                                        const cubuf_stream_token_t *on, bool in_ctx,
                                        CUdeviceptr *ptr, cubuf_charge_t *charge)
{
    struct cubuf_raw_map *m = raw_map(res);
    if (!m) return cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "cannot allocate the raw allocation map");
    /* Room in the map first, so that a failure there leaves nothing to undo
     * (the statistics of an allocation made and freed would keep it). */
    pthread_mutex_lock(&m->lock);
    cubuf_status_t st = cubuf__ptrmap_reserve(&m->map, m->reserved + 1);
    if (st == CUBUF_SUCCESS) m->reserved++;
    pthread_mutex_unlock(&m->lock);
    if (st != CUBUF_SUCCESS) return st;
    cubuf_buffer_t *buf = NULL;
    CUcontext current = in_ctx ? on->ctx : NULL;
    st = allocate_buffer(res, size, on->stream, current, &buf, charge);
    pthread_mutex_lock(&m->lock);
    m->reserved--;
    if (st == CUBUF_SUCCESS) {
        const cubuf_ptr_entry_t e = {buf->ptr, size, buf, NULL, 0};
        /* An entry of the same pointer is a free that returned it upstream
         * and has not yet taken its entry out: this one takes its place. */
        cubuf_ptr_entry_t *stale = cubuf__ptrmap_find(&m->map, e.ptr);
        if (stale) *stale = e;
        else (void)cubuf__ptrmap_insert(&m->map, &e); /* cannot fail: reserved */
    }
    pthread_mutex_unlock(&m->lock);
    if (st == CUBUF_SUCCESS) *ptr = buf->ptr;
    return st;
}

static cubuf_status_t raw_keep_deallocate(cubuf_resource_t *res, CUdeviceptr ptr, size_t size,
                                          const cubuf_stream_token_t *token, cubuf_charge_t *charge)
{
    cubuf__resource_lock(res);
    struct cubuf_raw_map *m = res->raw;
    cubuf__resource_unlock(res);
    /* The entry stays in the map, marked (c = 1), while its free runs: a
     * failed free then needs no room to put it back, and a second free of
     * the same pointer meanwhile is refused. */
    cubuf_ptr_entry_t *e = NULL;
    cubuf_buffer_t *buf = NULL;
    bool wrong_size = false;
    if (m) {
        pthread_mutex_lock(&m->lock);
        e = cubuf__ptrmap_find(&m->map, ptr);
        wrong_size = e && e->size != size;
        if (e && !wrong_size && !e->c) {
            e->c = 1;
            buf = e->a;
        }
        pthread_mutex_unlock(&m->lock);
    }
    if (!buf)
        return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,
                           "cubuf_resource_deallocate_raw: 0x%llx (%zu bytes) is not a raw "
                           "allocation of this %s resource%s",
                           (unsigned long long)ptr, size, res->vt->name,
                           wrong_size ? " of that size" : e ? " (another thread is freeing it)" : "");
    cubuf_stream_token_t saved = buf->dealloc;
    cubuf__buffer_set_token(buf, token);
    /* The buffer's hold on the resource goes last: the map lives in it. */
    cubuf_status_t st = free_counted(res, buf, &buf->dealloc, false, charge);
    if (st != CUBUF_SUCCESS) cubuf__buffer_set_token(buf, &saved);
    cubuf_ptr_entry_t gone;
    pthread_mutex_lock(&m->lock);
    e = cubuf__ptrmap_find(&m->map, ptr);
    if (e && st != CUBUF_SUCCESS) e->c = 0; /* still allocated */
    else if (e && e->a == buf) (void)cubuf__ptrmap_remove(&m->map, ptr, &gone);
    /* else a new allocation of the pointer took the entry over: it stays */
    pthread_mutex_unlock(&m->lock);
    if (st != CUBUF_SUCCESS) return st;
    cubuf__resource_unref(res);
    buf->resource = NULL;
    buf->closed = true;
    buf->ptr = 0;
    buf->size = 0;
    buf->impl = NULL;
    cubuf_buffer_release(buf);
    return CUBUF_SUCCESS;
}

cubuf_buffer_t *cubuf__raw_kept_buffer(cubuf_resource_t *res, CUdeviceptr ptr)
{
    if (!res->vt->raw_keeps_buffer) return NULL;
    cubuf__resource_lock(res);
    struct cubuf_raw_map *m = res->raw;
    cubuf__resource_unlock(res);
    if (!m) return NULL;
    pthread_mutex_lock(&m->lock);
    const cubuf_ptr_entry_t *e = cubuf__ptrmap_find(&m->map, ptr);
    cubuf_buffer_t *buf = e ? e->a : NULL;
    pthread_mutex_unlock(&m->lock);
    return buf;
}

/* A raw_keeps_buffer resource's raw allocation, into rec: a buffer of its
 * own, counted by its own path wherever it sits in a stack. */
static cubuf_status_t kept_allocate(cubuf_resource_t *res, cubuf_buffer_t *rec, bool in_ctx,
                                    cubuf_charge_t *charge)
{
    CUdeviceptr p = 0;
    cubuf_status_t st = raw_keep_allocate(res, rec->size, &rec->dealloc, in_ctx, &p, charge);
    if (st == CUBUF_SUCCESS) rec->ptr = p;
    return st;
}

/* The raw pair at the top of a stack: counted. */
static cubuf_status_t record_allocate(cubuf_resource_t *res, cubuf_buffer_t *rec, bool in_ctx,
                                      cubuf_charge_t *charge)
{
    if (__builtin_expect(res->vt->raw_keeps_buffer, 0)) return kept_allocate(res, rec, in_ctx, charge);
    return allocate_counted(res, rec, rec->dealloc.stream, in_ctx, false, charge);
}

static cubuf_status_t record_free(cubuf_resource_t *res, cubuf_buffer_t *rec,
                                  const cubuf_stream_token_t *token, cubuf_charge_t *charge)
{
    if (__builtin_expect(res->vt->raw_keeps_buffer, 0))
        return raw_keep_deallocate(res, rec->ptr, rec->size, token, charge);
    return free_counted(res, rec, token, false, charge);
}

/* The same one layer down (an adaptor's upstream): uncounted, as the top counts. */
cubuf_status_t cubuf__layer_allocate(cubuf_resource_t *res, cubuf_buffer_t *rec, bool in_ctx,
                                     cubuf_charge_t *charge)
{
    if (__builtin_expect(res->vt->raw_keeps_buffer, 0)) return kept_allocate(res, rec, in_ctx, charge);
    return allocate_step(res, rec, rec->dealloc.stream, in_ctx, charge);
}

cubuf_status_t cubuf__layer_free(cubuf_resource_t *res, cubuf_buffer_t *rec,
                                 const cubuf_stream_token_t *token, cubuf_charge_t *charge)
{
    if (__builtin_expect(res->vt->raw_keeps_buffer, 0))
        return raw_keep_deallocate(res, rec->ptr, rec->size, token, charge);
    *charge = (cubuf_charge_t){rec->size, 1};
    return res->vt->deallocate(res, rec, token, charge);
}

void cubuf__layer_undo(cubuf_resource_t *res, cubuf_buffer_t *rec)
{
    const size_t asked = rec->size;
    cubuf_charge_t ch;
    cubuf_status_t st = cubuf__layer_free(res, rec, &rec->dealloc, &ch);
    if (st != CUBUF_SUCCESS)
        cubuf__warn(st, "an allocation an adaptor could not hand on could not be freed (%zu bytes "
                    "lost): %s", asked, cubuf_last_error());
    cubuf__resource_lock(res);
    for (cubuf_resource_t *r = res; r && !r->vt->raw_keeps_buffer; r = r->upstream)
        if (r->cap != SIZE_MAX) r->admitted -= asked;
    cubuf__resource_unlock(res);
    rec->ptr = 0;
}

/* A raw record: what the resources' allocate and deallocate read of a
 * buffer, its stream bound in place (not copied in: allocate_buffer). */
static inline __attribute__((always_inline)) cubuf_status_t
raw_record(cubuf_buffer_t *rec, cubuf_resource_t *res, CUdeviceptr ptr, size_t size, CUstream stream,
           bool *in_ctx)
{
    cubuf__buffer_init(rec);
    rec->ptr = ptr;
    rec->size = size;
    rec->resource = res;
    return bind_stream(res, stream, NULL, &rec->dealloc, in_ctx);
}

cubuf_status_t cubuf_resource_allocate_raw(cubuf_resource_t *res, size_t size, CUstream stream,
                                           CUdeviceptr *ptr)
{
    CHECK_ARG(res && ptr, "cubuf_resource_allocate_raw: NULL argument");
    CHECK_ARG(size > 0, "cubuf_resource_allocate_raw: size 0");
    bool in_ctx;
    cubuf_buffer_t rec;
    cubuf_charge_t ch;
    cubuf_status_t st = raw_record(&rec, res, 0, size, stream, &in_ctx);
    if (st != CUBUF_SUCCESS) return st;
    st = record_allocate(res, &rec, in_ctx, &ch);
    if (__builtin_expect(st == CUBUF_SUCCESS, 1)) *ptr = rec.ptr;
    return st;
}

cubuf_status_t cubuf_resource_deallocate_raw(cubuf_resource_t *res, CUdeviceptr ptr, size_t size,
                                             CUstream stream)
{
    CHECK_ARG(res, "cubuf_resource_deallocate_raw: res is NULL");
    CHECK_ARG(ptr && size, "cubuf_resource_deallocate_raw: pointer 0x%llx with size %zu",
              (unsigned long long)ptr, size);
    bool in_ctx;
    cubuf_buffer_t rec;
    cubuf_charge_t ch;
    cubuf_status_t st = raw_record(&rec, res, ptr, size, stream, &in_ctx);
    if (st != CUBUF_SUCCESS) return st;
    return record_free(res, &rec, &rec.dealloc, &ch);
}

/* ---- user-defined resources ---- */

typedef struct user_impl {
    cubuf_resource_ops_t ops;
    void *state;
} user_impl_t;

static cubuf_status_t user_allocate(cubuf_resource_t *res, cubuf_buffer_t *buf, CUstream stream,
                                    bool in_ctx, cubuf_charge_t *charge)
{
    (void)in_ctx; /* user allocations run in the caller's context, as called */
    (void)charge;
    const user_impl_t *u = res->impl;
    CUdeviceptr p = 0;
    cubuf__detail_clear(); /* a detail the callback gives its failure (the caching resource's) is kept */
    cubuf_status_t st = u->ops.allocate(u->state, buf->size, stream, &p);
    if (st != CUBUF_SUCCESS) {
        if (!cubuf_last_error()[0])
            return cubuf__fail(st, "user resource: allocate of %zu bytes returned %s", buf->size,
                               cubuf_status_name(st));
        cubuf__detail_append("user resource: allocate of %zu bytes returned %s", buf->size,
                             cubuf_status_name(st));
        return st;
    }
    if (!p) return cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "user resource returned pointer 0");
    buf->ptr = p;
    return CUBUF_SUCCESS;
}

static cubuf_status_t user_deallocate(cubuf_resource_t *res, cubuf_buffer_t *buf,
                                      const cubuf_stream_token_t *token, cubuf_charge_t *charge)
{
    (void)charge;
    const user_impl_t *u = res->impl;
    /* A default stream means something only in the context it was bound in. */
    cubuf_ctx_guard_t g = {false};
    cubuf_status_t st;
    if ((st = cubuf__ctx_push(token->ctx, &g)) != CUBUF_SUCCESS) return st;
    st = u->ops.deallocate(u->state, buf->ptr, buf->size, token->stream);
    cubuf__ctx_pop(&g);
    return st;
}

static void user_destroy(cubuf_resource_t *res)
{
    user_impl_t *u = res->impl;
    if (u->ops.destroy) u->ops.destroy(u->state);
}

static const cubuf_resource_vtbl_t user_vtbl = {
    .name = "user",
    .allocate = user_allocate,
    .deallocate = user_deallocate,
    .destroy = user_destroy,
};

cubuf_status_t cubuf_resource_create(const cubuf_resource_ops_t *ops,
                                     const cubuf_resource_props_t *props, void *state,
                                     cubuf_resource_t **out)
{
    CHECK_ARG(ops && out, "cubuf_resource_create: NULL argument");
    if (ops->version < 1 || ops->version > CUBUF_RESOURCE_OPS_VERSION)
        return cubuf__fail(CUBUF_ERROR_NOT_SUPPORTED,
                           "cubuf_resource_create: ops version %u is not supported (this cubuf "
                           "knows versions 1 to %d)",
                           ops->version, CUBUF_RESOURCE_OPS_VERSION);
    CHECK_ARG(ops->allocate && ops->deallocate,
              "cubuf_resource_create: allocate and deallocate are required");
    cubuf_resource_props_t p = CUBUF_RESOURCE_PROPS_INIT;
    if (props) {
        cubuf_status_t pst = cubuf__struct_in("cubuf_resource_create", "cubuf_resource_props_t",
                                              &p, sizeof p, props, CUBUF_RESOURCE_PROPS_SIZE_V1);
        if (pst != CUBUF_SUCCESS) return pst;
    } else {
        p.device_accessible = true;
        p.device_id = -1;
    }
    /* The bytes of each ops version: a caller's struct is read no further. */
    static const size_t ops_size[CUBUF_RESOURCE_OPS_VERSION + 1] = {0, CUBUF_RESOURCE_OPS_SIZE_V1};
    cubuf_resource_t *res = NULL;
    cubuf_status_t st = cubuf__resource_new(&user_vtbl, NULL, sizeof(user_impl_t), &res);
    if (st != CUBUF_SUCCESS) return st;
    user_impl_t *u = res->impl;
    memcpy(&u->ops, ops, ops_size[ops->version]);
    u->state = state;
    res->props = p;
    *out = res;
    return CUBUF_SUCCESS;
}

void *cubuf_resource_user_state(const cubuf_resource_t *res)
{
    return res && res->vt == &user_vtbl ? ((const user_impl_t *)res->impl)->state : NULL;
}
