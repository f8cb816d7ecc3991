/* Virtual memory: the driver calls. Each call that makes or removes a
 * reservation, a mapping, a physical allocation or a range's waits stream
 * or event counts it here (what cubuf__vmm_live reports); undoing and
 * releasing have quiet variants that cannot fail their caller; the guard
 * every call runs under. The model is in vmm.h. */
#include "vmm.h"

static atomic_long live_resv, live_maps, live_phys, live_waiters;

void cubuf__vmm_live(cubuf_vmm_live_t *live)
{
    live->reservations = atomic_load(&live_resv);
    live->mappings = atomic_load(&live_maps);
    live->allocations = atomic_load(&live_phys);
    live->waiters = atomic_load(&live_waiters);
}

/* ---- driver calls ---------------------------------------------------------- */

cubuf_status_t cubuf__vmm_va_reserve(CUdeviceptr *va, size_t size, size_t align, CUdeviceptr hint)
{
    cubuf_status_t st = CU(cuMemAddressReserve, va, size, align, hint, 0);
    if (st != CUBUF_SUCCESS) {
        cubuf__detail_append("reserving %zu bytes, alignment %zu, hint 0x%llx", size, align,
                             (unsigned long long)hint);
        return st;
    }
    atomic_fetch_add(&live_resv, 1);
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf__vmm_phys_create(CUmemGenericAllocationHandle *h, size_t size,
                                      const CUmemAllocationProp *prop)
{
    cubuf_status_t st = CU(cuMemCreate, h, size, prop, 0);
    if (st != CUBUF_SUCCESS) {
        cubuf__detail_append("size %zu", size);
        return st;
    }
    atomic_fetch_add(&live_phys, 1);
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf__vmm_map_phys(CUdeviceptr va, const vmm_phys_t *p)
{
    cubuf_status_t st = CU(cuMemMap, va, p->size, 0, p->handle, 0);
    if (st != CUBUF_SUCCESS) {
        cubuf__detail_append("mapping %zu bytes at 0x%llx", p->size, (unsigned long long)va);
        return st;
    }
    atomic_fetch_add(&live_maps, 1);
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf__vmm_set_access(CUdeviceptr va, size_t size, const vmm_access_t *a)
{
    if (a->count == 0) return CUBUF_SUCCESS; /* nothing granted: mappings start without access */
    cubuf_status_t st = CU(cuMemSetAccess, va, size, a->desc, a->count);
    if (st != CUBUF_SUCCESS)
        cubuf__detail_append("%zu bytes at 0x%llx, %u access entries", size, (unsigned long long)va,
                             a->count);
    return st;
}

/* An unmap a close can still undo (vmm_close.c maps back on failure). */
cubuf_status_t cubuf__vmm_unmap(CUdeviceptr va, size_t size)
{
    cubuf_status_t st = CU(cuMemUnmap, va, size);
    if (st != CUBUF_SUCCESS) {
        cubuf__detail_append("unmapping %zu bytes at 0x%llx", size, (unsigned long long)va);
        return st;
    }
    atomic_fetch_sub(&live_maps, 1);
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf__vmm_stream_create(CUstream *s)
{
    cubuf_status_t st = CU(cuStreamCreate, s, CU_STREAM_NON_BLOCKING);
    if (st != CUBUF_SUCCESS) return st;
    atomic_fetch_add(&live_waiters, 1);
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf__vmm_event_create(CUevent *e)
{
    cubuf_status_t st = CU(cuEventCreate, e, CU_EVENT_DISABLE_TIMING);
    if (st != CUBUF_SUCCESS) return st;
    atomic_fetch_add(&live_waiters, 1);
    return CUBUF_SUCCESS;
}

/* Undoing and releasing: no caller can be told about these, and the thread's
 * last error must keep describing the failure being unwound. A failed call
 * is tried once more (a transient or injected failure must not leak), then
 * reported to the warning handler. */
static CUresult retry_once(CUresult r, CUresult (*again)(const void *), const void *arg)
{
    return r == CUDA_SUCCESS ? r : again(arg);
}

typedef struct vmm_span {
    CUdeviceptr va;
    size_t size;
} vmm_span_t;

static CUresult free_va_call(const void *arg)
{
    const vmm_span_t *s = arg;
    return CU_CALL(cuMemAddressFree, s->va, s->size);
}

static CUresult unmap_call(const void *arg)
{
    const vmm_span_t *s = arg;
    return CU_CALL(cuMemUnmap, s->va, s->size);
}

static CUresult release_call(const void *arg)
{
    return CU_CALL(cuMemRelease, *(const CUmemGenericAllocationHandle *)arg);
}

static CUresult stream_destroy_call(const void *arg)
{
    return CU_CALL(cuStreamDestroy, *(const CUstream *)arg);
}

static CUresult event_destroy_call(const void *arg)
{
    return CU_CALL(cuEventDestroy, *(const CUevent *)arg);
}

void cubuf__vmm_va_free_quiet(CUdeviceptr va, size_t size)
{
    vmm_span_t s = {va, size};
    CUresult r = retry_once(free_va_call(&s), free_va_call, &s);
    if (r == CUDA_SUCCESS)
        atomic_fetch_sub(&live_resv, 1);
    else
        cubuf__warn(cubuf__cu_map(r),
                    "cuMemAddressFree of %zu bytes at 0x%llx failed (CUresult %d): the address "
                    "range stays reserved",
                    size, (unsigned long long)va, (int)r);
}

void cubuf__vmm_unmap_quiet(CUdeviceptr va, size_t size)
{
    vmm_span_t s = {va, size};
    CUresult r = retry_once(unmap_call(&s), unmap_call, &s);
    if (r == CUDA_SUCCESS)
        atomic_fetch_sub(&live_maps, 1);
    else
        cubuf__warn(cubuf__cu_map(r),
                    "cuMemUnmap of %zu bytes at 0x%llx failed (CUresult %d): the mapping stays",
                    size, (unsigned long long)va, (int)r);
}

void cubuf__vmm_release_quiet(CUmemGenericAllocationHandle h, size_t size)
{
    CUresult r = retry_once(release_call(&h), release_call, &h);
    if (r == CUDA_SUCCESS)
        atomic_fetch_sub(&live_phys, 1);
    else
        cubuf__warn(cubuf__cu_map(r),
                    "cuMemRelease of a %zu-byte physical allocation failed (CUresult %d): the "
                    "memory is lost",
                    size, (int)r);
}

void cubuf__vmm_stream_destroy_quiet(CUstream s)
{
    CUresult r = retry_once(stream_destroy_call(&s), stream_destroy_call, &s);
    if (r == CUDA_SUCCESS)
        atomic_fetch_sub(&live_waiters, 1);
    else
        cubuf__warn(cubuf__cu_map(r), "cuStreamDestroy of a range's waits stream failed (CUresult %d)",
                    (int)r);
}

void cubuf__vmm_event_destroy_quiet(CUevent e)
{
    CUresult r = retry_once(event_destroy_call(&e), event_destroy_call, &e);
    if (r == CUDA_SUCCESS)
        atomic_fetch_sub(&live_waiters, 1);
    else
        cubuf__warn(cubuf__cu_map(r), "cuEventDestroy of a close's event failed (CUresult %d)",
                    (int)r);
}

/* Maps a physical allocation again where a failed close had unmapped it. */
void cubuf__vmm_remap_quiet(CUdeviceptr va, const vmm_phys_t *p, const vmm_access_t *a)
{
    CUresult r = CU_CALL(cuMemMap, va, p->size, 0, p->handle, 0);
    if (r != CUDA_SUCCESS) r = CU_CALL(cuMemMap, va, p->size, 0, p->handle, 0);
    if (r != CUDA_SUCCESS) {
        cubuf__warn(cubuf__cu_map(r),
                    "restoring a mapping of %zu bytes at 0x%llx after a failed close failed "
                    "(CUresult %d): the buffer no longer maps that part",
                    p->size, (unsigned long long)va, (int)r);
        return;
    }
    atomic_fetch_add(&live_maps, 1);
    if (a->count == 0) return;
    r = CU_CALL(cuMemSetAccess, va, p->size, a->desc, a->count);
    if (r != CUDA_SUCCESS) r = CU_CALL(cuMemSetAccess, va, p->size, a->desc, a->count);
    if (r != CUDA_SUCCESS)
        cubuf__warn(cubuf__cu_map(r),
                    "restoring access to %zu bytes at 0x%llx after a failed close failed "
                    "(CUresult %d)",
                    p->size, (unsigned long long)va, (int)r);
}

/* The resource's probe (vmm_resource.c says why). Raw calls: the caller
 * records the failure itself, after the undo, naming the call that refused. */
CUresult cubuf__vmm_try_granule(const CUmemAllocationProp *prop, size_t g, const vmm_access_t *a,
                                const char **call)
{
    CUmemGenericAllocationHandle h = 0;
    CUdeviceptr va = 0;
    bool created = false, reserved = false, mapped = false;
    *call = "cuMemCreate";
    CUresult r = CU_CALL(cuMemCreate, &h, g, prop, 0);
    if (r == CUDA_SUCCESS) {
        created = true;
        atomic_fetch_add(&live_phys, 1);
        *call = "cuMemAddressReserve";
        r = CU_CALL(cuMemAddressReserve, &va, g, g, 0, 0);
    }
    if (r == CUDA_SUCCESS) {
        reserved = true;
        atomic_fetch_add(&live_resv, 1);
        *call = "cuMemMap";
        r = CU_CALL(cuMemMap, va, g, 0, h, 0);
    }
    if (r == CUDA_SUCCESS) {
        mapped = true;
        atomic_fetch_add(&live_maps, 1);
        *call = "cuMemSetAccess";
        if (a->count) r = CU_CALL(cuMemSetAccess, va, g, a->desc, a->count);
    }
    if (mapped) cubuf__vmm_unmap_quiet(va, g);
    if (reserved) cubuf__vmm_va_free_quiet(va, g);
    if (created) cubuf__vmm_release_quiet(h, g);
    return r;
}

/* ---- the guard ----------------------------------------------------------------- */

cubuf_status_t cubuf__vmm_guard_enter(const cubuf_resource_t *res, vmm_guard_t *g)
{
    g->relaxed = false;
    cubuf_status_t st = cubuf__ctx_push(res->ctx->handle, &g->ctx);
    if (st != CUBUF_SUCCESS) return st;
    g->mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    st = CU(cuThreadExchangeStreamCaptureMode, &g->mode);
    if (st != CUBUF_SUCCESS) {
        cubuf__ctx_pop(&g->ctx);
        return st;
    }
    g->relaxed = true;
    return CUBUF_SUCCESS;
}

void cubuf__vmm_guard_exit(vmm_guard_t *g)
{
    if (g->relaxed) {
        /* Restoring the caller's mode bypasses fault injection, as
         * cubuf__ctx_pop does: it cannot fail short of a broken driver. */
        CUstreamCaptureMode mode = g->mode;
        CUresult r = cubuf__drv.cuThreadExchangeStreamCaptureMode(&mode);
        if (r != CUDA_SUCCESS)
            cubuf__warn(cubuf__cu_map(r), "restoring the thread's stream capture mode failed (CUresult %d)",
                        (int)r);
        g->relaxed = false;
    }
    cubuf__ctx_pop(&g->ctx);
}
