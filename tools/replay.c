/* cubuf replay LOG: replays a logging adaptor's log (cubuf/adaptor.h)
 * against a resource kind and against the raw driver pool, in one run.
 *
 * Each logged thread becomes a replay thread that performs its own events
 * in their logged order, each logged stream a stream of its own (default
 * streams stay default streams), and each free frees what the matching
 * allocation returned, with that allocation's size whatever size the free
 * line gives (a free logged on another thread waits until that
 * allocation has been replayed). Failed events are skipped; allocations the
 * log never frees are freed at the end (or before their pointer is handed
 * out again); frees of allocations made before the log began are skipped.
 * The raw side calls cuMemAllocFromPoolAsync and cuMemFreeAsync on the
 * device's default pool, loaded here from the same libcuda cubuf uses; the
 * rounds alternate (raw, cubuf, cubuf, raw, ...) and the medians of the
 * per-round means are printed with their ratio. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cubuf.h"
#include "cubuf/caching.h"
#include "replay.h"

/* ---- the log ---- */

typedef struct event {
    int thread;   /* index into the replay threads */
    int stream;   /* index into the streams */
    bool alloc;
    size_t size;
    long id;      /* the allocation this event makes or frees */
} event_t;

typedef struct plan {
    event_t *ev;
    long nev, nalloc;
    int nthreads, nstreams;
    void *streams_logged[64];
    long skipped;
} plan_t;

static int index_of(long *keys, int *n, int max, long key)
{
    for (int i = 0; i < *n; i++)
        if (keys[i] == key) return i;
    if (*n == max) return -1;
    keys[*n] = key;
    return (*n)++;
}

/* One successful line of the log, as read. */
typedef struct line_ev {
    unsigned long long order; /* the log's order (a version 1 log's time) */
    long at;                  /* position in the file: ties keep it */
    void *stream;
    unsigned long long ptr;
    size_t size;
    int tid;
    bool alloc;
} line_ev_t;

static int by_order(const void *a, const void *b)
{
    const line_ev_t *x = a, *y = b;
    if (x->order != y->order) return x->order < y->order ? -1 : 1;
    return x->at < y->at ? -1 : x->at > y->at;
}

/* Live pointers -> the event that allocated them: open addressing, linear
 * probing, deletion by backward shift; cap a power of two above 2x the
 * allocations, so it never fills. */
typedef struct live_map {
    unsigned long long *ptr; /* 0: empty */
    long *ev;                /* index into plan->ev */
    size_t mask;
} live_map_t;

static size_t live_home(const live_map_t *m, unsigned long long p)
{
    return (size_t)((p * 0x9E3779B97F4A7C15ull) >> 20) & m->mask;
}

static void live_put(live_map_t *m, unsigned long long p, long ev)
{
    size_t i = live_home(m, p);
    while (m->ptr[i] && m->ptr[i] != p) i = (i + 1) & m->mask;
    m->ptr[i] = p;
    m->ev[i] = ev;
}

static long live_take(live_map_t *m, unsigned long long p)
{
    size_t i = live_home(m, p);
    while (m->ptr[i] && m->ptr[i] != p) i = (i + 1) & m->mask;
    if (!m->ptr[i]) return -1;
    long ev = m->ev[i];
    for (size_t j = i;;) {
        m->ptr[i] = 0;
        for (;;) {
            j = (j + 1) & m->mask;
            if (!m->ptr[j]) return ev;
            size_t h = live_home(m, m->ptr[j]);
            if (i <= j ? (h <= i || h > j) : (h <= i && h > j)) break;
        }
        m->ptr[i] = m->ptr[j];
        m->ev[i] = m->ev[j];
        i = j;
    }
}

static int fail_plan(FILE *f, line_ev_t *lines, live_map_t *m, plan_t *p, const char *why)
{
    fprintf(stderr, "cubuf replay: %s\n", why);
    if (f) fclose(f);
    free(lines);
    free(m->ptr);
    free(m->ev);
    free(p->ev);
    p->ev = NULL;
    return 2;
}

/* Reads the log into a plan: its successful events sorted by order (lines
 * of different threads may come out of order, cubuf/adaptor.h),
 * allocations numbered, each free naming its allocation. */
static int read_plan(const char *path, plan_t *p)
{
    memset(p, 0, sizeof *p);
    live_map_t m = {NULL, NULL, 0};
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "cubuf replay: cannot open %s\n", path);
        return 2;
    }
    line_ev_t *lines = NULL;
    long n = 0, cap = 0, lineno = 0, nalloc = 0;
    char line[512];
    int version = 2;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        if (!strchr(line, '\n') && !feof(f)) { /* the rest would read as lines of their own */
            fprintf(stderr, "cubuf replay: %s:%ld: a line longer than %zu bytes\n", path, lineno,
                    sizeof line - 2);
            return fail_plan(f, lines, &m, p, "the log cannot be read");
        }
        if (line[0] == '#') { /* "# cubuf log 1:" had no order field: its time orders it */
            if (sscanf(line, "# cubuf log %d:", &version) == 1 && version != 1 && version != 2) {
                fprintf(stderr, "cubuf replay: %s:%ld: log version %d\n", path, lineno, version);
                return fail_plan(f, lines, &m, p, "a log of a version this tool does not know");
            }
            continue;
        }
        if (line[0] == '\n') continue;
        line_ev_t e = {0, lineno, NULL, 0, 0, 0, false};
        char op[16], status[48];
        long long time = 0;
        int end = 0;
        const int got = version == 1 ? sscanf(line, "%llu,%d,%p,%15[a-z],0x%llx,%zu,%47[A-Z0-9_]%n",
                                              &e.order, &e.tid, &e.stream, op, &e.ptr, &e.size, status,
                                              &end) + 1
                                     : sscanf(line, "%llu,%lld,%d,%p,%15[a-z],0x%llx,%zu,%47[A-Z0-9_]%n",
                                              &e.order, &time, &e.tid, &e.stream, op, &e.ptr, &e.size, status,
                                              &end);
        /* Nothing may follow the status; %zu stops an overflowing size at
         * SIZE_MAX, which was not allocated. No field of a line has a
         * minus sign, and the scanf conversions take one and negate what
         * follows: -18446744073709551615 reads as a size of 1. */
        if (got != 8 || line[end + strspn(line + end, " \t\r\n")] || e.size > SIZE_MAX / 2 ||
            strchr(line, '-') ||
            (strcmp(op, "allocate") && strcmp(op, "free"))) {
            fprintf(stderr, "cubuf replay: %s:%ld: not a log line: %s", path, lineno, line);
            return fail_plan(f, lines, &m, p, "the log cannot be read");
        }
        e.alloc = op[0] == 'a';
        /* A free's size is not read: it frees its allocation, at that size. */
        if (strcmp(status, "CUBUF_SUCCESS") != 0 || (e.alloc && e.size == 0) || !e.ptr) {
            p->skipped++;
            continue;
        }
        nalloc += e.alloc;
        if (n == cap) {
            cap = cap ? 2 * cap : 4096;
            line_ev_t *more = realloc(lines, (size_t)cap * sizeof *lines);
            if (!more) return fail_plan(f, lines, &m, p, "out of memory reading the log");
            lines = more;
        }
        lines[n++] = e;
    }
    if (ferror(f)) {
        fprintf(stderr, "cubuf replay: %s:%ld: %s\n", path, lineno + 1, strerror(errno));
        return fail_plan(f, lines, &m, p, "the log cannot be read");
    }
    fclose(f);
    f = NULL;
    if (n) qsort(lines, (size_t)n, sizeof *lines, by_order); /* lines is NULL when none succeeded */
    size_t mcap = 64;
    while (mcap < 2 * (size_t)nalloc + 2) mcap *= 2;
    m.ptr = calloc(mcap, sizeof *m.ptr);
    m.ev = calloc(mcap, sizeof *m.ev);
    p->ev = malloc(((size_t)n + (size_t)nalloc + 1) * sizeof *p->ev); /* frees of the never freed too */
    if (!m.ptr || !m.ev || !p->ev) return fail_plan(f, lines, &m, p, "out of memory planning the replay");
    m.mask = mcap - 1;
    long tids[256];
    for (long k = 0; k < n; k++) {
        const line_ev_t *e = &lines[k];
        long id = -1, at = -1;
        size_t size = e->size;
        if (e->alloc) {
            id = p->nalloc++;
            if ((at = live_take(&m, e->ptr)) >= 0) { /* handed out again, no free logged: freed first */
                const event_t *a = &p->ev[at];
                p->ev[p->nev++] = (event_t){a->thread, a->stream, false, a->size, a->id};
            }
        } else if ((at = live_take(&m, e->ptr)) >= 0) {
            id = p->ev[at].id;
            size = p->ev[at].size; /* a resource that checks it (virtual memory) or files by it (caching) */
        } else { /* allocated before the log began */
            p->skipped++;
            continue;
        }
        int th = index_of(tids, &p->nthreads, 256, e->tid);
        int sx = -1;
        for (int i = 0; i < p->nstreams; i++)
            if (p->streams_logged[i] == e->stream) sx = i;
        if (sx < 0 && p->nstreams < 64) {
            sx = p->nstreams;
            p->streams_logged[p->nstreams++] = e->stream;
        }
        if (th < 0 || sx < 0) return fail_plan(f, lines, &m, p, "more than 256 threads or 64 streams in the log");
        p->ev[p->nev] = (event_t){th, sx, e->alloc, size, id};
        if (e->alloc) live_put(&m, e->ptr, p->nev);
        p->nev++;
    }
    /* What the log never frees is freed at the end, by the allocating thread. */
    for (size_t i = 0; i < mcap; i++) {
        if (!m.ptr[i]) continue;
        const event_t *a = &p->ev[m.ev[i]];
        p->ev[p->nev++] = (event_t){a->thread, a->stream, false, a->size, a->id};
    }
    free(lines);
    free(m.ptr);
    free(m.ev);
    return 0;
}

/* ---- the two sides ---- */

typedef CUresult (*alloc_fn)(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
typedef CUresult (*free_fn)(CUdeviceptr, CUstream);

typedef struct raw_driver {
    alloc_fn alloc;
    free_fn free;
    CUresult (*default_pool)(CUmemoryPool *, CUdevice);
    CUresult (*ctx_set)(CUcontext);
    CUresult (*ctx_device)(CUdevice *);
    CUresult (*ctx_sync)(void);
    CUresult (*set_attr)(CUmemoryPool, CUmemPool_attribute, void *);
    CUmemoryPool pool;
} raw_driver_t;

typedef struct side {
    cubuf_resource_t *res; /* NULL: the raw driver */
    raw_driver_t *raw;
} side_t;

typedef struct run {
    const plan_t *plan;
    side_t side;
    const raw_driver_t *drv;
    CUstream *streams;
    CUcontext ctx;
    _Atomic(CUdeviceptr) *ptrs;
    atomic_int failed;
    double ns[2]; /* summed per thread below, then here */
    long n[2];
    pthread_mutex_t lock;
} run_t;

typedef struct worker {
    run_t *run;
    int thread;
} worker_t;

static double now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

static void *replay_thread(void *arg)
{
    worker_t *w = arg;
    run_t *r = w->run;
    const plan_t *p = r->plan;
    double ns[2] = {0, 0};
    long n[2] = {0, 0};
    r->drv->ctx_set(r->ctx); /* both sides: as a program using the device would run */
    for (long i = 0; i < p->nev && !atomic_load(&r->failed); i++) {
        const event_t *e = &p->ev[i];
        if (e->thread != w->thread) continue;
        CUstream s = r->streams[e->stream];
        CUdeviceptr d = 0;
        double t0;
        if (e->alloc) {
            t0 = now_ns();
            bool ok = r->side.res ? cubuf_resource_allocate_raw(r->side.res, e->size, s, &d) == CUBUF_SUCCESS
                                  : r->side.raw->alloc(&d, e->size, r->side.raw->pool, s) == CUDA_SUCCESS;
            ns[0] += now_ns() - t0;
            n[0]++;
            if (!ok) {
                fprintf(stderr, "cubuf replay: allocation %ld of %zu bytes failed: %s\n", e->id, e->size,
                        r->side.res ? cubuf_last_error() : "the raw driver pool");
                atomic_store(&r->failed, 1);
                break;
            }
            atomic_store_explicit(&r->ptrs[e->id], d, memory_order_release);
        } else {
            while (!(d = atomic_load_explicit(&r->ptrs[e->id], memory_order_acquire)) &&
                   !atomic_load(&r->failed))
                sched_yield(); /* allocated on another thread, not yet */
            if (!d) break;
            t0 = now_ns();
            bool ok = r->side.res ? cubuf_resource_deallocate_raw(r->side.res, d, e->size, s) == CUBUF_SUCCESS
                                  : r->side.raw->free(d, s) == CUDA_SUCCESS;
            ns[1] += now_ns() - t0;
            n[1]++;
            if (!ok) { /* still allocated: the round's end frees it */
                fprintf(stderr, "cubuf replay: free of allocation %ld failed: %s\n", e->id,
                        r->side.res ? cubuf_last_error() : "the raw driver pool");
                atomic_store(&r->failed, 1);
                break;
            }
            atomic_store(&r->ptrs[e->id], 0);
        }
    }
    pthread_mutex_lock(&r->lock);
    for (int k = 0; k < 2; k++) {
        r->ns[k] += ns[k];
        r->n[k] += n[k];
    }
    pthread_mutex_unlock(&r->lock);
    return NULL;
}

/* One replay of the whole plan on one side; means per allocate and per free in ns. */
static int replay_once(const plan_t *p, side_t side, const raw_driver_t *drv, CUstream *streams,
                       CUcontext ctx, double mean[2])
{
    run_t r = {.plan = p, .side = side, .drv = drv, .streams = streams, .ctx = ctx};
    r.ptrs = calloc((size_t)p->nalloc + 1, sizeof *r.ptrs);
    if (!r.ptrs) {
        fprintf(stderr, "cubuf replay: out of host memory\n");
        return 1;
    }
    pthread_mutex_init(&r.lock, NULL);
    pthread_t th[256];
    worker_t w[256];
    int started = 0;
    for (; started < p->nthreads; started++) {
        w[started] = (worker_t){&r, started};
        if (pthread_create(&th[started], NULL, replay_thread, &w[started]) != 0) {
            fprintf(stderr, "cubuf replay: cannot start thread %d of %d\n", started + 1, p->nthreads);
            atomic_store(&r.failed, 1); /* the started ones stop waiting for it */
            break;
        }
    }
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    pthread_mutex_destroy(&r.lock);
    /* A failed round leaves what it allocated (a failed free included):
     * freed here once the device is idle, on the stream it was allocated on. */
    const bool failed = atomic_load(&r.failed);
    long freed = 0, lost = 0;
    if (failed) drv->ctx_sync();
    for (long i = 0; failed && i < p->nev; i++) {
        const event_t *e = &p->ev[i];
        CUdeviceptr d = e->alloc ? atomic_load(&r.ptrs[e->id]) : 0;
        if (!d) continue;
        const bool ok = r.side.res
                            ? cubuf_resource_deallocate_raw(r.side.res, d, e->size, streams[e->stream]) ==
                                  CUBUF_SUCCESS
                            : r.side.raw->free(d, streams[e->stream]) == CUDA_SUCCESS;
        freed += ok;
        lost += !ok;
        atomic_store(&r.ptrs[e->id], 0);
    }
    if (failed)
        fprintf(stderr, "cubuf replay: freed %ld of the %ld allocation(s) the failed round left\n", freed,
                freed + lost);
    free(r.ptrs);
    for (int k = 0; k < 2; k++) mean[k] = r.n[k] ? r.ns[k] / (double)r.n[k] : 0;
    return failed ? 1 : 0;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static bool known_kind(const char *kind)
{
    static const char *const kinds[] = {"device", "private", "managed", "sync", "vmm", "caching"};
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++)
        if (strcmp(kind, kinds[i]) == 0) return true;
    return false;
}

/* kind is one that known_kind accepts. */
static cubuf_status_t make_resource(const char *kind, cubuf_resource_t **out)
{
    if (strcmp(kind, "device") == 0) return cubuf_device_resource_create(0, NULL, out);
    if (strcmp(kind, "private") == 0) {
        cubuf_device_resource_options_t o = CUBUF_DEVICE_RESOURCE_OPTIONS_INIT;
        o.private_pool = true;
        return cubuf_device_resource_create(0, &o, out);
    }
    if (strcmp(kind, "managed") == 0) return cubuf_managed_resource_create(0, -2, out);
    if (strcmp(kind, "sync") == 0) return cubuf_sync_device_resource_create(0, out);
    if (strcmp(kind, "vmm") == 0) return cubuf_vmm_resource_create(0, NULL, out);
    if (strcmp(kind, "caching") == 0) {
        cubuf_resource_t *up = NULL;
        cubuf_status_t st = cubuf_device_resource_create(0, NULL, &up);
        if (st != CUBUF_SUCCESS) return st;
        st = cubuf_caching_resource_create(up, NULL, out);
        cubuf_resource_release(up);
        return st;
    }
    return CUBUF_ERROR_INVALID_ARGUMENT;
}

/* The driver's entry points, found as cubuf finds them: through
 * cuGetProcAddress_v2 of the library CUBUF_LIBCUDA names (libcuda.so.1 by
 * default). */
typedef CUresult (*get_proc_fn)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);

static void *entry(get_proc_fn get, const char *name)
{
    void *fn = NULL;
    CUdriverProcAddressQueryResult q;
    return get(name, &fn, 12020, CU_GET_PROC_ADDRESS_DEFAULT, &q) == CUDA_SUCCESS ? fn : NULL;
}

static void *load_driver(raw_driver_t *d)
{
    const char *path = getenv("CUBUF_LIBCUDA");
    void *lib = dlopen(path && *path ? path : "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return NULL;
    get_proc_fn get = (get_proc_fn)dlsym(lib, "cuGetProcAddress_v2");
    if (!get) {
        dlclose(lib);
        return NULL;
    }
    d->alloc = (alloc_fn)entry(get, "cuMemAllocFromPoolAsync");
    d->free = (free_fn)entry(get, "cuMemFreeAsync");
    d->default_pool = (CUresult(*)(CUmemoryPool *, CUdevice))entry(get, "cuDeviceGetDefaultMemPool");
    d->ctx_set = (CUresult(*)(CUcontext))entry(get, "cuCtxSetCurrent");
    d->ctx_sync = (CUresult(*)(void))entry(get, "cuCtxSynchronize");
    d->ctx_device = (CUresult(*)(CUdevice *))entry(get, "cuCtxGetDevice");
    d->set_attr = (CUresult(*)(CUmemoryPool, CUmemPool_attribute, void *))entry(get, "cuMemPoolSetAttribute");
    if (!d->alloc || !d->free || !d->default_pool || !d->ctx_set || !d->ctx_sync || !d->set_attr ||
        !d->ctx_device) {
        dlclose(lib);
        return NULL;
    }
    return lib;
}

/* The N of --rounds N, 1 to 99; 0 for anything else. */
static int parse_rounds(const char *text)
{
    char *end = NULL;
    const long v = strtol(text, &end, 10);
    return end == text || *end || v < 1 || v > 99 ? 0 : (int)v;
}

int cubuf__replay(int argc, char **argv)
{
    const char *path = NULL, *kind = "device";
    int rounds = 5;
    for (int i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--resource") == 0 && i + 1 < argc) kind = argv[++i];
        else if (strcmp(argv[i], "--rounds") == 0 && i + 1 < argc) rounds = parse_rounds(argv[++i]);
        else if (!path && argv[i][0] != '-') path = argv[i];
        else path = NULL, i = argc;
    }
    if (!path || rounds < 1 || rounds > 99 || !known_kind(kind)) { /* before the device: a usage error */
        fprintf(stderr, "usage: cubuf replay LOG [--resource device|private|managed|sync|vmm|caching] "
                        "[--rounds N]\n");
        return 2;
    }
    plan_t p;
    int rc = read_plan(path, &p);
    if (rc) return rc;
    cubuf_context_t *ctx = NULL;
    cubuf_resource_t *res = NULL;
    cubuf_status_t st = cubuf_context_create(0, &ctx);
    if (st != CUBUF_SUCCESS) {
        fprintf(stderr, "cubuf replay: %s: %s\n",
                st == CUBUF_ERROR_NO_DRIVER || st == CUBUF_ERROR_NO_DEVICE ? "no device"
                                                                           : "cannot make device 0's context",
                cubuf_last_error());
        free(p.ev);
        return st == CUBUF_ERROR_NO_DRIVER ? 3 : st == CUBUF_ERROR_NO_DEVICE ? 4 : 1;
    }
    if ((st = make_resource(kind, &res)) != CUBUF_SUCCESS) {
        fprintf(stderr, "cubuf replay: resource \"%s\": %s\n", kind, cubuf_last_error());
        cubuf_context_destroy(ctx);
        free(p.ev);
        return 1;
    }
    raw_driver_t drv;
    void *lib = load_driver(&drv);
    CUcontext cu = NULL;
    cubuf_context_handle(ctx, &cu);
    CUdevice dev = 0;
    CUstream streams[64];
    int created = 0;
    rc = 1;
    if (!lib || drv.ctx_set(cu) != CUDA_SUCCESS || drv.ctx_device(&dev) != CUDA_SUCCESS ||
        drv.default_pool(&drv.pool, dev) != CUDA_SUCCESS) {
        fprintf(stderr, "cubuf replay: cannot load the raw driver pool for the comparison\n");
        goto out;
    }
    cuuint64_t keep = UINT64_MAX; /* as the device resource's pool keeps memory */
    drv.set_attr(drv.pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &keep);
    for (int i = 0; i < p.nstreams; i++) {
        void *s = p.streams_logged[i];
        if (!s || s == (void *)CU_STREAM_LEGACY || s == (void *)CU_STREAM_PER_THREAD) {
            streams[i] = (CUstream)s;
        } else if (cubuf_stream_create(ctx, CU_STREAM_NON_BLOCKING, 0, &streams[i]) == CUBUF_SUCCESS) {
            created = i + 1;
        } else {
            fprintf(stderr, "cubuf replay: cannot create a stream: %s\n", cubuf_last_error());
            goto out;
        }
    }
    printf("cubuf replay %s: %ld events (%ld allocations) on %d thread(s) and %d stream(s), %ld "
           "skipped; resource \"%s\" against the raw driver pool, %d rounds\n",
           path, p.nev, p.nalloc, p.nthreads, p.nstreams, p.skipped, kind, rounds);
    double cub[2][99], raw[2][99];
    for (int r = 0; r < rounds; r++) {
        double m[2];
        side_t rs = {NULL, &drv}, cs = {res, NULL};
        bool raw_first = r % 2 == 0;
        for (int k = 0; k < 2; k++) {
            bool is_raw = (k == 0) == raw_first;
            if (replay_once(&p, is_raw ? rs : cs, &drv, streams, cu, m)) goto out;
            drv.ctx_sync();
            for (int o = 0; o < 2; o++) (is_raw ? raw : cub)[o][r] = m[o];
        }
    }
    static const char *const op[2] = {"allocate", "free"};
    for (int o = 0; o < 2; o++) {
        double c = median(cub[o], rounds), w = median(raw[o], rounds);
        printf("  %-8s cubuf %9.1f ns   raw pool %9.1f ns   ratio %.3f\n", op[o], c, w, w > 0 ? c / w : 0);
    }
    rc = 0;
out:
    cubuf_resource_release(res); /* first: a cache gives its blocks back on the streams they are on */
    for (int i = 0; i < created; i++)
        if (streams[i] && streams[i] != CU_STREAM_LEGACY && streams[i] != CU_STREAM_PER_THREAD)
            cubuf_stream_destroy(streams[i]);
    if (lib) dlclose(lib);
    cubuf_context_destroy(ctx);
    free(p.ev);
    return rc;
}
