/* Virtual memory: closing a buffer (the resource's deallocate) and the
 * waiting it needs. A close that unmaps nothing hands the work queued on its
 * stream to the range's waits stream and returns; a close that unmaps waits
 * for every stream it must, unmaps (mapping back on failure) and only then
 * releases. The rules are in <cubuf/vmm.h>, the model in vmm.h. */
#include <stdlib.h>

#include "vmm.h"

/* What closing `m` unmaps: space->maps[lo, hi), and whether its space goes. */
static void plan_close(const vmm_member_t *m, size_t *lo, size_t *hi, bool *dies)
{
    const vmm_space_t *s = m->space;
    size_t c = m->count;
    *dies = s->buffers == 1;
    *lo = *hi = c;
    if (*dies) {
        *lo = 0;
        *hi = s->nmaps;
        return;
    }
    if (c != s->nmaps || s->maps[c - 1].ends != 1) return; /* someone still covers our end */
    /* Down to the next end of another buffer of the space; one exists, since
     * the space keeps other buffers and none reaches past us. */
    size_t j = c - 1;
    while (j > 0 && s->maps[j - 1].ends == 0) j--;
    *lo = j;
}

typedef struct vmm_wait {
    cubuf_stream_token_t t;
    bool skip;     /* not waited for */
    bool captured; /* ... because a capture would be disturbed: warn */
} vmm_wait_t;

static bool same_token(const cubuf_stream_token_t *a, const cubuf_stream_token_t *b)
{
    return a->stream == b->stream && a->ctx == b->ctx;
}

static const char *default_stream_name(CUstream s)
{
    return s == CU_STREAM_PER_THREAD ? "per-thread" : "legacy";
}

/* A default stream may be used unless that would disturb a capture in its
 * context: then it is marked skipped, to be warned about. One without a
 * context (host-only memory records none) orders nothing: skipped too. */
static cubuf_status_t check_default(vmm_wait_t *w)
{
    if (!w->t.ctx) {
        w->skip = true;
        return CUBUF_SUCCESS;
    }
    CUstreamCaptureStatus cs = CU_STREAM_CAPTURE_STATUS_NONE;
    cubuf_status_t st = cubuf__stream_capture_status(w->t.stream, w->t.ctx, &cs);
    if (st != CUBUF_SUCCESS) return st;
    if (cs != CU_STREAM_CAPTURE_STATUS_NONE) w->skip = w->captured = true;
    return CUBUF_SUCCESS;
}

/* ---- a close that unmaps nothing -------------------------------------------------- */

/* Keeps a default stream that a capture kept from being recorded, for the
 * closes that unmap to check (cuda.core: "a default stream is checked when
 * the range is released instead"). False when there is no room. */
static bool hold_default(vmm_range_t *r, const cubuf_stream_token_t *t)
{
    for (unsigned i = 0; i < r->nheld; i++)
        if (same_token(&r->held[i], t)) return true;
    if (r->nheld == sizeof r->held / sizeof r->held[0]) return false;
    r->held[r->nheld++] = *t;
    return true;
}

/* The work queued on the closing buffer's stream so far must end before a
 * later close unmaps this memory, but need not end now, and the stream may
 * be destroyed as soon as the buffer is closed. So: an event recorded on
 * the stream, which the range's waits stream is made to wait for; the host
 * waits for nothing. Whatever it makes is published only on success. */
static cubuf_status_t defer_wait(const cubuf_resource_t *res, vmm_range_t *r, vmm_wait_t *w)
{
    const cubuf_stream_token_t *t = &w->t;
    CUcontext ctx = t->ctx;
    cubuf_status_t st;
    if (cubuf__stream_is_default(t->stream)) {
        if ((st = check_default(w)) != CUBUF_SUCCESS) return st;
        if (w->captured && hold_default(r, t)) {
            w->skip = w->captured = false; /* checked again when memory is released */
            return CUBUF_SUCCESS;
        }
        if (w->skip) return st;
    } else if ((st = CU(cuStreamGetCtx, t->stream, &ctx)) != CUBUF_SUCCESS) {
        return st;
    }
    /* An event must belong to its stream's context. The range keeps one for
     * the resource's context (current here, and alive while the range is);
     * another context, which may be destroyed after this close, gets an
     * event of its own for this close only. */
    bool own = ctx == res->ctx->handle;
    CUstream waits = r->waits;
    CUevent ev = own ? r->event : NULL;
    bool new_waits = false, new_ev = false;
    cubuf_ctx_guard_t g = {false};
    if (!waits) {
        CHECK(cubuf__vmm_stream_create(&waits));
        new_waits = true;
    }
    if (!own) CHECK(cubuf__ctx_push(ctx, &g));
    if (!ev) {
        CHECK(cubuf__vmm_event_create(&ev));
        new_ev = true;
    }
    CHECK(CU(cuEventRecord, ev, t->stream));
    cubuf__ctx_pop(&g);
    /* The wait takes the event's state now: the event may be recorded
     * again, or destroyed, right after. */
    CHECK(CU(cuStreamWaitEvent, waits, ev, 0));
    r->waits = waits;
    r->pending = true;
    if (own) r->event = ev;
    else cubuf__vmm_event_destroy_quiet(ev);
    return CUBUF_SUCCESS;
fail:
    cubuf__ctx_pop(&g);
    if (new_ev) cubuf__vmm_event_destroy_quiet(ev);
    if (new_waits) cubuf__vmm_stream_destroy_quiet(waits);
    return st;
}

/* ---- a close that unmaps ------------------------------------------------------------ */

/* Adds t to w[0, *k) unless it is there already. */
static void add_wait(vmm_wait_t *w, size_t *k, const cubuf_stream_token_t *t)
{
    for (size_t i = 0; i < *k; i++)
        if (same_token(&w[i].t, t)) return;
    w[(*k)++] = (vmm_wait_t){*t, false, false};
}

/* Checks and synchronizes what an unmap waits for: the closing buffer's
 * stream, those of the other open buffers of the range (read under the
 * range lock, where cubuf__vmm_set_token writes them), and the range's
 * waits stream. Any failure leaves the close undone. */
static cubuf_status_t wait_streams(vmm_range_t *r, const vmm_member_t *m,
                                   const cubuf_stream_token_t *token, vmm_wait_t *w, size_t *n,
                                   const char *what)
{
    size_t k = 0;
    w[k++] = (vmm_wait_t){*token, false, false};
    for (const vmm_member_t *o = r->members; o; o = o->next)
        if (o != m) add_wait(w, &k, &o->buf->dealloc);
    for (unsigned h = 0; h < r->nheld; h++) add_wait(w, &k, &r->held[h]);
    *n = k;
    cubuf_status_t st;
    for (size_t i = 0; i < k; i++) {
        if (cubuf__stream_is_default(w[i].t.stream)) {
            if ((st = check_default(&w[i])) != CUBUF_SUCCESS) return st;
            continue;
        }
        if (i == 0) continue; /* the closing buffer's: checked before the close began */
        CUstreamCaptureStatus cs = CU_STREAM_CAPTURE_STATUS_NONE;
        if ((st = cubuf__stream_capture_status(w[i].t.stream, NULL, &cs)) != CUBUF_SUCCESS)
            return st;
        if (cs != CU_STREAM_CAPTURE_STATUS_NONE)
            return cubuf__fail(CUBUF_ERROR_STREAM_CAPTURING,
                               "%s: another buffer of the same range records a deallocation "
                               "stream that is capturing; unmapping would have to wait for it",
                               what);
    }
    for (size_t i = 0; i < k; i++) {
        if (w[i].skip) continue;
        if ((st = cubuf__stream_sync(&w[i].t)) != CUBUF_SUCCESS) return st;
    }
    /* Held default streams synchronized now are done with; skipped ones stay. */
    unsigned keep = 0;
    for (unsigned h = 0; h < r->nheld; h++) {
        bool synced = false;
        for (size_t i = 0; i < k && !synced; i++)
            synced = same_token(&w[i].t, &r->held[h]) && !w[i].skip;
        if (!synced) r->held[keep++] = r->held[h];
    }
    r->nheld = keep;
    if (r->pending) {
        if ((st = CU(cuStreamSynchronize, r->waits)) != CUBUF_SUCCESS) return st;
        r->pending = false;
    }
    return CUBUF_SUCCESS;
}

/* Unmaps space->maps[lo, hi), last first. On failure maps back what it had
 * unmapped (the physical allocations are still held) and returns the error. */
static cubuf_status_t unmap_span(const vmm_range_t *r, vmm_space_t *s, size_t lo, size_t hi)
{
    size_t k = hi;
    cubuf_status_t st = CUBUF_SUCCESS;
    while (k > lo) {
        const vmm_mapping_t *mp = &s->maps[k - 1];
        st = cubuf__vmm_unmap(s->base + mp->offset, mp->phys->size);
        if (st != CUBUF_SUCCESS) break;
        k--;
    }
    if (k == lo) return CUBUF_SUCCESS;
    for (size_t i = k; i < hi; i++) {
        const vmm_mapping_t *mp = &s->maps[i];
        cubuf__vmm_remap_quiet(s->base + mp->offset, mp->phys, &r->access[mp->phys->access]);
    }
    return st;
}

/* After the unmap: allocations no other mapping holds and, when the space
 * goes, its reservations. */
static void release_span(vmm_space_t *s, size_t lo, size_t hi, bool dies, cubuf_charge_t *released)
{
    for (size_t i = lo; i < hi; i++) {
        vmm_phys_t *p = s->maps[i].phys;
        if (--p->maps > 0) continue;
        cubuf__vmm_release_quiet(p->handle, p->size);
        if (!p->lost) {
            released->bytes += p->size;
            released->count++;
        }
        free(p);
    }
    if (!dies) return;
    for (size_t i = 0; i < s->nresv; i++)
        cubuf__vmm_va_free_quiet(s->base + s->resv[i].offset, s->resv[i].size);
}

static void warn_skipped(const vmm_wait_t *w, size_t n, bool releasing, const char *what)
{
    for (size_t i = 0; i < n; i++) {
        if (!w[i].captured) continue;
        cubuf__warn(CUBUF_ERROR_STREAM_CAPTURING,
                    "%s: the %s default stream was not %s, because that would invalidate a "
                    "stream capture in its context; %s",
                    what, default_stream_name(w[i].t.stream),
                    releasing ? "synchronized" : "recorded",
                    releasing ? "unmapped without waiting for it"
                              : "the memory will be unmapped without waiting for its work");
    }
}

/* ---- the close ------------------------------------------------------------------------ */

/* The range's waits stream and event, when its last member is gone. */
static void drop_waits(vmm_range_t *r)
{
    if (r->event) cubuf__vmm_event_destroy_quiet(r->event);
    if (r->waits) cubuf__vmm_stream_destroy_quiet(r->waits);
    r->event = NULL;
    r->waits = NULL;
}

static cubuf_status_t close_member(cubuf_resource_t *res, vmm_member_t *m,
                                   const cubuf_stream_token_t *token, const char *what,
                                   cubuf_charge_t *released)
{
    cubuf_status_t st;
    /* Refused before anything changes: the buffer stays open. */
    if (!cubuf__stream_is_default(token->stream) &&
        (st = cubuf__stream_refuse_capture(token->stream, NULL, what)) != CUBUF_SUCCESS)
        return st;
    vmm_range_t *r = m->range;
    vmm_space_t *s = m->space;
    vmm_guard_t g;
    if ((st = cubuf__vmm_guard_enter(res, &g)) != CUBUF_SUCCESS) return st;
    pthread_mutex_lock(&r->lock);

    size_t lo, hi, n = 1;
    bool dies;
    plan_close(m, &lo, &hi, &dies);
    bool releasing = hi > lo;
    vmm_wait_t small[8], *w = small;
    small[0] = (vmm_wait_t){*token, false, false};
    if (!releasing) {
        if ((st = defer_wait(res, r, &small[0])) != CUBUF_SUCCESS) goto out;
        s->maps[m->count - 1].ends--;
        s->buffers--;
    } else {
        size_t cap = r->nmembers + r->nheld;
        if (cap > sizeof small / sizeof small[0] && !(w = cubuf__malloc(cap * sizeof *w))) {
            st = cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "%s: out of host memory", what);
            w = small;
            goto out;
        }
        if ((st = wait_streams(r, m, token, w, &n, what)) != CUBUF_SUCCESS) goto out;
        if ((st = unmap_span(r, s, lo, hi)) != CUBUF_SUCCESS) goto out;
        /* The close is done from here on: nothing below can fail it. */
        release_span(s, lo, hi, dies, released);
        if (dies) {
            cubuf__vmm_space_free(s);
        } else {
            s->nmaps = lo;
            s->mapped = s->maps[lo].offset;
            s->buffers--;
        }
    }
    cubuf__vmm_range_unlink(r, m);
out:;
    bool last = st == CUBUF_SUCCESS && r->nmembers == 0;
    pthread_mutex_unlock(&r->lock);
    if (last) drop_waits(r);
    cubuf__vmm_guard_exit(&g);
    if (st == CUBUF_SUCCESS) warn_skipped(w, n, releasing, what);
    if (w != small) free(w);
    if (st != CUBUF_SUCCESS) return st;
    if (last) cubuf__vmm_range_free(r);
    free(m);
    return CUBUF_SUCCESS;
}

/* A space whose last buffer is forgotten: its mappings and reservations
 * stay, since nothing can wait for that buffer's stream now (the memory is
 * lost, as cubuf_buffer_release warns, and stays counted). Its physical
 * allocations no other space maps are released now, the others when that
 * space releases them (the driver frees the memory only when its mappings
 * go), and its bookkeeping is freed. Runs under the range's lock. */
static void forget_space(vmm_space_t *s)
{
    for (size_t i = 0; i < s->nmaps; i++) s->maps[i].phys->lost = true;
    cubuf_charge_t uncounted = {0, 0}; /* lost allocations count nothing back */
    release_span(s, 0, s->nmaps, false, &uncounted);
    cubuf__vmm_space_free(s);
}

/* The last reference of a buffer whose close failed is going away
 * (cubuf_buffer_release warns that its memory is lost): its membership must
 * not outlive it. Mappings other buffers cover are theirs to release; a
 * space only it held is forgotten (forget_space). */
static void forget_member(cubuf_resource_t *res, vmm_member_t *m)
{
    vmm_range_t *r = m->range;
    vmm_space_t *s = m->space;
    vmm_guard_t g;
    bool entered = cubuf__vmm_guard_enter(res, &g) == CUBUF_SUCCESS;
    pthread_mutex_lock(&r->lock);
    if (--s->buffers > 0) s->maps[m->count - 1].ends--;
    else forget_space(s);
    cubuf__vmm_range_unlink(r, m);
    bool last = r->nmembers == 0;
    pthread_mutex_unlock(&r->lock);
    if (last) drop_waits(r);
    if (entered) cubuf__vmm_guard_exit(&g);
    if (last) cubuf__vmm_range_free(r);
    free(m);
}

cubuf_status_t cubuf__vmm_deallocate(cubuf_resource_t *res, cubuf_buffer_t *buf,
                                     const cubuf_stream_token_t *token, cubuf_charge_t *charge)
{
    static const char what[] = "closing a virtual memory buffer";
    vmm_member_t *m = buf->impl;
    if (!m) /* cubuf_buffer_wrap refuses this resource (no_adopt): never reached */
        return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,
                           "%s: the buffer's memory was not allocated by this resource", what);
    *charge = (cubuf_charge_t){0, 0};
    cubuf_status_t st = close_member(res, m, token, what, charge);
    if (st != CUBUF_SUCCESS && atomic_load(&buf->refs) == 0) forget_member(res, m);
    return st;
}

void cubuf__vmm_set_token(cubuf_resource_t *res, cubuf_buffer_t *buf,
                          const cubuf_stream_token_t *token)
{
    (void)res;
    vmm_member_t *m = buf->impl;
    if (!m) {
        buf->dealloc = *token;
        return;
    }
    pthread_mutex_lock(&m->range->lock);
    buf->dealloc = *token;
    pthread_mutex_unlock(&m->range->lock);
}

cubuf_status_t cubuf__vmm_test_lock_range(cubuf_buffer_t *buf, bool lock)
{
    vmm_member_t *m = buf && !buf->closed && cubuf__vmm_of(buf->resource) ? buf->impl : NULL;
    CHECK_ARG(m, "cubuf__vmm_test_lock_range: not an open VMM buffer with memory");
    if (lock) pthread_mutex_lock(&m->range->lock);
    else pthread_mutex_unlock(&m->range->lock);
    return CUBUF_SUCCESS;
}
