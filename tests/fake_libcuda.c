/* A stand-in for libcuda.so.1 that reports the CUDA version in
 * $CUBUF_FAKE_DRIVER_VERSION (default 12020) and has no device: enough for
 * cubuf's loader (cuGetProcAddress_v2, then cuDriverGetVersion, then every
 * entry of the table, then cuInit). Every entry point resolves; the few the
 * tests call behave (cuInit succeeds, cuDeviceGetCount reports 0, error
 * names are known), every other one returns CUDA_ERROR_NOT_SUPPORTED.
 * Built for test_driver_floor only; never installed. */
#include <stdlib.h>
#include <string.h>

#include <cuda.h>

#define FAKE_API __attribute__((visibility("default")))

static int fake_version(void)
{
    const char *v = getenv("CUBUF_FAKE_DRIVER_VERSION");
    return v && *v ? atoi(v) : 12020;
}

static CUresult fake_driver_get_version(int *version)
{
    *version = fake_version();
    return CUDA_SUCCESS;
}

static CUresult fake_init(unsigned flags)
{
    (void)flags;
    return CUDA_SUCCESS;
}

static CUresult fake_device_get_count(int *count)
{
    *count = 0;
    return CUDA_SUCCESS;
}

static CUresult fake_get_error_name(CUresult r, const char **name)
{
    *name = r == CUDA_ERROR_NOT_SUPPORTED ? "CUDA_ERROR_NOT_SUPPORTED" : "CUDA_ERROR_UNKNOWN";
    return CUDA_SUCCESS;
}

/* Every other entry: no device, so nothing is supported. The caller's
 * arguments are ignored (the SysV calling convention makes that safe). */
static CUresult fake_not_supported(void) { return CUDA_ERROR_NOT_SUPPORTED; }

FAKE_API CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                      cuuint64_t flags, CUdriverProcAddressQueryResult *status)
{
    (void)flags;
    if (!symbol || !pfn) return CUDA_ERROR_INVALID_VALUE;
    if (cudaVersion > fake_version()) {
        /* As a real driver answers for a version newer than itself. */
        *pfn = NULL;
        if (status) *status = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
        return CUDA_ERROR_NOT_FOUND;
    }
    if (strcmp(symbol, "cuDriverGetVersion") == 0) *pfn = (void *)fake_driver_get_version;
    else if (strcmp(symbol, "cuInit") == 0) *pfn = (void *)fake_init;
    else if (strcmp(symbol, "cuDeviceGetCount") == 0) *pfn = (void *)fake_device_get_count;
    else if (strcmp(symbol, "cuGetErrorName") == 0) *pfn = (void *)fake_get_error_name;
    else *pfn = (void *)fake_not_supported;
    if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
    return CUDA_SUCCESS;
}
