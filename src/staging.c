/* Pinned staging memory for copies that read their source during the call
 * (CUBUF_SRC_ACCESS_DURING_API_CALL, copy.c).
 *
 * One host-located pool per device, made on first use and kept for the
 * process with a reference to the device's primary context (it holds no
 * memory between copies: release threshold 0). The
 * block must be pinned: a copy from pageable memory makes the driver wait
 * for the stream, which is what the option is used to avoid. Its reuse
 * follows no stream dependencies (neither event nor internal ones): a block
 * is handed out again only once its free has really completed, so the host
 * may write a new block as soon as its allocation on an idle stream has
 * been synchronized, whatever the copying streams are still doing. */
#include <pthread.h>
#include <string.h>

#include "internal.h"
#include "staging.h"

#define MAX_DEVICES 64

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static CUmemoryPool g_pools[MAX_DEVICES];

static cubuf_status_t set_attr(CUmemoryPool pool, CUmemPool_attribute attr, int value)
{
    cubuf_status_t st = CU(cuMemPoolSetAttribute, pool, attr, &value);
    if (st != CUBUF_SUCCESS) cubuf__detail_append("staging pool attribute %d", (int)attr);
    return st;
}

static cubuf_status_t make_pool(CUdevice dev, CUmemoryPool *out)
{
    /* Drivers before 12.6 do not know the attribute at all
     * (CUDA_ERROR_INVALID_VALUE); any other failure is the driver's. */
    int v = 0;
    CUresult r = CU_CALL(cuDeviceGetAttribute, &v, CU_DEVICE_ATTRIBUTE_HOST_MEMORY_POOLS_SUPPORTED, dev);
    if (r != CUDA_SUCCESS && r != CUDA_ERROR_INVALID_VALUE)
        return cubuf__cu_status(r, "cuDeviceGetAttribute");
    if (r != CUDA_SUCCESS || !v)
        return cubuf__fail(CUBUF_ERROR_NOT_SUPPORTED,
                           "src_access_order DURING_API_CALL: device %d has no host memory pools "
                           "(or this driver cannot say), which cubuf reads the source into during "
                           "the call", (int)dev);
    /* The pool must outlive every context of the device: hold the primary
     * context for the process, so that releasing the last cubuf context
     * cannot take the pool with it. */
    CUcontext primary = NULL;
    cubuf_status_t st;
    if ((st = CU(cuDevicePrimaryCtxRetain, &primary, dev)) != CUBUF_SUCCESS) return st;
    CUmemPoolProps pp;
    memset(&pp, 0, sizeof pp);
    pp.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    pp.handleTypes = CU_MEM_HANDLE_TYPE_NONE;
    pp.location.type = CU_MEM_LOCATION_TYPE_HOST;
    CUmemoryPool pool = NULL;
    if ((st = CU(cuMemPoolCreate, &pool, &pp)) != CUBUF_SUCCESS) {
        CU_CALL(cuDevicePrimaryCtxRelease, dev);
        return st;
    }
    CUmemAccessDesc access;
    memset(&access, 0, sizeof access);
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = (int)dev;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    st = CU(cuMemPoolSetAccess, pool, &access, 1);
    if (st == CUBUF_SUCCESS) st = set_attr(pool, CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES, 0);
    if (st == CUBUF_SUCCESS) st = set_attr(pool, CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES, 0);
    if (st != CUBUF_SUCCESS) {
        r = CU_CALL(cuMemPoolDestroy, pool);
        if (r != CUDA_SUCCESS) cubuf__warn(cubuf__cu_map(r), "cuMemPoolDestroy failed while unwinding");
        CU_CALL(cuDevicePrimaryCtxRelease, dev);
        return st;
    }
    *out = pool;
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf__staging_pool(CUmemoryPool *out)
{
    CUdevice dev = 0;
    cubuf_status_t st = CU(cuCtxGetDevice, &dev);
    if (st != CUBUF_SUCCESS) return st;
    if (dev < 0 || dev >= MAX_DEVICES)
        return cubuf__fail(CUBUF_ERROR_NOT_SUPPORTED, "device %d: cubuf stages copies for devices "
                           "0 to %d only", (int)dev, MAX_DEVICES - 1);
    pthread_mutex_lock(&g_lock);
    if (!g_pools[dev]) st = make_pool(dev, &g_pools[dev]);
    if (st == CUBUF_SUCCESS) *out = g_pools[dev];
    pthread_mutex_unlock(&g_lock);
    return st;
}
