/* Streams, events, host functions, capture and graphs.
 *
 * Every stream has a worker thread that runs its ops in order. An op waits
 * for its dependencies first: (stream id, sequence number) pairs, met when
 * that stream has run that op (or is gone). The legacy default stream's rules
 * are dependencies taken at enqueue time: an op on a blocking stream waits
 * for everything enqueued before on its context's legacy stream, an op on
 * the legacy stream for everything enqueued before on the context's blocking
 * streams. One mutex and one condition variable guard it all. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fake.h"

typedef struct dep {
    unsigned long long stream_id, seq;
} dep_t;

typedef struct op {
    struct op *next;
    td_op_fn fn;
    void *arg;
    size_t arg_size;
    unsigned long long seq;
    dep_t *deps;
    size_t ndeps;
} op_t;

typedef enum stream_kind { KIND_USER, KIND_LEGACY, KIND_PER_THREAD } stream_kind_t;

typedef struct capture capture_t;

struct CUstream_st {
    struct CUstream_st *next; /* the list of all streams */
    unsigned long long id;
    CUcontext ctx;
    stream_kind_t kind;
    unsigned flags;
    int priority;
    bool destroyed;           /* no new work; the worker exits once idle */
    op_t *head, *tail;
    unsigned long long enqueued, done; /* sequence numbers */
    capture_t *cap;           /* capturing (its own capture or one it joined) */
    unsigned long long cap_ops; /* work it recorded into cap so far */
    bool cap_tail;            /* it joined cap and holds captured work the origin
                                 stream has not waited for (a fork not joined) */
};

/* A graph: the ops a capture recorded, and what it owns (graph
 * allocations). Shared by the graph and its executable graphs. */
typedef struct owned {
    struct owned *next;
    void (*release)(void *);
    void *arg;
} owned_t;

struct CUgraph_st {
    op_t *ops, *last;
    owned_t *owned;
    int refs;
};

struct CUgraphExec_st {
    struct CUgraph_st *graph;
};

struct capture {
    capture_t *next; /* the list of active captures */
    unsigned long long id;
    CUstream origin;
    CUstreamCaptureMode mode;
    pthread_t thread;
    bool invalidated;
    struct CUgraph_st *graph;
};

struct CUevent_st {
    struct CUevent_st *next; /* the list of live events */
    CUcontext ctx;
    unsigned flags;
    bool recorded;
    dep_t at;                   /* the marker op of the last record */
    unsigned long long cap_id;  /* last recorded during this capture, or 0 */
    unsigned long long cap_stream, cap_seq; /* that record: the stream, its cap_ops then */
    bool cap_tail;              /* the stream held unjoined work then */
    struct timespec when;       /* when the marker ran */
    bool destroyed;
    int refs;                   /* the handle and pending markers */
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t changed = PTHREAD_COND_INITIALIZER;
static CUstream streams;
static capture_t *captures;
static struct CUevent_st *events;
static unsigned long long next_id = 1;


/* ---- dependencies and workers ---- */

static CUstream find_id_locked(unsigned long long id)
{
    for (CUstream s = streams; s; s = s->next)
        if (s->id == id) return s;
    return NULL;
}

static bool dep_met_locked(const dep_t *d)
{
    CUstream s = find_id_locked(d->stream_id);
    return !s || s->done >= d->seq;
}

static bool deps_met_locked(const op_t *op)
{
    for (size_t i = 0; i < op->ndeps; i++)
        if (!dep_met_locked(&op->deps[i])) return false;
    return true;
}

static void op_free(op_t *op)
{
    free(op->deps);
    free(op->arg);
    free(op);
}

static void *worker(void *arg)
{
    CUstream s = arg;
    pthread_mutex_lock(&lock);
    for (;;) {
        while (!s->head && !s->destroyed) pthread_cond_wait(&changed, &lock);
        if (!s->head) break;
        op_t *op = s->head;
        while (!deps_met_locked(op)) pthread_cond_wait(&changed, &lock);
        pthread_mutex_unlock(&lock);
        if (op->fn) op->fn(op->arg);
        pthread_mutex_lock(&lock);
        s->head = op->next;
        if (!s->head) s->tail = NULL;
        s->done = op->seq;
        pthread_cond_broadcast(&changed);
        op_free(op);
    }
    CUstream *at = &streams;
    while (*at != s) at = &(*at)->next;
    *at = s->next;
    pthread_cond_broadcast(&changed);
    pthread_mutex_unlock(&lock);
    free(s);
    return NULL;
}

/* A stream that the legacy default stream synchronizes with. */
static bool blocking(CUstream s)
{
    return s->kind == KIND_PER_THREAD || (s->kind == KIND_USER && !(s->flags & CU_STREAM_NON_BLOCKING));
}

static CUresult stream_new_locked(CUcontext ctx, stream_kind_t kind, unsigned flags, int priority,
                                  CUstream *out)
{
    CUstream s = calloc(1, sizeof *s);
    if (!s) return CUDA_ERROR_OUT_OF_MEMORY;
    s->id = next_id++;
    s->ctx = ctx;
    s->kind = kind;
    s->flags = flags;
    s->priority = priority;
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int e = pthread_create(&t, &attr, worker, s);
    pthread_attr_destroy(&attr);
    if (e != 0) {
        free(s);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    s->next = streams;
    streams = s;
    *out = s;
    return CUDA_SUCCESS;
}

/* ---- the per-thread default streams ---- */

#define TD_PER_THREAD_MAX 8
typedef struct per_thread {
    CUcontext ctx;
    unsigned long long id;
} per_thread_t;

/* What each thread has of its own, behind a pthread key: no _Thread_local
 * in a library that is dlopen'ed (ThreadSanitizer reports the release of
 * such dynamic TLS as a race). */
typedef struct thread_state {
    CUstreamCaptureMode mode; /* cuThreadExchangeStreamCaptureMode; GLOBAL (0) at first */
    per_thread_t streams[TD_PER_THREAD_MAX]; /* the per-thread default streams */
} thread_state_t;

static pthread_key_t thread_key;
static pthread_once_t thread_once = PTHREAD_ONCE_INIT;

/* A thread's per-thread streams end with it. */
static void thread_exit(void *arg)
{
    thread_state_t *t = arg;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < TD_PER_THREAD_MAX; i++) {
        CUstream s = t->streams[i].id ? find_id_locked(t->streams[i].id) : NULL;
        if (s) s->destroyed = true;
    }
    pthread_cond_broadcast(&changed);
    pthread_mutex_unlock(&lock);
    free(t);
}

static void thread_init(void) { pthread_key_create(&thread_key, thread_exit); }

/* This thread's state, made on first use; NULL if memory ran out. Takes no
 * lock (callers may hold it). */
static thread_state_t *thread_state(void)
{
    pthread_once(&thread_once, thread_init);
    thread_state_t *t = pthread_getspecific(thread_key);
    if (!t && (t = calloc(1, sizeof *t)) && pthread_setspecific(thread_key, t) != 0) {
        free(t);
        t = NULL;
    }
    return t;
}

static CUresult per_thread_locked(CUcontext ctx, CUstream *out)
{
    thread_state_t *t = thread_state();
    if (!t) return CUDA_ERROR_OUT_OF_MEMORY;
    int slot = -1;
    for (int i = 0; i < TD_PER_THREAD_MAX; i++) {
        per_thread_t *p = &t->streams[i];
        if (p->id && p->ctx == ctx) {
            CUstream s = find_id_locked(p->id);
            if (s && !s->destroyed) {
                *out = s;
                return CUDA_SUCCESS;
            }
            p->id = 0;
        }
        if (!p->id && slot < 0) slot = i;
    }
    if (slot < 0) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = stream_new_locked(ctx, KIND_PER_THREAD, 0, 0, out);
    if (r == CUDA_SUCCESS) t->streams[slot] = (per_thread_t){ctx, (*out)->id};
    return r;
}

/* ---- handles ---- */

static CUstream legacy_find_locked(CUcontext ctx)
{
    for (CUstream s = streams; s; s = s->next)
        if (s->kind == KIND_LEGACY && s->ctx == ctx && !s->destroyed) return s;
    return NULL;
}

/* The stream a handle means, for the calling thread. */
static CUresult resolve_locked(CUstream h, CUstream *out)
{
    if (h == NULL || h == CU_STREAM_LEGACY || h == CU_STREAM_PER_THREAD) {
        CUcontext ctx;
        CUresult r = td_ctx_require(&ctx);
        if (r != CUDA_SUCCESS) return r;
        if (h == CU_STREAM_PER_THREAD) return per_thread_locked(ctx, out);
        *out = legacy_find_locked(ctx);
        return *out ? CUDA_SUCCESS : stream_new_locked(ctx, KIND_LEGACY, 0, 0, out);
    }
    for (CUstream s = streams; s; s = s->next)
        if (s == h && s->kind == KIND_USER && !s->destroyed) {
            *out = s;
            return CUDA_SUCCESS;
        }
    return CUDA_ERROR_INVALID_HANDLE;
}

static CUresult resolve(CUstream h, CUstream *out)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    pthread_mutex_lock(&lock);
    r = resolve_locked(h, out);
    pthread_mutex_unlock(&lock);
    return r;
}

static struct CUevent_st *event_find_locked(CUevent e)
{
    for (struct CUevent_st *x = events; x; x = x->next)
        if (x == e && !x->destroyed) return x;
    return NULL;
}

/* ---- capture state ---- */

/* A blocking stream of ctx that captures (the legacy stream must not
 * depend on it), or NULL. */
static CUstream capturing_blocking_locked(CUcontext ctx)
{
    for (CUstream s = streams; s; s = s->next)
        if (s->ctx == ctx && s->cap && blocking(s) && !s->destroyed) return s;
    return NULL;
}

static void graph_release(struct CUgraph_st *g)
{
    if (!g || --g->refs > 0) return;
    for (op_t *op = g->ops, *next; op; op = next) {
        next = op->next;
        op_free(op);
    }
    for (owned_t *o = g->owned, *next; o; o = next) {
        next = o->next;
        o->release(o->arg);
        free(o);
    }
    free(g);
}

static pthread_mutex_t graph_lock = PTHREAD_MUTEX_INITIALIZER;

static void graph_unref(struct CUgraph_st *g)
{
    pthread_mutex_lock(&graph_lock);
    graph_release(g);
    pthread_mutex_unlock(&graph_lock);
}

/* A capture ends: no stream captures into it any more. */
static void capture_unlink_locked(capture_t *c)
{
    for (CUstream x = streams; x; x = x->next)
        if (x->cap == c) x->cap = NULL;
    capture_t **at = &captures;
    while (*at != c) at = &(*at)->next;
    *at = c->next;
}

static bool capture_active_locked(unsigned long long id)
{
    for (capture_t *c = captures; c; c = c->next)
        if (c->id == id) return true;
    return false;
}

/* ---- enqueueing ---- */

static op_t *op_new(td_op_fn fn, const void *arg, size_t arg_size)
{
    op_t *op = calloc(1, sizeof *op);
    if (!op) return NULL;
    op->fn = fn;
    op->arg_size = arg_size;
    if (arg_size) {
        op->arg = malloc(arg_size);
        if (!op->arg) {
            free(op);
            return NULL;
        }
        memcpy(op->arg, arg, arg_size);
    }
    return op;
}

static CUresult add_dep(op_t *op, CUstream on)
{
    if (on->done >= on->enqueued) return CUDA_SUCCESS;
    dep_t *d = realloc(op->deps, (op->ndeps + 1) * sizeof *d);
    if (!d) return CUDA_ERROR_OUT_OF_MEMORY;
    op->deps = d;
    d[op->ndeps++] = (dep_t){on->id, on->enqueued};
    return CUDA_SUCCESS;
}

/* Enqueues op on s (lock held; takes op, freeing it on failure), or records
 * it into s's capture. `extra` is one more dependency (a waited event). */
static CUresult submit_locked(CUstream s, op_t *op, const dep_t *extra)
{
    CUresult r = CUDA_SUCCESS;
    if (s->cap) {
        if (s->cap->invalidated) r = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
        if (r != CUDA_SUCCESS || !op->fn) { /* a bare wait adds nothing to a linear graph */
            op_free(op);
            return r;
        }
        struct CUgraph_st *g = s->cap->graph;
        if (g->last) g->last->next = op;
        else g->ops = op;
        g->last = op;
        s->cap_ops++;
        if (s != s->cap->origin) s->cap_tail = true;
        return CUDA_SUCCESS;
    }
    if (s->kind == KIND_LEGACY) {
        CUstream c = capturing_blocking_locked(s->ctx);
        if (c) {
            c->cap->invalidated = true;
            op_free(op);
            return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
        }
        for (CUstream b = streams; b && r == CUDA_SUCCESS; b = b->next)
            if (b->ctx == s->ctx && blocking(b)) r = add_dep(op, b);
    } else if (blocking(s)) {
        CUstream l = legacy_find_locked(s->ctx);
        if (l) r = add_dep(op, l);
    }
    if (r == CUDA_SUCCESS && extra) {
        dep_t *d = realloc(op->deps, (op->ndeps + 1) * sizeof *d);
        if (d) {
            op->deps = d;
            d[op->ndeps++] = *extra;
        } else {
            r = CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    if (r != CUDA_SUCCESS) {
        op_free(op);
        return r;
    }
    op->seq = ++s->enqueued;
    if (s->tail) s->tail->next = op;
    else s->head = op;
    s->tail = op;
    pthread_cond_broadcast(&changed);
    return CUDA_SUCCESS;
}

CUresult td_enqueue(CUstream hStream, td_op_fn fn, const void *arg, size_t arg_size)
{
    op_t *op = op_new(fn, arg, arg_size);
    if (!op) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) {
        op_free(op);
        return r;
    }
    pthread_mutex_lock(&lock);
    CUstream s;
    r = resolve_locked(hStream, &s);
    if (r != CUDA_SUCCESS) op_free(op);
    else r = submit_locked(s, op, NULL);
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult td_enqueue_sync(CUstream hStream, td_op_fn fn, const void *arg, size_t arg_size)
{
    CUresult r = td_capture_unsafe_call();
    if (r != CUDA_SUCCESS) return r;
    op_t *op = op_new(fn, arg, arg_size);
    if (!op) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&lock);
    CUstream s;
    dep_t at = {0, 0};
    r = resolve_locked(hStream, &s);
    if (r == CUDA_SUCCESS && s->cap) { /* waiting on a capturing stream */
        s->cap->invalidated = true;
        r = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    }
    if (r != CUDA_SUCCESS) op_free(op);
    else if ((r = submit_locked(s, op, NULL)) == CUDA_SUCCESS) at = (dep_t){s->id, s->enqueued};
    while (r == CUDA_SUCCESS && !dep_met_locked(&at)) pthread_cond_wait(&changed, &lock);
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult td_stream_ctx(CUstream hStream, CUcontext *ctx)
{
    CUstream s;
    CUresult r = resolve(hStream, &s);
    if (r == CUDA_SUCCESS) *ctx = s->ctx;
    return r;
}

CUresult td_stream_capture_status(CUstream hStream, CUstreamCaptureStatus *status)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    pthread_mutex_lock(&lock);
    CUstream s;
    r = resolve_locked(hStream, &s);
    if (r == CUDA_SUCCESS) {
        if (s->kind == KIND_LEGACY && capturing_blocking_locked(s->ctx))
            r = CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
        else if (!s->cap) *status = CU_STREAM_CAPTURE_STATUS_NONE;
        else *status = s->cap->invalidated ? CU_STREAM_CAPTURE_STATUS_INVALIDATED
                                           : CU_STREAM_CAPTURE_STATUS_ACTIVE;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult td_capture_own(CUstream hStream, void (*release)(void *arg), void *arg)
{
    owned_t *o = calloc(1, sizeof *o);
    if (!o) return CUDA_ERROR_OUT_OF_MEMORY;
    o->release = release;
    o->arg = arg;
    pthread_mutex_lock(&lock);
    CUstream s;
    CUresult r = resolve_locked(hStream, &s);
    if (r == CUDA_SUCCESS && !s->cap) r = CUDA_ERROR_ILLEGAL_STATE;
    if (r == CUDA_SUCCESS) {
        o->next = s->cap->graph->owned;
        s->cap->graph->owned = o;
    }
    pthread_mutex_unlock(&lock);
    if (r != CUDA_SUCCESS) free(o);
    return r;
}

/* The captures that forbid this thread a potentially unsafe call, as the
 * CUDA programming guide's capture modes define it. */
static bool forbids_locked(const capture_t *c)
{
    bool mine = pthread_equal(c->thread, pthread_self());
    const thread_state_t *t = thread_state();
    switch (t ? t->mode : CU_STREAM_CAPTURE_MODE_GLOBAL) {
    case CU_STREAM_CAPTURE_MODE_RELAXED: return false;
    case CU_STREAM_CAPTURE_MODE_THREAD_LOCAL: return mine && c->mode != CU_STREAM_CAPTURE_MODE_RELAXED;
    default:
        return (mine && c->mode != CU_STREAM_CAPTURE_MODE_RELAXED) ||
               (!mine && c->mode == CU_STREAM_CAPTURE_MODE_GLOBAL);
    }
}

CUresult td_capture_unsafe_call(void)
{
    CUresult r = CUDA_SUCCESS;
    pthread_mutex_lock(&lock);
    for (capture_t *c = captures; c; c = c->next)
        if (forbids_locked(c)) {
            c->invalidated = true;
            r = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
        }
    pthread_mutex_unlock(&lock);
    return r;
}

/* Waits for all work enqueued so far on the streams of ctx (all if NULL). */
static void drain_locked(CUcontext ctx)
{
    size_t n = 0;
    for (CUstream s = streams; s; s = s->next) n++;
    dep_t *want = calloc(n ? n : 1, sizeof *want);
    size_t k = 0;
    for (CUstream s = streams; s; s = s->next)
        if ((!ctx || s->ctx == ctx) && s->done < s->enqueued) {
            if (want) want[k++] = (dep_t){s->id, s->enqueued};
            else while (s->done < s->enqueued) pthread_cond_wait(&changed, &lock);
        }
    for (size_t i = 0; i < k; i++)
        while (!dep_met_locked(&want[i])) pthread_cond_wait(&changed, &lock);
    free(want);
}

void td_ctx_drain(CUcontext ctx)
{
    pthread_mutex_lock(&lock);
    drain_locked(ctx);
    pthread_mutex_unlock(&lock);
}

CUresult td_ctx_synchronize(CUcontext ctx)
{
    CUresult r = CUDA_SUCCESS;
    pthread_mutex_lock(&lock);
    for (CUstream s = streams; s; s = s->next)
        if (s->ctx == ctx && s->cap && !s->destroyed) {
            s->cap->invalidated = true;
            r = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
        }
    if (r == CUDA_SUCCESS) drain_locked(ctx);
    pthread_mutex_unlock(&lock);
    return r;
}

void td_ctx_streams_destroy(CUcontext ctx)
{
    pthread_mutex_lock(&lock);
    drain_locked(ctx);
    for (CUstream s = streams; s; s = s->next)
        if (s->ctx == ctx) s->destroyed = true;
    pthread_cond_broadcast(&changed);
    pthread_mutex_unlock(&lock);
}

/* ---- streams ---- */

CUresult td_cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority)
{
    CUcontext ctx;
    CUresult r = td_ctx_require(&ctx);
    if (r != CUDA_SUCCESS) return r;
    if (!phStream || (flags & ~(unsigned)CU_STREAM_NON_BLOCKING)) return CUDA_ERROR_INVALID_VALUE;
    /* Clamped to [greatest, least] = [-5, 0], as cuCtxGetStreamPriorityRange says. */
    if (priority > 0) priority = 0;
    if (priority < -5) priority = -5;
    pthread_mutex_lock(&lock);
    r = stream_new_locked(ctx, KIND_USER, flags, priority, phStream);
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult td_cuStreamCreate(CUstream *phStream, unsigned int Flags)
{
    return td_cuStreamCreateWithPriority(phStream, Flags, 0);
}

CUresult td_cuStreamDestroy(CUstream hStream)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (hStream == NULL || hStream == CU_STREAM_LEGACY || hStream == CU_STREAM_PER_THREAD)
        return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&lock);
    CUstream s;
    r = resolve_locked(hStream, &s);
    capture_t *ended = NULL;
    if (r == CUDA_SUCCESS) {
        /* A capture it began ends with it, failed; one it joined goes on without it. */
        if (s->cap && s->cap->origin == s) capture_unlink_locked(ended = s->cap);
        s->cap = NULL;
        s->destroyed = true; /* its work still runs, then the worker ends */
        pthread_cond_broadcast(&changed);
    }
    pthread_mutex_unlock(&lock);
    if (ended) {
        graph_unref(ended->graph);
        free(ended);
    }
    return r;
}

/* What synchronizing s waits for: its own work, and for the legacy stream
 * the work of the context's blocking streams too. Fills want[] (lock held)
 * and returns how many it filled. */
static size_t sync_targets_locked(CUstream s, dep_t *want, size_t cap)
{
    size_t k = 0;
    want[k++] = (dep_t){s->id, s->enqueued};
    if (s->kind == KIND_LEGACY)
        for (CUstream b = streams; b && k < cap; b = b->next)
            if (b->ctx == s->ctx && blocking(b)) want[k++] = (dep_t){b->id, b->enqueued};
    return k;
}

/* Synchronize (wait) or query (don't) a stream. */
static CUresult stream_wait(CUstream hStream, bool wait)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    pthread_mutex_lock(&lock);
    CUstream s;
    r = resolve_locked(hStream, &s);
    if (r == CUDA_SUCCESS && s->cap) {
        s->cap->invalidated = true;
        r = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    }
    if (r == CUDA_SUCCESS && s->kind == KIND_LEGACY) {
        CUstream c = capturing_blocking_locked(s->ctx);
        if (c) {
            c->cap->invalidated = true;
            r = CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
        }
    }
    if (r == CUDA_SUCCESS) {
        size_t n = 1;
        for (CUstream b = streams; b; b = b->next) n++;
        dep_t *want = calloc(n, sizeof *want);
        if (!want) {
            r = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            size_t k = sync_targets_locked(s, want, n);
            for (size_t i = 0; i < k && r == CUDA_SUCCESS; i++)
                while (!dep_met_locked(&want[i])) {
                    if (!wait) {
                        r = CUDA_ERROR_NOT_READY;
                        break;
                    }
                    pthread_cond_wait(&changed, &lock);
                }
            free(want);
        }
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult td_cuStreamSynchronize(CUstream hStream) { return stream_wait(hStream, true); }

CUresult td_cuStreamQuery(CUstream hStream) { return stream_wait(hStream, false); }

CUresult td_cuStreamGetFlags(CUstream hStream, unsigned int *flags)
{
    CUstream s;
    CUresult r = resolve(hStream, &s);
    if (r != CUDA_SUCCESS) return r;
    if (!flags) return CUDA_ERROR_INVALID_VALUE;
    *flags = s->flags;
    return CUDA_SUCCESS;
}

CUresult td_cuStreamGetPriority(CUstream hStream, int *priority)
{
    CUstream s;
    CUresult r = resolve(hStream, &s);
    if (r != CUDA_SUCCESS) return r;
    if (!priority) return CUDA_ERROR_INVALID_VALUE;
    *priority = s->priority;
    return CUDA_SUCCESS;
}

CUresult td_cuStreamGetCtx(CUstream hStream, CUcontext *pctx)
{
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    return td_stream_ctx(hStream, pctx);
}

typedef struct host_call {
    CUhostFn fn;
    void *data;
} host_call_t;

static void run_host_call(void *arg)
{
    const host_call_t *c = arg;
    c->fn(c->data);
}

CUresult td_cuLaunchHostFunc(CUstream hStream, CUhostFn fn, void *userData)
{
    if (!fn) return CUDA_ERROR_INVALID_VALUE;
    host_call_t c = {fn, userData};
    return td_enqueue(hStream, run_host_call, &c, sizeof c);
}

/* ---- capture ---- */

CUresult td_cuStreamIsCapturing(CUstream hStream, CUstreamCaptureStatus *captureStatus)
{
    if (!captureStatus) return CUDA_ERROR_INVALID_VALUE;
    return td_stream_capture_status(hStream, captureStatus);
}

CUresult td_cuStreamBeginCapture(CUstream hStream, CUstreamCaptureMode mode)
{
    if ((unsigned)mode > CU_STREAM_CAPTURE_MODE_RELAXED) return CUDA_ERROR_INVALID_VALUE;
    capture_t *c = calloc(1, sizeof *c);
    struct CUgraph_st *g = calloc(1, sizeof *g);
    if (!c || !g) {
        free(c);
        free(g);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) {
        free(c);
        free(g);
        return r;
    }
    pthread_mutex_lock(&lock);
    CUstream s;
    r = resolve_locked(hStream, &s);
    if (r == CUDA_SUCCESS && s->kind == KIND_LEGACY) r = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    if (r == CUDA_SUCCESS && s->cap) r = CUDA_ERROR_ILLEGAL_STATE;
    if (r == CUDA_SUCCESS) {
        g->refs = 1;
        c->graph = g;
        c->id = next_id++;
        c->origin = s;
        c->mode = mode;
        c->thread = pthread_self();
        c->next = captures;
        captures = c;
        s->cap = c;
        s->cap_ops = 0;
        s->cap_tail = false;
    }
    pthread_mutex_unlock(&lock);
    if (r != CUDA_SUCCESS) {
        free(c);
        free(g);
    }
    return r;
}

CUresult td_cuStreamEndCapture(CUstream hStream, CUgraph *phGraph)
{
    if (!phGraph) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    pthread_mutex_lock(&lock);
    CUstream s;
    r = resolve_locked(hStream, &s);
    capture_t *c = r == CUDA_SUCCESS ? s->cap : NULL;
    if (r == CUDA_SUCCESS && !c) r = CUDA_ERROR_ILLEGAL_STATE;
    if (r == CUDA_SUCCESS && c->origin != s) r = CUDA_ERROR_STREAM_CAPTURE_UNMATCHED;
    if (r == CUDA_SUCCESS && c->mode != CU_STREAM_CAPTURE_MODE_RELAXED &&
        !pthread_equal(c->thread, pthread_self()))
        r = CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD;
    /* Every stream that joined must have its captured work joined back into
     * the origin (the origin waited on an event recorded after that work),
     * else the capture fails: CUDA_ERROR_STREAM_CAPTURE_UNJOINED. */
    bool unjoined = false;
    for (CUstream x = streams; x && r == CUDA_SUCCESS; x = x->next)
        if (x->cap == c && x != s && !x->destroyed && x->cap_tail) unjoined = true;
    if (r == CUDA_SUCCESS) capture_unlink_locked(c);
    pthread_mutex_unlock(&lock);
    if (r != CUDA_SUCCESS) return r;
    *phGraph = NULL;
    struct CUgraph_st *g = c->graph;
    bool invalidated = c->invalidated;
    free(c);
    if (invalidated || unjoined) {
        graph_unref(g);
        return invalidated ? CUDA_ERROR_STREAM_CAPTURE_INVALIDATED : CUDA_ERROR_STREAM_CAPTURE_UNJOINED;
    }
    *phGraph = g;
    return CUDA_SUCCESS;
}

CUresult td_cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *mode)
{
    if (!mode || (unsigned)*mode > CU_STREAM_CAPTURE_MODE_RELAXED) return CUDA_ERROR_INVALID_VALUE;
    thread_state_t *t = thread_state();
    if (!t) return CUDA_ERROR_OUT_OF_MEMORY;
    CUstreamCaptureMode old = t->mode;
    t->mode = *mode;
    *mode = old;
    return CUDA_SUCCESS;
}

/* ---- graphs ---- */

CUresult td_cuGraphDestroy(CUgraph hGraph)
{
    if (!hGraph) return CUDA_ERROR_INVALID_VALUE;
    graph_unref(hGraph);
    return CUDA_SUCCESS;
}

CUresult td_cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags)
{
    if (!phGraphExec || !hGraph) return CUDA_ERROR_INVALID_VALUE;
    struct CUgraphExec_st *x = calloc(1, sizeof *x);
    if (!x) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&graph_lock);
    hGraph->refs++;
    pthread_mutex_unlock(&graph_lock);
    x->graph = hGraph;
    *phGraphExec = x;
    return CUDA_SUCCESS;
}

CUresult td_cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream)
{
    if (!hGraphExec) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = CUDA_SUCCESS;
    for (const op_t *op = hGraphExec->graph->ops; op && r == CUDA_SUCCESS; op = op->next)
        r = td_enqueue(hStream, op->fn, op->arg, op->arg_size);
    return r;
}

CUresult td_cuGraphExecDestroy(CUgraphExec hGraphExec)
{
    if (!hGraphExec) return CUDA_ERROR_INVALID_VALUE;
    graph_unref(hGraphExec->graph);
    free(hGraphExec);
    return CUDA_SUCCESS;
}

/* ---- events ---- */

static void event_unref_locked(struct CUevent_st *e)
{
    if (--e->refs > 0) return;
    struct CUevent_st **at = &events;
    while (*at != e) at = &(*at)->next;
    *at = e->next;
    free(e);
}

CUresult td_cuEventCreate(CUevent *phEvent, unsigned int Flags)
{
    CUcontext ctx;
    CUresult r = td_ctx_require(&ctx);
    if (r != CUDA_SUCCESS) return r;
    const unsigned known = CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS;
    if (!phEvent || (Flags & ~known)) return CUDA_ERROR_INVALID_VALUE;
    if ((Flags & CU_EVENT_INTERPROCESS) && !(Flags & CU_EVENT_DISABLE_TIMING))
        return CUDA_ERROR_INVALID_VALUE;
    struct CUevent_st *e = calloc(1, sizeof *e);
    if (!e) return CUDA_ERROR_OUT_OF_MEMORY;
    e->ctx = ctx;
    e->flags = Flags;
    e->refs = 1;
    pthread_mutex_lock(&lock);
    e->next = events;
    events = e;
    pthread_mutex_unlock(&lock);
    *phEvent = e;
    return CUDA_SUCCESS;
}

CUresult td_cuEventDestroy(CUevent hEvent)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    pthread_mutex_lock(&lock);
    struct CUevent_st *e = event_find_locked(hEvent);
    if (e) {
        e->destroyed = true;
        event_unref_locked(e);
    }
    pthread_mutex_unlock(&lock);
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

/* The marker op of a record: timestamps the event when the stream gets there. */
static void mark_event(void *arg)
{
    struct CUevent_st *e = *(struct CUevent_st **)arg;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    pthread_mutex_lock(&lock);
    e->when = now;
    event_unref_locked(e);
    pthread_mutex_unlock(&lock);
}

CUresult td_cuEventRecord(CUevent hEvent, CUstream hStream)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    pthread_mutex_lock(&lock);
    struct CUevent_st *e = event_find_locked(hEvent);
    CUstream s = NULL;
    r = e ? resolve_locked(hStream, &s) : CUDA_ERROR_INVALID_HANDLE;
    if (r == CUDA_SUCCESS && s->cap) {
        /* Recorded into the capture: a node of the graph, no work now. */
        if (s->cap->invalidated) {
            r = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
        } else {
            e->cap_id = s->cap->id;
            e->cap_stream = s->id;
            e->cap_seq = s->cap_ops;
            e->cap_tail = s->cap_tail;
        }
    } else if (r == CUDA_SUCCESS) {
        op_t *op = op_new(mark_event, &e, sizeof e);
        if (!op) {
            r = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            e->refs++;
            r = submit_locked(s, op, NULL);
            if (r == CUDA_SUCCESS) {
                e->recorded = true;
                e->cap_id = 0;
                e->at = (dep_t){s->id, s->enqueued};
            } else {
                e->refs--;
            }
        }
    }
    pthread_mutex_unlock(&lock);
    return r;
}

/* CUDA_SUCCESS when the event's record has run (or it was never recorded). */
static CUresult event_wait(CUevent hEvent, bool wait)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    pthread_mutex_lock(&lock);
    struct CUevent_st *e = event_find_locked(hEvent);
    if (!e) r = CUDA_ERROR_INVALID_HANDLE;
    else if (e->cap_id && capture_active_locked(e->cap_id)) r = CUDA_ERROR_CAPTURED_EVENT;
    else if (e->recorded) {
        e->refs++; /* it may be destroyed while this thread waits */
        while (r == CUDA_SUCCESS && !dep_met_locked(&e->at)) {
            if (!wait) r = CUDA_ERROR_NOT_READY;
            else pthread_cond_wait(&changed, &lock);
        }
        event_unref_locked(e);
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult td_cuEventQuery(CUevent hEvent) { return event_wait(hEvent, false); }

CUresult td_cuEventSynchronize(CUevent hEvent) { return event_wait(hEvent, true); }

CUresult td_cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (Flags & ~(unsigned)CU_EVENT_WAIT_EXTERNAL) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    struct CUevent_st *e = event_find_locked(hEvent);
    CUstream s = NULL;
    r = e ? resolve_locked(hStream, &s) : CUDA_ERROR_INVALID_HANDLE;
    if (r == CUDA_SUCCESS && e->cap_id && capture_active_locked(e->cap_id)) {
        /* Waiting on a captured event joins its capture (fork). */
        capture_t *c = captures;
        while (c->id != e->cap_id) c = c->next;
        if (s->cap && s->cap != c) {
            r = CUDA_ERROR_STREAM_CAPTURE_MERGE;
        } else {
            if (!s->cap) { /* a fork: s joins the capture */
                s->cap = c;
                s->cap_ops = 0;
                s->cap_tail = false;
            }
            /* The recording stream's work up to the record now precedes s's;
             * waited for by the origin, it is joined. */
            CUstream x = find_id_locked(e->cap_stream);
            if (x && x != s && x->cap == c && x->cap_ops == e->cap_seq) x->cap_tail = false;
            if (e->cap_tail && s != c->origin) s->cap_tail = true;
        }
    } else if (r == CUDA_SUCCESS && e->recorded) {
        op_t *op = op_new(NULL, NULL, 0);
        r = op ? submit_locked(s, op, &e->at) : CUDA_ERROR_OUT_OF_MEMORY;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult td_cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd)
{
    if (!pMilliseconds) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    pthread_mutex_lock(&lock);
    struct CUevent_st *a = event_find_locked(hStart), *b = event_find_locked(hEnd);
    if (!a || !b) r = CUDA_ERROR_INVALID_HANDLE;
    else if ((a->flags | b->flags) & CU_EVENT_DISABLE_TIMING) r = CUDA_ERROR_INVALID_HANDLE;
    else if (!a->recorded || !b->recorded) r = CUDA_ERROR_INVALID_HANDLE;
    else if (!dep_met_locked(&a->at) || !dep_met_locked(&b->at)) r = CUDA_ERROR_NOT_READY;
    else
        *pMilliseconds = (float)((double)(b->when.tv_sec - a->when.tv_sec) * 1e3 +
                                 (double)(b->when.tv_nsec - a->when.tv_nsec) / 1e6);
    pthread_mutex_unlock(&lock);
    return r;
}
