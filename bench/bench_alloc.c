/* Allocate + free per resource, cubuf against the raw driver call that the
 * resource is built on, at 4 KiB, 64 KiB and 1 MiB. Target: <= 1.10x raw
 * (the capture refusal a pool resource owes and exact statistics cost
 * 1.04-1.06 by themselves, docs/DESIGN.md). Then the adaptors: each one's
 * cost over a user resource with empty callbacks (target: at most 20 ns
 * per allocate + free) and a statistics + limiting stack over the device
 * pool against the raw pool pair (target: <= 1.10x).
 *
 * One operation is an allocation followed by its free. The stream is
 * synchronized before the first and after the last operation of a batch,
 * so stream-ordered frees are complete when the clock is read, on both
 * sides. After each row the resource's statistics must be back at zero
 * (a leak is reported as an error). */
#include <pthread.h>

#include "bench_common.h"
#include "resource_pool.h"

typedef struct alloc_arg {
    size_t size;
    CUstream stream;
    cubuf_resource_t *res;  /* cubuf side */
    cubuf_context_t *ctx;   /* cubuf side of the new_buffer case */
    CUmemoryPool pool;      /* raw side of the pool cases */
} alloc_arg_t;

/* ---- raw sides ---- */

static void raw_pool(void *p)
{
    alloc_arg_t *a = p;
    CUdeviceptr d = 0;
    B_CU(cuMemAllocFromPoolAsync, &d, a->size, a->pool, a->stream);
    B_CU(cuMemFreeAsync, d, a->stream);
}

/* The floor of any correct pool resource: a pool must refuse a capturing
 * stream before it allocates (on a capturing stream the allocation becomes a
 * graph node), so it pays one capture query on top of the raw pair. */
static void raw_pool_with_capture_query(void *p)
{
    alloc_arg_t *a = p;
    CUstreamCaptureStatus cs;
    B_CU(cuStreamIsCapturing, a->stream, &cs);
    raw_pool(p);
}

/* The floor of new_buffer, whose memory is ordered on the context's legacy
 * stream: besides the capture query, the allocation must learn that the
 * context is current (or push it) and so must the free, which may come from
 * any thread: one cuCtxGetCurrent each. */
static void raw_pool_with_context_queries(void *p)
{
    CUcontext cur = NULL;
    B_CU(cuCtxGetCurrent, &cur);
    alloc_arg_t *a = p;
    CUstreamCaptureStatus cs;
    B_CU(cuStreamIsCapturing, a->stream, &cs);
    CUdeviceptr d = 0;
    B_CU(cuMemAllocFromPoolAsync, &d, a->size, a->pool, a->stream);
    B_CU(cuCtxGetCurrent, &cur);
    B_CU(cuMemFreeAsync, d, a->stream);
}

/* Where an atomic read-modify-write sits next to the driver calls may
 * matter (a locked instruction waits for the stores before it, the
 * driver's included): the same atomics right after each call, and right
 * before each. */
static atomic_ulong g_counter;

static void raw_pool_atomics_after(void *p)
{
    alloc_arg_t *a = p;
    CUstreamCaptureStatus cs;
    B_CU(cuStreamIsCapturing, a->stream, &cs);
    CUdeviceptr d = 0;
    B_CU(cuMemAllocFromPoolAsync, &d, a->size, a->pool, a->stream);
    atomic_fetch_add(&g_counter, 1);
    B_CU(cuMemFreeAsync, d, a->stream);
    atomic_fetch_add(&g_counter, 1);
}

static void raw_pool_atomics_before(void *p)
{
    alloc_arg_t *a = p;
    CUstreamCaptureStatus cs;
    B_CU(cuStreamIsCapturing, a->stream, &cs);
    CUdeviceptr d = 0;
    atomic_fetch_add(&g_counter, 1);
    B_CU(cuMemAllocFromPoolAsync, &d, a->size, a->pool, a->stream);
    atomic_fetch_add(&g_counter, 1);
    B_CU(cuMemFreeAsync, d, a->stream);
}

static void raw_mem_alloc(void *p)
{
    alloc_arg_t *a = p;
    CUdeviceptr d = 0;
    B_CU(cuMemAlloc, &d, a->size);
    B_CU(cuMemFree, d);
}

/* The legacy pinned resource calls cuMemHostAlloc(PORTABLE). */
static void raw_host_alloc(void *p)
{
    alloc_arg_t *a = p;
    void *h = NULL;
    B_CU(cuMemHostAlloc, &h, a->size, CU_MEMHOSTALLOC_PORTABLE);
    B_CU(cuMemFreeHost, h);
}

/* No advice and no prefetch: the resource is made with preferred location -2. */
static void raw_managed(void *p)
{
    alloc_arg_t *a = p;
    CUdeviceptr d = 0;
    B_CU(cuMemAllocManaged, &d, a->size, CU_MEM_ATTACH_GLOBAL);
    B_CU(cuMemFree, d);
}

/* ---- cubuf sides ---- */

static void lib_resource(void *p)
{
    alloc_arg_t *a = p;
    cubuf_buffer_t *b = NULL;
    B_OK(cubuf_resource_allocate(a->res, a->size, a->stream, &b));
    B_OK(cubuf_buffer_close(b));
    cubuf_buffer_release(b);
}

static void lib_new_buffer(void *p)
{
    alloc_arg_t *a = p;
    cubuf_buffer_t *b = NULL;
    B_OK(cubuf_context_new_buffer(a->ctx, a->size, &b));
    B_OK(cubuf_buffer_close(b));
    cubuf_buffer_release(b);
}

/* ---- where the time goes: absolute costs of the pieces (informational) ---- */

static cubuf_status_t empty_alloc(void *state, size_t size, CUstream s, CUdeviceptr *p)
{
    (void)state, (void)size, (void)s;
    *p = 0x1000; /* never dereferenced */
    return CUBUF_SUCCESS;
}

static cubuf_status_t empty_free(void *state, CUdeviceptr p, size_t size, CUstream s)
{
    (void)state, (void)p, (void)size, (void)s;
    return CUBUF_SUCCESS;
}

/* Median over 9 rounds of the mean time of `n` calls of `piece`, in ns. */
static double piece_ns(void (*piece)(void *), void *arg, long n)
{
    double t[9];
    for (int r = 0; r < 9; r++) {
        double t0 = bench_now();
        for (long i = 0; i < n; i++) piece(arg);
        t[r] = (bench_now() - t0) / (double)n * 1e9;
    }
    return bench_median(t, 9);
}

static void piece_bookkeeping(void *p)
{
    cubuf_buffer_t *b = NULL;
    B_OK(cubuf_resource_allocate(p, 4096, (CUstream)p, &b));
    B_OK(cubuf_buffer_close(b));
    cubuf_buffer_release(b);
}

static void piece_raw_pair(void *p)
{
    CUdeviceptr d = 0;
    B_OK(cubuf_resource_allocate_raw(p, 4096, (CUstream)p, &d));
    B_OK(cubuf_resource_deallocate_raw(p, d, 4096, (CUstream)p));
}

static void piece_capture_query(void *p)
{
    CUstreamCaptureStatus cs;
    B_CU(cuStreamIsCapturing, (CUstream)p, &cs);
}

static void piece_get_current(void *p)
{
    (void)p;
    CUcontext c = NULL;
    B_CU(cuCtxGetCurrent, &c);
}

/* What each adaptor layer's exact bookkeeping is made of: an uncontended
 * spin lock and unlock (one atomic read-modify-write), and a clock read
 * (what a log with precise times pays per event). */
static atomic_bool piece_lock_word;
static void piece_lock(void *p)
{
    (void)p;
    while (atomic_exchange_explicit(&piece_lock_word, true, memory_order_acquire)) {
    }
    atomic_store_explicit(&piece_lock_word, false, memory_order_release);
}

/* cubuf's own lock (src/lock.h): as its owner (no atomic), and once
 * another thread has taken it (its word, one atomic). */
static cubuf_lock_t piece_owned, piece_shared;
static void piece_cubuf_lock(void *p)
{
    cubuf__lock(p);
    cubuf__unlock(p);
}
static void *touch_lock(void *p)
{
    piece_cubuf_lock(p);
    return NULL;
}

static void piece_clock(void *p)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    *(volatile long *)p = t.tv_nsec;
}

/* Bursts of 256 pairs through a logging adaptor, each followed by a
 * flush: what a thread pays per pair while the writer keeps up (the
 * adaptor row measures it sustained, where the writer's formatting bounds
 * it), and what the flush pays per line it writes (`*line_ns`, when the
 * burst went through the adaptor). Medians of 101 bursts, in ns. */
static void drop_line(void *user, const char *line);
static double log_burst_ns(cubuf_resource_t *res, cubuf_resource_t *flushed, double *line_ns)
{
    double t[101], f[101];
    for (int r = 0; r < 101; r++) {
        double t0 = bench_now();
        for (int i = 0; i < 256; i++) piece_raw_pair(res);
        double t1 = bench_now();
        B_OK(cubuf_log_adaptor_flush(flushed));
        t[r] = (t1 - t0) / 256 * 1e9;
        f[r] = (bench_now() - t1) / 512 * 1e9;
    }
    if (line_ns) *line_ns = bench_median(f, 101);
    return bench_median(t, 101);
}

#if defined(__x86_64__)
/* The processor's time-stamp counter: what a log stamped in ticks (and
 * converted to time when written) would pay per event. */
static void piece_tsc(void *p) { *(volatile unsigned long long *)p = __builtin_ia32_rdtsc(); }
#endif

static void bench_pieces(bench_env_t *env)
{
    bench_section("the pieces of an allocate + free, absolute (informational)");
    cubuf_resource_ops_t ops = {.version = CUBUF_RESOURCE_OPS_VERSION};
    ops.allocate = empty_alloc;
    ops.deallocate = empty_free;
    cubuf_resource_t *user = NULL;
    B_OK(cubuf_resource_create(&ops, NULL, NULL, &user));
    const long n = 200000;
    printf("  cubuf bookkeeping (allocate + close + release, a user resource with empty "
           "callbacks): %.1f ns\n",
           piece_ns(piece_bookkeeping, user, n));
    printf("  cubuf raw pair (allocate_raw + deallocate_raw, the same resource): %.1f ns\n",
           piece_ns(piece_raw_pair, user, n));
    cubuf_log_options_t lo = CUBUF_LOG_OPTIONS_INIT;
    lo.callback = drop_line;
    cubuf_resource_t *lg = NULL;
    B_OK(cubuf_log_adaptor_create(user, &lo, &lg));
    double line_ns = 0;
    const double burst_raw = log_burst_ns(user, lg, NULL), burst_log = log_burst_ns(lg, lg, &line_ns);
    printf("  logging adaptor, bursts of 256 raw pairs with the writer keeping up: %.1f ns "
           "(the user resource's %.1f ns, +%.1f)\n",
           burst_log, burst_raw, burst_log - burst_raw);
    printf("  logging adaptor, a flush after a burst: %.1f ns per line formatted and handed to the "
           "callback (the writer thread's pace bounds the sustained row at two lines per pair)\n",
           line_ns);
    cubuf_resource_release(lg);
    printf("  cuStreamIsCapturing (a user stream): %.1f ns\n",
           piece_ns(piece_capture_query, env->stream, n));
    printf("  cuCtxGetCurrent: %.1f ns\n", piece_ns(piece_get_current, NULL, n));
    long sink = 0;
    printf("  an uncontended spin lock + unlock (one atomic read-modify-write): %.1f ns\n",
           piece_ns(piece_lock, NULL, n));
    pthread_t t;
    piece_cubuf_lock(&piece_owned);
    /* Another thread claims piece_shared; this thread's lock then revokes it
     * (membarrier), so what is measured below is the word. */
    if (pthread_create(&t, NULL, touch_lock, &piece_shared) != 0)
        bench_die_st("pthread_create", CUBUF_ERROR_SYSTEM, __FILE__, __LINE__);
    pthread_join(t, NULL);
    piece_cubuf_lock(&piece_shared);
    printf("  cubuf's lock + unlock as the lock's owner (%s): %.1f ns; shared, through its word: "
           "%.1f ns\n",
           cubuf__lock_bias_on() ? "biased" : "bias off: shared too",
           piece_ns(piece_cubuf_lock, &piece_owned, n), piece_ns(piece_cubuf_lock, &piece_shared, n));
    printf("  clock_gettime(CLOCK_MONOTONIC): %.1f ns\n", piece_ns(piece_clock, &sink, n));
#if defined(__x86_64__)
    unsigned long long ticks = 0;
    printf("  rdtsc (the time-stamp counter alone): %.1f ns\n", piece_ns(piece_tsc, &ticks, n));
#endif
    cubuf_resource_release(user);
}

/* ---- floors: what a correct pool resource cannot avoid, and cubuf's pieces in place ---- */

/* One informational row: raw against `lib`, the same memory and stream. */
static void floor_row(bench_env_t *env, const char *name, size_t size, CUstream stream,
                      bench_op_fn raw, bench_op_fn lib, alloc_arg_t *arg)
{
    bench_case_t c = {
        .group = "floor",
        .name = name,
        .size = size,
        .mode = BENCH_LATENCY,
        .stream = stream,
        .raw = raw,
        .lib = lib,
        .arg = arg,
        .sample_s = 2e-3,
        .max_batch = 2000,
        .budget_s = 0.5,
        .min_pairs = 9,
        .max_pairs = 41,
        .target = BENCH_TARGET_NONE,
    };
    bench_compare(env, &c);
}

static void bench_floors(bench_env_t *env, cubuf_resource_t *r_pool, CUmemoryPool pool,
                         CUmemoryPool ctx_pool, const size_t *sizes, size_t nsizes)
{
    bench_section("the capture query a pool resource must make, and cubuf's pieces in place "
                  "(informational)");
    bench_note("raw = cuMemAllocFromPoolAsync + cuMemFreeAsync; \"cubuf\" column = the same plus one "
               "cuStreamIsCapturing");
    for (size_t k = 0; k < nsizes; k++) {
        alloc_arg_t arg = {sizes[k], env->stream, NULL, env->ctx, pool};
        floor_row(env, "pool+capture_query", sizes[k], env->stream, raw_pool,
                  raw_pool_with_capture_query, &arg);
    }

    bench_note("raw = cuMemAllocFromPoolAsync + cuMemFreeAsync; \"cubuf\" column = the query, "
               "one atomic increment after each driver call");
    alloc_arg_t after = {64 * BENCH_KIB, env->stream, NULL, env->ctx, pool};
    floor_row(env, "query+atomics_after", 64 * BENCH_KIB, env->stream, raw_pool, raw_pool_atomics_after,
              &after);
    bench_note("raw = the same; \"cubuf\" column = the query, one atomic increment before each "
               "driver call");
    floor_row(env, "query+atomics_before", 64 * BENCH_KIB, env->stream, raw_pool,
              raw_pool_atomics_before, &after);

    if (r_pool) { /* the least the pool path could be, and the row once more, now warm */
        bench_note("device_pool_again: the device_pool row at 64 KiB, measured again last");
        alloc_arg_t arg = {64 * BENCH_KIB, env->stream, r_pool, env->ctx, pool};
        floor_row(env, "device_pool_again", 64 * BENCH_KIB, env->stream, raw_pool, lib_resource,
                  &arg);
    }

    bench_note("raw = the same on the legacy stream; \"cubuf\" column = the same plus "
               "cuStreamIsCapturing and two cuCtxGetCurrent (new_buffer's floor)");
    for (size_t k = 0; k < nsizes; k++) {
        alloc_arg_t arg = {sizes[k], CU_STREAM_LEGACY, NULL, env->ctx, ctx_pool};
        floor_row(env, "legacy+context_queries", sizes[k], CU_STREAM_LEGACY, raw_pool,
                  raw_pool_with_context_queries, &arg);
    }
}

/* ---- adaptors ---- */

/* The raw pair on arg->res: what an adaptor asks of its upstream. */
static void raw_pair(void *p)
{
    alloc_arg_t *a = p;
    CUdeviceptr d = 0;
    B_OK(cubuf_resource_allocate_raw(a->res, a->size, a->stream, &d));
    B_OK(cubuf_resource_deallocate_raw(a->res, d, a->size, a->stream));
}

/* The same through the upstream of arg: alloc_arg_t pairs, [0] upstream, [1] adaptor. */
static void raw_pair_upstream(void *p) { raw_pair(&((alloc_arg_t *)p)[0]); }
static void raw_pair_adaptor(void *p) { raw_pair(&((alloc_arg_t *)p)[1]); }
static void *pair_both(void *p)
{
    raw_pair_upstream(p);
    raw_pair_adaptor(p);
    return NULL;
}

static bool retry_never(void *user, size_t size, unsigned attempt)
{
    (void)user, (void)size, (void)attempt;
    return false;
}

static void drop_line(void *user, const char *line) { (void)user, (void)line; }

static void adaptor_row(bench_env_t *env, const char *name, bench_op_fn raw, bench_op_fn lib,
                        void *arg, size_t size, bench_target_kind_t kind, double bound)
{
    bench_case_t c = {
        .group = "adaptor",
        .name = name,
        .size = size,
        .mode = BENCH_LATENCY,
        .stream = env->stream,
        .raw = raw,
        .lib = lib,
        .arg = arg,
        .sample_s = 2e-3,
        .max_batch = 20000,
        .budget_s = 0.5,
        .min_pairs = 15,
        .max_pairs = 61,
        .target = kind,
        .bound = bound,
    };
    bench_compare(env, &c);
}

static void check_zero(bench_env_t *env, cubuf_resource_t *res, const char *name)
{
    cubuf_statistics_t s = CUBUF_STATISTICS_INIT;
    B_OK(cubuf_statistics_get(res, &s));
    if (s.current_bytes || s.current_count || !s.total_count)
        bench_error(env, "adaptor %s: %lld bytes in %lld allocations live after the row, %llu made",
                    name, (long long)s.current_bytes, (long long)s.current_count,
                    (unsigned long long)s.total_count);
}

static void bench_adaptors(bench_env_t *env, cubuf_resource_t *r_pool, CUmemoryPool pool)
{
    bench_section("adaptors: the cost each adds over a user resource with empty callbacks");
    bench_note("\"raw\" column = cubuf_resource_allocate_raw + deallocate_raw on the user resource; "
               "\"cubuf\" column = the same through the adaptor over it; target: <= 20 ns added");
    cubuf_resource_ops_t ops = {.version = CUBUF_RESOURCE_OPS_VERSION};
    ops.allocate = empty_alloc;
    ops.deallocate = empty_free;
    cubuf_resource_t *user = NULL;
    B_OK(cubuf_resource_create(&ops, NULL, NULL, &user));
    cubuf_resource_t *ad[5] = {NULL};
    static const char *const names[5] = {"statistics", "limiting", "logging", "tracking",
                                         "failure_callback"};
    B_OK(cubuf_statistics_adaptor_create(user, &ad[0]));
    B_OK(cubuf_limit_adaptor_create(user, (size_t)1 << 40, &ad[1]));
    cubuf_log_options_t lo = CUBUF_LOG_OPTIONS_INIT;
    lo.callback = drop_line;
    B_OK(cubuf_log_adaptor_create(user, &lo, &ad[2]));
    B_OK(cubuf_tracking_adaptor_create(user, false, &ad[3]));
    B_OK(cubuf_failure_adaptor_create(user, retry_never, NULL, &ad[4]));
    for (int i = 0; i < 5; i++) {
        alloc_arg_t pair[2] = {{4096, env->stream, user, env->ctx, NULL},
                               {4096, env->stream, ad[i], env->ctx, NULL}};
        adaptor_row(env, names[i], raw_pair_upstream, raw_pair_adaptor, pair, 4096,
                    BENCH_TARGET_NS_LE, 20);
        check_zero(env, ad[i], names[i]);
    }
    /* The same after another thread made a pair through each: every lock
     * the rows take is shared then (src/lock.h), as in a program whose
     * threads share the stack. */
    bench_note("the same rows once another thread has used each adaptor (its locks shared): "
               "informational");
    for (int i = 0; i < 5; i++) {
        alloc_arg_t pair[2] = {{4096, env->stream, user, env->ctx, NULL},
                               {4096, env->stream, ad[i], env->ctx, NULL}};
        pthread_t t;
        if (pthread_create(&t, NULL, pair_both, pair) != 0)
            bench_die_st("pthread_create", CUBUF_ERROR_SYSTEM, __FILE__, __LINE__);
        pthread_join(t, NULL);
        char name[48];
        snprintf(name, sizeof name, "%s_shared", names[i]);
        adaptor_row(env, name, raw_pair_upstream, raw_pair_adaptor, pair, 4096, BENCH_TARGET_NONE, 0);
        check_zero(env, ad[i], name);
    }
    for (int i = 0; i < 5; i++) cubuf_resource_release(ad[i]);
    cubuf_resource_release(user);

    if (!r_pool) return;
    bench_section("a statistics + limiting stack over the device pool, against the raw pool pair");
    cubuf_resource_t *limit = NULL, *stats = NULL;
    B_OK(cubuf_limit_adaptor_create(r_pool, (size_t)1 << 40, &limit));
    B_OK(cubuf_statistics_adaptor_create(limit, &stats));
    const size_t sizes[] = {4 * BENCH_KIB, 64 * BENCH_KIB, BENCH_MIB};
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        alloc_arg_t arg = {sizes[k], env->stream, stats, env->ctx, pool};
        bench_note("raw = cuMemAllocFromPoolAsync + cuMemFreeAsync; cubuf = the raw pair through "
                   "the stack");
        adaptor_row(env, "stack_raw", raw_pool, raw_pair, &arg, sizes[k], BENCH_TARGET_LE, 1.10);
        bench_note("raw = the same; cubuf = buffers from the stack (allocate, close, release)");
        adaptor_row(env, "stack_buffer", raw_pool, lib_resource, &arg, sizes[k], BENCH_TARGET_LE, 1.10);
    }
    check_zero(env, stats, "stack");
    check_zero(env, limit, "stack's limiting");
    cubuf_resource_release(stats);
    cubuf_resource_release(limit);
}

/* ---- setup ---- */

static void raise_release_threshold(CUmemoryPool pool)
{
    cuuint64_t keep_all = UINT64_MAX;
    B_CU(cuMemPoolSetAttribute, pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &keep_all);
}

/* A pool of pinned host memory like the pinned resource's: release
 * threshold raised and device access granted (without the grant, copies
 * from it crawl; the allocation cost is what is measured here). */
static CUmemoryPool make_host_pool(const bench_env_t *env)
{
    CUmemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    props.handleTypes = CU_MEM_HANDLE_TYPE_NONE;
    props.location.type = CU_MEM_LOCATION_TYPE_HOST;
    props.location.id = 0;
    CUmemoryPool pool = NULL;
    CUresult r = cubuf__drv.cuMemPoolCreate(&pool, &props);
    if (r != CUDA_SUCCESS) {
        /* Drivers that know only NUMA-placed host pools. */
        props.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
        B_CU(cuMemPoolCreate, &pool, &props);
    }
    raise_release_threshold(pool);
    CUmemAccessDesc access;
    memset(&access, 0, sizeof access);
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = (int)env->dev;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    B_CU(cuMemPoolSetAccess, pool, &access, 1);
    return pool;
}

typedef struct alloc_row {
    const char *name;
    bench_op_fn raw, lib;
    cubuf_resource_t *res; /* NULL for new_buffer */
    CUmemoryPool pool;
    CUstream stream;
} alloc_row_t;

/* Creates a cubuf resource, or reports why the row is skipped. */
static cubuf_resource_t *made(cubuf_status_t st, cubuf_resource_t *res, const char *what)
{
    if (st == CUBUF_SUCCESS) return res;
    if (st == CUBUF_ERROR_NOT_SUPPORTED) {
        bench_note("%s skipped: %s", what, cubuf_last_error());
        return NULL;
    }
    bench_die_st(what, st, __FILE__, __LINE__);
    return NULL;
}

/* Leak check after a row: the resource (or the context) is back at zero,
 * and cubuf did allocate. */
static void check_row(bench_env_t *env, const alloc_row_t *row, size_t size, uint64_t total_before)
{
    if (row->res) {
        cubuf_resource_stats_t s = CUBUF_RESOURCE_STATS_INIT;
        B_OK(cubuf_resource_stats(row->res, &s));
        if (s.current_bytes || s.current_count)
            bench_error(env, "%s/%zu: %zu bytes in %zu allocations still live after the row",
                        row->name, size, s.current_bytes, s.current_count);
        if (s.total_allocations <= total_before)
            bench_error(env, "%s/%zu: the resource counted no allocation", row->name, size);
    } else {
        size_t live = 0;
        B_OK(cubuf_context_bytes_allocated(env->ctx, &live));
        if (live) bench_error(env, "%s/%zu: bytes_allocated is %zu after the row", row->name, size, live);
    }
}

int main(void)
{
    bench_env_t env;
    bench_init(&env, "bench_alloc");

    cubuf_resource_t *r_pool = NULL, *r_sync = NULL, *r_legacy = NULL, *r_pinned = NULL,
                     *r_managed = NULL;
    cubuf_status_t st;
    st = cubuf_device_resource_create(0, NULL, &r_pool);
    r_pool = made(st, r_pool, "cubuf_device_resource_create");
    st = cubuf_sync_device_resource_create(0, &r_sync);
    r_sync = made(st, r_sync, "cubuf_sync_device_resource_create");
    st = cubuf_legacy_pinned_resource_create(0, &r_legacy);
    r_legacy = made(st, r_legacy, "cubuf_legacy_pinned_resource_create");
    st = cubuf_pinned_resource_create(0, false, &r_pinned);
    r_pinned = made(st, r_pinned, "cubuf_pinned_resource_create");
    st = cubuf_managed_resource_create(0, -2, &r_managed);
    r_managed = made(st, r_managed, "cubuf_managed_resource_create");

    /* The default pool serves both the device resource (made with NULL
     * options) and the raw side; raising its threshold again is what the
     * resource promises, so both sides keep memory cached alike. */
    CUmemoryPool default_pool = NULL;
    B_CU(cuDeviceGetDefaultMemPool, &default_pool, env.dev);
    raise_release_threshold(default_pool);
    CUmemoryPool host_pool = r_pinned ? make_host_pool(&env) : NULL;
    /* new_buffer allocates from the context's own pool: the raw side uses it too. */
    cubuf_buffer_t *probe = NULL;
    B_OK(cubuf_context_new_buffer(env.ctx, 0, &probe));
    CUmemoryPool ctx_pool = cubuf__pool_handle(cubuf_buffer_resource(probe));
    cubuf_buffer_release(probe);
    if (!ctx_pool) bench_die_st("the context's pool", CUBUF_ERROR_DRIVER, __FILE__, __LINE__);

    const alloc_row_t rows[] = {
        {"device_pool", raw_pool, lib_resource, r_pool, default_pool, env.stream},
        {"sync_device", raw_mem_alloc, lib_resource, r_sync, NULL, env.stream},
        {"legacy_pinned", raw_host_alloc, lib_resource, r_legacy, NULL, env.stream},
        {"pinned_pool", raw_pool, lib_resource, r_pinned, host_pool, env.stream},
        {"managed", raw_managed, lib_resource, r_managed, NULL, env.stream},
        /* new_buffer: the context's pool on its legacy default stream. */
        {"context_new_buffer", raw_pool, lib_new_buffer, NULL, ctx_pool, CU_STREAM_LEGACY},
    };
    static const char *const raw_names[] = {
        "cuMemAllocFromPoolAsync + cuMemFreeAsync (default pool)",
        "cuMemAlloc + cuMemFree",
        "cuMemHostAlloc(PORTABLE) + cuMemFreeHost",
        "cuMemAllocFromPoolAsync + cuMemFreeAsync (host pool, access granted)",
        "cuMemAllocManaged(GLOBAL) + cuMemFree",
        "cuMemAllocFromPoolAsync + cuMemFreeAsync (the context's pool, legacy stream)",
    };
    const size_t sizes[] = {4 * BENCH_KIB, 64 * BENCH_KIB, BENCH_MIB};

    bench_pieces(&env);
    bench_section("allocate + free, per operation (cubuf: allocate, close, release)");
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        const alloc_row_t *row = &rows[i];
        bool is_new_buffer = row->lib == lib_new_buffer;
        if (!row->res && !is_new_buffer) continue; /* resource not supported: noted above */
        bench_note("%s: raw = %s", row->name, raw_names[i]);
        for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
            alloc_arg_t arg = {sizes[k], row->stream, row->res, env.ctx, row->pool};
            uint64_t total_before = 0;
            if (row->res) {
                cubuf_resource_stats_t s = CUBUF_RESOURCE_STATS_INIT;
                B_OK(cubuf_resource_stats(row->res, &s));
                total_before = s.total_allocations;
            }
            bench_case_t c = {
                .group = "alloc",
                .name = row->name,
                .size = sizes[k],
                .mode = BENCH_LATENCY,
                .stream = row->stream,
                .raw = row->raw,
                .lib = row->lib,
                .arg = &arg,
                .sample_s = 2e-3,
                .max_batch = 2000,
                .budget_s = 0.8,
                .min_pairs = 9,
                .max_pairs = 41,
                .target = BENCH_TARGET_LE,
                .bound = 1.10,
            };
            bench_compare(&env, &c);
            check_row(&env, row, sizes[k], total_before);
        }
    }

    bench_floors(&env, r_pool, default_pool, ctx_pool, sizes, sizeof sizes / sizeof sizes[0]);
    bench_adaptors(&env, r_pool, default_pool);

    B_CU(cuCtxSynchronize);
    if (host_pool) B_CU(cuMemPoolDestroy, host_pool);
    cubuf_resource_release(r_pool);
    cubuf_resource_release(r_sync);
    cubuf_resource_release(r_legacy);
    cubuf_resource_release(r_pinned);
    cubuf_resource_release(r_managed);
    int rc = bench_summary(&env, "bench_alloc");
    bench_fini(&env);
    return rc;
}
