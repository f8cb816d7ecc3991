/* Virtual memory growth at scale: 2 MiB -> 64 GiB by doubling, and a
 * thousand grows of one granule each. Data written before every step reads
 * back after it; nothing is copied (each step adds one physical allocation
 * and statistics count physical memory once); everything is freed at the end. */
#include <stdint.h>

#include "test.h"
#include "vmm_test.h"
#include "vmm.h"

#define MIB ((size_t)1 << 20)
#define GIB ((size_t)1 << 30)

static size_t g_gran;

/* Every 32-bit word of [p, p+n) equals v. */
static bool check_words(CUdeviceptr p, size_t n, uint32_t v)
{
    T_CU(cuMemcpyDtoH, g_host, p, n);
    const uint32_t *w = (const uint32_t *)g_host;
    for (size_t i = 0; i < n / 4; i++)
        if (w[i] != v) {
            fprintf(stderr, "word mismatch at 0x%llx + %zu: 0x%08x, expected 0x%08x\n",
                    (unsigned long long)p, 4 * i, w[i], v);
            return false;
        }
    return true;
}

static cubuf_resource_stats_t stats_of(cubuf_resource_t *res)
{
    cubuf_resource_stats_t s = CUBUF_RESOURCE_STATS_INIT;
    T_OK(cubuf_resource_stats(res, &s));
    return s;
}

static size_t chunk_count(cubuf_buffer_t *b)
{
    cubuf_vmm_chunk_t *c = NULL;
    size_t n = 0, first = 0;
    T_OK(cubuf__vmm_chunks(b, &c, &n, &first));
    free(c);
    return n;
}

/* Region k of the doubling buffer is [start(k), start(k+1)), filled with
 * the word k+1: region 0 is the first allocation, region k the part step k
 * added. */
static size_t region_start(size_t k, size_t first) { return k == 0 ? 0 : first << (k - 1); }

static bool check_region(CUdeviceptr base, size_t k, size_t first, size_t sample)
{
    size_t lo = region_start(k, first), hi = region_start(k + 1, first);
    size_t n = hi - lo < sample ? hi - lo : sample;
    uint32_t v = (uint32_t)k + 1;
    return check_words(base + lo, n, v) && check_words(base + lo + (hi - lo) / 2 - n / 2, n, v) &&
           check_words(base + hi - n, n, v);
}

static void test_doubling(cubuf_resource_t *res, size_t top)
{
    size_t first = 2 * MIB > g_gran ? 2 * MIB : g_gran;
    cubuf_buffer_t *b = NULL;
    T_REQUIRE(cubuf_resource_allocate(res, first, 0, &b));
    T_CU(cuMemsetD32Async, cubuf_buffer_ptr(b), 1, first / 4, NULL);
    size_t steps = 0, moves = 0;
    for (size_t size = first; size < top; size *= 2) {
        cubuf_buffer_t *n = NULL;
        T_REQUIRE(cubuf_vmm_modify_allocation(res, b, 2 * size, NULL, &n));
        steps++;
        T_CHECK(cubuf_buffer_size(n) == 2 * size);
        if (cubuf_buffer_ptr(n) != cubuf_buffer_ptr(b)) moves++;
        /* Everything written so far reads back through the new buffer. */
        for (size_t k = 0; k < steps; k++) T_CHECK(check_region(cubuf_buffer_ptr(n), k, first, 256));
        T_CU(cuMemsetD32Async, cubuf_buffer_ptr(n) + size, (unsigned)(steps + 1), size / 4, NULL);
        T_CU(cuCtxSynchronize);
        T_OK(cubuf_buffer_close(b)); /* the old buffer's close frees nothing */
        cubuf_buffer_release(b);
        b = n;
        cubuf_resource_stats_t s = stats_of(res);
        T_CHECK(s.current_bytes == 2 * size && s.current_count == steps + 1);
    }
    for (size_t k = 0; k <= steps; k++) T_CHECK(check_region(cubuf_buffer_ptr(b), k, first, 64 << 10));
    T_CHECK(chunk_count(b) == steps + 1);
    printf("doubling: %zu MiB -> %zu MiB in %zu steps, %zu of them moved the range\n", first / MIB,
           cubuf_buffer_size(b) / MIB, steps, moves);
    T_OK(cubuf_buffer_close(b));
    cubuf_buffer_release(b);
    cubuf_resource_stats_t s = stats_of(res);
    T_CHECK(s.current_bytes == 0 && s.current_count == 0);
}

static void test_steps(cubuf_resource_t *res, size_t nsteps)
{
    size_t step = 2 * MIB > g_gran ? 2 * MIB : g_gran;
    cubuf_buffer_t *b = NULL;
    T_REQUIRE(cubuf_resource_allocate(res, step, 0, &b));
    write_pattern(cubuf_buffer_ptr(b), step, 0, 7);
    size_t moves = 0;
    for (size_t i = 1; i <= nsteps; i++) {
        cubuf_buffer_t *n = NULL;
        size_t size = (i + 1) * step;
        T_REQUIRE(cubuf_vmm_modify_allocation(res, b, size, NULL, &n));
        T_CHECK(cubuf_buffer_size(n) == size);
        if (cubuf_buffer_ptr(n) != cubuf_buffer_ptr(b)) moves++;
        CUdeviceptr p = cubuf_buffer_ptr(n);
        write_pattern(p + i * step, step, i * step, 7);
        /* A few offsets: the start, the previous step, one in the middle, the new end. */
        size_t mid = (i / 2) * step + step / 3;
        T_CHECK(check_pattern(p, 256, 0, 7));
        T_CHECK(check_pattern(p + (i - 1) * step + step - 256, 256, (i - 1) * step + step - 256, 7));
        T_CHECK(check_pattern(p + mid, 256, mid, 7));
        T_CHECK(check_pattern(p + size - 256, 256, size - 256, 7));
        T_OK(cubuf_buffer_close(b));
        cubuf_buffer_release(b);
        b = n;
        if (t_failures > 20) break;
    }
    size_t total = cubuf_buffer_size(b);
    T_CHECK(check_pattern(cubuf_buffer_ptr(b), total, 0, 7)); /* all of it */
    cubuf_resource_stats_t s = stats_of(res);
    T_CHECK(s.current_bytes == total && s.current_count == nsteps + 1);
    T_CHECK(chunk_count(b) == nsteps + 1);
    printf("steps: %zu grows of %zu MiB to %zu MiB, %zu of them moved the range\n", nsteps,
           step / MIB, total / MIB, moves);
    T_OK(cubuf_buffer_close(b));
    cubuf_buffer_release(b);
    s = stats_of(res);
    T_CHECK(s.current_bytes == 0 && s.current_count == 0);
}

int main(void)
{
    cubuf_context_t *ctx = NULL;
    CUcontext cu = NULL;
    cubuf_resource_t *res = vmm_test_start(&ctx, &cu, &g_gran);
    g_host = malloc(SCRATCH);
    if (!g_host) return 1;
    t_held_t held0 = t_held();
    cubuf_vmm_live_t live0;
    cubuf__vmm_live(&live0);
    size_t free0 = 0, total = 0; /* sizes the test, checks nothing */
    T_CU(cuMemGetInfo, &free0, &total);

    /* 64 GiB when the device has room for it (and a margin), else the
     * largest doubling that fits, so the test still runs on smaller GPUs. */
    size_t top = 64 * GIB;
    while (top > 4 * MIB && top + 4 * GIB > free0) top /= 2;
    if (top < 64 * GIB) printf("note: %zu MiB free, doubling only up to %zu MiB\n", free0 / MIB, top / MIB);
    test_doubling(res, top);
    test_steps(res, 1000);

    cubuf_vmm_live_t live1;
    cubuf__vmm_live(&live1);
    T_CHECK(live1.reservations == live0.reservations && live1.mappings == live0.mappings &&
            live1.allocations == live0.allocations);
    cubuf_resource_release(res);
    T_HELD_BACK(held0, "test_vmm_grow");
    free(g_host);
    cubuf_context_destroy(ctx);
    return t_finish("test_vmm_grow");
}
