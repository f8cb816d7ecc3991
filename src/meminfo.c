/* What a registration cache keys on: the span of memory a buffer lies in,
 * its physical allocations, their handle types and RDMA capability; and
 * the device capabilities distributed engines ask for
 * (include/cubuf/dist.h). */
#include <stdlib.h>
#include <string.h>

#include "dist.h"
#include "inspect.h"

cubuf_status_t cubuf_device_dist_caps(int ordinal, cubuf_dist_caps_t *caps)
{
    static const char what[] = "cubuf_device_dist_caps";
    CHECK_ARG(caps, "%s: caps is NULL", what);
    cubuf_status_t st = cubuf__struct_check(what, "cubuf_dist_caps_t", caps->struct_size,
                                            CUBUF_DIST_CAPS_SIZE_V1, sizeof *caps);
    if (st != CUBUF_SUCCESS) return st;
    if ((st = cubuf__driver_load()) != CUBUF_SUCCESS) return st;
    CUdevice dev;
    if ((st = cubuf__device_get(ordinal, &dev)) != CUBUF_SUCCESS) return st;
    static const CUdevice_attribute attrs[5] = {
        CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED,
        CU_DEVICE_ATTRIBUTE_HOST_ALLOC_DMA_BUF_SUPPORTED,
        CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED,
        CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
        CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED,
    };
    int v[5];
    for (int i = 0; i < 5; i++) {
        v[i] = 0;
        CUresult r = CU_CALL(cuDeviceGetAttribute, &v[i], attrs[i], dev);
        /* A driver older than an attribute does not know it: not supported. */
        if (r == CUDA_ERROR_INVALID_VALUE) v[i] = 0;
        else if (r != CUDA_SUCCESS) return cubuf__cu_status(r, "cuDeviceGetAttribute");
    }
    cubuf_dist_caps_t c = CUBUF_DIST_CAPS_INIT;
    c.dmabuf = v[0] != 0;
    c.dmabuf_host_alloc = v[1] != 0;
    c.gpu_direct_rdma = v[2] != 0;
    c.gpu_direct_rdma_vmm = v[3] != 0;
    c.fabric_handles = v[4] != 0;
    cubuf__struct_out(caps, &c, sizeof c);
    return CUBUF_SUCCESS;
}

/* ---- the span ---------------------------------------------------------------- */

cubuf_status_t cubuf__span_enter(const cubuf_buffer_t *buf, const char *what, cubuf_ctx_guard_t *guard)
{
    guard->pushed = false;
    CHECK_ARG(buf, "%s: buf is NULL", what);
    cubuf_status_t st = cubuf__buffer_check_open(buf, what);
    if (st != CUBUF_SUCCESS) return st;
    CHECK_ARG(cubuf_buffer_size(buf) > 0, "%s: the buffer is empty (size 0): it holds no memory", what);
    if ((st = cubuf__driver_load()) != CUBUF_SUCCESS) return st;
    return cubuf__ctx_push(cubuf__buffer_exec_ctx(buf), guard);
}

/* The VMM buffer whose memory buf's is, or NULL: its root, where a VMM
 * resource made that; else, where the root's resource is a stack of
 * adaptors and caching resources over a VMM resource (each handing on the
 * pointer the one below gave it), the buffer the VMM resource keeps for
 * that raw allocation. */
static const cubuf_buffer_t *vmm_buffer_of(const cubuf_buffer_t *buf)
{
    const cubuf_buffer_t *root = cubuf_buffer_parent(buf) ? cubuf_buffer_parent(buf) : buf;
    for (cubuf_resource_t *r = cubuf_buffer_resource(root); r;) {
        if (cubuf__vmm_granularity(r))
            return r == cubuf_buffer_resource(root) ? root : cubuf__raw_kept_buffer(r, root->ptr);
        cubuf_resource_t *up = cubuf__caching_upstream(r);
        r = up ? up : r->upstream; /* set for adaptors only */
    }
    return NULL;
}

cubuf_status_t cubuf__span_get(const cubuf_buffer_t *buf, const char *what, cubuf_span_t *span)
{
    memset(span, 0, sizeof *span);
    CUdeviceptr ptr = cubuf_buffer_ptr(buf);
    size_t size = cubuf_buffer_size(buf);
    CUdeviceptr start = 0;
    size_t range = 0;
    /* The driver writes bools and a handle-type mask of its own width;
     * wide zeroed slots read the same. */
    uint64_t handle_types = 0, managed = 0;
    unsigned long long id = 0;
    CUmemoryPool pool = NULL;
    CUpointer_attribute attrs[6] = {
        CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES, CU_POINTER_ATTRIBUTE_BUFFER_ID,
        CU_POINTER_ATTRIBUTE_IS_MANAGED, CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
    };
    void *data[6] = {&start, &range, &handle_types, &id, &managed, &pool};
    CUresult r = CU_CALL(cuPointerGetAttributes, 6, attrs, data, ptr);
    if (r == CUDA_ERROR_INVALID_VALUE || r == CUDA_ERROR_INVALID_CONTEXT) start = range = 0;
    else if (r != CUDA_SUCCESS) {
        cubuf_status_t st = cubuf__cu_status(r, "cuPointerGetAttributes");
        cubuf__detail_append("%s: pointer 0x%llx", what, (unsigned long long)ptr);
        return st;
    }
    span->buffer_id = id;
    span->managed = managed != 0;
    span->from_pool = pool != NULL;
    const cubuf_buffer_t *vmm = vmm_buffer_of(buf);
    if (vmm) {
        size_t first = 0;
        cubuf_status_t st = cubuf__vmm_chunks_at(vmm, ptr, size, &span->chunks, &span->nchunks, &first);
        if (st != CUBUF_SUCCESS) return st;
        const cubuf_vmm_chunk_t *last = &span->chunks[span->nchunks - 1];
        span->base = ptr - first;
        span->extent = last->offset + last->size;
        span->offset = first;
        return CUBUF_SUCCESS;
    }
    /* The mapped allocation, as the engines ask for it: the attributes'
     * range may be a whole reservation (a pool's), cuMemGetAddressRange's is
     * what is mapped. It knows no pinned host memory; there the attributes
     * give the allocation. */
    CUdeviceptr mapped = 0;
    size_t mapped_size = 0;
    r = CU_CALL(cuMemGetAddressRange, &mapped, &mapped_size, ptr);
    if (r == CUDA_SUCCESS) {
        start = mapped;
        range = mapped_size;
    } else if (r != CUDA_ERROR_NOT_FOUND && r != CUDA_ERROR_INVALID_VALUE &&
               r != CUDA_ERROR_INVALID_CONTEXT) {
        cubuf_status_t st = cubuf__cu_status(r, "cuMemGetAddressRange");
        cubuf__detail_append("%s: pointer 0x%llx", what, (unsigned long long)ptr);
        return st;
    }
    /* Memory cubuf knows devices reach, with no range the driver reports:
     * host memory pools' (measured on the H200, driver 580: neither query
     * describes it). */
    if ((start == 0 || range == 0) && cubuf_buffer_is_device_accessible(buf))
        return cubuf__fail(CUBUF_ERROR_NOT_SUPPORTED,
                           "%s: the driver reports no allocation at 0x%llx, pinned host memory a "
                           "device reaches (a host memory pool's): it has no base and extent to give",
                           what, (unsigned long long)ptr);
    if (start == 0 || range == 0)
        return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,
                           "%s: the driver does not know the buffer's memory at 0x%llx (host-only "
                           "memory: pageable, not registered)",
                           what, (unsigned long long)ptr);
    if (ptr < start || ptr - start > range || size > range - (size_t)(ptr - start))
        return cubuf__fail(CUBUF_ERROR_NOT_SUPPORTED,
                           "%s: the buffer [0x%llx, +%zu) is not inside the one allocation the "
                           "driver reports there [0x%llx, +%zu)",
                           what, (unsigned long long)ptr, size, (unsigned long long)start, range);
    span->base = start;
    span->extent = range;
    span->offset = (size_t)(ptr - start);
    span->handle_types = (unsigned)handle_types;
    /* Not among the plural query's attributes. A refusal (memory the
     * attribute does not describe, a driver without the entry) reads as
     * not capable. */
    uint64_t rdma = 0;
    if (CU_CALL(cuPointerGetAttribute, &rdma, CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE, ptr) !=
        CUDA_SUCCESS)
        rdma = 0;
    span->rdma = rdma != 0;
    return CUBUF_SUCCESS;
}

void cubuf__span_free(cubuf_span_t *span)
{
    free(span->chunks);
    span->chunks = NULL;
    span->nchunks = 0;
}

/* The creation properties of one physical allocation of virtual memory. */
static cubuf_status_t chunk_props(const cubuf_vmm_chunk_t *c, const char *what, unsigned *types,
                                  bool *rdma)
{
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    cubuf_status_t st = CU(cuMemGetAllocationPropertiesFromHandle, &prop, c->handle);
    if (st != CUBUF_SUCCESS) {
        cubuf__detail_append("%s", what);
        return st;
    }
    *types = (unsigned)prop.requestedHandleTypes;
    *rdma = prop.allocFlags.gpuDirectRDMACapable != 0;
    return CUBUF_SUCCESS;
}

/* ---- the queries ------------------------------------------------------------- */

cubuf_status_t cubuf_buffer_memory_info(const cubuf_buffer_t *buf, cubuf_memory_info_t *info)
{
    static const char what[] = "cubuf_buffer_memory_info";
    CHECK_ARG(info, "%s: info is NULL", what);
    cubuf_status_t st = cubuf__struct_check(what, "cubuf_memory_info_t", info->struct_size,
                                            CUBUF_MEMORY_INFO_SIZE_V1, sizeof *info);
    if (st != CUBUF_SUCCESS) return st;
    cubuf_ctx_guard_t g;
    if ((st = cubuf__span_enter(buf, what, &g)) != CUBUF_SUCCESS) return st;
    cubuf_span_t s;
    if ((st = cubuf__span_get(buf, what, &s)) != CUBUF_SUCCESS) goto out;
    cubuf_memory_info_t m = CUBUF_MEMORY_INFO_INIT;
    m.base = s.base;
    m.extent = s.extent;
    m.offset = s.offset;
    m.buffer_id = s.buffer_id;
    m.handle_types = s.handle_types;
    m.gpu_direct_rdma = s.rdma;
    m.allocation_count = s.chunks ? s.nchunks : 1;
    if (s.chunks) {
        m.handle_types = ~0u;
        m.gpu_direct_rdma = true;
        for (size_t i = 0; i < s.nchunks; i++) {
            unsigned types = 0;
            bool rdma = false;
            if ((st = chunk_props(&s.chunks[i], what, &types, &rdma)) != CUBUF_SUCCESS) break;
            m.handle_types &= types;
            m.gpu_direct_rdma = m.gpu_direct_rdma && rdma;
        }
    }
    cubuf__span_free(&s);
    if (st == CUBUF_SUCCESS) cubuf__struct_out(info, &m, sizeof m);
out:
    cubuf__ctx_pop(&g);
    return st;
}

cubuf_status_t cubuf_buffer_physical_allocation(const cubuf_buffer_t *buf, size_t index,
                                                cubuf_physical_info_t *info)
{
    static const char what[] = "cubuf_buffer_physical_allocation";
    CHECK_ARG(info, "%s: info is NULL", what);
    cubuf_status_t st = cubuf__struct_check(what, "cubuf_physical_info_t", info->struct_size,
                                            CUBUF_PHYSICAL_INFO_SIZE_V1, sizeof *info);
    if (st != CUBUF_SUCCESS) return st;
    cubuf_ctx_guard_t g;
    if ((st = cubuf__span_enter(buf, what, &g)) != CUBUF_SUCCESS) return st;
    cubuf_span_t s;
    if ((st = cubuf__span_get(buf, what, &s)) != CUBUF_SUCCESS) goto out;
    size_t count = s.chunks ? s.nchunks : 1;
    cubuf_physical_info_t p = CUBUF_PHYSICAL_INFO_INIT;
    if (index >= count) {
        st = cubuf__fail(CUBUF_ERROR_OUT_OF_RANGE,
                         "%s: index %zu, but the buffer lies on %zu physical allocation(s)", what,
                         index, count);
    } else if (s.chunks) {
        p.base = s.base + s.chunks[index].offset;
        p.size = s.chunks[index].size;
        st = chunk_props(&s.chunks[index], what, &p.handle_types, &p.gpu_direct_rdma);
    } else {
        p.base = s.base;
        p.size = s.extent;
        p.handle_types = s.handle_types;
        p.gpu_direct_rdma = s.rdma;
    }
    cubuf__span_free(&s);
    if (st == CUBUF_SUCCESS) cubuf__struct_out(info, &p, sizeof p);
out:
    cubuf__ctx_pop(&g);
    return st;
}
