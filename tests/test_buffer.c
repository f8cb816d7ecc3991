/* Buffers: views and their attributes, the three from_handle modes, slices,
 * close / close_on / release, deallocation streams, the warning handler. */
#include <pthread.h>

#include "internal.h"
#include "test.h"

/* ---- a user resource over cuMemAlloc / cuMemFree ---- */

typedef struct user_res {
    CUcontext ctx;         /* frees run in it, whatever thread closes */
    int allocs, deallocs, destroys;
    CUstream last_stream;
    bool fail_dealloc;
} user_res_t;

static cubuf_status_t ur_alloc(void *state, size_t size, CUstream stream, CUdeviceptr *ptr)
{
    user_res_t *u = state;
    if (CU_CALL(cuMemAlloc, ptr, size) != CUDA_SUCCESS) return CUBUF_ERROR_OUT_OF_MEMORY;
    u->allocs++;
    return CUBUF_SUCCESS;
}

static cubuf_status_t ur_dealloc(void *state, CUdeviceptr ptr, size_t size, CUstream stream)
{
    user_res_t *u = state;
    u->deallocs++;
    u->last_stream = stream;
    if (u->fail_dealloc) return CUBUF_ERROR_DRIVER;
    if (cubuf__drv.cuCtxPushCurrent(u->ctx) != CUDA_SUCCESS) return CUBUF_ERROR_DRIVER;
    CUresult r = cubuf__drv.cuMemFree(ptr);
    CUcontext popped;
    cubuf__drv.cuCtxPopCurrent(&popped);
    return r == CUDA_SUCCESS ? CUBUF_SUCCESS : CUBUF_ERROR_DRIVER;
}

static void ur_destroy(void *state) { ((user_res_t *)state)->destroys++; }

static cubuf_resource_t *make_user_res(user_res_t *u, CUcontext ctx, bool device_accessible)
{
    memset(u, 0, sizeof *u);
    u->ctx = ctx;
    u->last_stream = (CUstream)(uintptr_t)0xdead;
    cubuf_resource_ops_t ops = {CUBUF_RESOURCE_OPS_VERSION, ur_alloc, ur_dealloc, ur_destroy};
    cubuf_resource_props_t props = CUBUF_RESOURCE_PROPS_INIT;
    props.device_id = 0;
    props.device_accessible = device_accessible;
    props.host_accessible = !device_accessible;
    cubuf_resource_t *res = NULL;
    T_REQUIRE(cubuf_resource_create(&ops, &props, u, &res));
    return res;
}

static CUdeviceptr dev_alloc(size_t n)
{
    CUdeviceptr p = 0;
    T_CU(cuMemAlloc, &p, n);
    return p;
}

static void check_stats_zero(const cubuf_resource_t *res)
{
    cubuf_resource_stats_t s = CUBUF_RESOURCE_STATS_INIT;
    T_OK(cubuf_resource_stats(res, &s));
    T_CHECK(s.current_bytes == 0 && s.current_count == 0);
}

/* ---- owner release counting ---- */

static int owner_releases;
static void owner_release(void *owner)
{
    T_CHECK(owner == &owner_releases);
    owner_releases++;
}

/* ---- warnings ---- */

static int warnings;
static cubuf_status_t last_warning;
static void on_warning(cubuf_status_t st, const char *message, void *user)
{
    T_CHECK(user == &warnings);
    T_CHECK(message && *message);
    last_warning = st;
    warnings++;
}

/* ---- closing from a thread with no current context ---- */

typedef struct close_job {
    cubuf_buffer_t *buf;
    cubuf_status_t st;
    CUcontext current_before;
} close_job_t;

static void *close_on_thread(void *arg)
{
    close_job_t *j = arg;
    cubuf__drv.cuCtxGetCurrent(&j->current_before);
    j->st = cubuf_buffer_close(j->buf);
    return NULL;
}

static cubuf_status_t close_from_thread(cubuf_buffer_t *buf, CUcontext *seen)
{
    close_job_t j = {buf, CUBUF_ERROR_DRIVER, (CUcontext)(uintptr_t)1};
    pthread_t t;
    T_CHECK(pthread_create(&t, NULL, close_on_thread, &j) == 0);
    pthread_join(t, NULL);
    *seen = j.current_before;
    return j.st;
}

static void test_views(void)
{
    cubuf_buffer_t *b = NULL;

    /* Device memory. */
    CUdeviceptr d = dev_alloc(4096);
    T_REQUIRE(cubuf_buffer_view(d, 4096, &b));
    T_CHECK(cubuf_buffer_ptr(b) == d && cubuf_buffer_size(b) == 4096);
    T_CHECK(cubuf_buffer_device_id(b) == 0);
    T_CHECK(cubuf_buffer_is_device_accessible(b) && !cubuf_buffer_is_host_accessible(b));
    T_CHECK(!cubuf_buffer_is_managed(b) && !cubuf_buffer_is_mapped(b) && !cubuf_buffer_is_closed(b));
    T_CHECK(cubuf_buffer_resource(b) == NULL && cubuf_buffer_owner(b) == NULL);
    T_CHECK(cubuf_buffer_parent(b) == NULL);
    cubuf_buffer_release(b);
    /* A view never frees: the memory is still usable. */
    T_CU(cuMemsetD8, d, 7, 4096);
    T_CU(cuMemFree, d);

    /* Pinned host memory: host and device accessible, bound to no device. */
    void *pinned = NULL;
    T_CU(cuMemHostAlloc, &pinned, 4096, 0);
    T_REQUIRE(cubuf_buffer_view((CUdeviceptr)(uintptr_t)pinned, 4096, &b));
    T_CHECK(cubuf_buffer_device_id(b) == -1);
    T_CHECK(cubuf_buffer_is_device_accessible(b) && cubuf_buffer_is_host_accessible(b));
    T_CHECK(!cubuf_buffer_is_managed(b));
    T_OK(cubuf_buffer_close(b));
    cubuf_buffer_release(b);
    T_CU(cuMemFreeHost, pinned);

    /* Managed memory. */
    CUdeviceptr m = 0;
    T_CU(cuMemAllocManaged, &m, 4096, CU_MEM_ATTACH_GLOBAL);
    T_REQUIRE(cubuf_buffer_view(m, 4096, &b));
    T_CHECK(cubuf_buffer_is_managed(b));
    T_CHECK(cubuf_buffer_is_device_accessible(b) && cubuf_buffer_is_host_accessible(b));
    cubuf_buffer_release(b);
    T_CU(cuMemFree, m);

    /* Pageable memory: host only, no device. */
    char *pageable = malloc(4096);
    T_REQUIRE(cubuf_buffer_view((CUdeviceptr)(uintptr_t)pageable, 4096, &b));
    T_CHECK(cubuf_buffer_device_id(b) == -1);
    T_CHECK(cubuf_buffer_is_host_accessible(b) && !cubuf_buffer_is_device_accessible(b));
    T_CHECK(!cubuf_buffer_is_managed(b));
    cubuf_buffer_release(b);
    free(pageable);

    /* 0/0 is an empty open buffer; pointer 0 with a size is refused. */
    T_REQUIRE(cubuf_buffer_view(0, 0, &b));
    T_CHECK(cubuf_buffer_ptr(b) == 0 && cubuf_buffer_size(b) == 0 && !cubuf_buffer_is_closed(b));
    cubuf_buffer_release(b);
    b = (cubuf_buffer_t *)(uintptr_t)1;
    T_STATUS(cubuf_buffer_view(0, 16, &b), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(b == (cubuf_buffer_t *)(uintptr_t)1); /* untouched on failure */
    T_STATUS(cubuf_buffer_view(0x1000, 16, NULL), CUBUF_ERROR_INVALID_ARGUMENT);

    /* NULL reads as closed. */
    T_CHECK(cubuf_buffer_is_closed(NULL) && cubuf_buffer_ptr(NULL) == 0);
    T_CHECK(cubuf_buffer_device_id(NULL) == -1 && cubuf_buffer_size(NULL) == 0);
    cubuf_buffer_release(NULL);
}

static void test_wrap(CUcontext ctx, CUstream s1, CUstream s2)
{
    user_res_t u;
    cubuf_resource_t *res = make_user_res(&u, ctx, true);
    cubuf_buffer_t *b = NULL;

    /* close: deallocate once, on the recorded stream. */
    T_REQUIRE(cubuf_buffer_wrap(dev_alloc(1000), 1000, res, s1, &b));
    T_CHECK(cubuf_buffer_resource(b) == res && cubuf_buffer_device_id(b) == 0);
    T_CHECK(cubuf_buffer_is_device_accessible(b));
    cubuf_resource_stats_t s = CUBUF_RESOURCE_STATS_INIT;
    T_OK(cubuf_resource_stats(res, &s));
    T_CHECK(s.current_bytes == 1000 && s.current_count == 1);
    T_OK(cubuf_buffer_close(b));
    T_CHECK(u.deallocs == 1 && u.last_stream == s1);
    T_OK(cubuf_buffer_close(b)); /* double close */
    T_CHECK(u.deallocs == 1);
    cubuf_buffer_release(b);
    T_CHECK(u.deallocs == 1);
    check_stats_zero(res);

    /* close_on replaces the stream. */
    T_REQUIRE(cubuf_buffer_wrap(dev_alloc(64), 64, res, s1, &b));
    T_OK(cubuf_buffer_close_on(b, s2));
    T_CHECK(u.deallocs == 2 && u.last_stream == s2);
    cubuf_buffer_release(b);

    /* set_deallocation_stream, then the last release closes on it. */
    T_REQUIRE(cubuf_buffer_wrap(dev_alloc(64), 64, res, s1, &b));
    cubuf_fault_count_calls(true); /* it records, and waits for nothing */
    T_OK(cubuf_buffer_set_deallocation_stream(b, s2));
    T_CHECK(cubuf_fault_calls("cuStreamSynchronize") == 0 && cubuf_fault_calls("cuCtxSynchronize") == 0 &&
            cubuf_fault_calls("cuEventSynchronize") == 0 && cubuf_fault_calls("cuStreamQuery") == 0);
    cubuf_fault_count_calls(false);
    T_CHECK(u.deallocs == 2);
    cubuf_buffer_retain(b);
    cubuf_buffer_release(b);
    T_CHECK(u.deallocs == 2 && !cubuf_buffer_is_closed(b)); /* one reference left */
    cubuf_buffer_release(b);
    T_CHECK(u.deallocs == 3 && u.last_stream == s2);
    check_stats_zero(res);

    /* Bad arguments. */
    T_STATUS(cubuf_buffer_wrap(0, 16, res, s1, &b), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_buffer_wrap(0x1000, 16, NULL, s1, &b), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(u.deallocs == 3);

    cubuf_resource_release(res);
    T_CHECK(u.destroys == 1);
}

static void test_external(void)
{
    cubuf_buffer_t *b = NULL;
    char *host = malloc(256);
    CUdeviceptr p = (CUdeviceptr)(uintptr_t)host;

    /* close, then release: release(owner) exactly once, at close. */
    owner_releases = 0;
    T_REQUIRE(cubuf_buffer_wrap_external(p, 256, &owner_releases, owner_release, &b));
    T_CHECK(cubuf_buffer_owner(b) == &owner_releases && cubuf_buffer_resource(b) == NULL);
    T_OK(cubuf_buffer_close(b));
    T_CHECK(owner_releases == 1);
    T_CHECK(cubuf_buffer_owner(b) == NULL);
    cubuf_buffer_release(b);
    T_CHECK(owner_releases == 1);

    /* release alone. */
    owner_releases = 0;
    T_REQUIRE(cubuf_buffer_wrap_external(p, 256, &owner_releases, owner_release, &b));
    cubuf_buffer_release(b);
    T_CHECK(owner_releases == 1);

    /* A NULL release function is fine; 0/0 works too. */
    T_REQUIRE(cubuf_buffer_wrap_external(0, 0, &owner_releases, NULL, &b));
    T_CHECK(cubuf_buffer_owner(b) == &owner_releases);
    cubuf_buffer_release(b);
    free(host);
}

static void test_slices(CUcontext ctx, CUstream s1)
{
    user_res_t u;
    cubuf_resource_t *res = make_user_res(&u, ctx, true);
    cubuf_buffer_t *parent = NULL, *slice = NULL, *inner = NULL;
    CUdeviceptr p = dev_alloc(1000);
    T_REQUIRE(cubuf_buffer_wrap(p, 1000, res, s1, &parent));

    T_REQUIRE(cubuf_buffer_slice(parent, 100, 200, &slice));
    T_CHECK(cubuf_buffer_ptr(slice) == p + 100 && cubuf_buffer_size(slice) == 200);
    T_CHECK(cubuf_buffer_parent(slice) == parent && cubuf_buffer_device_id(slice) == 0);
    T_CHECK(cubuf_buffer_is_device_accessible(slice));
    T_REQUIRE(cubuf_buffer_slice(slice, 50, 150, &inner)); /* a slice of a slice */
    T_CHECK(cubuf_buffer_ptr(inner) == p + 150 && cubuf_buffer_size(inner) == 150);

    /* Range checks. */
    cubuf_buffer_t *bad = NULL;
    T_STATUS(cubuf_buffer_slice(parent, 1001, 0, &bad), CUBUF_ERROR_OUT_OF_RANGE);
    T_STATUS(cubuf_buffer_slice(parent, 900, 101, &bad), CUBUF_ERROR_OUT_OF_RANGE);
    T_STATUS(cubuf_buffer_slice(parent, 1, SIZE_MAX, &bad), CUBUF_ERROR_OUT_OF_RANGE);
    T_OK(cubuf_buffer_slice(parent, 1000, 0, &bad));
    cubuf_buffer_release(bad);

    /* The parent lives while slices do. */
    cubuf_buffer_release(parent);
    T_CHECK(u.deallocs == 0);
    T_CHECK(!cubuf_buffer_is_closed(slice));
    T_CU(cuMemsetD8, cubuf_buffer_ptr(inner), 1, cubuf_buffer_size(inner)); /* still mapped */
    /* Closing a slice closes only the slice. */
    T_OK(cubuf_buffer_close(slice));
    T_CHECK(cubuf_buffer_is_closed(slice) && !cubuf_buffer_is_closed(inner));
    T_CHECK(u.deallocs == 0);
    cubuf_buffer_release(slice);
    T_CHECK(u.deallocs == 0);
    cubuf_buffer_release(inner);
    T_CHECK(u.deallocs == 1 && u.last_stream == s1);
    check_stats_zero(res);

    /* A slice of a closed buffer is refused; a slice of an external buffer shows its owner. */
    T_REQUIRE(cubuf_buffer_wrap(dev_alloc(64), 64, res, s1, &parent));
    T_OK(cubuf_buffer_close(parent));
    T_STATUS(cubuf_buffer_slice(parent, 0, 0, &bad), CUBUF_ERROR_CLOSED);
    cubuf_buffer_release(parent);
    char host[64];
    T_REQUIRE(cubuf_buffer_wrap_external((CUdeviceptr)(uintptr_t)host, 64, &owner_releases, NULL,
                                         &parent));
    T_REQUIRE(cubuf_buffer_slice(parent, 8, 8, &slice));
    T_CHECK(cubuf_buffer_owner(slice) == &owner_releases);
    cubuf_buffer_release(parent);
    cubuf_buffer_release(slice);
    cubuf_resource_release(res);
}

static void test_closed(CUcontext ctx, CUstream s1)
{
    user_res_t u;
    cubuf_resource_t *res = make_user_res(&u, ctx, true);
    cubuf_buffer_t *b = NULL;
    T_REQUIRE(cubuf_buffer_wrap(dev_alloc(128), 128, res, s1, &b));
    T_OK(cubuf_buffer_close(b));
    T_CHECK(cubuf_buffer_is_closed(b) && cubuf_buffer_ptr(b) == 0 && cubuf_buffer_size(b) == 0);
    T_CHECK(!cubuf_buffer_is_device_accessible(b) && !cubuf_buffer_is_host_accessible(b));
    T_CHECK(cubuf_buffer_resource(b) == NULL);
    T_OK(cubuf_buffer_close(b));
    T_OK(cubuf_buffer_close_on(b, s1));
    T_STATUS(cubuf_buffer_set_deallocation_stream(b, s1), CUBUF_ERROR_CLOSED);
    T_CHECK(u.deallocs == 1);
    cubuf_buffer_release(b);
    T_STATUS(cubuf_buffer_close(NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    cubuf_resource_release(res);
}

static void test_default_stream(cubuf_context_t *cctx, CUcontext ctx)
{
    user_res_t u;
    cubuf_resource_t *res = make_user_res(&u, ctx, true);
    cubuf_buffer_t *b = NULL;
    CUcontext seen = NULL;

    /* Recording stream 0 binds the current context; a thread with no
     * current context can close the buffer. */
    T_REQUIRE(cubuf_buffer_wrap(dev_alloc(256), 256, res, NULL, &b));
    T_CHECK(t_dealloc_ctx(b) == ctx && t_dealloc_stream(b) == NULL);
    T_OK(close_from_thread(b, &seen));
    T_CHECK(seen == NULL);
    T_CHECK(cubuf_buffer_is_closed(b) && u.deallocs == 1 && u.last_stream == NULL);
    cubuf_buffer_release(b);

    /* The same with a context's buffer: its pool frees in the bound context. */
    size_t before = 0, after = 1;
    T_OK(cubuf_context_bytes_allocated(cctx, &before));
    T_REQUIRE(cubuf_context_new_buffer(cctx, 4096, &b));
    T_CHECK(t_dealloc_ctx(b) == ctx);
    T_OK(cubuf_buffer_set_deallocation_stream(b, CU_STREAM_LEGACY));
    T_CHECK(t_dealloc_ctx(b) == ctx && t_dealloc_stream(b) == CU_STREAM_LEGACY);
    T_OK(close_from_thread(b, &seen));
    T_CHECK(cubuf_buffer_is_closed(b));
    T_OK(cubuf_context_bytes_allocated(cctx, &after));
    T_CHECK(after == before);
    cubuf_buffer_release(b);

    /* With nothing current, a device resource without a context cannot
     * record a default stream; a host-only one needs no context at all. */
    cubuf_resource_ops_t ops = {CUBUF_RESOURCE_OPS_VERSION, ur_alloc, ur_dealloc, NULL};
    cubuf_resource_t *nodev = NULL;
    T_REQUIRE(cubuf_resource_create(&ops, NULL, &u, &nodev)); /* device accessible, no device */
    user_res_t hu;
    cubuf_resource_t *hostres = make_user_res(&hu, ctx, false);
    T_CU(cuCtxSetCurrent, NULL);
    CUdeviceptr p = 0x10000; /* never dereferenced: the wrap fails */
    b = (cubuf_buffer_t *)(uintptr_t)1;
    T_CHECK(cubuf_buffer_wrap(p, 64, nodev, NULL, &b) != CUBUF_SUCCESS);
    T_CHECK(b == (cubuf_buffer_t *)(uintptr_t)1);
    check_stats_zero(nodev);
    T_CU(cuCtxSetCurrent, ctx);
    CUdeviceptr hp = dev_alloc(64);
    T_CU(cuCtxSetCurrent, NULL);
    T_REQUIRE(cubuf_buffer_wrap(hp, 64, hostres, NULL, &b));
    T_CHECK(t_dealloc_ctx(b) == NULL);
    T_OK(cubuf_buffer_set_deallocation_stream(b, CU_STREAM_PER_THREAD));
    cubuf_buffer_release(b);
    T_CHECK(hu.deallocs == 1 && hu.last_stream == CU_STREAM_PER_THREAD);
    T_CU(cuCtxSetCurrent, ctx);
    cubuf_resource_release(nodev);
    cubuf_resource_release(hostres);
    cubuf_resource_release(res);
}

static void test_warning(CUcontext ctx, CUstream s1)
{
    user_res_t u;
    cubuf_resource_t *res = make_user_res(&u, ctx, true);
    cubuf_buffer_t *b = NULL;
    warnings = 0;
    cubuf_set_warning_handler(on_warning, &warnings);

    /* A failed close returns the error and leaves the buffer open. */
    CUdeviceptr p = dev_alloc(512);
    T_REQUIRE(cubuf_buffer_wrap(p, 512, res, s1, &b));
    u.fail_dealloc = true;
    T_CHECK(cubuf_buffer_close(b) != CUBUF_SUCCESS);
    T_CHECK(!cubuf_buffer_is_closed(b) && cubuf_buffer_ptr(b) == p && cubuf_buffer_size(b) == 512);
    T_CHECK(warnings == 0);
    u.fail_dealloc = false;
    T_OK(cubuf_buffer_close(b));
    T_CHECK(u.deallocs == 2);
    cubuf_buffer_release(b);
    check_stats_zero(res);

    /* The last release of an open buffer whose deallocate fails warns once. */
    p = dev_alloc(512);
    T_REQUIRE(cubuf_buffer_wrap(p, 512, res, s1, &b));
    u.fail_dealloc = true;
    cubuf_buffer_release(b);
    T_CHECK(warnings == 1 && last_warning != CUBUF_SUCCESS);
    T_CHECK(u.deallocs == 3);
    u.fail_dealloc = false;
    T_CU(cuMemFree, p); /* the memory the failed close could not free */

    /* A successful release does not warn. */
    T_REQUIRE(cubuf_buffer_wrap(dev_alloc(64), 64, res, s1, &b));
    cubuf_buffer_release(b);
    T_CHECK(warnings == 1 && u.deallocs == 4);
    cubuf_set_warning_handler(NULL, NULL);
    cubuf_resource_release(res);
    T_CHECK(u.destroys == 1);
}

int main(void)
{
    t_require_gpu();
    cubuf_context_t *cctx = NULL;
    T_REQUIRE(cubuf_context_create(0, &cctx));
    CUcontext ctx = NULL;
    T_OK(cubuf_context_handle(cctx, &ctx));
    T_CU(cuCtxSetCurrent, ctx);
    CUstream s1 = NULL, s2 = NULL;
    T_CU(cuStreamCreate, &s1, CU_STREAM_NON_BLOCKING);
    T_CU(cuStreamCreate, &s2, CU_STREAM_NON_BLOCKING);

    test_views();
    test_wrap(ctx, s1, s2);
    test_external();
    test_slices(ctx, s1);
    test_closed(ctx, s1);
    test_default_stream(cctx, ctx);
    test_warning(ctx, s1);

    size_t bytes = 1;
    T_OK(cubuf_context_bytes_allocated(cctx, &bytes));
    T_CHECK(bytes == 0);
    T_CU(cuStreamSynchronize, s1);
    T_CU(cuStreamSynchronize, s2);
    T_CU(cuStreamDestroy, s1);
    T_CU(cuStreamDestroy, s2);
    T_CU(cuCtxSetCurrent, NULL);
    cubuf_context_destroy(cctx);
    return t_finish("test_buffer");
}
