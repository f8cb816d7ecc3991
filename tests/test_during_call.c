/* CUBUF_SRC_ACCESS_DURING_API_CALL is a promise: the source may change as
 * soon as the call returns. Checked on a blocked stream (a host function
 * holds it until released), for pageable, pinned, device and managed
 * sources of 4 KiB, 1 MiB and 64 MiB, for buffer copies and batches: the
 * call returns while the stream is still held, the source is overwritten,
 * and after the stream runs the destination holds the bytes of the time of
 * the call. Then every driver call on the path fails once in turn: the copy
 * either fails with the destination untouched or succeeds with the right
 * bytes.
 *
 * Uses only calls that predate cubuf keeping the promise itself, so the
 * same program shows the failure on a library that passed it to the driver. */
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"
#include "staging.h"
#include "test.h"

#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)

static cubuf_context_t *cctx;

/* ---- a stream held by a host function, with a watchdog ---- */

static atomic_int g_release;
static atomic_int g_watchdog_fired;
static atomic_int g_watchdog_stop;

static void CUDA_CB hold(void *arg)
{
    (void)arg;
    while (!atomic_load(&g_release)) usleep(50);
}

/* Releases a held stream after 30 s (generous: compute-sanitizer slows every
 * step), so a call that waits for the stream
 * cannot hang the test: it fails it instead. */
static void *watchdog(void *arg)
{
    (void)arg;
    for (int i = 0; i < 30000 && !atomic_load(&g_watchdog_stop); i++) usleep(1000);
    if (!atomic_load(&g_watchdog_stop) && !atomic_exchange(&g_release, 1))
        atomic_store(&g_watchdog_fired, 1);
    return NULL;
}

static pthread_t hold_stream(CUstream s)
{
    atomic_store(&g_release, 0);
    atomic_store(&g_watchdog_stop, 0);
    T_CU(cuLaunchHostFunc, s, hold, NULL);
    pthread_t t;
    T_CHECK(pthread_create(&t, NULL, watchdog, NULL) == 0);
    return t;
}

static void let_go(pthread_t t)
{
    atomic_store(&g_release, 1);
    atomic_store(&g_watchdog_stop, 1);
    pthread_join(t, NULL);
}

/* ---- sources ---- */

typedef enum { SRC_PAGEABLE, SRC_PINNED, SRC_DEVICE, SRC_MANAGED, SRC_KINDS } src_kind_t;
static const char *const g_kind_names[] = {"pageable", "pinned", "device", "managed"};

typedef struct source {
    src_kind_t kind;
    CUdeviceptr ptr;
    void *host;       /* pageable / pinned */
    size_t size;
} source_t;

static source_t source_new(src_kind_t kind, size_t size)
{
    source_t s = {kind, 0, NULL, size};
    switch (kind) {
    case SRC_PAGEABLE: s.host = malloc(size); break;
    case SRC_PINNED: T_CU(cuMemHostAlloc, &s.host, size, CU_MEMHOSTALLOC_PORTABLE); break;
    case SRC_DEVICE: T_CU(cuMemAlloc, &s.ptr, size); break;
    case SRC_MANAGED: T_CU(cuMemAllocManaged, &s.ptr, size, CU_MEM_ATTACH_GLOBAL); break;
    default: break;
    }
    if (s.host) s.ptr = (CUdeviceptr)(uintptr_t)s.host;
    if (!s.ptr) exit(1);
    return s;
}

static void source_free(source_t *s)
{
    switch (s->kind) {
    case SRC_PAGEABLE: free(s->host); break;
    case SRC_PINNED: T_CU(cuMemFreeHost, s->host); break;
    default: T_CU(cuMemFree, s->ptr); break;
    }
}

/* Writes byte v everywhere, by the host or synchronously by the device (on
 * the legacy stream, which does not wait for the held non-blocking one). */
static void source_set(source_t *s, unsigned char v)
{
    if (s->host) memset(s->host, v, s->size);
    else T_CU(cuMemsetD8, s->ptr, v, s->size);
}

static bool device_all(CUdeviceptr p, size_t n, unsigned char v)
{
    unsigned char *h = malloc(n);
    T_CU(cuMemcpyDtoH, h, p, n);
    bool ok = true;
    for (size_t i = 0; i < n && ok; i++)
        if (h[i] != v) {
            fprintf(stderr, "byte %zu of %zu is 0x%02x, expected 0x%02x\n", i, n, h[i], v);
            ok = false;
        }
    free(h);
    return ok;
}

static cubuf_copy_options_t during(void)
{
    cubuf_copy_options_t o = CUBUF_COPY_OPTIONS_INIT;
    o.src_access_order = CUBUF_SRC_ACCESS_DURING_API_CALL;
    return o;
}

/* One copy (or a batch of two halves) from a source onto a held stream. */
static void check_held(src_kind_t kind, size_t n, bool batch, CUstream s)
{
    source_t src = source_new(kind, n);
    cubuf_buffer_t *dst = NULL, *view = NULL;
    T_REQUIRE(cubuf_context_new_buffer(cctx, n, &dst));
    T_CU(cuMemsetD8, cubuf_buffer_ptr(dst), 0, n);
    source_set(&src, 0xa1);
    T_CU(cuCtxSynchronize); /* a device memset is asynchronous */
    T_REQUIRE(cubuf_buffer_view(src.ptr, n, &view));
    cubuf_copy_options_t o = during();

    pthread_t t = hold_stream(s);
    cubuf_status_t st;
    if (batch) {
        size_t h = n / 2;
        cubuf_copy_t copies[] = {{cubuf_buffer_ptr(dst), src.ptr, h},
                                 {cubuf_buffer_ptr(dst) + h, src.ptr + h, n - h}};
        st = cubuf_copy_batch(copies, 2, s, &o, NULL);
    } else {
        st = cubuf_buffer_copy_from(dst, view, s, &o);
    }
    bool returned_held = !atomic_load(&g_release);
    source_set(&src, 0xb2); /* the caller reuses the source at once */
    let_go(t);
    T_CU(cuStreamSynchronize, s);
    const char *how = batch ? "batch" : "copy";
    if (st != CUBUF_SUCCESS) {
        fprintf(stderr, "%s from %s, %zu bytes: %s\n", how, g_kind_names[kind], n, cubuf_last_error());
        t_failures++;
    } else if (!returned_held || atomic_load(&g_watchdog_fired)) {
        fprintf(stderr, "%s from %s, %zu bytes: the call waited for the held stream\n", how,
                g_kind_names[kind], n);
        t_failures++;
    } else if (!device_all(cubuf_buffer_ptr(dst), n, 0xa1)) {
        fprintf(stderr, "%s from %s, %zu bytes: the device got bytes written after the call\n",
                how, g_kind_names[kind], n);
        t_failures++;
    }
    atomic_store(&g_watchdog_fired, 0);
    cubuf_buffer_release(view);
    cubuf_buffer_release(dst);
    source_free(&src);
}

/* Every driver call on the path fails once in turn. */
static void check_faults(src_kind_t kind, CUstream s)
{
    const size_t n = 1 * MiB;
    source_t src = source_new(kind, n);
    cubuf_buffer_t *dst = NULL, *view = NULL;
    T_REQUIRE(cubuf_context_new_buffer(cctx, n, &dst));
    T_REQUIRE(cubuf_buffer_view(src.ptr, n, &view));
    cubuf_copy_options_t o = during();
    bool succeeded = false;
    unsigned nth;
    for (nth = 1; nth < 100 && !succeeded; nth++) {
        T_CU(cuMemsetD8, cubuf_buffer_ptr(dst), 0, n);
        source_set(&src, (unsigned char)(0x10 + nth));
        T_CU(cuCtxSynchronize);
        cubuf_fault_fail_any_nth(nth, CUDA_ERROR_UNKNOWN);
        cubuf_status_t st = cubuf_buffer_copy_from(dst, view, s, &o);
        cubuf_fault_reset();
        source_set(&src, 0xee);
        T_CU(cuStreamSynchronize, s);
        if (st == CUBUF_SUCCESS) {
            succeeded = true;
            T_CHECK(device_all(cubuf_buffer_ptr(dst), n, (unsigned char)(0x10 + nth)));
        } else {
            T_CHECK(st == CUBUF_ERROR_DRIVER);
            T_CHECK(device_all(cubuf_buffer_ptr(dst), n, 0)); /* nothing was copied */
        }
    }
    T_CHECK(succeeded && nth > 2); /* at least one call on the path was failed */
    /* Every staging block came back, on the failure paths too. */
    CUmemoryPool pool = NULL;
    T_OK(cubuf__staging_pool(&pool));
    cuuint64_t used = 1;
    T_CU(cuCtxSynchronize);
    T_CU(cuMemPoolGetAttribute, pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &used);
    T_CHECK(used == 0);
    cubuf_buffer_release(view);
    cubuf_buffer_release(dst);
    source_free(&src);
}

/* Before the staging pool exists: a failing query of whether the device has
 * host memory pools is a driver failure, with its CUresult, not a device
 * without them; the next copy makes the pool. */
static void check_pool_query_fault(CUstream s)
{
    cubuf_buffer_t *src = NULL, *dst = NULL;
    T_REQUIRE(cubuf_context_new_buffer(cctx, 4 * KiB, &src));
    T_REQUIRE(cubuf_context_new_buffer(cctx, 4 * KiB, &dst));
    T_CU(cuCtxSynchronize);
    cubuf_copy_options_t o = during();
    T_CHECK(cubuf_fault_fail_nth("cuDeviceGetAttribute", 1, CUDA_ERROR_UNKNOWN));
    T_STATUS(cubuf_buffer_copy_from(dst, src, s, &o), CUBUF_ERROR_DRIVER);
    T_CHECK(cubuf_fault_fired() && cubuf_last_cuda_result() == CUDA_ERROR_UNKNOWN);
    cubuf_fault_reset();
    T_OK(cubuf_buffer_copy_from(dst, src, s, &o));
    T_CU(cuStreamSynchronize, s);
    cubuf_buffer_release(dst);
    cubuf_buffer_release(src);
}

/* A batch whose k-th source read fails names that copy in *failed_index,
 * skipping the empty copies as the index does not. */
static void check_batch_failed_index(CUstream s)
{
    cubuf_buffer_t *src = NULL, *dst = NULL;
    T_REQUIRE(cubuf_context_new_buffer(cctx, 3 * 4 * KiB, &src));
    T_REQUIRE(cubuf_context_new_buffer(cctx, 3 * 4 * KiB, &dst));
    const CUdeviceptr a = cubuf_buffer_ptr(src), b = cubuf_buffer_ptr(dst);
    const cubuf_copy_t copies[] = {{b, a, 4 * KiB},
                                   {b, a, 0},
                                   {b + 4 * KiB, a + 4 * KiB, 4 * KiB},
                                   {b + 8 * KiB, a + 8 * KiB, 4 * KiB}};
    const size_t nonempty_index[] = {0, 2, 3};
    cubuf_copy_options_t o = during();
    for (unsigned read = 1; read <= 3; read++) {
        size_t failed = 99;
        T_CHECK(cubuf_fault_fail_nth("cuMemcpyAsync", read, CUDA_ERROR_UNKNOWN));
        cubuf_status_t st = cubuf_copy_batch(copies, 4, s, &o, &failed);
        T_CHECK(cubuf_fault_fired());
        cubuf_fault_reset();
        T_CHECK(st == CUBUF_ERROR_DRIVER);
        if (failed != nonempty_index[read - 1]) {
            fprintf(stderr, "read %u failed: failed_index %zu, expected %zu\n", read, failed,
                    nonempty_index[read - 1]);
            t_failures++;
        }
    }
    T_CU(cuStreamSynchronize, s);
    cubuf_buffer_release(dst);
    cubuf_buffer_release(src);
}

int main(void)
{
    t_require_gpu();
    T_REQUIRE(cubuf_context_create(0, &cctx));
    T_CU(cuCtxSetCurrent, t_cu(cctx));
    CUstream s = NULL;
    T_CU(cuStreamCreate, &s, CU_STREAM_NON_BLOCKING);
    check_pool_query_fault(s); /* first: the pool is made once per process */
    const size_t sizes[] = {4 * KiB, 1 * MiB, 64 * MiB};
    for (int kind = 0; kind < SRC_KINDS; kind++)
        for (size_t i = 0; i < 3; i++) {
            check_held((src_kind_t)kind, sizes[i], false, s);
            check_held((src_kind_t)kind, sizes[i], true, s);
        }
    for (int kind = 0; kind < SRC_KINDS; kind++) check_faults((src_kind_t)kind, s);
    check_batch_failed_index(s);
    T_CU(cuStreamDestroy, s);
    T_OK(cubuf_context_synchronize(cctx));
    cubuf_context_destroy(cctx);
    return t_finish("test_during_call");
}
