/* The driver table: every cu* call cubuf makes goes through it. Private. */
#ifndef CUBUF_DRIVER_H
#define CUBUF_DRIVER_H

#include <stdatomic.h>
#include <stdbool.h>

#include <cudaTypedefs.h>

#include "cubuf.h"

/* The entry points, each with the CUDA version whose ABI cubuf calls:
 * X(name, version) required, XO(name, version) optional (NULL if absent).
 * Required are exactly those the library (src/) calls unconditionally;
 * entries only tests and benchmarks use are optional, and so are those the
 * library can do without (it checks for NULL, or CU() returns
 * CUBUF_ERROR_NOT_SUPPORTED naming the entry). The oldest driver accepted is
 * the highest version among the required entries (cubuf_driver_min_version;
 * tests/check_driver_entries.sh keeps the two kinds honest).
 * The field type is cudaTypedefs.h's PFN_<name>_v<version>, and the driver is
 * asked for exactly that version, so a call can never go through a
 * mismatched signature (13.0 changed cuCtxSynchronize, cuCtxGetDevice and
 * cuStreamGetCtx under unchanged names; the old ABIs are the ones used). To
 * add one: the highest PFN_<name>_v<N> in cudaTypedefs.h that matches the
 * cuda.h declaration you call. */
#define CUBUF_DRIVER_ENTRIES(X, XO)                                                         \
    X(cuInit, 2000) X(cuDriverGetVersion, 2020) X(cuGetErrorName, 6000)                 \
    XO(cuGetErrorString, 6000) X(cuDeviceGet, 2000) X(cuDeviceGetCount, 2000)           \
    X(cuDeviceGetName, 2000) X(cuDeviceTotalMem, 3020) X(cuDeviceGetAttribute, 2000)    \
    X(cuDeviceCanAccessPeer, 4000) X(cuDevicePrimaryCtxRetain, 7000)                    \
    X(cuDevicePrimaryCtxRelease, 11000) XO(cuDevicePrimaryCtxGetState, 7000)            \
    X(cuCtxPushCurrent, 4000) X(cuCtxPopCurrent, 4000) X(cuCtxGetCurrent, 4000)         \
    XO(cuCtxSetCurrent, 4000) X(cuCtxGetDevice, 2000) X(cuCtxSynchronize, 2000)         \
    XO(cuCtxCreate, 12050) XO(cuCtxDestroy, 4000) X(cuStreamCreate, 2000)               \
    X(cuStreamDestroy, 4000) X(cuStreamSynchronize, 2000) X(cuStreamQuery, 2000)        \
    X(cuStreamCreateWithPriority, 5050) X(cuCtxGetStreamPriorityRange, 5050)            \
    X(cuEventQuery, 2000) XO(cuStreamGetFlags, 5050) XO(cuStreamGetPriority, 5050)      \
    XO(cuLaunchHostFunc, 10000)                                                         \
    X(cuStreamIsCapturing, 10000) X(cuStreamGetCtx, 9020) XO(cuStreamBeginCapture, 10010)\
    XO(cuStreamEndCapture, 10000) X(cuThreadExchangeStreamCaptureMode, 10010)           \
    XO(cuGraphDestroy, 10000) XO(cuGraphInstantiateWithFlags, 11040)                    \
    XO(cuGraphLaunch, 10000) XO(cuGraphExecDestroy, 10000) X(cuEventCreate, 2000)       \
    X(cuEventDestroy, 4000) X(cuEventRecord, 2000) X(cuEventSynchronize, 2000)          \
    X(cuStreamWaitEvent, 3020)                                                          \
    XO(cuEventElapsedTime, 12080) XO(cuMemGetInfo, 3020) X(cuMemAlloc, 3020)            \
    X(cuMemFree, 3020) XO(cuMemAllocHost, 3020) X(cuMemFreeHost, 2000)                  \
    X(cuMemHostAlloc, 2020) XO(cuMemHostGetDevicePointer, 3020)                         \
    XO(cuMemHostRegister, 6050) XO(cuMemHostUnregister, 4000) X(cuMemAllocManaged, 6000)  \
    X(cuMemAdvise, 12020) X(cuMemPrefetchAsync, 12020) X(cuMemGetAddressRange, 3020)    \
    XO(cuMemRangeGetAttribute, 8000)                                                    \
    XO(cuPointerGetAttribute, 4000) X(cuPointerGetAttributes, 7000)                     \
    XO(cuMemAllocAsync, 11020) X(cuMemAllocFromPoolAsync, 11020) X(cuMemFreeAsync, 11020)\
    X(cuMemPoolCreate, 11020) X(cuMemPoolDestroy, 11020) X(cuMemPoolSetAttribute, 11020)\
    X(cuMemPoolGetAttribute, 11020) X(cuMemPoolSetAccess, 11020)                        \
    X(cuMemPoolGetAccess, 11020) X(cuMemPoolTrimTo, 11020)                              \
    X(cuDeviceGetDefaultMemPool, 11020) XO(cuDeviceGetMemPool, 11020)                   \
    XO(cuMemGetDefaultMemPool, 13000) X(cuMemPoolExportToShareableHandle, 11020)        \
    X(cuMemPoolImportFromShareableHandle, 11020) X(cuMemPoolExportPointer, 11020)       \
    X(cuMemPoolImportPointer, 11020) XO(cuMemcpy, 4000) X(cuMemcpyAsync, 4000)          \
    XO(cuMemcpyHtoD, 3020) XO(cuMemcpyDtoH, 3020) X(cuMemcpyPeerAsync, 4000)            \
    X(cuMemsetD8Async, 3020) X(cuMemsetD16Async, 3020) X(cuMemsetD32Async, 3020)        \
    XO(cuMemsetD8, 3020) X(cuMemAddressReserve, 10020) X(cuMemAddressFree, 10020)       \
    X(cuMemCreate, 10020) X(cuMemRelease, 10020) X(cuMemMap, 10020) X(cuMemUnmap, 10020)\
    X(cuMemSetAccess, 10020) XO(cuMemGetAccess, 10020)                                  \
    X(cuMemGetAllocationGranularity, 10020) X(cuMemExportToShareableHandle, 10020)      \
    X(cuMemImportFromShareableHandle, 10020) XO(cuMemRetainAllocationHandle, 11000)     \
    XO(cuMemGetAllocationPropertiesFromHandle, 10020) X(cuIpcGetMemHandle, 4010)        \
    X(cuIpcOpenMemHandle, 11000) X(cuIpcCloseMemHandle, 4010)                           \
    XO(cuMemcpyBatchAsync, 13000) XO(cuMemGetHandleForAddressRange, 11070)

/* One id per entry point, for fault injection and call counting. */
typedef enum cubuf_drv_id {
#define CUBUF_DRV_ID_(name, version) CUBUF_DRV_##name,
    CUBUF_DRIVER_ENTRIES(CUBUF_DRV_ID_, CUBUF_DRV_ID_)
#undef CUBUF_DRV_ID_
    CUBUF_DRV_COUNT
} cubuf_drv_id_t;

typedef struct cubuf_driver {
#define CUBUF_DRV_FIELD_(name, version) PFN_##name##_v##version name;
    CUBUF_DRIVER_ENTRIES(CUBUF_DRV_FIELD_, CUBUF_DRV_FIELD_)
#undef CUBUF_DRV_FIELD_
    int version; /* cuDriverGetVersion */
} cubuf_driver_t;

/* CUBUF_DRV_OPTIONAL_<name>: 1 for an optional entry. CU() and CU_CALL() test
 * an optional entry for NULL first; for a required one the test is a
 * constant 0 and compiles away. */
enum {
#define CUBUF_DRV_REQUIRED_(name, version) CUBUF_DRV_OPTIONAL_##name = 0,
#define CUBUF_DRV_OPTIONAL_(name, version) CUBUF_DRV_OPTIONAL_##name = 1,
    CUBUF_DRIVER_ENTRIES(CUBUF_DRV_REQUIRED_, CUBUF_DRV_OPTIONAL_)
#undef CUBUF_DRV_REQUIRED_
#undef CUBUF_DRV_OPTIONAL_
};

/* The oldest driver version cubuf loads with (the highest version among the
 * required entries) and, in *entry (may be NULL), an entry that needs it. */
int cubuf__driver_floor(const char **entry);

/* CUBUF_ERROR_NOT_SUPPORTED for an optional entry this driver lacks: the
 * detail names the entry and the driver's version. */
cubuf_status_t cubuf__drv_absent(cubuf_drv_id_t id);

/* The table. Valid once cubuf__driver_load() returned CUBUF_SUCCESS. */
extern cubuf_driver_t cubuf__drv;

/* Loads libcuda and calls cuInit(0) once; cheap after the first call.
 * Returns CUBUF_SUCCESS, CUBUF_ERROR_NO_DRIVER or CUBUF_ERROR_NO_DEVICE. */
cubuf_status_t cubuf__driver_load(void);

/* Name of an entry point ("cuMemAlloc"). */
const char *cubuf__drv_name(cubuf_drv_id_t id);
/* Id of an entry point by name, or CUBUF_DRV_COUNT. */
cubuf_drv_id_t cubuf__drv_lookup(const char *name);

/* ---- fault injection seam (see fault.h for the test interface) ---- */
extern atomic_bool cubuf__fault_armed;
/* Decides whether this call of `id` fails; if so stores the CUresult. */
bool cubuf__fault_hit(cubuf_drv_id_t id, CUresult *result);

/* The one way to call the driver: CU_CALL(cuMemAlloc, &p, n) -> CUresult;
 * an optional entry the driver lacks gives CUDA_ERROR_NOT_SUPPORTED.
 * (fn must reach CUBUF_DRV_##fn unexpanded, since cuda.h maps many names to
 * versioned ones; hence two macros that do not call each other.) */
#define CU_CALL(fn, ...)                                                               \
    __extension__({                                                                    \
        CUresult cu_r_;                                                                \
        if (CUBUF_DRV_OPTIONAL_##fn && !cubuf__drv.fn)                                 \
            cu_r_ = CUDA_ERROR_NOT_SUPPORTED;                                          \
        else if (!(atomic_load_explicit(&cubuf__fault_armed, memory_order_relaxed) &&  \
                   cubuf__fault_hit(CUBUF_DRV_##fn, &cu_r_)))                          \
            cu_r_ = cubuf__drv.fn(__VA_ARGS__);                                        \
        cu_r_;                                                                         \
    })

/* CU(fn, ...) calls the driver and turns the CUresult into a cubuf status,
 * recording "fn failed: CUDA_ERROR_X" as this thread's last error; an
 * optional entry the driver lacks gives CUBUF_ERROR_NOT_SUPPORTED naming it. */
#define CU(fn, ...)                                                                    \
    __extension__({                                                                    \
        CUresult cu_r_;                                                                \
        cubuf_status_t cu_s_;                                                          \
        if (CUBUF_DRV_OPTIONAL_##fn && !cubuf__drv.fn) {                               \
            cu_s_ = cubuf__drv_absent(CUBUF_DRV_##fn);                                 \
        } else {                                                                       \
            if (!(atomic_load_explicit(&cubuf__fault_armed, memory_order_relaxed) &&   \
                  cubuf__fault_hit(CUBUF_DRV_##fn, &cu_r_)))                           \
                cu_r_ = cubuf__drv.fn(__VA_ARGS__);                                    \
            cu_s_ = cu_r_ == CUDA_SUCCESS ? CUBUF_SUCCESS : cubuf__cu_status(cu_r_, #fn); \
        }                                                                              \
        cu_s_;                                                                         \
    })

cubuf_status_t cubuf__cu_status(CUresult r, const char *call);
/* The name of a CUresult ("CUDA_ERROR_OUT_OF_MEMORY"), NULL where the
 * driver (or a driver not loaded) cannot say. */
const char *cubuf__cu_name(CUresult r);
/* Maps a CUresult to a status without recording anything. */
cubuf_status_t cubuf__cu_map(CUresult r);

#endif
