/* Resource adaptors: the shared base, and the three that need no state of
 * their own beyond the resource's counters: statistics (scopes), limiting
 * (the cap) and the failure callback. Logging and tracking have files of
 * their own. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "adaptor_base.h"

cubuf_status_t cubuf__adaptor_new(cubuf_resource_t *up, const cubuf_resource_vtbl_t *vt,
                                  size_t impl_size, const char *what, cubuf_resource_t **out)
{
    CHECK_ARG(up && out, "%s: NULL argument", what);
    cubuf_resource_t *res = NULL;
    cubuf_status_t st = cubuf__resource_new(vt, cubuf__context_retain(up->ctx), impl_size, &res);
    if (st != CUBUF_SUCCESS) {
        cubuf__context_release(up->ctx);
        return st;
    }
    res->props = up->props;
    res->upstream = cubuf_resource_retain(up);
    res->lock = up->lock; /* one lock for the stack: resource.c */
    *out = res;
    return CUBUF_SUCCESS;
}

const char cubuf__adaptor_no_adopt[] =
    "an adaptor frees through its upstream's raw-pointer interface, which takes back only what "
    "was allocated through it (allocate from the adaptor instead)";

const char cubuf__adaptor_no_export[] =
    "an adaptor's buffers are not shared (its counts, cap or log could not follow the memory "
    "into another process): share a buffer allocated from the upstream resource itself";

static _Thread_local int32_t tls_tid;
CUBUF_TLS_ACCESSOR int32_t *cubuf__adaptor_tid_slot(void) { return &tls_tid; }
static pthread_once_t tid_once = PTHREAD_ONCE_INIT;

/* A child of fork() runs on a copy of the forking thread, cache included:
 * it asks the kernel again. */
static void tid_forget(void) { *cubuf__adaptor_tid_slot() = 0; }
static void tid_watch_forks(void) { (void)pthread_atfork(NULL, NULL, tid_forget); }

int32_t cubuf__adaptor_thread_id_slow(int32_t *slot)
{
    pthread_once(&tid_once, tid_watch_forks);
    return *slot = (int32_t)syscall(SYS_gettid);
}

void cubuf__adaptor_destroy(cubuf_resource_t *res)
{
    cubuf_resource_release(res->upstream);
}

/* ---- statistics ---------------------------------------------------------------- */

static void stats_destroy(cubuf_resource_t *res)
{
    while (res->scope) { /* scopes left open */
        cubuf_scope_t *s = res->scope;
        res->scope = s->outer;
        free(s);
    }
    cubuf__adaptor_destroy(res);
}

static const cubuf_resource_vtbl_t stats_vtbl = {
    .name = "statistics adaptor",
    .no_adopt = cubuf__adaptor_no_adopt,
    .no_export = cubuf__adaptor_no_export,
    .allocate = cubuf__adaptor_up_allocate,
    .deallocate = cubuf__adaptor_up_deallocate,
    .destroy = stats_destroy,
};

cubuf_status_t cubuf_statistics_adaptor_create(cubuf_resource_t *upstream, cubuf_resource_t **out)
{
    return cubuf__adaptor_new(upstream, &stats_vtbl, 0,
                              "cubuf_statistics_adaptor_create", out);
}

static void tally_out(const cubuf_tally_t *t, cubuf_statistics_t *s)
{
    s->current_bytes = t->bytes;
    s->peak_bytes = t->peak_bytes;
    s->current_count = t->count;
    s->peak_count = t->peak_count;
    s->current_requested = t->req_bytes;
    s->peak_requested = t->peak_req_bytes;
    s->total_bytes = t->total_bytes;
    s->total_count = t->total_count;
    s->total_requested = t->total_req_bytes;
}

static cubuf_status_t check_stats_struct(const cubuf_statistics_t *stats, const char *what)
{
    return cubuf__struct_check(what, "cubuf_statistics_t", stats->struct_size,
                               CUBUF_STATISTICS_SIZE_V1, sizeof *stats);
}

cubuf_status_t cubuf_statistics_get(const cubuf_resource_t *res, cubuf_statistics_t *stats)
{
    static const char what[] = "cubuf_statistics_get";
    CHECK_ARG(res && stats, "%s: NULL argument", what);
    cubuf_status_t st = check_stats_struct(stats, what);
    if (st != CUBUF_SUCCESS) return st;
    cubuf_resource_t *r = cubuf__stats_owner(res);
    cubuf_statistics_t s = CUBUF_STATISTICS_INIT;
    cubuf__resource_lock(r);
    tally_out(r->scope ? &r->scope->tally : &r->tally, &s);
    cubuf__resource_unlock(r);
    cubuf__struct_out(stats, &s, sizeof s);
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf_statistics_reset_peaks(cubuf_resource_t *res)
{
    CHECK_ARG(res, "cubuf_statistics_reset_peaks: res is NULL");
    res = cubuf__stats_owner(res);
    cubuf__resource_lock(res);
    cubuf_tally_t *t = res->scope ? &res->scope->tally : &res->tally;
    t->peak_bytes = t->bytes;
    t->peak_count = t->count;
    t->peak_req_bytes = t->req_bytes;
    cubuf__resource_unlock(res);
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf_statistics_push(cubuf_resource_t *res)
{
    static const char what[] = "cubuf_statistics_push";
    CHECK_ARG(res && res->vt == &stats_vtbl, "%s: not a statistics adaptor", what);
    cubuf_scope_t *s = cubuf__calloc(1, sizeof *s);
    if (!s) return cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "%s: cannot allocate a scope", what);
    cubuf__resource_lock(res);
    s->outer = res->scope;
    res->scope = s;
    cubuf__resource_unlock(res);
    return CUBUF_SUCCESS;
}

/* Folds an inner scope's figures into the outer one (or the resource's own
 * tally, which already counted everything: nothing to fold there). */
static void fold(cubuf_tally_t *outer, const cubuf_tally_t *inner)
{
    const int64_t base_bytes = outer->bytes, base_count = outer->count, base_req = outer->req_bytes;
    outer->bytes += inner->bytes;
    outer->count += inner->count;
    outer->req_bytes += inner->req_bytes;
    if (base_bytes + inner->peak_bytes > outer->peak_bytes) outer->peak_bytes = base_bytes + inner->peak_bytes;
    if (base_count + inner->peak_count > outer->peak_count) outer->peak_count = base_count + inner->peak_count;
    if (base_req + inner->peak_req_bytes > outer->peak_req_bytes)
        outer->peak_req_bytes = base_req + inner->peak_req_bytes;
    outer->total_bytes += inner->total_bytes;
    outer->total_count += inner->total_count;
    outer->total_req_bytes += inner->total_req_bytes;
}

cubuf_status_t cubuf_statistics_pop(cubuf_resource_t *res, cubuf_statistics_t *popped)
{
    static const char what[] = "cubuf_statistics_pop";
    CHECK_ARG(res && res->vt == &stats_vtbl, "%s: not a statistics adaptor", what);
    cubuf_status_t st;
    if (popped && (st = check_stats_struct(popped, what)) != CUBUF_SUCCESS) return st;
    cubuf__resource_lock(res);
    cubuf_scope_t *s = res->scope;
    if (s) {
        res->scope = s->outer;
        if (s->outer) fold(&s->outer->tally, &s->tally);
    }
    cubuf__resource_unlock(res);
    if (!s) return cubuf__fail(CUBUF_ERROR_OUT_OF_RANGE, "%s: no scope is open", what);
    if (popped) {
        cubuf_statistics_t out = CUBUF_STATISTICS_INIT;
        tally_out(&s->tally, &out);
        cubuf__struct_out(popped, &out, sizeof out);
    }
    free(s);
    return CUBUF_SUCCESS;
}

/* ---- limiting ---------------------------------------------------------------------- */

/* The cap itself is the resource path's (resource.c, admit): this adaptor is
 * a pass-through whose resource has one. */
static const cubuf_resource_vtbl_t limit_vtbl = {
    .name = "limiting adaptor",
    .no_adopt = cubuf__adaptor_no_adopt,
    .no_export = cubuf__adaptor_no_export,
    .allocate = cubuf__adaptor_up_allocate,
    .deallocate = cubuf__adaptor_up_deallocate,
    .destroy = cubuf__adaptor_destroy,
};

cubuf_status_t cubuf_limit_adaptor_create(cubuf_resource_t *upstream, size_t cap,
                                          cubuf_resource_t **out)
{
    static const char what[] = "cubuf_limit_adaptor_create";
    CHECK_ARG(cap < SIZE_MAX, "%s: a cap of SIZE_MAX bytes limits nothing", what);
    cubuf_status_t st = cubuf__adaptor_new(upstream, &limit_vtbl, 0, what, out);
    if (st == CUBUF_SUCCESS) (*out)->cap = cap;
    return st;
}

/* ---- failure callback ------------------------------------------------------------------ */

typedef struct failure_adaptor {
    cubuf_oom_callback_fn callback;
    void *user;
} failure_adaptor_t;

static __attribute__((noinline)) cubuf_status_t retry_allocate(cubuf_resource_t *res,
                                                               cubuf_buffer_t *buf, bool in_ctx,
                                                               cubuf_charge_t *charge)
{
    const failure_adaptor_t *f = res->impl;
    cubuf_status_t st = CUBUF_ERROR_OUT_OF_MEMORY;
    for (unsigned attempt = 1; st == CUBUF_ERROR_OUT_OF_MEMORY; attempt++) {
        /* The callback's own calls may fail and leave their detail: a
         * declined retry reports the upstream's. */
        char why[1024];
        snprintf(why, sizeof why, "%s", cubuf_last_error());
        const CUresult why_cu = cubuf_last_cuda_result();
        if (!f->callback(f->user, buf->size, attempt)) {
            (void)cubuf__fail(st, "%s", why);
            cubuf__set_last_cu(why_cu);
            cubuf__detail_append("the failure callback declined a retry after %u attempt%s",
                                 attempt, attempt == 1 ? "" : "s");
            return st;
        }
        *charge = (cubuf_charge_t){buf->size, 1};
        st = cubuf__adaptor_up_allocate(res, buf, buf->dealloc.stream, in_ctx, charge);
    }
    return st;
}

static cubuf_status_t failure_allocate(cubuf_resource_t *res, cubuf_buffer_t *buf, CUstream stream,
                                       bool in_ctx, cubuf_charge_t *charge)
{
    cubuf_status_t st = cubuf__adaptor_up_allocate(res, buf, stream, in_ctx, charge);
    if (__builtin_expect(st == CUBUF_ERROR_OUT_OF_MEMORY, 0))
        st = retry_allocate(res, buf, in_ctx, charge);
    return st;
}

static const cubuf_resource_vtbl_t failure_vtbl = {
    .name = "failure-callback adaptor",
    .no_adopt = cubuf__adaptor_no_adopt,
    .no_export = cubuf__adaptor_no_export,
    .passes_stats = true,
    .allocate = failure_allocate,
    .deallocate = cubuf__adaptor_up_deallocate,
    .destroy = cubuf__adaptor_destroy,
};

cubuf_status_t cubuf_failure_adaptor_create(cubuf_resource_t *upstream,
                                            cubuf_oom_callback_fn callback, void *user,
                                            cubuf_resource_t **out)
{
    static const char what[] = "cubuf_failure_adaptor_create";
    CHECK_ARG(callback, "%s: callback is NULL", what);
    cubuf_status_t st = cubuf__adaptor_new(upstream, &failure_vtbl, sizeof(failure_adaptor_t), what, out);
    if (st == CUBUF_SUCCESS) {
        failure_adaptor_t *f = (*out)->impl;
        f->callback = callback;
        f->user = user;
    }
    return st;
}
