/* The buffer half of pyarrow.cuda.Context: new_buffer, new_host_buffer,
 * buffer_from_data, foreign_buffer, buffer_from_object (strided views) and
 * get_device_address. */
#include <limits.h>

#include "resource_pool.h"
#include "strided.h"

/* ---- the context's lazily made pools ---------------------------------------- */

typedef cubuf_status_t (*make_pool_fn)(cubuf_context_t *ctx, cubuf_resource_t **out);

/* The pools live in the context itself (a wrapped context included) and
 * hold it: buffers from them keep it alive.
 *
 * The device pool is the context's own, exportable as POSIX fds, so that
 * its buffers can be shared with other processes as pyarrow's context
 * memory can (cubuf_buffer_ipc_descriptor); it keeps freed memory for
 * reuse (cubuf_resource_trim gives it back). Where pools
 * cannot be exported (CUBUF_ERROR_NOT_SUPPORTED), the device's default pool
 * serves instead (its threshold left as it is: it is shared) and the
 * buffers stay in this process. */
static cubuf_status_t make_device_pool(cubuf_context_t *ctx, cubuf_resource_t **out)
{
    cubuf_device_resource_options_t o = CUBUF_DEVICE_RESOURCE_OPTIONS_INIT;
    o.private_pool = true;
    o.ipc_enabled = true;
    cubuf_status_t st = cubuf__device_pool_make(cubuf__context_retain(ctx), &o, out);
    if (st != CUBUF_ERROR_NOT_SUPPORTED) return st;
    const cubuf_device_resource_options_t defaults = CUBUF_DEVICE_RESOURCE_OPTIONS_INIT;
    return cubuf__device_pool_make(cubuf__context_retain(ctx), &defaults, out);
}

static cubuf_status_t make_host_pool(cubuf_context_t *ctx, cubuf_resource_t **out)
{
    return cubuf__pinned_pool_make(cubuf__context_retain(ctx), false, out);
}

/* The resource in *slot, made on first use. Two threads may both make one;
 * the loser releases its own and uses the winner's. Not a new reference:
 * the context holds it until it is destroyed. */
static cubuf_status_t context_pool(cubuf_context_t *ctx, atomic_uintptr_t *slot, make_pool_fn make,
                                   cubuf_resource_t **out)
{
    uintptr_t cur = atomic_load_explicit(slot, memory_order_acquire);
    if (cur) {
        *out = (cubuf_resource_t *)cur;
        return CUBUF_SUCCESS;
    }
    cubuf_resource_t *mine = NULL;
    cubuf_status_t st = make(ctx, &mine);
    if (st != CUBUF_SUCCESS) return st;
    if (atomic_compare_exchange_strong_explicit(slot, &cur, (uintptr_t)mine, memory_order_acq_rel,
                                                memory_order_acquire)) {
        *out = mine;
    } else {
        cubuf_resource_release(mine);
        *out = (cubuf_resource_t *)cur;
    }
    return CUBUF_SUCCESS;
}

/* Allocates from one of the context's pools, ordered on the context's legacy
 * default stream. The pool's statistics are the context's bytes_allocated. */
static cubuf_status_t context_allocate(cubuf_context_t *ctx, atomic_uintptr_t *slot, make_pool_fn make,
                                       size_t size, cubuf_buffer_t **out)
{
    cubuf_resource_t *res = NULL;
    cubuf_status_t st = context_pool(ctx, slot, make, &res);
    if (st != CUBUF_SUCCESS) return st;
    cubuf_ctx_guard_t g;
    if ((st = cubuf__ctx_push(ctx->handle, &g)) != CUBUF_SUCCESS) return st;
    /* Current now: the legacy stream is recorded as this context's with no
     * further query. */
    st = cubuf__resource_allocate(res, size, CU_STREAM_LEGACY, ctx->handle, out);
    cubuf__ctx_pop(&g);
    return st;
}

cubuf_status_t cubuf_context_new_buffer(cubuf_context_t *ctx, size_t size, cubuf_buffer_t **out)
{
    CHECK_ARG(ctx && out, "cubuf_context_new_buffer: NULL argument");
    return context_allocate(ctx, &ctx->device_pool, make_device_pool, size, out);
}

cubuf_status_t cubuf_context_new_host_buffer(cubuf_context_t *ctx, size_t size, cubuf_buffer_t **out)
{
    CHECK_ARG(ctx && out, "cubuf_context_new_host_buffer: NULL argument");
    return context_allocate(ctx, &ctx->host_pool, make_host_pool, size, out);
}

/* ---- buffer_from_data ----------------------------------------------------- */

/* pyarrow's rules: offset in [0, data_size) (0 allowed for empty data), size
 * -1 for the rest, else offset+size within the data. */
static cubuf_status_t data_range(size_t data_size, int64_t offset, int64_t size, size_t *n)
{
    static const char what[] = "cubuf_context_buffer_from_data";
    if (offset < 0 || (data_size > 0 && (uint64_t)offset >= data_size) ||
        (data_size == 0 && offset > 0))
        return cubuf__fail(CUBUF_ERROR_OUT_OF_RANGE,
                           "%s: offset %lld is out of range for %zu bytes of data", what,
                           (long long)offset, data_size);
    size_t rest = data_size - (size_t)offset;
    if (size == CUBUF_SIZE_REST) {
        *n = rest;
        return CUBUF_SUCCESS;
    }
    if (size < 0)
        return cubuf__fail(CUBUF_ERROR_OUT_OF_RANGE,
                           "%s: size %lld is negative (only -1, the rest of the data, is allowed)",
                           what, (long long)size);
    if ((uint64_t)size > rest)
        return cubuf__fail(CUBUF_ERROR_OUT_OF_RANGE,
                           "%s: offset %lld + size %lld is past the end of %zu bytes of data", what,
                           (long long)offset, (long long)size, data_size);
    *n = (size_t)size;
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf_context_buffer_from_data(cubuf_context_t *ctx, const void *data,
                                              size_t data_size, int64_t offset, int64_t size,
                                              cubuf_buffer_t **out)
{
    CHECK_ARG(ctx && out, "cubuf_context_buffer_from_data: NULL argument");
    CHECK_ARG(data || data_size == 0, "cubuf_context_buffer_from_data: data is NULL with %zu bytes",
              data_size);
    size_t n = 0;
    cubuf_status_t st = data_range(data_size, offset, size, &n);
    if (st != CUBUF_SUCCESS) return st;
    cubuf_buffer_t *buf = NULL;
    if ((st = cubuf_context_new_buffer(ctx, n, &buf)) != CUBUF_SUCCESS) return st;
    if (n == 0) goto done;
    cubuf_ctx_guard_t g;
    if ((st = cubuf__ctx_push(ctx->handle, &g)) != CUBUF_SUCCESS) goto fail;
    /* With unified addressing the driver tells pageable, pinned and device
     * sources apart by itself. The legacy stream is the one the buffer was
     * allocated on, and synchronizing it completes the copy. */
    CUdeviceptr src = (CUdeviceptr)(uintptr_t)data + (CUdeviceptr)offset;
    st = CU(cuMemcpyAsync, buf->ptr, src, n, CU_STREAM_LEGACY);
    if (st == CUBUF_SUCCESS) st = CU(cuStreamSynchronize, CU_STREAM_LEGACY);
    if (st != CUBUF_SUCCESS) cubuf__detail_append("cubuf_context_buffer_from_data of %zu bytes", n);
    cubuf__ctx_pop(&g);
    if (st != CUBUF_SUCCESS) goto fail;
done:
    *out = buf;
    return CUBUF_SUCCESS;
fail:
    cubuf_buffer_release(buf);
    return st;
}

/* ---- views --------------------------------------------------------------- */

/* A view made through ctx: described with ctx current, running its work
 * there (it holds the context), depending on `base` when given. On failure
 * nothing is retained and the owner is not released. */
static cubuf_status_t context_view(cubuf_context_t *ctx, CUdeviceptr ptr, size_t size,
                                   bool need_device_access, cubuf_buffer_t *base, void *owner,
                                   cubuf_owner_release_fn release, const char *what,
                                   cubuf_buffer_t **out)
{
    cubuf_status_t st = CUBUF_SUCCESS;
    if (base) {
        if ((st = cubuf__buffer_check_open(base, what)) != CUBUF_SUCCESS) return st;
        /* An empty range too must be inside (its end may be base's end);
         * address 0 with size 0 is the empty buffer, inside any base. */
        if ((ptr || size) &&
            (ptr < base->ptr || ptr - base->ptr > base->size || size > base->size - (ptr - base->ptr)))
            return cubuf__fail(CUBUF_ERROR_OUT_OF_RANGE,
                               "%s: [0x%llx, +%zu) is not inside the base buffer [0x%llx, +%zu)",
                               what, (unsigned long long)ptr, size,
                               (unsigned long long)base->ptr, base->size);
    }
    cubuf_buffer_t *buf = NULL;
    cubuf_ctx_guard_t g = {false};
    if (ptr && (st = cubuf__driver_load()) == CUBUF_SUCCESS) st = cubuf__ctx_push(ctx->handle, &g);
    if (st != CUBUF_SUCCESS) return st;
    st = cubuf_buffer_view(ptr, size, &buf);
    cubuf__ctx_pop(&g);
    if (st != CUBUF_SUCCESS) return st;
    if (need_device_access && size && !cubuf_buffer_is_device_accessible(buf)) {
        cubuf_buffer_release(buf);
        return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,
                           "%s: memory at 0x%llx is pageable host memory the device cannot reach; "
                           "use device, pinned (cuMemHostAlloc / cuMemHostRegister) or managed "
                           "memory", what, (unsigned long long)ptr);
    }
    buf->view_ctx = cubuf__context_retain(ctx);
    if (base) cubuf__buffer_attach(buf, base);
    buf->owner = owner;
    buf->owner_release = release;
    *out = buf;
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf_context_foreign_buffer(cubuf_context_t *ctx, CUdeviceptr address, size_t size,
                                            cubuf_buffer_t *base, void *owner,
                                            cubuf_owner_release_fn release, cubuf_buffer_t **out)
{
    static const char what[] = "cubuf_context_foreign_buffer";
    CHECK_ARG(ctx && out, "%s: NULL argument", what);
    CHECK_ARG(address || !size, "%s: address 0 with size %zu", what, size);
    return context_view(ctx, address, size, false, base, owner, release, what, out);
}

/* ---- strided views (buffer_from_object) ------------------------------------- */

#define CUBUF_MAX_NDIM 64

cubuf_status_t cubuf_context_buffer_from_strided(cubuf_context_t *ctx, CUdeviceptr address,
                                                 int ndim, const int64_t *shape,
                                                 const int64_t *strides, size_t itemsize,
                                                 cubuf_buffer_t *base, void *owner,
                                                 cubuf_owner_release_fn release, cubuf_buffer_t **out)
{
    static const char what[] = "cubuf_context_buffer_from_strided";
    CHECK_ARG(ctx && out, "%s: NULL argument", what);
    CHECK_ARG(ndim >= 0 && ndim <= CUBUF_MAX_NDIM, "%s: ndim %d is outside [0, %d]", what, ndim,
              CUBUF_MAX_NDIM);
    CHECK_ARG(ndim == 0 || (shape && strides), "%s: shape or strides is NULL with ndim %d", what,
              ndim);
    CHECK_ARG(itemsize > 0, "%s: itemsize is 0", what);
    for (int k = 0; k < ndim; k++)
        CHECK_ARG(shape[k] >= 0, "%s: shape[%d] is negative (%lld)", what, k, (long long)shape[k]);
    int64_t lo = 0;
    uint64_t len = 0;
    cubuf_status_t st = cubuf__strided_span(what, ndim, shape, strides, 1, itemsize, NULL, &lo, &len);
    if (st != CUBUF_SUCCESS) return st;
    if (len == 0) return context_view(ctx, address, 0, false, base, owner, release, what, out);
    CHECK_ARG(address != 0, "%s: address 0 with a non-empty array", what);
    uint64_t below = 0 - (uint64_t)lo; /* how far the span reaches below address */
    if (below >= address)
        return cubuf__fail(CUBUF_ERROR_OUT_OF_RANGE,
                           "%s: the span starts %llu bytes below address 0x%llx, at or below 0",
                           what, (unsigned long long)below, (unsigned long long)address);
    CUdeviceptr start = address - below;
    if (len > UINT64_MAX - start)
        return cubuf__fail(CUBUF_ERROR_OUT_OF_RANGE,
                           "%s: the span of %llu bytes from 0x%llx passes the end of the address "
                           "space", what, (unsigned long long)len, (unsigned long long)start);
    return context_view(ctx, start, (size_t)len, true, base, owner, release, what, out);
}

/* ---- get_device_address -------------------------------------------------- */

cubuf_status_t cubuf_context_device_address(cubuf_context_t *ctx, const void *address,
                                            CUdeviceptr *device_address)
{
    static const char what[] = "cubuf_context_device_address";
    CHECK_ARG(ctx && address && device_address, "%s: NULL argument", what);
    cubuf_status_t st = cubuf__driver_load();
    if (st != CUBUF_SUCCESS) return st;
    cubuf_ctx_guard_t g;
    if ((st = cubuf__ctx_push(ctx->handle, &g)) != CUBUF_SUCCESS) return st;
    /* The plural query reports memory the driver does not know as type 0
     * instead of failing, the same test cubuf_buffer_view uses, so pageable
     * memory reads as pageable even where the device could reach it (HMM). */
    unsigned int type = 0;
    CUdeviceptr d = 0;
    CUpointer_attribute attrs[] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                   CU_POINTER_ATTRIBUTE_DEVICE_POINTER};
    void *data[] = {&type, &d};
    CUresult r = CU_CALL(cuPointerGetAttributes, 2, attrs, data, (CUdeviceptr)(uintptr_t)address);
    cubuf__ctx_pop(&g);
    if (r == CUDA_SUCCESS && type == 0)
        return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,
                           "%s: %p is pageable host memory (not device, managed, pinned or "
                           "registered memory); kernels in this context cannot reach it", what,
                           address);
    if (r == CUDA_ERROR_INVALID_VALUE || (r == CUDA_SUCCESS && d == 0))
        return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,
                           "%s: %p has no device address in this context (pinned or registered "
                           "in another context without CU_MEMHOSTALLOC_PORTABLE?)", what, address);
    if (r != CUDA_SUCCESS) return cubuf__cu_status(r, "cuPointerGetAttributes");
    *device_address = d;
    return CUBUF_SUCCESS;
}
