/* Stream-ordered pool resources: the device pool (the device's default pool
 * or a private one), the pinned host pool, and the graph resource, which
 * allocates inside stream capture (graph memory nodes). */
#include <stdint.h>
#include <string.h>

#include "abi.h"
#include "ipc.h"
#include "resource_pool.h"

/* res->impl holds the CUmemoryPool itself: the hot path reads it with no
 * indirection and no allocation beyond the buffer object. Whether the pool
 * is owned (destroyed with the resource) is told by the vtbl. */
static CUmemoryPool pool_of(const cubuf_resource_t *res) { return (CUmemoryPool)res->impl; }

CUmemoryPool cubuf__pool_handle(const cubuf_resource_t *res)
{
    return res && res->vt->pool ? res->vt->pool(res) : NULL;
}

static const cubuf_resource_vtbl_t default_pool_vtbl, owned_pool_vtbl;

/* A device pool (the device's default pool or a private one), as opposed to the pinned pool. */
static bool is_device_pool(const cubuf_resource_t *res)
{
    return res->vt == &default_pool_vtbl || res->vt == &owned_pool_vtbl;
}

/* ---- allocate / deallocate ------------------------------------------------ */

/* A default stream is the one the deallocation token bound it to: the
 * resource's context's (cubuf.h, "Default streams"). The allocation runs on
 * that same stream, so the allocation, the work the caller orders on
 * "stream 0" and the eventual free share one stream. When that context is
 * already current (in_ctx), nothing is pushed; user streams need no context
 * at all. */
static cubuf_status_t push_for_stream(const cubuf_buffer_t *buf, bool in_ctx, cubuf_ctx_guard_t *g)
{
    if (in_ctx) {
        g->pushed = false;
        return CUBUF_SUCCESS;
    }
    return cubuf__ctx_push(buf->dealloc.ctx, g);
}

/* The refusal of an allocation on a capturing stream (kept out of the hot
 * path). The legacy stream's CUDA_ERROR_STREAM_CAPTURE_IMPLICIT means a
 * capture on another stream depends on it: allocating there would break
 * that capture, so it is refused like a capture of its own. */
static __attribute__((cold)) cubuf_status_t refuse_allocation(CUresult r, CUstreamCaptureStatus cs)
{
    if (r != CUDA_SUCCESS && r != CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)
        return cubuf__cu_status(r, "cuStreamIsCapturing");
    return cubuf__fail(CUBUF_ERROR_STREAM_CAPTURING,
                       "cubuf_resource_allocate: the stream is capturing%s; a pool resource "
                       "cannot allocate during capture (use cubuf_graph_resource_create)",
                       r == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
                           ? " (a capture on another stream depends on the legacy stream)"
                       : cs == CU_STREAM_CAPTURE_STATUS_INVALIDATED ? " (capture invalidated)"
                                                                     : "");
}

/*
 * The hot path: one capture query, then cuMemAllocFromPoolAsync.
 *
 * Why query first: on a capturing stream cuMemAllocFromPoolAsync does not
 * fail, it adds an allocation node owned by the graph; that cannot be taken
 * back, so the refusal must come before the call. Why cuStreamIsCapturing
 * and nothing cheaper: capture can begin on any thread at any moment, so a
 * flag cached by cubuf would be stale, and the driver holds the only true
 * answer. The query reads the stream's capture state on the host (no device
 * work, no synchronization). It is made here directly, not through
 * cubuf__stream_capture_status: the context is already pushed, and the
 * success path then costs no call beyond the two driver calls; the
 * bookkeeping around it is a recycled buffer object and the resource's
 * lock (resource.c).
 */
static inline cubuf_status_t pool_alloc_on(cubuf_resource_t *res, size_t size, CUstream stream,
                                           CUdeviceptr *p)
{
    CUstreamCaptureStatus cs = CU_STREAM_CAPTURE_STATUS_NONE;
    CUresult r = CU_CALL(cuStreamIsCapturing, stream, &cs);
    if (__builtin_expect(r != CUDA_SUCCESS || cs != CU_STREAM_CAPTURE_STATUS_NONE, 0))
        return refuse_allocation(r, cs);
    r = CU_CALL(cuMemAllocFromPoolAsync, p, size, pool_of(res), stream);
    if (__builtin_expect(r != CUDA_SUCCESS, 0)) {
        cubuf_status_t st = cubuf__cu_status(r, "cuMemAllocFromPoolAsync");
        cubuf__detail_append("size %zu", size);
        return st;
    }
    return CUBUF_SUCCESS;
}

/* The one allocation path's pool step (resource.c binds the stream). */
static cubuf_status_t pool_allocate(cubuf_resource_t *res, cubuf_buffer_t *buf, CUstream stream,
                                    bool in_ctx, cubuf_charge_t *charge)
{
    (void)charge; /* the pool gives what was asked */
    cubuf_ctx_guard_t g;
    cubuf_status_t st = push_for_stream(buf, in_ctx, &g);
    if (__builtin_expect(st != CUBUF_SUCCESS, 0)) return st;
    CUdeviceptr p = 0;
    if (__builtin_expect((st = pool_alloc_on(res, buf->size, stream, &p)) == CUBUF_SUCCESS, 1))
        buf->ptr = p;
    cubuf__ctx_pop(&g);
    return st;
}

/* A failed free leaves the buffer open. The common reason is a capturing
 * stream (a free node may only free a graph allocation): that is only asked
 * after the fact, so the successful path pays no second query. */
static cubuf_status_t free_failed(CUresult r, const cubuf_buffer_t *buf, CUstream stream)
{
    CUstreamCaptureStatus cs = CU_STREAM_CAPTURE_STATUS_NONE;
    if (cubuf__stream_capture_status(stream, NULL, &cs) == CUBUF_SUCCESS &&
        cs != CU_STREAM_CAPTURE_STATUS_NONE)
        return cubuf__fail(CUBUF_ERROR_STREAM_CAPTURING,
                           "cuMemFreeAsync refused: the deallocation stream is capturing and pool "
                           "memory cannot be freed inside a graph; the buffer stays open (close it "
                           "on a stream that is not capturing)");
    cubuf_status_t st = cubuf__cu_status(r, "cuMemFreeAsync");
    cubuf__detail_append("pointer 0x%llx, size %zu", (unsigned long long)buf->ptr, buf->size);
    return st;
}

static cubuf_status_t pool_deallocate(cubuf_resource_t *res, cubuf_buffer_t *buf,
                                      const cubuf_stream_token_t *token, cubuf_charge_t *charge)
{
    (void)res;
    (void)charge;
    cubuf_ctx_guard_t g = {false};
    cubuf_status_t st;
    if ((st = cubuf__ctx_push(token->ctx, &g)) != CUBUF_SUCCESS) return st;
    CUresult r = CU_CALL(cuMemFreeAsync, buf->ptr, token->stream);
    st = r == CUDA_SUCCESS ? CUBUF_SUCCESS : free_failed(r, buf, token->stream);
    cubuf__ctx_pop(&g);
    return st;
}

static void owned_pool_destroy(cubuf_resource_t *res)
{
    /* Buffers hold their resource, so every allocation has been freed (or
     * its free is pending, which cuMemPoolDestroy handles). The last release
     * may come from a thread with no context: run in the device's. */
    cubuf_ctx_guard_t g;
    cubuf_status_t st = cubuf__ctx_push(res->ctx->handle, &g);
    CUresult r = CU_CALL(cuMemPoolDestroy, pool_of(res));
    if (st == CUBUF_SUCCESS) cubuf__ctx_pop(&g);
    if (r != CUDA_SUCCESS)
        cubuf__warn(cubuf__cu_map(r), "cuMemPoolDestroy failed (CUresult %d): the pool leaks", (int)r);
}

static const cubuf_resource_vtbl_t default_pool_vtbl = {
    .name = "device pool",
    .allocate = pool_allocate,
    .deallocate = pool_deallocate,
    .export_ipc = cubuf__ipc_export_pool,
    .pool = pool_of,
};
static const cubuf_resource_vtbl_t owned_pool_vtbl = {
    .name = "device pool",
    .allocate = pool_allocate,
    .deallocate = pool_deallocate,
    .destroy = owned_pool_destroy,
    .export_ipc = cubuf__ipc_export_pool,
    .pool = pool_of,
};
static const cubuf_resource_vtbl_t pinned_pool_vtbl = {
    .name = "pinned pool",
    .allocate = pool_allocate,
    .deallocate = pool_deallocate,
    .destroy = owned_pool_destroy,
    .export_ipc = cubuf__ipc_export_pool,
    .pool = pool_of,
};

/* ---- graph resource --------------------------------------------------------- */

static cubuf_status_t graph_allocate(cubuf_resource_t *res, cubuf_buffer_t *buf, CUstream stream,
                                     bool in_ctx, cubuf_charge_t *charge)
{
    (void)charge;
    cubuf_ctx_guard_t g;
    cubuf_status_t st = push_for_stream(buf, in_ctx, &g);
    if (st != CUBUF_SUCCESS) return st;
    /* The raw query: the legacy stream's "implicit" answer means another
     * stream captures, not this one, and allocating here would break that
     * capture. */
    CUstreamCaptureStatus cs = CU_STREAM_CAPTURE_STATUS_NONE;
    CUresult r = CU_CALL(cuStreamIsCapturing, stream, &cs);
    if (r == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) {
        st = cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,
                         "graph resource: the legacy default stream is not capturing (another "
                         "stream's capture depends on it); allocate on the capturing stream");
    } else if (r != CUDA_SUCCESS) {
        st = cubuf__cu_status(r, "cuStreamIsCapturing");
    } else if (cs == CU_STREAM_CAPTURE_STATUS_NONE) {
        st = cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,
                         "graph resource: the stream is not capturing; the graph resource only "
                         "allocates inside stream capture (outside capture use a pool resource, "
                         "cubuf_device_resource_create)");
    } else if (cs != CU_STREAM_CAPTURE_STATUS_ACTIVE) {
        st = cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,
                         "graph resource: the stream's capture was invalidated");
    } else {
        /* During capture this adds an allocation node; the pool's properties
         * (the device's default pool) set the node's parameters. */
        CUdeviceptr p = 0;
        st = CU(cuMemAllocFromPoolAsync, &p, buf->size, pool_of(res), stream);
        if (st == CUBUF_SUCCESS) buf->ptr = p;
        else cubuf__detail_append("size %zu", buf->size);
    }
    cubuf__ctx_pop(&g);
    return st;
}

/* On a capturing stream cuMemFreeAsync adds a free node; on any other it
 * frees the graph allocation in stream order. */
static cubuf_status_t graph_deallocate(cubuf_resource_t *res, cubuf_buffer_t *buf,
                                       const cubuf_stream_token_t *token, cubuf_charge_t *charge)
{
    (void)res;
    (void)charge;
    cubuf_ctx_guard_t g = {false};
    cubuf_status_t st;
    if ((st = cubuf__ctx_push(token->ctx, &g)) != CUBUF_SUCCESS) return st;
    st = CU(cuMemFreeAsync, buf->ptr, token->stream);
    if (st != CUBUF_SUCCESS)
        cubuf__detail_append("pointer 0x%llx, size %zu", (unsigned long long)buf->ptr, buf->size);
    cubuf__ctx_pop(&g);
    return st;
}

static const cubuf_resource_vtbl_t graph_vtbl = {
    .name = "graph",
    .no_export = "graph memory exists only while its graph runs",
    .allocate = graph_allocate,
    .deallocate = graph_deallocate,
};

/* ---- creation ---------------------------------------------------------------- */

static cubuf_status_t require_pools(const cubuf_context_t *ctx)
{
    int v;
    cubuf_status_t st = cubuf__device_attr(ctx->device, CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, &v);
    if (st != CUBUF_SUCCESS) return st;
    if (!v)
        return cubuf__fail(CUBUF_ERROR_NOT_SUPPORTED,
                           "device %d does not support stream-ordered memory pools", ctx->ordinal);
    return CUBUF_SUCCESS;
}

static cubuf_status_t require_posix_fd_pools(const cubuf_context_t *ctx)
{
    int v;
    cubuf_status_t st = cubuf__device_attr(ctx->device, CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES, &v);
    if (st != CUBUF_SUCCESS) return st;
    if (!(v & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
        return cubuf__fail(CUBUF_ERROR_NOT_SUPPORTED,
                           "device %d cannot export memory pools as POSIX file descriptors "
                           "(supported handle types 0x%x): IPC is not available",
                           ctx->ordinal, (unsigned)v);
    return CUBUF_SUCCESS;
}

static cubuf_status_t set_threshold(CUmemoryPool pool, cuuint64_t value)
{
    cubuf_status_t st = CU(cuMemPoolSetAttribute, pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &value);
    if (st != CUBUF_SUCCESS) cubuf__detail_append("release threshold %llu", (unsigned long long)value);
    return st;
}

static void destroy_pool(CUmemoryPool pool)
{
    CUresult r = CU_CALL(cuMemPoolDestroy, pool);
    if (r != CUDA_SUCCESS)
        cubuf__warn(cubuf__cu_map(r), "cuMemPoolDestroy failed (CUresult %d) while unwinding", (int)r);
}

/* cuMemPoolCreate, then the release threshold; the pool is destroyed again
 * if the threshold cannot be set. */
static cubuf_status_t create_pool(const CUmemPoolProps *props, cuuint64_t threshold,
                                  CUmemoryPool *out)
{
    CUmemoryPool pool = NULL;
    cubuf_status_t st = CU(cuMemPoolCreate, &pool, props);
    if (st != CUBUF_SUCCESS) {
        cubuf__detail_append("location type %d id %d, max size %zu, handle types 0x%x",
                             (int)props->location.type, props->location.id, props->maxSize,
                             (unsigned)props->handleTypes);
        return st;
    }
    if ((st = set_threshold(pool, threshold)) != CUBUF_SUCCESS) {
        destroy_pool(pool);
        return st;
    }
    *out = pool;
    return CUBUF_SUCCESS;
}

/* A private pool that asks for fabric handles (with POSIX fds or not): made
 * with them where the driver grants them, else with POSIX fds alone
 * (*fell_back): the driver refuses fabric without an IMEX channel
 * (CUDA_ERROR_NOT_PERMITTED) or support (CUDA_ERROR_NOT_SUPPORTED). */
static cubuf_status_t create_fabric_pool(const cubuf_context_t *ctx, CUmemPoolProps *pp,
                                         cuuint64_t threshold, CUmemoryPool *out, bool *fell_back)
{
    pp->handleTypes = (CUmemAllocationHandleType)(pp->handleTypes | CU_MEM_HANDLE_TYPE_FABRIC);
    cubuf_status_t st = create_pool(pp, threshold, out);
    CUresult r = cubuf_last_cuda_result();
    if (st == CUBUF_SUCCESS || (r != CUDA_ERROR_NOT_PERMITTED && r != CUDA_ERROR_NOT_SUPPORTED)) return st;
    if ((st = require_posix_fd_pools(ctx)) != CUBUF_SUCCESS) return st;
    pp->handleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    *fell_back = true;
    return create_pool(pp, threshold, out);
}

/* Wraps a pool in a resource. On failure the caller still owns ctx and pool. */
static cubuf_status_t wrap_pool(const cubuf_resource_vtbl_t *vt, cubuf_context_t *ctx, CUmemoryPool pool,
                                const cubuf_resource_props_t *props, cubuf_resource_t **out)
{
    cubuf_resource_t *res = NULL;
    cubuf_status_t st = cubuf__resource_new(vt, ctx, 0, &res);
    if (st != CUBUF_SUCCESS) return st;
    res->props = *props;
    res->impl = (void *)pool;
    *out = res;
    return CUBUF_SUCCESS;
}

/* A threshold in bytes as the driver takes it: SIZE_MAX (and the options'
 * CUBUF_RELEASE_THRESHOLD_DEFAULT, for a private pool) keep everything. */
static cuuint64_t threshold_of(size_t bytes)
{
    return bytes >= CUBUF_RELEASE_THRESHOLD_DEFAULT ? UINT64_MAX : (cuuint64_t)bytes;
}

cubuf_status_t cubuf_device_resource_create(int ordinal,
                                            const cubuf_device_resource_options_t *options,
                                            cubuf_resource_t **out)
{
    CHECK_ARG(out, "cubuf_device_resource_create: out is NULL");
    cubuf_device_resource_options_t o = CUBUF_DEVICE_RESOURCE_OPTIONS_INIT;
    if (options) {
        cubuf_status_t st = cubuf__struct_in("cubuf_device_resource_create",
                                             "cubuf_device_resource_options_t", &o, sizeof o, options,
                                             CUBUF_DEVICE_RESOURCE_OPTIONS_SIZE_V1);
        if (st != CUBUF_SUCCESS) return st;
        CHECK_ARG(o.private_pool || (o.max_size == 0 && !o.ipc_enabled && !o.fabric),
                  "cubuf_device_resource_create: max_size, ipc_enabled and fabric need private_pool "
                  "(the device's default pool is shared and cannot change them)");
    }
    cubuf_context_t *ctx = NULL;
    cubuf_status_t st = cubuf__context_for_device(ordinal, &ctx);
    if (st != CUBUF_SUCCESS) return st;
    return cubuf__device_pool_make(ctx, &o, out);
}

cubuf_status_t cubuf__device_pool_make(cubuf_context_t *ctx,
                                       const cubuf_device_resource_options_t *opts,
                                       cubuf_resource_t **out)
{
    const cubuf_device_resource_options_t o = *opts;
    const int ordinal = ctx->ordinal;
    cubuf_status_t st;
    cubuf_ctx_guard_t g = {false};
    CUmemoryPool pool = NULL;
    bool owned = false, fell_back = false;
    CHECK(cubuf__ctx_push(ctx->handle, &g));
    CHECK(require_pools(ctx));
    if (o.ipc_enabled) CHECK(require_posix_fd_pools(ctx));
    if (o.private_pool) {
        CUmemPoolProps pp;
        memset(&pp, 0, sizeof pp);
        pp.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
        pp.handleTypes =
            o.ipc_enabled ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
        pp.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        pp.location.id = ordinal;
        pp.maxSize = o.max_size;
        if (o.fabric) CHECK(create_fabric_pool(ctx, &pp, threshold_of(o.release_threshold), &pool, &fell_back));
        else CHECK(create_pool(&pp, threshold_of(o.release_threshold), &pool));
        owned = true;
    } else {
        CHECK(CU(cuDeviceGetDefaultMemPool, &pool, ctx->device));
    }
    cubuf_resource_props_t props = CUBUF_RESOURCE_PROPS_INIT;
    props.device_id = ordinal;
    props.device_accessible = true;
    props.ipc_enabled = o.ipc_enabled || fell_back;
    cubuf_resource_t *res = NULL;
    CHECK(wrap_pool(owned ? &owned_pool_vtbl : &default_pool_vtbl, ctx, pool, &props, &res));
    /* The default pool is shared with every other user in the process (the
     * runtime's cudaMallocAsync, frameworks' allocators): its threshold
     * changes only when asked, and last: a failure before it (the
     * resource's own allocation included) leaves the shared pool as it was. */
    if (!owned && o.release_threshold != CUBUF_RELEASE_THRESHOLD_DEFAULT &&
        (st = set_threshold(pool, threshold_of(o.release_threshold))) != CUBUF_SUCCESS) {
        cubuf__ctx_pop(&g);
        cubuf_resource_release(res); /* and with it ctx */
        return st;
    }
    res->fabric_fallback = fell_back;
    cubuf__ctx_pop(&g);
    *out = res;
    return CUBUF_SUCCESS;
fail:
    if (owned) destroy_pool(pool);
    cubuf__ctx_pop(&g);
    cubuf__context_release(ctx);
    return st;
}

/* A host-pool attribute: drivers before 12.6 do not know these at all
 * (CUDA_ERROR_INVALID_VALUE), which reads as a device without the feature;
 * any other failure is the driver's. */
static cubuf_status_t host_pool_attr(const cubuf_context_t *ctx, CUdevice_attribute attr, int *v)
{
    *v = 0;
    const CUresult r = CU_CALL(cuDeviceGetAttribute, v, attr, ctx->device);
    if (r == CUDA_ERROR_INVALID_VALUE) *v = 0;
    else if (r != CUDA_SUCCESS) return cubuf__cu_status(r, "cuDeviceGetAttribute");
    return CUBUF_SUCCESS;
}

/* The host pool's location: plain host memory, or, for IPC (the driver
 * refuses handle types on CU_MEM_LOCATION_TYPE_HOST pools), the host NUMA
 * node closest to the device. */
static cubuf_status_t pinned_location(const cubuf_context_t *ctx, bool ipc, CUmemLocation *loc)
{
    int v;
    cubuf_status_t st;
    if (!ipc) {
        if ((st = host_pool_attr(ctx, CU_DEVICE_ATTRIBUTE_HOST_MEMORY_POOLS_SUPPORTED, &v)) != CUBUF_SUCCESS)
            return st;
        if (!v)
            return cubuf__fail(CUBUF_ERROR_NOT_SUPPORTED,
                               "device %d does not support host-located memory pools (or this driver, "
                               "before 12.6, cannot say)",
                               ctx->ordinal);
        loc->type = CU_MEM_LOCATION_TYPE_HOST;
        loc->id = 0;
        return CUBUF_SUCCESS;
    }
    if ((st = host_pool_attr(ctx, CU_DEVICE_ATTRIBUTE_HOST_NUMA_MEMORY_POOLS_SUPPORTED, &v)) != CUBUF_SUCCESS)
        return st;
    if (!v)
        return cubuf__fail(CUBUF_ERROR_NOT_SUPPORTED,
                           "device %d does not support host NUMA memory pools, which IPC-enabled "
                           "pinned pools need (or this driver, before 12.6, cannot say)",
                           ctx->ordinal);
    if ((st = cubuf__device_attr(ctx->device, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, &v)) != CUBUF_SUCCESS) return st;
    loc->type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
    loc->id = v >= 0 ? v : 0; /* -1: no NUMA; the single node is 0 */
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf_pinned_resource_create(int ordinal, bool ipc_enabled, cubuf_resource_t **out)
{
    CHECK_ARG(out, "cubuf_pinned_resource_create: out is NULL");
    cubuf_context_t *ctx = NULL;
    cubuf_status_t st = cubuf__context_for_device(ordinal, &ctx);
    if (st != CUBUF_SUCCESS) return st;
    return cubuf__pinned_pool_make(ctx, ipc_enabled, out);
}

cubuf_status_t cubuf__pinned_pool_make(cubuf_context_t *ctx, bool ipc_enabled, cubuf_resource_t **out)
{
    const int ordinal = ctx->ordinal;
    cubuf_status_t st;
    cubuf_ctx_guard_t g = {false};
    CUmemoryPool pool = NULL;
    CHECK(cubuf__ctx_push(ctx->handle, &g));
    CHECK(require_pools(ctx));
    if (ipc_enabled) CHECK(require_posix_fd_pools(ctx));
    CUmemPoolProps pp;
    memset(&pp, 0, sizeof pp);
    pp.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    pp.handleTypes = ipc_enabled ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
    CHECK(pinned_location(ctx, ipc_enabled, &pp.location));
    CHECK(create_pool(&pp, UINT64_MAX, &pool));
    /* A host pool is accessible from the host only until the device is
     * granted access: without the grant, copies to the device are staged
     * (8.5 GB/s on an H200), with it they run at pinned speed (55 GB/s). */
    CUmemAccessDesc access;
    memset(&access, 0, sizeof access);
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = ordinal;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    if ((st = CU(cuMemPoolSetAccess, pool, &access, 1)) != CUBUF_SUCCESS) {
        cubuf__detail_append("read-write access for device %d to a host pool", ordinal);
        goto fail;
    }
    cubuf_resource_props_t props = CUBUF_RESOURCE_PROPS_INIT;
    props.device_id = -1;
    props.device_accessible = true;
    props.host_accessible = true;
    props.ipc_enabled = ipc_enabled;
    CHECK(wrap_pool(&pinned_pool_vtbl, ctx, pool, &props, out));
    cubuf__ctx_pop(&g);
    return CUBUF_SUCCESS;
fail:
    if (pool) destroy_pool(pool);
    cubuf__ctx_pop(&g);
    cubuf__context_release(ctx);
    return st;
}

cubuf_status_t cubuf_graph_resource_create(int ordinal, cubuf_resource_t **out)
{
    CHECK_ARG(out, "cubuf_graph_resource_create: out is NULL");
    cubuf_context_t *ctx = NULL;
    cubuf_status_t st = cubuf__context_for_device(ordinal, &ctx);
    if (st != CUBUF_SUCCESS) return st;
    CUmemoryPool pool = NULL;
    CHECK(require_pools(ctx));
    CHECK(CU(cuDeviceGetDefaultMemPool, &pool, ctx->device));
    cubuf_resource_props_t props = CUBUF_RESOURCE_PROPS_INIT;
    props.device_id = ordinal;
    props.device_accessible = true;
    CHECK(wrap_pool(&graph_vtbl, ctx, pool, &props, out));
    return CUBUF_SUCCESS;
fail:
    cubuf__context_release(ctx);
    return st;
}

/* ---- peer access ------------------------------------------------------------ */

/* The pool of a pool resource and the device `peer` names, validated. */
static cubuf_status_t peer_target(const cubuf_resource_t *res, int peer, const char *what,
                                  CUmemoryPool *pool, CUdevice *dev)
{
    CHECK_ARG(res, "%s: res is NULL", what);
    CHECK_ARG(cubuf__pool_handle(res) != NULL,
              "%s: the resource is not a pool resource (device or pinned pool)", what);
    cubuf_status_t st = cubuf__device_get(peer, dev);
    if (st != CUBUF_SUCCESS) return st;
    CHECK_ARG(!is_device_pool(res) || peer != res->ctx->ordinal,
              "%s: device %d owns the pool; its access cannot be changed", what, peer);
    *pool = pool_of(res);
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf_resource_set_peer_access(cubuf_resource_t *res, int peer, bool grant)
{
    static const char what[] = "cubuf_resource_set_peer_access";
    CUmemoryPool pool = NULL;
    CUdevice dev;
    cubuf_status_t st = peer_target(res, peer, what, &pool, &dev);
    if (st != CUBUF_SUCCESS) return st;
    if (grant && is_device_pool(res)) {
        int can = 0;
        if ((st = CU(cuDeviceCanAccessPeer, &can, dev, res->ctx->device)) != CUBUF_SUCCESS) return st;
        if (!can)
            return cubuf__fail(CUBUF_ERROR_NOT_SUPPORTED, "%s: device %d cannot access the memory "
                               "of device %d (no peer access between them)", what, peer,
                               res->ctx->ordinal);
    }
    CUmemAccessDesc desc = {{CU_MEM_LOCATION_TYPE_DEVICE, (int)dev},
                            grant ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE : CU_MEM_ACCESS_FLAGS_PROT_NONE};
    cubuf_ctx_guard_t g;
    if ((st = cubuf__ctx_push(res->ctx->handle, &g)) != CUBUF_SUCCESS) return st;
    st = CU(cuMemPoolSetAccess, pool, &desc, 1);
    cubuf__ctx_pop(&g);
    if (st != CUBUF_SUCCESS) cubuf__detail_append("%s device %d", grant ? "granting" : "revoking", peer);
    return st;
}

cubuf_status_t cubuf_resource_peer_access(const cubuf_resource_t *res, int peer, bool *granted)
{
    static const char what[] = "cubuf_resource_peer_access";
    CHECK_ARG(granted, "%s: granted is NULL", what);
    CUmemoryPool pool = NULL;
    CUdevice dev;
    cubuf_status_t st;
    if (res && is_device_pool(res) && peer == res->ctx->ordinal) {
        *granted = true;
        return CUBUF_SUCCESS;
    }
    if ((st = peer_target(res, peer, what, &pool, &dev)) != CUBUF_SUCCESS) return st;
    CUmemLocation loc = {CU_MEM_LOCATION_TYPE_DEVICE, (int)dev};
    CUmemAccess_flags flags = CU_MEM_ACCESS_FLAGS_PROT_NONE;
    cubuf_ctx_guard_t g;
    if ((st = cubuf__ctx_push(res->ctx->handle, &g)) != CUBUF_SUCCESS) return st;
    st = CU(cuMemPoolGetAccess, &flags, pool, &loc);
    cubuf__ctx_pop(&g);
    if (st == CUBUF_SUCCESS) *granted = flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    return st;
}

/* ---- memory back to the system ------------------------------------------------ */

/* The pool of a device or pinned pool resource, or NOT_SUPPORTED naming `what`. */
static cubuf_status_t pool_target(const cubuf_resource_t *res, const char *what, CUmemoryPool *pool)
{
    CHECK_ARG(res, "%s: res is NULL", what);
    *pool = cubuf__pool_handle(res);
    if (!*pool)
        return cubuf__fail(CUBUF_ERROR_NOT_SUPPORTED,
                           "%s: the resource has no memory pool (only device pool and pinned pool "
                           "resources have one)",
                           what);
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf_resource_trim(cubuf_resource_t *res, size_t bytes_to_keep)
{
    static const char what[] = "cubuf_resource_trim";
    CUmemoryPool pool;
    cubuf_status_t st = pool_target(res, what, &pool);
    if (st != CUBUF_SUCCESS) return st;
    cubuf_ctx_guard_t g;
    if ((st = cubuf__ctx_push(res->ctx->handle, &g)) != CUBUF_SUCCESS) return st;
    st = CU(cuMemPoolTrimTo, pool, bytes_to_keep);
    cubuf__ctx_pop(&g);
    if (st != CUBUF_SUCCESS) cubuf__detail_append("%s to %zu bytes", what, bytes_to_keep);
    return st;
}

cubuf_status_t cubuf_resource_set_release_threshold(cubuf_resource_t *res, size_t bytes)
{
    CUmemoryPool pool;
    cubuf_status_t st = pool_target(res, "cubuf_resource_set_release_threshold", &pool);
    if (st != CUBUF_SUCCESS) return st;
    cubuf_ctx_guard_t g;
    if ((st = cubuf__ctx_push(res->ctx->handle, &g)) != CUBUF_SUCCESS) return st;
    st = set_threshold(pool, threshold_of(bytes));
    cubuf__ctx_pop(&g);
    return st;
}

cubuf_status_t cubuf__pool_usage(const cubuf_resource_t *res, cubuf_resource_stats_t *stats)
{
    static const CUmemPool_attribute attrs[4] = {
        CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
        CU_MEMPOOL_ATTR_USED_MEM_CURRENT, CU_MEMPOOL_ATTR_USED_MEM_HIGH};
    cuuint64_t v[4] = {0, 0, 0, 0};
    CUmemoryPool pool = cubuf__pool_handle(res);
    cubuf_status_t st = CUBUF_SUCCESS;
    if (pool) {
        cubuf_ctx_guard_t g;
        if ((st = cubuf__ctx_push(res->ctx->handle, &g)) != CUBUF_SUCCESS) return st;
        for (int i = 0; i < 4 && st == CUBUF_SUCCESS; i++)
            st = CU(cuMemPoolGetAttribute, pool, attrs[i], &v[i]);
        cubuf__ctx_pop(&g);
        if (st != CUBUF_SUCCESS) return st;
    }
    stats->pool_reserved_current = v[0];
    stats->pool_reserved_high = v[1];
    stats->pool_used_current = v[2];
    stats->pool_used_high = v[3];
    return CUBUF_SUCCESS;
}
