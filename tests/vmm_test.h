/* What the virtual-memory tests share. */
#ifndef CUBUF_VMM_TEST_H
#define CUBUF_VMM_TEST_H

#include "test.h"

/* The start of every VMM test: the driver objects counted (t_held_count),
 * device 0's primary context made current (*ctx, *cu), a VMM resource with
 * default options (the program exits 77 where the device has none) and,
 * unless gran is NULL, its granularity. */
__attribute__((unused)) static cubuf_resource_t *vmm_test_start(cubuf_context_t **ctx, CUcontext *cu,
                                                                size_t *gran)
{
    t_require_gpu();
    t_held_count();
    T_REQUIRE(cubuf_context_create(0, ctx));
    T_REQUIRE(cubuf_context_handle(*ctx, cu));
    T_CU(cuCtxSetCurrent, *cu);
    cubuf_resource_t *res = NULL;
    cubuf_status_t st = cubuf_vmm_resource_create(0, NULL, &res);
    if (st == CUBUF_ERROR_NOT_SUPPORTED) {
        printf("SKIP: %s\n", cubuf_last_error());
        exit(T_SKIP);
    }
    T_REQUIRE(st);
    if (gran) T_REQUIRE(cubuf_vmm_granularity(res, gran));
    return res;
}

/* Host scratch for byte patterns; a test mallocs SCRATCH bytes into it. */
static unsigned char *g_host;
#define SCRATCH ((size_t)64 << 20)

__attribute__((unused)) static unsigned char pattern_byte(size_t offset, unsigned seed)
{
    uint64_t x = (uint64_t)offset * 0x9E3779B97F4A7C15ull + seed * 0xD6E8FEB86659FD93ull;
    return (unsigned char)(x >> 56);
}

/* Writes the pattern of logical offsets [base, base+n) at device address p,
 * and waits for the writes: from pageable memory cuMemcpyHtoD returns once
 * the data is staged, its DMA maybe still running, which a close ordered
 * on another (non-blocking) stream does not wait for. */
__attribute__((unused)) static void write_pattern(CUdeviceptr p, size_t n, size_t base, unsigned seed)
{
    for (size_t done = 0; done < n;) {
        size_t k = n - done < SCRATCH ? n - done : SCRATCH;
        for (size_t i = 0; i < k; i++) g_host[i] = pattern_byte(base + done + i, seed);
        T_CU(cuMemcpyHtoD, p + done, g_host, k);
        done += k;
    }
    T_CU(cuCtxSynchronize);
}

__attribute__((unused)) static bool check_pattern(CUdeviceptr p, size_t n, size_t base, unsigned seed)
{
    for (size_t done = 0; done < n;) {
        size_t k = n - done < SCRATCH ? n - done : SCRATCH;
        T_CU(cuMemcpyDtoH, g_host, p + done, k);
        for (size_t i = 0; i < k; i++)
            if (g_host[i] != pattern_byte(base + done + i, seed)) {
                fprintf(stderr, "pattern mismatch at offset %zu (seed %u): got 0x%02x\n",
                        base + done + i, seed, g_host[i]);
                return false;
            }
        done += k;
    }
    return true;
}

#endif
