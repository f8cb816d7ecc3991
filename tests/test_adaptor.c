/* The raw-pointer interface and the resource adaptors over a host-memory
 * user resource: statistics and scopes, the cap, the log parsed back, the
 * tracker's report, the failure callback's retry, fault injection through
 * each adaptor, and 8 threads through a stack with exact totals. Needs no
 * driver (test_adaptor_gpu has the device parts). */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "test.h"

/* ---- the upstream: host memory, counting what it holds ---- */

typedef struct host_up {
    atomic_long allocs, frees, live, live_bytes, max_live_bytes;
    atomic_long fail_next;  /* > 0: that many allocations fail with OUT_OF_MEMORY */
    atomic_long fail_free;  /* > 0: that many frees fail with CUBUF_ERROR_DRIVER (nothing freed) */
    size_t budget;          /* 0: none; else allocations past budget live bytes fail */
} host_up_t;

static cubuf_status_t up_alloc(void *state, size_t size, CUstream s, CUdeviceptr *p)
{
    (void)s;
    host_up_t *h = state;
    if (atomic_load(&h->fail_next) > 0) {
        atomic_fetch_sub(&h->fail_next, 1);
        return CUBUF_ERROR_OUT_OF_MEMORY;
    }
    if (h->budget && (size_t)atomic_load(&h->live_bytes) + size > h->budget) return CUBUF_ERROR_OUT_OF_MEMORY;
    void *m = malloc(size);
    if (!m) return CUBUF_ERROR_OUT_OF_MEMORY;
    memset(m, 0xab, size < 64 ? size : 64);
    atomic_fetch_add(&h->allocs, 1);
    atomic_fetch_add(&h->live, 1);
    long now = atomic_fetch_add(&h->live_bytes, (long)size) + (long)size;
    long max = atomic_load(&h->max_live_bytes);
    while (now > max && !atomic_compare_exchange_weak(&h->max_live_bytes, &max, now)) {
    }
    *p = (CUdeviceptr)(uintptr_t)m;
    return CUBUF_SUCCESS;
}

static cubuf_status_t up_free(void *state, CUdeviceptr p, size_t size, CUstream s)
{
    (void)s;
    host_up_t *h = state;
    if (atomic_load(&h->fail_free) > 0) {
        atomic_fetch_sub(&h->fail_free, 1);
        return CUBUF_ERROR_DRIVER;
    }
    free((void *)(uintptr_t)p);
    atomic_fetch_add(&h->frees, 1);
    atomic_fetch_sub(&h->live, 1);
    atomic_fetch_sub(&h->live_bytes, (long)size);
    return CUBUF_SUCCESS;
}

static cubuf_resource_t *host_upstream(host_up_t *h)
{
    memset(h, 0, sizeof *h);
    static const cubuf_resource_ops_t ops = {CUBUF_RESOURCE_OPS_VERSION, up_alloc, up_free, NULL};
    cubuf_resource_props_t p = CUBUF_RESOURCE_PROPS_INIT;
    p.host_accessible = true; /* host memory: no stream is ever bound */
    cubuf_resource_t *r = NULL;
    T_REQUIRE(cubuf_resource_create(&ops, &p, h, &r));
    return r;
}

static cubuf_statistics_t stats_of(cubuf_resource_t *r)
{
    cubuf_statistics_t s = CUBUF_STATISTICS_INIT;
    T_OK(cubuf_statistics_get(r, &s));
    return s;
}

#define T_STAT(r, CUR, PEAK, CNT, TCNT, TBYTES)                                        \
    do {                                                                                          \
        cubuf_statistics_t s_ = stats_of(r);                                                      \
        if (s_.current_bytes != (CUR) || s_.peak_bytes != (PEAK) || s_.current_count != (CNT) ||  \
            s_.total_count != (uint64_t)(TCNT) || s_.total_bytes != (uint64_t)(TBYTES)) { \
            fprintf(stderr, "%s:%d: statistics %lld/%lld bytes, %lld live, %llu/%llu total; "     \
                    "expected %lld/%lld, %lld, %llu/%llu\n", __FILE__, __LINE__,                 \
                    (long long)s_.current_bytes, (long long)s_.peak_bytes,                       \
                    (long long)s_.current_count, (unsigned long long)s_.total_count,             \
                    (unsigned long long)s_.total_bytes, (long long)(CUR), (long long)(PEAK),      \
                    (long long)(CNT), (unsigned long long)(TCNT),                            \
                    (unsigned long long)(TBYTES));                                          \
            t_failures++;                                                                         \
        }                                                                                         \
    } while (0)

/* ---- the raw-pointer interface ---- */

static void test_raw(void)
{
    host_up_t h;
    cubuf_resource_t *up = host_upstream(&h);
    CUdeviceptr p = 0, q = 0;
    T_STATUS(cubuf_resource_allocate_raw(NULL, 8, NULL, &p), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_resource_allocate_raw(up, 8, NULL, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_resource_allocate_raw(up, 0, NULL, &p), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(p == 0 && h.allocs == 0);
    T_OK(cubuf_resource_allocate_raw(up, 100, NULL, &p));
    T_OK(cubuf_resource_allocate_raw(up, 300, NULL, &q));
    T_CHECK(p && q && p != q && h.live == 2);
    T_CHECK(((unsigned char *)(uintptr_t)p)[0] == 0xab);
    T_STAT(up, 400, 400, 2, 2, 400);
    T_STATUS(cubuf_resource_deallocate_raw(up, 0, 8, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_resource_deallocate_raw(up, p, 0, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_resource_deallocate_raw(NULL, p, 100, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_OK(cubuf_resource_deallocate_raw(up, p, 100, NULL));
    T_CHECK(h.frees == 1);
    T_STAT(up, 300, 400, 1, 2, 400);
    /* Raw allocations and buffers count alike. */
    cubuf_buffer_t *b = NULL;
    T_OK(cubuf_resource_allocate(up, 50, NULL, &b));
    T_STAT(up, 350, 400, 2, 3, 450);
    cubuf_buffer_release(b);
    T_OK(cubuf_resource_deallocate_raw(up, q, 300, NULL));
    T_CHECK(h.frees == 3 && h.live == 0);
    T_STAT(up, 0, 400, 0, 3, 450);
    cubuf_statistics_t s = stats_of(up);
    T_CHECK(s.current_requested == 0 && s.peak_requested == 400 && s.total_requested == 450);
    cubuf_resource_release(up);
}

/* ---- statistics ---- */

static void test_statistics(void)
{
    host_up_t h;
    cubuf_resource_t *up = host_upstream(&h), *st = NULL;
    T_STATUS(cubuf_statistics_adaptor_create(NULL, &st), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_statistics_adaptor_create(up, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_OK(cubuf_statistics_adaptor_create(up, &st));
    cubuf_resource_props_t pu = CUBUF_RESOURCE_PROPS_INIT, pa = CUBUF_RESOURCE_PROPS_INIT;
    T_OK(cubuf_resource_props(up, &pu));
    T_OK(cubuf_resource_props(st, &pa));
    T_CHECK(memcmp(&pu, &pa, sizeof pu) == 0);
    /* The adaptor holds its upstream: released first here, it lives on. */
    cubuf_resource_release(up);

    cubuf_buffer_t *a = NULL, *b = NULL, *c = NULL;
    T_OK(cubuf_resource_allocate(st, 1000, NULL, &a));
    T_OK(cubuf_resource_allocate(st, 24, NULL, &b));
    T_STAT(st, 1024, 1024, 2, 2, 1024);
    T_OK(cubuf_buffer_close(a));
    T_STAT(st, 24, 1024, 1, 2, 1024);
    T_OK(cubuf_statistics_reset_peaks(st));
    T_STAT(st, 24, 24, 1, 2, 1024);

    /* Scopes: counts from the push; frees of older allocations go negative. */
    T_STATUS(cubuf_statistics_pop(st, NULL), CUBUF_ERROR_OUT_OF_RANGE);
    T_OK(cubuf_statistics_push(st));
    T_STAT(st, 0, 0, 0, 0, 0);
    T_OK(cubuf_resource_allocate(st, 500, NULL, &c));
    T_STAT(st, 500, 500, 1, 1, 500);
    T_OK(cubuf_statistics_push(st));
    T_OK(cubuf_buffer_close(b));
    T_STAT(st, -24, 0, -1, 0, 0);
    cubuf_buffer_t *d = NULL;
    T_OK(cubuf_resource_allocate(st, 100, NULL, &d));
    T_STAT(st, 76, 76, 0, 1, 100);
    cubuf_statistics_t popped = CUBUF_STATISTICS_INIT;
    T_OK(cubuf_statistics_pop(st, &popped));
    T_CHECK(popped.current_bytes == 76 && popped.peak_bytes == 76 && popped.total_count == 1);
    /* Folded into the outer scope: 500 at the push, 576 now, peak 576. */
    T_STAT(st, 576, 576, 1, 2, 600);
    T_OK(cubuf_statistics_pop(st, NULL));
    /* The resource's own figures count everything. */
    T_STAT(st, 600, 600, 2, 4, 1624); /* its peak was reset at 24 */
    cubuf_statistics_t small = {.struct_size = 8};
    T_STATUS(cubuf_statistics_get(st, &small), CUBUF_ERROR_INVALID_ARGUMENT);
    T_OK(cubuf_statistics_push(st)); /* left open: freed with the adaptor */
    T_STATUS(cubuf_statistics_push(up), CUBUF_ERROR_INVALID_ARGUMENT); /* held by st: still alive */
    T_STATUS(cubuf_statistics_push(NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    cubuf_buffer_release(a);
    cubuf_buffer_release(b);
    cubuf_buffer_release(c);
    cubuf_buffer_release(d);
    T_CHECK(h.live == 0 && h.frees == 4);
    cubuf_resource_release(st);
}

/* ---- limiting ---- */

static void test_limit(void)
{
    host_up_t h;
    cubuf_resource_t *up = host_upstream(&h), *lim = NULL;
    T_STATUS(cubuf_limit_adaptor_create(up, SIZE_MAX, &lim), CUBUF_ERROR_INVALID_ARGUMENT);
    T_OK(cubuf_limit_adaptor_create(up, 1000, &lim));
    CUdeviceptr p = 0, q = 0;
    T_OK(cubuf_resource_allocate_raw(lim, 600, NULL, &p));
    T_STATUS(cubuf_resource_allocate_raw(lim, 401, NULL, &q), CUBUF_ERROR_OUT_OF_MEMORY);
    T_CHECK(strstr(cubuf_last_error(), "401 bytes") && strstr(cubuf_last_error(), "cap of 1000 bytes") &&
            strstr(cubuf_last_error(), "600 bytes allocated"));
    T_CHECK(q == 0 && h.allocs == 1); /* the upstream was not asked */
    T_OK(cubuf_resource_allocate_raw(lim, 400, NULL, &q));
    T_STAT(lim, 1000, 1000, 2, 2, 1000);
    cubuf_buffer_t *b = (cubuf_buffer_t *)&b;
    T_STATUS(cubuf_resource_allocate(lim, 1, NULL, &b), CUBUF_ERROR_OUT_OF_MEMORY);
    T_CHECK(b == (cubuf_buffer_t *)&b);
    T_OK(cubuf_resource_deallocate_raw(lim, p, 600, NULL));
    T_OK(cubuf_resource_allocate(lim, 600, NULL, &b));
    /* An upstream failure gives the admitted bytes back. */
    cubuf_buffer_release(b);
    h.fail_next = 1;
    T_STATUS(cubuf_resource_allocate_raw(lim, 600, NULL, &p), CUBUF_ERROR_OUT_OF_MEMORY);
    T_STAT(lim, 400, 1000, 1, 3, 1600);
    T_OK(cubuf_resource_deallocate_raw(lim, q, 400, NULL));
    T_CHECK(h.live == 0);
    cubuf_resource_release(lim);
    cubuf_resource_release(up);
}

typedef struct cap_job {
    cubuf_resource_t *res;
    unsigned seed;
    long refused;
    cubuf_status_t st;
} cap_job_t;

static void *cap_worker(void *arg)
{
    cap_job_t *j = arg;
    CUdeviceptr held[4] = {0};
    size_t sizes[4] = {0};
    for (int i = 0; i < 4000 && j->st == CUBUF_SUCCESS; i++) {
        int k = i % 4;
        if (held[k]) {
            j->st = cubuf_resource_deallocate_raw(j->res, held[k], sizes[k], NULL);
            held[k] = 0;
            continue;
        }
        sizes[k] = 1 + rand_r(&j->seed) % 1024;
        cubuf_status_t st = cubuf_resource_allocate_raw(j->res, sizes[k], NULL, &held[k]);
        if (st == CUBUF_ERROR_OUT_OF_MEMORY) j->refused++;
        else j->st = st;
    }
    for (int k = 0; k < 4; k++)
        if (held[k] && j->st == CUBUF_SUCCESS) j->st = cubuf_resource_deallocate_raw(j->res, held[k], sizes[k], NULL);
    return NULL;
}

/* Concurrent requests never pass the cap together. */
static void test_limit_threads(void)
{
    host_up_t h;
    cubuf_resource_t *up = host_upstream(&h), *lim = NULL;
    T_OK(cubuf_limit_adaptor_create(up, 2048, &lim));
    pthread_t th[8];
    cap_job_t jobs[8];
    for (int i = 0; i < 8; i++) {
        jobs[i] = (cap_job_t){lim, 17u * (unsigned)i + 1, 0, CUBUF_SUCCESS};
        T_CHECK(pthread_create(&th[i], NULL, cap_worker, &jobs[i]) == 0);
    }
    long refused = 0;
    for (int i = 0; i < 8; i++) {
        pthread_join(th[i], NULL);
        T_OK(jobs[i].st);
        refused += jobs[i].refused;
    }
    T_CHECK(h.max_live_bytes <= 2048 && h.live == 0);
    T_CHECK(refused > 0); /* even one thread holding 4 of up to 1024 bytes reaches past 2048 */
    cubuf_statistics_t s = stats_of(lim);
    T_CHECK(s.current_bytes == 0 && s.current_count == 0 && s.peak_bytes <= 2048 &&
            s.total_count == (uint64_t)h.allocs);
    cubuf_resource_release(lim);
    cubuf_resource_release(up);
}

/* ---- logging ---- */

typedef struct lines {
    pthread_mutex_t lock;
    char **v;
    size_t n, cap;
    bool watch;       /* set: count the lines that come on a thread other than `main` */
    pthread_t main;
    size_t off_main;
} lines_t;
#define LINES_INIT {PTHREAD_MUTEX_INITIALIZER, NULL, 0, 0, false, (pthread_t)0, 0}

static void collect(void *user, const char *line)
{
    lines_t *l = user;
    pthread_mutex_lock(&l->lock);
    if (l->watch && !pthread_equal(pthread_self(), l->main)) l->off_main++;
    if (l->n == l->cap) {
        l->cap = l->cap ? 2 * l->cap : 64;
        l->v = realloc(l->v, l->cap * sizeof *l->v);
    }
    l->v[l->n++] = strdup(line);
    pthread_mutex_unlock(&l->lock);
}

static void lines_free(lines_t *l)
{
    for (size_t i = 0; i < l->n; i++) free(l->v[i]);
    free(l->v);
    memset(l, 0, sizeof *l);
}

typedef struct log_line {
    unsigned long long order;
    long long time;
    int tid;
    void *stream;
    char op[16];
    unsigned long long ptr;
    size_t size;
    char status[40];
} log_line_t;

static bool parse(const char *s, log_line_t *e)
{
    return sscanf(s, "%llu,%lld,%d,%p,%15[a-z],0x%llx,%zu,%39s", &e->order, &e->time, &e->tid, &e->stream,
                  e->op, &e->ptr, &e->size, e->status) == 8;
}

/* The successful events of a log, sorted by order, ties in the log's order. */
typedef struct sorted_line {
    log_line_t e;
    size_t at;
} sorted_line_t;

static int by_order(const void *a, const void *b)
{
    const sorted_line_t *x = a, *y = b;
    if (x->e.order != y->e.order) return x->e.order < y->e.order ? -1 : 1;
    return x->at < y->at ? -1 : x->at > y->at;
}

static sorted_line_t *sorted_lines(const lines_t *l, size_t *n)
{
    sorted_line_t *v = calloc(l->n ? l->n : 1, sizeof *v);
    *n = 0;
    for (size_t i = 1; v && i < l->n; i++)
        if (parse(l->v[i], &v[*n].e) && strcmp(v[*n].e.status, "CUBUF_SUCCESS") == 0) v[*n].at = i, (*n)++;
    if (v) qsort(v, *n, sizeof *v, by_order);
    return v;
}

/* In order, every pointer is allocated, freed, allocated, ... (a pointer
 * the upstream hands out again, on any thread, comes after its free), and
 * nothing is left allocated; `want` events succeeded. */
static bool pointers_alternate(const lines_t *l, size_t want)
{
    size_t n = 0, cap = 64;
    sorted_line_t *v = sorted_lines(l, &n);
    while (cap < 4 * n) cap *= 2;
    unsigned long long *live = calloc(cap, sizeof *live);
    bool ok = v && live && n == want;
    size_t outstanding = 0;
    for (size_t i = 0; ok && i < n; i++) {
        const unsigned long long p = v[i].e.ptr;
        size_t k = (size_t)(p * 0x9E3779B97F4A7C15ull >> 20) & (cap - 1);
        for (; live[k]; k = (k + 1) & (cap - 1))
            if (live[k] == p) break;
        const bool alloc = strcmp(v[i].e.op, "allocate") == 0, was = live[k] == p;
        if (alloc == was) {
            printf("  order %llu: %s of 0x%llx, which is %s\n", v[i].e.order, v[i].e.op, p,
                   was ? "allocated" : "not allocated");
            ok = false;
        } else if (alloc) {
            live[k] = p, outstanding++;
        } else { /* tombstone: a value no pointer has */
            live[k] = 1, outstanding--;
        }
    }
    ok = ok && outstanding == 0;
    free(live);
    free(v);
    return ok;
}

/* A logging adaptor over `up` whose lines go to `got`. */
static cubuf_resource_t *collecting_log(cubuf_resource_t *up, lines_t *got)
{
    cubuf_log_options_t o = CUBUF_LOG_OPTIONS_INIT;
    o.callback = collect;
    o.user = got;
    cubuf_resource_t *lg = NULL;
    T_OK(cubuf_log_adaptor_create(up, &o, &lg));
    return lg;
}

static void test_log_callback(void)
{
    host_up_t h;
    cubuf_resource_t *up = host_upstream(&h), *lg = NULL;
    lines_t got = LINES_INIT;
    cubuf_log_options_t o = CUBUF_LOG_OPTIONS_INIT;
    T_STATUS(cubuf_log_adaptor_create(up, &o, &lg), CUBUF_ERROR_INVALID_ARGUMENT); /* neither */
    o.path = "/tmp/x";
    o.callback = collect;
    T_STATUS(cubuf_log_adaptor_create(up, &o, &lg), CUBUF_ERROR_INVALID_ARGUMENT); /* both */
    o.path = NULL;
    o.user = &got;
    /* A ring of 0 (the default) or a power of two from 128 to 2^24 events. */
    const size_t bad_rings[] = {1, 64, 100, 3000, (size_t)1 << 25, SIZE_MAX};
    for (size_t i = 0; i < sizeof bad_rings / sizeof bad_rings[0]; i++) {
        o.ring_events = bad_rings[i];
        lg = NULL;
        T_STATUS(cubuf_log_adaptor_create(up, &o, &lg), CUBUF_ERROR_INVALID_ARGUMENT);
        T_CHECK(lg == NULL && strstr(cubuf_last_error(), "ring_events"));
    }
    T_CHECK(got.n == 0); /* nothing was written for them */
    const size_t good_rings[] = {128, (size_t)1 << 24}; /* the ends: made, no ring allocated yet */
    for (size_t i = 0; i < sizeof good_rings / sizeof good_rings[0]; i++) {
        o.ring_events = good_rings[i];
        T_OK(cubuf_log_adaptor_create(up, &o, &lg));
        cubuf_resource_release(lg);
    }
    T_CHECK(got.n == 2); /* their header lines */
    lines_free(&got);
    got = (lines_t)LINES_INIT;
    o.ring_events = 2048; /* the 5000 pairs below pass it */
    T_OK(cubuf_log_adaptor_create(up, &o, &lg));
    T_CHECK(got.n == 1 && got.v[0][0] == '#');
    CUdeviceptr p = 0;
    T_OK(cubuf_resource_allocate_raw(lg, 123, (CUstream)(uintptr_t)0x40, &p));
    h.fail_next = 1;
    CUdeviceptr q = 0;
    T_STATUS(cubuf_resource_allocate_raw(lg, 77, NULL, &q), CUBUF_ERROR_OUT_OF_MEMORY);
    T_OK(cubuf_resource_deallocate_raw(lg, p, 123, (CUstream)(uintptr_t)0x80));
    T_OK(cubuf_log_adaptor_flush(lg));
    T_CHECK(got.n == 4);
    log_line_t e[3];
    for (int i = 0; i < 3 && got.n == 4; i++) T_CHECK(parse(got.v[1 + i], &e[i]));
    if (got.n == 4) {
        T_CHECK(strcmp(e[0].op, "allocate") == 0 && e[0].ptr == p && e[0].size == 123 &&
                e[0].stream == (void *)0x40 && strcmp(e[0].status, "CUBUF_SUCCESS") == 0);
        T_CHECK(strcmp(e[1].op, "allocate") == 0 && e[1].ptr == 0 && e[1].size == 77 &&
                strcmp(e[1].status, "CUBUF_ERROR_OUT_OF_MEMORY") == 0);
        T_CHECK(strcmp(e[2].op, "free") == 0 && e[2].ptr == p && e[2].stream == (void *)0x80);
        T_CHECK(e[0].time <= e[1].time && e[1].time <= e[2].time && e[0].tid == e[2].tid &&
                e[0].tid > 0);
        /* Both allocations saw no free; the free is numbered after them. */
        T_CHECK(e[0].order == 0 && e[1].order == 0 && e[2].order == 1);
    }
    T_STATUS(cubuf_log_adaptor_flush(up), CUBUF_ERROR_INVALID_ARGUMENT);
    /* The writer thread writes events with no flush asked for (fewer than
     * would fill the ring, so this thread never writes them itself). */
    pthread_mutex_lock(&got.lock);
    got.watch = true;
    got.main = pthread_self();
    pthread_mutex_unlock(&got.lock);
    for (int i = 0; i < 100; i++) {
        T_OK(cubuf_resource_allocate_raw(lg, 8, NULL, &p));
        T_OK(cubuf_resource_deallocate_raw(lg, p, 8, NULL));
    }
    size_t out = 0, off_main = 0;
    for (int i = 0; i < 2000 && out < 4 + 200; i++) {
        pthread_mutex_lock(&got.lock);
        out = got.n;
        off_main = got.off_main;
        pthread_mutex_unlock(&got.lock);
        if (out < 4 + 200) usleep(5000);
    }
    T_CHECK(out == 4 + 200 && off_main == 200);
    /* More events than one thread's ring holds. */
    for (int i = 0; i < 5000; i++) {
        T_OK(cubuf_resource_allocate_raw(lg, 8, NULL, &p));
        T_OK(cubuf_resource_deallocate_raw(lg, p, 8, NULL));
    }
    cubuf_resource_release(lg); /* the last flush */
    T_CHECK(got.n == 4 + 200 + 10000);
    /* One thread: its lines come out in its order, order and time never go back. */
    long long last = 0;
    unsigned long long last_order = 0;
    bool ordered = true;
    for (size_t i = 4; i < got.n; i++) {
        log_line_t x;
        if (!parse(got.v[i], &x) || x.time < last || x.order < last_order) ordered = false;
        last = x.time;
        last_order = x.order;
    }
    T_CHECK(ordered);
    T_CHECK(pointers_alternate(&got, got.n - 2)); /* all but the failed allocation */
    T_CHECK(h.live == 0);
    lines_free(&got);
    cubuf_resource_release(up);
}

/* A line callback that flushes its own adaptor: told CUBUF_ERROR_BUSY (the
 * flush would wait for the lock the write holds), on the writer thread
 * (waited for, no flush asked), on a thread whose flush writes and at the
 * last release; another adaptor's flush from it works. */
typedef struct reentrant {
    _Atomic(cubuf_resource_t *) self, other;
    atomic_int calls, busy, other_ok, off_main;
    pthread_t main;
} reentrant_t;

static void flush_self(void *user, const char *line)
{
    (void)line;
    reentrant_t *r = user;
    cubuf_resource_t *self = atomic_load(&r->self), *other = atomic_load(&r->other);
    if (self && cubuf_log_adaptor_flush(self) == CUBUF_ERROR_BUSY) atomic_fetch_add(&r->busy, 1);
    if (other && cubuf_log_adaptor_flush(other) == CUBUF_SUCCESS) atomic_fetch_add(&r->other_ok, 1);
    if (!pthread_equal(pthread_self(), r->main)) atomic_fetch_add(&r->off_main, 1);
    atomic_fetch_add(&r->calls, 1);
}

static void test_log_callback_flush(void)
{
    host_up_t h;
    cubuf_resource_t *up = host_upstream(&h);
    lines_t got = LINES_INIT;
    cubuf_resource_t *other = collecting_log(up, &got);
    reentrant_t r;
    atomic_init(&r.self, NULL);
    atomic_init(&r.other, NULL);
    atomic_init(&r.calls, 0);
    atomic_init(&r.busy, 0);
    atomic_init(&r.other_ok, 0);
    atomic_init(&r.off_main, 0);
    r.main = pthread_self();
    cubuf_log_options_t o = CUBUF_LOG_OPTIONS_INIT;
    o.callback = flush_self;
    o.user = &r;
    cubuf_resource_t *lg = NULL;
    T_OK(cubuf_log_adaptor_create(up, &o, &lg));
    T_CHECK(atomic_load(&r.calls) == 1); /* the header line, before self is known */
    atomic_store(&r.self, lg);
    atomic_store(&r.other, other);
    /* The writer thread writes these (no flush asked). */
    CUdeviceptr p = 0;
    T_OK(cubuf_resource_allocate_raw(lg, 64, NULL, &p));
    T_OK(cubuf_resource_deallocate_raw(lg, p, 64, NULL));
    for (int i = 0; i < 2000 && atomic_load(&r.calls) < 3; i++) usleep(5000);
    T_CHECK(atomic_load(&r.calls) == 3 && atomic_load(&r.busy) == 2 &&
            atomic_load(&r.other_ok) == 2 && atomic_load(&r.off_main) == 2);
    /* No event is left to write: no callback runs until the next one. */
    atomic_store(&r.other, NULL);
    cubuf_resource_release(other);
    /* This thread's flush or the writer writes this one, the last release the next. */
    T_OK(cubuf_resource_allocate_raw(lg, 64, NULL, &p));
    T_OK(cubuf_log_adaptor_flush(lg));
    T_CHECK(atomic_load(&r.calls) == 4 && atomic_load(&r.busy) == 3);
    T_OK(cubuf_resource_deallocate_raw(lg, p, 64, NULL));
    cubuf_resource_release(lg);
    T_CHECK(atomic_load(&r.calls) == 5 && atomic_load(&r.busy) == 4);
    T_CHECK(h.live == 0);
    lines_free(&got);
    cubuf_resource_release(up);
}

/* A writer slower than the program: a thread whose ring is full waits for
 * it, so the events made and not yet written never pass the ring's size
 * (2048 events here: the log's memory stays bounded), and every event
 * still reaches the callback once. The writer's callback returns only once
 * the program has made no event for 20 ms (or is done), so it is the
 * slower one on any machine. */
typedef struct slow_lines {
    atomic_long lines, last_event_ms;
    atomic_bool done;
} slow_lines_t;

static long now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

static void slow_collect(void *user, const char *line)
{
    (void)line;
    slow_lines_t *s = user;
    atomic_fetch_add(&s->lines, 1);
    while (!atomic_load(&s->done) && now_ms() - atomic_load(&s->last_event_ms) < 20) usleep(1000);
}

static void test_log_backpressure(void)
{
    host_up_t h;
    cubuf_resource_t *up = host_upstream(&h), *lg = NULL;
    slow_lines_t s = {0};
    atomic_store(&s.last_event_ms, now_ms());
    cubuf_log_options_t o = CUBUF_LOG_OPTIONS_INIT;
    o.callback = slow_collect;
    o.user = &s;
    o.ring_events = 2048;
    T_OK(cubuf_log_adaptor_create(up, &o, &lg));
    const long header = atomic_load(&s.lines); /* written at create */
    long most = 0, pairs;
    for (pairs = 1; pairs <= 1500; pairs++) {
        CUdeviceptr p = 0;
        T_OK(cubuf_resource_allocate_raw(lg, 8, NULL, &p));
        T_OK(cubuf_resource_deallocate_raw(lg, p, 8, NULL));
        if (pairs % 16) continue;
        atomic_store(&s.last_event_ms, now_ms());
        const long unwritten = 2 * pairs - (atomic_load(&s.lines) - header); /* lines begun count */
        if (unwritten > most) most = unwritten;
    }
    atomic_store(&s.done, true);
    printf("  backpressure: at most %ld of %ld events made and not yet written\n", most, 2 * (pairs - 1));
    T_CHECK(most > 1024 && most <= 2048); /* the ring filled, and held */
    cubuf_resource_release(lg);
    T_CHECK(atomic_load(&s.lines) == header + 2 * (pairs - 1));
    T_CHECK(h.live == 0);
    cubuf_resource_release(up);
}

/* Times: read at the event with precise_time (between the clock read
 * before and after it), else the writer's (never after the event, never
 * before the adaptor was made, never back within a thread). An options
 * struct of the first version's size (no precise_time) is taken. */
static long long mono_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void test_log_time(void)
{
    for (int precise = 0; precise < 3; precise++) {
        host_up_t h;
        cubuf_resource_t *up = host_upstream(&h), *lg = NULL;
        lines_t got = LINES_INIT;
        cubuf_log_options_t o = CUBUF_LOG_OPTIONS_INIT;
        o.callback = collect;
        o.user = &got;
        o.precise_time = precise == 1;
        if (precise == 2) o.struct_size = CUBUF_LOG_OPTIONS_SIZE_V1;
        const long long made = mono_now();
        T_OK(cubuf_log_adaptor_create(up, &o, &lg));
        enum { N = 300 };
        long long before[N], after[N];
        for (int i = 0; i < N; i++) {
            CUdeviceptr p = 0;
            before[i] = mono_now();
            T_OK(cubuf_resource_allocate_raw(lg, 32, NULL, &p));
            after[i] = mono_now();
            T_OK(cubuf_resource_deallocate_raw(lg, p, 32, NULL));
            if (i % 100 == 99) usleep(3000); /* the writer's clock moves on */
        }
        T_OK(cubuf_log_adaptor_flush(lg));
        T_CHECK(got.n == 1 + 2 * N);
        int bad = 0;
        long long last = 0;
        for (int i = 0; i < N && got.n == 1 + 2 * N; i++) {
            log_line_t e;
            T_CHECK(parse(got.v[1 + 2 * i], &e) && strcmp(e.op, "allocate") == 0);
            if (precise == 1 ? e.time < before[i] || e.time > after[i]
                             : e.time < made || e.time > after[i] || e.time < last)
                bad++;
            last = e.time;
        }
        printf("  %s time: %d of %d allocations out of bounds\n", precise == 1 ? "precise" : "writer's",
               bad, N);
        T_CHECK(bad == 0);
        cubuf_resource_release(lg);
        lines_free(&got);
        T_CHECK(h.live == 0);
        cubuf_resource_release(up);
    }
}

/* Threads that come and go: each logs through the adaptor and exits; the
 * later ones take over the rings of those gone. Every event reaches the
 * log once, in order per pointer. */
typedef struct churn_job {
    cubuf_resource_t *log;
    cubuf_status_t st;
} churn_job_t;

static void *churn_worker(void *arg)
{
    churn_job_t *j = arg;
    for (int i = 0; i < 500 && j->st == CUBUF_SUCCESS; i++) {
        CUdeviceptr p = 0;
        if ((j->st = cubuf_resource_allocate_raw(j->log, 64 + (size_t)i, NULL, &p)) == CUBUF_SUCCESS)
            j->st = cubuf_resource_deallocate_raw(j->log, p, 64 + (size_t)i, NULL);
    }
    return NULL;
}

static void test_log_thread_churn(void)
{
    host_up_t h;
    cubuf_resource_t *up = host_upstream(&h);
    lines_t got = LINES_INIT;
    cubuf_resource_t *lg = collecting_log(up, &got);
    for (int wave = 0; wave < 6; wave++) {
        pthread_t th[4];
        churn_job_t jobs[4];
        for (int i = 0; i < 4; i++) {
            jobs[i] = (churn_job_t){lg, CUBUF_SUCCESS};
            T_CHECK(pthread_create(&th[i], NULL, churn_worker, &jobs[i]) == 0);
        }
        for (int i = 0; i < 4; i++) {
            pthread_join(th[i], NULL);
            T_OK(jobs[i].st);
        }
    }
    cubuf_resource_release(lg);
    T_CHECK(got.n == 1 + 6 * 4 * 1000);
    T_CHECK(pointers_alternate(&got, 6 * 4 * 1000));
    lines_free(&got);
    T_CHECK(h.live == 0);
    cubuf_resource_release(up);
}

/* The smallest rings (128 entries) under pressure, where one event may take
 * three entries (a time note with precise_time, a status note when it
 * fails, the event) and rings change hands: waves of threads that come and
 * go, a writer slowed now and then, allocations that fail (size % 7 == 0)
 * and frees that fail (size % 11 == 0). Each line must name its worker's
 * thread (the worker is in the stream), carry its own status, and keep its
 * worker's times in order; every event is there once. */
typedef struct note_job {
    cubuf_resource_t *log;
    int worker;
    int tid;
    bool ok; /* every status as expected */
} note_job_t;

#define NOTE_WORKERS 4
#define NOTE_WAVES 5
#define NOTE_ROUNDS 300

static cubuf_status_t note_alloc(void *state, size_t size, CUstream s, CUdeviceptr *p)
{
    (void)state, (void)s;
    if (size % 7 == 0) return CUBUF_ERROR_OUT_OF_MEMORY;
    *p = (CUdeviceptr)size;
    return CUBUF_SUCCESS;
}
static cubuf_status_t note_free(void *state, CUdeviceptr p, size_t size, CUstream s)
{
    (void)state, (void)p, (void)s;
    return size % 11 == 0 ? CUBUF_ERROR_DRIVER : CUBUF_SUCCESS;
}

static void slow_collect_some(void *user, const char *line)
{
    lines_t *l = user;
    collect(l, line);
    if (l->n % 97 == 0) usleep(200); /* the rings fill meanwhile */
}

static void *note_worker(void *arg)
{
    note_job_t *j = arg;
    j->tid = (int)syscall(SYS_gettid);
    CUstream s = (CUstream)(uintptr_t)(0x1000 + j->worker);
    for (int i = 1; i <= NOTE_ROUNDS; i++) {
        const size_t size = (size_t)j->worker * 100000 + (size_t)i;
        CUdeviceptr p = 0;
        cubuf_status_t st = cubuf_resource_allocate_raw(j->log, size, s, &p);
        if (st != (size % 7 == 0 ? CUBUF_ERROR_OUT_OF_MEMORY : CUBUF_SUCCESS)) j->ok = false;
        if (st != CUBUF_SUCCESS) continue;
        st = cubuf_resource_deallocate_raw(j->log, p, size, s);
        if (st != (size % 11 == 0 ? CUBUF_ERROR_DRIVER : CUBUF_SUCCESS)) j->ok = false;
    }
    return NULL;
}

static void test_log_notes_small_rings(void)
{
    static const cubuf_resource_ops_t ops = {CUBUF_RESOURCE_OPS_VERSION, note_alloc, note_free, NULL};
    cubuf_resource_t *up = NULL;
    T_REQUIRE(cubuf_resource_create(&ops, NULL, NULL, &up));
    for (int precise = 0; precise < 2; precise++) {
        lines_t got = LINES_INIT;
        cubuf_log_options_t o = CUBUF_LOG_OPTIONS_INIT;
        o.callback = slow_collect_some;
        o.user = &got;
        o.ring_events = 128;
        o.precise_time = precise;
        cubuf_resource_t *lg = NULL;
        T_REQUIRE(cubuf_log_adaptor_create(up, &o, &lg));
        int tids[NOTE_WAVES * NOTE_WORKERS];
        size_t expected = 0;
        for (int wave = 0; wave < NOTE_WAVES; wave++) {
            pthread_t th[NOTE_WORKERS];
            note_job_t jobs[NOTE_WORKERS];
            for (int k = 0; k < NOTE_WORKERS; k++) {
                jobs[k] = (note_job_t){lg, wave * NOTE_WORKERS + k, 0, true};
                T_CHECK(pthread_create(&th[k], NULL, note_worker, &jobs[k]) == 0);
            }
            for (int k = 0; k < NOTE_WORKERS; k++) {
                pthread_join(th[k], NULL);
                T_CHECK(jobs[k].ok);
                tids[jobs[k].worker] = jobs[k].tid;
            }
        }
        for (int w = 0; w < NOTE_WAVES * NOTE_WORKERS; w++)
            for (int i = 1; i <= NOTE_ROUNDS; i++) expected += ((size_t)w * 100000 + (size_t)i) % 7 ? 2 : 1;
        cubuf_resource_release(lg); /* the last flush */
        T_CHECK(got.n == 1 + expected);
        long long last_time[NOTE_WAVES * NOTE_WORKERS] = {0};
        size_t wrong_tid = 0, wrong_status = 0, back_in_time = 0, unparsed = 0;
        for (size_t i = 1; i < got.n; i++) {
            log_line_t e;
            if (!parse(got.v[i], &e) || (uintptr_t)e.stream < 0x1000 ||
                (uintptr_t)e.stream >= 0x1000 + NOTE_WAVES * NOTE_WORKERS) {
                unparsed++;
                continue;
            }
            const int worker = (int)((uintptr_t)e.stream - 0x1000);
            const bool is_free = strcmp(e.op, "free") == 0;
            const bool fails = is_free ? e.size % 11 == 0 : e.size % 7 == 0;
            const char *want = !fails ? "CUBUF_SUCCESS"
                               : is_free ? "CUBUF_ERROR_DRIVER"
                                         : "CUBUF_ERROR_OUT_OF_MEMORY";
            if (e.tid != tids[worker]) wrong_tid++;
            if (strcmp(e.status, want) != 0 || e.size / 100000 != (size_t)worker) wrong_status++;
            if (e.time < last_time[worker]) back_in_time++;
            last_time[worker] = e.time;
        }
        printf("  small rings%s: %zu lines, %zu unparsed, %zu with another thread, %zu with another "
               "status, %zu back in time\n",
               precise ? ", precise time" : "", got.n - 1, unparsed, wrong_tid, wrong_status, back_in_time);
        T_CHECK(unparsed == 0 && wrong_tid == 0 && wrong_status == 0 && back_in_time == 0);
        lines_free(&got);
    }
    cubuf_resource_release(up);
}

/* Every field as printf writes it, across the digit counts: a resource
 * that hands out the size as the pointer (never touched), sizes and
 * streams at each power of ten and of two and next to them. */
static cubuf_status_t fake_alloc(void *state, size_t size, CUstream s, CUdeviceptr *p)
{
    (void)state, (void)s;
    *p = (CUdeviceptr)size;
    return CUBUF_SUCCESS;
}
static cubuf_status_t fake_free(void *state, CUdeviceptr p, size_t size, CUstream s)
{
    (void)state, (void)p, (void)size, (void)s;
    return CUBUF_SUCCESS;
}

static void test_log_fields(void)
{
    static const cubuf_resource_ops_t ops = {CUBUF_RESOURCE_OPS_VERSION, fake_alloc, fake_free, NULL};
    cubuf_resource_t *up = NULL;
    T_REQUIRE(cubuf_resource_create(&ops, NULL, NULL, &up));
    lines_t got = LINES_INIT;
    cubuf_resource_t *lg = collecting_log(up, &got);
    uint64_t v[3 * 64 + 3 * 20 + 1], n = 0;
    for (uint64_t b = 1; b; b <<= 1) v[n++] = b - 1, v[n++] = b, v[n++] = b + 1;
    v[n++] = UINT64_MAX;
    uint64_t ten = 1;
    for (int k = 0; k < 20; k++, ten *= 10) v[n++] = ten - 1, v[n++] = ten, v[n++] = ten + 1;
    size_t made = 0;
    for (uint64_t i = 0; i < n; i++) {
        if (!v[i]) continue; /* no size 0, no pointer 0 */
        CUdeviceptr p = 0;
        const uint64_t sv = v[(i * 7) % n];
        CUstream s = (CUstream)(uintptr_t)(sv > 2 ? sv : 0x40 + sv); /* 0, 1, 2 are default streams */
        T_OK(cubuf_resource_allocate_raw(lg, (size_t)v[i], s, &p));
        T_OK(cubuf_resource_deallocate_raw(lg, p, (size_t)v[i], s));
        made++;
    }
    cubuf_resource_release(lg);
    T_CHECK(got.n == 1 + 2 * made);
    int bad = 0;
    for (size_t i = 1; i < got.n; i++) {
        log_line_t e;
        char want[256];
        if (!parse(got.v[i], &e)) {
            bad++;
            continue;
        }
        snprintf(want, sizeof want, "%llu,%lld,%d,%p,%s,0x%llx,%zu,%s", e.order, e.time, e.tid, e.stream,
                 e.op, e.ptr, e.size, e.status);
        if (strcmp(want, got.v[i]) != 0 || e.ptr != e.size) {
            if (bad < 5) printf("  line %zu: %s, printf: %s\n", i, got.v[i], want);
            bad++;
        }
    }
    T_CHECK(bad == 0);
    lines_free(&got);
    cubuf_resource_release(up);
}

/* A child of fork() logs under its own thread id, not the one its
 * thread's cache held in the parent (the parent has logged already). */
static char fork_line[256];
static void keep_line(void *user, const char *line)
{
    (void)user;
    if (line[0] != '#') snprintf(fork_line, sizeof fork_line, "%s", line);
}

static void test_log_fork_thread_id(void)
{
    host_up_t h;
    cubuf_resource_t *up = host_upstream(&h);
    lines_t got = LINES_INIT;
    cubuf_resource_t *lg = collecting_log(up, &got);
    CUdeviceptr p = 0;
    T_OK(cubuf_resource_allocate_raw(lg, 8, NULL, &p)); /* the parent's id is cached now */
    T_OK(cubuf_resource_deallocate_raw(lg, p, 8, NULL));
    cubuf_resource_release(lg);
    fflush(stdout);
    pid_t child = fork();
    if (child == 0) { /* a new adaptor in the child: its own writer thread */
        cubuf_log_options_t o = CUBUF_LOG_OPTIONS_INIT;
        o.callback = keep_line;
        cubuf_resource_t *clg = NULL;
        if (cubuf_log_adaptor_create(up, &o, &clg) != CUBUF_SUCCESS ||
            cubuf_resource_allocate_raw(clg, 8, NULL, &p) != CUBUF_SUCCESS)
            _exit(2);
        cubuf_resource_release(clg); /* the allocation stays: the child exits */
        log_line_t e;
        _exit(parse(fork_line, &e) && e.tid == (int)getpid() ? 0 : 1);
    }
    int status = -1;
    T_CHECK(child > 0 && waitpid(child, &status, 0) == child);
    T_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    T_CHECK(got.n == 3);
    lines_free(&got);
    cubuf_resource_release(up);
}

static void test_log_file(void)
{
    host_up_t h;
    cubuf_resource_t *up = host_upstream(&h), *lg = NULL;
    char path[] = "/tmp/cubuf_log_XXXXXX";
    int fd = mkstemp(path);
    T_CHECK(fd >= 0);
    close(fd);
    cubuf_log_options_t o = CUBUF_LOG_OPTIONS_INIT;
    o.path = "/nonexistent-dir/log";
    T_STATUS(cubuf_log_adaptor_create(up, &o, &lg), CUBUF_ERROR_SYSTEM);
    T_CHECK(strstr(cubuf_last_error(), "/nonexistent-dir/log") != NULL);
    o.path = path;
    T_OK(cubuf_log_adaptor_create(up, &o, &lg));
    cubuf_buffer_t *b = NULL;
    T_OK(cubuf_resource_allocate(lg, 4096, NULL, &b));
    CUdeviceptr p = cubuf_buffer_ptr(b);
    cubuf_buffer_release(b);
    cubuf_resource_release(lg);
    FILE *f = fopen(path, "r");
    T_CHECK(f != NULL);
    char line[256];
    int n = 0;
    log_line_t e[2];
    while (f && fgets(line, sizeof line, f)) {
        if (n > 0 && n <= 2) T_CHECK(parse(line, &e[n - 1]));
        n++;
    }
    if (f) fclose(f);
    T_CHECK(n == 3);
    if (n == 3)
        T_CHECK(e[0].ptr == p && e[1].ptr == p && e[0].size == 4096 && strcmp(e[1].op, "free") == 0);
    unlink(path);
    cubuf_resource_release(up);
}

/* A log whose writes fail (a full device), with events that have no ring
 * (its memory refused), writes each event at once on the allocating
 * thread: the failed write is a warning, and cubuf_last_error still says
 * why the allocation failed (the log's write replaced it). */
static void test_log_write_failure_keeps_detail(void)
{
    host_up_t h;
    cubuf_resource_t *up = host_upstream(&h), *lg = NULL;
    cubuf_log_options_t o = CUBUF_LOG_OPTIONS_INIT;
    o.path = "/dev/full";
    T_REQUIRE(cubuf_log_adaptor_create(up, &o, &lg));
    t_warnings_t w = {0};
    cubuf_set_warning_handler(t_warning, &w);
    int alone = 0, replaced = 0;
    for (int i = 0; i < 1000; i++) {
        atomic_store(&h.fail_next, 1);
        cubuf_fault_fail_alloc_nth(1); /* the event's ring */
        CUdeviceptr p = 0;
        const cubuf_status_t st = cubuf_resource_allocate_raw(lg, 64, NULL, &p);
        alone += cubuf_fault_fired_alloc();
        cubuf_fault_reset();
        T_CHECK(st == CUBUF_ERROR_OUT_OF_MEMORY);
        replaced += strstr(cubuf_last_error(), "user resource") == NULL;
    }
    T_CHECK(alone == 1000 && replaced == 0);
    T_CHECK(w.n > 0 && strstr(w.last, "its events are lost") != NULL);
    cubuf_resource_release(lg); /* its last flush fails too: a warning */
    cubuf_set_warning_handler(NULL, NULL);
    cubuf_resource_release(up);
}

/* ---- tracking ---- */

static void test_tracking(void)
{
    host_up_t h;
    cubuf_resource_t *up = host_upstream(&h), *tr = NULL;
    T_OK(cubuf_tracking_adaptor_create(up, true, &tr));
    CUdeviceptr p = 0, q = 0;
    T_OK(cubuf_resource_allocate_raw(tr, 100, NULL, &p));
    T_OK(cubuf_resource_allocate_raw(tr, 200, NULL, &q));
    size_t n = 0, bytes = 0;
    T_OK(cubuf_tracking_outstanding(tr, &n, &bytes));
    T_CHECK(n == 2 && bytes == 300);
    /* A pointer or size it did not hand out: refused, the upstream untouched. */
    T_STATUS(cubuf_resource_deallocate_raw(tr, p + 8, 100, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_resource_deallocate_raw(tr, p, 99, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(strstr(cubuf_last_error(), "not an outstanding allocation") != NULL);
    T_CHECK(h.frees == 0);
    cubuf_buffer_t *b = (cubuf_buffer_t *)&b;
    T_STATUS(cubuf_buffer_wrap(p, 100, tr, NULL, &b), CUBUF_ERROR_INVALID_ARGUMENT);
    /* The report: totals, each allocation, its backtrace. */
    char *text = NULL;
    size_t len = 0;
    FILE *mem = open_memstream(&text, &len);
    T_OK(cubuf_tracking_report(tr, mem));
    fclose(mem);
    char hex[32];
    snprintf(hex, sizeof hex, "0x%llx 100 bytes", (unsigned long long)p);
    T_CHECK(text && strstr(text, "2 outstanding allocations, 300 bytes") && strstr(text, hex) &&
            strstr(text, "    ")); /* frames */
    free(text);
    T_OK(cubuf_resource_deallocate_raw(tr, p, 100, NULL));
    T_OK(cubuf_tracking_outstanding(tr, &n, &bytes));
    T_CHECK(n == 1 && bytes == 200);
    T_STATUS(cubuf_tracking_outstanding(up, &n, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    /* Released with one outstanding: reported as a warning. */
    t_warnings_t w = {0};
    cubuf_set_warning_handler(t_warning, &w);
    cubuf_resource_release(tr);
    cubuf_set_warning_handler(NULL, NULL);
    T_CHECK(w.n == 2 && strstr(w.first, "1 allocation (200 bytes) outstanding"));
    snprintf(hex, sizeof hex, "0x%llx, 200 bytes", (unsigned long long)q);
    T_CHECK(strstr(w.last, hex) && strstr(w.last, "\n    ")); /* with its frames */
    T_CHECK(h.frees == 1 && h.live == 1); /* the caller's leak stays the caller's */
    T_OK(up_free(&h, q, 200, NULL));
    cubuf_resource_release(up);
}

/* Released with many outstanding: every one is reported, none left out. */
static void test_tracking_release_all(void)
{
    host_up_t h;
    cubuf_resource_t *up = host_upstream(&h), *tr = NULL;
    T_OK(cubuf_tracking_adaptor_create(up, false, &tr));
    enum { N = 40 };
    CUdeviceptr p[N];
    for (int i = 0; i < N; i++) T_OK(cubuf_resource_allocate_raw(tr, 64 + (size_t)i, NULL, &p[i]));
    t_warnings_t w = {0};
    cubuf_set_warning_handler(t_warning, &w);
    cubuf_resource_release(tr);
    cubuf_set_warning_handler(NULL, NULL);
    T_CHECK(w.n == 1 + N && strstr(w.first, "40 allocations (") && strstr(w.last, "  outstanding: 0x"));
    for (int i = 0; i < N; i++) T_OK(up_free(&h, p[i], 64 + (size_t)i, NULL));
    T_CHECK(h.live == 0);
    cubuf_resource_release(up);
}

/* ---- failure callback ---- */

typedef struct rescuer {
    cubuf_resource_t *res;
    CUdeviceptr held;
    size_t held_size;
    int calls;
    bool agree;
} rescuer_t;

static bool rescue(void *user, size_t size, unsigned attempt)
{
    rescuer_t *r = user;
    r->calls++;
    if (!r->agree || attempt > 2) return false;
    if (r->held) { /* free what it holds, through the adaptor itself */
        T_OK(cubuf_resource_deallocate_raw(r->res, r->held, r->held_size, NULL));
        r->held = 0;
    }
    return size > 0;
}

static void test_failure_callback(void)
{
    host_up_t h;
    cubuf_resource_t *up = host_upstream(&h), *fa = NULL;
    h.budget = 1000;
    rescuer_t r = {NULL, 0, 0, 0, true};
    T_STATUS(cubuf_failure_adaptor_create(up, NULL, &r, &fa), CUBUF_ERROR_INVALID_ARGUMENT);
    T_OK(cubuf_failure_adaptor_create(up, rescue, &r, &fa));
    r.res = fa;
    T_OK(cubuf_resource_allocate_raw(fa, 800, NULL, &r.held));
    r.held_size = 800;
    CUdeviceptr p = 0;
    T_CHECK(r.calls == 0);
    T_OK(cubuf_resource_allocate_raw(fa, 600, NULL, &p)); /* fails, the callback frees 800, retried */
    T_CHECK(r.calls == 1 && r.held == 0 && h.live == 1 && p != 0);
    T_STAT(fa, 600, 800, 1, 2, 1400);
    /* Past what freeing can give: the callback is asked again, then declines. */
    CUdeviceptr q = 0;
    T_STATUS(cubuf_resource_allocate_raw(fa, 2000, NULL, &q), CUBUF_ERROR_OUT_OF_MEMORY);
    T_CHECK(r.calls == 4 && q == 0);
    T_CHECK(strstr(cubuf_last_error(), "declined a retry after 3 attempts") != NULL);
    r.agree = false;
    T_STATUS(cubuf_resource_allocate_raw(fa, 2000, NULL, &q), CUBUF_ERROR_OUT_OF_MEMORY);
    T_CHECK(r.calls == 5);
    T_OK(cubuf_resource_deallocate_raw(fa, p, 600, NULL));
    T_CHECK(h.live == 0);
    T_STAT(fa, 0, 800, 0, 2, 1400);
    cubuf_resource_release(fa);
    cubuf_resource_release(up);
}

/* ---- host allocation faults through each adaptor ---- */

typedef cubuf_status_t (*make_fn)(cubuf_resource_t *up, void *arg, cubuf_resource_t **out);

static cubuf_status_t make_stats(cubuf_resource_t *up, void *arg, cubuf_resource_t **out)
{
    (void)arg;
    return cubuf_statistics_adaptor_create(up, out);
}
static cubuf_status_t make_limit(cubuf_resource_t *up, void *arg, cubuf_resource_t **out)
{
    (void)arg;
    return cubuf_limit_adaptor_create(up, 1 << 20, out);
}
static void drop_line(void *user, const char *line) { (void)user, (void)line; }
static cubuf_status_t make_log(cubuf_resource_t *up, void *arg, cubuf_resource_t **out)
{
    (void)arg;
    cubuf_log_options_t o = CUBUF_LOG_OPTIONS_INIT;
    o.callback = drop_line;
    return cubuf_log_adaptor_create(up, &o, out);
}
static cubuf_status_t make_track(cubuf_resource_t *up, void *arg, cubuf_resource_t **out)
{
    return cubuf_tracking_adaptor_create(up, arg != NULL, out);
}
static bool never(void *user, size_t size, unsigned attempt)
{
    (void)user, (void)size, (void)attempt;
    return false;
}
static cubuf_status_t make_failure(cubuf_resource_t *up, void *arg, cubuf_resource_t **out)
{
    (void)arg;
    return cubuf_failure_adaptor_create(up, never, NULL, out);
}

/* Every host allocation of creating an adaptor, 70 raw allocations and a
 * buffer through it, and releasing it, failed in turn: each step fails
 * cleanly or succeeds, and nothing is left in the upstream. */
static void test_faults(void)
{
    const struct {
        const char *name;
        make_fn make;
        void *arg;
    } kinds[] = {{"statistics", make_stats, NULL}, {"limiting", make_limit, NULL}, {"logging", make_log, NULL},
                 {"tracking", make_track, NULL},   {"tracking+backtraces", make_track, (void *)1},
                 {"failure", make_failure, NULL}};
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
        int fired = 0;
        for (unsigned nth = 1; nth < 400; nth++) {
            host_up_t h;
            cubuf_resource_t *up = host_upstream(&h), *ad = NULL;
            cubuf_fault_fail_alloc_nth(nth);
            cubuf_status_t st = kinds[k].make(up, kinds[k].arg, &ad);
            CUdeviceptr p[70] = {0};
            cubuf_buffer_t *b = NULL;
            if (st == CUBUF_SUCCESS) {
                for (int i = 0; i < 70; i++) {
                    cubuf_status_t ast = cubuf_resource_allocate_raw(ad, 16 + (size_t)i, NULL, &p[i]);
                    T_CHECK(ast == CUBUF_SUCCESS || ast == CUBUF_ERROR_OUT_OF_MEMORY);
                    if (ast != CUBUF_SUCCESS) p[i] = 0;
                }
                cubuf_status_t bst = cubuf_resource_allocate(ad, 64, NULL, &b);
                T_CHECK(bst == CUBUF_SUCCESS || bst == CUBUF_ERROR_OUT_OF_MEMORY);
                for (int i = 0; i < 70; i++)
                    if (p[i]) T_OK(cubuf_resource_deallocate_raw(ad, p[i], 16 + (size_t)i, NULL));
                cubuf_buffer_release(b);
            } else {
                T_CHECK(st == CUBUF_ERROR_OUT_OF_MEMORY && ad == NULL);
            }
            bool hit = cubuf_fault_fired();
            cubuf_fault_reset();
            cubuf_resource_release(ad);
            T_CHECK(h.live == 0);
            cubuf_resource_release(up);
            if (!hit) break;
            fired++;
        }
        printf("  %s: %d host allocation(s) failed in turn\n", kinds[k].name, fired);
        T_CHECK(fired > 0);
    }
}

/* ---- a stack, 8 threads, exact totals ---- */

typedef struct stack_job {
    cubuf_resource_t *top;
    unsigned seed;
    uint64_t bytes, count;
    cubuf_status_t st;
} stack_job_t;

static void *stack_worker(void *arg)
{
    stack_job_t *j = arg;
    for (int i = 0; i < 3000 && j->st == CUBUF_SUCCESS; i++) {
        size_t size = 1 + rand_r(&j->seed) % 2048;
        if (i % 3 == 0) {
            cubuf_buffer_t *b = NULL;
            if ((j->st = cubuf_resource_allocate(j->top, size, NULL, &b)) != CUBUF_SUCCESS) break;
            memset((void *)(uintptr_t)cubuf_buffer_ptr(b), 1, size);
            j->st = cubuf_buffer_close(b);
            cubuf_buffer_release(b);
        } else {
            CUdeviceptr p = 0;
            if ((j->st = cubuf_resource_allocate_raw(j->top, size, NULL, &p)) != CUBUF_SUCCESS) break;
            j->st = cubuf_resource_deallocate_raw(j->top, p, size, NULL);
        }
        j->bytes += size;
        j->count++;
    }
    return NULL;
}

static void test_stack_threads(void)
{
    host_up_t h;
    cubuf_resource_t *up = host_upstream(&h), *log = NULL, *track = NULL, *lim = NULL, *stats = NULL;
    lines_t got = LINES_INIT;
    cubuf_log_options_t o = CUBUF_LOG_OPTIONS_INIT;
    o.callback = collect;
    o.user = &got;
    T_OK(cubuf_log_adaptor_create(up, &o, &log));
    T_OK(cubuf_tracking_adaptor_create(log, false, &track));
    T_OK(cubuf_limit_adaptor_create(track, (size_t)1 << 30, &lim));
    T_OK(cubuf_statistics_adaptor_create(lim, &stats));
    /* The main thread goes first, so it owns the stack's locks (src/lock.h),
     * then works on beside the 8 threads, whose first calls revoke it. */
    pthread_t th[8];
    stack_job_t jobs[10];
    for (int i = 0; i < 10; i++) jobs[i] = (stack_job_t){stats, 31u * (unsigned)i + 5, 0, 0, CUBUF_SUCCESS};
    stack_worker(&jobs[9]);
    for (int i = 0; i < 8; i++) T_CHECK(pthread_create(&th[i], NULL, stack_worker, &jobs[i]) == 0);
    stack_worker(&jobs[8]);
    uint64_t bytes = 0, count = 0;
    for (int i = 0; i < 10; i++) {
        if (i < 8) pthread_join(th[i], NULL);
        T_OK(jobs[i].st);
        bytes += jobs[i].bytes;
        count += jobs[i].count;
    }
    T_CHECK(count == 10 * 3000);
    cubuf_resource_t *layers[4] = {stats, lim, track, log};
    for (int i = 0; i < 4; i++) {
        cubuf_statistics_t s = stats_of(layers[i]);
        T_CHECK(s.current_bytes == 0 && s.current_count == 0 && s.total_count == count &&
                s.total_bytes == bytes && s.total_requested == bytes);
    }
    size_t n = 1;
    T_OK(cubuf_tracking_outstanding(track, &n, NULL));
    T_CHECK(n == 0 && h.live == 0 && (uint64_t)h.allocs == count);
    cubuf_resource_release(stats);
    cubuf_resource_release(lim);
    cubuf_resource_release(track);
    cubuf_resource_release(log);
    T_CHECK(got.n == 1 + 2 * count);
    /* Each thread's events appear in its own order: allocate, free, allocate, ... */
    int last_op[1 << 16];
    memset(last_op, -1, sizeof last_op);
    bool alternates = true;
    for (size_t i = 1; i < got.n; i++) {
        log_line_t e;
        if (!parse(got.v[i], &e)) {
            alternates = false;
            break;
        }
        int op = strcmp(e.op, "free") == 0;
        int *prev = &last_op[e.tid & 0xffff];
        if (*prev == op) alternates = false;
        *prev = op;
    }
    T_CHECK(alternates);
    /* Across the threads, in order: malloc hands freed memory to any thread. */
    T_CHECK(pointers_alternate(&got, 2 * count));
    lines_free(&got);
    cubuf_resource_release(up);
}

/* ---- what a second reader found (fifth session) ---- */

/* A refused admission or an upstream failure leaves no trace, peaks included. */
static void test_limit_failure_no_trace(void)
{
    host_up_t h;
    cubuf_resource_t *up = host_upstream(&h), *lim = NULL;
    T_OK(cubuf_limit_adaptor_create(up, 1000, &lim));
    h.fail_next = 1;
    CUdeviceptr p = 0;
    T_STATUS(cubuf_resource_allocate_raw(lim, 800, NULL, &p), CUBUF_ERROR_OUT_OF_MEMORY);
    cubuf_buffer_t *b = NULL;
    h.fail_next = 1;
    T_STATUS(cubuf_resource_allocate(lim, 900, NULL, &b), CUBUF_ERROR_OUT_OF_MEMORY);
    T_STAT(lim, 0, 0, 0, 0, 0);
    cubuf_statistics_t s = stats_of(lim);
    T_CHECK(s.peak_count == 0 && s.peak_requested == 0);
    /* The cap is whole again. */
    T_OK(cubuf_resource_allocate_raw(lim, 1000, NULL, &p));
    T_OK(cubuf_resource_deallocate_raw(lim, p, 1000, NULL));
    cubuf_resource_release(lim);
    cubuf_resource_release(up);
}

/* No adaptor takes over memory it did not allocate; a wrap of size 0 with a
 * pointer counts as it closes. */
static void test_wrap_rules(void)
{
    host_up_t h;
    cubuf_resource_t *up = host_upstream(&h), *st = NULL, *lim = NULL;
    T_OK(cubuf_statistics_adaptor_create(up, &st));
    T_OK(cubuf_limit_adaptor_create(up, 1 << 20, &lim));
    unsigned char mem[64];
    cubuf_buffer_t *b = (cubuf_buffer_t *)&b;
    T_STATUS(cubuf_buffer_wrap((CUdeviceptr)(uintptr_t)mem, sizeof mem, st, NULL, &b), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(strstr(cubuf_last_error(), "adaptor") != NULL);
    T_STATUS(cubuf_buffer_wrap((CUdeviceptr)(uintptr_t)mem, sizeof mem, lim, NULL, &b), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(b == (cubuf_buffer_t *)&b);
    T_STAT(up, 0, 0, 0, 0, 0);
    void *m = malloc(16);
    T_OK(cubuf_buffer_wrap((CUdeviceptr)(uintptr_t)m, 0, up, NULL, &b)); /* the upstream adopts */
    cubuf_buffer_release(b);
    cubuf_statistics_t s = stats_of(up);
    T_CHECK(s.current_count == 0 && s.current_bytes == 0 && h.frees == 1);
    cubuf_resource_release(lim);
    cubuf_resource_release(st);
    cubuf_resource_release(up);
}

/* A free the upstream refuses leaves the allocation tracked, with its
 * backtrace, and freeable. */
static void test_tracker_failed_free(void)
{
    host_up_t h;
    cubuf_resource_t *up = host_upstream(&h), *tr = NULL;
    T_OK(cubuf_tracking_adaptor_create(up, true, &tr));
    CUdeviceptr p = 0;
    T_OK(cubuf_resource_allocate_raw(tr, 100, NULL, &p));
    h.fail_free = 1;
    T_STATUS(cubuf_resource_deallocate_raw(tr, p, 100, NULL), CUBUF_ERROR_DRIVER);
    size_t n = 0, bytes = 0;
    T_OK(cubuf_tracking_outstanding(tr, &n, &bytes));
    T_CHECK(n == 1 && bytes == 100 && h.live == 1);
    char *text = NULL;
    size_t len = 0;
    FILE *mem = open_memstream(&text, &len);
    T_OK(cubuf_tracking_report(tr, mem));
    fclose(mem);
    T_CHECK(text && strstr(text, "1 outstanding allocation, 100 bytes") && strstr(text, "\n    "));
    free(text);
    T_OK(cubuf_resource_deallocate_raw(tr, p, 100, NULL));
    T_OK(cubuf_tracking_outstanding(tr, &n, &bytes));
    T_CHECK(n == 0 && bytes == 0 && h.live == 0);
    cubuf_resource_release(tr);
    cubuf_resource_release(up);
}

/* A second free of a pointer while its first is under way (here from
 * inside the upstream's free) is refused and frees nothing. */
typedef struct again_up {
    host_up_t h;
    cubuf_resource_t *tr;
    bool tried; /* the nested free once only: a tracker that let it through must not recurse */
    cubuf_status_t second;
    char detail[256];
} again_up_t;

static cubuf_status_t again_free(void *state, CUdeviceptr p, size_t size, CUstream s)
{
    again_up_t *a = state;
    if (!a->tried) {
        a->tried = true;
        a->second = cubuf_resource_deallocate_raw(a->tr, p, size, NULL);
        snprintf(a->detail, sizeof a->detail, "%s", cubuf_last_error());
    }
    return up_free(&a->h, p, size, s);
}

static void test_tracker_free_under_way(void)
{
    again_up_t a = {.second = CUBUF_SUCCESS};
    static const cubuf_resource_ops_t ops = {CUBUF_RESOURCE_OPS_VERSION, up_alloc, again_free, NULL};
    cubuf_resource_props_t props = CUBUF_RESOURCE_PROPS_INIT;
    props.host_accessible = true;
    cubuf_resource_t *up = NULL;
    T_OK(cubuf_resource_create(&ops, &props, &a, &up));
    T_OK(cubuf_tracking_adaptor_create(up, false, &a.tr));
    CUdeviceptr p = 0;
    T_OK(cubuf_resource_allocate_raw(a.tr, 64, NULL, &p));
    T_OK(cubuf_resource_deallocate_raw(a.tr, p, 64, NULL));
    T_STATUS(a.second, CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(strstr(a.detail, "another thread is freeing it") != NULL);
    size_t n = 1;
    T_OK(cubuf_tracking_outstanding(a.tr, &n, NULL));
    T_CHECK(n == 0 && a.h.frees == 1 && a.h.live == 0);
    cubuf_resource_release(a.tr);
    cubuf_resource_release(up);
}

/* A tracker in the middle of a stack that cannot record an allocation: the
 * statistics above it count nothing, and the memory is back. */
static void test_tracker_undo_in_stack(void)
{
    host_up_t h;
    cubuf_resource_t *up = host_upstream(&h), *tr = NULL, *st = NULL;
    T_OK(cubuf_tracking_adaptor_create(up, false, &tr));
    T_OK(cubuf_statistics_adaptor_create(tr, &st));
    cubuf_fault_fail_alloc_nth(1); /* the tracker's first map */
    T_STATUS(cubuf_resource_allocate_raw(st, 128, NULL, &(CUdeviceptr){0}), CUBUF_ERROR_OUT_OF_MEMORY);
    T_CHECK(cubuf_fault_fired());
    cubuf_fault_reset();
    T_STAT(st, 0, 0, 0, 0, 0);
    T_STAT(up, 0, 0, 0, 0, 0);
    T_CHECK(h.allocs == 1 && h.live == 0);
    cubuf_buffer_t *b = NULL;
    T_OK(cubuf_resource_allocate(st, 128, NULL, &b));
    T_STAT(st, 128, 128, 1, 1, 128);
    size_t n = 0;
    T_OK(cubuf_tracking_outstanding(tr, &n, NULL));
    T_CHECK(n == 1);
    cubuf_buffer_release(b);
    T_OK(cubuf_tracking_outstanding(tr, &n, NULL));
    T_CHECK(n == 0 && h.live == 0);
    T_STAT(st, 0, 128, 0, 1, 128);
    cubuf_resource_release(st);
    cubuf_resource_release(tr);
    cubuf_resource_release(up);
}

/* An allocation the tracker cannot record (its map cannot grow) is given
 * back through the cap below it, which lets go of the bytes it held: the
 * failed allocation is counted nowhere and the whole cap stays available. */
static void test_tracker_undo_under_cap(void)
{
    host_up_t h;
    cubuf_resource_t *up = host_upstream(&h), *lim = NULL, *tr = NULL;
    T_OK(cubuf_limit_adaptor_create(up, 1000, &lim));
    T_OK(cubuf_tracking_adaptor_create(lim, false, &tr));
    CUdeviceptr p = 0;
    cubuf_fault_fail_alloc_nth(1); /* the tracker's first map */
    T_STATUS(cubuf_resource_allocate_raw(tr, 600, NULL, &p), CUBUF_ERROR_OUT_OF_MEMORY);
    T_CHECK(cubuf_fault_fired());
    cubuf_fault_reset();
    T_CHECK(h.allocs == 1 && h.live == 0);
    T_STAT(lim, 0, 0, 0, 0, 0);
    T_STAT(up, 0, 0, 0, 0, 0);
    T_OK(cubuf_resource_allocate_raw(tr, 1000, NULL, &p)); /* the whole cap */
    T_STAT(lim, 1000, 1000, 1, 1, 1000);
    T_STATUS(cubuf_resource_allocate_raw(tr, 1, NULL, &(CUdeviceptr){0}), CUBUF_ERROR_OUT_OF_MEMORY);
    T_OK(cubuf_resource_deallocate_raw(tr, p, 1000, NULL));
    T_STAT(lim, 0, 1000, 0, 1, 1000);
    T_CHECK(h.live == 0);
    cubuf_resource_release(tr);
    cubuf_resource_release(lim);
    cubuf_resource_release(up);
}

/* A pointer freed and handed out again is logged freed first: the free's
 * stamp is taken before the upstream frees (here the upstream hands the
 * block out again from inside its free, as another thread could the moment
 * the free returns). */
typedef struct reuse_up {
    unsigned char block[256];
    bool taken;
    cubuf_resource_t *log; /* set: the free allocates again through it */
    CUdeviceptr again;
} reuse_up_t;

static cubuf_status_t reuse_alloc(void *state, size_t size, CUstream s, CUdeviceptr *p)
{
    (void)s;
    reuse_up_t *r = state;
    if (r->taken || size > sizeof r->block) return CUBUF_ERROR_OUT_OF_MEMORY;
    r->taken = true;
    *p = (CUdeviceptr)(uintptr_t)r->block;
    return CUBUF_SUCCESS;
}

static cubuf_status_t reuse_free(void *state, CUdeviceptr p, size_t size, CUstream s)
{
    (void)p, (void)s;
    reuse_up_t *r = state;
    r->taken = false;
    cubuf_resource_t *log = r->log;
    r->log = NULL;
    if (log) return cubuf_resource_allocate_raw(log, size, NULL, &r->again);
    return CUBUF_SUCCESS;
}

/* An allocation reads the order counter after its upstream returned: here
 * the upstream holds one thread's allocation until another thread frees
 * the block it then hands out, so an allocation placed when asked for
 * would sort before that free. */
typedef struct handoff_up {
    pthread_mutex_t m;
    pthread_cond_t c;
    bool taken, waiting;
    unsigned char block[64];
} handoff_up_t;

static cubuf_status_t handoff_alloc(void *state, size_t size, CUstream s, CUdeviceptr *p)
{
    (void)size, (void)s;
    handoff_up_t *u = state;
    pthread_mutex_lock(&u->m);
    while (u->taken) {
        u->waiting = true;
        pthread_cond_broadcast(&u->c);
        pthread_cond_wait(&u->c, &u->m);
    }
    u->waiting = false;
    u->taken = true;
    pthread_mutex_unlock(&u->m);
    *p = (CUdeviceptr)(uintptr_t)u->block;
    return CUBUF_SUCCESS;
}

static cubuf_status_t handoff_free(void *state, CUdeviceptr p, size_t size, CUstream s)
{
    (void)p, (void)size, (void)s;
    handoff_up_t *u = state;
    pthread_mutex_lock(&u->m);
    u->taken = false;
    pthread_cond_broadcast(&u->c);
    pthread_mutex_unlock(&u->m);
    return CUBUF_SUCCESS;
}

static void *handoff_taker(void *arg)
{
    cubuf_resource_t *lg = arg;
    CUdeviceptr p = 0;
    if (cubuf_resource_allocate_raw(lg, 64, NULL, &p) != CUBUF_SUCCESS) return NULL;
    return cubuf_resource_deallocate_raw(lg, p, 64, NULL) == CUBUF_SUCCESS ? (void *)(uintptr_t)p : NULL;
}

static void test_log_handoff_order(void)
{
    handoff_up_t u = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, false, false, {0}};
    static const cubuf_resource_ops_t ops = {CUBUF_RESOURCE_OPS_VERSION, handoff_alloc, handoff_free, NULL};
    cubuf_resource_props_t props = CUBUF_RESOURCE_PROPS_INIT;
    props.host_accessible = true;
    cubuf_resource_t *up = NULL;
    T_REQUIRE(cubuf_resource_create(&ops, &props, &u, &up));
    lines_t got = LINES_INIT;
    cubuf_resource_t *lg = collecting_log(up, &got);
    CUdeviceptr p = 0;
    T_OK(cubuf_resource_allocate_raw(lg, 64, NULL, &p));
    pthread_t th;
    T_CHECK(pthread_create(&th, NULL, handoff_taker, lg) == 0);
    pthread_mutex_lock(&u.m);
    while (!u.waiting) pthread_cond_wait(&u.c, &u.m); /* the other thread is in its allocate */
    pthread_mutex_unlock(&u.m);
    T_OK(cubuf_resource_deallocate_raw(lg, p, 64, NULL));
    void *again = NULL;
    pthread_join(th, &again);
    T_CHECK(again == (void *)(uintptr_t)p);
    cubuf_resource_release(lg);
    T_CHECK(got.n == 5 && pointers_alternate(&got, 4));
    lines_free(&got);
    cubuf_resource_release(up);
}

static void test_log_reuse_order(void)
{
    reuse_up_t r = {{0}, false, NULL, 0};
    static const cubuf_resource_ops_t ops = {CUBUF_RESOURCE_OPS_VERSION, reuse_alloc, reuse_free, NULL};
    cubuf_resource_props_t props = CUBUF_RESOURCE_PROPS_INIT;
    props.host_accessible = true;
    cubuf_resource_t *up = NULL, *lg = NULL;
    T_REQUIRE(cubuf_resource_create(&ops, &props, &r, &up));
    lines_t got = LINES_INIT;
    cubuf_log_options_t o = CUBUF_LOG_OPTIONS_INIT;
    o.callback = collect;
    o.user = &got;
    T_OK(cubuf_log_adaptor_create(up, &o, &lg));
    CUdeviceptr p = 0;
    T_OK(cubuf_resource_allocate_raw(lg, 64, NULL, &p));
    r.log = lg;
    T_OK(cubuf_resource_deallocate_raw(lg, p, 64, NULL));
    T_CHECK(r.again == p);
    T_OK(cubuf_resource_deallocate_raw(lg, r.again, 64, NULL));
    T_OK(cubuf_log_adaptor_flush(lg));
    T_CHECK(got.n == 5);
    /* The nested allocation was written before the free that made it, and
     * sorts after it. */
    static const char *const want[4] = {"allocate", "free", "allocate", "free"};
    size_t n = 0;
    sorted_line_t *v = sorted_lines(&got, &n);
    T_CHECK(v && n == 4);
    for (size_t i = 0; v && i < n && n == 4; i++)
        T_CHECK(strcmp(v[i].e.op, want[i]) == 0 && v[i].e.ptr == p && v[i].e.order == i);
    free(v);
    T_CHECK(pointers_alternate(&got, 4));
    cubuf_resource_release(lg);
    lines_free(&got);
    cubuf_resource_release(up);
}

/* Requested bytes past INT64_MAX still count against the cap (the tally is
 * modulo 2^64): half the address space and one byte held, half more is
 * refused under a cap of half and 4 KiB. It was admitted (the held bytes
 * read as 0). */
static void test_limit_past_int64(void)
{
    /* fake_alloc hands out the size as the pointer, never touched */
    static const cubuf_resource_ops_t ops = {CUBUF_RESOURCE_OPS_VERSION, fake_alloc, fake_free, NULL};
    cubuf_resource_props_t props = CUBUF_RESOURCE_PROPS_INIT;
    props.host_accessible = true;
    cubuf_resource_t *up = NULL, *lim = NULL;
    T_REQUIRE(cubuf_resource_create(&ops, &props, NULL, &up));
    const size_t half = (size_t)1 << 63;
    T_REQUIRE(cubuf_limit_adaptor_create(up, half + 4096, &lim));
    CUdeviceptr a = 0, b = 0;
    T_OK(cubuf_resource_allocate_raw(lim, half + 1, NULL, &a));
    T_STATUS(cubuf_resource_allocate_raw(lim, half, NULL, &b), CUBUF_ERROR_OUT_OF_MEMORY);
    T_CHECK(strstr(cubuf_last_error(), "cap of 9223372036854779904 bytes") != NULL);
    T_CHECK(b == 0);
    T_OK(cubuf_resource_allocate_raw(lim, 4095, NULL, &b)); /* what is left fits */
    T_OK(cubuf_resource_deallocate_raw(lim, b, 4095, NULL));
    T_OK(cubuf_resource_deallocate_raw(lim, a, half + 1, NULL));
    T_OK(cubuf_resource_allocate_raw(lim, half, NULL, &b)); /* all given back: fits again */
    T_OK(cubuf_resource_deallocate_raw(lim, b, half, NULL));
    cubuf_resource_release(lim);
    cubuf_resource_release(up);
}

/* ---- the failure callback under 8 threads (h63 review) ---- */

/* Allocations any thread may free: the callback frees the oldest, through
 * the top of the stack, and has the allocation retried. */
typedef struct stash {
    pthread_mutex_t lock;
    cubuf_resource_t *top;
    CUdeviceptr p[64];
    size_t size[64];
    int n;
    atomic_long calls, freed, declined;
} stash_t;

static bool stash_free_one(stash_t *s)
{
    pthread_mutex_lock(&s->lock);
    CUdeviceptr p = 0;
    size_t size = 0;
    if (s->n) {
        p = s->p[0];
        size = s->size[0];
        memmove(s->p, s->p + 1, (size_t)(s->n - 1) * sizeof *s->p);
        memmove(s->size, s->size + 1, (size_t)(s->n - 1) * sizeof *s->size);
        s->n--;
    }
    pthread_mutex_unlock(&s->lock);
    if (!p) return false;
    T_OK(cubuf_resource_deallocate_raw(s->top, p, size, NULL));
    atomic_fetch_add(&s->freed, 1);
    return true;
}

static bool stash_rescue(void *user, size_t size, unsigned attempt)
{
    (void)size;
    stash_t *s = user;
    atomic_fetch_add(&s->calls, 1);
    if (stash_free_one(s)) return true;
    sched_yield(); /* others hold it all, in flight: they free soon */
    return attempt < 1000;
}

typedef struct rescue_job {
    stash_t *s;
    unsigned seed;
    long made;
    uint64_t bytes;
    cubuf_status_t st;
} rescue_job_t;

static void *rescue_worker(void *arg)
{
    rescue_job_t *j = arg;
    stash_t *s = j->s;
    for (int i = 0; i < 3000; i++) {
        size_t size = 1 + rand_r(&j->seed) % 1000;
        CUdeviceptr p = 0;
        cubuf_status_t st = cubuf_resource_allocate_raw(s->top, size, NULL, &p);
        if (st == CUBUF_ERROR_OUT_OF_MEMORY) {
            atomic_fetch_add(&s->declined, 1);
            continue;
        }
        if (st != CUBUF_SUCCESS) {
            j->st = st;
            break;
        }
        j->made++;
        j->bytes += size;
        pthread_mutex_lock(&s->lock);
        bool kept = s->n < 64;
        if (kept) {
            s->p[s->n] = p;
            s->size[s->n++] = size;
        }
        pthread_mutex_unlock(&s->lock);
        if (!kept) T_OK(cubuf_resource_deallocate_raw(s->top, p, size, NULL));
    }
    return NULL;
}

static void test_failure_threads(void)
{
    host_up_t h;
    cubuf_resource_t *up = host_upstream(&h), *lim = NULL, *fa = NULL, *stats = NULL;
    stash_t s = {PTHREAD_MUTEX_INITIALIZER, NULL, {0}, {0}, 0, 0, 0, 0};
    T_OK(cubuf_limit_adaptor_create(up, 8000, &lim));
    T_OK(cubuf_failure_adaptor_create(lim, stash_rescue, &s, &fa));
    T_OK(cubuf_statistics_adaptor_create(fa, &stats));
    s.top = stats;
    pthread_t th[8];
    rescue_job_t jobs[8];
    for (int i = 0; i < 8; i++) {
        jobs[i] = (rescue_job_t){&s, 17u * (unsigned)i + 3, 0, 0, CUBUF_SUCCESS};
        T_CHECK(pthread_create(&th[i], NULL, rescue_worker, &jobs[i]) == 0);
    }
    long made = 0;
    uint64_t bytes = 0;
    for (int i = 0; i < 8; i++) {
        pthread_join(th[i], NULL);
        T_OK(jobs[i].st);
        made += jobs[i].made;
        bytes += jobs[i].bytes;
    }
    while (stash_free_one(&s)) {
    }
    printf("  failure callback, 8 threads: %ld made, %ld callbacks, %ld freed by them, %ld declined\n",
           made, (long)s.calls, (long)s.freed, (long)s.declined);
    T_CHECK(s.calls > 0 && made > 0 && h.live == 0);
    cubuf_statistics_t st = stats_of(stats), sl = stats_of(lim), su = stats_of(up);
    T_CHECK(st.current_bytes == 0 && st.current_count == 0 && st.total_count == (uint64_t)made &&
            st.total_requested == bytes && st.peak_requested <= 8000);
    T_CHECK(sl.current_requested == 0 && sl.total_count == (uint64_t)made && sl.peak_requested <= 8000);
    T_CHECK(su.current_bytes == 0 && su.total_count == (uint64_t)made);
    /* Nothing is left held against the cap: all of it can be had. */
    CUdeviceptr p = 0;
    T_OK(cubuf_resource_allocate_raw(stats, 8000, NULL, &p));
    T_OK(cubuf_resource_deallocate_raw(stats, p, 8000, NULL));
    cubuf_resource_release(stats);
    cubuf_resource_release(fa);
    cubuf_resource_release(lim);
    cubuf_resource_release(up);
}

/* A callback whose own work fails (a free it tries is refused) and then
 * declines: the allocation's detail is still the upstream's out of memory
 * (here the cap's), not the callback's failure (h63 review). */
static bool fail_then_decline(void *user, size_t size, unsigned attempt)
{
    (void)size, (void)attempt;
    T_STATUS(cubuf_resource_deallocate_raw(user, 0x1234, 8, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    return false;
}

static void test_failure_detail(void)
{
    host_up_t h;
    cubuf_resource_t *up = host_upstream(&h), *lim = NULL, *fa = NULL, *tr = NULL;
    T_OK(cubuf_tracking_adaptor_create(up, false, &tr));
    T_OK(cubuf_limit_adaptor_create(up, 100, &lim));
    T_OK(cubuf_failure_adaptor_create(lim, fail_then_decline, tr, &fa));
    CUdeviceptr p = 0;
    T_STATUS(cubuf_resource_allocate_raw(fa, 200, NULL, &p), CUBUF_ERROR_OUT_OF_MEMORY);
    T_CHECK(strstr(cubuf_last_error(), "would pass the cap of 100 bytes") != NULL &&
            strstr(cubuf_last_error(), "declined a retry after 1 attempt") != NULL &&
            strstr(cubuf_last_error(), "tracking adaptor") == NULL);
    if (!strstr(cubuf_last_error(), "cap of 100")) printf("  detail: %s\n", cubuf_last_error());
    cubuf_resource_release(fa);
    cubuf_resource_release(lim);
    cubuf_resource_release(tr);
    cubuf_resource_release(up);
}

int main(void)
{
    test_raw();
    test_limit_past_int64();
    test_statistics();
    test_limit();
    test_limit_threads();
    test_log_callback();
    test_log_callback_flush();
    test_log_backpressure();
    test_log_file();
    test_log_write_failure_keeps_detail();
    test_log_fork_thread_id();
    test_log_fields();
    test_log_time();
    test_log_thread_churn();
    test_log_notes_small_rings();
    test_tracking();
    test_tracking_release_all();
    test_failure_callback();
    test_faults();
    test_stack_threads();
    test_limit_failure_no_trace();
    test_wrap_rules();
    test_tracker_failed_free();
    test_tracker_undo_under_cap();
    test_tracker_free_under_way();
    test_tracker_undo_in_stack();
    test_log_reuse_order();
    test_log_handoff_order();
    test_failure_threads();
    test_failure_detail();
    return t_finish("test_adaptor");
}
