/* Devices and contexts (pyarrow.cuda.Context, the non-buffer half). */
#include <stdlib.h>

#include "internal.h"

cubuf_status_t cubuf_device_count(int *count)
{
    CHECK_ARG(count, "cubuf_device_count: count is NULL");
    cubuf_status_t st = cubuf__driver_load();
    if (st == CUBUF_ERROR_NO_DEVICE) {
        *count = 0;
        return CUBUF_SUCCESS;
    }
    if (st != CUBUF_SUCCESS) return st;
    int n = 0;
    st = CU(cuDeviceGetCount, &n);
    if (st == CUBUF_SUCCESS) *count = n;
    return st;
}

/* Validates an ordinal; the message names the valid range. */
static cubuf_status_t check_ordinal(int ordinal, CUdevice *dev)
{
    cubuf_status_t st = cubuf__driver_load();
    if (st != CUBUF_SUCCESS) return st;
    int n = 0;
    if ((st = CU(cuDeviceGetCount, &n)) != CUBUF_SUCCESS) return st;
    if (n == 0) return cubuf__fail(CUBUF_ERROR_NO_DEVICE, "no CUDA device is present");
    if (ordinal < 0 || ordinal >= n)
        return cubuf__fail(CUBUF_ERROR_OUT_OF_RANGE,
                           "device ordinal %d is out of range: valid ordinals are 0 to %d", ordinal,
                           n - 1);
    return CU(cuDeviceGet, dev, ordinal);
}

cubuf_status_t cubuf__device_get(int ordinal, CUdevice *dev) { return check_ordinal(ordinal, dev); }

cubuf_status_t cubuf__device_attr(CUdevice dev, CUdevice_attribute attr, int *value)
{
    *value = 0;
    return CU(cuDeviceGetAttribute, value, attr, dev);
}

cubuf_status_t cubuf__context_for_device(int ordinal, cubuf_context_t **out)
{
    CUdevice dev;
    cubuf_status_t st = check_ordinal(ordinal, &dev);
    if (st != CUBUF_SUCCESS) return st;
    cubuf_context_t *ctx = cubuf__calloc(1, sizeof *ctx);
    if (!ctx) return cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "cannot allocate a context");
    if ((st = CU(cuDevicePrimaryCtxRetain, &ctx->handle, dev)) != CUBUF_SUCCESS) {
        cubuf__detail_append("device %d", ordinal);
        free(ctx);
        return st;
    }
    atomic_init(&ctx->refs, 1);
    ctx->device = dev;
    ctx->ordinal = ordinal;
    ctx->primary = true;
    *out = ctx;
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf_context_create(int ordinal, cubuf_context_t **out)
{
    CHECK_ARG(out, "cubuf_context_create: out is NULL");
    cubuf_status_t st = cubuf__context_for_device(ordinal, out);
    if (st == CUBUF_SUCCESS) atomic_init(&(*out)->users, 1);
    return st;
}

cubuf_status_t cubuf_context_wrap(CUcontext handle, cubuf_context_t **out)
{
    CHECK_ARG(out, "cubuf_context_wrap: out is NULL");
    CHECK_ARG(handle, "cubuf_context_wrap: the CUcontext handle is NULL");
    cubuf_status_t st = cubuf__driver_load();
    if (st != CUBUF_SUCCESS) return st;
    cubuf_ctx_guard_t g;
    if ((st = cubuf__ctx_push(handle, &g)) != CUBUF_SUCCESS) return st;
    CUdevice dev = 0;
    st = CU(cuCtxGetDevice, &dev);
    cubuf__ctx_pop(&g);
    if (st != CUBUF_SUCCESS) return st;
    int n = 0, ordinal = -1;
    if ((st = CU(cuDeviceGetCount, &n)) != CUBUF_SUCCESS) return st;
    for (int i = 0; i < n && ordinal < 0; i++) {
        CUdevice d;
        if ((st = CU(cuDeviceGet, &d, i)) != CUBUF_SUCCESS) return st;
        if (d == dev) ordinal = i;
    }
    if (ordinal < 0) /* its pools would be made for device -1 */
        return cubuf__fail(CUBUF_ERROR_DRIVER,
                           "cubuf_context_wrap: the context's device (%d) is none of the %d "
                           "devices the driver lists", (int)dev, n);
    cubuf_context_t *ctx = cubuf__calloc(1, sizeof *ctx);
    if (!ctx) return cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "cannot allocate a context");
    atomic_init(&ctx->refs, 1);
    atomic_init(&ctx->users, 1);
    ctx->handle = handle;
    ctx->device = dev;
    ctx->ordinal = ordinal;
    ctx->primary = false;
    *out = ctx;
    return CUBUF_SUCCESS;
}

cubuf_context_t *cubuf__context_retain(cubuf_context_t *ctx)
{
    if (ctx) atomic_fetch_add_explicit(&ctx->refs, 1, memory_order_relaxed);
    return ctx;
}

void cubuf__context_release(cubuf_context_t *ctx)
{
    if (!ctx || atomic_fetch_sub_explicit(&ctx->refs, 1, memory_order_acq_rel) != 1) return;
    if (ctx->primary) {
        cubuf_status_t st = CU(cuDevicePrimaryCtxRelease, ctx->device);
        if (st != CUBUF_SUCCESS) cubuf__warn(st, "releasing the primary context: %s", cubuf_last_error());
    }
    free(ctx);
}

/* The context's pools hold it, and the context holds its pools while it has
 * users: the last user's reference drops the pools, which live on while
 * buffers from them are open, and the context with the last of them. */
void cubuf_context_destroy(cubuf_context_t *ctx)
{
    if (!ctx || atomic_fetch_sub_explicit(&ctx->users, 1, memory_order_acq_rel) != 1) return;
    cubuf_resource_release((cubuf_resource_t *)atomic_exchange(&ctx->device_pool, 0));
    cubuf_resource_release((cubuf_resource_t *)atomic_exchange(&ctx->host_pool, 0));
    cubuf__context_release(ctx);
}

cubuf_status_t cubuf_context_device(const cubuf_context_t *ctx, int *ordinal)
{
    CHECK_ARG(ctx && ordinal, "cubuf_context_device: NULL argument");
    *ordinal = ctx->ordinal;
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf_context_handle(const cubuf_context_t *ctx, CUcontext *handle)
{
    CHECK_ARG(ctx && handle, "cubuf_context_handle: NULL argument");
    *handle = ctx->handle;
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf_context_synchronize(cubuf_context_t *ctx)
{
    CHECK_ARG(ctx, "cubuf_context_synchronize: ctx is NULL");
    cubuf_ctx_guard_t g;
    cubuf_status_t st = cubuf__ctx_push(ctx->handle, &g);
    if (st != CUBUF_SUCCESS) return st;
    st = CU(cuCtxSynchronize);
    cubuf__ctx_pop(&g);
    return st;
}

cubuf_status_t cubuf_context_bytes_allocated(const cubuf_context_t *ctx, size_t *bytes)
{
    CHECK_ARG(ctx && bytes, "cubuf_context_bytes_allocated: NULL argument");
    /* Everything counted comes from the context's two pools. */
    size_t total = 0;
    const atomic_uintptr_t *slots[] = {&ctx->device_pool, &ctx->host_pool};
    for (size_t i = 0; i < 2; i++) {
        const cubuf_resource_t *res = (const cubuf_resource_t *)atomic_load(slots[i]);
        cubuf_resource_stats_t s = {.struct_size = CUBUF_RESOURCE_STATS_SIZE_V1}; /* no driver query */
        if (res && cubuf_resource_stats(res, &s) == CUBUF_SUCCESS) total += s.current_bytes;
    }
    *bytes = total;
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf__ctx_push_nonnull(CUcontext ctx, cubuf_ctx_guard_t *guard)
{
    CUcontext cur = NULL;
    cubuf_status_t st = CU(cuCtxGetCurrent, &cur);
    if (st != CUBUF_SUCCESS) return st;
    if (cur == ctx) return CUBUF_SUCCESS;
    if ((st = CU(cuCtxPushCurrent, ctx)) != CUBUF_SUCCESS) return st;
    guard->pushed = true;
    return CUBUF_SUCCESS;
}

void cubuf__ctx_pop_pushed(cubuf_ctx_guard_t *guard)
{
    CUcontext popped = NULL;
    /* Restoring the caller's context bypasses fault injection: popping what
     * was pushed cannot fail short of a broken driver, and an injected
     * failure here would only test this warning. */
    CUresult r = cubuf__drv.cuCtxPopCurrent(&popped);
    if (r != CUDA_SUCCESS) cubuf__warn(cubuf__cu_map(r), "cuCtxPopCurrent failed (CUresult %d)", (int)r);
    guard->pushed = false;
}
