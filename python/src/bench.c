/* Timing hooks for bench/bench_python.py (private): the C library's own
 * allocate + close pair and the raw driver calls, each in a C loop, so the
 * benchmark compares the Python layer with both in one run. */
#include "cubufpy.h"

#include <string.h>
#include <time.h>

#include "driver.h"

static double now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

/* _bench_c_alloc_close(resource, size, iterations, stream) -> ns per pair */
PyObject *cbp_bench_c_alloc_close(PyObject *m, PyObject *args)
{
    PyObject *res, *sobj;
    Py_ssize_t size, iters;
    if (!PyArg_ParseTuple(args, "O!nnO", &cbp_MemoryResource_Type, &res, &size, &iters, &sobj)) return NULL;
    /* the result is a time per iteration: 0 of them would divide by zero, fewer give a negative time */
    if (iters <= 0) return PyErr_Format(PyExc_ValueError, "_bench_c_alloc_close: iterations must be > 0, not %zd", iters);
    CUstream s;
    if (cbp_stream(sobj, &s) < 0) return NULL;
    cubuf_resource_t *r = ((ResourceObject *)res)->res;
    double t0 = now_ns();
    for (Py_ssize_t i = 0; i < iters; i++) {
        cubuf_buffer_t *b = NULL; /* left unset by a failed allocate */
        cubuf_status_t st = cubuf_resource_allocate(r, (size_t)size, s, &b);
        if (st == CUBUF_SUCCESS) st = cubuf_buffer_close(b);
        cubuf_buffer_release(b);
        if (st != CUBUF_SUCCESS) return cbp_fail(st, "_bench_c_alloc_close");
    }
    return PyFloat_FromDouble((now_ns() - t0) / (double)iters);
}

/* _bench_raw(kind, size, iterations, stream, device) -> ns per call (pair
 * for "alloc_free"): the driver alone, in the device's primary context;
 * kind "alloc_free" (default pool), "memcpy" (device to device), "memset". */
PyObject *cbp_bench_raw(PyObject *m, PyObject *args)
{
    const char *kind;
    Py_ssize_t size, iters;
    PyObject *sobj;
    int device;
    if (!PyArg_ParseTuple(args, "snnOi", &kind, &size, &iters, &sobj, &device)) return NULL;
    if (iters <= 0) return PyErr_Format(PyExc_ValueError, "_bench_raw: iterations must be > 0, not %zd", iters);
    CUstream s;
    if (cbp_stream(sobj, &s) < 0) return NULL;
    cubuf_context_t *ctx = cbp_device_context(device);
    if (!ctx) return NULL;
    CUcontext h = NULL, popped;
    cubuf_context_handle(ctx, &h);
    CUresult r = cubuf__drv.cuCtxPushCurrent(h);
    CUdeviceptr a = 0, b = 0;
    double t0 = 0, t1 = 0;
    if (r == CUDA_SUCCESS && strcmp(kind, "alloc_free") == 0) {
        CUdevice dev;
        CUmemoryPool pool;
        r = cubuf__drv.cuDeviceGet(&dev, device);
        if (r == CUDA_SUCCESS) r = cubuf__drv.cuDeviceGetDefaultMemPool(&pool, dev);
        t0 = now_ns();
        for (Py_ssize_t i = 0; r == CUDA_SUCCESS && i < iters; i++) {
            r = cubuf__drv.cuMemAllocFromPoolAsync(&a, (size_t)size, pool, s);
            if (r == CUDA_SUCCESS) r = cubuf__drv.cuMemFreeAsync(a, s);
        }
        t1 = now_ns();
    } else if (r == CUDA_SUCCESS) {
        bool copy = strcmp(kind, "memcpy") == 0;
        r = cubuf__drv.cuMemAlloc(&a, (size_t)size);
        if (r == CUDA_SUCCESS) r = cubuf__drv.cuMemAlloc(&b, (size_t)size);
        t0 = now_ns();
        for (Py_ssize_t i = 0; r == CUDA_SUCCESS && i < iters; i++)
            r = copy ? cubuf__drv.cuMemcpyAsync(b, a, (size_t)size, s) : cubuf__drv.cuMemsetD8Async(a, 7, (size_t)size, s);
        if (r == CUDA_SUCCESS) r = cubuf__drv.cuStreamSynchronize(s);
        t1 = now_ns();
        if (a) cubuf__drv.cuMemFree(a);
        if (b) cubuf__drv.cuMemFree(b);
    }
    if (r == CUDA_SUCCESS) r = cubuf__drv.cuStreamSynchronize(s);
    cubuf__drv.cuCtxPopCurrent(&popped);
    if (r != CUDA_SUCCESS) return cbp_fail(cubuf__cu_status(r, kind), "_bench_raw");
    return PyFloat_FromDouble((t1 - t0) / (double)iters);
}
