/* One meaning for a default stream (cubuf.h, "Default streams"). With a
 * private context current, as Numba, PyTorch or any framework may leave one,
 * every built-in resource allocates, fills, copies and closes on 0,
 * CU_STREAM_LEGACY and CU_STREAM_PER_THREAD with no synchronization between
 * the steps: all of it must run on the resource's context's stream, so a
 * close that synchronizes before freeing (managed, legacy pinned, sync
 * device, VMM) waits for the fill, and nothing faults. The bytes are read
 * back, and afterwards both contexts still work (a fault would poison the
 * primary context for every later call).
 *
 * Uses only calls that predate the rule, so the same program shows the
 * failure on a library without it. */
#include "internal.h"
#include "test.h"

#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)

static cubuf_context_t *cctx; /* device 0's primary context */

typedef struct res_case {
    const char *name;
    cubuf_resource_t *res;
} res_case_t;

static cubuf_resource_t *device_pool(bool private_pool)
{
    cubuf_device_resource_options_t o = CUBUF_DEVICE_RESOURCE_OPTIONS_INIT;
    o.private_pool = private_pool;
    cubuf_resource_t *r = NULL;
    T_REQUIRE(cubuf_device_resource_create(0, &o, &r));
    return r;
}

static size_t make_cases(res_case_t *c)
{
    size_t n = 0;
    c[n++] = (res_case_t){"device default pool", device_pool(false)};
    c[n++] = (res_case_t){"device private pool", device_pool(true)};
    T_REQUIRE(cubuf_pinned_resource_create(0, false, &c[n].res));
    c[n++].name = "pinned pool";
    T_REQUIRE(cubuf_managed_resource_create(0, -2, &c[n].res));
    c[n++].name = "managed";
    T_REQUIRE(cubuf_managed_resource_create(0, 0, &c[n].res));
    c[n++].name = "managed, prefetched to device 0";
    T_REQUIRE(cubuf_legacy_pinned_resource_create(0, &c[n].res));
    c[n++].name = "legacy pinned";
    T_REQUIRE(cubuf_sync_device_resource_create(0, &c[n].res));
    c[n++].name = "sync device";
    T_REQUIRE(cubuf_vmm_resource_create(0, NULL, &c[n].res));
    c[n++].name = "virtual memory";
    return n;
}

static const CUstream g_streams[] = {NULL, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD};
static const char *const g_stream_names[] = {"0", "CU_STREAM_LEGACY", "CU_STREAM_PER_THREAD"};

static bool all_bytes(const unsigned char *p, size_t n, unsigned char v)
{
    for (size_t i = 0; i < n; i++)
        if (p[i] != v) {
            fprintf(stderr, "byte %zu of %zu is 0x%02x, expected 0x%02x\n", i, n, p[i], v);
            return false;
        }
    return true;
}

/* Allocate, fill, close at once; then allocate, fill, copy into pinned host
 * memory, close, and read the bytes after synchronizing the primary context. */
static void run_case(const res_case_t *c, CUstream s, const char *sname, size_t n,
                     unsigned char *host, cubuf_buffer_t *host_view)
{
    cubuf_buffer_t *b = NULL;
    unsigned char v = (unsigned char)(0x11 + n % 200);
    cubuf_status_t st = cubuf_resource_allocate(c->res, n, s, &b);
    if (st != CUBUF_SUCCESS) {
        fprintf(stderr, "%s on %s, %zu bytes: allocate: %s\n", c->name, sname, n, cubuf_last_error());
        t_failures++;
        return;
    }
    T_OK(cubuf_buffer_fill_byte(b, v, s));
    st = cubuf_buffer_close(b);
    if (st != CUBUF_SUCCESS) {
        fprintf(stderr, "%s on %s, %zu bytes: close right after the fill: %s\n", c->name, sname,
                n, cubuf_last_error());
        t_failures++;
    }
    cubuf_buffer_release(b);

    b = NULL;
    T_REQUIRE(cubuf_resource_allocate(c->res, n, s, &b));
    T_OK(cubuf_buffer_fill_byte(b, (unsigned char)(v + 1), s));
    n = cubuf_buffer_size(b); /* virtual memory rounds up to its granularity */
    cubuf_buffer_t *hv = NULL;
    T_REQUIRE(cubuf_buffer_slice(host_view, 0, n, &hv));
    memset(host, 0, n);
    T_OK(cubuf_buffer_copy_from(hv, b, s, NULL)); /* runs in b's context, on its stream */
    T_OK(cubuf_buffer_close(b));
    cubuf_buffer_release(b);
    cubuf_buffer_release(hv);
    T_OK(cubuf_context_synchronize(cctx));
    if (!all_bytes(host, n, (unsigned char)(v + 1))) {
        fprintf(stderr, "  (%s on %s, %zu bytes)\n", c->name, sname, n);
        t_failures++;
    }
}

int main(void)
{
    t_require_gpu();
    T_REQUIRE(cubuf_context_create(0, &cctx));
    T_CU(cuCtxSetCurrent, t_cu(cctx));
    res_case_t cases[16];
    size_t ncases = make_cases(cases);
    const size_t big = 128 * MiB; /* room for a rounded-up 64 MiB */
    void *host = NULL;
    T_CU(cuMemHostAlloc, &host, big, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP);
    cubuf_buffer_t *host_view = NULL;
    T_REQUIRE(cubuf_buffer_view((CUdeviceptr)(uintptr_t)host, big, &host_view));

    /* A private context of the same device, current from here on. */
    CUcontext priv = NULL;
    T_CU(cuCtxCreate, &priv, NULL, 0, cubuf__inspect_context_device(cctx));
    const size_t sizes[] = {64 * KiB, 64 * MiB};
    for (size_t k = 0; k < ncases; k++)
        for (size_t i = 0; i < 3; i++)
            for (size_t j = 0; j < 2; j++)
                run_case(&cases[k], g_streams[i], g_stream_names[i], sizes[j], host, host_view);

    /* The context's buffers (made on its legacy stream) used on stream 0. */
    for (size_t j = 0; j < 2; j++) {
        cubuf_buffer_t *b = NULL, *hv = NULL;
        T_REQUIRE(cubuf_context_new_buffer(cctx, sizes[j], &b));
        T_OK(cubuf_buffer_fill_byte(b, 0x77, NULL));
        T_REQUIRE(cubuf_buffer_slice(host_view, 0, sizes[j], &hv));
        memset(host, 0, sizes[j]);
        T_OK(cubuf_buffer_copy_from(hv, b, NULL, NULL));
        cubuf_buffer_release(b);
        cubuf_buffer_release(hv);
        T_OK(cubuf_context_synchronize(cctx));
        T_CHECK(all_bytes(host, sizes[j], 0x77));
    }

    /* Recording: a default stream given with a foreign context current is
     * bound to the memory's own context. */
    cubuf_buffer_t *b = NULL;
    T_REQUIRE(cubuf_resource_allocate(cases[0].res, 4096, NULL, &b));
    T_CHECK(t_dealloc_ctx(b) == t_cu(cctx));
    T_OK(cubuf_buffer_set_deallocation_stream(b, CU_STREAM_PER_THREAD));
    T_CHECK(t_dealloc_ctx(b) == t_cu(cctx) && t_dealloc_stream(b) == CU_STREAM_PER_THREAD);
    cubuf_buffer_release(b);

    /* Nothing faulted: both contexts still work. */
    CUcontext cur = NULL;
    T_CU(cuCtxGetCurrent, &cur);
    T_CHECK(cur == priv); /* every call restored the caller's context */
    T_CU(cuCtxSynchronize);
    T_OK(cubuf_context_synchronize(cctx));
    T_REQUIRE(cubuf_context_new_buffer(cctx, 4096, &b));
    T_OK(cubuf_buffer_fill_byte(b, 0x42, CU_STREAM_LEGACY));
    cubuf_buffer_t *hv = NULL;
    T_REQUIRE(cubuf_buffer_slice(host_view, 0, 4096, &hv));
    T_OK(cubuf_buffer_copy_from(hv, b, CU_STREAM_LEGACY, NULL));
    T_OK(cubuf_context_synchronize(cctx));
    T_CHECK(all_bytes(host, 4096, 0x42));
    cubuf_buffer_release(hv);
    cubuf_buffer_release(b);

    T_CU(cuCtxDestroy, priv);
    for (size_t k = 0; k < ncases; k++) cubuf_resource_release(cases[k].res);
    cubuf_buffer_release(host_view);
    T_CU(cuMemFreeHost, host);
    cubuf_context_destroy(cctx);
    return t_finish("test_default_stream");
}
