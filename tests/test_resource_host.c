/* The synchronous resources: managed memory (preferred locations, prefetch),
 * legacy pinned host memory and cuMemAlloc device memory. Data written and
 * read back, exact statistics, closes refused on capturing streams without
 * breaking the capture, and every driver call of each allocate path failed
 * in turn. */
#include <stdint.h>
#include <unistd.h>

#include "internal.h"
#include "test.h"
#include "resource_test.h"


static CUcontext g_ctx;
static CUdevice g_dev;
static CUstream g_s;




/* ---- device memory accounting ------------------------------------------------
 *
 * The leak checks compare cuMemGetInfo's free memory with a baseline. What
 * the driver legitimately keeps must not read as a leak:
 *  - state made on the first use of a path and kept for the life of the
 *    context: on the H200 (driver 580) the first use of the per-thread
 *    default stream of a thread keeps 2 MiB (the sync device fault loop on
 *    that stream failed on it before warm_up() used every stream once,
 *    ahead of any baseline);
 *  - work still in flight: the context is synchronized before each reading;
 *  - managed memory: the UVM driver takes device memory for managed pages
 *    from the GPU's allocator in root chunks of 2 MiB, 64 at a time, keeps
 *    the unused ones and gives a free one back per later free. Measured on
 *    the H200: the first managed pages on the device kept 124 MiB (62 root
 *    chunks) after they were freed, and every later round on the device
 *    returned one chunk (free memory 2 MiB above its baseline); once the
 *    cache is empty the next round takes a new batch. So free memory after
 *    managed work sits anywhere within one batch (128 MiB) of its baseline,
 *    depending on history. Managed checks allow that (k_uvm_slack) and use
 *    allocations larger than it on the device (1 GiB, k_managed_size), so
 *    one leaked allocation still fails them; a leaked small allocation
 *    never shows in device memory at all (its pages end on the host), so
 *    every closed pointer is also checked to be unknown to the driver
 *    (check_gone), whatever its size. The other checks are exact.
 * leak_visible() shows on the device that one leaked allocation of each
 * tested size moves free memory beyond what the check allows. */

#define k_uvm_slack ((size_t)128 << 20)

static bool g_memlog; /* CUBUF_TEST_MEMLOG set: print every reading */

static size_t settled_free(void)
{
    T_CU(cuCtxSynchronize);
    return t_free_device_memory();
}

/* Free memory must be back at `base`, within `slack` bytes either way. The
 * driver may hand memory back a little after the call that freed it, so a
 * shortfall is read again for up to a second before it counts. Prints both
 * numbers and the difference on failure. Needs g_ctx current. */
#define T_FREE_BACK(base, slack, what) t_free_back(__FILE__, __LINE__, (base), (slack), (what))
static void t_free_back(const char *file, int line, size_t base, size_t slack, const char *what)
{
    size_t now = settled_free();
    for (int i = 0; now + slack < base && i < 100; i++) {
        usleep(10000);
        now = settled_free();
    }
    size_t diff = now < base ? base - now : now - base;
    if (diff > slack) {
        fprintf(stderr,
                "%s:%d: %s: device free memory %zu bytes, baseline %zu bytes: %s by %zu bytes "
                "(%lld KiB; allowed %zu)\n",
                file, line, what, now, base, now < base ? "short (leak)" : "above the baseline",
                diff, kib_delta(now, base), slack);
        t_failures++;
    } else if (g_memlog) {
        printf("memlog %s:%d: %s: free memory %lld KiB from the baseline (allowed %zu KiB)\n",
               file, line, what, kib_delta(now, base), slack >> 10);
    }
}

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


/* How a fault loop checks device memory: not at all (host memory), exactly,
 * or within the UVM driver's root-chunk batch (managed memory). */
typedef enum mem_check { MEM_NONE, MEM_EXACT, MEM_UVM } mem_check_t;

static void free_back_after(mem_check_t mem, size_t base, const char *what)
{
    if (mem == MEM_NONE) return;
    CUcontext before = current();
    T_CU(cuCtxSetCurrent, g_ctx);
    T_FREE_BACK(base, mem == MEM_UVM ? k_uvm_slack : 0, what);
    T_CU(cuCtxSetCurrent, before);
}

/* Fails each driver call of an allocation of `size` bytes in turn. */
static void fault_allocate(const char *name, cubuf_resource_t *r, CUstream s, size_t size,
                           mem_check_t mem)
{
    CUcontext before = current();
    T_CU(cuCtxSetCurrent, g_ctx);
    size_t base = settled_free();
    T_CU(cuCtxSetCurrent, before);
    cubuf_resource_stats_t st0 = CUBUF_RESOURCE_STATS_INIT;
    T_OK(cubuf_resource_stats(r, &st0));
    for (unsigned n = 1; n < 100; n++) {
        cubuf_buffer_t *b = NULL;
        cubuf_fault_count_calls(true);
        cubuf_fault_fail_any_nth(n, CUDA_ERROR_UNKNOWN);
        cubuf_status_t st = cubuf_resource_allocate(r, size, s, &b);
        bool fired = cubuf_fault_fired();
        if (fired) check_balanced(name, n, cubuf_fault_fired_name());
        cubuf_fault_reset();
        cubuf_fault_count_calls(false);
        T_CHECK(current() == before);
        if (fired) free_back_after(mem, base, name);
        if (!fired) {
            T_OK(st);
            T_CHECK(cubuf_buffer_ptr(b) != 0);
            T_OK(cubuf_buffer_close(b));
            cubuf_buffer_release(b);
            T_STATS(r, 0, st0.peak_bytes > size ? st0.peak_bytes : size, 0,
                    st0.peak_count ? st0.peak_count : 1, st0.total_allocations + 1);
            free_back_after(mem, base, name);
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

/* Managed allocations in the fault loops: large enough that one leaked
 * allocation on the device moves free memory well beyond k_uvm_slack. */
#define k_managed_size (4 * k_uvm_slack)

static const CUmemLocation k_device0 = {CU_MEM_LOCATION_TYPE_DEVICE, 0};

/* The driver's lazily made state for each path the tests use, made now: the
 * first cuMemAlloc, the first use of each stream (a fill on it, the capture
 * query, a synchronization), and managed pages' first trip to the device and
 * back. Logs what each kept. */
static void warm_up(bool managed)
{
    const CUstream streams[] = {g_s, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD};
    const char *const names[] = {"a user stream", "the legacy stream", "the per-thread stream"};
    size_t before = settled_free();
    CUdeviceptr p = 0;
    T_CU(cuMemAlloc, &p, MiB);
    T_CU(cuMemFree, p);
    if (g_memlog)
        printf("memlog warm-up: the first cuMemAlloc kept %lld KiB\n", -kib_delta(settled_free(), before));
    T_CU(cuMemAlloc, &p, MiB);
    for (int i = 0; i < 3; i++) {
        before = settled_free();
        CUstreamCaptureStatus cs = CU_STREAM_CAPTURE_STATUS_NONE;
        T_CU(cuStreamIsCapturing, streams[i], &cs);
        T_CU(cuMemsetD8Async, p, 0, MiB, streams[i]);
        T_CU(cuStreamSynchronize, streams[i]);
        if (g_memlog)
            printf("memlog warm-up: first use of %s kept %lld KiB\n", names[i],
                   -kib_delta(settled_free(), before));
    }
    T_CU(cuMemFree, p);
    if (!managed) return;
    before = settled_free();
    const size_t n = 4 * MiB;
    T_CU(cuMemAllocManaged, &p, n, CU_MEM_ATTACH_GLOBAL);
    unsigned char *h = (unsigned char *)(uintptr_t)p;
    memset(h, 1, n);
    T_CU(cuMemPrefetchAsync, p, n, k_device0, 0, g_s);
    T_CU(cuMemsetD8Async, p, 2, n, g_s);
    T_CU(cuStreamSynchronize, g_s);
    size_t bad = 0;
    for (size_t i = 0; i < n; i += 4096) bad += h[i] != 2;
    T_CHECK(bad == 0);
    T_CU(cuMemFree, p);
    if (g_memlog)
        printf("memlog warm-up: managed pages to the device and back kept %lld KiB\n",
               -kib_delta(settled_free(), before));
}

/* The leak checks can see one leaked allocation of each tested size: with it
 * live, settled free memory is short of the baseline by more than the check
 * allows; once freed, it is back. */
static void leak_visible(bool managed)
{
    const size_t sizes[] = {1, 1000, MiB};
    size_t base = settled_free();
    for (int i = 0; i < 3; i++) {
        CUdeviceptr p = 0;
        T_CU(cuMemAlloc, &p, sizes[i]);
        size_t with = settled_free();
        if (g_memlog)
            printf("memlog cuMemAlloc: one live allocation of %zu bytes holds %lld KiB\n", sizes[i],
                   -kib_delta(with, base));
        if (with >= base) {
            fprintf(stderr, "cuMemAlloc: a live allocation of %zu bytes does not show in free "
                    "memory (%zu bytes, baseline %zu): the leak checks could not see it\n",
                    sizes[i], with, base);
            t_failures++;
        }
        T_CU(cuMemFree, p);
        T_FREE_BACK(base, 0, "cuMemAlloc freed");
    }
    if (!managed) return;
    /* The managed fault loops' size, on the device as a preferred location of
     * device 0 puts it. */
    base = settled_free();
    CUdeviceptr p = 0;
    T_CU(cuMemAllocManaged, &p, k_managed_size, CU_MEM_ATTACH_GLOBAL);
    T_CU(cuMemPrefetchAsync, p, k_managed_size, k_device0, 0, g_s);
    size_t with = settled_free();
    if (g_memlog)
        printf("memlog managed: one live allocation of %zu bytes on the device holds %lld KiB\n",
               k_managed_size, -kib_delta(with, base));
    if (with + k_uvm_slack >= base) {
        fprintf(stderr, "managed: a live allocation of %zu bytes on the device does not show in "
                "free memory beyond the UVM slack (%zu bytes, baseline %zu)\n",
                k_managed_size, with, base);
        t_failures++;
    }
    T_CU(cuMemFree, p);
    T_FREE_BACK(base, k_uvm_slack, "managed freed");
}

/* CUBUF_TEST_MEMLOG only: how free memory moves over further rounds. */
static void managed_rounds(int pref, const size_t *sizes, int n)
{
    printf("memlog managed, preferred location %d: further rounds moved free memory by", pref);
    for (int k = 0; k < 3; k++) {
        cubuf_resource_t *w = NULL;
        T_REQUIRE(cubuf_managed_resource_create(0, pref, &w));
        size_t before = settled_free();
        exercise(w, sizes, n, true, true);
        cubuf_resource_release(w);
        printf(" %lld", kib_delta(settled_free(), before));
    }
    printf(" KiB\n");
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
        /* A first round on a resource of its own: whatever UVM makes on first
         * use of this path is made before the baseline. */
        cubuf_resource_t *w = NULL;
        T_REQUIRE(cubuf_managed_resource_create(0, pref, &w));
        size_t w0 = settled_free();
        exercise(w, sizes, n, true, true);
        cubuf_resource_release(w);
        if (g_memlog)
            printf("memlog managed, preferred location %d: the warm-up round moved free memory "
                   "by %lld KiB\n", pref, kib_delta(settled_free(), w0));
        size_t base = settled_free();
        exercise(r, sizes, n, true, true);
        T_FREE_BACK(base, k_uvm_slack, pref == -2   ? "managed, no preferred location"
                                       : pref == -1 ? "managed, preferred on the host"
                                                    : "managed, preferred on device 0");
        if (g_memlog) managed_rounds(pref, sizes, n);

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

        fault_allocate("managed, user stream", r, g_s, k_managed_size, MEM_UVM);
        T_CU(cuCtxSetCurrent, NULL);
        fault_allocate("managed, legacy stream, no context", r, CU_STREAM_LEGACY, k_managed_size,
                       MEM_UVM);
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
    exercise(r, sizes, 4, true, false);

    T_REQUIRE(cubuf_resource_allocate(r, 1000, g_s, &b));
    T_CHECK(cubuf_buffer_device_id(b) == -1);
    unsigned int type = 0;
    T_CU(cuPointerGetAttribute, &type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, cubuf_buffer_ptr(b));
    T_CHECK(type == CU_MEMORYTYPE_HOST); /* page-locked, known to the driver */
    cubuf_buffer_release(b);

    fault_allocate("legacy pinned, user stream", r, g_s, MiB, MEM_NONE);
    T_CU(cuCtxSetCurrent, NULL);
    fault_allocate("legacy pinned, legacy stream, no context", r, CU_STREAM_LEGACY, MiB, MEM_NONE);
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
    size_t base = settled_free();
    size_t sizes[4] = {0, 1, 1000, GiB};
    exercise(r, sizes, 4, false, false);
    T_FREE_BACK(base, 0, "sync device, sizes 0, 1, 1000, 1 GiB");

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

    fault_allocate("sync device, user stream", r, g_s, MiB, MEM_EXACT);
    T_CU(cuCtxSetCurrent, NULL);
    fault_allocate("sync device, per-thread stream, no context", r, CU_STREAM_PER_THREAD, MiB,
                   MEM_EXACT);
    T_CU(cuCtxSetCurrent, g_ctx);
    close_rules(r, "cuMemFree");
    cubuf_resource_release(r);
    T_FREE_BACK(base, 0, "sync device, at the end");
}

/* Each create path with each driver call failed in turn. */
static void fault_creates(bool managed)
{
    for (int which = managed ? 0 : 1; which < 3; which++) {
        for (int ctx_current = 1; ctx_current >= 0; ctx_current--) {
            T_CU(cuCtxSetCurrent, ctx_current ? g_ctx : NULL);
            for (unsigned n = 1; n < 100; n++) {
                cubuf_resource_t *r = NULL;
                cubuf_fault_count_calls(true);
                cubuf_fault_fail_any_nth(n, CUDA_ERROR_UNKNOWN);
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
            }
        }
    }
    T_CU(cuCtxSetCurrent, g_ctx);
}

int main(void)
{
    t_require_gpu();
    cubuf_context_t *ctx = NULL;
    T_REQUIRE(cubuf_context_create(0, &ctx));
    T_REQUIRE(cubuf_context_handle(ctx, &g_ctx));
    T_CU(cuCtxSetCurrent, g_ctx);
    T_CU(cuDeviceGet, &g_dev, 0);
    T_CU(cuStreamCreate, &g_s, CU_STREAM_NON_BLOCKING);
    int managed = 0;
    T_CU(cuDeviceGetAttribute, &managed, CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY, g_dev);
    g_memlog = getenv("CUBUF_TEST_MEMLOG") != NULL;
    warm_up(managed != 0);
    leak_visible(managed != 0);

    if (managed) test_managed();
    else printf("note: device 0 has no managed memory; managed tests skipped\n");
    test_legacy_pinned();
    test_sync_device();
    fault_creates(managed != 0);

    T_CU(cuStreamDestroy, g_s);
    T_CU(cuCtxSetCurrent, NULL);
    cubuf_context_destroy(ctx);
    unsigned flags = 0;
    int active = 1;
    T_CU(cuDevicePrimaryCtxGetState, g_dev, &flags, &active);
    T_CHECK(!active); /* every resource released its retained primary context */
    return t_finish("test_resource_host");
}
