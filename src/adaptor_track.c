/* The tracking adaptor: every outstanding allocation made through it
 * (cubuf/adaptor.h). Its map lives under the stack's lock, kept by the
 * hook the stack's top calls in the sections that count (resource.c): an
 * allocation is added in the section that counts it; a free marks its
 * entry in a section before it and removes it in the one that counts it, so
 * tracking costs one critical section per allocate + free, not two of its
 * own. */
#include <execinfo.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "adaptor_base.h"
#include "ptrmap.h"

#define TRACK_FRAMES 24
#define TRACK_FREEING (1ull << 63) /* in an entry's c: its free is under way */

/* A kept call stack: frame count, then the frames. */
typedef struct track_trace {
    int n;
    void *frames[TRACK_FRAMES];
} track_trace_t;

typedef struct track_adaptor {
    bool backtraces;
    cubuf_ptrmap_t map; /* entry: ptr, size, a = stream, b = track_trace_t * or NULL, c = thread | TRACK_FREEING */
    size_t bytes;
} track_adaptor_t;

/* The stack's lock is held. With backtraces, the call stack is taken here,
 * inside it: microseconds per allocation, a debugging aid. */
static cubuf_status_t track_hook(cubuf_resource_t *res, cubuf_buffer_t *rec, cubuf_hook_op_t op)
{
    track_adaptor_t *t = res->impl;
    if (op == CUBUF_HOOK_ADD) {
        track_trace_t *trace = NULL;
        if (t->backtraces) {
            if (!(trace = cubuf__malloc(sizeof *trace)))
                return cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "tracking adaptor: no memory for a backtrace");
            trace->n = backtrace(trace->frames, TRACK_FRAMES);
        }
        const cubuf_ptr_entry_t e = {rec->ptr, rec->size, rec->dealloc.stream, trace,
                                     (uint64_t)cubuf__adaptor_thread_id()};
        cubuf_status_t st = cubuf__ptrmap_insert(&t->map, &e);
        if (st != CUBUF_SUCCESS) { /* the allocation is undone: untracked memory must not leave */
            free(trace);
            return st;
        }
        t->bytes += rec->size;
        return CUBUF_SUCCESS;
    }
    cubuf_ptr_entry_t *e = cubuf__ptrmap_find(&t->map, rec->ptr);
    if (op == CUBUF_HOOK_TAKE) { /* a second free meanwhile is refused */
        if (e && e->size == rec->size && !(e->c & TRACK_FREEING)) {
            e->c |= TRACK_FREEING;
            return CUBUF_SUCCESS;
        }
        return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,
                           "tracking adaptor: 0x%llx with %zu bytes is not an outstanding "
                           "allocation of it%s; nothing was freed",
                           (unsigned long long)rec->ptr, rec->size,
                           !e ? "" : e->size != rec->size ? " of that size" : " (another thread is freeing it)");
    }
    if (op == CUBUF_HOOK_PUT_BACK) {
        e->c &= ~TRACK_FREEING;
        return CUBUF_SUCCESS;
    }
    cubuf_ptr_entry_t gone; /* CUBUF_HOOK_DROP */
    (void)cubuf__ptrmap_remove(&t->map, rec->ptr, &gone);
    t->bytes -= gone.size;
    free(gone.b);
    return CUBUF_SUCCESS;
}

static void totals(cubuf_resource_t *res, size_t *count, size_t *bytes)
{
    const track_adaptor_t *t = res->impl;
    cubuf__resource_lock(res);
    *count = t->map.used;
    *bytes = t->bytes;
    cubuf__resource_unlock(res);
}

static void track_destroy(cubuf_resource_t *res)
{
    track_adaptor_t *t = res->impl;
    if (t->map.used) {
        cubuf__warn(CUBUF_ERROR_BUSY,
                    "tracking adaptor released with %zu allocation%s (%zu bytes) outstanding; "
                    "the first:",
                    t->map.used, t->map.used == 1 ? "" : "s", t->bytes);
        int shown = 0;
        for (size_t k = 0; k < t->map.cap && shown < 8; k++) {
            const cubuf_ptr_entry_t *e = &t->map.slots[k];
            if (!e->ptr) continue;
            cubuf__warn(CUBUF_ERROR_BUSY, "  outstanding: 0x%llx, %zu bytes, stream %p, thread %llu",
                        (unsigned long long)e->ptr, e->size, e->a, (unsigned long long)(e->c & ~TRACK_FREEING));
            shown++;
        }
    }
    for (size_t k = 0; k < t->map.cap; k++)
        if (t->map.slots[k].ptr) free(t->map.slots[k].b);
    cubuf__ptrmap_free(&t->map);
    cubuf__adaptor_destroy(res);
}

static const cubuf_resource_vtbl_t track_vtbl = {
    .name = "tracking adaptor",
    .passes_stats = true,
    .allocate = cubuf__adaptor_up_allocate,
    .deallocate = cubuf__adaptor_up_deallocate,
    .destroy = track_destroy,
    .hook = track_hook,
    .no_adopt = cubuf__adaptor_no_adopt,
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
    totals((cubuf_resource_t *)res, &c, &b);
    if (count) *count = c;
    if (bytes) *bytes = b;
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf_tracking_report(const cubuf_resource_t *res, FILE *out)
{
    static const char what[] = "cubuf_tracking_report";
    CHECK_ARG(res && res->vt == &track_vtbl && out, "%s: NULL argument or not a tracking adaptor", what);
    cubuf_resource_t *r = (cubuf_resource_t *)res; /* the lock is not part of the value */
    const track_adaptor_t *t = res->impl;
    /* A copy, taken under the stack's lock (which allocations need), printed outside it. */
    typedef struct {
        cubuf_ptr_entry_t e;
        track_trace_t trace;
    } item_t;
    item_t *items = NULL;
    size_t n = 0, bytes = 0, room = 0;
    for (;;) {
        cubuf__resource_lock(r);
        if (t->map.used <= room) {
            for (size_t k = 0; k < t->map.cap; k++) {
                const cubuf_ptr_entry_t *e = &t->map.slots[k];
                if (!e->ptr) continue;
                items[n].e = *e;
                items[n].trace.n = 0;
                if (e->b) items[n].trace = *(const track_trace_t *)e->b;
                n++;
            }
            bytes = t->bytes;
            cubuf__resource_unlock(r);
            break;
        }
        room = t->map.used + 16;
        cubuf__resource_unlock(r);
        free(items);
        if (!(items = cubuf__malloc(room * sizeof *items)))
            return cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "%s: no memory for a copy of %zu entries", what, room);
    }
    bool ok = fprintf(out, "cubuf tracking adaptor: %zu outstanding allocation%s, %zu bytes\n", n,
                      n == 1 ? "" : "s", bytes) > 0;
    for (size_t i = 0; i < n; i++) {
        const cubuf_ptr_entry_t *e = &items[i].e;
        ok &= fprintf(out, "0x%llx %zu bytes, stream %p, thread %llu\n", (unsigned long long)e->ptr,
                      e->size, e->a, (unsigned long long)(e->c & ~TRACK_FREEING)) > 0;
        const track_trace_t *tr = &items[i].trace;
        if (!tr->n) continue;
        char **names = backtrace_symbols(tr->frames, tr->n);
        for (int f = 0; f < tr->n; f++)
            ok &= fprintf(out, "    %s\n", names ? names[f] : "?") > 0;
        free(names);
    }
    free(items);
    if (fflush(out) != 0) ok = false;
    if (!ok) return cubuf__fail(CUBUF_ERROR_SYSTEM, "%s: writing the report failed", what);
    return CUBUF_SUCCESS;
}
