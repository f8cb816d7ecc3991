/* The logging adaptor: one line per allocate and free (cubuf/adaptor.h).
 *
 * The hot path stamps a small binary event with CLOCK_MONOTONIC and writes
 * it into one of a few shards, picked by thread, each under its own spin
 * lock. A full shard hands its batch to the adaptor's writer thread, which
 * formats it (by hand: snprintf would make the writer slower than the
 * threads it serves) and writes it. At most LOG_MAX_PENDING batches wait:
 * past that the thread that filled a shard writes everything itself, so a
 * program that allocates faster than its log can be written slows down
 * instead of growing without bound. A flush writes what is queued, then what
 * the shards hold. Lock order: the output lock, a shard, the queue. */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "adaptor_base.h"

#define LOG_SHARDS 16
#define LOG_SHARD_EVENTS 4096
#define LOG_MAX_PENDING 16

enum { OP_ALLOCATE, OP_FREE };

typedef struct log_event {
    uint64_t stamp;
    CUstream stream;
    CUdeviceptr ptr;
    size_t size;
    int32_t tid;
    uint8_t op;
    int8_t status;
} log_event_t;

typedef struct log_shard {
    atomic_bool lock;
    size_t n;
    log_event_t *ev; /* LOG_SHARD_EVENTS of them */
} log_shard_t;

/* A full batch waiting for the writer, or a spare array (n unused). */
typedef struct log_batch {
    log_event_t *ev;
    size_t n;
    struct log_batch *next;
} log_batch_t;

typedef struct log_adaptor {
    FILE *file;
    cubuf_log_line_fn callback;
    void *user;
    pthread_mutex_t out_lock; /* one writer at a time: batches go out in order */
    log_shard_t shards[LOG_SHARDS];
    pthread_mutex_t q_lock; /* the queue of full batches, the spare arrays, stop */
    pthread_cond_t q_cond;
    log_batch_t *pending, **pending_tail, *spares;
    unsigned npending; /* batches in pending */
    bool stop, writer_started;
    pthread_t writer;
} log_adaptor_t;

static int64_t mono_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* CLOCK_MONOTONIC itself (the vDSO, about 20 ns): one clock for every
 * thread, so stamps order events across threads and need no conversion. */
static inline uint64_t stamp_now(void) { return (uint64_t)mono_ns(); }

static void shard_lock(log_shard_t *s) { cubuf__spin_lock(&s->lock); }
static void shard_unlock(log_shard_t *s) { cubuf__spin_unlock(&s->lock); }

static cubuf_status_t flush(log_adaptor_t *l);

/* Hands a shard's batch to the writer and gives the shard a fresh array;
 * false when no array can be had, or (`bounded`) LOG_MAX_PENDING batches
 * wait already: the caller writes instead. The shard's lock is held. */
static bool hand_over(log_adaptor_t *l, log_shard_t *s, bool bounded)
{
    log_batch_t *b = NULL;
    pthread_mutex_lock(&l->q_lock);
    const bool full = bounded && l->npending >= LOG_MAX_PENDING;
    if (!full && (b = l->spares)) l->spares = b->next;
    pthread_mutex_unlock(&l->q_lock);
    if (full) return false;
    if (!b && (b = cubuf__malloc(sizeof *b)) && !(b->ev = cubuf__malloc(LOG_SHARD_EVENTS * sizeof *b->ev))) {
        free(b);
        b = NULL;
    }
    if (!b) return false;
    log_event_t *fresh = b->ev;
    b->ev = s->ev;
    b->n = s->n;
    b->next = NULL;
    s->ev = fresh;
    s->n = 0;
    pthread_mutex_lock(&l->q_lock);
    *l->pending_tail = b;
    l->pending_tail = &b->next;
    l->npending++;
    pthread_cond_signal(&l->q_cond);
    pthread_mutex_unlock(&l->q_lock);
    return true;
}

/* `stamp`: an allocation's after it returned, a free's before it is asked
 * for, so a pointer freed and handed out again is logged freed first. */
static void record(log_adaptor_t *l, uint8_t op, uint64_t stamp, const cubuf_stream_token_t *on,
                   CUdeviceptr ptr, size_t size, cubuf_status_t st)
{
    const int32_t tid = cubuf__adaptor_thread_id();
    log_shard_t *s = &l->shards[(unsigned)tid % LOG_SHARDS];
    for (;;) {
        shard_lock(s);
        if (__builtin_expect(s->n < LOG_SHARD_EVENTS, 1) || hand_over(l, s, true)) break;
        shard_unlock(s);
        if (flush(l) != CUBUF_SUCCESS)
            cubuf__warn(CUBUF_ERROR_SYSTEM, "logging adaptor: a flush failed; its events are lost");
    }
    log_event_t *e = &s->ev[s->n++];
    e->stamp = stamp;
    e->stream = on->stream;
    e->ptr = ptr;
    e->size = size;
    e->tid = tid;
    e->op = op;
    e->status = (int8_t)st;
    shard_unlock(s);
}

static cubuf_status_t log_allocate(cubuf_resource_t *res, cubuf_buffer_t *buf, CUstream stream,
                                   bool in_ctx, cubuf_charge_t *charge)
{
    cubuf_status_t st = cubuf__adaptor_up_allocate(res, buf, stream, in_ctx, charge);
    record(res->impl, OP_ALLOCATE, stamp_now(), &buf->dealloc, st == CUBUF_SUCCESS ? buf->ptr : 0,
           buf->size, st);
    return st;
}

static cubuf_status_t log_deallocate(cubuf_resource_t *res, cubuf_buffer_t *buf,
                                     const cubuf_stream_token_t *token, cubuf_charge_t *charge)
{
    const uint64_t stamp = stamp_now();
    cubuf_status_t st = cubuf__adaptor_up_deallocate(res, buf, token, charge);
    record(res->impl, OP_FREE, stamp, token, buf->ptr, buf->size, st);
    return st;
}

/* ---- flushing ---- */

static int by_stamp(const void *a, const void *b)
{
    const log_event_t *x = a, *y = b;
    return x->stamp < y->stamp ? -1 : x->stamp > y->stamp ? 1 : 0;
}

/* The line's fields, formatted as printf's %llu, %d, %p, %s and 0x%llx would. */
static char *put_u64(char *p, uint64_t v)
{
    char t[20];
    int n = 0;
    do t[n++] = (char)('0' + v % 10);
    while ((v /= 10));
    while (n) *p++ = t[--n];
    return p;
}
static char *put_i32(char *p, int32_t v)
{
    if (v < 0) *p++ = '-';
    return put_u64(p, v < 0 ? -(uint64_t)(int64_t)v : (uint64_t)v);
}
static char *put_hex(char *p, uint64_t v)
{
    char t[16];
    int n = 0;
    *p++ = '0';
    *p++ = 'x';
    do t[n++] = "0123456789abcdef"[v & 15];
    while ((v >>= 4));
    while (n) *p++ = t[--n];
    return p;
}
static char *put_str(char *p, const char *str)
{
    const size_t n = strlen(str);
    memcpy(p, str, n);
    return p + n;
}

/* One event's line, without its newline, into p (at most LOG_LINE_MAX
 * bytes); returns its end. */
#define LOG_LINE_MAX 160
static char *format_event(char *p, const log_event_t *e)
{
    p = put_u64(p, e->stamp);
    *p++ = ',';
    p = put_i32(p, e->tid);
    *p++ = ',';
    p = e->stream ? put_hex(p, (uint64_t)(uintptr_t)e->stream) : put_str(p, "(nil)");
    p = put_str(p, e->op == OP_ALLOCATE ? ",allocate," : ",free,");
    p = put_hex(p, e->ptr);
    *p++ = ',';
    p = put_u64(p, e->size);
    *p++ = ',';
    return put_str(p, cubuf_status_name((cubuf_status_t)e->status));
}

static cubuf_status_t write_failed(void)
{
    return cubuf__fail(CUBUF_ERROR_SYSTEM, "logging adaptor: cannot write the log: %s", strerror(errno));
}

static cubuf_status_t emit(log_adaptor_t *l, const char *line)
{
    if (l->callback) {
        l->callback(l->user, line);
        return CUBUF_SUCCESS;
    }
    if (fputs(line, l->file) < 0 || fputc('\n', l->file) < 0) return write_failed();
    return CUBUF_SUCCESS;
}

/* Writes n events in time order (a shard's are already, but for threads
 * sharing it); the output lock is held. A file gets them in large writes. */
static cubuf_status_t write_events(log_adaptor_t *l, log_event_t *ev, size_t n)
{
    for (size_t i = 1; i < n; i++)
        if (ev[i].stamp < ev[i - 1].stamp) {
            qsort(ev, n, sizeof *ev, by_stamp);
            break;
        }
    char out[16 * 1024];
    size_t used = 0;
    cubuf_status_t st = CUBUF_SUCCESS;
    for (size_t i = 0; i < n && st == CUBUF_SUCCESS; i++) {
        if (l->callback) {
            char line[LOG_LINE_MAX];
            *format_event(line, &ev[i]) = '\0';
            l->callback(l->user, line);
            continue;
        }
        char *end = format_event(out + used, &ev[i]);
        *end++ = '\n';
        used = (size_t)(end - out);
        if (used > sizeof out - LOG_LINE_MAX) {
            if (fwrite(out, 1, used, l->file) != used) st = write_failed();
            used = 0;
        }
    }
    if (l->file && st == CUBUF_SUCCESS && used && fwrite(out, 1, used, l->file) != used) st = write_failed();
    if (l->file && fflush(l->file) != 0 && st == CUBUF_SUCCESS) st = write_failed();
    return st;
}

/* Writes the queued batches in order (the output lock is held), returning
 * their arrays to the spares. */
static cubuf_status_t write_pending(log_adaptor_t *l)
{
    pthread_mutex_lock(&l->q_lock);
    log_batch_t *b = l->pending;
    l->pending = NULL;
    l->pending_tail = &l->pending;
    l->npending = 0;
    pthread_mutex_unlock(&l->q_lock);
    cubuf_status_t st = CUBUF_SUCCESS;
    while (b) {
        log_batch_t *next = b->next;
        cubuf_status_t wst = write_events(l, b->ev, b->n);
        if (st == CUBUF_SUCCESS) st = wst;
        pthread_mutex_lock(&l->q_lock);
        b->next = l->spares;
        l->spares = b;
        pthread_mutex_unlock(&l->q_lock);
        b = next;
    }
    return st;
}

/* The writer thread: writes batches as shards hand them over. */
static void *writer_main(void *arg)
{
    log_adaptor_t *l = arg;
    for (;;) {
        pthread_mutex_lock(&l->q_lock);
        while (!l->pending && !l->stop) pthread_cond_wait(&l->q_cond, &l->q_lock);
        bool stop = l->stop && !l->pending;
        pthread_mutex_unlock(&l->q_lock);
        if (stop) return NULL;
        pthread_mutex_lock(&l->out_lock);
        if (write_pending(l) != CUBUF_SUCCESS)
            cubuf__warn(CUBUF_ERROR_SYSTEM, "logging adaptor: a write failed: %s", cubuf_last_error());
        pthread_mutex_unlock(&l->out_lock);
    }
}

/* Everything so far: the queued batches, then what the shards hold (each
 * handed over as a batch, or written in place when no array can be had). */
static cubuf_status_t flush(log_adaptor_t *l)
{
    pthread_mutex_lock(&l->out_lock);
    cubuf_status_t st = write_pending(l);
    for (int i = 0; i < LOG_SHARDS; i++) {
        log_shard_t *s = &l->shards[i];
        shard_lock(s);
        if (s->n && !hand_over(l, s, false)) {
            cubuf_status_t wst = write_events(l, s->ev, s->n);
            if (st == CUBUF_SUCCESS) st = wst;
            s->n = 0;
        }
        shard_unlock(s);
    }
    cubuf_status_t wst = write_pending(l);
    if (st == CUBUF_SUCCESS) st = wst;
    pthread_mutex_unlock(&l->out_lock);
    return st;
}

/* Frees what a (partly) made adaptor holds besides the resource. */
static void log_free(log_adaptor_t *l)
{
    for (int i = 0; i < LOG_SHARDS; i++) free(l->shards[i].ev);
    for (log_batch_t *b = l->spares, *next; b; b = next) {
        next = b->next;
        free(b->ev);
        free(b);
    }
    if (l->file) fclose(l->file);
    pthread_cond_destroy(&l->q_cond);
    pthread_mutex_destroy(&l->q_lock);
    pthread_mutex_destroy(&l->out_lock);
}

static void log_destroy(cubuf_resource_t *res)
{
    log_adaptor_t *l = res->impl;
    if (l->writer_started) {
        pthread_mutex_lock(&l->q_lock);
        l->stop = true;
        pthread_cond_signal(&l->q_cond);
        pthread_mutex_unlock(&l->q_lock);
        pthread_join(l->writer, NULL);
    }
    if (flush(l) != CUBUF_SUCCESS)
        cubuf__warn(CUBUF_ERROR_SYSTEM, "logging adaptor: the last flush failed: %s", cubuf_last_error());
    log_free(l);
    cubuf__adaptor_destroy(res);
}

static const cubuf_resource_vtbl_t log_vtbl = {
    .name = "logging adaptor",
    .no_adopt = cubuf__adaptor_no_adopt,
    .passes_stats = true,
    .allocate = log_allocate,
    .deallocate = log_deallocate,
    .destroy = log_destroy,
};

cubuf_status_t cubuf_log_adaptor_create(cubuf_resource_t *upstream, const cubuf_log_options_t *options,
                                        cubuf_resource_t **out)
{
    static const char what[] = "cubuf_log_adaptor_create";
    CHECK_ARG(upstream && options && out, "%s: NULL argument", what);
    cubuf_log_options_t o = CUBUF_LOG_OPTIONS_INIT;
    cubuf_status_t st = cubuf__struct_in(what, "cubuf_log_options_t", &o, sizeof o, options,
                                         CUBUF_LOG_OPTIONS_SIZE_V1);
    if (st != CUBUF_SUCCESS) return st;
    CHECK_ARG(!o.path != !o.callback, "%s: set exactly one of path and callback", what);
    FILE *f = NULL;
    if (o.path && !(f = fopen(o.path, "we"))) {
        int e = errno;
        return cubuf__fail(CUBUF_ERROR_SYSTEM, "%s: cannot open %s: %s", what, o.path, strerror(e));
    }
    cubuf_resource_t *res = NULL;
    if ((st = cubuf__adaptor_new(upstream, &log_vtbl, sizeof(log_adaptor_t), what, &res)) != CUBUF_SUCCESS) {
        if (f) fclose(f);
        return st;
    }
    log_adaptor_t *l = res->impl;
    l->file = f;
    l->callback = o.callback;
    l->user = o.user;
    pthread_mutex_init(&l->out_lock, NULL);
    pthread_mutex_init(&l->q_lock, NULL);
    pthread_cond_init(&l->q_cond, NULL);
    l->pending_tail = &l->pending;
    for (int i = 0; i < LOG_SHARDS && st == CUBUF_SUCCESS; i++)
        if (!(l->shards[i].ev = cubuf__malloc(LOG_SHARD_EVENTS * sizeof(log_event_t))))
            st = cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "%s: cannot allocate the event buffers", what);
    if (st == CUBUF_SUCCESS)
        st = emit(l, "# cubuf log 1: time_ns,thread,stream,operation,pointer,size,status");
    if (st == CUBUF_SUCCESS) {
        int e = pthread_create(&l->writer, NULL, writer_main, l);
        if (e) st = cubuf__fail(CUBUF_ERROR_SYSTEM, "%s: cannot start the writer thread: %s", what, strerror(e));
        l->writer_started = e == 0;
    }
    if (st != CUBUF_SUCCESS) {
        cubuf_resource_release(res); /* log_destroy copes with a part-made adaptor */
        return st;
    }
    *out = res;
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf_log_adaptor_flush(cubuf_resource_t *res)
{
    CHECK_ARG(res && res->vt == &log_vtbl, "cubuf_log_adaptor_flush: not a logging adaptor");
    return flush(res->impl);
}
