/* Stream-ordered pool resources: the device pool (default and private), the
 * pinned host pool and the graph resource. Data is written and read back,
 * statistics are checked exactly, capture is refused without breaking it,
 * and every driver call on the create and allocate paths is failed in turn. */
#include <stdint.h>

#include "alloc_fault_test.h"
#include "internal.h"
#include "resource_pool.h"
#include "test.h"
#include "resource_test.h"


static CUcontext g_ctx; /* device 0's primary context, current on the main thread */
static CUdevice g_dev;
static CUstream g_s;    /* a non-blocking stream of g_ctx */
static const size_t k_sizes[] = {0, 1, 1000, GiB};



static CUmemoryPool default_pool(void)
{
    CUmemoryPool p = NULL;
    T_CU(cuDeviceGetDefaultMemPool, &p, g_dev);
    return p;
}

static cuuint64_t threshold(CUmemoryPool pool)
{
    cuuint64_t v = 0;
    T_CU(cuMemPoolGetAttribute, pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &v);
    return v;
}

/* ---- pool accounting ---------------------------------------------------------
 *
 * The leak checks read the pool's own figure, CU_MEMPOOL_ATTR_USED_MEM_CURRENT
 * (what its live allocations take), once the context is synchronized: a free
 * runs in stream order. It counts this process's allocations from that pool
 * and nothing else, so other work on the device cannot move it; what the
 * pool keeps cached after frees is reserved, not used. Pools made and
 * destroyed are counted at the driver table (t_held). leak_visible() shows
 * that one leaked allocation of each tested size moves the figure. */

static cuuint64_t pool_attr(CUmemoryPool pool, CUmemPool_attribute a)
{
    cuuint64_t v = 0;
    T_CU(cuMemPoolGetAttribute, pool, a, &v);
    return v;
}

/* The pool's used memory once all work of the current context is done. */
static cuuint64_t settled_used(CUmemoryPool pool)
{
    T_CU(cuCtxSynchronize);
    return pool_attr(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT);
}

/* The pool's used memory must be back at `base` exactly. Prints both numbers
 * (and what the pool reserves) on failure. Needs g_ctx current. */
#define T_USED_BACK(pool, base, what) t_used_back(__FILE__, __LINE__, (pool), (base), (what))
static void t_used_back(const char *file, int line, CUmemoryPool pool, cuuint64_t base,
                        const char *what)
{
    cuuint64_t now = settled_used(pool);
    if (now != base) {
        fprintf(stderr,
                "%s:%d: %s: the pool's used memory is %llu bytes, baseline %llu bytes (%s; it "
                "reserves %llu bytes)\n",
                file, line, what, (unsigned long long)now, (unsigned long long)base,
                now > base ? "a leak" : "below the baseline",
                (unsigned long long)pool_attr(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT));
        t_failures++;
    }
}

/* The leak checks can see one leaked allocation of each tested size: with it
 * live, the pool's used memory is above the baseline; once freed, back at it. */
static void leak_visible(CUmemoryPool pool, const char *what)
{
    const size_t sizes[] = {1, 1000, MiB};
    cuuint64_t base = settled_used(pool);
    for (int i = 0; i < 3; i++) {
        CUdeviceptr p = 0;
        T_CU(cuMemAllocFromPoolAsync, &p, sizes[i], pool, g_s);
        cuuint64_t with = settled_used(pool);
        if (with <= base) {
            fprintf(stderr, "%s: a live allocation of %zu bytes does not show in the pool's used "
                    "memory (%llu bytes, baseline %llu): the leak checks could not see it\n",
                    what, sizes[i], (unsigned long long)with, (unsigned long long)base);
            t_failures++;
        }
        T_CU(cuMemFreeAsync, p, g_s);
        T_USED_BACK(pool, base, what);
    }
}

/* Sizes 0, 1, 1000 and 1 GiB from a fresh resource: data and exact stats. */
static void exercise_sizes(cubuf_resource_t *res, CUstream s, bool host)
{
    T_STATS(res, 0, 0, 0, 0, 0);
    cubuf_buffer_t *b[4] = {NULL};
    size_t sum = 0;
    for (int i = 0; i < 4; i++) {
        T_REQUIRE(cubuf_resource_allocate(res, k_sizes[i], s, &b[i]));
        T_CHECK(!cubuf_buffer_is_closed(b[i]));
        T_CHECK(cubuf_buffer_size(b[i]) == k_sizes[i]);
        T_CHECK((cubuf_buffer_ptr(b[i]) == 0) == (k_sizes[i] == 0));
        T_CHECK(cubuf_buffer_resource(b[i]) == res);
        T_CHECK(cubuf_buffer_is_device_accessible(b[i]));
        T_CHECK(cubuf_buffer_is_host_accessible(b[i]) == host);
        T_CHECK(!cubuf_buffer_is_managed(b[i]));
        sum += k_sizes[i];
    }
    for (int i = 1; i < 4; i++) {
        /* The memory comes from the resource's own pool. */
        CUmemoryPool from = NULL;
        T_CU(cuPointerGetAttribute, &from, CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, cubuf_buffer_ptr(b[i]));
        T_CHECK(from == cubuf__pool_handle(res));
        if (host) check_host_rw(cubuf_buffer_ptr(b[i]), k_sizes[i], s);
        else check_device_rw(cubuf_buffer_ptr(b[i]), k_sizes[i], s);
    }
    /* Size 0 is an open buffer that counts nowhere. */
    T_STATS(res, sum, sum, 3, 3, 3);
    T_OK(cubuf_buffer_close(b[2]));
    T_CHECK(cubuf_buffer_is_closed(b[2]) && cubuf_buffer_ptr(b[2]) == 0 && cubuf_buffer_size(b[2]) == 0);
    T_STATS(res, sum - 1000, sum, 2, 3, 3);
    for (int i = 0; i < 4; i++) {
        T_OK(cubuf_buffer_close(b[i]));
        cubuf_buffer_release(b[i]);
    }
    T_STATS(res, 0, sum, 0, 3, 3);
    T_CU(cuCtxSynchronize);
}


static void test_validation(void)
{
    int n = 0;
    T_REQUIRE(cubuf_device_count(&n));
    cubuf_resource_t *r = NULL;
    cubuf_device_resource_options_t o = CUBUF_DEVICE_RESOURCE_OPTIONS_INIT;
    T_STATUS(cubuf_device_resource_create(0, NULL, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_pinned_resource_create(0, false, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_graph_resource_create(0, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    o.struct_size = 0;
    T_STATUS(cubuf_device_resource_create(0, &o, &r), CUBUF_ERROR_INVALID_ARGUMENT);
    o = (cubuf_device_resource_options_t)CUBUF_DEVICE_RESOURCE_OPTIONS_INIT;
    o.max_size = 64 * MiB; /* only with a private pool */
    T_STATUS(cubuf_device_resource_create(0, &o, &r), CUBUF_ERROR_INVALID_ARGUMENT);
    o = (cubuf_device_resource_options_t)CUBUF_DEVICE_RESOURCE_OPTIONS_INIT;
    o.ipc_enabled = true;
    T_STATUS(cubuf_device_resource_create(0, &o, &r), CUBUF_ERROR_INVALID_ARGUMENT);
    int bad[2] = {-1, n};
    for (int i = 0; i < 2; i++) {
        T_STATUS(cubuf_device_resource_create(bad[i], NULL, &r), CUBUF_ERROR_OUT_OF_RANGE);
        T_CHECK(strstr(cubuf_last_error(), "0 to") != NULL);
        T_STATUS(cubuf_pinned_resource_create(bad[i], false, &r), CUBUF_ERROR_OUT_OF_RANGE);
        T_STATUS(cubuf_graph_resource_create(bad[i], &r), CUBUF_ERROR_OUT_OF_RANGE);
    }
    T_CHECK(r == NULL);
    T_CHECK(cubuf__pool_handle(NULL) == NULL);
}

/* The default pool is shared with the rest of the process: cubuf leaves
 * its release threshold as it finds it unless asked, and then sets exactly
 * what is asked. A distinctive value set beforehand (as another library in
 * the process might) must survive every creation that does not ask. */
static void default_threshold_untouched(void)
{
    CUmemoryPool dp = default_pool();
    cuuint64_t theirs = 5 * MiB + 4096;
    T_CU(cuMemPoolSetAttribute, dp, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &theirs);
    cubuf_resource_t *r = NULL;
    T_REQUIRE(cubuf_device_resource_create(0, NULL, &r));
    T_CHECK(threshold(dp) == theirs);
    cubuf_resource_release(r);
    cubuf_device_resource_options_t o = CUBUF_DEVICE_RESOURCE_OPTIONS_INIT;
    T_CHECK(o.release_threshold == CUBUF_RELEASE_THRESHOLD_DEFAULT);
    T_REQUIRE(cubuf_device_resource_create(0, &o, &r));
    T_CHECK(threshold(dp) == theirs);
    /* allocating and freeing through it changes nothing either */
    cubuf_buffer_t *b = NULL;
    T_OK(cubuf_resource_allocate(r, MiB, g_s, &b));
    cubuf_buffer_release(b);
    T_CU(cuStreamSynchronize, g_s);
    T_CHECK(threshold(dp) == theirs);
    cubuf_resource_release(r);
    /* a private pool and the context's pools leave it alone too */
    o.private_pool = true;
    T_REQUIRE(cubuf_device_resource_create(0, &o, &r));
    cubuf_resource_release(r);
    T_REQUIRE(cubuf_pinned_resource_create(0, false, &r));
    cubuf_resource_release(r);
    cubuf_context_t *c = NULL;
    T_REQUIRE(cubuf_context_create(0, &c));
    T_OK(cubuf_context_new_buffer(c, MiB, &b));
    cubuf_buffer_release(b);
    T_OK(cubuf_context_new_host_buffer(c, MiB, &b));
    cubuf_buffer_release(b);
    T_OK(cubuf_context_synchronize(c));
    cubuf_context_destroy(c);
    T_CHECK(threshold(dp) == theirs);

    /* Asked for: set exactly, lower or higher (it is the caller's call). */
    o = (cubuf_device_resource_options_t)CUBUF_DEVICE_RESOURCE_OPTIONS_INIT;
    o.release_threshold = 64 * MiB;
    T_REQUIRE(cubuf_device_resource_create(0, &o, &r));
    T_CHECK(threshold(dp) == 64 * MiB);
    cubuf_resource_release(r);
    o.release_threshold = MiB;
    T_REQUIRE(cubuf_device_resource_create(0, &o, &r));
    T_CHECK(threshold(dp) == MiB);
    o.release_threshold = SIZE_MAX;
    cubuf_resource_t *r2 = NULL;
    T_REQUIRE(cubuf_device_resource_create(0, &o, &r2));
    T_CHECK(threshold(dp) == UINT64_MAX);
    cubuf_resource_release(r2);
    /* and through the setter, on the resource of the default pool */
    T_OK(cubuf_resource_set_release_threshold(r, (size_t)theirs));
    T_CHECK(threshold(dp) == theirs);
    cubuf_resource_release(r);
    /* A create that asks for a threshold and fails (each driver call, then
     * each host allocation, in turn) leaves the shared pool's as it was. */
    o.release_threshold = 7 * MiB;
    for (int alloc = 0; alloc < 2; alloc++)
    for (unsigned n = 1; n < 50; n++) {
        r = NULL;
        if (alloc) t_fail_alloc_nth(n);
        else cubuf_fault_fail_any_nth(n, CUDA_ERROR_UNKNOWN);
        cubuf_status_t st = cubuf_device_resource_create(0, &o, &r);
        bool fired = cubuf_fault_fired();
        cubuf_fault_reset();
        if (!fired) {
            T_OK(st);
            T_CHECK(threshold(dp) == 7 * MiB);
            cubuf_resource_release(r);
            T_CU(cuMemPoolSetAttribute, dp, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &theirs);
            break;
        }
        T_CHECK(st != CUBUF_SUCCESS && (!alloc || st == CUBUF_ERROR_OUT_OF_MEMORY));
        T_CHECK(r == NULL && threshold(dp) == theirs);
    }
    /* the driver's default again for the tests below */
    cuuint64_t zero = 0;
    T_CU(cuMemPoolSetAttribute, dp, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &zero);
}

static void test_default_pool(void)
{
    CUmemoryPool dp = default_pool();
    cubuf_resource_t *r = NULL;
    default_threshold_untouched();
    T_REQUIRE(cubuf_device_resource_create(0, NULL, &r));
    T_CHECK(cubuf__pool_handle(r) == dp);
    check_props(r, 0, false, false, false);

    cuuint64_t base = settled_used(dp);
    exercise_sizes(r, g_s, false);
    T_USED_BACK(dp, base, "default pool, sizes 0, 1, 1000, 1 GiB");

    /* A default stream with no current context runs in the resource's
     * context, and the caller's (absent) context is restored. */
    T_CU(cuCtxSetCurrent, NULL);
    cubuf_buffer_t *b = NULL;
    T_OK(cubuf_resource_allocate(r, 1000, CU_STREAM_LEGACY, &b));
    T_CHECK(current() == NULL);
    T_CU(cuCtxSetCurrent, g_ctx);
    T_CHECK(b && t_dealloc_ctx(b) == g_ctx);
    check_device_rw(cubuf_buffer_ptr(b), 1000, CU_STREAM_LEGACY);
    T_CU(cuCtxSetCurrent, NULL);
    T_OK(cubuf_buffer_close(b));
    T_CHECK(current() == NULL);
    T_CU(cuCtxSetCurrent, g_ctx);
    cubuf_buffer_release(b);
    T_USED_BACK(dp, base, "default pool, legacy stream with no current context");

    /* The hot path: a user stream costs the capture query and the
     * allocation; the free is one call. A default stream adds one
     * cuCtxGetCurrent each way (recording it finds the context current, so
     * the allocation asks nothing again; the free checks it) and no push. */
    cubuf_fault_count_calls(true);
    T_OK(cubuf_resource_allocate(r, 4096, g_s, &b));
    T_CHECK(cubuf_fault_calls("cuStreamIsCapturing") == 1);
    T_CHECK(cubuf_fault_calls("cuMemAllocFromPoolAsync") == 1);
    T_CHECK(total_calls() == 2);
    cubuf_fault_count_calls(true);
    T_OK(cubuf_buffer_close(b));
    T_CHECK(cubuf_fault_calls("cuMemFreeAsync") == 1);
    T_CHECK(total_calls() == 1);
    cubuf_buffer_release(b);
    cubuf_fault_count_calls(true);
    T_OK(cubuf_resource_allocate(r, 4096, CU_STREAM_PER_THREAD, &b));
    T_CHECK(cubuf_fault_calls("cuCtxPushCurrent") == 0);
    T_CHECK(cubuf_fault_calls("cuCtxGetCurrent") == 1);
    T_CHECK(total_calls() == 3);
    cubuf_fault_count_calls(true);
    T_OK(cubuf_buffer_close(b));
    T_CHECK(cubuf_fault_calls("cuCtxPushCurrent") == 0);
    T_CHECK(total_calls() == 2);
    cubuf_fault_count_calls(false);
    cubuf_buffer_release(b);
    T_USED_BACK(dp, base, "default pool, user and per-thread streams");

    /* A failed free leaves the buffer open and counted; a second close works. */
    T_REQUIRE(cubuf_resource_allocate(r, 4096, g_s, &b));
    T_CHECK(cubuf_fault_fail_nth("cuMemFreeAsync", 1, CUDA_ERROR_UNKNOWN));
    T_STATUS(cubuf_buffer_close(b), CUBUF_ERROR_DRIVER);
    cubuf_fault_reset();
    T_CHECK(!cubuf_buffer_is_closed(b) && cubuf_buffer_ptr(b) != 0);
    T_STATS(r, 4096, GiB + 1001, 1, 3, 7);
    T_OK(cubuf_buffer_close(b));
    T_STATS(r, 0, GiB + 1001, 0, 3, 7);
    cubuf_buffer_release(b);
    cubuf_resource_release(r);
    T_USED_BACK(dp, base, "default pool, after default streams and a failed free");
}

static void test_private_pool(void)
{
    CUmemoryPool dp = default_pool();
    t_held_t held0 = t_held();
    cubuf_device_resource_options_t o = CUBUF_DEVICE_RESOURCE_OPTIONS_INIT;
    o.private_pool = true;
    cubuf_resource_t *r = NULL;
    T_REQUIRE(cubuf_device_resource_create(0, &o, &r));
    CUmemoryPool pool = cubuf__pool_handle(r);
    T_CHECK(settled_used(pool) == 0);
    T_CHECK(pool != NULL && pool != dp);
    T_CHECK(threshold(pool) == UINT64_MAX);
    check_props(r, 0, false, false, false);
    leak_visible(pool, "private pool");
    exercise_sizes(r, g_s, false);
    T_USED_BACK(pool, 0, "private pool, sizes 0, 1, 1000, 1 GiB");
    cubuf_resource_release(r); /* destroys the pool */
    T_HELD_BACK(held0, "private pool destroyed");

    /* A private pool's threshold is set exactly. */
    o.release_threshold = 3 * MiB;
    T_REQUIRE(cubuf_device_resource_create(0, &o, &r));
    T_CHECK(threshold(cubuf__pool_handle(r)) == 3 * MiB);
    cubuf_resource_release(r);

    /* IPC-enabled private pool, where the device can export pools. */
    o = (cubuf_device_resource_options_t)CUBUF_DEVICE_RESOURCE_OPTIONS_INIT;
    o.private_pool = true;
    o.ipc_enabled = true;
    cubuf_status_t st = cubuf_device_resource_create(0, &o, &r);
    if (st == CUBUF_ERROR_NOT_SUPPORTED) {
        printf("note: IPC pools not supported here: %s\n", cubuf_last_error());
    } else {
        T_OK(st);
        check_props(r, 0, false, false, true);
        cubuf_buffer_t *b = NULL;
        T_OK(cubuf_resource_allocate(r, MiB, g_s, &b));
        check_device_rw(cubuf_buffer_ptr(b), MiB, g_s);
        T_OK(cubuf_buffer_close(b));
        cubuf_buffer_release(b);
        T_USED_BACK(cubuf__pool_handle(r), 0, "IPC private pool");
        cubuf_resource_release(r);
    }
    T_HELD_BACK(held0, "IPC private pool destroyed");
}

/* ---- memory goes back ---------------------------------------------------------- */

static cubuf_resource_stats_t stats_now(cubuf_resource_t *r)
{
    cubuf_resource_stats_t s = CUBUF_RESOURCE_STATS_INIT;
    T_OK(cubuf_resource_stats(r, &s));
    return s;
}

/* A pool of cubuf's own (no buffer open, threshold at its maximum) keeps
 * what a freed buffer of `size` bytes used: reserved but unused once the
 * free has run, and still so after a synchronization; cubuf_resource_trim
 * gives it back to the device. Read through the statistics and through the
 * raw pool attributes; the high-water marks stay. */
static void trim_pool(cubuf_resource_t *r, size_t size)
{
    CUmemoryPool pool = cubuf__pool_handle(r);
    T_CHECK(threshold(pool) == UINT64_MAX);
    T_CU(cuCtxSynchronize); /* earlier frees have run: nothing of them is in use */
    T_OK(cubuf_resource_trim(r, 0));
    cubuf_resource_stats_t s = stats_now(r);
    T_CHECK(s.current_bytes == 0 && s.pool_reserved_current == 0 && s.pool_used_current == 0);
    cubuf_buffer_t *b = NULL;
    T_REQUIRE(cubuf_resource_allocate(r, size, g_s, &b));
    T_CU(cuStreamSynchronize, g_s);
    s = stats_now(r);
    T_CHECK(s.current_bytes == size);
    T_CHECK(s.pool_used_current >= size && s.pool_reserved_current >= s.pool_used_current);
    T_CHECK(s.pool_used_high >= size && s.pool_reserved_high >= s.pool_reserved_current);
    T_CHECK(s.pool_reserved_current == pool_attr(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT));
    T_CHECK(s.pool_used_current == pool_attr(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT));
    T_CHECK(s.pool_reserved_high == pool_attr(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH));
    T_CHECK(s.pool_used_high == pool_attr(pool, CU_MEMPOOL_ATTR_USED_MEM_HIGH));
    const uint64_t reserved = s.pool_reserved_current, used_high = s.pool_used_high;
    T_OK(cubuf_buffer_close(b));
    cubuf_buffer_release(b);
    T_CU(cuStreamSynchronize, g_s);
    s = stats_now(r);
    T_CHECK(s.current_bytes == 0 && s.pool_used_current == 0);
    T_CHECK(s.pool_reserved_current == reserved); /* the synchronization gave nothing back */
    T_CHECK(pool_attr(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) == reserved);
    T_OK(cubuf_resource_trim(r, 0));
    s = stats_now(r);
    T_CHECK(s.pool_reserved_current == 0);
    T_CHECK(pool_attr(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) == 0);
    T_CHECK(s.pool_used_high == used_high && s.pool_reserved_high >= reserved);
}

/* The release threshold setter sets exactly what it is given. */
static void threshold_round_trip(cubuf_resource_t *r)
{
    CUmemoryPool pool = cubuf__pool_handle(r);
    const size_t values[] = {3 * MiB, 0, SIZE_MAX, 12345};
    const cuuint64_t want[] = {3 * MiB, 0, UINT64_MAX, 12345};
    for (int i = 0; i < 4; i++) {
        T_OK(cubuf_resource_set_release_threshold(r, values[i]));
        T_CHECK(threshold(pool) == want[i]);
    }
    T_CHECK(cubuf_fault_fail_nth("cuMemPoolSetAttribute", 1, CUDA_ERROR_UNKNOWN));
    T_STATUS(cubuf_resource_set_release_threshold(r, 0), CUBUF_ERROR_DRIVER);
    T_CHECK(cubuf_fault_fail_nth("cuMemPoolTrimTo", 1, CUDA_ERROR_UNKNOWN));
    T_STATUS(cubuf_resource_trim(r, 0), CUBUF_ERROR_DRIVER);
    cubuf_fault_reset();
    T_CHECK(threshold(pool) == 12345);
    T_OK(cubuf_resource_set_release_threshold(r, SIZE_MAX));
}

/* The statistics' two layouts on a pool resource: the first one (counters
 * only) costs no driver call and leaves the bytes after it untouched; the
 * full one asks the pool four times, and a failed query writes nothing. */
static void stats_layouts(cubuf_resource_t *r)
{
    cubuf_resource_stats_t two[2];
    memset(two, 0xee, sizeof two);
    two[0].struct_size = CUBUF_RESOURCE_STATS_SIZE_V1;
    cubuf_fault_count_calls(true);
    T_OK(cubuf_resource_stats(r, &two[0]));
    T_CHECK(total_calls() == 0);
    cubuf_fault_count_calls(false);
    cubuf_resource_stats_t full = stats_now(r);
    T_CHECK(two[0].struct_size == CUBUF_RESOURCE_STATS_SIZE_V1);
    T_CHECK(two[0].current_bytes == full.current_bytes && two[0].peak_bytes == full.peak_bytes &&
            two[0].total_allocations == full.total_allocations);
    const unsigned char *tail = (const unsigned char *)two + CUBUF_RESOURCE_STATS_SIZE_V1;
    size_t touched = 0;
    for (size_t i = 0; i < sizeof two - CUBUF_RESOURCE_STATS_SIZE_V1; i++) touched += tail[i] != 0xee;
    T_CHECK(touched == 0);
    cubuf_fault_count_calls(true);
    full = stats_now(r);
    T_CHECK(cubuf_fault_calls("cuMemPoolGetAttribute") == 4);
    cubuf_fault_count_calls(false);
    for (unsigned n = 1; n <= 4; n++) {
        cubuf_resource_stats_t s = CUBUF_RESOURCE_STATS_INIT, copy;
        s.current_bytes = 77;
        copy = s;
        T_CHECK(cubuf_fault_fail_nth("cuMemPoolGetAttribute", n, CUDA_ERROR_UNKNOWN));
        T_STATUS(cubuf_resource_stats(r, &s), CUBUF_ERROR_DRIVER);
        cubuf_fault_reset();
        T_CHECK(memcmp(&s, &copy, sizeof s) == 0);
    }
}

/* A private pool (threshold at its maximum by default) and the context's
 * own pools give memory back on a trim. */
static void test_trim(void)
{
    cubuf_device_resource_options_t o = CUBUF_DEVICE_RESOURCE_OPTIONS_INIT;
    o.private_pool = true;
    cubuf_resource_t *r = NULL;
    T_REQUIRE(cubuf_device_resource_create(0, &o, &r));
    trim_pool(r, 256 * MiB);
    stats_layouts(r);
    threshold_round_trip(r);
    T_STATUS(cubuf_resource_trim(NULL, 0), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_resource_set_release_threshold(NULL, 0), CUBUF_ERROR_INVALID_ARGUMENT);
    cubuf_resource_release(r);

    /* The context's pools, reached through one of their buffers. */
    cubuf_context_t *c = NULL;
    T_REQUIRE(cubuf_context_create(0, &c));
    cubuf_buffer_t *b = NULL;
    T_REQUIRE(cubuf_context_new_host_buffer(c, 0, &b));
    trim_pool(cubuf_buffer_resource(b), 64 * MiB);
    cubuf_buffer_release(b);
    T_REQUIRE(cubuf_context_new_buffer(c, 0, &b));
    cubuf_resource_props_t p = CUBUF_RESOURCE_PROPS_INIT;
    T_OK(cubuf_resource_props(cubuf_buffer_resource(b), &p));
    if (p.ipc_enabled) trim_pool(cubuf_buffer_resource(b), 64 * MiB); /* else the shared default pool */
    else printf("note: the context's device pool is the default pool here\n");
    cubuf_buffer_release(b);
    cubuf_context_destroy(c);
}

static void test_max_size(void)
{
    t_held_t held0 = t_held();
    cubuf_device_resource_options_t o = CUBUF_DEVICE_RESOURCE_OPTIONS_INIT;
    o.private_pool = true;
    o.max_size = 64 * MiB;
    cubuf_resource_t *r = NULL;
    T_REQUIRE(cubuf_device_resource_create(0, &o, &r));
    cubuf_buffer_t *a = NULL, *b = NULL;
    T_REQUIRE(cubuf_resource_allocate(r, 40 * MiB, g_s, &a));
    check_device_rw(cubuf_buffer_ptr(a), 40 * MiB, g_s);
    T_STATUS(cubuf_resource_allocate(r, 40 * MiB, g_s, &b), CUBUF_ERROR_OUT_OF_MEMORY);
    T_CHECK(b == NULL);
    T_STATS(r, 40 * MiB, 40 * MiB, 1, 1, 1);
    T_OK(cubuf_buffer_close(a));
    cubuf_buffer_release(a);
    T_STATUS(cubuf_resource_allocate(r, 128 * MiB, g_s, &b), CUBUF_ERROR_OUT_OF_MEMORY);
    T_CHECK(b == NULL);
    T_STATS(r, 0, 40 * MiB, 0, 1, 1);
    T_REQUIRE(cubuf_resource_allocate(r, 32 * MiB, g_s, &b)); /* still usable */
    T_OK(cubuf_buffer_close(b));
    cubuf_buffer_release(b);
    T_USED_BACK(cubuf__pool_handle(r), 0, "pool with max_size");
    cubuf_resource_release(r);
    T_HELD_BACK(held0, "pool with max_size destroyed");
}

/* Allocating on a capturing stream is refused before anything is captured;
 * closing on one is refused and leaves the buffer open. */
static void test_capture_refused(cubuf_resource_t *r)
{
    cubuf_resource_stats_t st0 = CUBUF_RESOURCE_STATS_INIT;
    T_OK(cubuf_resource_stats(r, &st0));
    CUstream cs;
    T_CU(cuStreamCreate, &cs, CU_STREAM_NON_BLOCKING);
    T_CU(cuStreamBeginCapture, cs, CU_STREAM_CAPTURE_MODE_GLOBAL);
    cubuf_buffer_t *b = NULL;
    T_STATUS(cubuf_resource_allocate(r, 1000, cs, &b), CUBUF_ERROR_STREAM_CAPTURING);
    T_CHECK(b == NULL);
    T_CHECK(strstr(cubuf_last_error(), "graph") != NULL);
    T_STATS(r, st0.current_bytes, st0.peak_bytes, st0.current_count, st0.peak_count,
            st0.total_allocations);
    CUgraph g = NULL;
    T_CU(cuStreamEndCapture, cs, &g); /* the capture is still valid */
    T_CHECK(g != NULL);
    if (g) T_CU(cuGraphDestroy, g);

    T_REQUIRE(cubuf_resource_allocate(r, 1000, g_s, &b));
    T_CU(cuStreamSynchronize, g_s);
    T_CU(cuStreamBeginCapture, cs, CU_STREAM_CAPTURE_MODE_GLOBAL);
    T_STATUS(cubuf_buffer_close_on(b, cs), CUBUF_ERROR_STREAM_CAPTURING);
    T_CHECK(!cubuf_buffer_is_closed(b) && cubuf_buffer_ptr(b) != 0);
    g = NULL;
    (void)cubuf__drv.cuStreamEndCapture(cs, &g); /* the driver may have invalidated it */
    if (g) T_CU(cuGraphDestroy, g);
    T_OK(cubuf_buffer_close_on(b, g_s));
    T_CHECK(cubuf_buffer_is_closed(b));
    cubuf_buffer_release(b);
    T_STATS(r, st0.current_bytes, st0.peak_bytes > 1000 ? st0.peak_bytes : 1000, st0.current_count,
            st0.peak_count > 1 ? st0.peak_count : 1, st0.total_allocations + 1);
    T_CU(cuStreamDestroy, cs);
}

static void test_pinned(void)
{
    cubuf_resource_t *r = NULL;
    T_REQUIRE(cubuf_pinned_resource_create(0, false, &r));
    check_props(r, -1, true, false, false);
    CUmemoryPool pool = cubuf__pool_handle(r);
    T_CHECK(pool != NULL && pool != default_pool());
    /* The device was granted read-write access: copies run at full speed. */
    CUmemLocation loc = {CU_MEM_LOCATION_TYPE_DEVICE, 0};
    CUmemAccess_flags flags = CU_MEM_ACCESS_FLAGS_PROT_NONE;
    T_CU(cuMemPoolGetAccess, &flags, pool, &loc);
    T_CHECK(flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    T_CHECK(threshold(pool) == UINT64_MAX);
    exercise_sizes(r, g_s, true);
    cubuf_buffer_t *b = NULL;
    T_OK(cubuf_resource_allocate(r, 1000, g_s, &b));
    T_CHECK(cubuf_buffer_device_id(b) == -1);
    cubuf_buffer_release(b); /* the last release closes it */
    T_STATS(r, 0, GiB + 1001, 0, 3, 4);
    test_capture_refused(r);
    trim_pool(r, 64 * MiB);
    cubuf_resource_release(r);

    cubuf_status_t st = cubuf_pinned_resource_create(0, true, &r);
    if (st == CUBUF_ERROR_NOT_SUPPORTED) {
        printf("note: IPC pinned pools not supported here: %s\n", cubuf_last_error());
        return;
    }
    T_OK(st);
    check_props(r, -1, true, false, true);
    T_CU(cuMemPoolGetAccess, &flags, cubuf__pool_handle(r), &loc);
    T_CHECK(flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    T_OK(cubuf_resource_allocate(r, MiB, g_s, &b));
    check_host_rw(cubuf_buffer_ptr(b), MiB, g_s);
    T_OK(cubuf_buffer_close(b));
    cubuf_buffer_release(b);
    cubuf_resource_release(r);
}

/* A driver before 12.6 does not know the host-pool attributes
 * (CUDA_ERROR_INVALID_VALUE): the pinned pool is not supported there, as
 * the header says, not a driver failure; any other failure is the driver's. */
static void test_pinned_old_driver(void)
{
    for (int ipc = 0; ipc < 2; ipc++) {
        /* the query after memory pools (and, for IPC, pool handle types) */
        const unsigned nth = ipc ? 3 : 2;
        cubuf_resource_t *r = NULL;
        T_CHECK(cubuf_fault_fail_nth("cuDeviceGetAttribute", nth, CUDA_ERROR_INVALID_VALUE));
        T_STATUS(cubuf_pinned_resource_create(0, ipc, &r), CUBUF_ERROR_NOT_SUPPORTED);
        T_CHECK(cubuf_fault_fired() && r == NULL);
        T_CHECK(strstr(cubuf_last_error(), "before 12.6") != NULL);
        T_CHECK(cubuf_fault_fail_nth("cuDeviceGetAttribute", nth, CUDA_ERROR_UNKNOWN));
        T_STATUS(cubuf_pinned_resource_create(0, ipc, &r), CUBUF_ERROR_DRIVER);
        T_CHECK(cubuf_fault_fired() && r == NULL && cubuf_last_cuda_result() == CUDA_ERROR_UNKNOWN);
        cubuf_fault_reset();
    }
    cubuf_context_t *c = NULL;
    cubuf_buffer_t *b = NULL;
    T_REQUIRE(cubuf_context_create(0, &c));
    T_CHECK(cubuf_fault_fail_nth("cuDeviceGetAttribute", 2, CUDA_ERROR_INVALID_VALUE));
    T_STATUS(cubuf_context_new_host_buffer(c, MiB, &b), CUBUF_ERROR_NOT_SUPPORTED);
    T_CHECK(cubuf_fault_fired() && b == NULL);
    cubuf_fault_reset();
    T_OK(cubuf_context_new_host_buffer(c, MiB, &b)); /* the next call makes the pool */
    cubuf_buffer_release(b);
    cubuf_context_destroy(c);
}

static void test_graph(void)
{
    cubuf_resource_t *r = NULL;
    T_REQUIRE(cubuf_graph_resource_create(0, &r));
    check_props(r, 0, false, false, false);
    T_CHECK(cubuf__pool_handle(r) == NULL); /* not a pool resource: never exported */
    check_no_pool(r); /* graph memory is not the default pool's to trim */

    /* Outside capture: refused, pointing at the pool resources. */
    cubuf_buffer_t *b = NULL;
    T_STATUS(cubuf_resource_allocate(r, 4096, g_s, &b), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(strstr(cubuf_last_error(), "cubuf_device_resource_create") != NULL);
    T_STATUS(cubuf_resource_allocate(r, 4096, CU_STREAM_LEGACY, &b), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(b == NULL);
    T_STATS(r, 0, 0, 0, 0, 0);

    const size_t n = MiB;
    CUstream cs;
    T_CU(cuStreamCreate, &cs, CU_STREAM_NON_BLOCKING);
    CUdeviceptr out = 0;
    T_CU(cuMemAlloc, &out, n);
    unsigned char *h = malloc(n);
    T_CHECK(h != NULL);

    /* Inside capture: an allocation node, a fill and a copy out, a free node. */
    T_CU(cuStreamBeginCapture, cs, CU_STREAM_CAPTURE_MODE_GLOBAL);
    T_REQUIRE(cubuf_resource_allocate(r, n, cs, &b));
    CUdeviceptr p = cubuf_buffer_ptr(b);
    T_CHECK(p != 0);
    T_STATS(r, n, n, 1, 1, 1);
    T_CU(cuMemsetD8Async, p, 0xab, n, cs);
    T_CU(cuMemsetD8Async, p + 100, 0x11, 10, cs);
    T_CU(cuMemcpyAsync, out, p, n, cs);
    T_OK(cubuf_buffer_close(b)); /* a free node */
    cubuf_buffer_release(b);
    T_STATS(r, 0, n, 0, 1, 1);
    CUgraph g = NULL;
    T_CU(cuStreamEndCapture, cs, &g);
    T_REQUIRE(g ? CUBUF_SUCCESS : CUBUF_ERROR_DRIVER);
    CUgraphExec ge = NULL;
    T_CU(cuGraphInstantiateWithFlags, &ge, g, 0);
    for (int launch = 0; launch < 2; launch++) {
        T_CU(cuMemsetD8Async, out, 0, n, g_s);
        T_CU(cuGraphLaunch, ge, g_s);
        T_CU(cuStreamSynchronize, g_s);
        memset(h, 0, n);
        T_CU(cuMemcpyDtoH, h, out, n);
        size_t bad = 0;
        for (size_t i = 0; i < n; i++) bad += h[i] != (i >= 100 && i < 110 ? 0x11 : 0xab);
        T_CHECK(bad == 0);
    }
    T_CU(cuGraphExecDestroy, ge);
    T_CU(cuGraphDestroy, g);

    /* An allocation the graph does not free outlives its launch and is freed
     * later on a stream that is not capturing. */
    T_CU(cuStreamBeginCapture, cs, CU_STREAM_CAPTURE_MODE_GLOBAL);
    T_REQUIRE(cubuf_resource_allocate(r, n, cs, &b));
    T_CU(cuMemsetD8Async, cubuf_buffer_ptr(b), 0x77, n, cs);
    g = NULL;
    T_CU(cuStreamEndCapture, cs, &g);
    T_REQUIRE(g ? CUBUF_SUCCESS : CUBUF_ERROR_DRIVER);
    T_CU(cuGraphInstantiateWithFlags, &ge, g, 0);
    T_CU(cuGraphLaunch, ge, g_s);
    T_CU(cuMemcpyAsync, out, cubuf_buffer_ptr(b), n, g_s);
    T_CU(cuStreamSynchronize, g_s);
    T_CU(cuMemcpyDtoH, h, out, n);
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) bad += h[i] != 0x77;
    T_CHECK(bad == 0);
    T_STATS(r, n, n, 1, 1, 2);
    T_OK(cubuf_buffer_close_on(b, g_s));
    cubuf_buffer_release(b);
    T_STATS(r, 0, n, 0, 1, 2);
    T_CU(cuStreamSynchronize, g_s);
    T_CU(cuGraphExecDestroy, ge);
    T_CU(cuGraphDestroy, g);

    T_CU(cuMemFree, out);
    free(h);
    T_CU(cuStreamDestroy, cs);
    cubuf_resource_release(r);
}

/* ---- fault injection -------------------------------------------------------- */

typedef cubuf_status_t (*create_fn)(cubuf_resource_t **out);

static cubuf_status_t mk_default(cubuf_resource_t **o) { return cubuf_device_resource_create(0, NULL, o); }
static cubuf_status_t mk_private(cubuf_resource_t **o)
{
    cubuf_device_resource_options_t opt = CUBUF_DEVICE_RESOURCE_OPTIONS_INIT;
    opt.private_pool = true;
    opt.max_size = 256 * MiB;
    opt.release_threshold = 0;
    return cubuf_device_resource_create(0, &opt, o);
}
static cubuf_status_t mk_private_ipc(cubuf_resource_t **o)
{
    cubuf_device_resource_options_t opt = CUBUF_DEVICE_RESOURCE_OPTIONS_INIT;
    opt.private_pool = true;
    opt.ipc_enabled = true;
    return cubuf_device_resource_create(0, &opt, o);
}
static cubuf_status_t mk_pinned(cubuf_resource_t **o) { return cubuf_pinned_resource_create(0, false, o); }
static cubuf_status_t mk_pinned_ipc(cubuf_resource_t **o) { return cubuf_pinned_resource_create(0, true, o); }
static cubuf_status_t mk_graph(cubuf_resource_t **o) { return cubuf_graph_resource_create(0, o); }

static void fault_create_pass(const char *name, create_fn mk, bool alloc);

/* Fails the 1st, 2nd, ... driver call of a create until it succeeds, then
 * the 1st, 2nd, ... host allocation. */
static void fault_create(const char *name, create_fn mk)
{
    fault_create_pass(name, mk, false);
    fault_create_pass(name, mk, true);
}

static void fault_create_pass(const char *name, create_fn mk, bool alloc)
{
    CUcontext before = current();
    for (unsigned n = 1; n < 200; n++) {
        cubuf_resource_t *r = NULL;
        cubuf_fault_count_calls(true);
        if (alloc) t_fail_alloc_nth(n);
        else cubuf_fault_fail_any_nth(n, CUDA_ERROR_UNKNOWN);
        cubuf_status_t st = mk(&r);
        bool fired = cubuf_fault_fired();
        if (fired && alloc) T_STATUS(st, CUBUF_ERROR_OUT_OF_MEMORY);
        const char *call = cubuf_fault_fired_name();
        cubuf_fault_reset();
        if (fired) check_balanced(name, n, call);
        cubuf_fault_count_calls(false);
        T_CHECK(current() == before);
        if (!fired) {
            if (st != CUBUF_ERROR_NOT_SUPPORTED) T_OK(st);
            cubuf_resource_release(r);
            return;
        }
        if (st == CUBUF_SUCCESS) {
            fprintf(stderr, "%s: failing call %u (%s) was not reported\n", name, n, call);
            t_failures++;
            cubuf_resource_release(r);
        }
        T_CHECK(st == CUBUF_SUCCESS || r == NULL);
    }
    fprintf(stderr, "%s: never succeeded\n", name);
    t_failures++;
}

static void fault_allocate_pass(const char *name, cubuf_resource_t *r, CUstream s, bool alloc);

/* Fails each driver call, then each host allocation, of an allocation in
 * turn: nothing is counted, nothing is returned, and the resource's pool
 * uses no more than before. */
static void fault_allocate(const char *name, cubuf_resource_t *r, CUstream s)
{
    fault_allocate_pass(name, r, s, false);
    fault_allocate_pass(name, r, s, true);
}

static void fault_allocate_pass(const char *name, cubuf_resource_t *r, CUstream s, bool alloc)
{
    CUmemoryPool pool = cubuf__pool_handle(r);
    CUcontext before = current();
    T_CU(cuCtxSetCurrent, g_ctx);
    cuuint64_t base = settled_used(pool);
    T_CU(cuCtxSetCurrent, before);
    cubuf_resource_stats_t st0 = CUBUF_RESOURCE_STATS_INIT;
    T_OK(cubuf_resource_stats(r, &st0));
    for (unsigned n = 1; n < 100; n++) {
        cubuf_buffer_t *b = NULL;
        cubuf_fault_count_calls(true);
        if (alloc) t_fail_alloc_nth(n);
        else cubuf_fault_fail_any_nth(n, CUDA_ERROR_UNKNOWN);
        cubuf_status_t st = cubuf_resource_allocate(r, MiB, s, &b);
        bool fired = cubuf_fault_fired();
        if (fired && alloc) T_STATUS(st, CUBUF_ERROR_OUT_OF_MEMORY);
        if (fired) check_balanced(name, n, cubuf_fault_fired_name());
        cubuf_fault_reset();
        cubuf_fault_count_calls(false);
        T_CHECK(current() == before);
        if (!fired) {
            T_OK(st);
            T_CHECK(cubuf_buffer_ptr(b) != 0);
            T_OK(cubuf_buffer_close(b));
            cubuf_buffer_release(b);
            T_STATS(r, 0, st0.peak_bytes > MiB ? st0.peak_bytes : MiB, 0,
                    st0.peak_count ? st0.peak_count : 1, st0.total_allocations + 1);
            T_CU(cuCtxSetCurrent, g_ctx);
            T_USED_BACK(pool, base, name);
            T_CU(cuCtxSetCurrent, before);
            return;
        }
        T_CHECK(st != CUBUF_SUCCESS && b == NULL);
        T_STATS(r, 0, st0.peak_bytes, 0, st0.peak_count, st0.total_allocations);
        T_CU(cuCtxSetCurrent, g_ctx);
        T_USED_BACK(pool, base, name);
        T_CU(cuCtxSetCurrent, before);
    }
    fprintf(stderr, "%s: allocation never succeeded\n", name);
    t_failures++;
}

static void test_faults(void)
{
    static const struct {
        const char *name;
        create_fn mk;
    } makers[] = {{"default pool", mk_default}, {"private pool", mk_private},
                  {"private IPC pool", mk_private_ipc}, {"pinned pool", mk_pinned},
                  {"pinned IPC pool", mk_pinned_ipc}, {"graph resource", mk_graph}};
    for (size_t i = 0; i < sizeof makers / sizeof makers[0]; i++) {
        fault_create(makers[i].name, makers[i].mk); /* with a current context */
        T_CU(cuCtxSetCurrent, NULL);
        fault_create(makers[i].name, makers[i].mk); /* and without: pushes too */
        T_CU(cuCtxSetCurrent, g_ctx);
    }

    cubuf_resource_t *r = NULL;
    T_REQUIRE(mk_default(&r));
    fault_allocate("default pool, user stream", r, g_s);
    T_CU(cuCtxSetCurrent, NULL);
    fault_allocate("default pool, legacy stream, no context", r, CU_STREAM_LEGACY);
    T_CU(cuCtxSetCurrent, g_ctx);
    cubuf_resource_release(r);
    T_REQUIRE(mk_private(&r));
    fault_allocate("private pool", r, g_s);
    T_CU(cuCtxSetCurrent, NULL);
    fault_allocate("private pool, per-thread stream, no context", r, CU_STREAM_PER_THREAD);
    T_CU(cuCtxSetCurrent, g_ctx);
    cubuf_resource_release(r);
    T_REQUIRE(mk_pinned(&r));
    fault_allocate("pinned pool", r, g_s);
    T_CU(cuCtxSetCurrent, NULL);
    fault_allocate("pinned pool, legacy stream, no context", r, CU_STREAM_LEGACY);
    T_CU(cuCtxSetCurrent, g_ctx);
    cubuf_resource_release(r);

    /* The graph resource's allocation path, inside one capture that every
     * refused attempt leaves intact: each driver call, then each host
     * allocation, failed in turn. */
    T_REQUIRE(mk_graph(&r));
    CUstream cs;
    T_CU(cuStreamCreate, &cs, CU_STREAM_NON_BLOCKING);
    T_CU(cuStreamBeginCapture, cs, CU_STREAM_CAPTURE_MODE_GLOBAL);
    for (int alloc = 0; alloc < 2; alloc++)
    for (unsigned n = 1; n < 100; n++) {
        cubuf_buffer_t *b = NULL;
        cubuf_fault_count_calls(true);
        if (alloc) t_fail_alloc_nth(n);
        else cubuf_fault_fail_any_nth(n, CUDA_ERROR_UNKNOWN);
        cubuf_status_t st = cubuf_resource_allocate(r, MiB, cs, &b);
        bool fired = cubuf_fault_fired();
        if (fired && alloc) T_STATUS(st, CUBUF_ERROR_OUT_OF_MEMORY);
        if (fired) check_balanced("graph resource in capture", n, cubuf_fault_fired_name());
        cubuf_fault_reset();
        cubuf_fault_count_calls(false);
        CUstreamCaptureStatus cst = CU_STREAM_CAPTURE_STATUS_NONE;
        T_CU(cuStreamIsCapturing, cs, &cst);
        T_CHECK(cst == CU_STREAM_CAPTURE_STATUS_ACTIVE);
        if (!fired) {
            T_OK(st);
            T_OK(cubuf_buffer_close(b));
            cubuf_buffer_release(b);
            break;
        }
        T_CHECK(st != CUBUF_SUCCESS && b == NULL);
        T_STATS(r, 0, alloc ? MiB : 0, 0, alloc, alloc); /* the driver pass's one success */
    }
    CUgraph g = NULL;
    T_CU(cuStreamEndCapture, cs, &g);
    T_CHECK(g != NULL);
    if (g) T_CU(cuGraphDestroy, g);
    T_STATS(r, 0, MiB, 0, 1, 2);
    T_CU(cuStreamDestroy, cs);
    cubuf_resource_release(r);
}

/* ---- the statistics' layouts, on a resource that needs no driver ---------------- */

static cubuf_status_t host_alloc(void *state, size_t size, CUstream stream, CUdeviceptr *ptr)
{
    void *p = malloc(size);
    *ptr = (CUdeviceptr)(uintptr_t)p;
    return p ? CUBUF_SUCCESS : CUBUF_ERROR_OUT_OF_MEMORY;
}

static cubuf_status_t host_free(void *state, CUdeviceptr ptr, size_t size, CUstream stream)
{
    free((void *)(uintptr_t)ptr);
    return CUBUF_SUCCESS;
}

/* A struct of the first layout (as a program built against cubuf 0.1 has)
 * is filled up to its size and not a byte further; a larger one (a newer
 * header) up to this library's size; a smaller one is refused untouched.
 * Trim and the threshold setter refuse a resource without a pool. No GPU. */
static void test_stats_layouts_cpu(void)
{
    const cubuf_resource_ops_t ops = {CUBUF_RESOURCE_OPS_VERSION, host_alloc, host_free, NULL};
    cubuf_resource_props_t props = CUBUF_RESOURCE_PROPS_INIT;
    props.host_accessible = true; /* and not device accessible: stream 0 needs no context */
    cubuf_resource_t *r = NULL;
    T_REQUIRE(cubuf_resource_create(&ops, &props, NULL, &r));
    cubuf_buffer_t *b = NULL;
    T_REQUIRE(cubuf_resource_allocate(r, 1000, NULL, &b));

    cubuf_resource_stats_t two[2];
    memset(two, 0xee, sizeof two);
    two[0].struct_size = CUBUF_RESOURCE_STATS_SIZE_V1;
    T_OK(cubuf_resource_stats(r, &two[0]));
    T_CHECK(two[0].struct_size == CUBUF_RESOURCE_STATS_SIZE_V1);
    T_CHECK(two[0].current_bytes == 1000 && two[0].peak_bytes == 1000 && two[0].current_count == 1 &&
            two[0].peak_count == 1 && two[0].total_allocations == 1);
    const unsigned char *tail = (const unsigned char *)two + CUBUF_RESOURCE_STATS_SIZE_V1;
    size_t touched = 0;
    for (size_t i = 0; i < sizeof two - CUBUF_RESOURCE_STATS_SIZE_V1; i++) touched += tail[i] != 0xee;
    T_CHECK(touched == 0);

    memset(two, 0xee, sizeof two);
    two[0].struct_size = sizeof two[0] + 16; /* a newer header's */
    T_OK(cubuf_resource_stats(r, &two[0]));
    T_CHECK(two[0].struct_size == sizeof two[0] + 16);
    T_CHECK(two[0].current_bytes == 1000 && two[0].pool_reserved_current == 0 &&
            two[0].pool_used_high == 0);
    touched = 0;
    for (size_t i = 0; i < sizeof two[1]; i++) touched += ((const unsigned char *)&two[1])[i] != 0xee;
    T_CHECK(touched == 0);

    const size_t small[] = {0, sizeof(size_t), CUBUF_RESOURCE_STATS_SIZE_V1 - 1};
    for (int i = 0; i < 3; i++) {
        memset(two, 0xee, sizeof two);
        two[0].struct_size = small[i];
        cubuf_resource_stats_t copy = two[0];
        T_STATUS(cubuf_resource_stats(r, &two[0]), CUBUF_ERROR_INVALID_ARGUMENT);
        T_CHECK(strstr(cubuf_last_error(), "cubuf_resource_stats_t") != NULL);
        T_CHECK(memcmp(&copy, &two[0], sizeof copy) == 0);
    }
    T_STATUS(cubuf_resource_stats(r, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_resource_trim(NULL, 0), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_resource_set_release_threshold(NULL, 0), CUBUF_ERROR_INVALID_ARGUMENT);
    check_no_pool(r);
    cubuf_buffer_release(b);
    T_STATS(r, 0, 1000, 0, 1, 1);
    cubuf_resource_release(r);
}

int main(void)
{
    test_stats_layouts_cpu();
    if (t_failures) return t_finish("test_resource_pool (before the GPU part)");
    t_require_gpu();
    t_held_count();
    t_held_t held0 = t_held();
    cubuf_context_t *ctx = NULL;
    T_REQUIRE(cubuf_context_create(0, &ctx));
    T_REQUIRE(cubuf_context_handle(ctx, &g_ctx));
    T_CU(cuCtxSetCurrent, g_ctx);
    T_CU(cuDeviceGet, &g_dev, 0);
    T_CU(cuStreamCreate, &g_s, CU_STREAM_NON_BLOCKING);
    leak_visible(default_pool(), "default pool");

    test_validation();
    test_default_pool();
    test_private_pool();
    test_max_size();
    test_trim();
    cubuf_resource_t *r = NULL;
    T_REQUIRE(cubuf_device_resource_create(0, NULL, &r));
    test_capture_refused(r);
    cubuf_resource_release(r);
    test_faults();
    test_pinned();
    test_pinned_old_driver();
    test_graph();

    /* Every resource released its retained primary context. */
    T_CU(cuStreamDestroy, g_s);
    T_CU(cuCtxSetCurrent, NULL);
    cubuf_context_destroy(ctx);
    T_HELD_BACK(held0, "test_resource_pool"); /* every pool and allocation went back */
    unsigned flags = 0;
    int active = 1;
    T_CU(cuDevicePrimaryCtxGetState, g_dev, &flags, &active);
    T_CHECK(!active);
    return t_finish("test_resource_pool");
}
