/* cubuf as a framework's allocator (cubuf/caching.h): one resource per
 * device (a caching resource over the device's default pool unless one was
 * set), behind the C signatures of PyTorch's CUDAPluggableAllocator and
 * CuPy's CFunctionAllocator. */
#include <pthread.h>
#include <string.h>

#include "common.h"
#include "ptrmap.h"
#include "cubuf/caching.h"

#define FW_DEVICES 64

/* The resource each device serves, set once; `caching` is written before
 * `res` is published and tells which of the two paths its calls take. */
static struct fw_device {
    _Atomic(cubuf_resource_t *) res;
    bool caching;
} fw_dev[FW_DEVICES];
static pthread_mutex_t fw_mutex = PTHREAD_MUTEX_INITIALIZER;

static cubuf_status_t fw_range(const char *fn, int device)
{
    if (device < 0 || device >= FW_DEVICES)
        return cubuf__fail(CUBUF_ERROR_OUT_OF_RANGE, "%s: device %d is not in 0-%d", fn, device,
                           FW_DEVICES - 1);
    return CUBUF_SUCCESS;
}

/* Publishes r for the device. Under fw_mutex. */
static void fw_publish(int device, cubuf_resource_t *r)
{
    fw_dev[device].caching = cubuf_is_caching_resource(r);
    atomic_store_explicit(&fw_dev[device].res, r, memory_order_release);
}

cubuf_status_t cubuf_framework_set_resource(int device, cubuf_resource_t *res)
{
    static const char fn[] = "cubuf_framework_set_resource";
    CHECK_ARG(res, "%s: NULL resource", fn);
    cubuf_status_t st = fw_range(fn, device);
    if (st != CUBUF_SUCCESS) return st;
    pthread_mutex_lock(&fw_mutex);
    if (atomic_load_explicit(&fw_dev[device].res, memory_order_relaxed))
        st = cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,
                         "%s: device %d already has its resource (set once, before its first "
                         "allocation)", fn, device);
    else
        fw_publish(device, cubuf_resource_retain(res));
    pthread_mutex_unlock(&fw_mutex);
    return st;
}

cubuf_status_t cubuf_framework_resource(int device, cubuf_resource_t **out)
{
    CHECK_ARG(out, "cubuf_framework_resource: NULL argument");
    cubuf_status_t st = fw_range("cubuf_framework_resource", device);
    if (st != CUBUF_SUCCESS) return st;
    cubuf_resource_t *r = atomic_load_explicit(&fw_dev[device].res, memory_order_acquire);
    if (!r) {
        pthread_mutex_lock(&fw_mutex);
        r = atomic_load_explicit(&fw_dev[device].res, memory_order_relaxed);
        if (!r) {
            cubuf_resource_t *pool = NULL;
            st = cubuf_device_resource_create(device, NULL, &pool);
            if (st == CUBUF_SUCCESS) st = cubuf_caching_resource_create(pool, NULL, &r);
            cubuf_resource_release(pool); /* the cache holds it */
            if (st == CUBUF_SUCCESS) fw_publish(device, r);
        }
        pthread_mutex_unlock(&fw_mutex);
    }
    if (st == CUBUF_SUCCESS) *out = r;
    return st;
}

/* The device's resource, or what cubuf_framework_resource failed with (its
 * detail set): not always OUT_OF_RANGE, a first use may fail to make it. */
static inline cubuf_status_t fw_get(int device, cubuf_resource_t **r)
{
    if (device >= 0 && device < FW_DEVICES &&
        (*r = atomic_load_explicit(&fw_dev[device].res, memory_order_acquire)) != NULL)
        return CUBUF_SUCCESS;
    return cubuf_framework_resource(device, r);
}

/* The caching fast path, or the raw interface of any other resource set. */
static inline cubuf_status_t fw_alloc(int device, size_t size, CUstream stream, CUdeviceptr *p)
{
    cubuf_resource_t *r = NULL;
    cubuf_status_t st = fw_get(device, &r);
    if (st != CUBUF_SUCCESS) return st;
    return fw_dev[device].caching ? cubuf_caching_allocate(r, size, stream, p)
                                  : cubuf_resource_allocate_raw(r, size, stream, p);
}

static inline cubuf_status_t fw_free(int device, CUdeviceptr p, size_t size, CUstream stream)
{
    cubuf_resource_t *r = NULL;
    cubuf_status_t st = fw_get(device, &r);
    if (st != CUBUF_SUCCESS) return st;
    return fw_dev[device].caching ? cubuf_caching_deallocate(r, p, size, stream)
                                  : cubuf_resource_deallocate_raw(r, p, size, stream);
}

void *cubuf_torch_alloc(size_t size, int device, CUstream stream)
{
    CUdeviceptr p = 0;
    if (fw_alloc(device, size ? size : 1, stream, &p) != CUBUF_SUCCESS) return NULL;
    return (void *)(uintptr_t)p;
}

void cubuf_torch_free(void *ptr, size_t size, int device, CUstream stream)
{
    if (!ptr) return;
    cubuf_status_t st = fw_free(device, (CUdeviceptr)(uintptr_t)ptr, size ? size : 1, stream);
    if (st != CUBUF_SUCCESS)
        cubuf__warn(st, "cubuf_torch_free: %p (%zu bytes, device %d) not freed: %s", ptr, size,
                    device, cubuf_last_error());
}

/* ---- CuPy: its free passes no size, so live pointers map to their sizes ----
 * Pointer maps (ptrmap.h), sharded by the pointer's hash, each shard under
 * its own mutex. */

#define SHARDS 64

typedef struct shard {
    pthread_mutex_t mutex;
    cubuf_ptrmap_t map; /* entry: ptr, size */
} shard_t;

static shard_t shards[SHARDS];
static pthread_once_t shards_once = PTHREAD_ONCE_INIT;

static void shards_init(void)
{
    for (int i = 0; i < SHARDS; i++) pthread_mutex_init(&shards[i].mutex, NULL);
}

static inline shard_t *shard_of(CUdeviceptr p)
{
    return &shards[(((uint64_t)p >> 9) * 0x9E3779B97F4A7C15ULL) >> 58];
}

void *cubuf_cupy_malloc(void *param, size_t size, int device)
{
    (void)param;
    pthread_once(&shards_once, shards_init);
    CUdeviceptr p = 0;
    if (!size) size = 1;
    if (fw_alloc(device, size, CU_STREAM_LEGACY, &p) != CUBUF_SUCCESS) return NULL;
    shard_t *s = shard_of(p);
    const cubuf_ptr_entry_t e = {p, size, NULL, NULL, 0};
    pthread_mutex_lock(&s->mutex);
    cubuf_status_t st = cubuf__ptrmap_insert(&s->map, &e);
    pthread_mutex_unlock(&s->mutex);
    if (st != CUBUF_SUCCESS) {
        const cubuf_status_t fst = fw_free(device, p, size, CU_STREAM_LEGACY);
        if (fst != CUBUF_SUCCESS)
            cubuf__warn(fst, "cubuf_cupy_malloc: %zu bytes at 0x%llx could not be given back after the "
                        "pointer table failed to grow (lost): %s",
                        size, (unsigned long long)p, cubuf_last_error());
        cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "cubuf_cupy_malloc: cannot grow the pointer table");
        return NULL;
    }
    return (void *)(uintptr_t)p;
}

void cubuf_cupy_free(void *param, void *ptr, int device)
{
    (void)param;
    if (!ptr) return;
    pthread_once(&shards_once, shards_init);
    CUdeviceptr p = (CUdeviceptr)(uintptr_t)ptr;
    shard_t *s = shard_of(p);
    cubuf_ptr_entry_t e;
    pthread_mutex_lock(&s->mutex);
    bool found = cubuf__ptrmap_remove(&s->map, p, &e);
    pthread_mutex_unlock(&s->mutex);
    cubuf_status_t st = found ? fw_free(device, p, e.size, CU_STREAM_LEGACY)
                              : cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,
                                            "not allocated by cubuf_cupy_malloc");
    if (st == CUBUF_SUCCESS) return;
    if (found) { /* still allocated: a later free may succeed */
        pthread_mutex_lock(&s->mutex);
        (void)cubuf__ptrmap_put_back(&s->map, &e);
        pthread_mutex_unlock(&s->mutex);
    }
    cubuf__warn(st, "cubuf_cupy_free: %p (device %d) not freed: %s", ptr, device, cubuf_last_error());
}
