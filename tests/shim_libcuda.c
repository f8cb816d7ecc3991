/* A stand-in for libcuda.so.1 that forwards every entry point to the driver
 * named by $CUBUF_SHIM_TARGET (libcuda.so.1 by default), except that the
 * Nth call of cuMemFreeAsync in the process ($CUBUF_SHIM_FAIL_FREE, 1-based;
 * unset or 0: none) fails with CUDA_ERROR_INVALID_VALUE without freeing,
 * and so does the Nth call of cuMemcpyAsync ($CUBUF_SHIM_FAIL_COPY) without
 * copying. For programs a test runs as a child (`cubuf replay`, a Python
 * interpreter), which the library's fault seam (src/fault.h) cannot reach.
 * Like the driver, it is found through cuGetProcAddress_v2 alone
 * (src/driver.c, tools/replay.c). Built for the tests only; never
 * installed. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include <cuda.h>

#define SHIM_API __attribute__((visibility("default")))

typedef CUresult (*get_proc_fn)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
typedef CUresult (*free_async_fn)(CUdeviceptr, CUstream);
typedef CUresult (*copy_async_fn)(CUdeviceptr, CUdeviceptr, size_t, CUstream);

static get_proc_fn target_get_proc;
static free_async_fn target_free;
static copy_async_fn target_copy;
static long fail_at, fail_copy_at;
static atomic_long free_calls, copy_calls;
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void load_target(void)
{
    const char *path = getenv("CUBUF_SHIM_TARGET");
    void *lib = dlopen(path && *path ? path : "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib) target_get_proc = (get_proc_fn)dlsym(lib, "cuGetProcAddress_v2");
    const char *n = getenv("CUBUF_SHIM_FAIL_FREE");
    fail_at = n ? atol(n) : 0;
    n = getenv("CUBUF_SHIM_FAIL_COPY");
    fail_copy_at = n ? atol(n) : 0;
}

static CUresult shim_free_async(CUdeviceptr p, CUstream s)
{
    if (atomic_fetch_add(&free_calls, 1) + 1 == fail_at) return CUDA_ERROR_INVALID_VALUE;
    return target_free(p, s);
}

static CUresult shim_copy_async(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s)
{
    if (atomic_fetch_add(&copy_calls, 1) + 1 == fail_copy_at) return CUDA_ERROR_INVALID_VALUE;
    return target_copy(dst, src, n, s);
}

SHIM_API CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags,
                                      CUdriverProcAddressQueryResult *status)
{
    pthread_once(&once, load_target);
    if (!target_get_proc) return CUDA_ERROR_NOT_FOUND;
    CUresult r = target_get_proc(symbol, pfn, version, flags, status);
    if (r == CUDA_SUCCESS && *pfn && strcmp(symbol, "cuMemFreeAsync") == 0) {
        target_free = (free_async_fn)*pfn;
        *pfn = (void *)shim_free_async;
    } else if (r == CUDA_SUCCESS && *pfn && strcmp(symbol, "cuMemcpyAsync") == 0) {
        target_copy = (copy_async_fn)*pfn;
        *pfn = (void *)shim_copy_async;
    }
    return r;
}
