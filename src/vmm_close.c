/* Virtual memory: closing a buffer (the resource's deallocate). Plans what
 * the close unmaps, waits for the streams it must, unmaps (mapping back on
 * failure) and only then releases. The rules are in <cubuf/vmm.h>, the
 * model in vmm.h. */
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
    bool skip;     /* not synchronized */
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

/* Checks and synchronizes the streams a close waits for: its own, and when
 * it releases memory those of the other open buffers of the range. Changes
 * nothing: any failure leaves the close undone. */
static cubuf_status_t wait_streams(const vmm_range_t *r, const vmm_member_t *m,
                                   const cubuf_stream_token_t *token, bool releasing,
                                   vmm_wait_t *w, size_t *n, const char *what)
{
    size_t k = 0;
    w[k++] = (vmm_wait_t){*token, false, false};
    if (releasing) {
        for (const vmm_member_t *o = r->members; o; o = o->next) {
            if (o == m) continue;
            const cubuf_stream_token_t *t = &o->buf->dealloc;
            bool dup = false;
            for (size_t i = 0; i < k && !dup; i++) dup = same_token(&w[i].t, t);
            if (!dup) w[k++] = (vmm_wait_t){*t, false, false};
        }
    }
    *n = k;
    cubuf_status_t st;
    for (size_t i = 0; i < k; i++) {
        const cubuf_stream_token_t *t = &w[i].t;
        bool def = cubuf__stream_is_default(t->stream);
        if (def && !t->ctx) {
            w[i].skip = true; /* host-only memory records no context: nothing to wait for */
            continue;
        }
        if (i == 0 && !def) continue; /* checked before the close began */
        CUstreamCaptureStatus cs = CU_STREAM_CAPTURE_STATUS_NONE;
        if ((st = cubuf__stream_capture_status(t->stream, t->ctx, &cs)) != CUBUF_SUCCESS) return st;
        if (cs == CU_STREAM_CAPTURE_STATUS_NONE) continue;
        if (!def)
            return cubuf__fail(CUBUF_ERROR_STREAM_CAPTURING,
                               "%s: another buffer of the same range records a deallocation "
                               "stream that is capturing; unmapping would have to wait for it",
                               what);
        w[i].skip = w[i].captured = true;
    }
    for (size_t i = 0; i < k; i++) {
        if (w[i].skip) continue;
        if ((st = cubuf__stream_sync(&w[i].t)) != CUBUF_SUCCESS) return st;
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
static void release_span(cubuf_resource_t *res, vmm_space_t *s, size_t lo, size_t hi, bool dies)
{
    for (size_t i = lo; i < hi; i++) {
        vmm_phys_t *p = s->maps[i].phys;
        if (--p->maps > 0) continue;
        cubuf__vmm_release_quiet(p->handle, p->size);
        cubuf__stats_sub(res, p->size);
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
                    "%s: the %s default stream was not synchronized, because that would "
                    "invalidate a stream capture in its context; %s without waiting for it",
                    what, default_stream_name(w[i].t.stream),
                    releasing ? "unmapped" : "closed");
    }
}

/* A buffer made by cubuf_buffer_wrap over this resource (cuda.core's
 * deallocate): [ptr, ptr+size) is one reservation, fully mapped, whose
 * physical handles the caller released; unmapping frees the memory. */
static cubuf_status_t release_wrapped(cubuf_resource_t *res, cubuf_buffer_t *buf,
                                      const cubuf_stream_token_t *token, const char *what)
{
    cubuf_status_t st;
    bool def = cubuf__stream_is_default(token->stream);
    if (!def && (st = cubuf__stream_refuse_capture(token->stream, NULL, what)) != CUBUF_SUCCESS)
        return st;
    vmm_wait_t w = {*token, false, false};
    size_t n = 0;
    vmm_guard_t g;
    if ((st = cubuf__vmm_guard_enter(res, &g)) != CUBUF_SUCCESS) return st;
    if ((st = wait_streams(NULL, NULL, token, false, &w, &n, what)) == CUBUF_SUCCESS) {
        st = CU(cuMemUnmap, buf->ptr, buf->size);
        if (st == CUBUF_SUCCESS) {
            CUresult r = cubuf__vmm_va_free_retry(buf->ptr, buf->size);
            if (r != CUDA_SUCCESS)
                cubuf__warn(cubuf__cu_map(r), "%s: cuMemAddressFree failed (CUresult %d)", what,
                            (int)r);
            cubuf__stats_sub(res, buf->size); /* cubuf_buffer_wrap counted it */
        }
    }
    cubuf__vmm_guard_exit(&g);
    warn_skipped(&w, n, true, what);
    return st;
}

static cubuf_status_t close_member(cubuf_resource_t *res, vmm_member_t *m,
                                   const cubuf_stream_token_t *token, const char *what)
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

    size_t lo, hi, n = 0;
    bool dies;
    plan_close(m, &lo, &hi, &dies);
    bool releasing = hi > lo;
    vmm_wait_t small[8], *w = small;
    if (releasing && r->nmembers > sizeof small / sizeof small[0] &&
        !(w = malloc(r->nmembers * sizeof *w))) {
        st = cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "%s: out of host memory", what);
        w = small;
        goto out;
    }
    if ((st = wait_streams(r, m, token, releasing, w, &n, what)) != CUBUF_SUCCESS) goto out;
    if (releasing) {
        if ((st = unmap_span(r, s, lo, hi)) != CUBUF_SUCCESS) goto out;
        /* The close is done from here on: nothing below can fail it. */
        release_span(res, s, lo, hi, dies);
    }
    if (dies) {
        cubuf__vmm_space_free(s);
    } else {
        if (releasing) {
            s->nmaps = lo;
            s->mapped = s->maps[lo].offset;
        } else {
            s->maps[m->count - 1].ends--;
        }
        s->buffers--;
    }
    cubuf__vmm_range_unlink(r, m);
out:;
    bool last = st == CUBUF_SUCCESS && r->nmembers == 0;
    pthread_mutex_unlock(&r->lock);
    cubuf__vmm_guard_exit(&g);
    if (st == CUBUF_SUCCESS) warn_skipped(w, n, releasing, what);
    if (w != small) free(w);
    if (st != CUBUF_SUCCESS) return st;
    if (last) cubuf__vmm_range_free(r);
    free(m);
    return CUBUF_SUCCESS;
}

/* The last reference of a buffer whose close failed is going away
 * (cubuf_buffer_release warns that its memory is lost): its membership must
 * not outlive it. Mappings other buffers cover are theirs to release; a
 * space only it held keeps its mappings, since nothing can wait for its
 * stream now. */
static void forget_member(vmm_member_t *m)
{
    vmm_range_t *r = m->range;
    vmm_space_t *s = m->space;
    pthread_mutex_lock(&r->lock);
    if (--s->buffers > 0) s->maps[m->count - 1].ends--;
    cubuf__vmm_range_unlink(r, m);
    bool last = r->nmembers == 0;
    pthread_mutex_unlock(&r->lock);
    if (last) cubuf__vmm_range_free(r);
    free(m);
}

cubuf_status_t cubuf__vmm_deallocate(cubuf_resource_t *res, cubuf_buffer_t *buf,
                                     const cubuf_stream_token_t *token)
{
    static const char what[] = "closing a virtual memory buffer";
    vmm_member_t *m = buf->impl;
    if (!m) return release_wrapped(res, buf, token, what);
    cubuf_status_t st = close_member(res, m, token, what);
    if (st != CUBUF_SUCCESS && atomic_load(&buf->refs) == 0) forget_member(m);
    return st;
}
