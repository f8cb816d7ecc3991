/* Memory: the address-range registry, cuMemAlloc, pinned and registered
 * host memory, managed memory, pointer attributes, and the copies and fills
 * (ops on streams, or synchronous on the legacy stream). */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "fake.h"

/* ---- the registry ---- */

static pthread_mutex_t reg_lock = PTHREAD_MUTEX_INITIALIZER;
static td_range_t *ranges;
static size_t nranges, cap_ranges;
static unsigned long long next_range_id = 1;

CUresult td_range_add(td_range_t *range)
{
    pthread_mutex_lock(&reg_lock);
    if (nranges == cap_ranges) {
        size_t cap = cap_ranges ? 2 * cap_ranges : 64;
        td_range_t *r = realloc(ranges, cap * sizeof *r);
        if (!r) {
            pthread_mutex_unlock(&reg_lock);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        ranges = r;
        cap_ranges = cap;
    }
    range->id = next_range_id++;
    ranges[nranges++] = *range;
    pthread_mutex_unlock(&reg_lock);
    return CUDA_SUCCESS;
}

bool td_range_find(uintptr_t addr, td_range_t *out)
{
    pthread_mutex_lock(&reg_lock);
    const td_range_t *best = NULL;
    for (size_t i = 0; i < nranges; i++) {
        const td_range_t *r = &ranges[i];
        if (!(addr >= r->base && addr - r->base < r->size)) continue;
        /* The innermost: the smaller, or a mapping over its reservation. */
        if (!best || r->size < best->size ||
            (r->size == best->size && best->kind == TD_KIND_VMM_RESERVE))
            best = r;
    }
    if (best && out) *out = *best;
    pthread_mutex_unlock(&reg_lock);
    return best != NULL;
}

bool td_range_remove(uintptr_t base, td_kind_t kind, td_range_t *out)
{
    pthread_mutex_lock(&reg_lock);
    bool found = false;
    for (size_t i = 0; i < nranges && !found; i++)
        if (ranges[i].base == base && ranges[i].kind == kind) {
            if (out) *out = ranges[i];
            ranges[i] = ranges[--nranges];
            found = true;
        }
    pthread_mutex_unlock(&reg_lock);
    return found;
}

/* The range of this kind containing addr, copied to *out; false if none. */
static bool range_of_kind(uintptr_t addr, td_kind_t kind, td_range_t *out)
{
    pthread_mutex_lock(&reg_lock);
    bool found = false;
    for (size_t i = 0; i < nranges && !found; i++)
        if (ranges[i].kind == kind && addr >= ranges[i].base && addr - ranges[i].base < ranges[i].size) {
            *out = ranges[i];
            found = true;
        }
    pthread_mutex_unlock(&reg_lock);
    return found;
}

/* Whether [p, p+n) overlaps any range of this kind. */
static bool overlaps(uintptr_t p, size_t n, td_kind_t kind)
{
    pthread_mutex_lock(&reg_lock);
    bool hit = false;
    for (size_t i = 0; i < nranges && !hit; i++)
        hit = ranges[i].kind == kind && p < ranges[i].base + ranges[i].size && ranges[i].base < p + n;
    pthread_mutex_unlock(&reg_lock);
    return hit;
}

/* cuMemAlloc memory: a memfd mapped MAP_SHARED, so that a legacy IPC handle
 * (ipc.c) can share it. Returns the address (NULL on failure) and the fd. */
static void *memfd_map(size_t size, int *fd)
{
    *fd = td_share_memfd("alloc", size);
    if (*fd < 0) return NULL;
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, *fd, 0);
    if (p != MAP_FAILED) return p;
    close(*fd);
    *fd = -1;
    return NULL;
}

/* Device memory is charged in pages, so that one byte shows in cuMemGetInfo. */
static size_t charged_size(size_t n)
{
    size_t page = 4096;
    return (n + page - 1) / page * page;
}

/* ---- cuMemAlloc ---- */

CUresult td_cuMemGetInfo(size_t *free, size_t *total)
{
    CUcontext ctx;
    CUresult r = td_ctx_require(&ctx);
    if (r != CUDA_SUCCESS) return r;
    if (!free || !total) return CUDA_ERROR_INVALID_VALUE;
    int dev = td_ctx_device(ctx);
    *total = TD_TOTAL_MEM;
    *free = TD_TOTAL_MEM - td_mem_used(dev);
    return CUDA_SUCCESS;
}

CUresult td_cuMemAlloc(CUdeviceptr_v2 *dptr, size_t bytesize)
{
    CUcontext ctx;
    CUresult r = td_ctx_require(&ctx);
    if (r != CUDA_SUCCESS) return r;
    if (!dptr || bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
    if ((r = td_capture_unsafe_call()) != CUDA_SUCCESS) return r;
    int dev = td_ctx_device(ctx);
    if (bytesize > TD_TOTAL_MEM) return CUDA_ERROR_OUT_OF_MEMORY;
    if ((r = td_mem_charge(dev, charged_size(bytesize))) != CUDA_SUCCESS) return r;
    int fd = -1;
    void *p = memfd_map(bytesize, &fd);
    if (!p) {
        td_mem_uncharge(dev, charged_size(bytesize));
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    td_range_t rg = {.base = (uintptr_t)p, .size = bytesize, .kind = TD_KIND_DEVICE, .device = dev,
                     .ctx = ctx, .fd = fd};
    if ((r = td_range_add(&rg)) != CUDA_SUCCESS) {
        munmap(p, bytesize);
        close(fd);
        td_mem_uncharge(dev, charged_size(bytesize));
        return r;
    }
    *dptr = (CUdeviceptr)(uintptr_t)p;
    return CUDA_SUCCESS;
}

/* ---- managed memory: where it lives (advice, prefetches) ---- */

typedef struct managed {
    struct managed *next;
    uintptr_t base;
    size_t size;
    int preferred;     /* CU_DEVICE_INVALID, CU_DEVICE_CPU or a device */
    int last_prefetch; /* the same */
    int resident;      /* device charged for it, or -1 */
} managed_t;

static pthread_mutex_t managed_lock = PTHREAD_MUTEX_INITIALIZER;
static managed_t *managed_list;

/* The managed allocation holding [p, p+n), lock held. */
static managed_t *managed_find_locked(uintptr_t p, size_t n)
{
    for (managed_t *m = managed_list; m; m = m->next)
        if (p >= m->base && p - m->base < m->size && n <= m->size - (p - m->base)) return m;
    return NULL;
}

CUresult td_cuMemAllocManaged(CUdeviceptr_v2 *dptr, size_t bytesize, unsigned int flags)
{
    CUcontext ctx;
    CUresult r = td_ctx_require(&ctx);
    if (r != CUDA_SUCCESS) return r;
    if (!dptr || bytesize == 0 || (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST))
        return CUDA_ERROR_INVALID_VALUE;
    if ((r = td_capture_unsafe_call()) != CUDA_SUCCESS) return r;
    managed_t *m = calloc(1, sizeof *m);
    if (!m) return CUDA_ERROR_OUT_OF_MEMORY;
    void *p = mmap(NULL, bytesize, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
        free(m);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    td_range_t rg = {.base = (uintptr_t)p, .size = bytesize, .kind = TD_KIND_MANAGED,
                     .device = td_ctx_device(ctx), .ctx = ctx, .fd = -1};
    if ((r = td_range_add(&rg)) != CUDA_SUCCESS) {
        munmap(p, bytesize);
        free(m);
        return r;
    }
    m->base = (uintptr_t)p;
    m->size = bytesize;
    m->preferred = m->last_prefetch = CU_DEVICE_INVALID;
    m->resident = -1;
    pthread_mutex_lock(&managed_lock);
    m->next = managed_list;
    managed_list = m;
    pthread_mutex_unlock(&managed_lock);
    *dptr = (CUdeviceptr)(uintptr_t)p;
    return CUDA_SUCCESS;
}

static void managed_free(uintptr_t base)
{
    pthread_mutex_lock(&managed_lock);
    managed_t **at = &managed_list;
    while (*at && (*at)->base != base) at = &(*at)->next;
    managed_t *m = *at;
    if (m) *at = m->next;
    pthread_mutex_unlock(&managed_lock);
    if (!m) return;
    if (m->resident >= 0) td_mem_uncharge(m->resident, charged_size(m->size));
    free(m);
}

static int location_id(CUmemLocation loc, bool *ok)
{
    *ok = true;
    switch (loc.type) {
    case CU_MEM_LOCATION_TYPE_DEVICE:
        *ok = loc.id >= 0 && loc.id < TD_DEVICE_COUNT;
        return loc.id;
    case CU_MEM_LOCATION_TYPE_HOST:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT: return CU_DEVICE_CPU;
    default: *ok = false; return CU_DEVICE_INVALID;
    }
}

CUresult td_cuMemAdvise(CUdeviceptr_v2 devPtr, size_t count, CUmem_advise advice, CUmemLocation_v1 location)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    bool ok = true;
    int id = CU_DEVICE_INVALID;
    if (advice == CU_MEM_ADVISE_SET_PREFERRED_LOCATION || advice == CU_MEM_ADVISE_SET_ACCESSED_BY ||
        advice == CU_MEM_ADVISE_UNSET_ACCESSED_BY)
        id = location_id(location, &ok);
    else if (advice != CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION &&
             advice != CU_MEM_ADVISE_SET_READ_MOSTLY && advice != CU_MEM_ADVISE_UNSET_READ_MOSTLY)
        ok = false;
    if (!ok || count == 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&managed_lock);
    managed_t *m = managed_find_locked((uintptr_t)devPtr, count);
    if (!m) r = CUDA_ERROR_INVALID_VALUE;
    else if (advice == CU_MEM_ADVISE_SET_PREFERRED_LOCATION) m->preferred = id;
    else if (advice == CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION) m->preferred = CU_DEVICE_INVALID;
    pthread_mutex_unlock(&managed_lock);
    return r;
}

typedef struct prefetch {
    uintptr_t ptr;
    size_t count;
    int to;
} prefetch_t;

/* Runs on the stream: the pages move, and device memory is charged for
 * them where they land (or not at all, if the device is full: the real
 * driver evicts). */
static void run_prefetch(void *arg)
{
    const prefetch_t *p = arg;
    pthread_mutex_lock(&managed_lock);
    managed_t *m = managed_find_locked(p->ptr, p->count);
    if (m) {
        m->last_prefetch = p->to;
        int want = p->to >= 0 ? p->to : -1;
        if (m->resident != want) {
            if (m->resident >= 0) td_mem_uncharge(m->resident, charged_size(m->size));
            m->resident = -1;
            if (want >= 0 && td_mem_charge(want, charged_size(m->size)) == CUDA_SUCCESS)
                m->resident = want;
        }
    }
    pthread_mutex_unlock(&managed_lock);
}

CUresult td_cuMemPrefetchAsync(CUdeviceptr_v2 devPtr, size_t count, CUmemLocation_v1 location, unsigned int flags, CUstream hStream)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    bool ok;
    int to = location_id(location, &ok);
    if (!ok || flags != 0 || count == 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&managed_lock);
    bool known = managed_find_locked((uintptr_t)devPtr, count) != NULL;
    pthread_mutex_unlock(&managed_lock);
    if (!known) return CUDA_ERROR_INVALID_VALUE;
    prefetch_t p = {(uintptr_t)devPtr, count, to};
    return td_enqueue(hStream, run_prefetch, &p, sizeof p);
}

CUresult td_cuMemRangeGetAttribute(void *data, size_t dataSize, CUmem_range_attribute attribute, CUdeviceptr_v2 devPtr, size_t count)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!data || count == 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&managed_lock);
    managed_t *m = managed_find_locked((uintptr_t)devPtr, count);
    int v = 0;
    if (!m) r = CUDA_ERROR_INVALID_VALUE;
    else if (attribute == CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION) v = m->preferred;
    else if (attribute == CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION) v = m->last_prefetch;
    else if (attribute == CU_MEM_RANGE_ATTRIBUTE_READ_MOSTLY) v = 0;
    else r = CUDA_ERROR_NOT_SUPPORTED;
    pthread_mutex_unlock(&managed_lock);
    if (r != CUDA_SUCCESS) return r;
    if (dataSize != sizeof v) return CUDA_ERROR_INVALID_VALUE;
    memcpy(data, &v, sizeof v);
    return CUDA_SUCCESS;
}

/* ---- freeing ---- */

CUresult td_cuMemFree(CUdeviceptr_v2 dptr)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (dptr == 0) return CUDA_SUCCESS;
    if ((r = td_capture_unsafe_call()) != CUDA_SUCCESS) return r;
    td_range_t rg;
    if (!td_range_find((uintptr_t)dptr, &rg) || rg.base != (uintptr_t)dptr)
        return CUDA_ERROR_INVALID_VALUE;
    if (rg.kind == TD_KIND_POOL || rg.kind == TD_KIND_IPC) return td_pool_free_sync(&rg);
    if (rg.kind != TD_KIND_DEVICE && rg.kind != TD_KIND_MANAGED) return CUDA_ERROR_INVALID_VALUE;
    /* As the real cuMemFree: the device's work finishes first. */
    td_ctx_drain(NULL);
    if (!td_range_remove(rg.base, rg.kind, &rg)) return CUDA_ERROR_INVALID_VALUE;
    munmap((void *)rg.base, rg.size);
    if (rg.fd >= 0) close(rg.fd);
    if (rg.kind == TD_KIND_DEVICE) td_mem_uncharge(rg.device, charged_size(rg.size));
    else managed_free(rg.base);
    return CUDA_SUCCESS;
}

/* ---- pinned and registered host memory ---- */

CUresult td_cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags)
{
    CUcontext ctx;
    CUresult r = td_ctx_require(&ctx);
    if (r != CUDA_SUCCESS) return r;
    const unsigned known = CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_WRITECOMBINED;
    if (!pp || bytesize == 0 || (Flags & ~known)) return CUDA_ERROR_INVALID_VALUE;
    if ((r = td_capture_unsafe_call()) != CUDA_SUCCESS) return r;
    void *p = mmap(NULL, bytesize, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    td_range_t rg = {.base = (uintptr_t)p, .size = bytesize, .kind = TD_KIND_HOST,
                     .device = td_ctx_device(ctx), .ctx = ctx, .fd = -1, .host_memtype = true,
                     .flags = Flags};
    if ((r = td_range_add(&rg)) != CUDA_SUCCESS) {
        munmap(p, bytesize);
        return r;
    }
    *pp = p;
    return CUDA_SUCCESS;
}

CUresult td_cuMemAllocHost(void **pp, size_t bytesize) { return td_cuMemHostAlloc(pp, bytesize, 0); }

CUresult td_cuMemFreeHost(void *p)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    if ((r = td_capture_unsafe_call()) != CUDA_SUCCESS) return r;
    td_range_t rg;
    if (!p || !td_range_find((uintptr_t)p, &rg) || rg.kind != TD_KIND_HOST || rg.base != (uintptr_t)p)
        return CUDA_ERROR_INVALID_VALUE;
    td_ctx_drain(NULL);
    if (!td_range_remove(rg.base, TD_KIND_HOST, &rg)) return CUDA_ERROR_INVALID_VALUE;
    munmap(p, rg.size);
    return CUDA_SUCCESS;
}

CUresult td_cuMemHostRegister(void *p, size_t bytesize, unsigned int Flags)
{
    CUcontext ctx;
    CUresult r = td_ctx_require(&ctx);
    if (r != CUDA_SUCCESS) return r;
    const unsigned known = CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP |
                           CU_MEMHOSTREGISTER_IOMEMORY | CU_MEMHOSTREGISTER_READ_ONLY;
    if (!p || bytesize == 0 || (Flags & ~known) || (Flags & CU_MEMHOSTREGISTER_IOMEMORY))
        return CUDA_ERROR_INVALID_VALUE;
    if (overlaps((uintptr_t)p, bytesize, TD_KIND_REGISTERED) ||
        overlaps((uintptr_t)p, bytesize, TD_KIND_HOST))
        return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
    td_range_t rg = {.base = (uintptr_t)p, .size = bytesize, .kind = TD_KIND_REGISTERED,
                     .device = td_ctx_device(ctx), .ctx = ctx, .fd = -1, .host_memtype = true,
                     .flags = Flags};
    return td_range_add(&rg);
}

CUresult td_cuMemHostUnregister(void *p)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    td_ctx_drain(NULL);
    return td_range_remove((uintptr_t)p, TD_KIND_REGISTERED, NULL)
               ? CUDA_SUCCESS
               : CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
}

/* Pinned or registered memory has a device address in the context that
 * made it, or in every context when it is portable. */
static bool host_mapped_here(const td_range_t *rg)
{
    unsigned portable = rg->kind == TD_KIND_HOST ? CU_MEMHOSTALLOC_PORTABLE : CU_MEMHOSTREGISTER_PORTABLE;
    CUcontext cur = td_ctx_current();
    return (rg->flags & portable) || !cur || cur == rg->ctx;
}

CUresult td_cuMemHostGetDevicePointer(CUdeviceptr_v2 *pdptr, void *p, unsigned int Flags)
{
    CUcontext ctx;
    CUresult r = td_ctx_require(&ctx);
    if (r != CUDA_SUCCESS) return r;
    if (!pdptr || !p || Flags != 0) return CUDA_ERROR_INVALID_VALUE;
    td_range_t rg;
    if (!td_range_find((uintptr_t)p, &rg) || (rg.kind != TD_KIND_HOST && rg.kind != TD_KIND_REGISTERED) ||
        !host_mapped_here(&rg))
        return CUDA_ERROR_INVALID_VALUE;
    *pdptr = (CUdeviceptr)(uintptr_t)p;
    return CUDA_SUCCESS;
}

/* ---- pointer attributes ---- */

CUresult td_cuMemGetAddressRange(CUdeviceptr_v2 *pbase, size_t *psize, CUdeviceptr_v2 dptr)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    td_range_t rg;
    if (!td_range_find((uintptr_t)dptr, &rg) || rg.kind == TD_KIND_VMM_RESERVE ||
        rg.kind == TD_KIND_HOST || rg.kind == TD_KIND_REGISTERED)
        return CUDA_ERROR_NOT_FOUND;
    if (pbase) *pbase = (CUdeviceptr)rg.base;
    if (psize) *psize = rg.size;
    return CUDA_SUCCESS;
}

/* The range behind ptr as pointer attributes see it: not a bare
 * reservation (no memory there). */
static bool attr_range(CUdeviceptr ptr, td_range_t *rg)
{
    return td_range_find((uintptr_t)ptr, rg) && rg->kind != TD_KIND_VMM_RESERVE;
}

static void put_bool(void *data, bool v) { *(bool *)data = v; }

/* One attribute of known memory (rg) or of memory the driver does not know
 * (rg NULL: the plural query's defaults). CUDA_ERROR_INVALID_VALUE where
 * the attribute has no value for this memory. */
static CUresult attribute(CUpointer_attribute a, void *data, CUdeviceptr ptr, const td_range_t *rg)
{
    bool host = rg && (rg->kind == TD_KIND_HOST || rg->kind == TD_KIND_REGISTERED);
    switch (a) {
    case CU_POINTER_ATTRIBUTE_CONTEXT: *(CUcontext *)data = rg ? rg->ctx : NULL; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
        *(unsigned int *)data = !rg ? 0u : rg->host_memtype ? CU_MEMORYTYPE_HOST : CU_MEMORYTYPE_DEVICE;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
        if (rg && host && !host_mapped_here(rg)) return CUDA_ERROR_INVALID_VALUE;
        *(CUdeviceptr *)data = rg ? ptr : 0;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_HOST_POINTER:
        if (rg && !rg->host_memtype && rg->kind != TD_KIND_MANAGED) return CUDA_ERROR_INVALID_VALUE;
        *(void **)data = rg ? (void *)(uintptr_t)ptr : NULL;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_SYNC_MEMOPS: put_bool(data, false); return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_BUFFER_ID:
        *(unsigned long long *)data = rg ? rg->id : 0;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_IS_MANAGED: put_bool(data, rg && rg->kind == TD_KIND_MANAGED); return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
        *(int *)data = !rg ? -2 : rg->device >= 0 ? rg->device : td_ctx_device(td_ctx_current());
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE:
        put_bool(data, rg && rg->kind == TD_KIND_DEVICE && rg->fd >= 0);
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE: {
        /* cuda.h: the mappable address range, not the mapped region (a VMM
         * mapping's is its cuMemAddressReserve reservation). */
        td_range_t resv;
        const td_range_t *of = rg && rg->kind == TD_KIND_VMM_MAP &&
                                       range_of_kind((uintptr_t)ptr, TD_KIND_VMM_RESERVE, &resv)
                                   ? &resv
                                   : rg;
        if (a == CU_POINTER_ATTRIBUTE_RANGE_START_ADDR) *(CUdeviceptr *)data = of ? (CUdeviceptr)of->base : 0;
        else *(size_t *)data = of ? of->size : 0;
        return CUDA_SUCCESS;
    }
    case CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR:
        *(CUdeviceptr *)data = rg ? (CUdeviceptr)rg->base : 0;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MAPPING_SIZE:
        *(size_t *)data = rg ? rg->size : 0;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MAPPED: put_bool(data, rg != NULL); return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES:
        *(unsigned long long *)data = rg ? rg->handle_types : 0;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE: put_bool(data, false); return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_ACCESS_FLAGS:
        *(unsigned int *)data = rg ? CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READWRITE : 0;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE:
        *(CUmemoryPool *)data = rg && rg->kind == TD_KIND_POOL ? (CUmemoryPool)rg->owner : NULL;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID:
        *(unsigned long long *)data = rg ? rg->id : 0;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_IS_HW_DECOMPRESS_CAPABLE: put_bool(data, false); return CUDA_SUCCESS;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
}

CUresult td_cuPointerGetAttribute(void *data, CUpointer_attribute attribute_, CUdeviceptr_v2 ptr)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!data) return CUDA_ERROR_INVALID_VALUE;
    td_range_t rg;
    if (!attr_range(ptr, &rg)) return CUDA_ERROR_INVALID_VALUE;
    return attribute(attribute_, data, ptr, &rg);
}

CUresult td_cuPointerGetAttributes(unsigned int numAttributes, CUpointer_attribute *attributes, void **data, CUdeviceptr_v2 ptr)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!numAttributes || !attributes || !data) return CUDA_ERROR_INVALID_VALUE;
    td_range_t rg;
    bool known = attr_range(ptr, &rg);
    for (unsigned i = 0; i < numAttributes; i++) {
        if (!data[i]) return CUDA_ERROR_INVALID_VALUE;
        r = attribute(attributes[i], data[i], ptr, known ? &rg : NULL);
        if (r != CUDA_SUCCESS) return r;
    }
    return CUDA_SUCCESS;
}

/* ---- copies and fills ---- */

/* Whether the device can touch all of [p, p+n): inside one allocation, or
 * across adjacent VMM mappings, never in a reservation where nothing is
 * mapped (the real driver reports CUDA_ERROR_INVALID_VALUE there). Memory
 * the driver does not know is pageable host memory: fine for a copy
 * (pageable_ok), not for a fill. */
static bool covered(CUdeviceptr p, size_t n, bool pageable_ok)
{
    if (!p || p + n < p) return false;
    uintptr_t a = (uintptr_t)p, end = (uintptr_t)p + n;
    while (a < end) {
        td_range_t rg;
        if (!td_range_find(a, &rg)) return pageable_ok && a == (uintptr_t)p;
        if (rg.kind == TD_KIND_VMM_RESERVE) return false;
        if (rg.kind != TD_KIND_VMM_MAP && end - rg.base > rg.size) return false;
        a = rg.base + rg.size;
    }
    return true;
}

typedef struct copy_op {
    uintptr_t dst, src;
    size_t n;
} copy_op_t;

static void run_copy(void *arg)
{
    const copy_op_t *c = arg;
    memmove((void *)c->dst, (const void *)c->src, c->n);
}

static CUresult copy_check(CUdeviceptr dst, CUdeviceptr src, size_t n)
{
    if (n == 0) return CUDA_SUCCESS;
    return covered(dst, n, true) && covered(src, n, true) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult td_cuMemcpyAsync(CUdeviceptr_v2 dst, CUdeviceptr_v2 src, size_t ByteCount, CUstream hStream)
{
    CUresult r = td_check_init();
    if (r == CUDA_SUCCESS) r = copy_check(dst, src, ByteCount);
    if (r != CUDA_SUCCESS) return r;
    copy_op_t c = {(uintptr_t)dst, (uintptr_t)src, ByteCount};
    return td_enqueue(hStream, ByteCount ? run_copy : NULL, &c, sizeof c);
}

/* A synchronous copy: on the legacy stream, waited for; needs a context. */
static CUresult copy_sync(CUdeviceptr dst, CUdeviceptr src, size_t n)
{
    CUcontext ctx;
    CUresult r = td_ctx_require(&ctx);
    if (r == CUDA_SUCCESS) r = copy_check(dst, src, n);
    if (r != CUDA_SUCCESS) return r;
    copy_op_t c = {(uintptr_t)dst, (uintptr_t)src, n};
    return td_enqueue_sync(CU_STREAM_LEGACY, n ? run_copy : NULL, &c, sizeof c);
}

CUresult td_cuMemcpy(CUdeviceptr_v2 dst, CUdeviceptr_v2 src, size_t ByteCount)
{
    return copy_sync(dst, src, ByteCount);
}

CUresult td_cuMemcpyHtoD(CUdeviceptr_v2 dstDevice, const void *srcHost, size_t ByteCount)
{
    return copy_sync(dstDevice, (CUdeviceptr)(uintptr_t)srcHost, ByteCount);
}

CUresult td_cuMemcpyDtoH(void *dstHost, CUdeviceptr_v2 srcDevice, size_t ByteCount)
{
    return copy_sync((CUdeviceptr)(uintptr_t)dstHost, srcDevice, ByteCount);
}

CUresult td_cuMemcpyPeerAsync(CUdeviceptr_v2 dstDevice, CUcontext dstContext, CUdeviceptr_v2 srcDevice, CUcontext srcContext, size_t ByteCount, CUstream hStream)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (td_ctx_device(dstContext) < 0 || td_ctx_device(srcContext) < 0) return CUDA_ERROR_INVALID_CONTEXT;
    return td_cuMemcpyAsync(dstDevice, srcDevice, ByteCount, hStream);
}

typedef struct batch_op {
    size_t count;
    uintptr_t *dsts, *srcs; /* srcs may point into `snap` */
    size_t *sizes;
    unsigned char *snap;    /* sources read during the call */
} batch_op_t;

static void run_batch(void *arg)
{
    batch_op_t *b = *(batch_op_t **)arg;
    for (size_t i = 0; i < b->count; i++)
        memmove((void *)b->dsts[i], (const void *)b->srcs[i], b->sizes[i]);
    free(b->dsts);
    free(b->srcs);
    free(b->sizes);
    free(b->snap);
    free(b);
}

CUresult td_cuMemcpyBatchAsync(CUdeviceptr_v2 *dsts, CUdeviceptr_v2 *srcs, size_t *sizes, size_t count, CUmemcpyAttributes_v1 *attrs, size_t *attrIdxs, size_t numAttrs, CUstream hStream)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!dsts || !srcs || !sizes || !count || !attrs || !attrIdxs || !numAttrs || attrIdxs[0] != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (hStream == NULL || hStream == CU_STREAM_LEGACY) return CUDA_ERROR_INVALID_VALUE;
    CUstreamCaptureStatus cs;
    if ((r = td_stream_capture_status(hStream, &cs)) != CUDA_SUCCESS) return r;
    if (cs != CU_STREAM_CAPTURE_STATUS_NONE) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    for (size_t i = 0; i < numAttrs; i++) {
        if (attrs[i].srcAccessOrder == CU_MEMCPY_SRC_ACCESS_ORDER_INVALID ||
            attrs[i].srcAccessOrder > CU_MEMCPY_SRC_ACCESS_ORDER_ANY)
            return CUDA_ERROR_INVALID_VALUE;
        if (i > 0 && (attrIdxs[i] <= attrIdxs[i - 1] || attrIdxs[i] >= count)) return CUDA_ERROR_INVALID_VALUE;
    }
    size_t snap_bytes = 0;
    for (size_t i = 0, a = 0; i < count; i++) {
        while (a + 1 < numAttrs && attrIdxs[a + 1] <= i) a++;
        if ((r = copy_check(dsts[i], srcs[i], sizes[i])) != CUDA_SUCCESS) return r;
        if (attrs[a].srcAccessOrder == CU_MEMCPY_SRC_ACCESS_ORDER_DURING_API_CALL) snap_bytes += sizes[i];
    }
    batch_op_t *b = calloc(1, sizeof *b);
    if (b) {
        b->count = count;
        b->dsts = malloc(count * sizeof *b->dsts);
        b->srcs = malloc(count * sizeof *b->srcs);
        b->sizes = malloc(count * sizeof *b->sizes);
        b->snap = snap_bytes ? malloc(snap_bytes) : NULL;
    }
    if (!b || !b->dsts || !b->srcs || !b->sizes || (snap_bytes && !b->snap)) {
        if (b) {
            free(b->dsts);
            free(b->srcs);
            free(b->sizes);
            free(b->snap);
            free(b);
        }
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    size_t at = 0;
    for (size_t i = 0, a = 0; i < count; i++) {
        while (a + 1 < numAttrs && attrIdxs[a + 1] <= i) a++;
        b->dsts[i] = (uintptr_t)dsts[i];
        b->sizes[i] = sizes[i];
        b->srcs[i] = (uintptr_t)srcs[i];
        if (attrs[a].srcAccessOrder == CU_MEMCPY_SRC_ACCESS_ORDER_DURING_API_CALL && sizes[i]) {
            memcpy(b->snap + at, (const void *)(uintptr_t)srcs[i], sizes[i]);
            b->srcs[i] = (uintptr_t)(b->snap + at);
            at += sizes[i];
        }
    }
    r = td_enqueue(hStream, run_batch, &b, sizeof b);
    if (r != CUDA_SUCCESS) {
        batch_op_t *keep = b;
        keep->count = 0;
        run_batch(&keep);
    }
    return r;
}

typedef struct fill_op {
    uintptr_t dst;
    unsigned int value;
    size_t n;     /* elements */
    unsigned width; /* 1, 2 or 4 bytes */
} fill_op_t;

static void run_fill(void *arg)
{
    const fill_op_t *f = arg;
    if (f->width == 1) {
        memset((void *)f->dst, (int)(f->value & 0xff), f->n);
    } else if (f->width == 2) {
        uint16_t v = (uint16_t)f->value, *p = (uint16_t *)f->dst;
        for (size_t i = 0; i < f->n; i++) p[i] = v;
    } else {
        uint32_t v = f->value, *p = (uint32_t *)f->dst;
        for (size_t i = 0; i < f->n; i++) p[i] = v;
    }
}

/* A fill needs memory the device can address (not pageable memory), aligned to its width. */
static CUresult fill_check(CUdeviceptr dst, size_t n, unsigned width)
{
    if (n == 0) return CUDA_SUCCESS;
    if (dst % width || n > SIZE_MAX / width) return CUDA_ERROR_INVALID_VALUE;
    return covered(dst, n * width, false) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

static CUresult fill_async(CUdeviceptr dst, unsigned value, size_t n, unsigned width, CUstream s)
{
    CUresult r = td_check_init();
    if (r == CUDA_SUCCESS) r = fill_check(dst, n, width);
    if (r != CUDA_SUCCESS) return r;
    fill_op_t f = {(uintptr_t)dst, value, n, width};
    return td_enqueue(s, n ? run_fill : NULL, &f, sizeof f);
}

CUresult td_cuMemsetD8Async(CUdeviceptr_v2 dstDevice, unsigned char uc, size_t N, CUstream hStream)
{
    return fill_async(dstDevice, uc, N, 1, hStream);
}

CUresult td_cuMemsetD16Async(CUdeviceptr_v2 dstDevice, unsigned short us, size_t N, CUstream hStream)
{
    return fill_async(dstDevice, us, N, 2, hStream);
}

CUresult td_cuMemsetD32Async(CUdeviceptr_v2 dstDevice, unsigned int ui, size_t N, CUstream hStream)
{
    return fill_async(dstDevice, ui, N, 4, hStream);
}

CUresult td_cuMemsetD8(CUdeviceptr_v2 dstDevice, unsigned char uc, size_t N)
{
    CUcontext ctx;
    CUresult r = td_ctx_require(&ctx);
    if (r == CUDA_SUCCESS) r = fill_check(dstDevice, N, 1);
    if (r != CUDA_SUCCESS) return r;
    fill_op_t f = {(uintptr_t)dstDevice, uc, N, 1};
    return td_enqueue_sync(CU_STREAM_LEGACY, N ? run_fill : NULL, &f, sizeof f);
}

/* dma-buf export: host memory has no dma-buf exporter, so the test driver
 * is a device without dma-buf support (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED
 * reads 0, device.c) and refuses every range as the real driver would there. */
CUresult td_cuMemGetHandleForAddressRange(void *handle, CUdeviceptr_v2 dptr, size_t size,
                                          CUmemRangeHandleType handleType, unsigned long long flags)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    (void)flags;
    if (!handle || !dptr || !size || handleType != CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD)
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_ERROR_NOT_SUPPORTED;
}
