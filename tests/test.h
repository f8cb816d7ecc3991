/* A tiny test harness: each test is a program; exit 0 pass, 1 fail, 77 skipped. */
#ifndef CUBUF_TEST_H
#define CUBUF_TEST_H

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cubuf.h"
#include "driver.h"
#include "fault.h"
#include "inspect.h"

#define T_SKIP 77

static int t_failures;

/* The warnings cubuf reports, counted (cubuf_set_warning_handler(t_warning,
 * &w)): how many, the first and the last. */
typedef struct t_warnings {
    int n;
    char first[512], last[512];
} t_warnings_t;

static inline void t_warning(cubuf_status_t st, const char *msg, void *user)
{
    (void)st;
    t_warnings_t *w = user;
    if (w->n++ == 0) snprintf(w->first, sizeof w->first, "%s", msg);
    snprintf(w->last, sizeof w->last, "%s", msg);
}

#define T_CHECK(cond)                                                                    \
    do {                                                                                 \
        if (!(cond)) {                                                                   \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);     \
            t_failures++;                                                                \
        }                                                                                \
    } while (0)

/* Expects a status; prints the detail when it differs. */
#define T_STATUS(expr, expected)                                                         \
    do {                                                                                 \
        cubuf_status_t t_st_ = (expr);                                                   \
        if (t_st_ != (expected)) {                                                       \
            fprintf(stderr, "%s:%d: %s returned %s, expected %s (%s)\n", __FILE__,         \
                    __LINE__, #expr, cubuf_status_name(t_st_), cubuf_status_name(expected), \
                    cubuf_last_error());                                                 \
            t_failures++;                                                                \
        }                                                                                \
    } while (0)

#define T_OK(expr) T_STATUS(expr, CUBUF_SUCCESS)

/* Aborts the test at once (later steps depend on this one). */
#define T_REQUIRE(expr)                                                                  \
    do {                                                                                 \
        cubuf_status_t t_st_ = (expr);                                                   \
        if (t_st_ != CUBUF_SUCCESS) {                                                    \
            fprintf(stderr, "%s:%d: %s returned %s (%s)\n", __FILE__, __LINE__, #expr,    \
                    cubuf_status_name(t_st_), cubuf_last_error());                       \
            exit(1);                                                                     \
        }                                                                                \
    } while (0)

/* Exits 77 unless a driver and at least `n` devices are present. */
/* A cubuf context's CUcontext. */
static inline CUcontext t_cu(cubuf_context_t *c)
{
    CUcontext h = NULL;
    (void)cubuf_context_handle(c, &h);
    return h;
}

/* A buffer's recorded deallocation stream and the context a default one is bound to. */
static inline CUstream t_dealloc_stream(const cubuf_buffer_t *b)
{
    CUstream s;
    CUcontext c;
    cubuf__inspect_dealloc(b, &s, &c);
    return s;
}
static inline CUcontext t_dealloc_ctx(const cubuf_buffer_t *b)
{
    CUstream s;
    CUcontext c;
    cubuf__inspect_dealloc(b, &s, &c);
    return c;
}

static inline void t_require_gpus(int n)
{
    int count = 0;
    cubuf_status_t st = cubuf_device_count(&count);
    if (st != CUBUF_SUCCESS || count < n) {
        printf("SKIP: needs %d CUDA device(s): %s\n", n,
               st != CUBUF_SUCCESS ? cubuf_last_error() : "not enough devices");
        exit(T_SKIP);
    }
}
#define t_require_gpu() t_require_gpus(1)

/* ---- leak checks: what this process holds of the driver ----------------------
 *
 * t_held_count() (once, after the driver loaded: after t_require_gpu, before
 * any other thread calls the driver) puts counting wrappers in front of the
 * table's entry points that make and remove memory objects. From then on
 * each call of them that succeeds is counted, cubuf's and the test's own
 * (T_CU) alike; a call an injected fault failed never reaches the table and
 * one the driver refused made nothing, so neither counts. A leak check takes
 * t_held() before and T_HELD_BACK after: everything made in between was
 * given back. These are the process's own objects: other users of the
 * device cannot move them (its free memory they can). */
typedef struct t_held {
    long reservations; /* cuMemAddressReserve - cuMemAddressFree */
    long physical;     /* cuMemCreate + cuMemImportFromShareableHandle - cuMemRelease */
    long mappings;     /* cuMemMap - cuMemUnmap */
    long device;       /* cuMemAlloc + cuMemAllocManaged - cuMemFree (of other pointers) */
    long host;         /* cuMemAllocHost + cuMemHostAlloc - cuMemFreeHost */
    long pools;        /* cuMemPoolCreate + cuMemPoolImportFromShareableHandle - cuMemPoolDestroy */
    long pool_ptrs;    /* cuMemPoolImportPointer - cuMemFree, cuMemFreeAsync of those */
    long ipc_opened;   /* cuIpcOpenMemHandle - cuIpcCloseMemHandle */
} t_held_t;

enum {
    T_HELD_RESV, T_HELD_PHYS, T_HELD_MAPS, T_HELD_DEV, T_HELD_HOST, T_HELD_POOLS, T_HELD_PTRS,
    T_HELD_IPC, T_HELD_N
};

static inline atomic_long *t_held_counts_(void)
{
    static atomic_long n[T_HELD_N];
    return n;
}

/* The table as the driver filled it: what the wrappers call. */
static inline cubuf_driver_t *t_held_real_(void)
{
    static cubuf_driver_t real;
    return &real;
}

#define T_HELD_WRAP_(name, counter, delta, params, args)                                   \
    static inline CUresult CUDAAPI t_held_##name params                                    \
    {                                                                                      \
        CUresult r = t_held_real_()->name args;                                            \
        if (r == CUDA_SUCCESS) atomic_fetch_add(&t_held_counts_()[counter], delta);        \
        return r;                                                                          \
    }
T_HELD_WRAP_(cuMemAddressReserve, T_HELD_RESV, 1,
             (CUdeviceptr *p, size_t n, size_t align, CUdeviceptr at, unsigned long long f),
             (p, n, align, at, f))
T_HELD_WRAP_(cuMemAddressFree, T_HELD_RESV, -1, (CUdeviceptr p, size_t n), (p, n))
T_HELD_WRAP_(cuMemCreate, T_HELD_PHYS, 1,
             (CUmemGenericAllocationHandle *h, size_t n, const CUmemAllocationProp *prop,
              unsigned long long f),
             (h, n, prop, f))
T_HELD_WRAP_(cuMemImportFromShareableHandle, T_HELD_PHYS, 1,
             (CUmemGenericAllocationHandle *h, void *os, CUmemAllocationHandleType type),
             (h, os, type))
T_HELD_WRAP_(cuMemRelease, T_HELD_PHYS, -1, (CUmemGenericAllocationHandle h), (h))
T_HELD_WRAP_(cuMemMap, T_HELD_MAPS, 1,
             (CUdeviceptr p, size_t n, size_t off, CUmemGenericAllocationHandle h,
              unsigned long long f),
             (p, n, off, h, f))
T_HELD_WRAP_(cuMemUnmap, T_HELD_MAPS, -1, (CUdeviceptr p, size_t n), (p, n))
T_HELD_WRAP_(cuMemAlloc, T_HELD_DEV, 1, (CUdeviceptr *p, size_t n), (p, n))
T_HELD_WRAP_(cuMemAllocManaged, T_HELD_DEV, 1, (CUdeviceptr *p, size_t n, unsigned f), (p, n, f))
T_HELD_WRAP_(cuMemAllocHost, T_HELD_HOST, 1, (void **p, size_t n), (p, n))
T_HELD_WRAP_(cuMemHostAlloc, T_HELD_HOST, 1, (void **p, size_t n, unsigned f), (p, n, f))
T_HELD_WRAP_(cuMemFreeHost, T_HELD_HOST, -1, (void *p), (p))
T_HELD_WRAP_(cuMemPoolCreate, T_HELD_POOLS, 1, (CUmemoryPool *pool, const CUmemPoolProps *props),
             (pool, props))
T_HELD_WRAP_(cuMemPoolDestroy, T_HELD_POOLS, -1, (CUmemoryPool pool), (pool))
T_HELD_WRAP_(cuMemPoolImportFromShareableHandle, T_HELD_POOLS, 1,
             (CUmemoryPool *pool, void *os, CUmemAllocationHandleType type, unsigned long long f),
             (pool, os, type, f))
T_HELD_WRAP_(cuIpcOpenMemHandle, T_HELD_IPC, 1, (CUdeviceptr *p, CUipcMemHandle h, unsigned f),
             (p, h, f))
T_HELD_WRAP_(cuIpcCloseMemHandle, T_HELD_IPC, -1, (CUdeviceptr p), (p))
#undef T_HELD_WRAP_

/* The imported pool pointers alive now: cuMemFree and cuMemFreeAsync free
 * them as well as the process's own memory, so the wrappers look them up.
 * Adds p (add) or removes it; returns whether that was done. */
#define T_HELD_PTRS_MAX 1024
static inline bool t_held_ptr_(CUdeviceptr p, bool add)
{
    static CUdeviceptr live[T_HELD_PTRS_MAX];
    static atomic_flag lock = ATOMIC_FLAG_INIT;
    bool done = false;
    while (atomic_flag_test_and_set(&lock)) {
    }
    for (int i = 0; i < T_HELD_PTRS_MAX && !done; i++)
        if (live[i] == (add ? 0 : p)) {
            live[i] = add ? p : 0;
            done = true;
        }
    atomic_flag_clear(&lock);
    return done;
}
static inline CUresult CUDAAPI t_held_cuMemPoolImportPointer(CUdeviceptr *p, CUmemoryPool pool,
                                                             CUmemPoolPtrExportData *data)
{
    CUresult r = t_held_real_()->cuMemPoolImportPointer(p, pool, data);
    if (r == CUDA_SUCCESS && t_held_ptr_(*p, true)) atomic_fetch_add(&t_held_counts_()[T_HELD_PTRS], 1);
    return r;
}
static inline CUresult CUDAAPI t_held_cuMemFree(CUdeviceptr p)
{
    CUresult r = t_held_real_()->cuMemFree(p);
    if (r == CUDA_SUCCESS)
        atomic_fetch_sub(&t_held_counts_()[t_held_ptr_(p, false) ? T_HELD_PTRS : T_HELD_DEV], 1);
    return r;
}
static inline CUresult CUDAAPI t_held_cuMemFreeAsync(CUdeviceptr p, CUstream s)
{
    CUresult r = t_held_real_()->cuMemFreeAsync(p, s);
    if (r == CUDA_SUCCESS && t_held_ptr_(p, false)) atomic_fetch_sub(&t_held_counts_()[T_HELD_PTRS], 1);
    return r;
}

static inline void t_held_count(void)
{
    static bool on;
    if (on) return;
    if (!cubuf__drv.cuMemAlloc) {
        fprintf(stderr, "t_held_count: the driver table is not loaded yet\n");
        exit(1);
    }
    on = true;
    *t_held_real_() = cubuf__drv;
#define T_HELD_SET_(name) \
    if (cubuf__drv.name) cubuf__drv.name = t_held_##name;
    T_HELD_SET_(cuMemAddressReserve) T_HELD_SET_(cuMemAddressFree) T_HELD_SET_(cuMemCreate)
    T_HELD_SET_(cuMemRelease) T_HELD_SET_(cuMemMap) T_HELD_SET_(cuMemUnmap)
    T_HELD_SET_(cuMemAlloc) T_HELD_SET_(cuMemAllocManaged) T_HELD_SET_(cuMemFree)
    T_HELD_SET_(cuMemAllocHost) T_HELD_SET_(cuMemHostAlloc) T_HELD_SET_(cuMemFreeHost)
    T_HELD_SET_(cuMemPoolCreate) T_HELD_SET_(cuMemPoolDestroy)
    T_HELD_SET_(cuMemImportFromShareableHandle) T_HELD_SET_(cuMemPoolImportFromShareableHandle)
    T_HELD_SET_(cuMemPoolImportPointer) T_HELD_SET_(cuMemFreeAsync)
    T_HELD_SET_(cuIpcOpenMemHandle) T_HELD_SET_(cuIpcCloseMemHandle)
#undef T_HELD_SET_
}

static inline t_held_t t_held(void)
{
    const atomic_long *n = t_held_counts_();
    t_held_t h = {atomic_load(&n[T_HELD_RESV]), atomic_load(&n[T_HELD_PHYS]),
                  atomic_load(&n[T_HELD_MAPS]), atomic_load(&n[T_HELD_DEV]),
                  atomic_load(&n[T_HELD_HOST]), atomic_load(&n[T_HELD_POOLS]),
                  atomic_load(&n[T_HELD_PTRS]), atomic_load(&n[T_HELD_IPC])};
    return h;
}

/* Whether a and b are the same; prints both where not. */
static inline bool t_held_same(const char *file, int line, const char *what, const t_held_t *a,
                               const t_held_t *b)
{
    if (a->reservations == b->reservations && a->physical == b->physical &&
        a->mappings == b->mappings && a->device == b->device && a->host == b->host &&
        a->pools == b->pools && a->pool_ptrs == b->pool_ptrs && a->ipc_opened == b->ipc_opened)
        return true;
    fprintf(stderr,
            "%s:%d: %s: driver objects held changed: reservations %ld -> %ld, physical "
            "allocations %ld -> %ld, mappings %ld -> %ld, device/managed allocations %ld -> %ld, "
            "pinned host allocations %ld -> %ld, memory pools %ld -> %ld, imported pool "
            "pointers %ld -> %ld, opened legacy handles %ld -> %ld\n",
            file, line, what, a->reservations, b->reservations, a->physical, b->physical,
            a->mappings, b->mappings, a->device, b->device, a->host, b->host, a->pools, b->pools,
            a->pool_ptrs, b->pool_ptrs, a->ipc_opened, b->ipc_opened);
    return false;
}

/* Fails the test unless the process holds what it held at `before`. */
#define T_HELD_BACK(before, what)                                                          \
    do {                                                                                   \
        t_held_t t_now_ = t_held();                                                        \
        if (!t_held_same(__FILE__, __LINE__, (what), &(before), &t_now_)) t_failures++;   \
    } while (0)

/* Raw driver call that must succeed (test setup). */
#define T_CU(fn, ...)                                                                    \
    do {                                                                                 \
        CUresult t_r_ = cubuf__drv.fn(__VA_ARGS__);                                      \
        if (t_r_ != CUDA_SUCCESS) {                                                      \
            fprintf(stderr, "%s:%d: %s failed: %d\n", __FILE__, __LINE__, #fn, (int)t_r_); \
            exit(1);                                                                     \
        }                                                                                \
    } while (0)

static inline int t_finish(const char *name)
{
    cubuf_fault_reset();
    if (t_failures) {
        fprintf(stderr, "%s: %d check(s) failed\n", name, t_failures);
        return 1;
    }
    printf("%s: all checks passed\n", name);
    return 0;
}

#endif
