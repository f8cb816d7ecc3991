/* The CUDA driver's rules that the host-backed test driver (tests/driver/)
 * reproduces and the other tests rely on, checked on whichever driver is
 * loaded, so that a run on a real GPU confirms what the test driver does:
 *  - the per-thread context stack: cuCtxCreate pushes, cuCtxSetCurrent
 *    replaces the top (NULL pops it), cuCtxDestroy pops the context only
 *    where it is on top;
 *  - primary context retain counts;
 *  - the legacy default stream: work on a blocking stream waits for earlier
 *    legacy work and legacy work for earlier work of blocking streams, not
 *    of non-blocking ones; events mark a point of a stream;
 *  - capture: never on the legacy stream; the legacy stream reports the
 *    implicit dependency on a capturing blocking stream without breaking the
 *    capture; an unsafe call in global mode fails and invalidates the
 *    capture, one in relaxed mode does not; a graph replays its work; a
 *    stream that joined a capture (waited on a captured event) and did
 *    work there must be joined back into the origin stream, else the
 *    capture ends with CUDA_ERROR_STREAM_CAPTURE_UNJOINED;
 *  - pointer attributes of device, pinned and pageable memory;
 *  - virtual memory: cuMemMap takes offset 0 only (cuda.h: "currently must
 *    be zero"); a mapping's RANGE_START_ADDR and RANGE_SIZE are its
 *    reservation's, cuMemGetAddressRange and the MAPPING_* attributes give
 *    the mapped region. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "test.h"

static CUcontext current(void)
{
    CUcontext c = NULL;
    T_CU(cuCtxGetCurrent, &c);
    return c;
}

/* ---- a stream held by a host function, released by the test or a watchdog ---- */

static atomic_int g_release;
static atomic_int g_watchdog_fired;
static atomic_int g_watchdog_stop;

static void CUDA_CB hold(void *arg)
{
    (void)arg;
    const struct timespec ms = {0, 1000000};
    while (!atomic_load(&g_release)) nanosleep(&ms, NULL);
}

static void CUDA_CB mark(void *arg) { atomic_store((atomic_int *)arg, 1); }

/* Lets a held stream go after 30 s, so that a call that waits for it
 * cannot hang the test: it fails it instead. */
static void *watchdog(void *arg)
{
    (void)arg;
    const struct timespec ms = {0, 1000000};
    for (int i = 0; i < 30000 && !atomic_load(&g_watchdog_stop); i++) nanosleep(&ms, NULL);
    if (!atomic_load(&g_watchdog_stop) && !atomic_exchange(&g_release, 1))
        atomic_store(&g_watchdog_fired, 1);
    return NULL;
}

static pthread_t hold_stream(CUstream s)
{
    atomic_store(&g_release, 0);
    atomic_store(&g_watchdog_stop, 0);
    atomic_store(&g_watchdog_fired, 0);
    T_CU(cuLaunchHostFunc, s, hold, NULL);
    pthread_t t;
    if (pthread_create(&t, NULL, watchdog, NULL) != 0) exit(1);
    return t;
}

static void let_go(pthread_t t)
{
    atomic_store(&g_release, 1);
    atomic_store(&g_watchdog_stop, 1);
    pthread_join(t, NULL);
    T_CHECK(!atomic_load(&g_watchdog_fired));
}

/* ---- contexts ---------------------------------------------------------------- */

static void test_context_stack(CUdevice dev, CUcontext primary)
{
    T_CHECK(current() == NULL);
    T_CU(cuCtxSetCurrent, primary); /* an empty stack gets one entry */
    CUcontext a = NULL, b = NULL;
    T_CU(cuCtxCreate, &a, NULL, 0, dev); /* pushed: [primary, a] */
    T_CHECK(current() == a);
    T_CU(cuCtxSetCurrent, primary); /* replaces the top: [primary, primary] */
    T_CHECK(current() == primary);
    T_CU(cuCtxDestroy, a); /* not on top: the stack stays */
    T_CHECK(current() == primary);
    T_CU(cuCtxSetCurrent, NULL); /* pops one: [primary] */
    T_CHECK(current() == primary);
    T_CU(cuCtxSetCurrent, NULL); /* []: */
    T_CHECK(current() == NULL);
    T_CU(cuCtxSetCurrent, NULL); /* a no-op on an empty stack */
    T_CHECK(current() == NULL);
    /* Destroying the context on top pops it. */
    T_CU(cuCtxPushCurrent, primary);
    T_CU(cuCtxCreate, &b, NULL, 0, dev); /* [primary, b] */
    T_CU(cuCtxDestroy, b);
    T_CHECK(current() == primary);
    CUcontext popped = NULL;
    T_CU(cuCtxPopCurrent, &popped);
    T_CHECK(popped == primary && current() == NULL);
    T_CHECK(cubuf__drv.cuCtxPopCurrent(&popped) == CUDA_ERROR_INVALID_CONTEXT);
    /* What needs a context says so when none is current. */
    CUdevice d = -1;
    T_CHECK(cubuf__drv.cuCtxGetDevice(&d) == CUDA_ERROR_INVALID_CONTEXT);
    CUdeviceptr p = 0;
    T_CHECK(cubuf__drv.cuMemAlloc(&p, 4096) == CUDA_ERROR_INVALID_CONTEXT);
}

static void test_primary_counts(CUdevice dev)
{
    unsigned flags = 0;
    int active = -1;
    T_CU(cuDevicePrimaryCtxGetState, dev, &flags, &active);
    const int before = active;
    CUcontext p1 = NULL, p2 = NULL;
    T_CU(cuDevicePrimaryCtxRetain, &p1, dev);
    T_CU(cuDevicePrimaryCtxRetain, &p2, dev);
    T_CHECK(p1 == p2 && p1 != NULL);
    T_CU(cuDevicePrimaryCtxGetState, dev, &flags, &active);
    T_CHECK(active == 1);
    T_CU(cuDevicePrimaryCtxRelease, dev);
    T_CU(cuDevicePrimaryCtxGetState, dev, &flags, &active);
    T_CHECK(active == 1); /* one retain left */
    T_CU(cuDevicePrimaryCtxRelease, dev);
    T_CU(cuDevicePrimaryCtxGetState, dev, &flags, &active);
    T_CHECK(active == before);
}

/* ---- the legacy default stream -------------------------------------------------- */

static void test_legacy_rules(CUcontext ctx)
{
    T_CU(cuCtxSetCurrent, ctx);
    CUstream blocking = NULL, nonblocking = NULL;
    T_CU(cuStreamCreate, &blocking, CU_STREAM_DEFAULT);
    T_CU(cuStreamCreate, &nonblocking, CU_STREAM_NON_BLOCKING);
    atomic_int done = 0;
    CUdeviceptr buf = 0;
    unsigned char h[4096];
    T_CU(cuMemAlloc, &buf, sizeof h);

    /* Legacy work waits for a held blocking stream ... */
    pthread_t t = hold_stream(blocking);
    T_CU(cuLaunchHostFunc, CU_STREAM_LEGACY, mark, &done);
    T_CHECK(cubuf__drv.cuStreamQuery(CU_STREAM_LEGACY) == CUDA_ERROR_NOT_READY);
    T_CHECK(atomic_load(&done) == 0);
    let_go(t);
    T_CU(cuStreamSynchronize, CU_STREAM_LEGACY);
    T_CHECK(atomic_load(&done) == 1);

    /* ... and blocking work for held legacy work, the per-thread stream too. */
    atomic_store(&done, 0);
    atomic_int done2 = 0;
    t = hold_stream(CU_STREAM_LEGACY);
    T_CU(cuLaunchHostFunc, blocking, mark, &done);
    T_CU(cuLaunchHostFunc, CU_STREAM_PER_THREAD, mark, &done2);
    T_CHECK(cubuf__drv.cuStreamQuery(blocking) == CUDA_ERROR_NOT_READY);
    T_CHECK(cubuf__drv.cuStreamQuery(CU_STREAM_PER_THREAD) == CUDA_ERROR_NOT_READY);
    T_CHECK(atomic_load(&done) == 0 && atomic_load(&done2) == 0);
    /* A non-blocking stream does not wait for it (a fill: host functions of
     * different streams may share one thread of the driver). */
    T_CU(cuMemsetD8Async, buf, 0x21, sizeof h, nonblocking);
    T_CU(cuStreamSynchronize, nonblocking);
    T_CHECK(!atomic_load(&g_release)); /* it returned while the legacy stream was held */
    let_go(t);
    T_CU(cuStreamSynchronize, blocking);
    T_CU(cuStreamSynchronize, CU_STREAM_PER_THREAD);
    T_CHECK(atomic_load(&done) == 1 && atomic_load(&done2) == 1);

    T_CU(cuMemcpyDtoH, h, buf, sizeof h);
    T_CHECK(h[0] == 0x21 && h[sizeof h - 1] == 0x21);

    /* Legacy work does not wait for a held non-blocking stream. */
    t = hold_stream(nonblocking);
    T_CU(cuMemsetD8Async, buf, 0x43, sizeof h, CU_STREAM_LEGACY);
    T_CU(cuStreamSynchronize, CU_STREAM_LEGACY);
    T_CHECK(!atomic_load(&g_release));
    T_CU(cuMemcpyDtoH, h, buf, sizeof h); /* synchronous, on the legacy stream */
    T_CHECK(h[0] == 0x43 && h[sizeof h - 1] == 0x43 && !atomic_load(&g_release));

    /* An event marks a point of its stream; one never recorded is complete. */
    CUevent e = NULL;
    T_CU(cuEventCreate, &e, CU_EVENT_DISABLE_TIMING);
    T_CHECK(cubuf__drv.cuEventQuery(e) == CUDA_SUCCESS);
    T_CU(cuEventRecord, e, nonblocking);
    T_CHECK(cubuf__drv.cuEventQuery(e) == CUDA_ERROR_NOT_READY);
    atomic_store(&done, 0);
    T_CU(cuStreamWaitEvent, blocking, e, 0);
    T_CU(cuLaunchHostFunc, blocking, mark, &done);
    T_CHECK(cubuf__drv.cuStreamQuery(blocking) == CUDA_ERROR_NOT_READY);
    let_go(t);
    T_CU(cuEventSynchronize, e);
    T_CU(cuStreamSynchronize, blocking);
    T_CHECK(atomic_load(&done) == 1);
    T_CU(cuEventDestroy, e);
    T_CU(cuMemFree, buf);
    T_CU(cuStreamDestroy, blocking);
    T_CU(cuStreamDestroy, nonblocking);
    T_CU(cuCtxSetCurrent, NULL);
}

/* ---- capture ---------------------------------------------------------------- */

static void test_capture(CUcontext ctx)
{
    T_CU(cuCtxSetCurrent, ctx);
    CUstream s = NULL;
    T_CU(cuStreamCreate, &s, CU_STREAM_DEFAULT);
    T_CHECK(cubuf__drv.cuStreamBeginCapture(CU_STREAM_LEGACY, CU_STREAM_CAPTURE_MODE_GLOBAL) !=
            CUDA_SUCCESS);

    CUdeviceptr buf = 0, out = 0;
    const size_t n = 1 << 20;
    T_CU(cuMemAlloc, &buf, n);
    T_CU(cuMemAlloc, &out, n);
    unsigned char *h = malloc(n);
    if (!h) exit(1);

    /* The legacy stream reports the implicit dependency; the capture lives on. */
    T_CU(cuStreamBeginCapture, s, CU_STREAM_CAPTURE_MODE_GLOBAL);
    CUstreamCaptureStatus cs = CU_STREAM_CAPTURE_STATUS_NONE;
    T_CU(cuStreamIsCapturing, s, &cs);
    T_CHECK(cs == CU_STREAM_CAPTURE_STATUS_ACTIVE);
    T_CHECK(cubuf__drv.cuStreamIsCapturing(CU_STREAM_LEGACY, &cs) == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
    T_CU(cuMemsetD8Async, buf, 0x5e, n, s);
    T_CU(cuMemcpyAsync, out, buf, n, s);
    CUgraph g = NULL;
    T_CU(cuStreamEndCapture, s, &g);
    T_CHECK(g != NULL);
    T_CU(cuStreamIsCapturing, s, &cs);
    T_CHECK(cs == CU_STREAM_CAPTURE_STATUS_NONE);
    /* Nothing ran at capture; each launch does it all. */
    T_CU(cuMemsetD8, out, 0, n);
    T_CU(cuCtxSynchronize);
    T_CU(cuMemcpyDtoH, h, out, n);
    T_CHECK(h[0] == 0 && h[n - 1] == 0);
    CUgraphExec ge = NULL;
    T_CU(cuGraphInstantiateWithFlags, &ge, g, 0);
    for (int launch = 0; launch < 2; launch++) {
        T_CU(cuMemsetD8, out, 0, n);
        T_CU(cuGraphLaunch, ge, s);
        T_CU(cuStreamSynchronize, s);
        T_CU(cuMemcpyDtoH, h, out, n);
        T_CHECK(h[0] == 0x5e && h[n / 2] == 0x5e && h[n - 1] == 0x5e);
    }
    T_CU(cuGraphExecDestroy, ge);
    T_CU(cuGraphDestroy, g);

    /* An unsafe call in global mode fails and invalidates the capture. */
    T_CU(cuStreamBeginCapture, s, CU_STREAM_CAPTURE_MODE_GLOBAL);
    CUdeviceptr p = 0;
    T_CHECK(cubuf__drv.cuMemAlloc(&p, 4096) == CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    T_CU(cuStreamIsCapturing, s, &cs);
    T_CHECK(cs == CU_STREAM_CAPTURE_STATUS_INVALIDATED);
    g = (CUgraph)(uintptr_t)1;
    T_CHECK(cubuf__drv.cuStreamEndCapture(s, &g) == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    T_CHECK(g == NULL);

    /* In relaxed mode the same call is allowed and the capture survives. */
    T_CU(cuStreamBeginCapture, s, CU_STREAM_CAPTURE_MODE_GLOBAL);
    CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    T_CU(cuThreadExchangeStreamCaptureMode, &mode);
    T_CHECK(mode == CU_STREAM_CAPTURE_MODE_GLOBAL);
    T_CHECK(cubuf__drv.cuMemAlloc(&p, 4096) == CUDA_SUCCESS);
    T_CU(cuThreadExchangeStreamCaptureMode, &mode);
    T_CHECK(mode == CU_STREAM_CAPTURE_MODE_RELAXED);
    T_CU(cuStreamIsCapturing, s, &cs);
    T_CHECK(cs == CU_STREAM_CAPTURE_STATUS_ACTIVE);
    g = NULL;
    T_CU(cuStreamEndCapture, s, &g);
    T_CHECK(g != NULL);
    if (g) T_CU(cuGraphDestroy, g);
    if (p) T_CU(cuMemFree, p);

    /* A fork: s2 joins the capture through a captured event. Its work not
     * joined back into s fails the capture; joined back, it succeeds. */
    CUstream s2 = NULL;
    CUevent fork = NULL, join = NULL;
    T_CU(cuStreamCreate, &s2, CU_STREAM_NON_BLOCKING);
    T_CU(cuEventCreate, &fork, CU_EVENT_DISABLE_TIMING);
    T_CU(cuEventCreate, &join, CU_EVENT_DISABLE_TIMING);
    for (int joined = 0; joined < 2; joined++) {
        T_CU(cuStreamBeginCapture, s, CU_STREAM_CAPTURE_MODE_GLOBAL);
        T_CU(cuMemsetD8Async, buf, 0x11, n, s);
        T_CU(cuEventRecord, fork, s);
        T_CU(cuStreamWaitEvent, s2, fork, 0);
        T_CU(cuStreamIsCapturing, s2, &cs);
        T_CHECK(cs == CU_STREAM_CAPTURE_STATUS_ACTIVE);
        T_CU(cuMemsetD8Async, out, 0x22, n, s2);
        if (joined) {
            T_CU(cuEventRecord, join, s2);
            T_CU(cuStreamWaitEvent, s, join, 0);
        }
        g = (CUgraph)(uintptr_t)1;
        CUresult r = cubuf__drv.cuStreamEndCapture(s, &g);
        printf("capture with a fork %s: %d\n", joined ? "joined" : "not joined", (int)r);
        T_CHECK(r == (joined ? CUDA_SUCCESS : CUDA_ERROR_STREAM_CAPTURE_UNJOINED));
        T_CHECK(joined ? g != NULL : g == NULL);
        if (joined && g) T_CU(cuGraphDestroy, g);
    }
    T_CU(cuEventDestroy, fork);
    T_CU(cuEventDestroy, join);
    T_CU(cuStreamDestroy, s2);

    free(h);
    T_CU(cuMemFree, buf);
    T_CU(cuMemFree, out);
    T_CU(cuStreamDestroy, s);
    T_CU(cuCtxSetCurrent, NULL);
}

/* ---- pointer attributes ----------------------------------------------------------- */

static void test_pointer_attributes(CUcontext ctx)
{
    T_CU(cuCtxSetCurrent, ctx);
    CUdeviceptr d = 0;
    void *pinned = NULL;
    char *pageable = malloc(4096);
    if (!pageable) exit(1);
    T_CU(cuMemAlloc, &d, 1000);
    T_CU(cuMemHostAlloc, &pinned, 1000, 0);

    unsigned type = 99;
    int ordinal = 99;
    uint64_t managed = 1;
    CUcontext owner = NULL;
    CUpointer_attribute attrs[] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                   CU_POINTER_ATTRIBUTE_IS_MANAGED, CU_POINTER_ATTRIBUTE_CONTEXT};
    void *data[] = {&type, &ordinal, &managed, &owner};
    T_CU(cuPointerGetAttributes, 4, attrs, data, d + 10);
    T_CHECK(type == CU_MEMORYTYPE_DEVICE && ordinal == 0 && managed == 0 && owner == ctx);
    type = 99;
    T_CU(cuPointerGetAttributes, 1, attrs, data, (CUdeviceptr)(uintptr_t)pinned);
    T_CHECK(type == CU_MEMORYTYPE_HOST);
    /* Memory the driver does not know: the plural query answers type 0, the
     * singular one fails. */
    type = 99;
    T_CU(cuPointerGetAttributes, 1, attrs, data, (CUdeviceptr)(uintptr_t)pageable);
    T_CHECK(type == 0);
    T_CHECK(cubuf__drv.cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                             (CUdeviceptr)(uintptr_t)pageable) ==
            CUDA_ERROR_INVALID_VALUE);
    CUdeviceptr base = 0;
    size_t size = 0;
    T_CU(cuMemGetAddressRange, &base, &size, d + 999);
    T_CHECK(base == d && size >= 1000);
    T_CU(cuMemFree, d);
    /* Freed: unknown again. */
    T_CHECK(cubuf__drv.cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, d) ==
            CUDA_ERROR_INVALID_VALUE);
    T_CU(cuMemFreeHost, pinned);
    free(pageable);
    T_CU(cuCtxSetCurrent, NULL);
}

/* ---- virtual memory ----------------------------------------------------------------- */

static void test_vmm_rules(CUcontext ctx)
{
    T_CU(cuCtxSetCurrent, ctx);
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    size_t g = 0;
    T_CU(cuMemGetAllocationGranularity, &g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    CUdeviceptr va = 0;
    CUmemGenericAllocationHandle h = 0;
    T_CU(cuMemAddressReserve, &va, 4 * g, 0, 0, 0);
    T_CU(cuMemCreate, &h, 2 * g, &prop, 0);
    /* A granule-aligned offset into the allocation is refused: NOT_SUPPORTED
     * on the H200 (driver 580); cuda.h says it "currently must be zero". */
    T_CHECK(cubuf__drv.cuMemMap(va + g, g, g, h, 0) == CUDA_ERROR_NOT_SUPPORTED);
    T_CU(cuMemMap, va + g, 2 * g, 0, h, 0);
    CUmemAccessDesc acc;
    memset(&acc, 0, sizeof acc);
    acc.location = prop.location;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    T_CU(cuMemSetAccess, va + g, 2 * g, &acc, 1);

    CUdeviceptr start = 0, map_base = 0;
    size_t range = 0, map_size = 0;
    CUpointer_attribute attrs[] = {CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                                   CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR, CU_POINTER_ATTRIBUTE_MAPPING_SIZE};
    void *data[] = {&start, &range, &map_base, &map_size};
    T_CU(cuPointerGetAttributes, 4, attrs, data, va + g + 100);
    printf("vmm: reservation 0x%llx +%zu, mapping 0x%llx +%zu; attributes: range 0x%llx +%zu, mapping "
           "0x%llx +%zu\n",
           (unsigned long long)va, 4 * g, (unsigned long long)(va + g), 2 * g, (unsigned long long)start,
           range, (unsigned long long)map_base, map_size);
    T_CHECK(start == va && range == 4 * g);
    T_CHECK(map_base == va + g && map_size == 2 * g);
    CUdeviceptr base = 0;
    size_t size = 0;
    T_CU(cuMemGetAddressRange, &base, &size, va + 2 * g);
    T_CHECK(base == va + g && size == 2 * g);

    T_CU(cuMemUnmap, va + g, 2 * g);
    T_CU(cuMemRelease, h);
    T_CU(cuMemAddressFree, va, 4 * g);
    T_CU(cuCtxSetCurrent, NULL);
}

int main(void)
{
    t_require_gpu();
    CUdevice dev;
    T_CU(cuDeviceGet, &dev, 0);
    test_primary_counts(dev);
    CUcontext primary = NULL;
    T_CU(cuDevicePrimaryCtxRetain, &primary, dev);
    test_context_stack(dev, primary);
    test_legacy_rules(primary);
    test_capture(primary);
    test_pointer_attributes(primary);
    test_vmm_rules(primary);
    T_CHECK(current() == NULL);
    T_CU(cuDevicePrimaryCtxRelease, dev);
    return t_finish("test_driver_rules");
}
