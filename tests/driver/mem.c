/* Memory: allocations, host memory, pointer attributes, copies and fills. */
#include "fake.h"

CUresult td_cuMemGetInfo(size_t *free, size_t *total)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemAlloc(CUdeviceptr_v2 *dptr, size_t bytesize)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemFree(CUdeviceptr_v2 dptr)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemAllocHost(void **pp, size_t bytesize)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemFreeHost(void *p)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemHostGetDevicePointer(CUdeviceptr_v2 *pdptr, void *p, unsigned int Flags)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemHostRegister(void *p, size_t bytesize, unsigned int Flags)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemHostUnregister(void *p)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemAllocManaged(CUdeviceptr_v2 *dptr, size_t bytesize, unsigned int flags)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemAdvise(CUdeviceptr_v2 devPtr, size_t count, CUmem_advise advice, CUmemLocation_v1 location)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemPrefetchAsync(CUdeviceptr_v2 devPtr, size_t count, CUmemLocation_v1 location, unsigned int flags, CUstream hStream)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemGetAddressRange(CUdeviceptr_v2 *pbase, size_t *psize, CUdeviceptr_v2 dptr)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemRangeGetAttribute(void *data, size_t dataSize, CUmem_range_attribute attribute, CUdeviceptr_v2 devPtr, size_t count)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr_v2 ptr)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuPointerGetAttributes(unsigned int numAttributes, CUpointer_attribute *attributes, void **data, CUdeviceptr_v2 ptr)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemcpy(CUdeviceptr_v2 dst, CUdeviceptr_v2 src, size_t ByteCount)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemcpyAsync(CUdeviceptr_v2 dst, CUdeviceptr_v2 src, size_t ByteCount, CUstream hStream)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemcpyHtoD(CUdeviceptr_v2 dstDevice, const void *srcHost, size_t ByteCount)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemcpyDtoH(void *dstHost, CUdeviceptr_v2 srcDevice, size_t ByteCount)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemcpyPeerAsync(CUdeviceptr_v2 dstDevice, CUcontext dstContext, CUdeviceptr_v2 srcDevice, CUcontext srcContext, size_t ByteCount, CUstream hStream)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemsetD8Async(CUdeviceptr_v2 dstDevice, unsigned char uc, size_t N, CUstream hStream)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemsetD16Async(CUdeviceptr_v2 dstDevice, unsigned short us, size_t N, CUstream hStream)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemsetD32Async(CUdeviceptr_v2 dstDevice, unsigned int ui, size_t N, CUstream hStream)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemsetD8(CUdeviceptr_v2 dstDevice, unsigned char uc, size_t N)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult td_cuMemcpyBatchAsync(CUdeviceptr_v2 *dsts, CUdeviceptr_v2 *srcs, size_t *sizes, size_t count, CUmemcpyAttributes_v1 *attrs, size_t *attrIdxs, size_t numAttrs, CUstream hStream)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

