/* Resources over the synchronous allocators: managed memory, legacy pinned
 * host memory and plain device memory (cuMemAlloc). Their frees are not
 * stream ordered, so deallocation first synchronizes the deallocation stream. */
#include <stdint.h>

#include "internal.h"

/* ---- shared --------------------------------------------------------------- */

/* Closing synchronizes the recorded stream. Synchronizing a capturing stream
 * (or the legacy stream another stream's capture depends on) would
 * invalidate that capture, so it is refused first and the buffer stays open. */
static cubuf_status_t sync_before_free(const cubuf_stream_token_t *token, const char *kind)
{
    CUstreamCaptureStatus cs = CU_STREAM_CAPTURE_STATUS_NONE;
    cubuf_status_t st = cubuf__stream_capture_status(token->stream, token->ctx, &cs);
    if (st != CUBUF_SUCCESS) return st;
    if (cs != CU_STREAM_CAPTURE_STATUS_NONE)
        return cubuf__fail(CUBUF_ERROR_STREAM_CAPTURING,
                           "closing a %s buffer synchronizes its deallocation stream, which is "
                           "capturing (or a capture depends on it); the buffer stays open (close "
                           "it on a stream that is not capturing)",
                           kind);
    return cubuf__stream_sync(token);
}

/* Runs the synchronous free inside the resource's context (the last release
 * may come from a thread with no current context). */
typedef enum free_kind { FREE_DEVICE, FREE_HOST } free_kind_t;

static cubuf_status_t free_in_ctx(const cubuf_resource_t *res, const cubuf_buffer_t *buf,
                                  free_kind_t kind)
{
    cubuf_ctx_guard_t g;
    cubuf_status_t st = cubuf__ctx_push(res->ctx->handle, &g);
    if (st != CUBUF_SUCCESS) return st;
    if (kind == FREE_HOST) st = CU(cuMemFreeHost, (void *)(uintptr_t)buf->ptr);
    else st = CU(cuMemFree, buf->ptr);
    if (st != CUBUF_SUCCESS)
        cubuf__detail_append("pointer 0x%llx, size %zu", (unsigned long long)buf->ptr, buf->size);
    cubuf__ctx_pop(&g);
    return st;
}

static cubuf_status_t new_resource(const cubuf_resource_vtbl_t *vt, cubuf_resource_kind_t kind,
                                   cubuf_context_t *ctx, const cubuf_resource_props_t *props,
                                   cubuf_resource_t **out)
{
    cubuf_resource_t *res = NULL;
    cubuf_status_t st = cubuf__resource_new(vt, kind, ctx, &res);
    if (st != CUBUF_SUCCESS) return st;
    res->props = *props;
    *out = res;
    return CUBUF_SUCCESS;
}

/* ---- managed memory ----------------------------------------------------------- */

/* The preferred location lives in res->impl as an integer: -2 none, -1 host,
 * else a device ordinal. */
static int preferred_of(const cubuf_resource_t *res) { return (int)(intptr_t)res->impl; }

static CUmemLocation location_of(int preferred)
{
    CUmemLocation loc;
    loc.type = preferred >= 0 ? CU_MEM_LOCATION_TYPE_DEVICE : CU_MEM_LOCATION_TYPE_HOST;
    loc.id = preferred >= 0 ? preferred : 0;
    return loc;
}

static cubuf_status_t managed_allocate(cubuf_resource_t *res, cubuf_buffer_t *buf, CUstream stream)
{
    int preferred = preferred_of(res);
    CUmemLocation loc = location_of(preferred);
    /* A default stream runs in the context its token bound it to; otherwise
     * the allocation needs some context: the resource's. */
    CUcontext c = buf->dealloc.ctx ? buf->dealloc.ctx : res->ctx->handle;
    cubuf_ctx_guard_t g;
    CUdeviceptr p = 0;
    cubuf_status_t st = cubuf__ctx_push(c, &g);
    if (st != CUBUF_SUCCESS) return st;
    /* cuMemAllocManaged is not allowed during capture, and the prefetch would
     * land in the graph: refuse before anything happens. */
    CHECK(cubuf__stream_refuse_capture(stream, NULL, "managed resource: allocate"));
    if ((st = CU(cuMemAllocManaged, &p, buf->size, CU_MEM_ATTACH_GLOBAL)) != CUBUF_SUCCESS) {
        cubuf__detail_append("size %zu", buf->size);
        p = 0;
        goto fail;
    }
    if (preferred >= -1) {
        if ((st = CU(cuMemAdvise, p, buf->size, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, loc)) !=
            CUBUF_SUCCESS) {
            cubuf__detail_append("preferred location %d, size %zu", preferred, buf->size);
            goto fail;
        }
    }
    if (preferred >= 0) {
        if ((st = CU(cuMemPrefetchAsync, p, buf->size, loc, 0, stream)) != CUBUF_SUCCESS) {
            cubuf__detail_append("to device %d, size %zu", preferred, buf->size);
            goto fail;
        }
    }
    buf->ptr = p;
    cubuf__ctx_pop(&g);
    return CUBUF_SUCCESS;
fail:
    if (p) {
        CUresult r = CU_CALL(cuMemFree, p);
        if (r != CUDA_SUCCESS)
            cubuf__warn(cubuf__cu_map(r), "cuMemFree failed (CUresult %d) while unwinding", (int)r);
    }
    cubuf__ctx_pop(&g);
    return st;
}

static cubuf_status_t managed_deallocate(cubuf_resource_t *res, cubuf_buffer_t *buf,
                                         const cubuf_stream_token_t *token)
{
    cubuf_status_t st = sync_before_free(token, "managed");
    if (st != CUBUF_SUCCESS) return st;
    return free_in_ctx(res, buf, FREE_DEVICE);
}

static const cubuf_resource_vtbl_t managed_vtbl = {managed_allocate, managed_deallocate, NULL, false};

cubuf_status_t cubuf_managed_resource_create(int ordinal, int preferred_location,
                                             cubuf_resource_t **out)
{
    CHECK_ARG(out, "cubuf_managed_resource_create: out is NULL");
    if (preferred_location < -2)
        return cubuf__fail(CUBUF_ERROR_OUT_OF_RANGE,
                           "cubuf_managed_resource_create: preferred_location %d is out of range: "
                           "-2 (none), -1 (host) or a device ordinal",
                           preferred_location);
    cubuf_context_t *ctx = NULL;
    cubuf_status_t st = cubuf__context_for_device(ordinal, &ctx);
    if (st != CUBUF_SUCCESS) return st;
    int n = 0, v = 0;
    CHECK(CU(cuDeviceGetCount, &n));
    if (preferred_location >= n) {
        st = cubuf__fail(CUBUF_ERROR_OUT_OF_RANGE,
                         "cubuf_managed_resource_create: preferred_location %d is out of range: "
                         "-2 (none), -1 (host) or a device ordinal 0 to %d",
                         preferred_location, n - 1);
        goto fail;
    }
    CHECK(cubuf__device_attr(ctx->device, CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY, &v));
    if (!v) {
        st = cubuf__fail(CUBUF_ERROR_NOT_SUPPORTED, "device %d does not support managed memory",
                         ordinal);
        goto fail;
    }
    if (preferred_location >= 0) {
        /* Advising or prefetching to a device needs concurrent managed access there. */
        CUdevice pref;
        CHECK(cubuf__device_get(preferred_location, &pref));
        CHECK(cubuf__device_attr(pref, CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS, &v));
        if (!v) {
            st = cubuf__fail(CUBUF_ERROR_NOT_SUPPORTED,
                             "device %d has no concurrent managed access: it cannot be a "
                             "preferred location",
                             preferred_location);
            goto fail;
        }
    }
    cubuf_resource_props_t props = CUBUF_RESOURCE_PROPS_INIT;
    props.device_id = ordinal;
    props.device_accessible = true;
    props.host_accessible = true;
    props.managed = true;
    CHECK(new_resource(&managed_vtbl, CUBUF_RES_MANAGED, ctx, &props, out));
    (*out)->impl = (void *)(intptr_t)preferred_location;
    return CUBUF_SUCCESS;
fail:
    cubuf__context_release(ctx);
    return st;
}

/* ---- legacy pinned host memory ---------------------------------------------------- */

static cubuf_status_t legacy_pinned_allocate(cubuf_resource_t *res, cubuf_buffer_t *buf,
                                             CUstream stream)
{
    cubuf_ctx_guard_t g;
    cubuf_status_t st = cubuf__ctx_push(res->ctx->handle, &g);
    if (st != CUBUF_SUCCESS) return st;
    void *h = NULL;
    /* With unified addressing the host pointer is also the device address. */
    st = CU(cuMemHostAlloc, &h, buf->size, CU_MEMHOSTALLOC_PORTABLE);
    if (st == CUBUF_SUCCESS) buf->ptr = (CUdeviceptr)(uintptr_t)h;
    else cubuf__detail_append("size %zu", buf->size);
    cubuf__ctx_pop(&g);
    return st;
}

static cubuf_status_t legacy_pinned_deallocate(cubuf_resource_t *res, cubuf_buffer_t *buf,
                                               const cubuf_stream_token_t *token)
{
    cubuf_status_t st = sync_before_free(token, "legacy pinned");
    if (st != CUBUF_SUCCESS) return st;
    return free_in_ctx(res, buf, FREE_HOST);
}

static const cubuf_resource_vtbl_t legacy_pinned_vtbl = {legacy_pinned_allocate,
                                                         legacy_pinned_deallocate, NULL, false};

cubuf_status_t cubuf_legacy_pinned_resource_create(int ordinal, cubuf_resource_t **out)
{
    CHECK_ARG(out, "cubuf_legacy_pinned_resource_create: out is NULL");
    cubuf_context_t *ctx = NULL;
    cubuf_status_t st = cubuf__context_for_device(ordinal, &ctx);
    if (st != CUBUF_SUCCESS) return st;
    cubuf_resource_props_t props = CUBUF_RESOURCE_PROPS_INIT;
    props.device_id = -1;
    props.device_accessible = true;
    props.host_accessible = true;
    if ((st = new_resource(&legacy_pinned_vtbl, CUBUF_RES_LEGACY_PINNED, ctx, &props, out)) !=
        CUBUF_SUCCESS)
        cubuf__context_release(ctx);
    return st;
}

/* ---- synchronous device memory ------------------------------------------------------ */

static cubuf_status_t sync_device_allocate(cubuf_resource_t *res, cubuf_buffer_t *buf,
                                           CUstream stream)
{
    cubuf_ctx_guard_t g;
    cubuf_status_t st = cubuf__ctx_push(res->ctx->handle, &g);
    if (st != CUBUF_SUCCESS) return st;
    CUdeviceptr p = 0;
    st = CU(cuMemAlloc, &p, buf->size);
    if (st == CUBUF_SUCCESS) buf->ptr = p;
    else cubuf__detail_append("size %zu", buf->size);
    cubuf__ctx_pop(&g);
    return st;
}

static cubuf_status_t sync_device_deallocate(cubuf_resource_t *res, cubuf_buffer_t *buf,
                                             const cubuf_stream_token_t *token)
{
    cubuf_status_t st = sync_before_free(token, "synchronous device");
    if (st != CUBUF_SUCCESS) return st;
    return free_in_ctx(res, buf, FREE_DEVICE);
}

static const cubuf_resource_vtbl_t sync_device_vtbl = {sync_device_allocate, sync_device_deallocate,
                                                       NULL, false};

cubuf_status_t cubuf_sync_device_resource_create(int ordinal, cubuf_resource_t **out)
{
    CHECK_ARG(out, "cubuf_sync_device_resource_create: out is NULL");
    cubuf_context_t *ctx = NULL;
    cubuf_status_t st = cubuf__context_for_device(ordinal, &ctx);
    if (st != CUBUF_SUCCESS) return st;
    cubuf_resource_props_t props = CUBUF_RESOURCE_PROPS_INIT;
    props.device_id = ordinal;
    props.device_accessible = true;
    if ((st = new_resource(&sync_device_vtbl, CUBUF_RES_SYNC_DEVICE, ctx, &props, out)) !=
        CUBUF_SUCCESS)
        cubuf__context_release(ctx);
    return st;
}
