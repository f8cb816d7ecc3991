/* The caching resource over device pools: reuse on one stream with the bytes
 * read back; reuse across streams while a copy on the freeing stream still
 * reads the block (held back by a host-function gate, so the order is
 * deterministic), with the same pattern without the cache showing the
 * corruption the ordering prevents; capture served or refused without
 * breaking it; out-of-memory release-and-retry and trim with the memory
 * back in the pool; a failure of every driver call in turn leaving nothing
 * leaked; 16 threads on 16 streams with exact totals. */
#include <pthread.h>
#include <unistd.h>
#include <sched.h>
#include <stdint.h>
#include <time.h>

#include "cubuf/caching.h"
#include "test.h"

static CUcontext g_ctx;

static CUstream new_stream(void)
{
    CUstream s = NULL;
    T_CU(cuStreamCreate, &s, CU_STREAM_NON_BLOCKING);
    return s;
}

static cubuf_resource_t *private_pool(size_t max_size)
{
    cubuf_device_resource_options_t o = CUBUF_DEVICE_RESOURCE_OPTIONS_INIT;
    o.private_pool = true;
    o.max_size = max_size;
    cubuf_resource_t *r = NULL;
    T_REQUIRE(cubuf_device_resource_create(0, &o, &r));
    return r;
}

static cubuf_resource_stats_t pool_stats(cubuf_resource_t *pool)
{
    cubuf_resource_stats_t s = CUBUF_RESOURCE_STATS_INIT;
    T_CU(cuCtxSynchronize);
    T_OK(cubuf_resource_stats(pool, &s));
    return s;
}

static cubuf_caching_stats_t cstats(cubuf_resource_t *c)
{
    cubuf_caching_stats_t s = CUBUF_CACHING_STATS_INIT;
    T_OK(cubuf_caching_stats(c, &s));
    return s;
}

/* Every word of n bytes at p (device) equals v. */
static bool words_are(CUdeviceptr p, size_t n, uint32_t v)
{
    uint32_t *h = malloc(n);
    T_CHECK(h != NULL);
    if (!h) return false;
    T_CU(cuMemcpyDtoH, h, p, n);
    size_t bad = 0;
    for (size_t i = 0; i < n / 4; i++) bad += h[i] != v;
    if (bad) fprintf(stderr, "%zu of %zu words differ from 0x%08x (first word 0x%08x)\n", bad, n / 4, v, h[0]);
    free(h);
    return bad == 0;
}

static void test_one_stream(void)
{
    cubuf_resource_t *pool = private_pool(0), *c = NULL;
    T_REQUIRE(cubuf_caching_resource_create(pool, NULL, &c));
    CUstream s = new_stream();
    const size_t n = 1 << 20;
    CUdeviceptr a = 0, b = 0;
    T_OK(cubuf_caching_allocate(c, n, s, &a));
    T_CU(cuMemsetD32Async, a, 0x11111111u, n / 4, s);
    T_OK(cubuf_caching_deallocate(c, a, n, s));
    T_OK(cubuf_caching_allocate(c, n - 100, s, &b)); /* same class, same stream: no driver call */
    T_CHECK(b == a);
    T_CU(cuMemsetD32Async, b + n / 2, 0x22222222u, n / 8, s);
    T_CU(cuStreamSynchronize, s);
    T_CHECK(words_are(b, n / 2, 0x11111111u) && words_are(b + n / 2, n / 2, 0x22222222u));
    cubuf_caching_stats_t st = cstats(c);
    T_CHECK(st.hits == 1 && st.misses == 1 && st.upstream_allocations == 1);
    T_CHECK(pool_stats(pool).current_count == 1);
    /* through the generic layer: a buffer of the cache */
    T_OK(cubuf_caching_deallocate(c, b, n - 100, s));
    cubuf_buffer_t *buf = NULL;
    T_OK(cubuf_resource_allocate(c, n, s, &buf));
    T_CHECK(cubuf_buffer_ptr(buf) == a);
    T_OK(cubuf_buffer_fill_byte(buf, 0x33, s));
    T_CU(cuStreamSynchronize, s);
    T_CHECK(words_are(a, n, 0x33333333u));
    T_OK(cubuf_buffer_close(buf));
    cubuf_buffer_release(buf);
    T_OK(cubuf_caching_forget_stream(c, s));
    T_CU(cuStreamDestroy, s);
    cubuf_resource_release(c);
    cubuf_resource_stats_t ps = pool_stats(pool);
    T_CHECK(ps.current_count == 0 && ps.pool_used_current == 0);
    cubuf_resource_release(pool);
}

/* ---- across streams ---- */

static atomic_int g_gate, g_gate_expired, g_gate_deadline_s = 20;

/* Waits for the flag, for g_gate_deadline_s at most: a test whose gate never
 * opens fails (g_gate_expired) instead of hanging. */
static void CUDA_CB gate_fn(void *arg)
{
    (void)arg;
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    while (!atomic_load(&g_gate)) {
        clock_gettime(CLOCK_MONOTONIC, &t);
        if (t.tv_sec - t0.tv_sec >= atomic_load(&g_gate_deadline_s)) {
            atomic_store(&g_gate_expired, 1);
            return;
        }
        sched_yield();
    }
}

/* Holds stream `a` back until open_gate: a host function on `g` that waits
 * for the flag, and `a` waiting for `g`. */
static CUevent close_gate(CUstream g, CUstream a)
{
    CUevent e = NULL;
    atomic_store(&g_gate, 0);
    T_CU(cuEventCreate, &e, CU_EVENT_DISABLE_TIMING);
    T_CU(cuLaunchHostFunc, g, gate_fn, NULL);
    T_CU(cuEventRecord, e, g);
    T_CU(cuStreamWaitEvent, a, e, 0);
    return e;
}

static void open_gate(CUevent e, CUstream g)
{
    atomic_store(&g_gate, 1);
    T_CU(cuStreamSynchronize, g);
    T_CU(cuEventDestroy, e);
}

static void test_cross_stream(void)
{
    cubuf_resource_t *pool = private_pool(0), *c = NULL;
    T_REQUIRE(cubuf_caching_resource_create(pool, NULL, &c));
    CUstream a = new_stream(), b = new_stream(), g = new_stream();
    const size_t n = 1 << 20;
    CUdeviceptr dst = 0, x = 0, x2 = 0, y = 0, y2 = 0;
    T_CU(cuMemAlloc, &dst, n);
    T_CU(cuMemsetD32Async, dst, 0, n / 4, a);
    T_OK(cubuf_caching_allocate(c, n, a, &x));
    T_OK(cubuf_caching_allocate(c, n, a, &x2));
    T_CU(cuMemsetD32Async, x, 0x11111111u, n / 4, a);
    T_CU(cuStreamSynchronize, a);

    /* a copy on `a` still has to read x when `b` takes it (a caches two
     * blocks of the class, so b takes the one freed last: x) */
    CUevent e = close_gate(g, a);
    T_CU(cuMemcpyAsync, dst, x, n, a);
    T_OK(cubuf_caching_deallocate(c, x2, n, a));
    T_OK(cubuf_caching_deallocate(c, x, n, a));
    T_OK(cubuf_caching_allocate(c, n, b, &y));
    T_CHECK(y == x && cstats(c).cross_stream_reuses == 1);
    T_CU(cuMemsetD32Async, y, 0xdeadbeefu, n / 4, b);
    /* b waits for a, which waits for the gate */
    T_CHECK(cubuf__drv.cuStreamQuery(b) == CUDA_ERROR_NOT_READY);
    open_gate(e, g);
    T_CU(cuStreamSynchronize, a);
    T_CU(cuStreamSynchronize, b);
    T_CHECK(words_are(dst, n, 0x11111111u)); /* the copy read x before b wrote it */
    T_CHECK(words_are(y, n, 0xdeadbeefu));

    /* the same pattern without the ordering: the copy reads b's bytes */
    T_CU(cuMemsetD32Async, y, 0x11111111u, n / 4, a);
    T_CU(cuMemsetD32Async, dst, 0, n / 4, a);
    T_CU(cuStreamSynchronize, a);
    e = close_gate(g, a);
    T_CU(cuMemcpyAsync, dst, y, n, a);
    T_CU(cuMemsetD32Async, y, 0xdeadbeefu, n / 4, b);
    T_CU(cuStreamSynchronize, b);
    open_gate(e, g);
    T_CU(cuStreamSynchronize, a);
    T_CHECK(words_are(dst, n, 0xdeadbeefu)); /* what the cache's event prevents */

    /* a's last block stays a's: b asks the pool */
    T_OK(cubuf_caching_allocate(c, n, b, &y2));
    T_CHECK(y2 != x2 && cstats(c).cross_stream_reuses == 1 && cstats(c).misses == 3);
    T_OK(cubuf_caching_deallocate(c, y2, n, b));
    T_OK(cubuf_caching_deallocate(c, y, n, b));
    T_CU(cuMemFree, dst);
    T_OK(cubuf_caching_forget_stream(c, a));
    T_OK(cubuf_caching_forget_stream(c, b));
    CUstream ss[3] = {a, b, g};
    for (int i = 0; i < 3; i++) T_CU(cuStreamDestroy, ss[i]);
    cubuf_resource_release(c);
    T_CHECK(pool_stats(pool).pool_used_current == 0);
    cubuf_resource_release(pool);
}

/* ---- capture: a hit is served, a miss refused, the capture intact ---- */

static void test_capture(void)
{
    cubuf_resource_t *pool = private_pool(0), *c = NULL;
    T_REQUIRE(cubuf_caching_resource_create(pool, NULL, &c));
    CUstream s = new_stream();
    CUdeviceptr a = 0, b = 0, d = 0;
    T_OK(cubuf_caching_allocate(c, 4096, s, &a));
    T_OK(cubuf_caching_deallocate(c, a, 4096, s));
    T_CU(cuStreamSynchronize, s);
    T_CU(cuStreamBeginCapture, s, CU_STREAM_CAPTURE_MODE_GLOBAL);
    T_OK(cubuf_caching_allocate(c, 4096, s, &b)); /* a hit */
    T_CHECK(b == a);
    T_STATUS(cubuf_caching_allocate(c, 8192, s, &d), CUBUF_ERROR_STREAM_CAPTURING);
    CUstreamCaptureStatus cs = CU_STREAM_CAPTURE_STATUS_NONE;
    T_CU(cuStreamIsCapturing, s, &cs);
    T_CHECK(cs == CU_STREAM_CAPTURE_STATUS_ACTIVE);
    T_OK(cubuf_caching_deallocate(c, b, 4096, s)); /* back to s's list, no driver call */
    CUgraph graph = NULL;
    T_CU(cuStreamEndCapture, s, &graph);
    T_CHECK(graph != NULL);
    if (graph) T_CU(cuGraphDestroy, graph);
    T_CHECK(cstats(c).cached_count == 1);
    T_OK(cubuf_caching_forget_stream(c, s));
    T_CU(cuStreamDestroy, s);
    cubuf_resource_release(c);
    cubuf_resource_release(pool);
}

/* Two blocks of `size` allocated on `stream` and cached there, the stream
 * synchronized after: what a later capture or steal finds. */
static void cache_pair(cubuf_resource_t *c, CUstream stream, size_t size)
{
    CUdeviceptr a = 0, b = 0;
    T_OK(cubuf_caching_allocate(c, size, stream, &a));
    T_OK(cubuf_caching_allocate(c, size, stream, &b));
    T_OK(cubuf_caching_deallocate(c, a, size, stream));
    T_OK(cubuf_caching_deallocate(c, b, size, stream));
    T_CU(cuCtxSynchronize);
}

/* The capture on `stream` is still active and ends cleanly (nothing from
 * outside it was put into it). */
static void end_capture_ok(CUstream stream)
{
    CUstreamCaptureStatus cs = CU_STREAM_CAPTURE_STATUS_NONE;
    T_CU(cuStreamIsCapturing, stream, &cs);
    T_CHECK(cs == CU_STREAM_CAPTURE_STATUS_ACTIVE);
    CUgraph graph = NULL;
    T_CHECK(cubuf__drv.cuStreamEndCapture(stream, &graph) == CUDA_SUCCESS);
    if (graph) T_CU(cuGraphDestroy, graph);
}

/* Ends t's capture (checked intact), then gives every block back, forgets
 * and destroys both streams: the blocks kept for the capture go now. */
static void end_and_drain(cubuf_resource_t *c, CUstream t, CUstream s)
{
    end_capture_ok(t);
    T_OK(cubuf_caching_trim(c, 0));
    T_CHECK(cstats(c).cached_count == 0);
    T_OK(cubuf_caching_forget_stream(c, t));
    T_OK(cubuf_caching_forget_stream(c, s));
    T_CU(cuStreamDestroy, t);
    T_CU(cuStreamDestroy, s);
}

/* A trim while a stream that holds cached blocks captures: their frees
 * would be nodes of the capture (freeing nothing now), so they stay cached
 * and the trim says so; once the capture ends they go. */
static void test_trim_while_capturing(void)
{
    cubuf_resource_t *pool = private_pool(0), *c = NULL;
    T_REQUIRE(cubuf_caching_resource_create(pool, NULL, &c));
    CUstream t = new_stream(), s = new_stream();
    cache_pair(c, t, 4096);
    cache_pair(c, s, 65536);
    T_CHECK(cstats(c).cached_count == 4);
    T_CU(cuStreamBeginCapture, t, CU_STREAM_CAPTURE_MODE_RELAXED);
    T_STATUS(cubuf_caching_trim(c, 0), CUBUF_ERROR_STREAM_CAPTURING);
    T_CHECK(strstr(cubuf_last_error(), "while it captures") != NULL);
    cubuf_caching_stats_t st = cstats(c);
    T_CHECK(st.cached_count == 2 && st.cached_bytes == 2 * 4096); /* s's blocks went, t's stayed */
    end_and_drain(c, t, s);
    cubuf_resource_release(c);
    cubuf_resource_release(pool);
}

/* A free past the release threshold on a capturing stream: the upstream's
 * free would be a node of the capture (the pool refuses it), so the block
 * is cached past the threshold, the free succeeds and the capture stays
 * intact; a trim after the capture gives everything back. */
static void test_threshold_while_capturing(void)
{
    cubuf_resource_t *pool = private_pool(0), *c = NULL;
    cubuf_caching_options_t o = CUBUF_CACHING_OPTIONS_INIT;
    o.release_threshold = 4096;
    T_REQUIRE(cubuf_caching_resource_create(pool, &o, &c));
    CUstream s = new_stream();
    CUdeviceptr a = 0, b = 0, d = 0;
    T_OK(cubuf_caching_allocate(c, 4096, s, &a));
    T_OK(cubuf_caching_allocate(c, 4096, s, &b));
    T_OK(cubuf_caching_allocate(c, 4096, s, &d));
    T_OK(cubuf_caching_deallocate(c, a, 4096, s)); /* within the threshold: cached */
    T_OK(cubuf_caching_deallocate(c, d, 4096, s)); /* past it, not capturing: upstream */
    cubuf_caching_stats_t st = cstats(c);
    T_CHECK(st.cached_count == 1 && st.upstream_deallocations == 1);
    T_CU(cuStreamSynchronize, s);
    T_CU(cuStreamBeginCapture, s, CU_STREAM_CAPTURE_MODE_RELAXED);
    T_OK(cubuf_caching_deallocate(c, b, 4096, s)); /* past it, capturing: cached */
    st = cstats(c);
    T_CHECK(st.cached_count == 2 && st.cached_bytes == 8192 && st.live_count == 0);
    T_CHECK(st.upstream_deallocations == 1);
    end_capture_ok(s);
    T_OK(cubuf_caching_trim(c, 0));
    T_CHECK(cstats(c).cached_count == 0 && pool_stats(pool).pool_used_current == 0);
    T_OK(cubuf_caching_forget_stream(c, s));
    T_CU(cuStreamDestroy, s);
    cubuf_resource_release(c);
    cubuf_resource_release(pool);
}

/* A trim that meets both a stream that captures (its blocks stay) and a
 * free that fails reports the failure, with its own detail and CUresult,
 * in whichever order it visits the two streams. */
static void test_trim_failure_order(void)
{
    cubuf_resource_t *pool = private_pool(0);
    for (int order = 0; order < 2; order++) {
        cubuf_resource_t *c = NULL;
        T_REQUIRE(cubuf_caching_resource_create(pool, NULL, &c));
        CUstream t = new_stream(), s = new_stream();
        if (order) cache_pair(c, s, 65536);
        cache_pair(c, t, 4096);
        if (!order) cache_pair(c, s, 65536);
        T_CU(cuStreamBeginCapture, t, CU_STREAM_CAPTURE_MODE_RELAXED);
        T_CHECK(cubuf_fault_fail_nth("cuMemFreeAsync", 1, CUDA_ERROR_UNKNOWN));
        T_STATUS(cubuf_caching_trim(c, 0), CUBUF_ERROR_DRIVER);
        T_CHECK(cubuf_fault_fired());
        cubuf_fault_reset();
        T_CHECK(strstr(cubuf_last_error(), "CUDA_ERROR_UNKNOWN") != NULL);
        T_CHECK(cubuf_last_cuda_result() == CUDA_ERROR_UNKNOWN);
        T_CHECK(cstats(c).cached_count == 4); /* t's kept, s's first free failed */
        end_and_drain(c, t, s);
        cubuf_resource_release(c);
    }
    T_CHECK(pool_stats(pool).pool_used_current == 0);
    cubuf_resource_release(pool);
}

/* Blocks cached on a stream before its capture began: another stream's miss
 * must not take them with an event recorded into that capture (waiting on
 * it makes the other stream join the capture, whose end then fails). */
static void test_steal_from_capturing(void)
{
    cubuf_resource_t *pool = private_pool(0), *c = NULL;
    T_REQUIRE(cubuf_caching_resource_create(pool, NULL, &c));
    CUstream t = new_stream(), s = new_stream();
    CUdeviceptr d = 0;
    cache_pair(c, t, 4096); /* t caches two of the class */
    T_CU(cuStreamBeginCapture, t, CU_STREAM_CAPTURE_MODE_RELAXED);
    T_OK(cubuf_caching_allocate(c, 4096, s, &d)); /* s does not capture */
    CUstreamCaptureStatus cs = CU_STREAM_CAPTURE_STATUS_NONE;
    T_CU(cuStreamIsCapturing, s, &cs);
    T_CHECK(cs == CU_STREAM_CAPTURE_STATUS_NONE); /* s has not joined t's capture */
    end_capture_ok(t);
    T_CU(cuStreamIsCapturing, s, &cs);
    if (cs == CU_STREAM_CAPTURE_STATUS_NONE) {
        T_CU(cuMemsetD32Async, d, 7u, 1024, s);
        T_CU(cuStreamSynchronize, s);
        T_CHECK(words_are(d, 4096, 7u));
    }
    T_OK(cubuf_caching_deallocate(c, d, 4096, s));
    /* blocks on the legacy stream while a blocking stream captures: an
     * event recorded on the legacy stream would invalidate that capture */
    CUstream bl = NULL;
    T_CU(cuStreamCreate, &bl, CU_STREAM_DEFAULT);
    cache_pair(c, NULL, 8192);
    T_CU(cuStreamBeginCapture, bl, CU_STREAM_CAPTURE_MODE_RELAXED);
    T_OK(cubuf_caching_allocate(c, 8192, s, &d));
    end_capture_ok(bl); /* not invalidated */
    T_OK(cubuf_caching_deallocate(c, d, 8192, s));
    T_OK(cubuf_caching_forget_stream(c, NULL));
    T_CU(cuStreamDestroy, bl);
    T_OK(cubuf_caching_forget_stream(c, t));
    T_OK(cubuf_caching_forget_stream(c, s));
    T_CU(cuStreamDestroy, t);
    T_CU(cuStreamDestroy, s);
    cubuf_resource_release(c);
    cubuf_resource_release(pool);
}

/* ---- out of memory, trim, memory back ---- */

static void test_oom_trim(void)
{
    const size_t max = 64u << 20, big = 15u << 20, small = 7u << 20;
    cubuf_resource_t *pool = private_pool(max), *c = NULL;
    CUstream s = new_stream();
    /* how many big blocks the pool holds */
    CUdeviceptr p[16] = {0};
    int nbig = 0;
    while (nbig < 16 && cubuf_resource_allocate_raw(pool, big, s, &p[nbig]) == CUBUF_SUCCESS) nbig++;
    for (int i = 0; i < nbig; i++) T_OK(cubuf_resource_deallocate_raw(pool, p[i], big, s));
    T_CU(cuStreamSynchronize, s);
    T_OK(cubuf_resource_trim(pool, 0));
    T_CHECK(nbig >= 2 && nbig < 16);
    T_REQUIRE(cubuf_caching_resource_create(pool, NULL, &c));
    for (int i = 0; i < nbig; i++) T_OK(cubuf_caching_allocate(c, big, s, &p[i]));
    for (int i = 0; i < nbig; i++) T_OK(cubuf_caching_deallocate(c, p[i], big, s));
    T_CHECK(cstats(c).cached_bytes == (size_t)nbig * big);
    /* another class: the pool is full of cached blocks until the cache lets go */
    CUdeviceptr q[16] = {0};
    int nsmall = 0;
    cubuf_status_t st = CUBUF_SUCCESS;
    while (nsmall < 16 && cstats(c).oom_retries == 0 &&
           (st = cubuf_caching_allocate(c, small, s, &q[nsmall])) == CUBUF_SUCCESS)
        nsmall++;
    T_OK(st);
    cubuf_caching_stats_t cs = cstats(c);
    T_CHECK(cs.oom_retries == 1 && cs.cached_bytes == 0 && cs.live_count == (size_t)nsmall);
    for (int i = 0; i < nsmall; i++) T_CU(cuMemsetD32Async, q[i], 0x5a5a5a5au, small / 4, s);
    T_CU(cuStreamSynchronize, s);
    for (int i = 0; i < nsmall; i++) T_CHECK(words_are(q[i], small, 0x5a5a5a5au));
    /* everything live and nothing to release: the report */
    CUdeviceptr r[16] = {0};
    int nr = 0;
    while (nr < 16 && (st = cubuf_caching_allocate(c, small, s, &r[nr])) == CUBUF_SUCCESS) nr++;
    T_STATUS(st, CUBUF_ERROR_OUT_OF_MEMORY);
    T_CHECK(strstr(cubuf_last_error(), "bytes requested") && strstr(cubuf_last_error(), "largest free block"));
    for (int i = 0; i < nr; i++) T_OK(cubuf_caching_deallocate(c, r[i], small, s));
    for (int i = 0; i < nsmall; i++) T_OK(cubuf_caching_deallocate(c, q[i], small, s));
    /* trim: the pool's used memory goes to 0, then the pool gives it to the device */
    T_CHECK(pool_stats(pool).pool_used_current > 0);
    T_OK(cubuf_caching_trim(c, 0));
    T_CHECK(cstats(c).cached_bytes == 0 && cstats(c).held_bytes == 0);
    cubuf_resource_stats_t ps = pool_stats(pool);
    T_CHECK(ps.pool_used_current == 0 && ps.current_count == 0);
    T_OK(cubuf_resource_trim(pool, 0));
    T_CHECK(pool_stats(pool).pool_reserved_current == 0);
    T_CU(cuStreamDestroy, s);
    cubuf_resource_release(c);
    cubuf_resource_release(pool);
}

/* Blocks cached on another thread's per-thread stream, which only that
 * thread can name: release-and-retry frees them on the legacy stream (which
 * waits for that stream), then synchronizes the legacy stream so that
 * the frees have run before the retry (on another stream, which could not
 * take memory whose free is still pending). */
typedef struct per_thread_fill {
    cubuf_resource_t *c;
    size_t size;
    int n;
    bool ok;
} per_thread_fill_t;

static void *fill_per_thread(void *arg)
{
    per_thread_fill_t *f = arg;
    CUdeviceptr p[16] = {0};
    f->ok = cubuf__drv.cuCtxSetCurrent(g_ctx) == CUDA_SUCCESS;
    for (int i = 0; f->ok && i < f->n; i++)
        f->ok = cubuf_caching_allocate(f->c, f->size, CU_STREAM_PER_THREAD, &p[i]) == CUBUF_SUCCESS;
    for (int i = 0; i < f->n; i++)
        if (p[i] && cubuf_caching_deallocate(f->c, p[i], f->size, CU_STREAM_PER_THREAD) != CUBUF_SUCCESS)
            f->ok = false;
    if (cubuf__drv.cuStreamSynchronize(CU_STREAM_PER_THREAD) != CUDA_SUCCESS) f->ok = false;
    return NULL;
}

static void test_oom_foreign_per_thread(void)
{
    const size_t max = 64u << 20, big = 15u << 20, small = 7u << 20;
    cubuf_resource_t *pool = private_pool(max), *c = NULL;
    CUstream s = new_stream();
    /* how many big blocks the pool holds (its granularity is the driver's) */
    CUdeviceptr p[16] = {0};
    int nbig = 0;
    while (nbig < 16 && cubuf_resource_allocate_raw(pool, big, s, &p[nbig]) == CUBUF_SUCCESS) nbig++;
    for (int i = 0; i < nbig; i++) T_OK(cubuf_resource_deallocate_raw(pool, p[i], big, s));
    T_CU(cuStreamSynchronize, s);
    T_OK(cubuf_resource_trim(pool, 0));
    T_CHECK(nbig >= 2 && nbig < 16);
    T_REQUIRE(cubuf_caching_resource_create(pool, NULL, &c));
    per_thread_fill_t f = {c, big, nbig, false};
    pthread_t th;
    T_CHECK(pthread_create(&th, NULL, fill_per_thread, &f) == 0);
    pthread_join(th, NULL);
    T_CHECK(f.ok && cstats(c).cached_bytes == (size_t)f.n * big);
    /* another class on s: the pool is full of the other thread's blocks */
    CUdeviceptr q[16] = {0};
    int nq = 0;
    cubuf_status_t st = CUBUF_SUCCESS;
    cubuf_fault_count_calls(true);
    while (nq < 16 && cstats(c).oom_retries == 0 &&
           (st = cubuf_caching_allocate(c, small, s, &q[nq])) == CUBUF_SUCCESS)
        nq++;
    const unsigned long syncs = cubuf_fault_calls("cuStreamSynchronize");
    cubuf_fault_count_calls(false);
    T_OK(st);
    cubuf_caching_stats_t cs = cstats(c);
    T_CHECK(cs.oom_retries == 1 && cs.cached_bytes == 0 && cs.live_count == (size_t)nq);
    T_CHECK(syncs >= 1); /* the legacy stream, after its frees */
    for (int i = 0; i < nq; i++) T_CU(cuMemsetD32Async, q[i], 0x3c3c3c3cu, small / 4, s);
    T_CU(cuStreamSynchronize, s);
    for (int i = 0; i < nq; i++) T_CHECK(words_are(q[i], small, 0x3c3c3c3cu));
    for (int i = 0; i < nq; i++) T_OK(cubuf_caching_deallocate(c, q[i], small, s));
    T_OK(cubuf_caching_trim(c, 0));
    T_CHECK(pool_stats(pool).pool_used_current == 0);
    T_OK(cubuf_caching_forget_stream(c, s));
    T_CU(cuStreamDestroy, s);
    cubuf_resource_release(c);
    cubuf_resource_release(pool);
}

/* A trim and the resource's end while a stream the cache never saw
 * captures, with blocks cached on another thread's per-thread stream whose
 * last use is still held back by a gate: the frees go on the legacy stream,
 * ordered after that use, with no context synchronization (which would
 * invalidate the capture, and wait for the gate).
 *
 * compute-sanitizer's memcheck makes a stream-ordered free wait for the
 * stream's work (on the H200 the trim returned only when the gate gave up),
 * so under it (CUBUF_TEST_SANITIZER=1, which tools/gpu_suite.sh sets) the
 * gate gives up after 2 s and the legacy stream may be done by then; the
 * capture and the pool's totals are checked all the same. */
typedef struct gated_fill {
    cubuf_resource_t *c;
    CUdeviceptr p;
    bool ok;
} gated_fill_t;

static void *gated_per_thread(void *arg)
{
    gated_fill_t *f = arg;
    f->ok = cubuf__drv.cuCtxSetCurrent(g_ctx) == CUDA_SUCCESS &&
            cubuf_caching_allocate(f->c, 4096, CU_STREAM_PER_THREAD, &f->p) == CUBUF_SUCCESS &&
            cubuf__drv.cuLaunchHostFunc(CU_STREAM_PER_THREAD, gate_fn, NULL) == CUDA_SUCCESS &&
            cubuf__drv.cuMemsetD32Async(f->p, 0x5a5a5a5au, 1024, CU_STREAM_PER_THREAD) ==
                CUDA_SUCCESS &&
            cubuf_caching_deallocate(f->c, f->p, 4096, CU_STREAM_PER_THREAD) == CUBUF_SUCCESS;
    return NULL;
}

static void test_foreign_per_thread_while_capturing(void)
{
    const char *san = getenv("CUBUF_TEST_SANITIZER");
    bool sanitizer = san && *san && strcmp(san, "0") != 0;
    if (sanitizer) atomic_store(&g_gate_deadline_s, 2);
    for (int end = 0; end < 2; end++) {
        cubuf_resource_t *pool = private_pool(0), *c = NULL;
        T_REQUIRE(cubuf_caching_resource_create(pool, NULL, &c));
        atomic_store(&g_gate, 0);
        gated_fill_t f = {c, 0, false};
        pthread_t th;
        T_CHECK(pthread_create(&th, NULL, gated_per_thread, &f) == 0);
        pthread_join(th, NULL);
        T_CHECK(f.ok && cstats(c).cached_count == 1);
        CUstream s = new_stream(); /* non-blocking: the legacy stream does not wait for it */
        T_CU(cuStreamBeginCapture, s, CU_STREAM_CAPTURE_MODE_RELAXED);
        if (end) {
            cubuf_resource_release(c); /* its end gives the block back */
        } else {
            T_OK(cubuf_caching_trim(c, 0));
            T_CHECK(cstats(c).cached_count == 0);
        }
        CUresult q = cubuf__drv.cuStreamQuery(CU_STREAM_LEGACY);
        bool gave_up = atomic_exchange(&g_gate_expired, 0);
        T_CHECK(q == CUDA_ERROR_NOT_READY || (sanitizer && gave_up)); /* behind the gate */
        end_capture_ok(s);
        atomic_store(&g_gate, 1);
        T_CU(cuStreamSynchronize, CU_STREAM_LEGACY);
        cubuf_resource_stats_t ps = pool_stats(pool);
        T_CHECK(ps.pool_used_current == 0 && ps.current_count == 0);
        if (!end) cubuf_resource_release(c);
        T_CU(cuStreamDestroy, s);
        cubuf_resource_release(pool);
    }
    atomic_store(&g_gate_deadline_s, 20);
}

/* ---- every driver call fails once ---- */

static void test_faults(void)
{
    cubuf_resource_t *pool = private_pool(0);
    CUstream s1 = new_stream(), s2 = new_stream();
    cubuf_caching_options_t o = CUBUF_CACHING_OPTIONS_INIT;
    o.max_cached_size = 1 << 20;
    int rounds = 0;
    for (unsigned nth = 1; nth < 10000; nth++, rounds++) {
        cubuf_resource_t *c = NULL;
        T_REQUIRE(cubuf_caching_resource_create(pool, &o, &c));
        CUdeviceptr a = 0, b = 0, l = 0;
        cubuf_fault_fail_any_nth(nth, CUDA_ERROR_UNKNOWN);
        if (cubuf_caching_allocate(c, 1000, s1, &a) == CUBUF_SUCCESS &&
            cubuf_caching_deallocate(c, a, 1000, s1) == CUBUF_SUCCESS)
            a = 0;
        if (cubuf_caching_allocate(c, 1000, s2, &b) != CUBUF_SUCCESS) b = 0; /* across streams */
        if (cubuf_caching_allocate(c, 2 << 20, s2, &l) != CUBUF_SUCCESS) l = 0; /* passed on */
        if (b && cubuf_caching_deallocate(c, b, 1000, s2) == CUBUF_SUCCESS) b = 0;
        if (l && cubuf_caching_deallocate(c, l, 2 << 20, s2) == CUBUF_SUCCESS) l = 0;
        (void)cubuf_caching_trim(c, 0);
        bool fired = cubuf_fault_fired();
        cubuf_fault_reset();
        if (a) T_OK(cubuf_caching_deallocate(c, a, 1000, s1));
        if (b) T_OK(cubuf_caching_deallocate(c, b, 1000, s2));
        if (l) T_OK(cubuf_caching_deallocate(c, l, 2 << 20, s2));
        cubuf_caching_stats_t cs = cstats(c);
        T_CHECK(cs.live_count == 0 && cs.held_bytes == cs.cached_bytes);
        cubuf_resource_release(c);
        cubuf_resource_stats_t ps = pool_stats(pool);
        T_CHECK(ps.current_count == 0 && ps.pool_used_current == 0);
        if (!fired) break;
    }
    printf("driver faults: %d rounds\n", rounds);
    T_CHECK(rounds >= 5);
    T_CU(cuStreamDestroy, s1);
    T_CU(cuStreamDestroy, s2);
    cubuf_resource_release(pool);
}

/* cubuf_stream_destroy gives back what every caching resource keeps on the
 * stream before the stream goes (a new stream may get its handle); a
 * give-back that fails keeps the blocks and the stream. */
static void test_stream_destroy_gives_back(void)
{
    cubuf_resource_t *pool = private_pool(0), *c1 = NULL, *c2 = NULL;
    T_REQUIRE(cubuf_caching_resource_create(pool, NULL, &c1));
    T_REQUIRE(cubuf_caching_resource_create(pool, NULL, &c2));
    CUstream s = new_stream(), t = new_stream();
    cache_pair(c1, s, 4096);
    cache_pair(c2, s, 8192);
    cache_pair(c2, t, 4096);
    T_CHECK(cstats(c1).cached_count == 2 && cstats(c2).cached_count == 4);
    T_CHECK(pool_stats(pool).current_count == 6);
    /* the give-back's second free (c2's second block on s: the newest
     * resource goes first) fails: that block stays cached, and the stream;
     * c1's blocks on s still go */
    T_CHECK(cubuf_fault_fail_nth("cuMemFreeAsync", 2, CUDA_ERROR_UNKNOWN));
    T_STATUS(cubuf_stream_destroy(s), CUBUF_ERROR_DRIVER);
    T_CHECK(cubuf_fault_fired());
    cubuf_fault_reset();
    T_CU(cuStreamSynchronize, s); /* still a stream */
    T_CHECK(cstats(c1).cached_count == 0 && cstats(c2).cached_count == 3);
    T_CHECK(pool_stats(pool).current_count == 3);
    T_OK(cubuf_stream_destroy(s));
    T_CHECK(cstats(c1).cached_count == 0 && cstats(c1).held_bytes == 0);
    T_CHECK(cstats(c2).cached_count == 2 && cstats(c2).cached_bytes == 2 * 4096); /* t's */
    T_CHECK(pool_stats(pool).current_count == 2);
    /* a released caching resource is no longer asked */
    cubuf_resource_release(c1);
    T_OK(cubuf_stream_destroy(t));
    T_CHECK(cstats(c2).cached_count == 0 && pool_stats(pool).current_count == 0);
    cubuf_resource_release(c2);
    T_CHECK(pool_stats(pool).current_count == 0);
    cubuf_resource_release(pool);
}

/* A caching resource over another: the upper one's blocks on the stream go
 * back into the lower one, cached on that stream there, so the lower one
 * must be visited after (it was visited first, and kept them). */
static void test_stream_destroy_stacked(void)
{
    cubuf_resource_t *pool = private_pool(0), *low = NULL, *top = NULL;
    T_REQUIRE(cubuf_caching_resource_create(pool, NULL, &low));
    T_REQUIRE(cubuf_caching_resource_create(low, NULL, &top));
    CUstream s = new_stream();
    cache_pair(top, s, 4096);
    T_CHECK(cstats(top).cached_count == 2 && cstats(low).live_count == 2);
    T_OK(cubuf_stream_destroy(s));
    T_CHECK(cstats(top).cached_count == 0 && cstats(low).cached_count == 0);
    T_CHECK(pool_stats(pool).current_count == 0);
    cubuf_resource_release(top);
    cubuf_resource_release(low);
    cubuf_resource_release(pool);
}

/* A stream destroyed while a caching resource's end gives its blocks back
 * (the first held in a gate by the upstream): the destroy waits for it, and
 * the block on that stream goes back before the stream goes. */
static atomic_int g_held_free, g_in_held_free, g_free_gate;

static cubuf_status_t held_alloc(void *up, size_t n, CUstream s, CUdeviceptr *p)
{
    return cubuf_resource_allocate_raw(up, n, s, p);
}

static cubuf_status_t held_free(void *up, CUdeviceptr p, size_t n, CUstream s)
{
    if (atomic_load(&g_held_free) && atomic_fetch_add(&g_in_held_free, 1) == 0)
        while (!atomic_load(&g_free_gate)) usleep(1000);
    return cubuf_resource_deallocate_raw(up, p, n, s);
}

static void *release_on_thread(void *res)
{
    if (cubuf__drv.cuCtxSetCurrent(g_ctx) == CUDA_SUCCESS) cubuf_resource_release(res);
    return NULL;
}

static void *open_free_gate_later(void *unused)
{
    (void)unused;
    usleep(200 * 1000);
    atomic_store(&g_free_gate, 1);
    return NULL;
}

static void test_stream_destroy_during_release(void)
{
    t_warnings_t w = {0};
    cubuf_set_warning_handler(t_warning, &w);
    cubuf_resource_t *pool = private_pool(0), *held = NULL, *c = NULL;
    cubuf_resource_props_t props = CUBUF_RESOURCE_PROPS_INIT;
    T_OK(cubuf_resource_props(pool, &props));
    const cubuf_resource_ops_t ops = {CUBUF_RESOURCE_OPS_VERSION, held_alloc, held_free, NULL};
    T_REQUIRE(cubuf_resource_create(&ops, &props, pool, &held));
    T_REQUIRE(cubuf_caching_resource_create(held, NULL, &c));
    CUstream s = new_stream(), t = new_stream();
    CUdeviceptr a = 0, b = 0;
    T_OK(cubuf_caching_allocate(c, 4096, s, &a));
    T_OK(cubuf_caching_allocate(c, 4096, t, &b)); /* t's state first in the cache's list */
    T_OK(cubuf_caching_deallocate(c, a, 4096, s));
    T_OK(cubuf_caching_deallocate(c, b, 4096, t));
    atomic_store(&g_held_free, 1);
    pthread_t r, g;
    T_CHECK(pthread_create(&r, NULL, release_on_thread, c) == 0); /* its end: t's block held */
    while (atomic_load(&g_in_held_free) < 1) usleep(1000);
    T_CHECK(pthread_create(&g, NULL, open_free_gate_later, NULL) == 0);
    T_OK(cubuf_stream_destroy(s)); /* waits for the end's give-back, s's block included */
    pthread_join(g, NULL);
    pthread_join(r, NULL);
    T_CHECK(pool_stats(pool).current_count == 0);
    T_CHECK(w.n == 0);
    if (w.n) fprintf(stderr, "warning: %s\n", w.first);
    cubuf_set_warning_handler(NULL, NULL);
    T_OK(cubuf_stream_destroy(t));
    cubuf_resource_release(held);
    cubuf_resource_release(pool);
}

/* Streams destroyed while other threads make and release caching resources
 * and cache blocks on their own streams: each stream's blocks go back, and
 * nothing is left when all is released. */
#define D_THREADS 4
#define D_ROUNDS 200

static void *destroy_work(void *arg)
{
    cubuf_resource_t *pool = arg;
    intptr_t bad = cubuf__drv.cuCtxSetCurrent(g_ctx) != CUDA_SUCCESS;
    for (int i = 0; i < D_ROUNDS && !bad; i++) {
        const size_t n = 1024 * (size_t)(1 + i % 8);
        cubuf_resource_t *c = NULL;
        CUstream s = NULL;
        CUdeviceptr p = 0;
        cubuf_caching_stats_t cs = CUBUF_CACHING_STATS_INIT;
        bad = cubuf_caching_resource_create(pool, NULL, &c) != CUBUF_SUCCESS ||
              cubuf__drv.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS ||
              cubuf_caching_allocate(c, n, s, &p) != CUBUF_SUCCESS ||
              cubuf_caching_deallocate(c, p, n, s) != CUBUF_SUCCESS;
        if (i % 2) cubuf_resource_release(c); /* before or after the stream */
        bad = bad || cubuf_stream_destroy(s) != CUBUF_SUCCESS;
        if (i % 2 == 0) {
            bad = bad || cubuf_caching_stats(c, &cs) != CUBUF_SUCCESS || cs.cached_count != 0;
            cubuf_resource_release(c);
        }
    }
    return (void *)bad;
}

static void test_stream_destroy_threads(void)
{
    cubuf_resource_t *pool = private_pool(0);
    pthread_t th[D_THREADS];
    for (int i = 0; i < D_THREADS; i++) T_CHECK(pthread_create(&th[i], NULL, destroy_work, pool) == 0);
    for (int i = 0; i < D_THREADS; i++) {
        void *bad = NULL;
        pthread_join(th[i], &bad);
        T_CHECK(!bad);
    }
    T_CHECK(pool_stats(pool).current_count == 0);
    cubuf_resource_release(pool);
}

/* ---- 16 threads, 16 streams ---- */

#define G_THREADS 16
#define G_ITERS 400

typedef struct gworker {
    cubuf_resource_t *c;
    int id;
    unsigned long allocs, failures;
} gworker_t;

static void *gwork(void *arg)
{
    gworker_t *w = arg;
    if (cubuf__drv.cuCtxSetCurrent(g_ctx) != CUDA_SUCCESS) {
        w->failures++;
        return NULL;
    }
    CUstream s = NULL;
    if (cubuf__drv.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) {
        w->failures++;
        return NULL;
    }
    uint64_t x = 0x9E3779B97F4A7C15ULL * (uint64_t)(w->id + 1);
    CUdeviceptr live[4] = {0};
    size_t size[4] = {0};
    for (int i = 0; i < G_ITERS; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        int j = (int)(x % 4);
        if (live[j]) {
            if (cubuf_caching_deallocate(w->c, live[j], size[j], s) != CUBUF_SUCCESS) w->failures++;
            live[j] = 0;
            continue;
        }
        size[j] = 256 + (size_t)((x >> 32) % (256 << 10));
        if (cubuf_caching_allocate(w->c, size[j], s, &live[j]) != CUBUF_SUCCESS) {
            w->failures++;
            live[j] = 0;
            continue;
        }
        w->allocs++;
        uint32_t tag = 0x1000u * (uint32_t)w->id + (uint32_t)i, got = 0;
        if (cubuf__drv.cuMemsetD32Async(live[j], tag, size[j] / 4, s) != CUDA_SUCCESS) w->failures++;
        if (i % 16 == 0) { /* read back the last word */
            if (cubuf__drv.cuStreamSynchronize(s) != CUDA_SUCCESS ||
                cubuf__drv.cuMemcpyDtoH(&got, live[j] + (size[j] / 4 - 1) * 4, 4) != CUDA_SUCCESS ||
                got != tag)
                w->failures++;
        }
    }
    for (int j = 0; j < 4; j++)
        if (live[j] && cubuf_caching_deallocate(w->c, live[j], size[j], s) != CUBUF_SUCCESS) w->failures++;
    if (cubuf_caching_forget_stream(w->c, s) != CUBUF_SUCCESS) w->failures++;
    if (cubuf__drv.cuStreamSynchronize(s) != CUDA_SUCCESS || cubuf__drv.cuStreamDestroy(s) != CUDA_SUCCESS)
        w->failures++;
    return NULL;
}

static void test_threads(void)
{
    cubuf_resource_t *pool = private_pool(0), *c = NULL;
    T_REQUIRE(cubuf_caching_resource_create(pool, NULL, &c));
    pthread_t th[G_THREADS];
    gworker_t w[G_THREADS];
    for (int i = 0; i < G_THREADS; i++) {
        w[i] = (gworker_t){c, i, 0, 0};
        T_CHECK(pthread_create(&th[i], NULL, gwork, &w[i]) == 0);
    }
    unsigned long allocs = 0, failures = 0;
    for (int i = 0; i < G_THREADS; i++) {
        pthread_join(th[i], NULL);
        allocs += w[i].allocs;
        failures += w[i].failures;
    }
    T_CHECK(failures == 0);
    cubuf_caching_stats_t s = cstats(c);
    T_CHECK(s.hits + s.cross_stream_reuses + s.misses == allocs);
    T_CHECK(s.live_bytes == 0 && s.live_count == 0 && s.cached_bytes == 0);
    T_CHECK(s.upstream_allocations == s.upstream_deallocations && s.held_bytes == 0);
    T_CHECK(pool_stats(pool).pool_used_current == 0);
    printf("threads: %lu allocations, %llu hits, %llu cross-stream, %llu misses\n", allocs,
           (unsigned long long)s.hits, (unsigned long long)s.cross_stream_reuses,
           (unsigned long long)s.misses);
    cubuf_resource_release(c);
    cubuf_resource_release(pool);
}

/* ---- the framework entry points ---- */

static void test_framework(void)
{
    cubuf_resource_t *r = NULL, *r2 = NULL;
    T_STATUS(cubuf_framework_resource(64, &r), CUBUF_ERROR_OUT_OF_RANGE);
    T_STATUS(cubuf_framework_resource(-1, &r), CUBUF_ERROR_OUT_OF_RANGE);
    T_CHECK(cubuf_torch_alloc(100, 64, NULL) == NULL);
    T_REQUIRE(cubuf_framework_resource(0, &r));
    T_REQUIRE(cubuf_framework_resource(0, &r2));
    T_CHECK(r == r2 && cubuf_is_caching_resource(r));
    CUstream s = new_stream();
    void *p[64] = {0};
    size_t n[64];
    uint64_t x = 12345;
    for (int round = 0; round < 4; round++) {
        for (int i = 0; i < 64; i++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            n[i] = i == 0 ? 0 : (size_t)(x % (3u << 20));
            p[i] = round % 2 ? cubuf_cupy_malloc(NULL, n[i], 0) : cubuf_torch_alloc(n[i], 0, s);
            T_CHECK(p[i] != NULL && (uintptr_t)p[i] % 256 == 0);
            for (int j = 0; j < i; j++) T_CHECK(p[j] != p[i]);
        }
        if (round % 2) T_CU(cuMemsetD32Async, (CUdeviceptr)(uintptr_t)p[5], 7u, n[5] / 4, NULL);
        for (int i = 0; i < 64; i++) {
            if (round % 2) cubuf_cupy_free(NULL, p[i], 0);
            else cubuf_torch_free(p[i], n[i], 0, s);
        }
    }
    cubuf_caching_stats_t cs = cstats(r);
    T_CHECK(cs.live_count == 0 && cs.live_bytes == 0 && cs.hits > 0);
    /* The process-lifetime resource gives its blocks back (compute-sanitizer
     * reports what a program leaves allocated at exit). */
    T_OK(cubuf_caching_trim(r, 0));
    cs = cstats(r);
    T_CHECK(cs.cached_bytes == 0);
    T_OK(cubuf_caching_forget_stream(r, s));
    T_CU(cuStreamSynchronize, s);
    T_CU(cuStreamDestroy, s);
}

int main(void)
{
    t_require_gpu();
    cubuf_context_t *ctx = NULL;
    T_REQUIRE(cubuf_context_create(0, &ctx));
    g_ctx = t_cu(ctx);
    T_CU(cuCtxSetCurrent, g_ctx);
    test_one_stream();
    test_cross_stream();
    test_capture();
    test_steal_from_capturing();
    test_trim_while_capturing();
    test_threshold_while_capturing();
    test_trim_failure_order();
    test_oom_trim();
    test_oom_foreign_per_thread();
    test_foreign_per_thread_while_capturing();
    test_faults();
    test_stream_destroy_gives_back();
    test_stream_destroy_stacked();
    test_stream_destroy_during_release();
    test_stream_destroy_threads();
    test_threads();
    test_framework();
    T_CHECK(!atomic_load(&g_gate_expired)); /* every gate opened by its test */
    T_CU(cuCtxSetCurrent, NULL);
    cubuf_context_destroy(ctx);
    return t_finish("test_caching_gpu");
}
