/* The synchronous resources: managed memory (preferred locations, prefetch),
 * legacy pinned host memory and cuMemAlloc device memory. Data written and
 * read back, exact statistics, closes refused on capturing streams without
 * breaking the capture, and every driver call of each allocate path failed
 * in turn. */
#include <stdint.h>

#include "alloc_fault_test.h"
#include "internal.h"
#include "test.h"
#include "resource_test.h"


static CUcontext g_ctx;
static CUdevice g_dev;
static CUstream g_s;




/* ---- leak checks ------------------------------------------------------------------
 *
 * These allocators call the driver synchronously, so the balance of their
 * calls at the driver table (t_held: cuMemAlloc and cuMemAllocManaged against
 * cuMemFree, cuMemHostAlloc and cuMemAllocHost against cuMemFreeHost) is
 * exact as soon as a close returns, whatever the size and wherever managed
 * pages are; other work on the device cannot move it. Every closed pointer is
 * also checked to be unknown to the driver (check_gone). leak_visible() shows
 * that one allocation of each kind moves the balance. */

/* The closed buffer's memory is gone as far as the driver knows: the driver
 * no longer recognizes the pointer (exact, whatever the size). */
static void check_gone(CUdeviceptr p, const char *what)
{
    unsigned int type = 0;
    CUresult r = cubuf__drv.cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, p);
    if (r == CUDA_SUCCESS) {
        fprintf(stderr, "%s: pointer 0x%llx is still known to the driver (memory type %u) after "
                "its buffer closed\n", what, (unsigned long long)p, type);
        t_failures++;
    }
}



/* Allocates each size from a fresh resource, checks data and exact stats,
 * closes. */
static void exercise(cubuf_resource_t *res, const size_t *sizes, int count, bool host, bool managed)
{
    T_STATS(res, 0, 0, 0, 0, 0);
    cubuf_buffer_t *b[4] = {NULL};
    size_t sum = 0, live = 0;
    for (int i = 0; i < count; i++) {
        T_REQUIRE(cubuf_resource_allocate(res, sizes[i], g_s, &b[i]));
        T_CHECK(cubuf_buffer_size(b[i]) == sizes[i]);
        T_CHECK((cubuf_buffer_ptr(b[i]) == 0) == (sizes[i] == 0));
        T_CHECK(cubuf_buffer_is_device_accessible(b[i]));
        T_CHECK(cubuf_buffer_is_host_accessible(b[i]) == host);
        T_CHECK(cubuf_buffer_is_managed(b[i]) == managed);
        sum += sizes[i];
        live += sizes[i] != 0;
    }
    for (int i = 0; i < count; i++) {
        if (!sizes[i]) continue;
        if (host) check_host_rw(cubuf_buffer_ptr(b[i]), sizes[i], g_s);
        else check_device_rw(cubuf_buffer_ptr(b[i]), sizes[i], g_s);
    }
    T_STATS(res, sum, sum, live, live, live);
    for (int i = 0; i < count; i++) {
        CUdeviceptr p = cubuf_buffer_ptr(b[i]);
        T_OK(cubuf_buffer_close(b[i]));
        T_CHECK(cubuf_buffer_is_closed(b[i]) && cubuf_buffer_ptr(b[i]) == 0);
        cubuf_buffer_release(b[i]);
        if (p) check_gone(p, "exercise");
    }
    T_STATS(res, 0, sum, 0, live, live);
}


static void fault_allocate_pass(const char *name, cubuf_resource_t *r, CUstream s, size_t size,
                                bool alloc);

/* Fails each driver call, then each host allocation, of an allocation of
 * `size` bytes in turn. */
static void fault_allocate(const char *name, cubuf_resource_t *r, CUstream s, size_t size)
{
    fault_allocate_pass(name, r, s, size, false);
    fault_allocate_pass(name, r, s, size, true);
}

static void fault_allocate_pass(const char *name, cubuf_resource_t *r, CUstream s, size_t size,
                                bool alloc)
{
    CUcontext before = current();
    t_held_t base = t_held();
    cubuf_resource_stats_t st0 = CUBUF_RESOURCE_STATS_INIT;
    T_OK(cubuf_resource_stats(r, &st0));
    for (unsigned n = 1; n < 100; n++) {
        cubuf_buffer_t *b = NULL;
        cubuf_fault_count_calls(true);
        if (alloc) t_fail_alloc_nth(n);
        else cubuf_fault_fail_any_nth(n, CUDA_ERROR_UNKNOWN);
        cubuf_status_t st = cubuf_resource_allocate(r, size, s, &b);
        bool fired = cubuf_fault_fired();
        if (fired && alloc) T_STATUS(st, CUBUF_ERROR_OUT_OF_MEMORY);
        if (fired) check_balanced(name, n, cubuf_fault_fired_name());
        cubuf_fault_reset();
        cubuf_fault_count_calls(false);
        T_CHECK(current() == before);
        if (fired) T_HELD_BACK(base, name);
        if (!fired) {
            T_OK(st);
            T_CHECK(cubuf_buffer_ptr(b) != 0);
            T_OK(cubuf_buffer_close(b));
            cubuf_buffer_release(b);
            T_STATS(r, 0, st0.peak_bytes > size ? st0.peak_bytes : size, 0,
                    st0.peak_count ? st0.peak_count : 1, st0.total_allocations + 1);
            T_HELD_BACK(base, name);
            return;
        }
        T_CHECK(st != CUBUF_SUCCESS && b == NULL);
        T_STATS(r, 0, st0.peak_bytes, 0, st0.peak_count, st0.total_allocations);
    }
    fprintf(stderr, "%s: allocation never succeeded\n", name);
    t_failures++;
}

/* Closing synchronizes the deallocation stream: on a capturing stream (or the
 * legacy stream a capture depends on) it is refused before anything happens,
 * the buffer stays open and the capture stays valid. A failed
 * synchronization or free also leaves the buffer open. */
static void close_rules(cubuf_resource_t *r, const char *free_call)
{
    cubuf_resource_stats_t st0 = CUBUF_RESOURCE_STATS_INIT;
    T_OK(cubuf_resource_stats(r, &st0));
    cubuf_buffer_t *b = NULL;
    T_REQUIRE(cubuf_resource_allocate(r, 4096, g_s, &b));
    T_CU(cuStreamSynchronize, g_s);

    CUstream cs, blocking;
    T_CU(cuStreamCreate, &cs, CU_STREAM_NON_BLOCKING);
    T_CU(cuStreamBeginCapture, cs, CU_STREAM_CAPTURE_MODE_GLOBAL);
    T_STATUS(cubuf_buffer_close_on(b, cs), CUBUF_ERROR_STREAM_CAPTURING);
    T_CHECK(!cubuf_buffer_is_closed(b) && cubuf_buffer_ptr(b) != 0);
    CUgraph g = NULL;
    T_CU(cuStreamEndCapture, cs, &g);
    T_CHECK(g != NULL);
    if (g) T_CU(cuGraphDestroy, g);

    T_CU(cuStreamCreate, &blocking, CU_STREAM_DEFAULT);
    T_CU(cuStreamBeginCapture, blocking, CU_STREAM_CAPTURE_MODE_RELAXED);
    T_STATUS(cubuf_buffer_close_on(b, CU_STREAM_LEGACY), CUBUF_ERROR_STREAM_CAPTURING);
    T_CHECK(!cubuf_buffer_is_closed(b));
    g = NULL;
    T_CU(cuStreamEndCapture, blocking, &g);
    T_CHECK(g != NULL);
    if (g) T_CU(cuGraphDestroy, g);

    T_CHECK(cubuf_fault_fail_nth("cuStreamSynchronize", 1, CUDA_ERROR_UNKNOWN));
    T_STATUS(cubuf_buffer_close_on(b, g_s), CUBUF_ERROR_DRIVER);
    cubuf_fault_reset();
    T_CHECK(!cubuf_buffer_is_closed(b));
    T_CHECK(cubuf_fault_fail_nth(free_call, 1, CUDA_ERROR_UNKNOWN));
    T_STATUS(cubuf_buffer_close_on(b, g_s), CUBUF_ERROR_DRIVER);
    cubuf_fault_reset();
    T_CHECK(!cubuf_buffer_is_closed(b));
    T_STATS(r, 4096, st0.peak_bytes > 4096 ? st0.peak_bytes : 4096, 1,
            st0.peak_count ? st0.peak_count : 1, st0.total_allocations + 1);

    /* No current context: the free runs in the resource's context. */
    T_CU(cuCtxSetCurrent, NULL);
    T_OK(cubuf_buffer_close(b));
    T_CHECK(current() == NULL);
    T_CU(cuCtxSetCurrent, g_ctx);
    T_CHECK(cubuf_buffer_is_closed(b));
    cubuf_buffer_release(b);
    T_STATS(r, 0, st0.peak_bytes > 4096 ? st0.peak_bytes : 4096, 0,
            st0.peak_count ? st0.peak_count : 1, st0.total_allocations + 1);
    T_CU(cuStreamDestroy, cs);
    T_CU(cuStreamDestroy, blocking);
}

static int range_attr(CUdeviceptr p, size_t n, CUmem_range_attribute attr)
{
    int v = 12345;
    T_CU(cuMemRangeGetAttribute, &v, sizeof v, attr, p, n);
    return v;
}

/* The leak checks can see one leaked allocation of each kind: made through
 * the table, it moves the balance by one; freed, the balance is back. */
static void leak_visible(bool managed)
{
    t_held_t base = t_held();
    CUdeviceptr p = 0;
    T_CU(cuMemAlloc, &p, 1);
    T_CHECK(t_held().device == base.device + 1);
    T_CU(cuMemFree, p);
    void *h = NULL;
    T_CU(cuMemHostAlloc, &h, 1, CU_MEMHOSTALLOC_PORTABLE);
    T_CHECK(t_held().host == base.host + 1);
    T_CU(cuMemFreeHost, h);
    if (managed) {
        T_CU(cuMemAllocManaged, &p, 1, CU_MEM_ATTACH_GLOBAL);
        T_CHECK(t_held().device == base.device + 1);
        T_CU(cuMemFree, p);
    }
    T_HELD_BACK(base, "leak_visible");
}

static void test_managed(void)
{
    int count = 0;
    T_REQUIRE(cubuf_device_count(&count));
    cubuf_resource_t *r = NULL;
    T_STATUS(cubuf_managed_resource_create(0, -2, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_managed_resource_create(0, -3, &r), CUBUF_ERROR_OUT_OF_RANGE);
    T_STATUS(cubuf_managed_resource_create(0, count, &r), CUBUF_ERROR_OUT_OF_RANGE);
    T_CHECK(strstr(cubuf_last_error(), "preferred_location") != NULL);
    T_STATUS(cubuf_managed_resource_create(-1, -2, &r), CUBUF_ERROR_OUT_OF_RANGE);
    T_STATUS(cubuf_managed_resource_create(count, -2, &r), CUBUF_ERROR_OUT_OF_RANGE);
    T_CHECK(r == NULL);

    size_t total = 0;
    T_CU(cuDeviceTotalMem, &total, g_dev);
    size_t sizes[4] = {0, 1, 1000, GiB};
    const int prefs[3] = {-2, -1, 0};
    for (int k = 0; k < 3; k++) {
        int pref = prefs[k];
        T_REQUIRE(cubuf_managed_resource_create(0, pref, &r));
        check_props(r, 0, true, true, false);
        check_no_pool(r);
        /* 1 GiB only where it is prefetched to a card with room to spare. */
        int n = pref == 0 && total >= 8 * GiB ? 4 : 3;
        t_held_t base = t_held();
        exercise(r, sizes, n, true, true);
        T_HELD_BACK(base, pref == -2   ? "managed, no preferred location"
                          : pref == -1 ? "managed, preferred on the host"
                                       : "managed, preferred on device 0");

        /* The advice and the prefetch really happened. */
        cubuf_buffer_t *b = NULL;
        T_REQUIRE(cubuf_resource_allocate(r, 2 * MiB, g_s, &b));
        T_CU(cuStreamSynchronize, g_s);
        CUdeviceptr p = cubuf_buffer_ptr(b);
        int want = pref == -2 ? (int)CU_DEVICE_INVALID : pref == -1 ? (int)CU_DEVICE_CPU : pref;
        T_CHECK(range_attr(p, 2 * MiB, CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION) == want);
        if (pref == 0)
            T_CHECK(range_attr(p, 2 * MiB, CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION) == 0);
        unsigned int type = 0;
        T_CU(cuPointerGetAttribute, &type, CU_POINTER_ATTRIBUTE_IS_MANAGED, p);
        T_CHECK(type != 0);
        cubuf_buffer_release(b);

        fault_allocate("managed, user stream", r, g_s, MiB);
        T_CU(cuCtxSetCurrent, NULL);
        fault_allocate("managed, legacy stream, no context", r, CU_STREAM_LEGACY, MiB);
        T_CU(cuCtxSetCurrent, g_ctx);

        /* Allocation on a capturing stream is refused; the capture survives. */
        CUstream cs;
        T_CU(cuStreamCreate, &cs, CU_STREAM_NON_BLOCKING);
        T_CU(cuStreamBeginCapture, cs, CU_STREAM_CAPTURE_MODE_GLOBAL);
        b = NULL;
        T_STATUS(cubuf_resource_allocate(r, 4096, cs, &b), CUBUF_ERROR_STREAM_CAPTURING);
        T_CHECK(b == NULL);
        CUgraph g = NULL;
        T_CU(cuStreamEndCapture, cs, &g);
        T_CHECK(g != NULL);
        if (g) T_CU(cuGraphDestroy, g);
        T_CU(cuStreamDestroy, cs);

        close_rules(r, "cuMemFree");
        cubuf_resource_release(r);
    }
}

static void test_legacy_pinned(void)
{
    int count = 0;
    T_REQUIRE(cubuf_device_count(&count));
    cubuf_resource_t *r = NULL;
    T_STATUS(cubuf_legacy_pinned_resource_create(0, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_legacy_pinned_resource_create(count, &r), CUBUF_ERROR_OUT_OF_RANGE);
    T_REQUIRE(cubuf_legacy_pinned_resource_create(0, &r));
    check_props(r, -1, true, false, false);
    check_no_pool(r);

    /* Size 0: pointer 0 and no driver call at all on a user stream; on a
     * default stream only the context lookup that records it. */
    cubuf_buffer_t *b = NULL;
    cubuf_fault_count_calls(true);
    T_OK(cubuf_resource_allocate(r, 0, g_s, &b));
    T_CHECK(total_calls() == 0);
    T_CHECK(cubuf_buffer_ptr(b) == 0 && cubuf_buffer_size(b) == 0 && !cubuf_buffer_is_closed(b));
    T_OK(cubuf_buffer_close(b));
    T_CHECK(total_calls() == 0);
    cubuf_buffer_release(b);
    cubuf_fault_count_calls(true);
    T_OK(cubuf_resource_allocate(r, 0, CU_STREAM_LEGACY, &b));
    T_CHECK(cubuf_fault_calls("cuMemHostAlloc") == 0 && cubuf_fault_calls("cuMemAllocHost") == 0);
    T_CHECK(total_calls() == 1);
    cubuf_buffer_release(b);
    cubuf_fault_count_calls(false);

    size_t sizes[4] = {0, 1, 1000, GiB};
    t_held_t base = t_held();
    exercise(r, sizes, 4, true, false);
    T_HELD_BACK(base, "legacy pinned, sizes 0, 1, 1000, 1 GiB");

    T_REQUIRE(cubuf_resource_allocate(r, 1000, g_s, &b));
    T_CHECK(cubuf_buffer_device_id(b) == -1);
    unsigned int type = 0;
    T_CU(cuPointerGetAttribute, &type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, cubuf_buffer_ptr(b));
    T_CHECK(type == CU_MEMORYTYPE_HOST); /* page-locked, known to the driver */
    cubuf_buffer_release(b);

    fault_allocate("legacy pinned, user stream", r, g_s, MiB);
    T_CU(cuCtxSetCurrent, NULL);
    fault_allocate("legacy pinned, legacy stream, no context", r, CU_STREAM_LEGACY, MiB);
    T_CU(cuCtxSetCurrent, g_ctx);
    close_rules(r, "cuMemFreeHost");
    cubuf_resource_release(r);
}

static void test_sync_device(void)
{
    int count = 0;
    T_REQUIRE(cubuf_device_count(&count));
    cubuf_resource_t *r = NULL;
    T_STATUS(cubuf_sync_device_resource_create(0, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_sync_device_resource_create(-1, &r), CUBUF_ERROR_OUT_OF_RANGE);
    T_REQUIRE(cubuf_sync_device_resource_create(0, &r));
    check_props(r, 0, false, false, false);
    check_no_pool(r);
    t_held_t base = t_held();
    size_t sizes[4] = {0, 1, 1000, GiB};
    exercise(r, sizes, 4, false, false);
    T_HELD_BACK(base, "sync device, sizes 0, 1, 1000, 1 GiB");

    /* cuMemAlloc memory: the kind legacy IPC handles can share. */
    cubuf_buffer_t *b = NULL;
    T_REQUIRE(cubuf_resource_allocate(r, 1000, g_s, &b));
    T_CHECK(cubuf_buffer_device_id(b) == 0);
    unsigned long long ipc_capable = 0;
    T_CU(cuPointerGetAttribute, &ipc_capable, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
         cubuf_buffer_ptr(b));
    T_CHECK(ipc_capable != 0);
    CUdeviceptr base_ptr = 0;
    size_t range = 0;
    T_CU(cuMemGetAddressRange, &base_ptr, &range, cubuf_buffer_ptr(b));
    T_CHECK(base_ptr == cubuf_buffer_ptr(b) && range >= 1000);
    cubuf_buffer_release(b);

    /* With no current context the allocation runs in the device's context. */
    T_CU(cuCtxSetCurrent, NULL);
    T_OK(cubuf_resource_allocate(r, 1000, g_s, &b));
    T_CHECK(current() == NULL);
    T_CU(cuCtxSetCurrent, g_ctx);
    CUcontext owner = NULL;
    T_CU(cuPointerGetAttribute, &owner, CU_POINTER_ATTRIBUTE_CONTEXT, cubuf_buffer_ptr(b));
    T_CHECK(owner == g_ctx);
    cubuf_buffer_release(b);

    fault_allocate("sync device, user stream", r, g_s, MiB);
    T_CU(cuCtxSetCurrent, NULL);
    fault_allocate("sync device, per-thread stream, no context", r, CU_STREAM_PER_THREAD, MiB);
    T_CU(cuCtxSetCurrent, g_ctx);
    close_rules(r, "cuMemFree");
    cubuf_resource_release(r);
    T_HELD_BACK(base, "sync device, at the end");
}

/* Each create path with each driver call, then each host allocation, failed
 * in turn. */
static void fault_creates(bool managed)
{
    for (int which = managed ? 0 : 1; which < 3; which++) {
        for (int mode = 3; mode >= 0; mode--) {
            const int ctx_current = mode & 1, alloc = mode < 2;
            T_CU(cuCtxSetCurrent, ctx_current ? g_ctx : NULL);
            for (unsigned n = 1; n < 100; n++) {
                cubuf_resource_t *r = NULL;
                cubuf_fault_count_calls(true);
                if (alloc) t_fail_alloc_nth(n);
                else cubuf_fault_fail_any_nth(n, CUDA_ERROR_UNKNOWN);
                cubuf_status_t st = which == 0   ? cubuf_managed_resource_create(0, 0, &r)
                                    : which == 1 ? cubuf_legacy_pinned_resource_create(0, &r)
                                                 : cubuf_sync_device_resource_create(0, &r);
                bool fired = cubuf_fault_fired();
                if (fired) check_balanced("create", n, cubuf_fault_fired_name());
                cubuf_fault_reset();
                cubuf_fault_count_calls(false);
                T_CHECK(current() == (ctx_current ? g_ctx : NULL));
                if (!fired) {
                    T_OK(st);
                    cubuf_resource_release(r);
                    break;
                }
                T_CHECK(st != CUBUF_SUCCESS && r == NULL);
                if (alloc) T_STATUS(st, CUBUF_ERROR_OUT_OF_MEMORY);
            }
        }
    }
    T_CU(cuCtxSetCurrent, g_ctx);
}

int main(void)
{
    t_require_gpu();
    t_held_count();
    t_held_t held0 = t_held();
    cubuf_context_t *ctx = NULL;
    T_REQUIRE(cubuf_context_create(0, &ctx));
    T_REQUIRE(cubuf_context_handle(ctx, &g_ctx));
    T_CU(cuCtxSetCurrent, g_ctx);
    T_CU(cuDeviceGet, &g_dev, 0);
    T_CU(cuStreamCreate, &g_s, CU_STREAM_NON_BLOCKING);
    int managed = 0;
    T_CU(cuDeviceGetAttribute, &managed, CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY, g_dev);
    leak_visible(managed != 0);

    if (managed) test_managed();
    else printf("note: device 0 has no managed memory; managed tests skipped\n");
    test_legacy_pinned();
    test_sync_device();
    fault_creates(managed != 0);

    T_CU(cuStreamDestroy, g_s);
    T_CU(cuCtxSetCurrent, NULL);
    cubuf_context_destroy(ctx);
    T_HELD_BACK(held0, "test_resource_host"); /* every allocation went back */
    unsigned flags = 0;
    int active = 1;
    T_CU(cuDevicePrimaryCtxGetState, g_dev, &flags, &active);
    T_CHECK(!active); /* every resource released its retained primary context */
    return t_finish("test_resource_host");
}
