/* Structs of their first released size (CUBUF_<TYPE>_SIZE_V1) doing real
 * work on the GPU (test_abi.c checks the sizes without one): device info
 * and VMM options written only up to struct_size, with the values a
 * full-size struct gets; a VMM resource, a grow and a copy made with
 * version-1 options ending at an inaccessible page; the dist.h queries and
 * a pool's usage written only up to struct_size. */
#include <stdint.h>

#include "abi_test.h"
#include "cubuf/dist.h"

static bool same_info(const cubuf_device_info_t *a, const cubuf_device_info_t *b)
{
    return a->ordinal == b->ordinal && strcmp(a->name, b->name) == 0 &&
           a->total_memory == b->total_memory && a->cc_major == b->cc_major &&
           a->cc_minor == b->cc_minor && a->pci_bus_id == b->pci_bus_id &&
           a->pci_device_id == b->pci_device_id && a->pci_domain_id == b->pci_domain_id &&
           a->unified_addressing == b->unified_addressing &&
           a->managed_memory == b->managed_memory &&
           a->concurrent_managed_access == b->concurrent_managed_access &&
           a->vmm_supported == b->vmm_supported &&
           a->granularity_minimum == b->granularity_minimum &&
           a->granularity_recommended == b->granularity_recommended &&
           a->posix_fd_handles == b->posix_fd_handles && a->fabric_handles == b->fabric_handles &&
           a->gpu_direct_rdma_vmm == b->gpu_direct_rdma_vmm &&
           a->memory_pools == b->memory_pools && a->pool_handle_types == b->pool_handle_types &&
           a->host_register == b->host_register &&
           a->can_map_host_memory == b->can_map_host_memory;
}

static bool same_vmm(const cubuf_vmm_options_t *a, const cubuf_vmm_options_t *b)
{
    return a->allocation_type == b->allocation_type && a->location == b->location &&
           a->location_id == b->location_id && a->handle_type == b->handle_type &&
           a->granularity == b->granularity && a->gpu_direct_rdma == b->gpu_direct_rdma &&
           a->address_hint == b->address_hint && a->address_alignment == b->address_alignment &&
           a->peer_count == b->peer_count && a->owner_access == b->owner_access &&
           a->peer_access == b->peer_access;
}

static void test_device_info(void)
{
    cubuf_device_info_t full = CUBUF_DEVICE_INFO_INIT;
    T_REQUIRE(cubuf_device_get_info(0, &full));
    T_CHECK(full.name[0] != '\0' && full.total_memory > 0);
    cubuf_device_info_t *info = output(CUBUF_DEVICE_INFO_SIZE_V1);
    T_OK(cubuf_device_get_info(0, info));
    T_CHECK(untouched_from(CUBUF_DEVICE_INFO_SIZE_V1) && same_info(info, &full));
    T_CHECK(info->struct_size == CUBUF_DEVICE_INFO_SIZE_V1);
    info = output(sizeof *info + MORE);
    T_OK(cubuf_device_get_info(0, info));
    T_CHECK(untouched_from(sizeof *info) && same_info(info, &full));
    info = output(CUBUF_DEVICE_INFO_SIZE_V1 - 1);
    T_STATUS(cubuf_device_get_info(0, info), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(untouched_from(sizeof(size_t)));
}

static void test_vmm(void)
{
    cubuf_vmm_options_t init = CUBUF_VMM_OPTIONS_INIT;
    init.granularity = CUBUF_VMM_GRANULARITY_MINIMUM;
    const cubuf_vmm_options_t *o = input(&init, sizeof init, CUBUF_VMM_OPTIONS_SIZE_V1);
    cubuf_resource_t *res = NULL;
    T_REQUIRE(cubuf_vmm_resource_create(0, o, &res)); /* the H200 and the test driver have VMM */
    cubuf_vmm_options_t full = CUBUF_VMM_OPTIONS_INIT;
    T_REQUIRE(cubuf_vmm_resource_options(res, &full));
    T_CHECK(full.granularity == CUBUF_VMM_GRANULARITY_MINIMUM);
    cubuf_vmm_options_t *got = output(CUBUF_VMM_OPTIONS_SIZE_V1);
    T_OK(cubuf_vmm_resource_options(res, got));
    T_CHECK(untouched_from(CUBUF_VMM_OPTIONS_SIZE_V1) && same_vmm(got, &full));
    got = output(sizeof *got + MORE);
    T_OK(cubuf_vmm_resource_options(res, got));
    T_CHECK(untouched_from(sizeof *got) && same_vmm(got, &full));

    size_t gran = 0;
    T_REQUIRE(cubuf_vmm_granularity(res, &gran));
    cubuf_buffer_t *buf = NULL, *grown = NULL;
    T_REQUIRE(cubuf_resource_allocate(res, gran, CU_STREAM_PER_THREAD, &buf));
    o = input(&init, sizeof init, CUBUF_VMM_OPTIONS_SIZE_V1);
    T_OK(cubuf_vmm_modify_allocation(res, buf, 2 * gran, o, &grown));
    T_CHECK(cubuf_buffer_size(grown) == 2 * gran);
    cubuf_buffer_release(grown);
    cubuf_buffer_release(buf);
    cubuf_resource_release(res);
}

static void test_copy(void)
{
    cubuf_context_t *ctx = NULL;
    T_REQUIRE(cubuf_context_create(0, &ctx));
    unsigned char data[4096], back[4096];
    for (size_t i = 0; i < sizeof data; i++) data[i] = (unsigned char)(i * 7 + 1);
    cubuf_buffer_t *src = NULL, *dst = NULL, *host = NULL;
    T_REQUIRE(cubuf_context_buffer_from_data(ctx, data, sizeof data, 0, CUBUF_SIZE_REST, &src));
    T_REQUIRE(cubuf_context_new_buffer(ctx, sizeof data, &dst));
    T_REQUIRE(cubuf_context_new_host_buffer(ctx, sizeof data, &host));
    T_REQUIRE(cubuf_context_synchronize(ctx));
    cubuf_copy_options_t init = CUBUF_COPY_OPTIONS_INIT;
    init.prefer_overlap_with_compute = true; /* the last field of version 1 */
    const cubuf_copy_options_t *o = input(&init, sizeof init, CUBUF_COPY_OPTIONS_SIZE_V1);
    T_OK(cubuf_buffer_copy_from(dst, src, CU_STREAM_PER_THREAD, o));
    T_OK(cubuf_buffer_copy_from(host, dst, CU_STREAM_PER_THREAD, NULL));
    T_OK(cubuf_context_synchronize(ctx));
    memcpy(back, (const void *)(uintptr_t)cubuf_buffer_ptr(host), sizeof back);
    T_CHECK(memcmp(back, data, sizeof data) == 0);
    cubuf_buffer_release(src);
    cubuf_buffer_release(dst);
    cubuf_buffer_release(host);
    cubuf_context_destroy(ctx);
}

static bool same_caps(const cubuf_dist_caps_t *a, const cubuf_dist_caps_t *b)
{
    return a->dmabuf == b->dmabuf && a->dmabuf_host_alloc == b->dmabuf_host_alloc &&
           a->gpu_direct_rdma == b->gpu_direct_rdma &&
           a->gpu_direct_rdma_vmm == b->gpu_direct_rdma_vmm &&
           a->fabric_handles == b->fabric_handles;
}

static bool same_memory(const cubuf_memory_info_t *a, const cubuf_memory_info_t *b)
{
    return a->base == b->base && a->extent == b->extent && a->offset == b->offset &&
           a->handle_types == b->handle_types && a->gpu_direct_rdma == b->gpu_direct_rdma &&
           a->allocation_count == b->allocation_count && a->buffer_id == b->buffer_id;
}

static bool same_physical(const cubuf_physical_info_t *a, const cubuf_physical_info_t *b)
{
    return a->base == b->base && a->size == b->size && a->handle_types == b->handle_types &&
           a->gpu_direct_rdma == b->gpu_direct_rdma;
}

static void test_dist_and_stats(void)
{
    cubuf_dist_caps_t caps = CUBUF_DIST_CAPS_INIT;
    T_REQUIRE(cubuf_device_dist_caps(0, &caps));
    OUTPUTS(cubuf_dist_caps_t, CUBUF_DIST_CAPS_SIZE_V1, cubuf_device_dist_caps(0, o_), same_caps,
            caps);
    cubuf_resource_t *res = NULL;
    cubuf_buffer_t *buf = NULL;
    T_REQUIRE(cubuf_device_resource_create(0, NULL, &res));
    T_REQUIRE(cubuf_resource_allocate(res, 1 << 20, CU_STREAM_PER_THREAD, &buf));
    cubuf_memory_info_t mem = CUBUF_MEMORY_INFO_INIT;
    T_REQUIRE(cubuf_buffer_memory_info(buf, &mem));
    OUTPUTS(cubuf_memory_info_t, CUBUF_MEMORY_INFO_SIZE_V1, cubuf_buffer_memory_info(buf, o_),
            same_memory, mem);
    cubuf_physical_info_t phys = CUBUF_PHYSICAL_INFO_INIT;
    T_REQUIRE(cubuf_buffer_physical_allocation(buf, 0, &phys));
    OUTPUTS(cubuf_physical_info_t, CUBUF_PHYSICAL_INFO_SIZE_V1,
            cubuf_buffer_physical_allocation(buf, 0, o_), same_physical, phys);
    /* A pool's usage at every size from the counters alone to all of it:
     * the pool figures (driver queries) are written only as far as they fit. */
    for (size_t n = CUBUF_RESOURCE_STATS_SIZE_V1; n <= sizeof(cubuf_resource_stats_t); n++) {
        cubuf_resource_stats_t *s = output(n);
        T_OK(cubuf_resource_stats(res, s));
        T_CHECK(untouched_from(n) && s->struct_size == n && s->current_count == 1);
    }
    cubuf_buffer_release(buf);
    cubuf_resource_release(res);
}

int main(void)
{
    t_require_gpu();
    guard_init();
    test_device_info();
    test_vmm();
    test_copy();
    test_dist_and_stats();
    return t_finish("test_abi_gpu");
}
