/* What the resource tests share: counting driver calls around injected faults. */
#ifndef CUBUF_RESOURCE_TEST_H
#define CUBUF_RESOURCE_TEST_H

#include <stdint.h>
#include <string.h>

#include "test.h"

#define MiB ((size_t)1 << 20)
#define GiB ((size_t)1 << 30)

/* The resource's counters are exactly these (printed on mismatch). Read with
 * the first layout: no driver query, so safe while faults are armed. */
#define T_STATS(res, cur, peak, cnt, pcnt, tot)                                               \
    do {                                                                                      \
        cubuf_resource_stats_t s_ = {.struct_size = CUBUF_RESOURCE_STATS_SIZE_V1};            \
        T_OK(cubuf_resource_stats((res), &s_));                                               \
        if (s_.current_bytes != (size_t)(cur) || s_.peak_bytes != (size_t)(peak) ||           \
            s_.current_count != (size_t)(cnt) || s_.peak_count != (size_t)(pcnt) ||           \
            s_.total_allocations != (uint64_t)(tot)) {                                        \
            fprintf(stderr,                                                                   \
                    "%s:%d: stats %zu/%zu bytes, %zu/%zu count, %llu total; expected "        \
                    "%zu/%zu, %zu/%zu, %llu\n",                                               \
                    __FILE__, __LINE__, s_.current_bytes, s_.peak_bytes, s_.current_count,    \
                    s_.peak_count, (unsigned long long)s_.total_allocations, (size_t)(cur),   \
                    (size_t)(peak), (size_t)(cnt), (size_t)(pcnt), (unsigned long long)(tot)); \
            t_failures++;                                                                     \
        }                                                                                     \
    } while (0)

static inline CUcontext current(void)
{
    CUcontext c = NULL;
    T_CU(cuCtxGetCurrent, &c);
    return c;
}

/* The resource's properties: device accessible, the rest as given. */
static inline void check_props(cubuf_resource_t *res, int device_id, bool host, bool managed, bool ipc)
{
    cubuf_resource_props_t p = CUBUF_RESOURCE_PROPS_INIT;
    T_OK(cubuf_resource_props(res, &p));
    T_CHECK(p.device_id == device_id);
    T_CHECK(p.device_accessible);
    T_CHECK(p.host_accessible == host);
    T_CHECK(p.managed == managed);
    T_CHECK(p.ipc_enabled == ipc);
}

/* A resource without a memory pool: trim and the threshold setter refuse
 * (nothing changes), and the statistics' pool figures are 0. */
static inline void check_no_pool(cubuf_resource_t *res)
{
    T_STATUS(cubuf_resource_trim(res, 0), CUBUF_ERROR_NOT_SUPPORTED);
    T_CHECK(strstr(cubuf_last_error(), "no memory pool") != NULL);
    T_STATUS(cubuf_resource_set_release_threshold(res, 0), CUBUF_ERROR_NOT_SUPPORTED);
    cubuf_resource_stats_t s = CUBUF_RESOURCE_STATS_INIT;
    s.pool_reserved_current = s.pool_reserved_high = s.pool_used_current = s.pool_used_high = 7;
    T_OK(cubuf_resource_stats(res, &s));
    T_CHECK(s.struct_size == sizeof s);
    T_CHECK(s.pool_reserved_current == 0 && s.pool_reserved_high == 0 && s.pool_used_current == 0 &&
            s.pool_used_high == 0);
}

static unsigned char pattern(size_t i) { return (unsigned char)(i * 31 + 7); }

/* Device memory: a device fill over the whole range read back at three
 * places, then a host pattern through the last page. */
static inline void check_device_rw(CUdeviceptr p, size_t n, CUstream s)
{
    size_t m = n < 4096 ? n : 4096;
    unsigned char w[4096], r[4096];
    T_CU(cuStreamSynchronize, s); /* the allocation has completed */
    if (n > m) {
        T_CU(cuMemsetD8Async, p, 0x5a, n, s);
        T_CU(cuStreamSynchronize, s);
        size_t offs[3] = {0, (n / 2) & ~(size_t)4095, n - m};
        for (int k = 0; k < 3; k++) {
            memset(r, 0, m);
            T_CU(cuMemcpyDtoH, r, p + offs[k], m);
            size_t bad = 0;
            for (size_t i = 0; i < m; i++) bad += r[i] != 0x5a;
            T_CHECK(bad == 0);
        }
    }
    for (size_t i = 0; i < m; i++) w[i] = pattern(i);
    T_CU(cuMemcpyHtoD, p + n - m, w, m);
    memset(r, 0, m);
    T_CU(cuMemcpyDtoH, r, p + n - m, m);
    T_CHECK(memcmp(w, r, m) == 0);
}

/* Host-accessible memory: the host writes the first and last page through
 * the pointer and the device reads them (a copy into device memory); then
 * the device fills the whole range and the host reads it back (about a
 * thousand samples of a large range: managed memory would otherwise
 * migrate every page). */
static inline void check_host_rw(CUdeviceptr p, size_t n, CUstream s)
{
    size_t m = n < 4096 ? n : 4096;
    unsigned char *h = (unsigned char *)(uintptr_t)p;
    unsigned char r[2 * 4096];
    T_CU(cuStreamSynchronize, s);
    memset(h, 0x3c, m);
    for (size_t i = 0; i < m; i++) h[n - m + i] = pattern(i);
    CUdeviceptr scratch = 0;
    T_CU(cuMemAlloc, &scratch, 2 * m);
    T_CU(cuMemcpyAsync, scratch, p, m, s);
    T_CU(cuMemcpyAsync, scratch + m, p + n - m, m, s);
    T_CU(cuStreamSynchronize, s);
    T_CU(cuMemcpyDtoH, r, scratch, 2 * m);
    size_t bad = 0;
    for (size_t i = 0; i < m; i++) {
        unsigned char want = i >= n - m ? pattern(i - (n - m)) : 0x3c;
        bad += r[i] != want;
        bad += r[m + i] != pattern(i);
    }
    T_CHECK(bad == 0);
    T_CU(cuMemFree, scratch);
    T_CU(cuMemsetD8Async, p, 0xc3, n, s);
    T_CU(cuStreamSynchronize, s);
    bad = 0;
    size_t step = n > MiB ? n / 1021 : 1;
    for (size_t i = 0; i < n; i += step) bad += h[i] != 0xc3;
    bad += h[n - 1] != 0xc3;
    T_CHECK(bad == 0);
}

static unsigned long total_calls(void)
{
    unsigned long n = 0;
    for (int i = 0; i < CUBUF_DRV_COUNT; i++) n += cubuf_fault_calls(cubuf__drv_name((cubuf_drv_id_t)i));
    return n;
}

/* During a failed operation every handle the driver gave out was given back:
 * primary context retains, pools and allocations (counted calls; the
 * injected failure is the one call that did not happen). */
static long succeeded(const char *const *names, const char *fired)
{
    long n = 0;
    for (; *names; names++) n += (long)cubuf_fault_calls(*names) - (strcmp(fired, *names) == 0);
    return n;
}

static void check_balanced(const char *what, unsigned nth, const char *fired)
{
    static const char *const retains[] = {"cuDevicePrimaryCtxRetain", NULL};
    static const char *const releases[] = {"cuDevicePrimaryCtxRelease", NULL};
    static const char *const creates[] = {"cuMemPoolCreate", NULL};
    static const char *const destroys[] = {"cuMemPoolDestroy", NULL};
    static const char *const allocs[] = {"cuMemAlloc", "cuMemAllocManaged", "cuMemHostAlloc",
                                         "cuMemAllocHost", "cuMemAllocFromPoolAsync",
                                         "cuMemAllocAsync", NULL};
    static const char *const frees[] = {"cuMemFree", "cuMemFreeHost", "cuMemFreeAsync", NULL};
    if (succeeded(retains, fired) != succeeded(releases, fired) ||
        succeeded(creates, fired) != succeeded(destroys, fired) ||
        succeeded(allocs, fired) != succeeded(frees, fired)) {
        fprintf(stderr, "%s: failing call %u (%s) leaked: %ld/%ld retains/releases, %ld/%ld pools "
                "created/destroyed, %ld/%ld allocations/frees\n",
                what, nth, fired, succeeded(retains, fired), succeeded(releases, fired),
                succeeded(creates, fired), succeeded(destroys, fired), succeeded(allocs, fired),
                succeeded(frees, fired));
        t_failures++;
    }
}

#endif
