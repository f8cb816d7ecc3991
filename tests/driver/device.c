/* Devices: init, version, devices and their attributes, error names, and the
 * per-device memory accounting behind cuMemGetInfo. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "fake.h"

static atomic_bool initialized;

CUresult td_check_init(void)
{
    return atomic_load(&initialized) ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
}

CUresult td_check_device(CUdevice dev)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    return dev >= 0 && dev < TD_DEVICE_COUNT ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

static pthread_mutex_t mem_lock = PTHREAD_MUTEX_INITIALIZER;
static size_t mem_used[TD_DEVICE_COUNT];

CUresult td_mem_charge(int device, size_t bytes)
{
    if (device < 0 || device >= TD_DEVICE_COUNT) return CUDA_ERROR_INVALID_DEVICE;
    CUresult r = CUDA_SUCCESS;
    pthread_mutex_lock(&mem_lock);
    if (bytes > TD_TOTAL_MEM - mem_used[device]) r = CUDA_ERROR_OUT_OF_MEMORY;
    else mem_used[device] += bytes;
    pthread_mutex_unlock(&mem_lock);
    return r;
}

void td_mem_uncharge(int device, size_t bytes)
{
    if (device < 0 || device >= TD_DEVICE_COUNT) return;
    pthread_mutex_lock(&mem_lock);
    mem_used[device] -= bytes < mem_used[device] ? bytes : mem_used[device];
    pthread_mutex_unlock(&mem_lock);
}

size_t td_mem_used(int device)
{
    if (device < 0 || device >= TD_DEVICE_COUNT) return 0;
    pthread_mutex_lock(&mem_lock);
    size_t used = mem_used[device];
    pthread_mutex_unlock(&mem_lock);
    return used;
}

CUresult td_cuInit(unsigned int Flags)
{
    if (Flags != 0) return CUDA_ERROR_INVALID_VALUE;
    atomic_store(&initialized, true);
    return CUDA_SUCCESS;
}

CUresult td_cuDriverGetVersion(int *driverVersion)
{
    if (!driverVersion) return CUDA_ERROR_INVALID_VALUE;
    *driverVersion = TD_DRIVER_VERSION;
    return CUDA_SUCCESS;
}

/* The names and strings of the errors this driver returns (and the ones
 * tests inject); any other valid-looking code gets a generic answer. */
#define TD_ERRORS(X)                                                                       \
    X(CUDA_SUCCESS, "no error")                                                            \
    X(CUDA_ERROR_INVALID_VALUE, "invalid argument")                                        \
    X(CUDA_ERROR_OUT_OF_MEMORY, "out of memory")                                           \
    X(CUDA_ERROR_NOT_INITIALIZED, "initialization error")                                  \
    X(CUDA_ERROR_DEINITIALIZED, "driver shutting down")                                    \
    X(CUDA_ERROR_NO_DEVICE, "no CUDA-capable device is detected")                          \
    X(CUDA_ERROR_INVALID_DEVICE, "invalid device ordinal")                                 \
    X(CUDA_ERROR_INVALID_CONTEXT, "invalid device context")                                \
    X(CUDA_ERROR_CONTEXT_ALREADY_CURRENT, "context already current")                       \
    X(CUDA_ERROR_MAP_FAILED, "mapping of buffer object failed")                            \
    X(CUDA_ERROR_ALREADY_MAPPED, "resource already mapped")                                \
    X(CUDA_ERROR_INVALID_HANDLE, "invalid resource handle")                                \
    X(CUDA_ERROR_ILLEGAL_STATE, "the operation cannot be performed in the present state")  \
    X(CUDA_ERROR_NOT_FOUND, "named symbol not found")                                      \
    X(CUDA_ERROR_NOT_READY, "device not ready")                                            \
    X(CUDA_ERROR_ILLEGAL_ADDRESS, "an illegal memory access was encountered")              \
    X(CUDA_ERROR_LAUNCH_FAILED, "unspecified launch failure")                              \
    X(CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED, "peer access is already enabled")            \
    X(CUDA_ERROR_PEER_ACCESS_NOT_ENABLED, "peer access has not been enabled")              \
    X(CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE, "primary context active")                         \
    X(CUDA_ERROR_CONTEXT_IS_DESTROYED, "context is destroyed")                             \
    X(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, "part or all of the requested memory range is already mapped") \
    X(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, "pointer does not correspond to a registered memory region") \
    X(CUDA_ERROR_NOT_PERMITTED, "operation not permitted")                                 \
    X(CUDA_ERROR_NOT_SUPPORTED, "operation not supported")                                 \
    X(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "operation not permitted when stream is capturing") \
    X(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "operation failed due to a previous error during capture") \
    X(CUDA_ERROR_STREAM_CAPTURE_MERGE, "operation would result in a merge of separate capture sequences") \
    X(CUDA_ERROR_STREAM_CAPTURE_UNMATCHED, "capture was not initiated in this stream")     \
    X(CUDA_ERROR_STREAM_CAPTURE_UNJOINED, "capturing stream has unjoined work")            \
    X(CUDA_ERROR_STREAM_CAPTURE_ISOLATION, "dependency created on uncaptured work in another stream") \
    X(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, "operation would make the legacy stream depend on a capturing blocking stream") \
    X(CUDA_ERROR_CAPTURED_EVENT, "operation not permitted on an event last recorded in a capturing stream") \
    X(CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD, "attempt to terminate a thread-local capture sequence from another thread") \
    X(CUDA_ERROR_UNKNOWN, "unknown error")

CUresult td_cuGetErrorName(CUresult error, const char **pStr)
{
    if (!pStr) return CUDA_ERROR_INVALID_VALUE;
    switch (error) {
#define TD_ERROR_NAME_(code, text) \
    case code: *pStr = #code; return CUDA_SUCCESS;
        TD_ERRORS(TD_ERROR_NAME_)
#undef TD_ERROR_NAME_
    default: *pStr = NULL; return CUDA_ERROR_INVALID_VALUE;
    }
}

CUresult td_cuGetErrorString(CUresult error, const char **pStr)
{
    if (!pStr) return CUDA_ERROR_INVALID_VALUE;
    switch (error) {
#define TD_ERROR_STRING_(code, text) \
    case code: *pStr = text; return CUDA_SUCCESS;
        TD_ERRORS(TD_ERROR_STRING_)
#undef TD_ERROR_STRING_
    default: *pStr = NULL; return CUDA_ERROR_INVALID_VALUE;
    }
}

CUresult td_cuDeviceGet(CUdevice_v1 *device, int ordinal)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    if (ordinal < 0 || ordinal >= TD_DEVICE_COUNT) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

CUresult td_cuDeviceGetCount(int *count)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    *count = TD_DEVICE_COUNT;
    return CUDA_SUCCESS;
}

CUresult td_cuDeviceGetName(char *name, int len, CUdevice_v1 dev)
{
    CUresult r = td_check_device(dev);
    if (r != CUDA_SUCCESS) return r;
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    snprintf(name, (size_t)len, "cubuf test driver device %d", dev);
    return CUDA_SUCCESS;
}

CUresult td_cuDeviceTotalMem(size_t *bytes, CUdevice_v1 dev)
{
    CUresult r = td_check_device(dev);
    if (r != CUDA_SUCCESS) return r;
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    *bytes = TD_TOTAL_MEM;
    return CUDA_SUCCESS;
}

/* A compute capability 9.0 device with everything cubuf uses, except what
 * host memory cannot honestly offer (fabric handles, GPUDirect RDMA). */
static int attribute(CUdevice_attribute a, int dev)
{
    switch (a) {
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: return 9;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: return 0;
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: return 0x10 + dev;
    case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID: return 0;
    case CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID: return 0;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: return 1024;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: return 32;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: return 4;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING:
    case CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY:
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS:
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY:
    case CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM:
    case CU_DEVICE_ATTRIBUTE_HOST_MEMORY_POOLS_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_HOST_NUMA_MEMORY_POOLS_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_DIRECT_MANAGED_MEM_ACCESS_FROM_HOST:
        return 1;
    case CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES:
        return CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    case CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID: return 0;
    default: return 0; /* fabric handles, GPUDirect RDMA, kernels' limits... */
    }
}

CUresult td_cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice_v1 dev)
{
    CUresult r = td_check_device(dev);
    if (r != CUDA_SUCCESS) return r;
    if (!pi || (int)attrib <= 0 || attrib >= CU_DEVICE_ATTRIBUTE_MAX) return CUDA_ERROR_INVALID_VALUE;
    *pi = attribute(attrib, dev);
    return CUDA_SUCCESS;
}

CUresult td_cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice_v1 dev, CUdevice_v1 peerDev)
{
    CUresult r = td_check_device(dev);
    if (r == CUDA_SUCCESS) r = td_check_device(peerDev);
    if (r != CUDA_SUCCESS) return r;
    if (!canAccessPeer) return CUDA_ERROR_INVALID_VALUE;
    /* As the real driver: a device is not its own peer. */
    *canAccessPeer = dev != peerDev;
    return CUDA_SUCCESS;
}
