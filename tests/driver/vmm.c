/* Virtual memory management: address reservations are taken from one large
 * PROT_NONE anonymous mapping made on first use (lowest free address first,
 * the requested one when it is free, as the GPU's address allocator does,
 * so that a range can usually grow in place); a physical allocation that
 * may be exported is a memfd of its size ("vmm:<loc type>:<id>:<handle
 * types>:<alloc type>"), any other a piece of one shared sparse memfd (a
 * process with thousands of allocations holds one fd); cuMemMap maps it
 * MAP_SHARED|MAP_FIXED inside a reservation without access, and cuMemSetAccess changes the protection for
 * real (the union of what the host and the devices were granted: they all
 * are this process). A physical allocation is freed once it is released and
 * no mapping refers to it. POSIX-fd export hands out a dup of the memfd;
 * fabric handles are refused with CUDA_ERROR_NOT_PERMITTED, as on an H200
 * without an IMEX channel. One lock guards it all. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fake.h"

#define PHYS_MAGIC 0x53594850u /* "PHYS" */
#define NLOC (1 + TD_DEVICE_COUNT) /* access slots: the host, then each device */

typedef struct phys {
    uint32_t magic;
    struct phys *next;
    int fd;          /* its own memfd, or the shared one */
    bool own_fd;
    uint64_t offset; /* in fd */
    size_t size;
    CUmemAllocationProp prop;
    int charged; /* device charged for it, or -1 */
    unsigned refs; /* handles not released (create/import, retains) */
    unsigned maps; /* live mappings */
} phys_t;

typedef struct resv {
    struct resv *next;
    uintptr_t base;
    size_t size;
    bool in_arena; /* else an mmap of its own (a requested address outside the arena) */
} resv_t;

typedef struct mapping {
    struct mapping *next;
    uintptr_t base;
    size_t size;
    phys_t *phys;
    CUmemAccess_flags access[NLOC];
} mapping_t;

#define ARENA_SIZE ((size_t)1 << 40)   /* address space for reservations */
#define SHARED_SPAN ((uint64_t)1 << 46) /* the shared memfd's (sparse) size */

typedef struct span {
    struct span *next;
    uint64_t offset, size;
} span_t;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static uintptr_t arena;       /* 0 until the first reservation */
static size_t arena_size;     /* its size, ARENA_SIZE or less (see arena_take_locked) */
static int shared_fd = -1;    /* memory that is never exported */
static uint64_t shared_bump;
static span_t *shared_holes;
static phys_t *allocs;
static resv_t *resvs;
static mapping_t *maps;

static bool aligned(uintptr_t v) { return v % TD_GRANULARITY == 0; }

static phys_t *phys_of_locked(CUmemGenericAllocationHandle h)
{
    for (phys_t *p = allocs; p; p = p->next)
        if ((uintptr_t)p == (uintptr_t)h && p->refs) return p;
    return NULL;
}

static void phys_maybe_free_locked(phys_t *p)
{
    if (p->refs || p->maps) return;
    for (phys_t **q = &allocs; *q; q = &(*q)->next)
        if (*q == p) {
            *q = p->next;
            break;
        }
    if (p->own_fd) {
        close(p->fd);
    } else {
        (void)fallocate(p->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)p->offset, (off_t)p->size);
        span_t *h = malloc(sizeof *h);
        if (h) {
            *h = (span_t){shared_holes, p->offset, p->size};
            shared_holes = h;
        }
    }
    if (p->charged >= 0) td_mem_uncharge(p->charged, p->size);
    p->magic = 0;
    free(p);
}

static bool numa_node_exists(int id)
{
    char path[64];
    snprintf(path, sizeof path, "/sys/devices/system/node/node%d", id);
    return id == 0 || (id > 0 && access(path, F_OK) == 0);
}

/* The properties cuMemCreate and cuMemGetAllocationGranularity accept. */
static CUresult check_prop(const CUmemAllocationProp *prop)
{
    if (!prop) return CUDA_ERROR_INVALID_VALUE;
    if (prop->type != CU_MEM_ALLOCATION_TYPE_PINNED && prop->type != CU_MEM_ALLOCATION_TYPE_MANAGED)
        return CUDA_ERROR_INVALID_VALUE;
    CUmemAllocationHandleType h = prop->requestedHandleTypes;
    if (h & CU_MEM_HANDLE_TYPE_FABRIC) return CUDA_ERROR_NOT_PERMITTED; /* no IMEX channel */
    if (h & ~(unsigned)CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_NOT_SUPPORTED;
    switch (prop->location.type) {
    case CU_MEM_LOCATION_TYPE_DEVICE: return td_check_device(prop->location.id);
    case CU_MEM_LOCATION_TYPE_HOST:
        return h == CU_MEM_HANDLE_TYPE_NONE ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    case CU_MEM_LOCATION_TYPE_HOST_NUMA:
        return numa_node_exists(prop->location.id) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    default: return CUDA_ERROR_INVALID_VALUE; /* HOST_NUMA_CURRENT included */
    }
}

/* ---- reservations ---- */

/* A reservation outside the arena, exactly at addr, or NULL. */
static void *reserve_at(uintptr_t addr, size_t size)
{
    void *p = mmap((void *)addr, size, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0);
    if (p == MAP_FAILED) return NULL;
    if ((uintptr_t)p != addr) { /* a kernel without MAP_FIXED_NOREPLACE */
        munmap(p, size);
        return NULL;
    }
    return p;
}

static uintptr_t align_up(uintptr_t v, size_t a) { return (v + a - 1) / a * a; }

static bool arena_free_locked(uintptr_t base, size_t size)
{
    if (base < arena || base + size > arena + arena_size || base + size < base) return false;
    for (resv_t *v = resvs; v; v = v->next)
        if (v->base < base + size && base < v->base + v->size) return false;
    return true;
}

/* The lowest free stretch of the arena (made on first use), or 0. */
static uintptr_t arena_take_locked(size_t size, size_t align)
{
    if (!arena) {
        /* As large as the process's address space allows: under
         * ThreadSanitizer, whose shadow takes most of it, 1 TiB is sometimes
         * not there, so halve down to 64 GiB. */
        void *p = MAP_FAILED;
        for (arena_size = ARENA_SIZE; p == MAP_FAILED && arena_size >= ((size_t)1 << 36);) {
            p = mmap(NULL, arena_size + ((size_t)1 << 30), PROT_NONE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (p == MAP_FAILED) arena_size /= 2;
        }
        if (p == MAP_FAILED) return 0;
        arena = align_up((uintptr_t)p, (size_t)1 << 30);
    }
    uintptr_t cand = align_up(arena, align);
    for (bool moved = true; moved;) {
        moved = false;
        if (cand + size > arena + arena_size || cand + size < cand) return 0;
        for (resv_t *v = resvs; v; v = v->next)
            if (v->base < cand + size && cand < v->base + v->size) {
                cand = align_up(v->base + v->size, align);
                moved = true;
            }
    }
    return cand;
}

CUresult td_cuMemAddressReserve(CUdeviceptr_v2 *ptr, size_t size, size_t alignment, CUdeviceptr_v2 addr,
                                unsigned long long flags)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!ptr || size == 0 || !aligned(size) || flags || (alignment & (alignment - 1)))
        return CUDA_ERROR_INVALID_VALUE;
    size_t align = alignment > TD_GRANULARITY ? alignment : TD_GRANULARITY;
    resv_t *v = calloc(1, sizeof *v);
    if (!v) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&lock);
    uintptr_t p = 0;
    v->in_arena = true;
    if (addr && addr % align == 0) {
        if (arena_free_locked((uintptr_t)addr, size)) p = (uintptr_t)addr;
        else if ((!arena || addr + size <= arena || addr >= arena + arena_size) &&
                 reserve_at((uintptr_t)addr, size)) {
            p = (uintptr_t)addr;
            v->in_arena = false;
        }
    }
    if (!p) {
        v->in_arena = true;
        p = arena_take_locked(size, align);
    }
    td_range_t rg = {.base = p, .size = size, .kind = TD_KIND_VMM_RESERVE, .device = -1, .fd = -1};
    r = p ? td_range_add(&rg) : CUDA_ERROR_OUT_OF_MEMORY;
    if (r != CUDA_SUCCESS) {
        if (p && !v->in_arena) munmap((void *)p, size);
        pthread_mutex_unlock(&lock);
        free(v);
        return r;
    }
    v->base = p;
    v->size = size;
    v->next = resvs;
    resvs = v;
    pthread_mutex_unlock(&lock);
    *ptr = (CUdeviceptr)p;
    return CUDA_SUCCESS;
}

static bool mapped_within_locked(uintptr_t base, size_t size)
{
    for (mapping_t *m = maps; m; m = m->next)
        if (m->base < base + size && base < m->base + m->size) return true;
    return false;
}

CUresult td_cuMemAddressFree(CUdeviceptr_v2 ptr, size_t size)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    pthread_mutex_lock(&lock);
    for (resv_t **q = &resvs; *q; q = &(*q)->next) {
        resv_t *v = *q;
        if (v->base != (uintptr_t)ptr || v->size != size) continue;
        if (mapped_within_locked(v->base, v->size)) break; /* unmap first */
        *q = v->next;
        td_range_remove(v->base, TD_KIND_VMM_RESERVE, NULL);
        if (!v->in_arena) munmap((void *)v->base, v->size); /* arena addresses stay PROT_NONE */
        free(v);
        pthread_mutex_unlock(&lock);
        return CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&lock);
    return CUDA_ERROR_INVALID_VALUE;
}

/* Whether reservations (adjacent ones together) cover [base, base+size). */
static bool reserved_locked(uintptr_t base, size_t size)
{
    uintptr_t pos = base, end = base + size;
    while (pos < end) {
        resv_t *hit = NULL;
        for (resv_t *v = resvs; v && !hit; v = v->next)
            if (v->base <= pos && pos < v->base + v->size) hit = v;
        if (!hit) return false;
        pos = hit->base + hit->size;
    }
    return true;
}

/* ---- physical allocations ---- */

CUresult td_cuMemCreate(CUmemGenericAllocationHandle_v1 *handle, size_t size, const CUmemAllocationProp_v1 *prop,
                        unsigned long long flags)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!handle || size == 0 || !aligned(size) || flags) return CUDA_ERROR_INVALID_VALUE;
    if ((r = check_prop(prop)) != CUDA_SUCCESS) return r;
    int dev = prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE ? prop->location.id : -1;
    if (dev >= 0 && (r = td_mem_charge(dev, size)) != CUDA_SUCCESS) return r;
    phys_t *p = calloc(1, sizeof *p);
    int fd = -1;
    uint64_t offset = 0;
    bool own = (prop->requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) != 0;
    if (p && own) {
        char name[64];
        snprintf(name, sizeof name, "vmm:%d:%d:%d:%d", (int)prop->location.type, prop->location.id,
                 (int)prop->requestedHandleTypes, (int)prop->type);
        fd = td_share_memfd(name, size);
    } else if (p) {
        pthread_mutex_lock(&lock);
        if (shared_fd < 0) shared_fd = td_share_memfd("vmm-shared", SHARED_SPAN);
        offset = UINT64_MAX;
        for (span_t **q = &shared_holes; *q && offset == UINT64_MAX; q = &(*q)->next) {
            span_t *h = *q;
            if (h->size < size) continue;
            offset = h->offset;
            h->offset += size;
            h->size -= size;
            if (h->size == 0) {
                *q = h->next;
                free(h);
                break;
            }
        }
        if (offset == UINT64_MAX && shared_bump + size <= SHARED_SPAN) {
            offset = shared_bump;
            shared_bump += size;
        }
        fd = offset == UINT64_MAX ? -1 : shared_fd;
        pthread_mutex_unlock(&lock);
    }
    if (fd < 0) {
        free(p);
        if (dev >= 0) td_mem_uncharge(dev, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    p->own_fd = own;
    p->offset = offset;
    p->magic = PHYS_MAGIC;
    p->fd = fd;
    p->size = size;
    p->prop = *prop;
    p->charged = dev;
    p->refs = 1;
    pthread_mutex_lock(&lock);
    p->next = allocs;
    allocs = p;
    pthread_mutex_unlock(&lock);
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)p;
    return CUDA_SUCCESS;
}

CUresult td_cuMemRelease(CUmemGenericAllocationHandle_v1 handle)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    pthread_mutex_lock(&lock);
    phys_t *p = phys_of_locked(handle);
    if (p) {
        p->refs--;
        phys_maybe_free_locked(p);
    }
    pthread_mutex_unlock(&lock);
    return p ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ---- mappings ---- */

static int device_of(const phys_t *p)
{
    return p->prop.location.type == CU_MEM_LOCATION_TYPE_DEVICE ? p->prop.location.id : -1;
}

CUresult td_cuMemMap(CUdeviceptr_v2 ptr, size_t size, size_t offset, CUmemGenericAllocationHandle_v1 handle,
                     unsigned long long flags)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!ptr || size == 0 || !aligned(ptr) || !aligned(size) || flags) return CUDA_ERROR_INVALID_VALUE;
    /* cuda.h: the offset into the allocation "currently must be zero"; the
     * H200's driver 580 answers a granule-aligned one with NOT_SUPPORTED. */
    if (offset != 0) return CUDA_ERROR_NOT_SUPPORTED;
    pthread_mutex_lock(&lock);
    phys_t *p = phys_of_locked(handle);
    mapping_t *m = NULL;
    r = CUDA_ERROR_INVALID_VALUE;
    if (!p || offset > p->size || size > p->size - offset || !reserved_locked(ptr, size) ||
        mapped_within_locked(ptr, size))
        goto out;
    r = CUDA_ERROR_OUT_OF_MEMORY;
    if (!(m = calloc(1, sizeof *m))) goto out;
    void *at = mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, p->fd,
                    (off_t)(p->offset + offset));
    if (at == MAP_FAILED) goto out;
    td_range_t rg = {.base = (uintptr_t)ptr, .size = size, .kind = TD_KIND_VMM_MAP, .device = device_of(p),
                     .fd = p->fd, .fd_offset = (size_t)(p->offset + offset), .owner = p,
                     .host_memtype = p->prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE,
                     .handle_types = (unsigned)p->prop.requestedHandleTypes};
    if ((r = td_range_add(&rg)) != CUDA_SUCCESS) {
        mmap(at, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
        goto out;
    }
    m->base = (uintptr_t)ptr;
    m->size = size;
    m->phys = p;
    m->next = maps;
    maps = m;
    p->maps++;
    m = NULL;
out:
    free(m);
    pthread_mutex_unlock(&lock);
    return r;
}

static mapping_t *mapping_at_locked(uintptr_t a)
{
    for (mapping_t *m = maps; m; m = m->next)
        if (m->base <= a && a < m->base + m->size) return m;
    return NULL;
}

/* Whether whole mappings, back to back, make up [base, base+size). */
static bool whole_mappings_locked(uintptr_t base, size_t size)
{
    uintptr_t pos = base, end = base + size;
    while (pos < end) {
        mapping_t *m = mapping_at_locked(pos);
        if (!m || m->base != pos || m->base + m->size > end) return false;
        pos += m->size;
    }
    return true;
}

CUresult td_cuMemUnmap(CUdeviceptr_v2 ptr, size_t size)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!ptr || size == 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    if (!whole_mappings_locked(ptr, size)) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    for (mapping_t **q = &maps; *q;) {
        mapping_t *m = *q;
        if (m->base < ptr || m->base >= ptr + size) {
            q = &m->next;
            continue;
        }
        *q = m->next;
        /* back to a reservation without memory */
        mmap((void *)m->base, m->size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
        td_range_remove(m->base, TD_KIND_VMM_MAP, NULL);
        m->phys->maps--;
        phys_maybe_free_locked(m->phys);
        free(m);
    }
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

/* The access slot of a location, or -1. */
static int slot_of(const CUmemLocation *loc)
{
    switch (loc->type) {
    case CU_MEM_LOCATION_TYPE_HOST:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT: return 0;
    case CU_MEM_LOCATION_TYPE_DEVICE:
        return loc->id >= 0 && loc->id < TD_DEVICE_COUNT ? 1 + loc->id : -1;
    default: return -1;
    }
}

static int prot_of(const mapping_t *m)
{
    int prot = PROT_NONE;
    for (int i = 0; i < NLOC; i++) {
        if (m->access[i] == CU_MEM_ACCESS_FLAGS_PROT_READWRITE) prot = PROT_READ | PROT_WRITE;
        else if (m->access[i] == CU_MEM_ACCESS_FLAGS_PROT_READ && prot == PROT_NONE) prot = PROT_READ;
    }
    return prot;
}

CUresult td_cuMemSetAccess(CUdeviceptr_v2 ptr, size_t size, const CUmemAccessDesc_v1 *desc, size_t count)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!ptr || size == 0 || !aligned(ptr) || !aligned(size) || !desc || count == 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    r = CUDA_SUCCESS;
    /* every granule mapped */
    for (uintptr_t pos = ptr; pos < ptr + size && r == CUDA_SUCCESS;) {
        mapping_t *m = mapping_at_locked(pos);
        if (!m) r = CUDA_ERROR_INVALID_VALUE;
        else pos = m->base + m->size;
    }
    for (size_t i = 0; i < count && r == CUDA_SUCCESS; i++) {
        int s = slot_of(&desc[i].location);
        CUmemAccess_flags f = desc[i].flags;
        if (s < 0) r = desc[i].location.type == CU_MEM_LOCATION_TYPE_DEVICE ? CUDA_ERROR_INVALID_DEVICE
                                                                            : CUDA_ERROR_INVALID_VALUE;
        else if (f != CU_MEM_ACCESS_FLAGS_PROT_NONE && f != CU_MEM_ACCESS_FLAGS_PROT_READ &&
                 f != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            r = CUDA_ERROR_INVALID_VALUE;
    }
    for (mapping_t *m = maps; m && r == CUDA_SUCCESS; m = m->next) {
        if (m->base + m->size <= ptr || m->base >= ptr + size) continue;
        for (size_t i = 0; i < count; i++)
            if (slot_of(&desc[i].location) == 0 &&
                m->phys->prop.location.type == CU_MEM_LOCATION_TYPE_DEVICE)
                r = CUDA_ERROR_INVALID_VALUE; /* host access to device memory */
    }
    for (mapping_t *m = maps; m && r == CUDA_SUCCESS; m = m->next) {
        if (m->base + m->size <= ptr || m->base >= ptr + size) continue;
        for (size_t i = 0; i < count; i++) m->access[slot_of(&desc[i].location)] = desc[i].flags;
        uintptr_t lo = m->base > ptr ? m->base : ptr;
        uintptr_t hi = m->base + m->size < ptr + size ? m->base + m->size : ptr + size;
        if (mprotect((void *)lo, hi - lo, prot_of(m)) != 0) r = CUDA_ERROR_UNKNOWN;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult td_cuMemGetAccess(unsigned long long *flags, const CUmemLocation_v1 *location, CUdeviceptr_v2 ptr)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!flags || !location) return CUDA_ERROR_INVALID_VALUE;
    int s = slot_of(location);
    if (s < 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    mapping_t *m = mapping_at_locked(ptr);
    if (m) *flags = m->access[s];
    pthread_mutex_unlock(&lock);
    return m ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult td_cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp_v1 *prop,
                                          CUmemAllocationGranularity_flags option)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!granularity) return CUDA_ERROR_INVALID_VALUE;
    if (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM && option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
        return CUDA_ERROR_INVALID_VALUE;
    if ((r = check_prop(prop)) != CUDA_SUCCESS) return r;
    *granularity = TD_GRANULARITY;
    return CUDA_SUCCESS;
}

/* ---- sharing ---- */

CUresult td_cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle_v1 handle,
                                         CUmemAllocationHandleType handleType, unsigned long long flags)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!shareableHandle || flags) return CUDA_ERROR_INVALID_VALUE;
    if (handleType == CU_MEM_HANDLE_TYPE_FABRIC) return CUDA_ERROR_NOT_PERMITTED;
    if (handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_NOT_SUPPORTED;
    pthread_mutex_lock(&lock);
    phys_t *p = phys_of_locked(handle);
    r = CUDA_ERROR_INVALID_VALUE;
    if (p && (p->prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) {
        int fd = fcntl(p->fd, F_DUPFD, 0); /* the driver's fds are not close-on-exec */
        if (fd < 0) {
            r = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            *(int *)shareableHandle = fd;
            r = CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult td_cuMemImportFromShareableHandle(CUmemGenericAllocationHandle_v1 *handle, void *osHandle,
                                           CUmemAllocationHandleType shHandleType)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!handle) return CUDA_ERROR_INVALID_VALUE;
    if (shHandleType == CU_MEM_HANDLE_TYPE_FABRIC) return CUDA_ERROR_NOT_PERMITTED;
    if (shHandleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_INVALID_VALUE;
    int fd = (int)(intptr_t)osHandle;
    char name[96];
    int loc_type = 0, loc_id = 0, types = 0, type = 0;
    struct stat s;
    if (!td_share_name(fd, name, sizeof name) ||
        sscanf(name, "vmm:%d:%d:%d:%d", &loc_type, &loc_id, &types, &type) != 4 || fstat(fd, &s) != 0 ||
        s.st_size <= 0 || !aligned((uintptr_t)s.st_size))
        return CUDA_ERROR_INVALID_VALUE; /* not a physical allocation's fd */
    phys_t *p = calloc(1, sizeof *p);
    int own = p ? fcntl(fd, F_DUPFD_CLOEXEC, 0) : -1;
    if (own < 0) {
        free(p);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    p->magic = PHYS_MAGIC;
    p->fd = own;
    p->own_fd = true;
    p->size = (size_t)s.st_size;
    p->prop.type = (CUmemAllocationType)type;
    p->prop.requestedHandleTypes = (CUmemAllocationHandleType)types;
    p->prop.location.type = (CUmemLocationType)loc_type;
    p->prop.location.id = loc_id;
    p->charged = -1; /* the exporter's memory */
    p->refs = 1;
    pthread_mutex_lock(&lock);
    p->next = allocs;
    allocs = p;
    pthread_mutex_unlock(&lock);
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)p;
    return CUDA_SUCCESS;
}

CUresult td_cuMemRetainAllocationHandle(CUmemGenericAllocationHandle_v1 *handle, void *addr)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!handle) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    mapping_t *m = mapping_at_locked((uintptr_t)addr);
    if (m) {
        m->phys->refs++;
        *handle = (CUmemGenericAllocationHandle)(uintptr_t)m->phys;
    }
    pthread_mutex_unlock(&lock);
    return m ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult td_cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp_v1 *prop,
                                                   CUmemGenericAllocationHandle_v1 handle)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!prop) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    phys_t *p = phys_of_locked(handle);
    if (p) *prop = p->prop;
    pthread_mutex_unlock(&lock);
    return p ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
