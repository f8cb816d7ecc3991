/* The caching resource (cubuf/caching.h) against the raw driver pool pair
 * (cuMemAllocFromPoolAsync + cuMemFreeAsync), in one run:
 *  - one stream, allocate + free at 256 B, 4 KiB, 64 KiB, 1 MiB, 64 MiB:
 *    cubuf_caching_allocate/deallocate, the PyTorch entry points
 *    (cubuf_torch_alloc/free) and the generic raw-pointer interface
 *    (cubuf_resource_allocate_raw on the caching resource). Target: <= 0.15x
 *    the pool pair up to 1 MiB.
 *  - 8 threads on 8 streams against 1 thread: throughput of each side, its
 *    scaling, and cubuf against raw at 8 threads. Target: cubuf's 8 threads
 *    >= 6x its one thread.
 *  - across streams: ping-pong (allocate + free on A, then on B) and
 *    hand-off (allocate on A, free on B: every allocation takes its block
 *    back from B through an event).
 *  - a server's mixed pattern: 8 threads, each on its own stream, random
 *    sizes 256 B - 1 MiB, allocate + fill (cuMemsetD8Async) + free, both
 *    sides; target: cubuf >= 10x the pool's throughput.
 * Raw pools: private pools of device 0 with the release threshold at its
 * maximum (so the raw side is not charged for giving memory back at each
 * synchronization); cubuf's upstream is a cubuf private device pool. After
 * the run every cache is trimmed and its statistics must show no live
 * block (a leak is reported as an error). PyTorch's caching allocator is
 * measured by bench_torch_peer (bench/build_torch_peer.sh) at the same
 * sizes. */
#include <pthread.h>

#include "bench_common.h"
#include "cubuf/caching.h"

typedef struct arg {
    size_t size;
    CUstream stream, stream2;
    CUmemoryPool pool;
    cubuf_resource_t *cache;
    int device;
} arg_t;

static CUmemoryPool make_pool(const bench_env_t *env)
{
    CUmemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    props.handleTypes = CU_MEM_HANDLE_TYPE_NONE;
    props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    props.location.id = (int)env->dev;
    CUmemoryPool pool = NULL;
    B_CU(cuMemPoolCreate, &pool, &props);
    cuuint64_t keep = UINT64_MAX;
    B_CU(cuMemPoolSetAttribute, pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &keep);
    return pool;
}

static cubuf_resource_t *make_cache(void)
{
    cubuf_device_resource_options_t o = CUBUF_DEVICE_RESOURCE_OPTIONS_INIT;
    o.private_pool = true;
    cubuf_resource_t *pool = NULL, *cache = NULL;
    B_OK(cubuf_device_resource_create(0, &o, &pool));
    B_OK(cubuf_caching_resource_create(pool, NULL, &cache));
    cubuf_resource_release(pool); /* the cache holds it */
    return cache;
}

/* ---- one operation of each side ---- */

static void raw_pair(void *p)
{
    arg_t *a = p;
    CUdeviceptr d = 0;
    B_CU(cuMemAllocFromPoolAsync, &d, a->size, a->pool, a->stream);
    B_CU(cuMemFreeAsync, d, a->stream);
}

static void lib_cached(void *p)
{
    arg_t *a = p;
    CUdeviceptr d = 0;
    B_OK(cubuf_caching_allocate(a->cache, a->size, a->stream, &d));
    B_OK(cubuf_caching_deallocate(a->cache, d, a->size, a->stream));
}

static void lib_torch(void *p)
{
    arg_t *a = p;
    void *d = cubuf_torch_alloc(a->size, a->device, a->stream);
    if (!d) bench_die_st("cubuf_torch_alloc", CUBUF_ERROR_OUT_OF_MEMORY, __FILE__, __LINE__);
    cubuf_torch_free(d, a->size, a->device, a->stream);
}

static void lib_generic(void *p)
{
    arg_t *a = p;
    CUdeviceptr d = 0;
    B_OK(cubuf_resource_allocate_raw(a->cache, a->size, a->stream, &d));
    B_OK(cubuf_resource_deallocate_raw(a->cache, d, a->size, a->stream));
}

/* two streams: allocate + free on one, then on the other */
static void raw_pingpong(void *p)
{
    arg_t *a = p;
    CUdeviceptr d = 0;
    B_CU(cuMemAllocFromPoolAsync, &d, a->size, a->pool, a->stream);
    B_CU(cuMemFreeAsync, d, a->stream);
    B_CU(cuMemAllocFromPoolAsync, &d, a->size, a->pool, a->stream2);
    B_CU(cuMemFreeAsync, d, a->stream2);
}

static void lib_pingpong(void *p)
{
    arg_t *a = p;
    CUdeviceptr d = 0;
    B_OK(cubuf_caching_allocate(a->cache, a->size, a->stream, &d));
    B_OK(cubuf_caching_deallocate(a->cache, d, a->size, a->stream));
    B_OK(cubuf_caching_allocate(a->cache, a->size, a->stream2, &d));
    B_OK(cubuf_caching_deallocate(a->cache, d, a->size, a->stream2));
}

/* allocate on one stream, free on the other */
static void raw_handoff(void *p)
{
    arg_t *a = p;
    CUdeviceptr d = 0;
    B_CU(cuMemAllocFromPoolAsync, &d, a->size, a->pool, a->stream);
    B_CU(cuMemFreeAsync, d, a->stream2);
}

static void lib_handoff(void *p)
{
    arg_t *a = p;
    CUdeviceptr d = 0;
    B_OK(cubuf_caching_allocate(a->cache, a->size, a->stream, &d));
    B_OK(cubuf_caching_deallocate(a->cache, d, a->size, a->stream2));
}

static void row(bench_env_t *env, const char *group, const char *name, size_t size, arg_t *a,
                bench_op_fn raw, bench_op_fn lib, bench_target_kind_t kind, double bound)
{
    bench_case_t c = {
        .group = group,
        .name = name,
        .size = size,
        .mode = BENCH_LATENCY,
        .stream = a->stream,
        .raw = raw,
        .lib = lib,
        .arg = a,
        .sample_s = 2e-3,
        .max_batch = size >= 64 * BENCH_MIB ? 200 : 4000,
        .budget_s = 0.5,
        .min_pairs = 9,
        .max_pairs = 41,
        .target = kind,
        .bound = bound,
    };
    a->size = size;
    bench_compare(env, &c);
}

/* ---- threads ---- */

enum { OP_RAW, OP_LIB };

typedef struct job {
    int op;
    bool fill, random;
    size_t size;
    double seconds;
    long ops;
    CUcontext ctx;
    CUmemoryPool pool;
    cubuf_resource_t *cache;
    pthread_barrier_t *start;
    CUstream stream;
    uint64_t seed;
} job_t;

static void *job_main(void *p)
{
    job_t *j = p;
    B_CU(cuCtxSetCurrent, j->ctx);
    uint64_t x = j->seed;
    pthread_barrier_wait(j->start);
    double end = bench_now() + j->seconds;
    long i = 0;
    for (; (i & 63) || bench_now() < end; i++) {
        size_t size = j->size;
        if (j->random) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            size = 256 + (size_t)(x % (BENCH_MIB - 256 + 1));
        }
        CUdeviceptr d = 0;
        if (j->op == OP_RAW) B_CU(cuMemAllocFromPoolAsync, &d, size, j->pool, j->stream);
        else B_OK(cubuf_caching_allocate(j->cache, size, j->stream, &d));
        if (j->fill) B_CU(cuMemsetD8Async, d, 0xab, size, j->stream);
        if (j->op == OP_RAW) B_CU(cuMemFreeAsync, d, j->stream);
        else B_OK(cubuf_caching_deallocate(j->cache, d, size, j->stream));
        if (j->fill && i % 64 == 63) B_CU(cuStreamSynchronize, j->stream); /* a bounded queue */
    }
    B_CU(cuStreamSynchronize, j->stream);
    j->ops = i;
    return NULL;
}

/* Operations per second of `n` threads, each on its own stream, each running
 * for `seconds`; the median of 5 runs. */
static double throughput(bench_env_t *env, int n, int op, bool fill, bool random, size_t size,
                         double seconds, CUmemoryPool pool, cubuf_resource_t *cache,
                         CUstream *streams)
{
    double rate[5];
    for (int r = 0; r < 5; r++) {
        pthread_barrier_t start;
        pthread_barrier_init(&start, NULL, (unsigned)n + 1);
        pthread_t th[8];
        job_t jobs[8];
        for (int i = 0; i < n; i++) {
            jobs[i] = (job_t){op, fill, random, size, seconds, 0, env->cu_ctx, pool, cache, &start,
                              streams[i], 0x9E3779B97F4A7C15ULL * (uint64_t)(i + 1 + 16 * r)};
            if (pthread_create(&th[i], NULL, job_main, &jobs[i]) != 0) {
                fprintf(stderr, "error: pthread_create failed\n");
                exit(1);
            }
        }
        pthread_barrier_wait(&start);
        double t0 = bench_now();
        long ops = 0;
        for (int i = 0; i < n; i++) {
            pthread_join(th[i], NULL);
            ops += jobs[i].ops;
        }
        rate[r] = (double)ops / (bench_now() - t0);
        pthread_barrier_destroy(&start);
    }
    return bench_median(rate, 5);
}

static void thread_rows(bench_env_t *env, const char *what, bool fill, bool random, size_t size,
                        double seconds, CUmemoryPool pool, cubuf_resource_t *cache, CUstream *streams,
                        double *raw8_out, double *lib8_out, double *lib1_out)
{
    /* warm both sides: the cache fills its lists, the pool its memory */
    throughput(env, 8, OP_RAW, fill, random, size, seconds / 2, pool, cache, streams);
    throughput(env, 8, OP_LIB, fill, random, size, seconds / 2, pool, cache, streams);
    double raw1 = throughput(env, 1, OP_RAW, fill, random, size, seconds, pool, cache, streams);
    double lib1 = throughput(env, 1, OP_LIB, fill, random, size, seconds, pool, cache, streams);
    double raw8 = throughput(env, 8, OP_RAW, fill, random, size, seconds, pool, cache, streams);
    double lib8 = throughput(env, 8, OP_LIB, fill, random, size, seconds, pool, cache, streams);
    printf("%-40s raw: 1 thread %10.0f ops/s (%8.3f us/op), 8 threads %10.0f ops/s (%.2fx of 1)\n",
           what, raw1, 1e6 / raw1, raw8, raw8 / raw1);
    printf("%-40s cubuf: 1 thread %10.0f ops/s (%8.3f us/op), 8 threads %10.0f ops/s (%.2fx of 1)\n",
           "", lib1, 1e6 / lib1, lib8, lib8 / lib1);
    printf("%-40s cubuf/raw throughput: 1 thread %.2fx, 8 threads %.2fx\n", "", lib1 / raw1,
           lib8 / raw8);
    fflush(stdout);
    *raw8_out = raw8;
    *lib8_out = lib8;
    *lib1_out = lib1;
}

/* Every cache ends with no live block. */
static void check_clean(bench_env_t *env, cubuf_resource_t *cache, const char *what)
{
    B_CU(cuCtxSynchronize);
    cubuf_caching_stats_t s = CUBUF_CACHING_STATS_INIT;
    B_OK(cubuf_caching_stats(cache, &s));
    if (s.live_count || s.live_bytes)
        bench_error(env, "%s: %zu blocks (%zu bytes) still live", what, s.live_count, s.live_bytes);
    printf("   %s: %llu hits, %llu cross-stream, %llu misses, %llu upstream allocations, peak %zu bytes held\n",
           what, (unsigned long long)s.hits, (unsigned long long)s.cross_stream_reuses,
           (unsigned long long)s.misses, (unsigned long long)s.upstream_allocations,
           s.peak_held_bytes);
}

int main(void)
{
    bench_env_t env;
    bench_init(&env, "bench_caching");
    CUmemoryPool pool = make_pool(&env);
    cubuf_resource_t *cache = make_cache(), *fw = NULL;
    B_OK(cubuf_framework_resource(0, &fw));
    CUstream s2 = NULL;
    B_CU(cuStreamCreate, &s2, CU_STREAM_NON_BLOCKING);
    arg_t a = {0, env.stream, s2, pool, cache, 0};
    static const size_t sizes[] = {256, 4 * BENCH_KIB, 64 * BENCH_KIB, BENCH_MIB, 64 * BENCH_MIB};

    bench_section("one stream: allocate + free, raw = cuMemAllocFromPoolAsync + cuMemFreeAsync");
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
        bool t = sizes[i] <= BENCH_MIB;
        row(&env, "cached", "caching_allocate", sizes[i], &a, raw_pair, lib_cached,
            t ? BENCH_TARGET_LE : BENCH_TARGET_NONE, 0.15);
        a.cache = fw;
        row(&env, "cached", "torch_alloc", sizes[i], &a, raw_pair, lib_torch,
            t ? BENCH_TARGET_LE : BENCH_TARGET_NONE, 0.15);
        a.cache = cache;
        row(&env, "cached", "resource_allocate_raw", sizes[i], &a, raw_pair, lib_generic,
            BENCH_TARGET_NONE, 0);
    }

    bench_section("across streams (informational)");
    for (size_t i = 1; i < 4; i++) {
        row(&env, "cross", "pingpong_2_streams", sizes[i], &a, raw_pingpong, lib_pingpong,
            BENCH_TARGET_NONE, 0);
        row(&env, "cross", "alloc_A_free_B", sizes[i], &a, raw_handoff, lib_handoff,
            BENCH_TARGET_NONE, 0);
    }
    check_clean(&env, cache, "one-stream and cross-stream cache");
    check_clean(&env, fw, "framework cache (torch_alloc rows)");

    CUstream streams[8];
    for (int i = 0; i < 8; i++) B_CU(cuStreamCreate, &streams[i], CU_STREAM_NON_BLOCKING);
    double raw8, lib8, lib1;
    printf("\n== threads: each on its own stream (ops/s are allocate + free [+ fill] per second, all threads)\n");
    cubuf_resource_t *tcache = make_cache();
    thread_rows(&env, "allocate + free, 4 KiB", false, false, 4 * BENCH_KIB, 0.2, pool, tcache,
                streams, &raw8, &lib8, &lib1);
    bench_add_target("threads/8_threads_vs_1/4KiB", lib8 / lib1, BENCH_TARGET_GE, 6.0);
    bench_add_target("threads/8_threads_vs_raw/4KiB", lib8 / raw8, BENCH_TARGET_GE, 10.0);
    thread_rows(&env, "server: random 256 B-1 MiB, alloc+free", false, true, 0, 0.2, pool,
                tcache, streams, &raw8, &lib8, &lib1);
    bench_add_target("server/8_threads_vs_raw/no_fill", lib8 / raw8, BENCH_TARGET_GE, 10.0);
    thread_rows(&env, "server: random 256 B-1 MiB, alloc+fill+free", true, true, 0, 0.3, pool,
                tcache, streams, &raw8, &lib8, &lib1);
    bench_add_target("server/8_threads_vs_raw/fill", lib8 / raw8, BENCH_TARGET_GE, 10.0);
    check_clean(&env, tcache, "threads cache");

    for (int i = 0; i < 8; i++) {
        B_OK(cubuf_caching_forget_stream(tcache, streams[i]));
        B_CU(cuStreamDestroy, streams[i]);
    }
    B_OK(cubuf_caching_forget_stream(cache, s2));
    B_OK(cubuf_caching_forget_stream(cache, env.stream));
    B_OK(cubuf_caching_forget_stream(fw, env.stream));
    B_CU(cuStreamDestroy, s2);
    cubuf_resource_release(tcache);
    cubuf_resource_release(cache);
    B_CU(cuCtxSynchronize);
    B_CU(cuMemPoolDestroy, pool);
    int rc = bench_summary(&env, "bench_caching");
    bench_fini(&env);
    return rc;
}
