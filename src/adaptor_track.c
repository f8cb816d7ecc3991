/* The tracking adaptor: every outstanding allocation made through it
 * (cubuf/adaptor.h). The allocations live in pointer maps sharded by
 * pointer, each under its own spin lock, so threads freeing different
 * pointers rarely meet. */
#include <execinfo.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "adaptor_base.h"
#include "ptrmap.h"

#define TRACK_SHARDS 32
#define TRACK_FRAMES 24

/* A kept call stack: frame count, then the frames. */
typedef struct track_trace {
    int n;
    void *frames[TRACK_FRAMES];
} track_trace_t;

typedef struct track_shard {
    cubuf_lock_t lock;
    cubuf_ptrmap_t map; /* entry: ptr, size, a = stream, b = track_trace_t * or NULL, c = thread */
    size_t bytes;
} track_shard_t;

typedef struct track_adaptor {
    bool backtraces;
    track_shard_t shards[TRACK_SHARDS];
} track_adaptor_t;

/* A pointer's shard: the top bits of the hash its map slot is taken from
 * (ptrmap.h), so allocate and free hash each pointer once. */
_Static_assert(TRACK_SHARDS == 32, "the shard is the hash's top 5 bits");
static track_shard_t *shard_of(track_adaptor_t *t, uint64_t hash) { return &t->shards[hash >> 59]; }

static void shard_lock(track_shard_t *s) { cubuf__lock(&s->lock); }
static void shard_unlock(track_shard_t *s) { cubuf__unlock(&s->lock); }

static cubuf_status_t track_allocate(cubuf_resource_t *res, cubuf_buffer_t *buf, CUstream stream,
                                     bool in_ctx, cubuf_charge_t *charge)
{
    track_adaptor_t *t = res->impl;
    track_trace_t *trace = NULL;
    if (t->backtraces) {
        if (!(trace = cubuf__malloc(sizeof *trace)))
            return cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "tracking adaptor: no memory for a backtrace");
        trace->n = backtrace(trace->frames, TRACK_FRAMES);
    }
    cubuf_status_t st = cubuf__adaptor_up_allocate(res, buf, stream, in_ctx, charge);
    if (st != CUBUF_SUCCESS) {
        free(trace);
        return st;
    }
    const cubuf_ptr_entry_t e = {buf->ptr, buf->size, buf->dealloc.stream, trace,
                                 (uint64_t)cubuf__adaptor_thread_id()};
    const uint64_t hash = cubuf__ptrmap_hash(e.ptr);
    track_shard_t *s = shard_of(t, hash);
    shard_lock(s);
    st = cubuf__ptrmap_insert_hashed(&s->map, &e, hash);
    if (st == CUBUF_SUCCESS) s->bytes += buf->size;
    shard_unlock(s);
    if (st != CUBUF_SUCCESS) { /* untracked memory must not leave: give it back */
        cubuf__adaptor_up_undo(res, buf);
        free(trace);
    }
    return st;
}

/* A free takes the entry out first, so the success path locks its shard
 * once, and a second free of the pointer meanwhile is refused; a failed free
 * puts it back. */
static cubuf_status_t track_deallocate(cubuf_resource_t *res, cubuf_buffer_t *buf,
                                       const cubuf_stream_token_t *token, cubuf_charge_t *charge)
{
    track_adaptor_t *t = res->impl;
    const CUdeviceptr ptr = buf->ptr;
    const uint64_t hash = cubuf__ptrmap_hash(ptr);
    track_shard_t *s = shard_of(t, hash);
    cubuf_ptr_entry_t e = {0, 0, NULL, NULL, 0};
    shard_lock(s);
    bool found = cubuf__ptrmap_remove_hashed(&s->map, ptr, hash, &e);
    bool ours = found && e.size == buf->size;
    if (found && !ours) (void)cubuf__ptrmap_put_back(&s->map, &e); /* just taken out: room */
    if (ours) s->bytes -= e.size;
    shard_unlock(s);
    if (!ours)
        return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,
                           "tracking adaptor: 0x%llx with %zu bytes is not an outstanding "
                           "allocation of it%s; nothing was freed",
                           (unsigned long long)buf->ptr, buf->size,
                           found ? " of that size" : " (or another thread is freeing it)");
    cubuf_status_t st = cubuf__adaptor_up_deallocate(res, buf, token, charge);
    if (st == CUBUF_SUCCESS) {
        if (e.b) free(e.b); /* backtraces only: no call into libc per free without them */
        return st;
    }
    shard_lock(s); /* still outstanding */
    bool back = cubuf__ptrmap_put_back(&s->map, &e);
    if (back) s->bytes += e.size;
    shard_unlock(s);
    if (!back) {
        cubuf__warn(CUBUF_ERROR_OUT_OF_MEMORY, "tracking adaptor: no memory to keep tracking 0x%llx "
                    "(%zu bytes), whose free failed", (unsigned long long)e.ptr, e.size);
        free(e.b);
    }
    return st;
}

static void totals(track_adaptor_t *t, size_t *count, size_t *bytes)
{
    *count = *bytes = 0;
    for (int i = 0; i < TRACK_SHARDS; i++) {
        track_shard_t *s = &t->shards[i];
        shard_lock(s);
        *count += s->map.used;
        *bytes += s->bytes;
        shard_unlock(s);
    }
}

/* One warning for an allocation still outstanding at the release: what the
 * report's line says, then its backtrace where one was kept, a frame a line,
 * as far as a warning's length allows. */
static void warn_outstanding(const cubuf_ptr_entry_t *e)
{
    char msg[1024];
    int n = snprintf(msg, sizeof msg, "  outstanding: 0x%llx, %zu bytes, stream %p, thread %llu",
                     (unsigned long long)e->ptr, e->size, e->a, (unsigned long long)e->c);
    const track_trace_t *tr = e->b;
    char **names = tr ? backtrace_symbols(tr->frames, tr->n) : NULL;
    for (int f = 0; tr && f < tr->n && n > 0 && (size_t)n < sizeof msg; f++)
        n += snprintf(msg + n, sizeof msg - (size_t)n, "\n    %s", names ? names[f] : "?");
    free(names);
    cubuf__warn(CUBUF_ERROR_BUSY, "%s", msg);
}

static void track_destroy(cubuf_resource_t *res)
{
    track_adaptor_t *t = res->impl;
    size_t count, bytes;
    totals(t, &count, &bytes);
    if (count)
        cubuf__warn(CUBUF_ERROR_BUSY,
                    "tracking adaptor released with %zu allocation%s (%zu bytes) outstanding; "
                    "each follows",
                    count, count == 1 ? "" : "s", bytes);
    for (int i = 0; i < TRACK_SHARDS; i++) {
        cubuf_ptrmap_t *m = &t->shards[i].map;
        for (size_t k = 0; k < m->cap; k++)
            if (m->slots[k].ptr) {
                warn_outstanding(&m->slots[k]);
                free(m->slots[k].b);
            }
        cubuf__ptrmap_free(m);
    }
    cubuf__adaptor_destroy(res);
}

static const cubuf_resource_vtbl_t track_vtbl = {
    .name = "tracking adaptor",
    .passes_stats = true,
    .allocate = track_allocate,
    .deallocate = track_deallocate,
    .destroy = track_destroy,
    .no_adopt = cubuf__adaptor_no_adopt,
    .no_export = cubuf__adaptor_no_export,
};

cubuf_status_t cubuf_tracking_adaptor_create(cubuf_resource_t *upstream, bool backtraces,
                                             cubuf_resource_t **out)
{
    cubuf_status_t st = cubuf__adaptor_new(upstream, &track_vtbl, sizeof(track_adaptor_t),
                                           "cubuf_tracking_adaptor_create", out);
    if (st == CUBUF_SUCCESS) {
        track_adaptor_t *t = (*out)->impl;
        t->backtraces = backtraces;
        if (backtraces) { /* backtrace() loads libgcc on first use: not inside an allocation later */
            void *f[1];
            (void)backtrace(f, 1);
        }
    }
    return st;
}

cubuf_status_t cubuf_tracking_outstanding(const cubuf_resource_t *res, size_t *count, size_t *bytes)
{
    CHECK_ARG(res && res->vt == &track_vtbl, "cubuf_tracking_outstanding: not a tracking adaptor");
    size_t c, b;
    totals(res->impl, &c, &b);
    if (count) *count = c;
    if (bytes) *bytes = b;
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf_tracking_report(const cubuf_resource_t *res, FILE *out)
{
    static const char what[] = "cubuf_tracking_report";
    CHECK_ARG(res && res->vt == &track_vtbl && out, "%s: NULL argument or not a tracking adaptor", what);
    track_adaptor_t *t = res->impl;
    size_t count, bytes;
    totals(t, &count, &bytes);
    bool ok = fprintf(out, "cubuf tracking adaptor: %zu outstanding allocation%s, %zu bytes\n", count,
                      count == 1 ? "" : "s", bytes) > 0;
    for (int i = 0; i < TRACK_SHARDS; i++) {
        track_shard_t *s = &t->shards[i];
        shard_lock(s);
        for (size_t k = 0; k < s->map.cap; k++) {
            const cubuf_ptr_entry_t *e = &s->map.slots[k];
            if (!e->ptr) continue;
            ok &= fprintf(out, "0x%llx %zu bytes, stream %p, thread %llu\n", (unsigned long long)e->ptr,
                          e->size, e->a, (unsigned long long)e->c) > 0;
            const track_trace_t *tr = e->b;
            if (!tr) continue;
            char **names = backtrace_symbols(tr->frames, tr->n);
            for (int f = 0; f < tr->n; f++)
                ok &= fprintf(out, "    %s\n", names ? names[f] : "?") > 0;
            free(names);
        }
        shard_unlock(s);
    }
    if (fflush(out) != 0) ok = false;
    if (!ok) return cubuf__fail(CUBUF_ERROR_SYSTEM, "%s: writing the report failed", what);
    return CUBUF_SUCCESS;
}
