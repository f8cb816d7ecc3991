/* Resources over the synchronous allocators: managed memory, legacy pinned
 * host memory and plain device memory (cuMemAlloc). Their frees are not
 * stream ordered, so deallocation first synchronizes the deallocation stream. */
#include <stdint.h>

#include "internal.h"
#include "ipc.h"

/* ---- shared --------------------------------------------------------------- */

/* The free of all three: synchronize the recorded stream (refused while it
 * captures, see cubuf__stream_sync_for_free), then `free_fn` inside the
 * resource's context (the last release may come from a thread with no
 * current context). */
static cubuf_status_t sync_free(cubuf_resource_t *res, cubuf_buffer_t *buf,
                                const cubuf_stream_token_t *token,
                                cubuf_status_t (*free_fn)(CUdeviceptr))
{
    cubuf_status_t st = cubuf__stream_sync_for_free(token, res->vt->name);
    if (st != CUBUF_SUCCESS) return st;
    cubuf_ctx_guard_t g;
    if ((st = cubuf__ctx_push(res->ctx->handle, &g)) != CUBUF_SUCCESS) return st;
    if ((st = free_fn(buf->ptr)) != CUBUF_SUCCESS)
        cubuf__detail_append("pointer 0x%llx, size %zu", (unsigned long long)buf->ptr, buf->size);
    cubuf__ctx_pop(&g);
    return st;
}

static cubuf_status_t free_device(CUdeviceptr p) { return CU(cuMemFree, p); }
static cubuf_status_t free_host(CUdeviceptr p) { return CU(cuMemFreeHost, (void *)(uintptr_t)p); }

static cubuf_status_t device_free(cubuf_resource_t *res, cubuf_buffer_t *buf,
                                  const cubuf_stream_token_t *token, cubuf_charge_t *charge)
{
    (void)charge;
    return sync_free(res, buf, token, free_device);
}

static cubuf_status_t host_free(cubuf_resource_t *res, cubuf_buffer_t *buf,
                                const cubuf_stream_token_t *token, cubuf_charge_t *charge)
{
    (void)charge;
    return sync_free(res, buf, token, free_host);
}

static cubuf_status_t new_resource(const cubuf_resource_vtbl_t *vt, cubuf_context_t *ctx, const cubuf_resource_props_t *props,
                                   cubuf_resource_t **out)
{
    cubuf_resource_t *res = NULL;
    cubuf_status_t st = cubuf__resource_new(vt, ctx, 0, &res);
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

static cubuf_status_t managed_allocate(cubuf_resource_t *res, cubuf_buffer_t *buf, CUstream stream,
                                       bool in_ctx, cubuf_charge_t *charge)
{
    (void)in_ctx; /* the push below checks */
    (void)charge;
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

static const cubuf_resource_vtbl_t managed_vtbl = {
    .name = "managed",
    .allocate = managed_allocate,
    .deallocate = device_free,
};

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
    CHECK(new_resource(&managed_vtbl, ctx, &props, out));
    (*out)->impl = (void *)(intptr_t)preferred_location;
    return CUBUF_SUCCESS;
fail:
    cubuf__context_release(ctx);
    return st;
}

/* ---- legacy pinned host memory and synchronous device memory ---------------------- */

/* Both allocate in the resource's context, not the stream's, and order
 * nothing: they are synchronous. */
static cubuf_status_t alloc_host(size_t size, CUdeviceptr *p)
{
    /* With unified addressing the host pointer is also the device address. */
    void *h = NULL;
    cubuf_status_t st = CU(cuMemHostAlloc, &h, size, CU_MEMHOSTALLOC_PORTABLE);
    *p = (CUdeviceptr)(uintptr_t)h;
    return st;
}
static cubuf_status_t alloc_device(size_t size, CUdeviceptr *p) { return CU(cuMemAlloc, p, size); }

static cubuf_status_t sync_allocate(cubuf_resource_t *res, cubuf_buffer_t *buf,
                                    cubuf_status_t (*alloc_fn)(size_t, CUdeviceptr *))
{
    cubuf_ctx_guard_t g;
    cubuf_status_t st = cubuf__ctx_push(res->ctx->handle, &g);
    if (st != CUBUF_SUCCESS) return st;
    CUdeviceptr p = 0;
    if ((st = alloc_fn(buf->size, &p)) == CUBUF_SUCCESS) buf->ptr = p;
    else cubuf__detail_append("size %zu", buf->size);
    cubuf__ctx_pop(&g);
    return st;
}

static cubuf_status_t host_allocate(cubuf_resource_t *res, cubuf_buffer_t *buf, CUstream stream,
                                    bool in_ctx, cubuf_charge_t *charge)
{
    (void)stream, (void)in_ctx, (void)charge;
    return sync_allocate(res, buf, alloc_host);
}

static cubuf_status_t device_allocate(cubuf_resource_t *res, cubuf_buffer_t *buf, CUstream stream,
                                      bool in_ctx, cubuf_charge_t *charge)
{
    (void)stream, (void)in_ctx, (void)charge;
    return sync_allocate(res, buf, alloc_device);
}

static const cubuf_resource_vtbl_t legacy_pinned_vtbl = {
    .name = "legacy pinned",
    .allocate = host_allocate,
    .deallocate = host_free,
};
static const cubuf_resource_vtbl_t sync_device_vtbl = {
    .name = "synchronous device",
    .allocate = device_allocate,
    .deallocate = device_free,
    .export_ipc = cubuf__ipc_export_legacy,
};

/* Legacy pinned memory is host memory of no device; the other is device memory. */
static cubuf_status_t sync_create(int ordinal, const cubuf_resource_vtbl_t *vt, cubuf_resource_t **out)
{
    cubuf_context_t *ctx = NULL;
    cubuf_status_t st = cubuf__context_for_device(ordinal, &ctx);
    if (st != CUBUF_SUCCESS) return st;
    bool host = vt == &legacy_pinned_vtbl;
    cubuf_resource_props_t props = CUBUF_RESOURCE_PROPS_INIT;
    props.device_id = host ? -1 : ordinal;
    props.device_accessible = true;
    props.host_accessible = host;
    if ((st = new_resource(vt, ctx, &props, out)) != CUBUF_SUCCESS) cubuf__context_release(ctx);
    return st;
}

cubuf_status_t cubuf_legacy_pinned_resource_create(int ordinal, cubuf_resource_t **out)
{
    CHECK_ARG(out, "cubuf_legacy_pinned_resource_create: out is NULL");
    return sync_create(ordinal, &legacy_pinned_vtbl, out);
}

cubuf_status_t cubuf_sync_device_resource_create(int ordinal, cubuf_resource_t **out)
{
    CHECK_ARG(out, "cubuf_sync_device_resource_create: out is NULL");
    return sync_create(ordinal, &sync_device_vtbl, out);
}
