/* TEMPORARY stand-ins for pool.c, vmm.c and ipc.c (driver-mem replaces this
 * file with them): every pool, VMM and legacy IPC entry point is
 * unsupported. */
#include "fake.h"

int td_mem_can(const char *what)
{
    (void)what;
    return -1;
}

CUresult td_cuMemAllocAsync(CUdeviceptr_v2 *dptr, size_t bytesize, CUstream hStream)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemAllocFromPoolAsync(CUdeviceptr_v2 *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemFreeAsync(CUdeviceptr_v2 dptr, CUstream hStream)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps_v1 *poolProps)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemPoolDestroy(CUmemoryPool pool)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemPoolSetAccess(CUmemoryPool pool, const CUmemAccessDesc_v1 *map, size_t count)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemPoolGetAccess(CUmemAccess_flags *flags, CUmemoryPool memPool, CUmemLocation_v1 *location)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuDeviceGetDefaultMemPool(CUmemoryPool *pool_out, CUdevice_v1 dev)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice_v1 dev)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemGetDefaultMemPool(CUmemoryPool *pool_out, CUmemLocation *location, CUmemAllocationType type)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemPoolExportToShareableHandle(void *handle_out, CUmemoryPool pool, CUmemAllocationHandleType handleType, unsigned long long flags)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemPoolImportFromShareableHandle(CUmemoryPool *pool_out, void *handle, CUmemAllocationHandleType handleType, unsigned long long flags)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemPoolExportPointer(CUmemPoolPtrExportData_v1 *shareData_out, CUdeviceptr_v2 ptr)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemPoolImportPointer(CUdeviceptr_v2 *ptr_out, CUmemoryPool pool, CUmemPoolPtrExportData_v1 *shareData)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemAddressReserve(CUdeviceptr_v2 *ptr, size_t size, size_t alignment, CUdeviceptr_v2 addr, unsigned long long flags)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemAddressFree(CUdeviceptr_v2 ptr, size_t size)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemCreate(CUmemGenericAllocationHandle_v1 *handle, size_t size, const CUmemAllocationProp_v1 *prop, unsigned long long flags)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemRelease(CUmemGenericAllocationHandle_v1 handle)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemMap(CUdeviceptr_v2 ptr, size_t size, size_t offset, CUmemGenericAllocationHandle_v1 handle, unsigned long long flags)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemUnmap(CUdeviceptr_v2 ptr, size_t size)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemSetAccess(CUdeviceptr_v2 ptr, size_t size, const CUmemAccessDesc_v1 *desc, size_t count)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemGetAccess(unsigned long long *flags, const CUmemLocation_v1 *location, CUdeviceptr_v2 ptr)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp_v1 *prop, CUmemAllocationGranularity_flags option)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle_v1 handle, CUmemAllocationHandleType handleType, unsigned long long flags)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemImportFromShareableHandle(CUmemGenericAllocationHandle_v1 *handle, void *osHandle, CUmemAllocationHandleType shHandleType)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemRetainAllocationHandle(CUmemGenericAllocationHandle_v1 *handle, void *addr)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp_v1 *prop, CUmemGenericAllocationHandle_v1 handle)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuIpcGetMemHandle(CUipcMemHandle_v1 *pHandle, CUdeviceptr_v2 dptr)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuIpcOpenMemHandle(CUdeviceptr_v2 *pdptr, CUipcMemHandle_v1 handle, unsigned int Flags)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuIpcCloseMemHandle(CUdeviceptr_v2 dptr)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

