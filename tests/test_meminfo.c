/* The registration-cache queries (cubuf_buffer_memory_info,
 * cubuf_buffer_physical_allocation): base, extent, offset, allocation count
 * and handle types of cuMemAlloc, pool and virtual memory, slices; a VMM
 * grow in place keeps the base; RDMA capability where the device has it;
 * the errors. */
#include "dist_test.h"
#include "cubuf/caching.h"

static cubuf_memory_info_t info_of(const cubuf_buffer_t *buf)
{
    cubuf_memory_info_t m = CUBUF_MEMORY_INFO_INIT;
    T_REQUIRE(cubuf_buffer_memory_info(buf, &m));
    return m;
}

static cubuf_physical_info_t physical(const cubuf_buffer_t *buf, size_t i)
{
    cubuf_physical_info_t p = CUBUF_PHYSICAL_INFO_INIT;
    T_REQUIRE(cubuf_buffer_physical_allocation(buf, i, &p));
    return p;
}

static void allocations(void)
{
    const size_t mib = (size_t)1 << 20;
    cubuf_resource_t *res = NULL;
    cubuf_buffer_t *a = NULL, *b = NULL, *slice = NULL;
    T_REQUIRE(cubuf_sync_device_resource_create(0, &res));
    T_REQUIRE(cubuf_resource_allocate(res, mib, CU_STREAM_LEGACY, &a));
    T_REQUIRE(cubuf_resource_allocate(res, mib, CU_STREAM_LEGACY, &b));
    cubuf_memory_info_t ma = info_of(a), mb = info_of(b);
    T_CHECK(ma.base == cubuf_buffer_ptr(a) && ma.offset == 0 && ma.extent >= mib);
    T_CHECK(ma.allocation_count == 1);
    T_CHECK(ma.buffer_id != 0 && mb.buffer_id != 0 && ma.buffer_id != mb.buffer_id);
    T_REQUIRE(cubuf_buffer_slice(a, 4096 + 8, 100, &slice));
    cubuf_memory_info_t ms = info_of(slice);
    T_CHECK(ms.base == ma.base && ms.extent == ma.extent && ms.offset == 4096 + 8);
    T_CHECK(ms.buffer_id == ma.buffer_id);
    cubuf_physical_info_t p = physical(slice, 0);
    T_CHECK(p.base == ma.base && p.size == ma.extent);
    T_CHECK(p.handle_types == ma.handle_types && p.gpu_direct_rdma == ma.gpu_direct_rdma);
    cubuf_physical_info_t none = CUBUF_PHYSICAL_INFO_INIT;
    T_STATUS(cubuf_buffer_physical_allocation(slice, 1, &none), CUBUF_ERROR_OUT_OF_RANGE);
    T_CHECK(none.size == 0);
    cubuf_buffer_release(slice);
    cubuf_buffer_release(b);
    cubuf_buffer_release(a);
    cubuf_resource_release(res);

    /* Pool memory: one allocation holding the buffer. */
    cubuf_device_resource_options_t po = CUBUF_DEVICE_RESOURCE_OPTIONS_INIT;
    po.private_pool = true;
    T_REQUIRE(cubuf_device_resource_create(0, &po, &res));
    T_REQUIRE(cubuf_resource_allocate(res, mib, CU_STREAM_LEGACY, &a));
    ma = info_of(a);
    T_CHECK(ma.base <= cubuf_buffer_ptr(a) && ma.offset == cubuf_buffer_ptr(a) - ma.base);
    T_CHECK(ma.offset + mib <= ma.extent && ma.allocation_count == 1);
    T_OK(cubuf_buffer_close(a));
    cubuf_buffer_release(a);
    cubuf_resource_release(res);
}

static void virtual_memory(const cubuf_dist_caps_t *caps)
{
    cubuf_vmm_options_t o = CUBUF_VMM_OPTIONS_INIT;
    o.handle_type = CUBUF_VMM_HANDLE_POSIX_FD;
    cubuf_resource_t *res = NULL;
    cubuf_buffer_t *one = NULL, *grown = NULL, *slice = NULL;
    size_t gran = 0;
    T_REQUIRE(cubuf_vmm_resource_create(0, &o, &res));
    T_REQUIRE(cubuf_vmm_granularity(res, &gran));
    T_REQUIRE(cubuf_resource_allocate(res, gran, CU_STREAM_LEGACY, &one));
    CUdeviceptr p = cubuf_buffer_ptr(one);
    cubuf_memory_info_t m = info_of(one);
    T_CHECK(m.base == p && m.extent == gran && m.offset == 0 && m.allocation_count == 1);
    T_CHECK(m.handle_types == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    /* A grow in place keeps the base and adds the new allocation after it. */
    T_REQUIRE(cubuf_vmm_modify_allocation(res, one, 3 * gran, NULL, &grown));
    T_CHECK(cubuf_buffer_ptr(grown) == p);
    m = info_of(grown);
    T_CHECK(m.base == p && m.extent == 3 * gran && m.offset == 0 && m.allocation_count == 2);
    T_CHECK(m.handle_types == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    cubuf_physical_info_t p0 = physical(grown, 0), p1 = physical(grown, 1);
    T_CHECK(p0.base == p && p0.size == gran);
    T_CHECK(p1.base == p + gran && p1.size == 2 * gran);
    T_CHECK(p1.handle_types == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    cubuf_physical_info_t none = CUBUF_PHYSICAL_INFO_INIT;
    T_STATUS(cubuf_buffer_physical_allocation(grown, 2, &none), CUBUF_ERROR_OUT_OF_RANGE);
    /* The buffer grown from still covers its one allocation. */
    m = info_of(one);
    T_CHECK(m.base == p && m.extent == gran && m.allocation_count == 1);
    /* Slices: the allocations they overlap, the offset from the first. */
    T_REQUIRE(cubuf_buffer_slice(grown, gran - 4096, 8192, &slice));
    m = info_of(slice);
    T_CHECK(m.base == p && m.extent == 3 * gran && m.offset == gran - 4096 && m.allocation_count == 2);
    cubuf_buffer_release(slice);
    T_REQUIRE(cubuf_buffer_slice(grown, gran + 4096, 4096, &slice));
    m = info_of(slice);
    T_CHECK(m.base == p + gran && m.extent == 2 * gran && m.offset == 4096 && m.allocation_count == 1);
    p0 = physical(slice, 0);
    T_CHECK(p0.base == p + gran && p0.size == 2 * gran);
    cubuf_buffer_release(slice);
    cubuf_buffer_release(grown);
    cubuf_buffer_release(one);
    cubuf_resource_release(res);

    /* Without handle types: none; RDMA-capable memory, where the device has it. */
    cubuf_vmm_options_t ro = CUBUF_VMM_OPTIONS_INIT;
    ro.gpu_direct_rdma = caps->gpu_direct_rdma_vmm;
    T_REQUIRE(cubuf_vmm_resource_create(0, &ro, &res));
    T_REQUIRE(cubuf_resource_allocate(res, gran, CU_STREAM_LEGACY, &one));
    m = info_of(one);
    T_CHECK(m.handle_types == 0);
    if (caps->gpu_direct_rdma_vmm) {
        T_CHECK(m.gpu_direct_rdma);
        T_CHECK(physical(one, 0).gpu_direct_rdma);
    }
    cubuf_buffer_release(one);
    /* The same memory through a statistics adaptor, and a caching resource
     * over that: virtual memory still, described by its physical allocation
     * (the creation properties), not by the pointer attributes. */
    cubuf_resource_t *stats = NULL, *cache = NULL;
    T_REQUIRE(cubuf_statistics_adaptor_create(res, &stats));
    T_REQUIRE(cubuf_caching_resource_create(stats, NULL, &cache));
    cubuf_resource_t *over[2] = {stats, cache};
    cubuf_context_t *ctx = NULL; /* the caching resource's default stream is the current context's */
    T_REQUIRE(cubuf_context_create(0, &ctx));
    T_CU(cuCtxSetCurrent, t_cu(ctx));
    for (int k = 0; k < 2; k++) {
        T_REQUIRE(cubuf_resource_allocate(over[k], gran / 2, CU_STREAM_LEGACY, &one));
        m = info_of(one);
        T_CHECK(m.base == cubuf_buffer_ptr(one) && m.extent == gran && m.offset == 0);
        T_CHECK(m.allocation_count == 1 && m.handle_types == 0);
        T_CHECK(physical(one, 0).handle_types == 0);
        if (caps->gpu_direct_rdma_vmm) T_CHECK(m.gpu_direct_rdma);
        T_REQUIRE(cubuf_buffer_slice(one, 4096, 4096, &slice));
        m = info_of(slice);
        T_CHECK(m.base == cubuf_buffer_ptr(one) && m.offset == 4096 && m.handle_types == 0);
        cubuf_buffer_release(slice);
        cubuf_buffer_release(one);
    }
    /* A view of virtual memory is described by the pointer attributes: the
     * handle types its physical allocation was created with, as the
     * driver's CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES reports them (none
     * here; POSIX fd for an exportable resource's memory). */
    cubuf_resource_t *posix = NULL;
    cubuf_vmm_options_t xo = CUBUF_VMM_OPTIONS_INIT;
    xo.handle_type = CUBUF_VMM_HANDLE_POSIX_FD;
    T_REQUIRE(cubuf_vmm_resource_create(0, &xo, &posix));
    cubuf_resource_t *kinds[2] = {res, posix};
    for (int k = 0; k < 2; k++) {
        cubuf_buffer_t *view = NULL;
        T_REQUIRE(cubuf_resource_allocate(kinds[k], gran, CU_STREAM_LEGACY, &one));
        T_REQUIRE(cubuf_buffer_view(cubuf_buffer_ptr(one), gran, &view));
        m = info_of(view);
        T_CHECK(m.base == cubuf_buffer_ptr(one) && m.extent == gran && m.allocation_count == 1);
        T_CHECK(m.handle_types == (k ? (unsigned)CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : 0u));
        T_CHECK(physical(view, 0).handle_types == m.handle_types);
        cubuf_buffer_release(view);
        cubuf_buffer_release(one);
    }
    cubuf_resource_release(posix);
    cubuf_resource_release(cache);
    cubuf_resource_release(stats);
    T_CU(cuCtxSetCurrent, NULL);
    cubuf_context_destroy(ctx);
    cubuf_resource_release(res);
}

static void errors(void)
{
    cubuf_memory_info_t m = CUBUF_MEMORY_INFO_INIT;
    cubuf_physical_info_t p = CUBUF_PHYSICAL_INFO_INIT;
    T_STATUS(cubuf_buffer_memory_info(NULL, &m), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_buffer_physical_allocation(NULL, 0, &p), CUBUF_ERROR_INVALID_ARGUMENT);
    cubuf_resource_t *res = NULL;
    cubuf_buffer_t *buf = NULL;
    T_REQUIRE(cubuf_sync_device_resource_create(0, &res));
    T_REQUIRE(cubuf_resource_allocate(res, 4096, CU_STREAM_LEGACY, &buf));
    T_STATUS(cubuf_buffer_memory_info(buf, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    cubuf_memory_info_t small = CUBUF_MEMORY_INFO_INIT;
    small.struct_size = offsetof(cubuf_memory_info_t, extent);
    T_STATUS(cubuf_buffer_memory_info(buf, &small), CUBUF_ERROR_INVALID_ARGUMENT);
    T_OK(cubuf_buffer_close(buf));
    T_STATUS(cubuf_buffer_memory_info(buf, &m), CUBUF_ERROR_CLOSED);
    T_STATUS(cubuf_buffer_physical_allocation(buf, 0, &p), CUBUF_ERROR_CLOSED);
    cubuf_buffer_release(buf);
    T_REQUIRE(cubuf_resource_allocate(res, 0, CU_STREAM_LEGACY, &buf));
    T_STATUS(cubuf_buffer_memory_info(buf, &m), CUBUF_ERROR_INVALID_ARGUMENT);
    cubuf_buffer_release(buf);
    cubuf_resource_release(res);
    static unsigned char host[4096];
    T_REQUIRE(cubuf_buffer_view((CUdeviceptr)(uintptr_t)host, sizeof host, &buf));
    T_STATUS(cubuf_buffer_memory_info(buf, &m), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(strstr(cubuf_last_error(), "host-only") != NULL);
    cubuf_buffer_release(buf);
    T_CHECK(m.base == 0 && m.extent == 0 && p.size == 0);
}

int main(void)
{
    t_require_gpu();
    cubuf_dist_caps_t caps = CUBUF_DIST_CAPS_INIT;
    T_REQUIRE(cubuf_device_dist_caps(0, &caps));
    allocations();
    virtual_memory(&caps);
    errors();
    return t_finish("test_meminfo");
}
