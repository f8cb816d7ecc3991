/* Device properties for `cubuf info` and for callers. */
#include <string.h>

#include "internal.h"

/* VMM granularity of a pinned, device-located allocation. */
static cubuf_status_t granularity(CUdevice dev, CUmemAllocationGranularity_flags which, size_t *out)
{
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = (int)dev;
    return CU(cuMemGetAllocationGranularity, out, &prop, which);
}

cubuf_status_t cubuf_device_get_info(int ordinal, cubuf_device_info_t *info)
{
    CHECK_ARG(info, "cubuf_device_get_info: info is NULL");
    cubuf_status_t st = cubuf__struct_check("cubuf_device_get_info", "cubuf_device_info_t",
                                            info->struct_size, CUBUF_DEVICE_INFO_SIZE_V1,
                                            sizeof *info);
    if (st != CUBUF_SUCCESS) return st;
    CUdevice dev;
    if ((st = cubuf__device_get(ordinal, &dev)) != CUBUF_SUCCESS) return st;
    cubuf_device_info_t d = CUBUF_DEVICE_INFO_INIT;
    d.ordinal = ordinal;
    int v = 0;
    CHECK(CU(cuDeviceGetName, d.name, (int)sizeof d.name, dev));
    CHECK(CU(cuDeviceTotalMem, &d.total_memory, dev));
    CHECK(cubuf__device_attr(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, &d.cc_major));
    CHECK(cubuf__device_attr(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, &d.cc_minor));
    CHECK(cubuf__device_attr(dev, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, &d.pci_bus_id));
    CHECK(cubuf__device_attr(dev, CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID, &d.pci_device_id));
    CHECK(cubuf__device_attr(dev, CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, &d.pci_domain_id));
#define FLAG(field, a)           \
    CHECK(cubuf__device_attr(dev, (a), &v));   \
    d.field = v != 0;
    FLAG(unified_addressing, CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING)
    FLAG(managed_memory, CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY)
    FLAG(concurrent_managed_access, CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS)
    FLAG(vmm_supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)
    FLAG(posix_fd_handles, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)
    FLAG(fabric_handles, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED)
    FLAG(gpu_direct_rdma_vmm, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED)
    FLAG(memory_pools, CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)
    FLAG(host_register, CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED)
    FLAG(can_map_host_memory, CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY)
#undef FLAG
    CHECK(cubuf__device_attr(dev, CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES, &v));
    d.pool_handle_types = (unsigned)v;
    if (d.vmm_supported) {
        CHECK(granularity(dev, CU_MEM_ALLOC_GRANULARITY_MINIMUM, &d.granularity_minimum));
        CHECK(granularity(dev, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED, &d.granularity_recommended));
    }
    cubuf__struct_out(info, &d, sizeof d);
    return CUBUF_SUCCESS;
fail:
    cubuf__detail_append("device %d", ordinal);
    return st;
}

cubuf_status_t cubuf_device_can_access_peer(int ordinal, int peer, bool *can_access)
{
    CHECK_ARG(can_access, "cubuf_device_can_access_peer: can_access is NULL");
    CUdevice dev, pdev;
    cubuf_status_t st = cubuf__device_get(ordinal, &dev);
    if (st == CUBUF_SUCCESS) st = cubuf__device_get(peer, &pdev);
    if (st != CUBUF_SUCCESS) return st;
    if (ordinal == peer) {
        *can_access = true;
        return CUBUF_SUCCESS;
    }
    int v = 0;
    if ((st = CU(cuDeviceCanAccessPeer, &v, dev, pdev)) != CUBUF_SUCCESS) return st;
    *can_access = v != 0;
    return CUBUF_SUCCESS;
}
