/* Copies: copy_from / copy_to / copy_batch, D2D, H2D, D2H, sizes 0 to 1 GiB,
 * copy options (the attributed batch-of-one path and its fallback), the
 * refusals, the cost of the hot path, and fault injection. */
#include "alloc_fault_test.h"
#include "internal.h"
#include "test.h"

static CUstream s;           /* blocking: ordered after the legacy-stream allocations */
static cubuf_context_t *cctx;
static CUcontext ctx;

static unsigned char pattern_byte(size_t i, unsigned seed)
{
    return (unsigned char)((i * 131u + seed * 7u + (i >> 8)) & 0xffu);
}

static void fill_pattern(unsigned char *p, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++) p[i] = pattern_byte(i, seed);
}

static bool check_pattern(const unsigned char *p, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++)
        if (p[i] != pattern_byte(i, seed)) {
            fprintf(stderr, "byte %zu is 0x%02x, expected 0x%02x\n", i, p[i], pattern_byte(i, seed));
            return false;
        }
    return true;
}

/* A device buffer of n bytes holding pattern `seed` (raw HtoD, synchronous). */
static cubuf_buffer_t *device_with_pattern(size_t n, unsigned seed)
{
    cubuf_buffer_t *b = NULL;
    T_REQUIRE(cubuf_context_new_buffer(cctx, n, &b));
    if (n) {
        unsigned char *h = malloc(n);
        fill_pattern(h, n, seed);
        T_CU(cuStreamSynchronize, CU_STREAM_LEGACY);
        T_CU(cuMemcpyHtoD, cubuf_buffer_ptr(b), h, n);
        free(h);
    }
    return b;
}

/* Reads a device buffer back (after the stream is done) and checks the pattern. */
static bool device_has_pattern(const cubuf_buffer_t *b, unsigned seed)
{
    size_t n = cubuf_buffer_size(b);
    T_CU(cuStreamSynchronize, s);
    unsigned char *h = malloc(n ? n : 1);
    if (n) T_CU(cuMemcpyDtoH, h, cubuf_buffer_ptr(b), n);
    bool ok = check_pattern(h, n, seed);
    free(h);
    return ok;
}

static size_t bytes_allocated(void)
{
    size_t b = 0;
    T_OK(cubuf_context_bytes_allocated(cctx, &b));
    return b;
}

/* ---- a user resource over cuMemAlloc/cuMemFree, its calls injectable ---- */

typedef struct user_res {
    int allocs, deallocs;
} user_res_t;

static cubuf_status_t ur_alloc(void *state, size_t size, CUstream stream, CUdeviceptr *ptr)
{
    if (CU_CALL(cuMemAlloc, ptr, size) != CUDA_SUCCESS) return CUBUF_ERROR_OUT_OF_MEMORY;
    ((user_res_t *)state)->allocs++;
    return CUBUF_SUCCESS;
}

static cubuf_status_t ur_dealloc(void *state, CUdeviceptr ptr, size_t size, CUstream stream)
{
    ((user_res_t *)state)->deallocs++;
    /* cuMemFree is synchronous w.r.t. the device, so any stream is ordered. */
    return cubuf__drv.cuMemFree(ptr) == CUDA_SUCCESS ? CUBUF_SUCCESS : CUBUF_ERROR_DRIVER;
}

static cubuf_resource_t *make_user_res(user_res_t *u)
{
    memset(u, 0, sizeof *u);
    cubuf_resource_ops_t ops = {CUBUF_RESOURCE_OPS_VERSION, ur_alloc, ur_dealloc, NULL};
    cubuf_resource_props_t props = CUBUF_RESOURCE_PROPS_INIT;
    props.device_id = 0;
    props.device_accessible = true;
    cubuf_resource_t *res = NULL;
    T_REQUIRE(cubuf_resource_create(&ops, &props, u, &res));
    return res;
}

static cubuf_resource_stats_t stats_of(const cubuf_resource_t *res)
{
    cubuf_resource_stats_t st = CUBUF_RESOURCE_STATS_INIT;
    T_OK(cubuf_resource_stats(res, &st));
    return st;
}

/* The counters alone: no pool query, which a global-mode capture forbids. */
static cubuf_resource_stats_t counters_of(const cubuf_resource_t *res)
{
    cubuf_resource_stats_t st = {.struct_size = CUBUF_RESOURCE_STATS_SIZE_V1};
    T_OK(cubuf_resource_stats(res, &st));
    return st;
}

/* ---- plain copies ---- */

static void test_d2d_sizes(void)
{
    const size_t sizes[] = {0, 1, 1000};
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        size_t n = sizes[k];
        cubuf_buffer_t *src = device_with_pattern(n, 3);
        cubuf_buffer_t *dst = device_with_pattern(n, 9);
        T_OK(cubuf_buffer_copy_from(dst, src, s, NULL));
        T_CHECK(device_has_pattern(dst, 3));
        /* copy_to into an existing destination. */
        cubuf_buffer_t *dst2 = device_with_pattern(n, 11);
        T_OK(cubuf_buffer_copy_to(src, dst2, s, NULL));
        T_CHECK(device_has_pattern(dst2, 3));
        cubuf_buffer_release(src);
        cubuf_buffer_release(dst);
        cubuf_buffer_release(dst2);
    }

    /* Size 0 makes no driver call at all. */
    cubuf_buffer_t *a = NULL, *b = NULL;
    T_REQUIRE(cubuf_buffer_view(0, 0, &a));
    T_REQUIRE(cubuf_buffer_view(0, 0, &b));
    cubuf_fault_count_calls(true);
    T_OK(cubuf_buffer_copy_from(a, b, s, NULL));
    cubuf_copy_options_t o = CUBUF_COPY_OPTIONS_INIT;
    T_OK(cubuf_buffer_copy_from(a, b, s, &o));
    T_CHECK(cubuf_fault_calls("cuMemcpyAsync") == 0 && cubuf_fault_calls("cuCtxGetCurrent") == 0);
    T_CHECK(cubuf_fault_calls("cuStreamIsCapturing") == 0);
    T_CHECK(cubuf_fault_calls("cuMemcpyBatchAsync") == 0);
    cubuf_fault_count_calls(false);
    cubuf_buffer_release(a);
    cubuf_buffer_release(b);
}

static void test_hot_path_cost(void)
{
    cubuf_buffer_t *src = device_with_pattern(1000, 1);
    cubuf_buffer_t *dst = device_with_pattern(1000, 2);
    /* With the buffers' context current: exactly the copy plus one cuCtxGetCurrent. */
    cubuf_fault_count_calls(true);
    T_OK(cubuf_buffer_copy_from(dst, src, s, NULL));
    T_CHECK(cubuf_fault_calls("cuMemcpyAsync") == 1);
    T_CHECK(cubuf_fault_calls("cuCtxGetCurrent") <= 1);
    T_CHECK(cubuf_fault_calls("cuCtxPushCurrent") == 0);
    T_CHECK(cubuf_fault_calls("cuStreamIsCapturing") == 0);
    T_CHECK(cubuf_fault_calls("cuMemcpyBatchAsync") == 0);
    cubuf_fault_count_calls(false);
    T_CHECK(device_has_pattern(dst, 1));

    /* With nothing current, the copy still runs (in the buffers' context),
     * and nothing is left current afterwards. */
    T_CU(cuCtxSetCurrent, NULL);
    cubuf_buffer_t *dst3 = NULL;
    T_OK(cubuf_buffer_copy_to_new(src, CU_STREAM_PER_THREAD, NULL, &dst3));
    CUcontext cur = (CUcontext)(uintptr_t)1;
    T_CU(cuCtxGetCurrent, &cur);
    T_CHECK(cur == NULL);
    T_CU(cuCtxSetCurrent, ctx);
    T_CU(cuStreamSynchronize, CU_STREAM_PER_THREAD);
    T_CHECK(device_has_pattern(dst3, 1));
    cubuf_buffer_release(dst3);
    cubuf_buffer_release(src);
    cubuf_buffer_release(dst);
}

static void test_host_device(void)
{
    const size_t n = 1000;
    void *h1 = NULL, *h2 = NULL;
    T_CU(cuMemHostAlloc, &h1, n, 0);
    T_CU(cuMemHostAlloc, &h2, n, 0);
    fill_pattern(h1, n, 21);
    memset(h2, 0, n);
    cubuf_buffer_t *hv1 = NULL, *hv2 = NULL, *d = NULL;
    T_REQUIRE(cubuf_buffer_view((CUdeviceptr)(uintptr_t)h1, n, &hv1));
    T_REQUIRE(cubuf_buffer_view((CUdeviceptr)(uintptr_t)h2, n, &hv2));
    T_REQUIRE(cubuf_context_new_buffer(cctx, n, &d));
    T_CU(cuStreamSynchronize, CU_STREAM_LEGACY);
    T_OK(cubuf_buffer_copy_from(d, hv1, s, NULL)); /* H2D */
    T_CHECK(device_has_pattern(d, 21));
    T_OK(cubuf_buffer_copy_from(hv2, d, s, NULL)); /* D2H */
    T_CU(cuStreamSynchronize, s);
    T_CHECK(check_pattern(h2, n, 21));
    /* Host to host through the same call. */
    memset(h2, 0, n);
    T_OK(cubuf_buffer_copy_from(hv2, hv1, s, NULL));
    T_CU(cuStreamSynchronize, s);
    T_CHECK(check_pattern(h2, n, 21));
    /* Size 1 D2H. */
    cubuf_buffer_t *one = NULL, *hone = NULL;
    T_REQUIRE(cubuf_buffer_slice(d, 999, 1, &one));
    T_REQUIRE(cubuf_buffer_slice(hv2, 0, 1, &hone));
    memset(h2, 0, n);
    T_OK(cubuf_buffer_copy_from(hone, one, s, NULL));
    T_CU(cuStreamSynchronize, s);
    T_CHECK(((unsigned char *)h2)[0] == pattern_byte(999, 21) && ((unsigned char *)h2)[1] == 0);
    cubuf_buffer_release(one);
    cubuf_buffer_release(hone);
    cubuf_buffer_release(hv1);
    cubuf_buffer_release(hv2);
    cubuf_buffer_release(d);
    T_CU(cuMemFreeHost, h1);
    T_CU(cuMemFreeHost, h2);
}

static void test_one_gib(void)
{
    const size_t n = (size_t)1 << 30;
    cubuf_buffer_t *src = NULL, *dst = NULL;
    T_REQUIRE(cubuf_context_new_buffer(cctx, n, &src));
    T_REQUIRE(cubuf_context_new_buffer(cctx, n, &dst));
    const uint32_t background = 0xa5c3e1f7u;
    T_OK(cubuf_buffer_fill(src, &background, 4, s));
    T_OK(cubuf_buffer_fill_byte(dst, 0, s));
    /* Distinct 64-byte markers at sampled offsets, the ends included. */
    const size_t offsets[] = {0, 4096 + 1, n / 3, n / 2 - 7, n - 64 - 4096, n - 64};
    unsigned char marker[64], back[64];
    T_CU(cuStreamSynchronize, s);
    for (size_t k = 0; k < sizeof offsets / sizeof offsets[0]; k++) {
        fill_pattern(marker, sizeof marker, (unsigned)k + 100);
        T_CU(cuMemcpyHtoD, cubuf_buffer_ptr(src) + offsets[k], marker, sizeof marker);
    }
    T_OK(cubuf_buffer_copy_from(dst, src, s, NULL));
    T_CU(cuStreamSynchronize, s);
    for (size_t k = 0; k < sizeof offsets / sizeof offsets[0]; k++) {
        T_CU(cuMemcpyDtoH, back, cubuf_buffer_ptr(dst) + offsets[k], sizeof back);
        T_CHECK(check_pattern(back, sizeof back, (unsigned)k + 100));
    }
    /* Between the markers: the background pattern, up to the last byte. */
    const size_t plain[] = {1024, n / 4, n - 64 - 4096 + 64, n - 64 - 8};
    for (size_t k = 0; k < sizeof plain / sizeof plain[0]; k++) {
        uint32_t w[2] = {0, 0};
        T_CU(cuMemcpyDtoH, w, cubuf_buffer_ptr(dst) + plain[k], sizeof w);
        T_CHECK(w[0] == background && w[1] == background);
    }
    cubuf_buffer_release(src);
    cubuf_buffer_release(dst);
}

static void test_errors(void)
{
    cubuf_buffer_t *a = device_with_pattern(100, 1);
    cubuf_buffer_t *b = device_with_pattern(101, 2);
    cubuf_buffer_t *c = device_with_pattern(100, 3);
    T_STATUS(cubuf_buffer_copy_from(a, b, s, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_buffer_copy_from(b, a, s, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_buffer_copy_to(a, b, s, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_buffer_copy_from(NULL, a, s, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_buffer_copy_from(a, NULL, s, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_buffer_copy_to(NULL, b, s, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_buffer_copy_to(a, NULL, s, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    cubuf_buffer_t *untouched = (cubuf_buffer_t *)&untouched; /* an out-parameter is only written */
    T_STATUS(cubuf_buffer_copy_to_new(NULL, s, NULL, &untouched), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_buffer_copy_to_new(a, s, NULL, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(untouched == (cubuf_buffer_t *)&untouched);
    /* Closed source or destination. */
    T_OK(cubuf_buffer_close(c));
    T_STATUS(cubuf_buffer_copy_from(a, c, s, NULL), CUBUF_ERROR_CLOSED);
    T_STATUS(cubuf_buffer_copy_from(c, a, s, NULL), CUBUF_ERROR_CLOSED);
    T_STATUS(cubuf_buffer_copy_to(c, a, s, NULL), CUBUF_ERROR_CLOSED);
    T_STATUS(cubuf_buffer_copy_to_new(c, s, NULL, &untouched), CUBUF_ERROR_CLOSED);
    T_CHECK(untouched == (cubuf_buffer_t *)&untouched);
    T_CHECK(device_has_pattern(a, 1)); /* nothing was written */
    cubuf_buffer_release(a);
    cubuf_buffer_release(b);
    cubuf_buffer_release(c);
}

/* ---- options ---- */

static cubuf_copy_options_t opts(cubuf_src_access_order_t order)
{
    cubuf_copy_options_t o = CUBUF_COPY_OPTIONS_INIT;
    o.src_access_order = order;
    return o;
}

/* A spy in the driver table: records the attributes of the last batch and
 * forwards it, to show what each option becomes. */
static __typeof__(cubuf__drv.cuMemcpyBatchAsync) g_real_batch;
static CUmemcpyAttributes g_seen;
static size_t g_seen_count;

static CUresult CUDAAPI spy_batch(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
                                  CUmemcpyAttributes *attrs, size_t *idxs, size_t nattrs, CUstream stream)
{
    g_seen = attrs[0];
    g_seen_count = nattrs;
    return g_real_batch(dsts, srcs, sizes, count, attrs, idxs, nattrs, stream);
}

static void test_option_attributes(void)
{
    static const struct {
        cubuf_src_access_order_t order;
        CUmemcpySrcAccessOrder want;
    } orders[] = {{CUBUF_SRC_ACCESS_STREAM, CU_MEMCPY_SRC_ACCESS_ORDER_STREAM},
                  {CUBUF_SRC_ACCESS_ANY, CU_MEMCPY_SRC_ACCESS_ORDER_ANY}};
    cubuf_buffer_t *a = device_with_pattern(4096, 0), *b = device_with_pattern(4096, 7);
    g_real_batch = cubuf__drv.cuMemcpyBatchAsync;
    cubuf__drv.cuMemcpyBatchAsync = spy_batch;
    for (size_t k = 0; k < 2; k++) {
        cubuf_copy_options_t o = opts(orders[k].order);
        memset(&g_seen, 0xff, sizeof g_seen);
        T_OK(cubuf_buffer_copy_from(a, b, s, &o));
        T_CHECK(g_seen_count == 1 && g_seen.srcAccessOrder == orders[k].want);
        T_CHECK(g_seen.srcLocHint.type == CU_MEM_LOCATION_TYPE_INVALID &&
                g_seen.dstLocHint.type == CU_MEM_LOCATION_TYPE_INVALID);
        T_CHECK(g_seen.flags == CU_MEMCPY_FLAG_DEFAULT);
    }
    /* DURING_API_CALL is kept by cubuf: the driver copies, in stream order,
     * from host memory cubuf read the source into during the call. */
    cubuf_copy_options_t o = opts(CUBUF_SRC_ACCESS_DURING_API_CALL);
    o.dst_location = CUBUF_LOCATION_DEVICE;
    o.prefer_overlap_with_compute = true;
    memset(&g_seen, 0xff, sizeof g_seen);
    T_OK(cubuf_buffer_copy_from(a, b, s, &o));
    T_CHECK(g_seen_count == 1 && g_seen.srcAccessOrder == CU_MEMCPY_SRC_ACCESS_ORDER_STREAM);
    T_CHECK(g_seen.srcLocHint.type == CU_MEM_LOCATION_TYPE_HOST);
    T_CHECK(g_seen.dstLocHint.type == CU_MEM_LOCATION_TYPE_DEVICE && g_seen.dstLocHint.id == 0);
    T_CHECK(g_seen.flags == CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE);
    o = opts(CUBUF_SRC_ACCESS_STREAM);
    o.src_location = CUBUF_LOCATION_HOST_NUMA;
    o.src_location_id = 0;
    o.dst_location = CUBUF_LOCATION_DEVICE;
    o.dst_location_id = 0;
    o.prefer_overlap_with_compute = true;
    T_OK(cubuf_buffer_copy_from(a, b, s, &o));
    T_CHECK(g_seen.srcLocHint.type == CU_MEM_LOCATION_TYPE_HOST_NUMA && g_seen.srcLocHint.id == 0);
    T_CHECK(g_seen.dstLocHint.type == CU_MEM_LOCATION_TYPE_DEVICE && g_seen.dstLocHint.id == 0);
    T_CHECK(g_seen.flags == CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE);
    o.src_location = CUBUF_LOCATION_HOST;
    o.dst_location = CUBUF_LOCATION_NONE;
    o.prefer_overlap_with_compute = false;
    T_OK(cubuf_buffer_copy_from(a, b, s, &o));
    T_CHECK(g_seen.srcLocHint.type == CU_MEM_LOCATION_TYPE_HOST &&
            g_seen.dstLocHint.type == CU_MEM_LOCATION_TYPE_INVALID);
    cubuf__drv.cuMemcpyBatchAsync = g_real_batch;
    T_CHECK(device_has_pattern(a, 7)); /* the spied copies were real */
    cubuf_buffer_release(a);
    cubuf_buffer_release(b);
}

static void test_options(void)
{
    if (!cubuf__drv.cuMemcpyBatchAsync) {
        fprintf(stderr, "this driver has no cuMemcpyBatchAsync: the 13.0 driver should have it\n");
        t_failures++;
        return;
    }
    const cubuf_src_access_order_t orders[] = {CUBUF_SRC_ACCESS_STREAM,
                                               CUBUF_SRC_ACCESS_DURING_API_CALL,
                                               CUBUF_SRC_ACCESS_ANY};
    void *h = NULL;
    T_CU(cuMemHostAlloc, &h, 1000, 0);
    cubuf_buffer_t *hv = NULL;
    T_REQUIRE(cubuf_buffer_view((CUdeviceptr)(uintptr_t)h, 1000, &hv));
    for (size_t k = 0; k < 3; k++) {
        cubuf_copy_options_t o = opts(orders[k]);
        /* D2D through the batch of one. */
        cubuf_buffer_t *src = device_with_pattern(1000, (unsigned)k + 30);
        cubuf_buffer_t *dst = device_with_pattern(1000, 0);
        cubuf_fault_count_calls(true);
        T_OK(cubuf_buffer_copy_from(dst, src, s, &o));
        T_CHECK(cubuf_fault_calls("cuMemcpyBatchAsync") == 1);
        /* DURING_API_CALL reads the device source on a private stream first. */
        T_CHECK(cubuf_fault_calls("cuMemcpyAsync") == (orders[k] == CUBUF_SRC_ACCESS_DURING_API_CALL));
        cubuf_fault_count_calls(false);
        T_CHECK(device_has_pattern(dst, (unsigned)k + 30));
        /* H2D from pinned memory, with location hints and the overlap flag. */
        fill_pattern(h, 1000, (unsigned)k + 40);
        o.src_location = CUBUF_LOCATION_HOST;
        o.dst_location = CUBUF_LOCATION_DEVICE;
        o.dst_location_id = 0;
        o.prefer_overlap_with_compute = true;
        T_OK(cubuf_buffer_copy_from(dst, hv, s, &o));
        T_CHECK(device_has_pattern(dst, (unsigned)k + 40));
        /* D2H on the per-thread default stream, through copy_to. */
        memset(h, 0, 1000);
        o = opts(orders[k]);
        T_OK(cubuf_buffer_copy_to(src, hv, CU_STREAM_PER_THREAD, &o));
        T_CU(cuStreamSynchronize, CU_STREAM_PER_THREAD);
        T_CHECK(check_pattern(h, 1000, (unsigned)k + 30));
        cubuf_buffer_release(src);
        cubuf_buffer_release(dst);
    }

    cubuf_buffer_t *a = device_with_pattern(64, 1), *b = device_with_pattern(64, 2);
    /* The legacy default stream is refused, in both spellings. */
    cubuf_copy_options_t o = opts(CUBUF_SRC_ACCESS_STREAM);
    T_STATUS(cubuf_buffer_copy_from(a, b, NULL, &o), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_buffer_copy_from(a, b, CU_STREAM_LEGACY, &o), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(strstr(cubuf_last_error(), "legacy") != NULL);
    /* Malformed options. */
    o.struct_size = 0;
    T_STATUS(cubuf_buffer_copy_from(a, b, s, &o), CUBUF_ERROR_INVALID_ARGUMENT);
    o = opts((cubuf_src_access_order_t)7);
    T_STATUS(cubuf_buffer_copy_from(a, b, s, &o), CUBUF_ERROR_INVALID_ARGUMENT);
    o = opts(CUBUF_SRC_ACCESS_STREAM);
    o.src_location = (cubuf_location_hint_t)9;
    T_STATUS(cubuf_buffer_copy_from(a, b, s, &o), CUBUF_ERROR_INVALID_ARGUMENT);
    o = opts(CUBUF_SRC_ACCESS_STREAM);
    o.dst_location = CUBUF_LOCATION_DEVICE;
    o.dst_location_id = -1;
    T_STATUS(cubuf_buffer_copy_from(a, b, s, &o), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(device_has_pattern(a, 1)); /* nothing was copied */

    /* A capturing stream is refused with options; without them the copy is captured. */
    CUstream cs = NULL;
    T_CU(cuStreamCreate, &cs, CU_STREAM_NON_BLOCKING);
    T_CU(cuStreamBeginCapture, cs, CU_STREAM_CAPTURE_MODE_RELAXED);
    o = opts(CUBUF_SRC_ACCESS_STREAM);
    T_STATUS(cubuf_buffer_copy_from(a, b, cs, &o), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(strstr(cubuf_last_error(), "capturing") != NULL);
    T_OK(cubuf_buffer_copy_from(a, b, cs, NULL));
    CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
    T_CU(cuStreamIsCapturing, cs, &st);
    T_CHECK(st == CU_STREAM_CAPTURE_STATUS_ACTIVE); /* the refusal did not break the capture */
    CUgraph graph = NULL;
    T_CU(cuStreamEndCapture, cs, &graph);
    T_CHECK(graph != NULL);
    if (graph) T_CU(cuGraphDestroy, graph);
    T_CU(cuStreamDestroy, cs);
    T_CHECK(device_has_pattern(a, 1)); /* the captured copy never ran */

    /* The fallback where the driver has no attributed copy. */
    __typeof__(cubuf__drv.cuMemcpyBatchAsync) saved = cubuf__drv.cuMemcpyBatchAsync;
    cubuf__drv.cuMemcpyBatchAsync = NULL;
    o = opts(CUBUF_SRC_ACCESS_STREAM);
    T_OK(cubuf_buffer_copy_from(a, b, s, &o));
    T_CHECK(device_has_pattern(a, 2));
    cubuf_buffer_t *c = device_with_pattern(64, 5);
    o = opts(CUBUF_SRC_ACCESS_ANY);
    T_OK(cubuf_buffer_copy_from(a, c, s, &o));
    T_CHECK(device_has_pattern(a, 5));
    /* A failed plain copy on that path: a status, not a write through the
     * batch's NULL failed index, and the destination as it was. */
    T_CHECK(cubuf_fault_fail_nth("cuMemcpyAsync", 1, CUDA_ERROR_ILLEGAL_ADDRESS));
    T_STATUS(cubuf_buffer_copy_from(a, b, s, &o), CUBUF_ERROR_DRIVER);
    T_CHECK(cubuf_last_cuda_result() == CUDA_ERROR_ILLEGAL_ADDRESS);
    cubuf_fault_reset();
    T_CHECK(device_has_pattern(a, 5));
    /* DURING_API_CALL needs nothing from the driver: cubuf keeps it. */
    o = opts(CUBUF_SRC_ACCESS_DURING_API_CALL);
    T_OK(cubuf_buffer_copy_from(a, b, s, &o));
    T_CHECK(device_has_pattern(a, 2));
    o = opts(CUBUF_SRC_ACCESS_STREAM);
    T_STATUS(cubuf_buffer_copy_from(a, b, CU_STREAM_LEGACY, &o), CUBUF_ERROR_INVALID_ARGUMENT);
    cubuf__drv.cuMemcpyBatchAsync = saved;

    cubuf_buffer_release(a);
    cubuf_buffer_release(b);
    cubuf_buffer_release(c);
    cubuf_buffer_release(hv);
    T_CU(cuMemFreeHost, h);
}

/* ---- copy_to without a destination ---- */

static void test_copy_to_allocates(void)
{
    /* From a context buffer: the new buffer comes from the same resource and is counted. */
    cubuf_buffer_t *src = device_with_pattern(1000, 50);
    size_t base = bytes_allocated();
    cubuf_buffer_t *dst = NULL;
    T_OK(cubuf_buffer_copy_to_new(src, s, NULL, &dst));
    T_REQUIRE(dst ? CUBUF_SUCCESS : CUBUF_ERROR_DRIVER);
    T_CHECK(cubuf_buffer_resource(dst) == cubuf_buffer_resource(src));
    T_CHECK(cubuf_buffer_size(dst) == 1000 && cubuf_buffer_ptr(dst) != cubuf_buffer_ptr(src));
    T_CHECK(bytes_allocated() == base + 1000);
    T_CHECK(device_has_pattern(dst, 50));
    cubuf_buffer_release(dst);
    T_CHECK(bytes_allocated() == base);

    /* With options, on the per-thread default stream. */
    dst = NULL;
    cubuf_copy_options_t o = opts(CUBUF_SRC_ACCESS_ANY);
    T_OK(cubuf_buffer_copy_to_new(src, CU_STREAM_PER_THREAD, &o, &dst));
    T_CU(cuStreamSynchronize, CU_STREAM_PER_THREAD);
    T_CHECK(dst && device_has_pattern(dst, 50));
    cubuf_buffer_release(dst);
    /* Bad options are refused before anything is allocated. */
    dst = NULL;
    cubuf_resource_stats_t before = stats_of(cubuf_buffer_resource(src));
    T_STATUS(cubuf_buffer_copy_to_new(src, CU_STREAM_LEGACY, &o, &dst), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(dst == NULL && stats_of(cubuf_buffer_resource(src)).total_allocations ==
                               before.total_allocations);
    T_CHECK(bytes_allocated() == base);

    /* Size 0. */
    cubuf_buffer_t *empty = NULL;
    T_REQUIRE(cubuf_context_new_buffer(cctx, 0, &empty));
    dst = NULL;
    T_OK(cubuf_buffer_copy_to_new(empty, s, NULL, &dst));
    T_CHECK(dst && cubuf_buffer_size(dst) == 0 && !cubuf_buffer_is_closed(dst));
    cubuf_buffer_release(dst);
    cubuf_buffer_release(empty);

    /* From a user resource. */
    user_res_t u;
    cubuf_resource_t *res = make_user_res(&u);
    cubuf_buffer_t *usrc = NULL;
    T_REQUIRE(cubuf_resource_allocate(res, 1000, s, &usrc));
    T_OK(cubuf_buffer_copy_from(usrc, src, s, NULL));
    dst = NULL;
    T_OK(cubuf_buffer_copy_to_new(usrc, s, NULL, &dst));
    T_CHECK(u.allocs == 2 && dst && cubuf_buffer_resource(dst) == res);
    T_CHECK(device_has_pattern(dst, 50));
    T_CHECK(bytes_allocated() == base); /* user resources count nowhere */
    cubuf_buffer_release(dst);
    /* Options on a capturing stream are refused before anything is
     * allocated: the user's callbacks are not called (their cuMemAlloc would
     * invalidate a global-mode capture), no pool allocation is made, and the
     * capture goes on. */
    CUstream cs = NULL;
    T_CU(cuStreamCreate, &cs, CU_STREAM_NON_BLOCKING);
    T_CU(cuStreamBeginCapture, cs, CU_STREAM_CAPTURE_MODE_GLOBAL);
    before = counters_of(cubuf_buffer_resource(src));
    dst = NULL;
    T_STATUS(cubuf_buffer_copy_to_new(usrc, cs, &o, &dst), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(dst == NULL && u.allocs == 2 && u.deallocs == 1);
    T_STATUS(cubuf_buffer_copy_to_new(src, cs, &o, &dst), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(dst == NULL && counters_of(cubuf_buffer_resource(src)).total_allocations ==
                               before.total_allocations);
    CUstreamCaptureStatus cap = CU_STREAM_CAPTURE_STATUS_NONE;
    T_CU(cuStreamIsCapturing, cs, &cap);
    T_CHECK(cap == CU_STREAM_CAPTURE_STATUS_ACTIVE);
    CUgraph graph = NULL;
    T_CU(cuStreamEndCapture, cs, &graph);
    if (graph) T_CU(cuGraphDestroy, graph);
    T_CU(cuStreamDestroy, cs);
    cubuf_buffer_release(usrc);
    T_CHECK(u.deallocs == 2 && stats_of(res).current_bytes == 0);

    /* Without a resource (a view): refused. */
    cubuf_buffer_t *view = NULL, *slice = NULL;
    T_REQUIRE(cubuf_buffer_view(cubuf_buffer_ptr(src), 1000, &view));
    T_REQUIRE(cubuf_buffer_slice(src, 0, 10, &slice));
    dst = NULL;
    T_STATUS(cubuf_buffer_copy_to_new(view, s, NULL, &dst), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(dst == NULL);
    /* A slice's memory is its root's: the copy comes from the root's resource. */
    T_OK(cubuf_buffer_copy_to_new(slice, s, NULL, &dst));
    T_CHECK(dst && cubuf_buffer_size(dst) == 10 && cubuf_buffer_resource(dst) == cubuf_buffer_resource(src));
    T_CHECK(dst && device_has_pattern(dst, 50));
    cubuf_buffer_release(dst);
    cubuf_buffer_release(view);
    cubuf_buffer_release(slice);
    cubuf_buffer_release(src);
    cubuf_resource_release(res);
}

/* ---- batches ---- */

static void test_batch(void)
{
    const size_t n = 4096;
    cubuf_buffer_t *src = device_with_pattern(n, 60);
    cubuf_buffer_t *dst = NULL;
    T_REQUIRE(cubuf_context_new_buffer(cctx, n, &dst));
    CUdeviceptr S = cubuf_buffer_ptr(src), D = cubuf_buffer_ptr(dst);
    /* Scatter the source to the destination in pieces, one of them empty. */
    const cubuf_copy_t copies[] = {
        {D + 0, S + 0, 1000}, {D + 1000, S + 1000, 1}, {D + 1001, S + 1001, 0},
        {D + 1001, S + 1001, 2047}, {D + 3048, S + 3048, 1048},
    };
    const size_t count = sizeof copies / sizeof copies[0];
    cubuf_copy_options_t o = opts(CUBUF_SRC_ACCESS_STREAM);
    const cubuf_copy_options_t *variants[] = {NULL, &o};
    const CUstream streams[] = {s, CU_STREAM_LEGACY};
    for (int v = 0; v < 2; v++) {
        for (int k = 0; k < 2; k++) {
            if (variants[v] && k == 1) continue; /* options refuse the legacy stream */
            T_OK(cubuf_buffer_fill_byte(dst, 0, s));
            size_t failed = 12345;
            cubuf_fault_count_calls(true);
            T_OK(cubuf_copy_batch(copies, count, streams[k], variants[v], &failed));
            if (k == 0) T_CHECK(cubuf_fault_calls("cuMemcpyBatchAsync") == 1);
            else T_CHECK(cubuf_fault_calls("cuMemcpyAsync") == 4);
            cubuf_fault_count_calls(false);
            T_CHECK(failed == 12345); /* written on failure only */
            T_CU(cuStreamSynchronize, CU_STREAM_LEGACY);
            T_CHECK(device_has_pattern(dst, 60));
        }
    }
    /* A lone copy goes through cuMemcpyAsync. */
    cubuf_fault_count_calls(true);
    T_OK(cubuf_copy_batch(copies, 1, s, NULL, NULL));
    T_CHECK(cubuf_fault_calls("cuMemcpyAsync") == 1 && cubuf_fault_calls("cuMemcpyBatchAsync") == 0);
    cubuf_fault_count_calls(false);

    /* count 0, NULL copies, address 0, legacy stream with options. */
    size_t failed = 777;
    T_OK(cubuf_copy_batch(NULL, 0, s, NULL, &failed));
    T_OK(cubuf_copy_batch(copies, 0, s, &o, &failed));
    T_CHECK(failed == 777);
    T_STATUS(cubuf_copy_batch(NULL, 3, s, NULL, &failed), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(failed == 3);
    cubuf_copy_t bad[] = {{D, S, 8}, {D + 8, 0, 8}};
    T_STATUS(cubuf_copy_batch(bad, 2, s, NULL, &failed), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(failed == 1);
    T_STATUS(cubuf_copy_batch(copies, count, CU_STREAM_LEGACY, &o, &failed),
             CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(failed == count);

    /* Capturing: refused with options; without them, plain captured copies. */
    CUstream cs = NULL;
    T_CU(cuStreamCreate, &cs, CU_STREAM_NON_BLOCKING);
    T_CU(cuStreamBeginCapture, cs, CU_STREAM_CAPTURE_MODE_RELAXED);
    T_STATUS(cubuf_copy_batch(copies, count, cs, &o, &failed), CUBUF_ERROR_INVALID_ARGUMENT);
    T_OK(cubuf_copy_batch(copies, count, cs, NULL, &failed));
    CUgraph graph = NULL;
    T_CU(cuStreamEndCapture, cs, &graph);
    T_CHECK(graph != NULL);
    if (graph) T_CU(cuGraphDestroy, graph);
    T_CU(cuStreamDestroy, cs);

    /* Fallback: plain copies, DURING_API_CALL included. */
    __typeof__(cubuf__drv.cuMemcpyBatchAsync) saved = cubuf__drv.cuMemcpyBatchAsync;
    cubuf__drv.cuMemcpyBatchAsync = NULL;
    T_OK(cubuf_buffer_fill_byte(dst, 0, s));
    T_OK(cubuf_copy_batch(copies, count, s, &o, &failed));
    T_CHECK(device_has_pattern(dst, 60));
    cubuf_copy_options_t during = opts(CUBUF_SRC_ACCESS_DURING_API_CALL);
    T_OK(cubuf_buffer_fill_byte(dst, 0, s));
    T_OK(cubuf_copy_batch(copies, count, s, &during, &failed));
    T_CHECK(device_has_pattern(dst, 60));
    cubuf__drv.cuMemcpyBatchAsync = saved;
    /* DURING_API_CALL sizes that add up past SIZE_MAX: a bad argument (the
     * header's status), the batch refused as a whole. */
    const cubuf_copy_t huge[] = {{D, S, SIZE_MAX / 2 + 1}, {D + 8, S + 8, SIZE_MAX / 2 + 1}};
    T_STATUS(cubuf_copy_batch(huge, 2, s, &during, &failed), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(failed == 2);

    /* Faults: the batch as a whole, and the second plain copy. */
    T_CHECK(cubuf_fault_fail_nth("cuMemcpyBatchAsync", 1, CUDA_ERROR_INVALID_VALUE));
    T_STATUS(cubuf_copy_batch(copies, count, s, &o, &failed), CUBUF_ERROR_DRIVER);
    T_CHECK(failed == count && cubuf_last_cuda_result() == CUDA_ERROR_INVALID_VALUE);
    T_CHECK(cubuf_fault_fail_nth("cuMemcpyAsync", 2, CUDA_ERROR_ILLEGAL_ADDRESS));
    T_STATUS(cubuf_copy_batch(copies, count, CU_STREAM_LEGACY, NULL, &failed), CUBUF_ERROR_DRIVER);
    T_CHECK(failed == 1);
    cubuf_fault_reset();
    T_CU(cuCtxSynchronize);

    /* Host allocations failed in turn: nine copies (more than the arrays kept
     * on the stack), with and without DURING_API_CALL (its copy records).
     * Each failure is OUT_OF_MEMORY with the destination untouched; then the
     * copies arrive whole. */
    cubuf_copy_t nine[9];
    for (size_t i = 0; i < 9; i++)
        nine[i] = (cubuf_copy_t){D + i * 400, S + i * 400, i == 8 ? n - 8 * 400 : 400};
    const cubuf_copy_options_t *alloc_variants[] = {&o, &during};
    unsigned char *h = malloc(n);
    for (int v = 0; v < 2 && h; v++) {
        unsigned failures = 0;
        for (unsigned nth = 1; nth < 50; nth++) {
            T_OK(cubuf_buffer_fill_byte(dst, 0, s));
            T_CU(cuStreamSynchronize, s);
            t_fail_alloc_nth(nth);
            cubuf_status_t st = cubuf_copy_batch(nine, 9, s, alloc_variants[v], &failed);
            bool fired = cubuf_fault_fired();
            cubuf_fault_reset();
            if (!fired) {
                T_OK(st);
                T_CHECK(device_has_pattern(dst, 60));
                break;
            }
            failures++;
            T_STATUS(st, CUBUF_ERROR_OUT_OF_MEMORY);
            T_CU(cuStreamSynchronize, s);
            T_CU(cuMemcpyDtoH, h, D, n);
            size_t written = 0;
            for (size_t i = 0; i < n; i++) written += h[i] != 0;
            T_CHECK(written == 0);
        }
        /* the arrays where cuMemcpyBatchAsync takes them; the records always */
        T_CHECK(failures >= (v == 1 || cubuf__drv.cuMemcpyBatchAsync ? 1u : 0u));
    }
    free(h);
    cubuf_buffer_release(src);
    cubuf_buffer_release(dst);
}

/* ---- fault injection ---- */

static void test_faults(void)
{
    cubuf_buffer_t *a = device_with_pattern(256, 70), *b = device_with_pattern(256, 71);
    T_CHECK(cubuf_fault_fail_nth("cuMemcpyAsync", 1, CUDA_ERROR_ILLEGAL_ADDRESS));
    T_STATUS(cubuf_buffer_copy_from(a, b, s, NULL), CUBUF_ERROR_DRIVER);
    T_CHECK(cubuf_last_cuda_result() == CUDA_ERROR_ILLEGAL_ADDRESS);
    T_CHECK(strstr(cubuf_last_error(), "cuMemcpyAsync failed") != NULL);
    cubuf_copy_options_t o = opts(CUBUF_SRC_ACCESS_STREAM);
    T_CHECK(cubuf_fault_fail_nth("cuMemcpyBatchAsync", 1, CUDA_ERROR_INVALID_VALUE));
    T_STATUS(cubuf_buffer_copy_from(a, b, s, &o), CUBUF_ERROR_DRIVER);
    T_CHECK(cubuf_last_cuda_result() == CUDA_ERROR_INVALID_VALUE);
    T_CHECK(cubuf_fault_fail_nth("cuStreamIsCapturing", 1, CUDA_ERROR_INVALID_HANDLE));
    T_STATUS(cubuf_buffer_copy_from(a, b, s, &o), CUBUF_ERROR_DRIVER);
    cubuf_fault_reset();
    T_CHECK(device_has_pattern(a, 70));

    /* copy_to without a destination, every call (then every host allocation)
     * on its path failed in turn, with and without options, from a context
     * buffer and a user resource. */
    user_res_t u;
    cubuf_resource_t *res = make_user_res(&u);
    cubuf_buffer_t *usrc = NULL;
    T_REQUIRE(cubuf_resource_allocate(res, 256, s, &usrc));
    cubuf_buffer_t *sources[] = {b, usrc};
    for (int which = 0; which < 2; which++) {
        for (int mode = 0; mode < 4; mode++) {
            const int with_opts = mode & 1, alloc = mode >> 1;
            cubuf_buffer_t *src = sources[which];
            cubuf_resource_t *r = cubuf_buffer_resource(src);
            size_t base = bytes_allocated();
            cubuf_resource_stats_t rs = stats_of(r);
            unsigned failures = 0;
            bool succeeded = false;
            for (unsigned nth = 1; nth < 200 && !succeeded; nth++) {
                cubuf_buffer_t *dst = NULL;
                if (alloc) t_fail_alloc_nth(nth);
                else cubuf_fault_fail_any_nth(nth, CUDA_ERROR_UNKNOWN);
                cubuf_status_t st = cubuf_buffer_copy_to_new(src, s, with_opts ? &o : NULL, &dst);
                bool fired = cubuf_fault_fired();
                cubuf_fault_reset();
                if (fired && alloc) T_STATUS(st, CUBUF_ERROR_OUT_OF_MEMORY);
                if (!fired) {
                    T_CHECK(st == CUBUF_SUCCESS && dst != NULL);
                    cubuf_buffer_release(dst);
                    succeeded = true;
                    break;
                }
                failures++;
                if (st == CUBUF_SUCCESS) {
                    fprintf(stderr, "copy_to succeeded although %s failed (n=%u)\n",
                            cubuf_fault_fired_name(), nth);
                    t_failures++;
                    cubuf_buffer_release(dst);
                    continue;
                }
                T_CHECK(dst == NULL);
                T_CU(cuStreamSynchronize, s); /* frees on the stream have run */
                cubuf_resource_stats_t now = stats_of(r);
                if (bytes_allocated() != base || now.current_bytes != rs.current_bytes ||
                    now.current_count != rs.current_count) {
                    fprintf(stderr, "leak after failing %s (n=%u, source %d, options %d)\n",
                            cubuf_fault_fired_name(), nth, which, with_opts);
                    t_failures++;
                }
            }
            /* driver: at least the allocation and the copy; host: the buffer object */
            T_CHECK(succeeded && failures >= (alloc ? 1u : 2u));
            T_CHECK(bytes_allocated() == base && stats_of(r).current_bytes == rs.current_bytes);
        }
    }
    T_CHECK(u.allocs == u.deallocs + 1); /* only usrc is alive */
    cubuf_buffer_release(usrc);
    T_CHECK(u.allocs == u.deallocs);
    cubuf_resource_release(res);
    T_CHECK(device_has_pattern(b, 71)); /* the source is intact */
    cubuf_buffer_release(a);
    cubuf_buffer_release(b);
}

int main(void)
{
    t_require_gpu();
    T_REQUIRE(cubuf_context_create(0, &cctx));
    T_OK(cubuf_context_handle(cctx, &ctx));
    T_CU(cuCtxSetCurrent, ctx);
    T_CU(cuStreamCreate, &s, CU_STREAM_DEFAULT);

    test_d2d_sizes();
    test_hot_path_cost();
    test_host_device();
    test_one_gib();
    test_errors();
    test_options();
    test_option_attributes();
    test_copy_to_allocates();
    test_batch();
    test_faults();

    T_CU(cuStreamSynchronize, s);
    T_CHECK(bytes_allocated() == 0);
    T_CU(cuStreamDestroy, s);
    T_CU(cuCtxSetCurrent, NULL);
    cubuf_context_destroy(cctx);
    return t_finish("test_copy");
}
