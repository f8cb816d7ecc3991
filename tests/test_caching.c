/* The caching resource over a user upstream of host memory: size classes,
 * hits and misses, the large-request rule, cross-stream reuse, trim, the
 * release threshold, out-of-memory release-and-retry with its report,
 * faults on every upstream call and host allocation leaving nothing
 * leaked, and 16 threads with exact totals. Host memory is not device
 * accessible, so the cache makes no driver call: this runs everywhere.
 * (The device parts are in test_caching_gpu.c.) */
#include <pthread.h>
#include <stdint.h>

#include "cubuf/caching.h"
#include "test.h"

/* ---- the upstream: host memory with a byte limit and an injected failure ---- */

typedef struct host_up {
    pthread_mutex_t mutex;
    size_t limit;        /* out of memory beyond this many live bytes */
    size_t live_bytes;
    long live, allocs, deallocs, calls, destroys;
    long fail_at;        /* the fail_at-th call from now (alloc or dealloc) fails */
    size_t last_alloc_size, last_dealloc_size;
    CUstream last_stream;
} host_up_t;

static bool up_fails(host_up_t *u)
{
    u->calls++;
    return u->fail_at && u->calls == u->fail_at;
}

static cubuf_status_t up_alloc(void *state, size_t size, CUstream stream, CUdeviceptr *ptr)
{
    host_up_t *u = state;
    cubuf_status_t st = CUBUF_SUCCESS;
    pthread_mutex_lock(&u->mutex);
    if (up_fails(u)) {
        st = CUBUF_ERROR_DRIVER;
    } else if (u->live_bytes + size > u->limit) {
        st = CUBUF_ERROR_OUT_OF_MEMORY;
    } else {
        void *p = aligned_alloc(512, (size + 511) & ~(size_t)511);
        if (!p) {
            st = CUBUF_ERROR_OUT_OF_MEMORY;
        } else {
            *ptr = (CUdeviceptr)(uintptr_t)p;
            u->live_bytes += size;
            u->live++;
            u->allocs++;
            u->last_alloc_size = size;
            u->last_stream = stream;
        }
    }
    pthread_mutex_unlock(&u->mutex);
    return st;
}

static cubuf_status_t up_dealloc(void *state, CUdeviceptr ptr, size_t size, CUstream stream)
{
    host_up_t *u = state;
    cubuf_status_t st = CUBUF_SUCCESS;
    pthread_mutex_lock(&u->mutex);
    if (up_fails(u)) {
        st = CUBUF_ERROR_DRIVER;
    } else {
        free((void *)(uintptr_t)ptr);
        u->live_bytes -= size;
        u->live--;
        u->deallocs++;
        u->last_dealloc_size = size;
        u->last_stream = stream;
    }
    pthread_mutex_unlock(&u->mutex);
    return st;
}

static void up_destroy(void *state) { ((host_up_t *)state)->destroys++; }

static const cubuf_resource_ops_t k_up_ops = {CUBUF_RESOURCE_OPS_VERSION, up_alloc, up_dealloc,
                                              up_destroy};

#define S1 ((CUstream)(uintptr_t)0x1000)
#define S2 ((CUstream)(uintptr_t)0x2000)

static cubuf_resource_t *make_up(host_up_t *u)
{
    memset(u, 0, sizeof *u);
    pthread_mutex_init(&u->mutex, NULL);
    u->limit = SIZE_MAX;
    cubuf_resource_props_t props = CUBUF_RESOURCE_PROPS_INIT;
    props.host_accessible = true; /* not device accessible: no driver */
    cubuf_resource_t *r = NULL;
    T_REQUIRE(cubuf_resource_create(&k_up_ops, &props, u, &r));
    return r;
}

/* A caching resource over a fresh upstream; the caller releases both. */
static cubuf_resource_t *make_cache(host_up_t *u, cubuf_resource_t **up,
                                    const cubuf_caching_options_t *o)
{
    *up = make_up(u);
    cubuf_resource_t *c = NULL;
    T_REQUIRE(cubuf_caching_resource_create(*up, o, &c));
    return c;
}

static cubuf_caching_stats_t stats_of(cubuf_resource_t *c)
{
    cubuf_caching_stats_t s = CUBUF_CACHING_STATS_INIT;
    T_OK(cubuf_caching_stats(c, &s));
    return s;
}

/* Releases the cache and its upstream; checks the upstream got everything back. */
static void finish(cubuf_resource_t *c, cubuf_resource_t *up, host_up_t *u)
{
    u->fail_at = 0;
    cubuf_resource_release(c);
    T_CHECK(u->live == 0 && u->live_bytes == 0);
    T_CHECK(u->destroys == 0); /* the test still holds it */
    cubuf_resource_release(up);
    T_CHECK(u->destroys == 1);
}

static void test_classes(void)
{
    T_CHECK(cubuf_caching_class_size(0) == 0);
    T_CHECK(cubuf_caching_class_size(1) == 512);
    T_CHECK(cubuf_caching_class_size(512) == 512);
    T_CHECK(cubuf_caching_class_size(513) == 1024);
    T_CHECK(cubuf_caching_class_size(4096) == 4096);
    T_CHECK(cubuf_caching_class_size(4097) == 4608);
    T_CHECK(cubuf_caching_class_size(8192) == 8192);
    T_CHECK(cubuf_caching_class_size(8193) == 9216);
    T_CHECK(cubuf_caching_class_size(1 << 20) == 1 << 20);
    T_CHECK(cubuf_caching_class_size((1 << 20) + 1) == (1 << 20) + (1 << 17));
    T_CHECK(cubuf_caching_class_size(CUBUF_CACHING_MAX_CLASS_SIZE) == CUBUF_CACHING_MAX_CLASS_SIZE);
    T_CHECK(cubuf_caching_class_size(CUBUF_CACHING_MAX_CLASS_SIZE + 1) == 0);
    /* the waste bound, multiples of 512, monotone, and each class its own fixed point */
    size_t prev = 0;
    int bad = 0;
    for (size_t n = 1; n < ((size_t)1 << 30); n += n < 65536 ? 1 : n / 1000 + 7) {
        size_t k = cubuf_caching_class_size(n);
        if (k < n || k % 512 || k - n >= 512 + n / 8 || k < prev || cubuf_caching_class_size(k) != k)
            bad++;
        prev = k;
    }
    T_CHECK(bad == 0);
}

static void test_args(void)
{
    host_up_t u;
    cubuf_resource_t *up = make_up(&u), *c = NULL;
    T_STATUS(cubuf_caching_resource_create(NULL, NULL, &c), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_caching_resource_create(up, NULL, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    cubuf_caching_options_t o = CUBUF_CACHING_OPTIONS_INIT;
    o.max_cached_size = CUBUF_CACHING_MAX_CLASS_SIZE + 1;
    T_STATUS(cubuf_caching_resource_create(up, &o, &c), CUBUF_ERROR_INVALID_ARGUMENT);
    o = (cubuf_caching_options_t)CUBUF_CACHING_OPTIONS_INIT;
    o.struct_size = 4;
    T_STATUS(cubuf_caching_resource_create(up, &o, &c), CUBUF_ERROR_INVALID_ARGUMENT);
    /* a resource that is not a caching one */
    CUdeviceptr p = 0;
    T_STATUS(cubuf_caching_allocate(up, 100, S1, &p), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(strstr(cubuf_last_error(), "not a caching resource") != NULL);
    T_CHECK(!cubuf_is_caching_resource(up) && !cubuf_is_caching_resource(NULL));
    T_STATUS(cubuf_caching_trim(NULL, 0), CUBUF_ERROR_INVALID_ARGUMENT);
    cubuf_caching_stats_t s = CUBUF_CACHING_STATS_INIT;
    T_STATUS(cubuf_caching_stats(up, &s), CUBUF_ERROR_INVALID_ARGUMENT);
    T_REQUIRE(cubuf_caching_resource_create(up, NULL, &c));
    T_CHECK(cubuf_is_caching_resource(c));
    T_STATUS(cubuf_caching_allocate(c, 0, S1, &p), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_caching_allocate(c, 1, S1, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_caching_deallocate(c, 0, 1, S1), CUBUF_ERROR_INVALID_ARGUMENT);
    s.struct_size = 8;
    T_STATUS(cubuf_caching_stats(c, &s), CUBUF_ERROR_INVALID_ARGUMENT);
    /* the properties are the upstream's */
    cubuf_resource_props_t pr = CUBUF_RESOURCE_PROPS_INIT;
    T_OK(cubuf_resource_props(c, &pr));
    T_CHECK(pr.host_accessible && !pr.device_accessible && pr.device_id == -1);
    T_CHECK(u.allocs == 0);
    finish(c, up, &u);
}

static void test_hits_misses(void)
{
    host_up_t u;
    cubuf_resource_t *up, *c = make_cache(&u, &up, NULL);
    CUdeviceptr a = 0, b = 0;
    T_OK(cubuf_caching_allocate(c, 1000, S1, &a));
    T_CHECK(u.allocs == 1 && u.last_alloc_size == 1024 && u.last_stream == S1);
    memset((void *)(uintptr_t)a, 0x5a, 1000);
    T_OK(cubuf_caching_deallocate(c, a, 1000, S1));
    T_CHECK(u.deallocs == 0); /* cached */
    T_OK(cubuf_caching_allocate(c, 900, S1, &b)); /* same class, same stream */
    T_CHECK(b == a && u.allocs == 1);
    T_CHECK(((unsigned char *)(uintptr_t)b)[999] == 0x5a); /* the same host bytes */
    cubuf_caching_stats_t s = stats_of(c);
    T_CHECK(s.hits == 1 && s.misses == 1 && s.cross_stream_reuses == 0);
    T_CHECK(s.live_bytes == 1024 && s.requested_bytes == 900 && s.internal_waste_bytes == 124);
    T_CHECK(s.live_count == 1 && s.cached_bytes == 0 && s.held_bytes == 1024);
    T_CHECK(s.upstream_allocations == 1 && s.upstream_deallocations == 0);
    /* another class is a miss */
    CUdeviceptr d = 0;
    T_OK(cubuf_caching_allocate(c, 5000, S1, &d));
    T_CHECK(d != a && u.allocs == 2 && u.last_alloc_size == 5120);
    T_OK(cubuf_caching_deallocate(c, d, 5000, S1));
    T_OK(cubuf_caching_deallocate(c, b, 900, S1));
    s = stats_of(c);
    T_CHECK(s.live_bytes == 0 && s.cached_bytes == 1024 + 5120 && s.cached_count == 2);
    T_CHECK(s.largest_free_bytes == 5120 && s.peak_held_bytes == 1024 + 5120);
    T_CHECK(s.fragmentation > 0.16 && s.fragmentation < 0.17); /* 1 - 5120/6144 */
    /* the generic paths: raw pointers and buffers */
    CUdeviceptr r = 0;
    T_OK(cubuf_resource_allocate_raw(c, 800, S1, &r));
    T_CHECK(r == a);
    T_OK(cubuf_resource_deallocate_raw(c, r, 800, S1));
    cubuf_buffer_t *buf = NULL;
    T_OK(cubuf_resource_allocate(c, 4900, S1, &buf));
    T_CHECK(cubuf_buffer_ptr(buf) == d && cubuf_buffer_size(buf) == 4900);
    T_OK(cubuf_buffer_close(buf));
    cubuf_buffer_release(buf);
    s = stats_of(c);
    T_CHECK(s.hits == 3 && u.allocs == 2 && s.live_count == 0 && s.cached_count == 2);
    finish(c, up, &u);
}

static void test_cross_stream_and_large(void)
{
    host_up_t u;
    cubuf_resource_t *up, *c = make_cache(&u, &up, NULL);
    CUdeviceptr a = 0, a2 = 0, b = 0;
    /* one block on S1: S2 does not take it (each stream keeps its own) */
    T_OK(cubuf_caching_allocate(c, 3000, S1, &a));
    T_OK(cubuf_caching_deallocate(c, a, 3000, S1));
    T_OK(cubuf_caching_allocate(c, 3000, S2, &a2));
    T_CHECK(a2 != a && u.allocs == 2 && stats_of(c).cross_stream_reuses == 0);
    /* two on S1: S2 takes the one freed last */
    T_OK(cubuf_caching_deallocate(c, a2, 3000, S1));
    T_OK(cubuf_caching_allocate(c, 3000, S2, &b));
    T_CHECK(b == a2 && u.allocs == 2);
    cubuf_caching_stats_t s = stats_of(c);
    T_CHECK(s.cross_stream_reuses == 1 && s.hits == 0 && s.misses == 2);
    /* freed on S2 it is S2's now: a hit there */
    T_OK(cubuf_caching_deallocate(c, b, 3000, S2));
    T_OK(cubuf_caching_allocate(c, 3000, S2, &b));
    T_CHECK(b == a2 && stats_of(c).hits == 1);
    /* out of memory upstream: S1's last block goes to S2, with no release */
    u.limit = u.live_bytes;
    T_OK(cubuf_caching_allocate(c, 3000, S2, &a2));
    s = stats_of(c);
    T_CHECK(a2 == a && s.cross_stream_reuses == 2 && s.oom_retries == 0 && u.allocs == 2);
    u.limit = SIZE_MAX;
    T_OK(cubuf_caching_deallocate(c, a2, 3000, S2));
    T_OK(cubuf_caching_deallocate(c, b, 3000, S2));
    /* CU_STREAM_LEGACY and 0 are one stream */
    T_OK(cubuf_caching_allocate(c, 3000, CU_STREAM_LEGACY, &b));
    T_OK(cubuf_caching_deallocate(c, b, 3000, CU_STREAM_LEGACY));
    T_OK(cubuf_caching_allocate(c, 3000, NULL, &b));
    T_CHECK(stats_of(c).hits == 2);
    T_OK(cubuf_caching_deallocate(c, b, 3000, NULL));
    finish(c, up, &u);

    /* cross_stream false: never across streams */
    cubuf_caching_options_t o = CUBUF_CACHING_OPTIONS_INIT;
    o.cross_stream = false;
    o.max_cached_size = 64 << 10;
    c = make_cache(&u, &up, &o);
    T_OK(cubuf_caching_allocate(c, 3000, S1, &a));
    T_OK(cubuf_caching_deallocate(c, a, 3000, S1));
    T_OK(cubuf_caching_allocate(c, 3000, S2, &b));
    T_CHECK(b != a && u.allocs == 2 && stats_of(c).cross_stream_reuses == 0);
    T_OK(cubuf_caching_deallocate(c, b, 3000, S2));
    /* above max_cached_size: the upstream at the request's own size, never cached */
    CUdeviceptr l = 0;
    T_OK(cubuf_caching_allocate(c, (64 << 10) + 1, S1, &l));
    T_CHECK(u.last_alloc_size == (64 << 10) + 1 && u.allocs == 3);
    s = stats_of(c);
    T_CHECK(s.live_bytes == (64 << 10) + 1 && s.live_count == 1 && s.internal_waste_bytes == 0);
    T_CHECK(s.misses == 3 && s.upstream_allocations == 3); /* the upstream served it: a miss */
    T_OK(cubuf_caching_deallocate(c, l, (64 << 10) + 1, S1));
    T_CHECK(u.deallocs == 1 && u.last_dealloc_size == (64 << 10) + 1);
    s = stats_of(c);
    T_CHECK(s.live_bytes == 0 && s.cached_count == 2 && s.cached_bytes == 2 * 3072);
    /* exactly max_cached_size is cached */
    T_OK(cubuf_caching_allocate(c, 64 << 10, S1, &l));
    T_OK(cubuf_caching_deallocate(c, l, 64 << 10, S1));
    T_CHECK(u.deallocs == 1 && stats_of(c).cached_count == 3);
    finish(c, up, &u);
}

static void test_trim_threshold_forget(void)
{
    host_up_t u;
    cubuf_resource_t *up, *c = make_cache(&u, &up, NULL);
    CUdeviceptr p[6];
    const size_t sizes[6] = {512, 1024, 2048, 4096, 8192, 16384};
    for (int i = 0; i < 6; i++) T_OK(cubuf_caching_allocate(c, sizes[i], i < 3 ? S1 : S2, &p[i]));
    for (int i = 0; i < 6; i++) T_OK(cubuf_caching_deallocate(c, p[i], sizes[i], i < 3 ? S1 : S2));
    T_CHECK(stats_of(c).cached_bytes == 32256 && u.live == 6);
    T_OK(cubuf_caching_trim(c, 20000));
    cubuf_caching_stats_t s = stats_of(c);
    T_CHECK(s.cached_bytes <= 20000 && s.cached_bytes == u.live_bytes);
    T_CHECK(s.held_bytes == s.cached_bytes && s.upstream_deallocations == (uint64_t)u.deallocs);
    /* forget S1: its blocks go back, on S1 */
    T_CHECK(s.cached_bytes == 15872 && u.deallocs == 1 && u.last_dealloc_size == 16384);
    T_CHECK(u.last_stream == S2);
    T_OK(cubuf_caching_forget_stream(c, S1));
    s = stats_of(c);
    T_CHECK(u.last_stream == S1 && u.deallocs == 4 && s.cached_bytes == 4096 + 8192);
    T_CHECK(s.cached_bytes == u.live_bytes);
    T_OK(cubuf_caching_forget_stream(c, (CUstream)(uintptr_t)0x7777)); /* never used: nothing */
    T_OK(cubuf_caching_trim(c, 0));
    T_CHECK(stats_of(c).cached_bytes == 0 && u.live == 0);
    /* a release threshold: deallocations beyond it go back to the upstream */
    T_OK(cubuf_caching_set_release_threshold(c, 4096));
    for (int i = 0; i < 6; i++) T_OK(cubuf_caching_allocate(c, 1024, S1, &p[i]));
    for (int i = 0; i < 6; i++) T_OK(cubuf_caching_deallocate(c, p[i], 1024, S1));
    s = stats_of(c);
    T_CHECK(s.cached_bytes == 4096 && s.cached_count == 4 && u.live == 4);
    T_OK(cubuf_caching_set_release_threshold(c, SIZE_MAX));
    for (int i = 0; i < 6; i++) T_OK(cubuf_caching_allocate(c, 1024, S1, &p[i]));
    for (int i = 0; i < 6; i++) T_OK(cubuf_caching_deallocate(c, p[i], 1024, S1));
    T_CHECK(stats_of(c).cached_count == 6 && u.live == 6);
    /* a failing upstream deallocation leaves the block cached */
    u.calls = 0;
    u.fail_at = 1;
    T_STATUS(cubuf_caching_trim(c, 0), CUBUF_ERROR_DRIVER);
    T_CHECK(stats_of(c).cached_count == 6 && u.live == 6);
    T_OK(cubuf_caching_trim(c, 0));
    T_CHECK(u.live == 0);
    finish(c, up, &u);
}

/* A free that fills a slot while a trim is giving one of its blocks back:
 * the upstream's deallocation frees another block of the class on the
 * stream (the slot is full again) and then fails, so the trim must push
 * its block back, growing the slot, not store it past the end. */
typedef struct reenter {
    cubuf_resource_t *cache;
    CUdeviceptr p;
    bool armed, fail_grow; /* fail_grow: the slot cannot grow for the put-back */
} reenter_t;
static reenter_t g_reenter;
static int g_warned;
static char g_warning[1024], g_hex[32];

static void count_warning(cubuf_status_t st, const char *message, void *user)
{
    (void)user;
    if (st == CUBUF_ERROR_OUT_OF_MEMORY) g_warned++;
    snprintf(g_warning, sizeof g_warning, "%s", message);
}

static cubuf_status_t up_dealloc_reenter(void *state, CUdeviceptr ptr, size_t size, CUstream stream)
{
    if (!g_reenter.armed) return up_dealloc(state, ptr, size, stream);
    g_reenter.armed = false;
    T_OK(cubuf_caching_deallocate(g_reenter.cache, g_reenter.p, 512, S1));
    if (g_reenter.fail_grow) cubuf_fault_fail_alloc_nth(1);
    return CUBUF_ERROR_DRIVER;
}

static void test_trim_putback_full_slot(void)
{
    static const cubuf_resource_ops_t ops = {CUBUF_RESOURCE_OPS_VERSION, up_alloc,
                                             up_dealloc_reenter, up_destroy};
    host_up_t u;
    memset(&u, 0, sizeof u);
    pthread_mutex_init(&u.mutex, NULL);
    u.limit = SIZE_MAX;
    cubuf_resource_props_t props = CUBUF_RESOURCE_PROPS_INIT;
    props.host_accessible = true;
    cubuf_resource_t *up = NULL, *c = NULL;
    T_REQUIRE(cubuf_resource_create(&ops, &props, &u, &up));
    T_REQUIRE(cubuf_caching_resource_create(up, NULL, &c));
    enum { N = 8 }; /* a slot's first capacity */
    CUdeviceptr p[N + 1];
    for (int i = 0; i <= N; i++) T_OK(cubuf_caching_allocate(c, 512, S1, &p[i]));
    for (int i = 0; i < N; i++) T_OK(cubuf_caching_deallocate(c, p[i], 512, S1));
    T_CHECK(stats_of(c).cached_count == N);
    g_reenter = (reenter_t){c, p[N], true, false};
    T_STATUS(cubuf_caching_trim(c, 0), CUBUF_ERROR_DRIVER);
    T_CHECK(!g_reenter.armed);
    cubuf_caching_stats_t s = stats_of(c);
    T_CHECK(s.cached_count == N + 1 && s.cached_bytes == (N + 1) * 512);
    T_CHECK(s.live_count == 0 && s.held_bytes == (N + 1) * 512 && u.live == N + 1);
    /* every block comes back once from the cache, and each goes back upstream */
    CUdeviceptr q[N + 1];
    for (int i = 0; i <= N; i++) T_OK(cubuf_caching_allocate(c, 512, S1, &q[i]));
    T_CHECK(stats_of(c).misses == N + 1); /* only the first allocations missed */
    int found = 0;
    for (int i = 0; i <= N; i++)
        for (int j = 0; j <= N; j++) found += q[i] == p[j];
    T_CHECK(found == N + 1);
    for (int i = 0; i <= N; i++) T_OK(cubuf_caching_deallocate(c, q[i], 512, S1));
    T_OK(cubuf_caching_trim(c, 0));
    T_CHECK(u.live == 0 && stats_of(c).held_bytes == 0);

    /* Again with no host memory for the slot to grow (it holds 16 now):
     * the block is lost to the cache, with a warning, and stays held. */
    enum { M = 16 };
    CUdeviceptr r[M + 1];
    for (int i = 0; i <= M; i++) T_OK(cubuf_caching_allocate(c, 512, S1, &r[i]));
    for (int i = 0; i < M; i++) T_OK(cubuf_caching_deallocate(c, r[i], 512, S1));
    g_reenter = (reenter_t){c, r[M], true, true};
    g_warned = 0;
    cubuf_set_warning_handler(count_warning, NULL);
    T_STATUS(cubuf_caching_trim(c, 0), CUBUF_ERROR_DRIVER);
    cubuf_set_warning_handler(NULL, NULL);
    T_CHECK(cubuf_fault_fired());
    cubuf_fault_reset();
    T_CHECK(g_warned == 1 && strstr(g_warning, "could not be cached again after a failed give-back"));
    s = stats_of(c);
    T_CHECK(s.cached_count == M && s.held_bytes == (M + 1) * 512 && u.live == M + 1);
    T_OK(cubuf_caching_trim(c, 0));
    T_CHECK(u.live == 1 && stats_of(c).held_bytes == 512);
    /* the lost block is the one the trim took last: hand it back by hand */
    CUdeviceptr lost = 0;
    for (int i = 0; i <= M && !lost; i++)
        if (strstr(g_warning, (snprintf(g_hex, sizeof g_hex, "0x%llx ", (unsigned long long)r[i]), g_hex)))
            lost = r[i];
    T_CHECK(lost != 0);
    if (lost) T_OK(up_dealloc(&u, lost, 512, S1));
    T_CHECK(u.live == 0);
    cubuf_resource_release(c); /* held_bytes counts the lost block: the cache's end says nothing of it */
    cubuf_resource_release(up);
    T_CHECK(u.destroys == 1);
}

static void test_oom_retry(void)
{
    host_up_t u;
    cubuf_resource_t *up, *c = make_cache(&u, &up, NULL);
    u.limit = 8192;
    CUdeviceptr a = 0, b = 0, d = 0, e = 0;
    T_OK(cubuf_caching_allocate(c, 4096, S1, &a));
    T_OK(cubuf_caching_allocate(c, 4096, S2, &b));
    T_OK(cubuf_caching_deallocate(c, a, 4096, S1));
    T_OK(cubuf_caching_deallocate(c, b, 4096, S2));
    /* the upstream fails until the cache gives its 8 KiB back */
    T_OK(cubuf_caching_allocate(c, 8000, S1, &d));
    cubuf_caching_stats_t s = stats_of(c);
    T_CHECK(s.oom_retries == 1 && s.cached_bytes == 0 && u.live == 1 && u.live_bytes == 8192);
    T_CHECK(s.live_bytes == 8192 && s.held_bytes == 8192);
    /* nothing left to release: the report */
    T_STATUS(cubuf_caching_allocate(c, 3000, S2, &e), CUBUF_ERROR_OUT_OF_MEMORY);
    const char *m = cubuf_last_error();
    T_CHECK(strstr(m, "3000 bytes requested") && strstr(m, "block of 3072 bytes"));
    T_CHECK(strstr(m, "live 8192 bytes") && strstr(m, "cached 0 bytes"));
    T_CHECK(strstr(m, "largest free block 0 bytes"));
    T_CHECK(e == 0 && stats_of(c).oom_retries == 2 && stats_of(c).live_count == 1);
    /* the generic path returns the same status and keeps the report, as
     * does an adaptor over the cache (they add what they add after it) */
    T_STATUS(cubuf_resource_allocate_raw(c, 3000, S2, &e), CUBUF_ERROR_OUT_OF_MEMORY);
    T_CHECK(strstr(cubuf_last_error(), "3000 bytes requested") &&
            strstr(cubuf_last_error(), "live 8192 bytes"));
    cubuf_resource_t *counted = NULL;
    T_REQUIRE(cubuf_statistics_adaptor_create(c, &counted));
    cubuf_buffer_t *none = NULL;
    T_STATUS(cubuf_resource_allocate(counted, 3000, S2, &none), CUBUF_ERROR_OUT_OF_MEMORY);
    m = cubuf_last_error();
    T_CHECK(strstr(m, "3000 bytes requested") && strstr(m, "largest free block 0 bytes"));
    T_CHECK(strstr(m, "user resource: allocate of 3000 bytes returned CUBUF_ERROR_OUT_OF_MEMORY"));
    T_CHECK(none == NULL);
    cubuf_resource_release(counted);
    /* the report counts cached blocks and the largest free one before the release */
    T_OK(cubuf_caching_deallocate(c, d, 8000, S1));
    u.limit = 8192 + 4096;
    T_OK(cubuf_caching_allocate(c, 4096, S2, &a)); /* the upstream: 12 KiB live */
    T_STATUS(cubuf_caching_allocate(c, 16384, S2, &e), CUBUF_ERROR_OUT_OF_MEMORY);
    m = cubuf_last_error();
    T_CHECK(strstr(m, "live 4096 bytes") && strstr(m, "cached 8192 bytes"));
    T_CHECK(strstr(m, "largest free block 8192 bytes"));
    T_CHECK(stats_of(c).cached_bytes == 0 && u.live == 1);
    T_OK(cubuf_caching_deallocate(c, a, 4096, S2));
    finish(c, up, &u);
}

/* One sequence over every path that calls the upstream; returns the live
 * pointers it could not free through `left` (freed later without faults). */
typedef struct held {
    CUdeviceptr p;
    size_t size;
    CUstream s;
} held_t;

static int scenario(cubuf_resource_t *c, host_up_t *u, held_t *left)
{
    int n = 0;
    held_t h[5] = {{0, 1000, S1}, {0, 5000, S2}, {0, 1000, S2}, {0, (64 << 10) + 5, S1},
                   {0, 70000, S2}};
    for (int i = 0; i < 5; i++) {
        cubuf_status_t st = cubuf_caching_allocate(c, h[i].size, h[i].s, &h[i].p);
        if (st != CUBUF_SUCCESS) {
            T_CHECK(st == CUBUF_ERROR_DRIVER || st == CUBUF_ERROR_OUT_OF_MEMORY);
            h[i].p = 0;
        }
        if (i == 0 && h[0].p) { /* the next 1000 comes from S1 to S2 */
            if (cubuf_caching_deallocate(c, h[0].p, 1000, S1) == CUBUF_SUCCESS) h[0].p = 0;
        }
    }
    for (int i = 1; i < 5; i++)
        if (h[i].p && cubuf_caching_deallocate(c, h[i].p, h[i].size, h[i].s) == CUBUF_SUCCESS)
            h[i].p = 0;
    (void)cubuf_caching_trim(c, 2048);
    u->limit = u->live_bytes + 1024; /* the next miss needs the release */
    CUdeviceptr q = 0;
    if (cubuf_caching_allocate(c, 6000, S1, &q) == CUBUF_SUCCESS) {
        if (cubuf_caching_deallocate(c, q, 6000, S1) != CUBUF_SUCCESS) left[n++] = (held_t){q, 6000, S1};
    }
    u->limit = SIZE_MAX;
    (void)cubuf_caching_trim(c, 0);
    for (int i = 0; i < 5; i++)
        if (h[i].p) left[n++] = h[i];
    return n;
}

static void test_faults(void)
{
    /* upstream failures: the n-th upstream call fails, for every n */
    int rounds = 0;
    for (long nth = 1;; nth++, rounds++) {
        host_up_t u;
        cubuf_resource_t *up, *c = make_cache(&u, &up, NULL);
        u.fail_at = nth;
        held_t left[8];
        int n = scenario(c, &u, left);
        bool fired = u.calls >= nth;
        u.fail_at = 0;
        for (int i = 0; i < n; i++) T_OK(cubuf_caching_deallocate(c, left[i].p, left[i].size, left[i].s));
        cubuf_caching_stats_t s = stats_of(c);
        T_CHECK(s.live_bytes == 0 && s.live_count == 0);
        T_CHECK(s.held_bytes == u.live_bytes && s.cached_count == (size_t)u.live);
        finish(c, up, &u);
        if (!fired) break;
    }
    printf("upstream faults: %d rounds\n", rounds);
    T_CHECK(rounds >= 10);
    /* host allocations: the n-th one fails, for every n */
    rounds = 0;
    for (unsigned nth = 1;; nth++, rounds++) {
        host_up_t u;
        cubuf_resource_t *up = make_up(&u), *c = NULL;
        cubuf_fault_fail_alloc_nth(nth);
        cubuf_status_t st = cubuf_caching_resource_create(up, NULL, &c);
        held_t left[8];
        int n = 0;
        if (st == CUBUF_SUCCESS) n = scenario(c, &u, left);
        else T_CHECK(st == CUBUF_ERROR_OUT_OF_MEMORY);
        bool fired = cubuf_fault_fired();
        cubuf_fault_reset();
        for (int i = 0; i < n; i++) T_OK(cubuf_caching_deallocate(c, left[i].p, left[i].size, left[i].s));
        if (c) {
            cubuf_caching_stats_t s = stats_of(c);
            T_CHECK(s.live_bytes == 0 && s.held_bytes == u.live_bytes);
            finish(c, up, &u);
        } else {
            cubuf_resource_release(up);
        }
        if (!fired) break;
    }
    printf("host allocation faults: %d rounds\n", rounds);
    T_CHECK(rounds > 3);
}

/* A deallocation on a stream the cache has not seen, without host memory
 * for that stream's state: the header lists no out-of-memory status for a
 * deallocation (a list that cannot grow sends the block to the upstream),
 * so the block must go to the upstream rather than stay allocated. */
static void test_free_new_stream_no_host_memory(void)
{
    host_up_t u;
    cubuf_resource_t *up, *c = make_cache(&u, &up, NULL);
    CUdeviceptr a = 0;
    T_OK(cubuf_caching_allocate(c, 1000, S1, &a));
    const CUstream s3 = (CUstream)(uintptr_t)0x3000;
    cubuf_fault_fail_alloc_nth(1);
    cubuf_status_t st = cubuf_caching_deallocate(c, a, 1000, s3);
    cubuf_fault_reset();
    T_OK(st);
    cubuf_caching_stats_t s = stats_of(c);
    T_CHECK(s.live_count == 0 && s.live_bytes == 0 && s.held_bytes == u.live_bytes);
    if (st != CUBUF_SUCCESS) T_OK(cubuf_caching_deallocate(c, a, 1000, s3));
    finish(c, up, &u);
}

/* ---- 16 threads: exact totals ---- */

#define T_THREADS 16
#define T_ITERS 20000
#define T_LIVE 8

typedef struct worker {
    cubuf_resource_t *c;
    int id;
    unsigned long allocs, failures;
} worker_t;

static atomic_int g_start;
static atomic_long g_mismatch;

static void *work(void *arg)
{
    worker_t *w = arg;
    uint64_t x = 0x9E3779B97F4A7C15ULL * (uint64_t)(w->id + 1);
    held_t live[T_LIVE] = {{0}};
    CUstream own = (CUstream)(uintptr_t)(0x10000 + 0x100 * w->id);
    while (!atomic_load(&g_start)) {
    }
    for (int i = 0; i < T_ITERS; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        int j = (int)(x % T_LIVE);
        if (live[j].p) {
            /* the tag is still ours: no other thread was given this block */
            if (*(volatile uint64_t *)(uintptr_t)live[j].p != (uint64_t)w->id * 1000003u + (uint64_t)j)
                w->failures++, atomic_fetch_add(&g_mismatch, 1);
            /* one in 8 frees on a neighbour's stream: shared stream locks */
            CUstream s = (x >> 20) % 8 ? own : (CUstream)(uintptr_t)(0x10000 + 0x100 * ((w->id + 1) % T_THREADS));
            if (cubuf_caching_deallocate(w->c, live[j].p, live[j].size, s) != CUBUF_SUCCESS) w->failures++;
            live[j].p = 0;
        } else {
            size_t size = 8 + (size_t)((x >> 32) % (256 << 10));
            if (cubuf_caching_allocate(w->c, size, own, &live[j].p) != CUBUF_SUCCESS) {
                w->failures++;
                continue;
            }
            live[j].size = size;
            *(volatile uint64_t *)(uintptr_t)live[j].p = (uint64_t)w->id * 1000003u + (uint64_t)j;
            w->allocs++;
        }
    }
    for (int j = 0; j < T_LIVE; j++)
        if (live[j].p && cubuf_caching_deallocate(w->c, live[j].p, live[j].size, own) != CUBUF_SUCCESS)
            w->failures++;
    return NULL;
}

/* T_THREADS workers (work) started together on c, and `beside` (if set)
 * running from before their start until they are all done (told to stop
 * by g_stop); their allocations and failures summed. */
static atomic_int g_stop;
static void run_workers(cubuf_resource_t *c, void *(*beside)(void *), unsigned long *allocs,
                        unsigned long *failures)
{
    pthread_t th[T_THREADS], side = 0;
    worker_t w[T_THREADS];
    atomic_store(&g_start, 0);
    atomic_store(&g_stop, 0);
    for (int i = 0; i < T_THREADS; i++) {
        w[i] = (worker_t){c, i, 0, 0};
        T_CHECK(pthread_create(&th[i], NULL, work, &w[i]) == 0);
    }
    if (beside) T_CHECK(pthread_create(&side, NULL, beside, c) == 0);
    atomic_store(&g_start, 1);
    for (int i = 0; i < T_THREADS; i++) {
        pthread_join(th[i], NULL);
        *allocs += w[i].allocs;
        *failures += w[i].failures;
    }
    atomic_store(&g_stop, 1);
    if (beside) pthread_join(side, NULL);
}

static void test_threads(void)
{
    host_up_t u;
    cubuf_resource_t *up, *c = make_cache(&u, &up, NULL);
    unsigned long allocs = 0, failures = 0;
    run_workers(c, NULL, &allocs, &failures);
    T_CHECK(failures == 0);
    cubuf_caching_stats_t s = stats_of(c);
    T_CHECK(s.hits + s.cross_stream_reuses + s.misses == allocs);
    T_CHECK(s.misses == s.upstream_allocations && s.upstream_deallocations == 0);
    T_CHECK(s.live_bytes == 0 && s.live_count == 0 && s.requested_bytes == 0);
    T_CHECK(s.cached_count == (size_t)u.live && s.cached_bytes == u.live_bytes);
    T_CHECK(s.held_bytes == u.live_bytes && s.peak_held_bytes >= s.held_bytes);
    T_CHECK(s.hits > allocs / 2);
    printf("threads: %lu allocations: %llu hits, %llu cross-stream, %llu misses; %zu bytes cached\n",
           allocs, (unsigned long long)s.hits, (unsigned long long)s.cross_stream_reuses,
           (unsigned long long)s.misses, s.cached_bytes);
    finish(c, up, &u);
}

/* Stress: workers allocate and free on their own and neighbours' streams
 * while one thread trims, reads statistics and flips the threshold, with the
 * upstream near out of memory (steals with min 1, release-and-retry). */
static void *chaos(void *arg)
{
    cubuf_resource_t *c = arg;
    unsigned i = 0;
    while (!atomic_load(&g_stop)) {
        switch (i++ % 4) {
        case 0: (void)cubuf_caching_trim(c, (i * 7919) % 200000); break;
        case 1: { cubuf_caching_stats_t s = CUBUF_CACHING_STATS_INIT; (void)cubuf_caching_stats(c, &s); break; }
        case 2: (void)cubuf_caching_set_release_threshold(c, i % 8 ? 100000 : SIZE_MAX); break;
        case 3: (void)cubuf_caching_forget_stream(c, (CUstream)(uintptr_t)(0x10000 + 0x100 * (i % T_THREADS))); break;
        }
    }
    return NULL;
}

static void test_threads_chaos(void)
{
    host_up_t u;
    cubuf_resource_t *up, *c = make_cache(&u, &up, NULL);
    u.limit = 6u << 20;
    unsigned long allocs = 0, failures = 0;
    run_workers(c, chaos, &allocs, &failures);
    cubuf_caching_stats_t s = stats_of(c);
    printf("chaos: %lu allocations, %lu failures (out of memory), %llu retries\n", allocs, failures,
           (unsigned long long)s.oom_retries);
    T_CHECK(s.live_bytes == 0 && s.live_count == 0 && s.requested_bytes == 0);
    T_CHECK(s.cached_count == (size_t)u.live && s.cached_bytes == u.live_bytes);
    T_CHECK(s.held_bytes == u.live_bytes);
    T_CHECK(atomic_load(&g_mismatch) == 0);
    u.limit = SIZE_MAX;
    finish(c, up, &u);
}

/* The framework entry points over resources set for two device slots: a
 * plain resource (its raw interface) and a caching one (the fast path). */
static void test_framework_set(void)
{
    host_up_t u, u2;
    cubuf_resource_t *up = make_up(&u), *up2, *c = make_cache(&u2, &up2, NULL);
    T_STATUS(cubuf_framework_set_resource(5, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_framework_set_resource(64, up), CUBUF_ERROR_OUT_OF_RANGE);
    T_OK(cubuf_framework_set_resource(5, up));
    T_STATUS(cubuf_framework_set_resource(5, c), CUBUF_ERROR_INVALID_ARGUMENT);
    T_OK(cubuf_framework_set_resource(6, c));
    cubuf_resource_t *r = NULL;
    T_OK(cubuf_framework_resource(6, &r));
    T_CHECK(r == c);
    void *p = cubuf_torch_alloc(1000, 5, S1);
    T_CHECK(p != NULL && u.allocs == 1 && u.last_alloc_size == 1000 && u.last_stream == S1);
    cubuf_torch_free(p, 1000, 5, S1);
    T_CHECK(u.deallocs == 1 && u.live == 0);
    void *q[100];
    for (int i = 0; i < 100; i++) {
        q[i] = cubuf_cupy_malloc(NULL, (size_t)i * 777, i % 2 ? 5 : 6);
        T_CHECK(q[i] != NULL);
    }
    T_CHECK(u.live == 50 && u.last_alloc_size == 99 * 777);
    for (int i = 0; i < 100; i++) cubuf_cupy_free(NULL, q[i], i % 2 ? 5 : 6);
    T_CHECK(u.live == 0 && stats_of(c).live_count == 0 && stats_of(c).cached_count > 0);
    void *t = cubuf_torch_alloc(0, 6, S2); /* 0 bytes: a block of 1 */
    T_CHECK(t != NULL);
    cubuf_torch_free(t, 0, 6, S2);
    T_CHECK(stats_of(c).live_count == 0);
    /* both stay set for the process: the upstreams are not released here */
    cubuf_resource_release(c);
    cubuf_resource_release(up);
}

/* CuPy's free passes no size: cubuf keeps each live pointer's. A free the
 * upstream fails keeps the pointer (a second free frees it, with its size);
 * a pointer it never handed out frees nothing (both warn); an allocation
 * whose size cannot be recorded is given back, and says why in the last
 * error. */
/* cubuf_cupy_malloc on slot 7 (u) until a new shard's first insert fails,
 * its host allocation made to fail at each call; `give_back_fails`: the
 * upstream's free of that memory fails too. Checks the refused call (NULL,
 * the table's error, the memory given back or not) and frees the pointers
 * made before it. Whether a call was refused. */
static bool cupy_refused_insert(host_up_t *u, bool give_back_fails)
{
    void *kept[256];
    int nkept = 0;
    bool refused = false;
    while (!refused && nkept < 256) {
        const long live = u->live;
        if (give_back_fails) u->fail_at = u->calls + 2; /* the call after the allocation */
        cubuf_fault_fail_alloc_nth(1);
        void *q = cubuf_cupy_malloc(NULL, 64, 7);
        refused = cubuf_fault_fired();
        cubuf_fault_reset();
        u->fail_at = 0;
        if (refused) {
            T_CHECK(q == NULL && u->live == live + give_back_fails);
            T_CHECK(strstr(cubuf_last_error(), "cannot grow the pointer table") != NULL);
        } else {
            T_CHECK(q != NULL);
            kept[nkept++] = q;
        }
    }
    for (int i = 0; i < nkept; i++) cubuf_cupy_free(NULL, kept[i], 7);
    return refused;
}

static void test_cupy_failures(void)
{
    static host_up_t u; /* slot 7 keeps the resource, and so this state, for the process */
    cubuf_resource_t *up = make_up(&u);
    T_OK(cubuf_framework_set_resource(7, up));
    t_warnings_t w = {0};
    cubuf_set_warning_handler(t_warning, &w);
    void *p = cubuf_cupy_malloc(NULL, 300, 7);
    T_CHECK(p != NULL && u.live == 1);
    u.fail_at = u.calls + 1; /* the free's upstream call */
    cubuf_cupy_free(NULL, p, 7);
    T_CHECK(w.n == 1 && u.live == 1 && strstr(w.last, "not freed"));
    cubuf_cupy_free(NULL, p, 7); /* still known, with its size */
    T_CHECK(w.n == 1 && u.live == 0 && u.deallocs == 1 && u.last_dealloc_size == 300);
    cubuf_cupy_free(NULL, p, 7); /* gone now */
    T_CHECK(w.n == 2 && u.deallocs == 1 && strstr(w.last, "not allocated by cubuf_cupy_malloc"));
    /* A table that cannot grow: a new shard's first insert fails, and the
     * memory goes back. */
    T_CHECK(cupy_refused_insert(&u, false));
    T_CHECK(u.live == 0 && w.n == 2);
    /* The same, and the give-back fails too: the memory is lost, and a
     * warning says so and where (it was lost silently). */
    T_CHECK(cupy_refused_insert(&u, true));
    T_CHECK(u.live == 1 && w.n == 3 && strstr(w.last, "could not be given back") != NULL);
    const char *at = strstr(w.last, " at 0x");
    const unsigned long long lost = at ? strtoull(at + 4, NULL, 16) : 0;
    T_CHECK(lost != 0);
    if (lost) T_OK(up_dealloc(&u, (CUdeviceptr)lost, 64, NULL)); /* the test's own cleanup */
    T_CHECK(u.live == 0);
    cubuf_set_warning_handler(NULL, NULL);
    cubuf_resource_release(up); /* the slot keeps it for the process */
}

/* A free on a device whose resource cannot be made warns with the status
 * that failed (here no driver, or no such device), not OUT_OF_RANGE. */
static cubuf_status_t w_status;
static void status_warning(cubuf_status_t st, const char *msg, void *user)
{
    (void)msg;
    (void)user;
    w_status = st;
}

static void test_framework_free_status(void)
{
    cubuf_resource_t *r = NULL;
    const cubuf_status_t want = cubuf_framework_resource(63, &r);
    if (want == CUBUF_SUCCESS) return; /* a machine with 64 devices */
    cubuf_set_warning_handler(status_warning, NULL);
    w_status = CUBUF_SUCCESS;
    cubuf_torch_free((void *)(uintptr_t)0x1000, 64, 63, NULL);
    T_CHECK(w_status == want);
    w_status = CUBUF_SUCCESS;
    cubuf_cupy_free(NULL, (void *)(uintptr_t)0x1000, 63); /* unknown: never reaches the resource */
    T_CHECK(w_status == CUBUF_ERROR_INVALID_ARGUMENT);
    cubuf_set_warning_handler(NULL, NULL);
    T_CHECK(cubuf_torch_alloc(64, 63, NULL) == NULL);
}

int main(void)
{
    test_classes();
    test_args();
    test_hits_misses();
    test_cross_stream_and_large();
    test_trim_threshold_forget();
    test_trim_putback_full_slot();
    test_oom_retry();
    test_faults();
    test_free_new_stream_no_host_memory();
    test_threads();
    test_threads_chaos();
    test_framework_set();
    test_cupy_failures();
    test_framework_free_status();
    return t_finish("test_caching");
}
