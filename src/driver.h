/* The driver table: every cu* call cubuf makes goes through it. Private. */
#ifndef CUBUF_DRIVER_H
#define CUBUF_DRIVER_H

#include <stdatomic.h>
#include <stdbool.h>

#include "cubuf.h"

/* The CUDA version at which entry points are resolved: it must match the
 * cuda.h that declares their types. */
#define CUBUF_DRIVER_ABI 13000

/* X(name): required entry points. XO(name): optional ones (NULL if absent). */
#define CUBUF_DRIVER_ENTRIES(X, XO)                                                 \
    X(cuInit) X(cuDriverGetVersion) X(cuGetErrorName) X(cuGetErrorString)          \
    X(cuDeviceGet) X(cuDeviceGetCount) X(cuDeviceGetName) X(cuDeviceTotalMem)      \
    X(cuDeviceGetAttribute) X(cuDeviceCanAccessPeer)                               \
    X(cuDevicePrimaryCtxRetain) X(cuDevicePrimaryCtxRelease) X(cuDevicePrimaryCtxGetState) \
    X(cuCtxPushCurrent) X(cuCtxPopCurrent) X(cuCtxGetCurrent) X(cuCtxSetCurrent)   \
    X(cuCtxGetDevice) X(cuCtxSynchronize) X(cuCtxCreate) X(cuCtxDestroy)           \
    X(cuStreamCreate) X(cuStreamDestroy) X(cuStreamSynchronize) X(cuStreamQuery)   \
    X(cuStreamIsCapturing) X(cuStreamGetCtx) X(cuStreamBeginCapture)               \
    X(cuStreamEndCapture) X(cuThreadExchangeStreamCaptureMode)                     \
    X(cuGraphDestroy) X(cuGraphInstantiate) X(cuGraphLaunch) X(cuGraphExecDestroy) \
    X(cuEventCreate) X(cuEventDestroy) X(cuEventRecord) X(cuEventSynchronize)      \
    X(cuEventElapsedTime)                                                          \
    X(cuMemGetInfo) X(cuMemAlloc) X(cuMemFree) X(cuMemAllocHost) X(cuMemFreeHost)  \
    X(cuMemHostAlloc) X(cuMemHostGetDevicePointer) X(cuMemHostRegister)            \
    X(cuMemHostUnregister) X(cuMemAllocManaged) X(cuMemAdvise)                     \
    X(cuMemPrefetchAsync) X(cuMemGetAddressRange)                                  \
    X(cuPointerGetAttribute) X(cuPointerGetAttributes)                             \
    X(cuMemAllocAsync) X(cuMemAllocFromPoolAsync) X(cuMemFreeAsync)                \
    X(cuMemPoolCreate) X(cuMemPoolDestroy) X(cuMemPoolSetAttribute)                \
    X(cuMemPoolGetAttribute) X(cuMemPoolSetAccess) X(cuMemPoolGetAccess)           \
    X(cuMemPoolTrimTo) X(cuDeviceGetDefaultMemPool) X(cuDeviceGetMemPool)          \
    X(cuMemGetDefaultMemPool)                                                      \
    X(cuMemPoolExportToShareableHandle) X(cuMemPoolImportFromShareableHandle)      \
    X(cuMemPoolExportPointer) X(cuMemPoolImportPointer)                            \
    X(cuMemcpy) X(cuMemcpyAsync) X(cuMemcpyHtoD) X(cuMemcpyDtoH)                   \
    X(cuMemcpyPeerAsync)                                                           \
    X(cuMemsetD8Async) X(cuMemsetD16Async) X(cuMemsetD32Async)                     \
    X(cuMemsetD8)                                                                  \
    X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemCreate) X(cuMemRelease)      \
    X(cuMemMap) X(cuMemUnmap) X(cuMemSetAccess) X(cuMemGetAccess)                  \
    X(cuMemGetAllocationGranularity) X(cuMemExportToShareableHandle)               \
    X(cuMemImportFromShareableHandle) X(cuMemRetainAllocationHandle)               \
    X(cuMemGetAllocationPropertiesFromHandle)                                      \
    X(cuIpcGetMemHandle) X(cuIpcOpenMemHandle) X(cuIpcCloseMemHandle)              \
    XO(cuMemcpyBatchAsync)

/* One id per entry point, for fault injection and call counting. */
typedef enum cubuf_drv_id {
#define CUBUF_DRV_ID_(name) CUBUF_DRV_##name,
    CUBUF_DRIVER_ENTRIES(CUBUF_DRV_ID_, CUBUF_DRV_ID_)
#undef CUBUF_DRV_ID_
    CUBUF_DRV_COUNT
} cubuf_drv_id_t;

typedef struct cubuf_driver {
#define CUBUF_DRV_FIELD_(name) __typeof__(name) *name;
    CUBUF_DRIVER_ENTRIES(CUBUF_DRV_FIELD_, CUBUF_DRV_FIELD_)
#undef CUBUF_DRV_FIELD_
    int version; /* cuDriverGetVersion */
} cubuf_driver_t;

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

/* The one way to call the driver: CU_CALL(cuMemAlloc, &p, n) -> CUresult.
 * (fn must reach CUBUF_DRV_##fn unexpanded, since cuda.h maps many names to
 * versioned ones; hence two macros that do not call each other.) */
#define CU_CALL(fn, ...)                                                               \
    __extension__({                                                                    \
        CUresult cu_r_;                                                                \
        if (!(atomic_load_explicit(&cubuf__fault_armed, memory_order_relaxed) &&       \
              cubuf__fault_hit(CUBUF_DRV_##fn, &cu_r_)))                               \
            cu_r_ = cubuf__drv.fn(__VA_ARGS__);                                        \
        cu_r_;                                                                         \
    })

/* CU(fn, ...) calls the driver and turns the CUresult into a cubuf status,
 * recording "fn failed: CUDA_ERROR_X" as this thread's last error. */
#define CU(fn, ...)                                                                    \
    __extension__({                                                                    \
        CUresult cu_r_;                                                                \
        if (!(atomic_load_explicit(&cubuf__fault_armed, memory_order_relaxed) &&       \
              cubuf__fault_hit(CUBUF_DRV_##fn, &cu_r_)))                               \
            cu_r_ = cubuf__drv.fn(__VA_ARGS__);                                        \
        cu_r_ == CUDA_SUCCESS ? CUBUF_SUCCESS : cubuf__cu_status(cu_r_, #fn);          \
    })

cubuf_status_t cubuf__cu_status(CUresult r, const char *call);
/* Maps a CUresult to a status without recording anything. */
cubuf_status_t cubuf__cu_map(CUresult r);

#endif
