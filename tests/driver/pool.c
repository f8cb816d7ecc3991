/* Stream-ordered memory pools: device and host pools, the default pools,
 * allocation and stream-ordered frees, the release threshold and trims,
 * attributes and access, graph allocations made during capture, and pools
 * shared with other processes through POSIX fds.
 *
 * Model. A pool's memory lives in one sparse memfd ("pool:<type>:<id>:<uid>")
 * that an importer can map. Each allocation takes a chunk of it, its size
 * rounded up to the 2 MiB granularity, mapped on its own; a freed chunk
 * stays reserved (cached for reuse) until the release threshold or a trim
 * gives it back (unmapped, its pages punched out of the memfd). A free runs
 * when its stream reaches it; until then the chunk is in use, except for
 * allocations on that same stream, which may take it at once (stream order
 * keeps their work after the free's), as the real pools do. A pool with
 * allocations outstanding when it is destroyed goes away with its last
 * free, as the real driver's does. Reserved device memory is charged to
 * the device (cuMemGetInfo). One lock guards every pool. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <unistd.h>

#include "fake.h"

#define POOL_MAGIC 0x4c4f4f50u  /* "POOL" */
#define GRAPH_MAGIC 0x48505247u /* "GRPH" */
#define EXPORT_MAGIC 0x50584542u
#define POOL_SPAN ((uint64_t)1 << 46) /* the memfd's (sparse) size */

typedef struct chunk {
    struct chunk *next;
    uintptr_t base;
    size_t size;     /* mapped bytes (granules) */
    size_t alloc;    /* bytes asked for */
    uint64_t offset; /* in the pool's memfd */
    bool busy;       /* holds an allocation (its free may be pending) */
    bool pending;    /* its free is enqueued on free_stream, not run yet */
    CUstream free_stream;
    CUcontext free_ctx;
    unsigned gen;    /* which free of it an enqueued free op is */
    unsigned ops;    /* free ops enqueued and not run: it stays until they ran */
} chunk_t;

typedef struct span {
    struct span *next;
    uint64_t offset, size;
} span_t;

struct CUmemPoolHandle_st {
    uint32_t magic;
    struct CUmemPoolHandle_st *next; /* the live pools */
    CUmemLocation location;
    CUmemAllocationHandleType handle_types;
    int device;     /* -1 for a host pool */
    size_t max_size; /* 0: unlimited */
    bool is_default, imported, destroyed;
    int fd;
    uint64_t uid;
    uint64_t bump;    /* next unused memfd offset */
    span_t *holes;    /* memfd ranges given back, for reuse */
    chunk_t *chunks;
    size_t live;      /* busy chunks */
    size_t ops;       /* free ops enqueued and not run */
    cuuint64_t threshold, reserved, reserved_high, used, used_high;
    int reuse_follow, reuse_opportunistic, reuse_internal;
    CUmemAccess_flags access[TD_DEVICE_COUNT];
};
typedef struct CUmemPoolHandle_st pool_t;

/* A graph allocation (cuMemAllocFromPoolAsync during capture): memory the
 * graph owns. It lives while the graph does or while an allocation node
 * has run with no free since (an allocation that escapes its graph). */
typedef struct graph_alloc {
    uint32_t magic;
    uintptr_t base;
    size_t size, alloc;
    int device;
    bool graph_alive, live, registered;
} graph_alloc_t;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pool_t *pools;
static pool_t *default_pools[TD_DEVICE_COUNT];
static pool_t *default_host_pools[2]; /* HOST, HOST_NUMA node 0 */

static size_t round_gran(size_t n) { return (n + TD_GRANULARITY - 1) / TD_GRANULARITY * TD_GRANULARITY; }

static bool pool_valid_locked(CUmemoryPool p)
{
    for (pool_t *q = pools; q; q = q->next)
        if (q == p) return true;
    return false;
}

/* ---- chunks ---- */

static void bump_high(pool_t *p)
{
    if (p->reserved > p->reserved_high) p->reserved_high = p->reserved;
    if (p->used > p->used_high) p->used_high = p->used;
}

static void release_chunk_locked(pool_t *p, chunk_t *c);

static void finalize_locked(pool_t *p)
{
    while (p->chunks) release_chunk_locked(p, p->chunks);
    for (span_t *s = p->holes, *n; s; s = n) {
        n = s->next;
        free(s);
    }
    if (p->fd >= 0) close(p->fd);
    p->magic = 0;
    free(p);
}

/* Gives a cached chunk back: unmapped, its pages punched out. */
static void release_chunk_locked(pool_t *p, chunk_t *c)
{
    for (chunk_t **q = &p->chunks; *q; q = &(*q)->next)
        if (*q == c) {
            *q = c->next;
            break;
        }
    munmap((void *)c->base, c->size);
    if (!p->imported) {
        (void)fallocate(p->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)c->offset,
                        (off_t)c->size);
        span_t *s = malloc(sizeof *s);
        if (s) {
            *s = (span_t){p->holes, c->offset, c->size};
            p->holes = s;
        }
        p->reserved -= c->size;
        if (p->device >= 0) td_mem_uncharge(p->device, c->size);
    }
    free(c);
}

/* Releases cached chunks until at most `keep` bytes stay reserved. */
static void trim_locked(pool_t *p, uint64_t keep)
{
    chunk_t *c = p->chunks;
    while (c && p->reserved > keep) {
        chunk_t *n = c->next;
        if (!c->busy && !c->ops) release_chunk_locked(p, c);
        c = n;
    }
}

static uint64_t take_offset_locked(pool_t *p, size_t size)
{
    for (span_t **q = &p->holes; *q; q = &(*q)->next) {
        span_t *s = *q;
        if (s->size < size) continue;
        uint64_t off = s->offset;
        s->offset += size;
        s->size -= size;
        if (s->size == 0) {
            *q = s->next;
            free(s);
        }
        return off;
    }
    if (p->bump + size > POOL_SPAN) return UINT64_MAX;
    uint64_t off = p->bump;
    p->bump += size;
    return off;
}

static CUresult register_chunk(const pool_t *p, const chunk_t *c, td_kind_t kind)
{
    td_range_t r = {.base = c->base, .size = c->alloc, .kind = kind, .device = p->device,
                    .fd = -1, .owner = (void *)p, .host_memtype = p->device < 0};
    return td_range_add(&r);
}

/* Whether two (stream, context) pairs name the same stream: 0 is the
 * legacy stream, one per context; each thread's per-thread stream is its
 * own, so it is never taken as the same. */
static bool same_stream(CUstream a, CUcontext actx, CUstream b, CUcontext bctx)
{
    if (a == CU_STREAM_PER_THREAD || b == CU_STREAM_PER_THREAD) return false;
    if (!a) a = CU_STREAM_LEGACY;
    if (!b) b = CU_STREAM_LEGACY;
    return a == b && actx == bctx;
}

static bool reusable(const chunk_t *c, CUstream s, CUcontext ctx)
{
    return !c->busy || (c->pending && same_stream(c->free_stream, c->free_ctx, s, ctx));
}

/* A chunk of `size` bytes from p for stream s of ctx: a cached one of a
 * fitting size (or one freed earlier on s), else a new one (cached memory
 * is given back first when the pool's maximum or the device's memory would
 * be exceeded). */
static CUresult pool_alloc_locked(pool_t *p, size_t size, CUstream s, CUcontext ctx, uintptr_t *out)
{
    size_t need = round_gran(size);
    if (need < size) return CUDA_ERROR_OUT_OF_MEMORY;
    chunk_t *best = NULL;
    for (chunk_t *c = p->chunks; c; c = c->next)
        if (reusable(c, s, ctx) && c->size >= need && c->size <= 2 * need && (!best || c->size < best->size))
            best = c;
    if (best && best->busy) {
        /* freed earlier on this stream: the enqueued free becomes a no-op */
        best->alloc = size;
        CUresult r = register_chunk(p, best, TD_KIND_POOL);
        if (r != CUDA_SUCCESS) return r;
        best->pending = false;
        best->gen++;
        *out = best->base;
        return CUDA_SUCCESS;
    }
    if (!best) {
        if (p->max_size && p->reserved + need > p->max_size) trim_locked(p, 0);
        if (p->max_size && p->reserved + need > p->max_size) return CUDA_ERROR_OUT_OF_MEMORY;
        if (p->device >= 0 && td_mem_charge(p->device, need) != CUDA_SUCCESS) {
            trim_locked(p, 0);
            if (td_mem_charge(p->device, need) != CUDA_SUCCESS) return CUDA_ERROR_OUT_OF_MEMORY;
        }
        CUresult r = CUDA_ERROR_OUT_OF_MEMORY;
        best = calloc(1, sizeof *best);
        uint64_t off = best ? take_offset_locked(p, need) : UINT64_MAX;
        void *m = MAP_FAILED;
        if (off != UINT64_MAX)
            m = mmap(NULL, need, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, p->fd, (off_t)off);
        if (m == MAP_FAILED) {
            if (off != UINT64_MAX) {
                span_t *h = malloc(sizeof *h);
                if (h) {
                    *h = (span_t){p->holes, off, need};
                    p->holes = h;
                }
            }
            free(best);
            if (p->device >= 0) td_mem_uncharge(p->device, need);
            return r;
        }
        best->base = (uintptr_t)m;
        best->size = need;
        best->offset = off;
        best->next = p->chunks;
        p->chunks = best;
        p->reserved += need;
    }
    best->alloc = size;
    CUresult r = register_chunk(p, best, TD_KIND_POOL);
    if (r != CUDA_SUCCESS) return r;
    best->busy = true;
    p->live++;
    p->used += best->size;
    bump_high(p);
    *out = best->base;
    return CUDA_SUCCESS;
}

static chunk_t *find_chunk_locked(pool_t *p, uintptr_t base)
{
    for (chunk_t *c = p->chunks; c; c = c->next)
        if (c->base == base) return c;
    return NULL;
}

/* The free itself, when the stream reaches it (or at once for cuMemFree). */
static void complete_free_locked(pool_t *p, chunk_t *c)
{
    c->busy = false;
    c->pending = false;
    p->live--;
    if (p->imported) {
        release_chunk_locked(p, c);
    } else {
        p->used -= c->size;
        if (p->destroyed) trim_locked(p, 0);
        else if (p->reserved > p->threshold) trim_locked(p, p->threshold);
    }
    if (p->destroyed && p->live == 0 && p->ops == 0) finalize_locked(p);
}

typedef struct free_op {
    pool_t *pool;
    chunk_t *chunk;
    unsigned gen;
} free_op_t;

static void run_free(void *arg)
{
    const free_op_t *op = arg;
    pthread_mutex_lock(&lock);
    pool_t *p = op->pool;
    chunk_t *c = op->chunk;
    c->ops--;
    p->ops--;
    /* else an allocation on the same stream took the chunk back */
    if (c->pending && c->gen == op->gen) {
        complete_free_locked(p, c);
    } else if (p->destroyed && p->live == 0 && p->ops == 0) {
        trim_locked(p, 0);
        finalize_locked(p);
    }
    pthread_mutex_unlock(&lock);
}

/* ---- graph allocations ---- */

static void graph_alloc_unmap_locked(graph_alloc_t *g)
{
    if (g->registered) td_range_remove(g->base, TD_KIND_POOL, NULL);
    munmap((void *)g->base, g->size);
    g->magic = 0;
    free(g);
}

static void graph_alloc_node(void *arg)
{
    graph_alloc_t *g = *(graph_alloc_t *const *)arg;
    pthread_mutex_lock(&lock);
    g->live = true;
    if (!g->registered) {
        td_range_t r = {.base = g->base, .size = g->alloc, .kind = TD_KIND_POOL, .device = g->device,
                        .fd = -1, .owner = g};
        g->registered = td_range_add(&r) == CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&lock);
}

static void graph_free_node(void *arg)
{
    graph_alloc_t *g = *(graph_alloc_t *const *)arg;
    pthread_mutex_lock(&lock);
    g->live = false;
    if (!g->graph_alive) graph_alloc_unmap_locked(g);
    pthread_mutex_unlock(&lock);
}

static void graph_released(void *arg)
{
    graph_alloc_t *g = arg;
    pthread_mutex_lock(&lock);
    g->graph_alive = false;
    if (!g->live) graph_alloc_unmap_locked(g);
    pthread_mutex_unlock(&lock);
}

/* An allocation node: the memory exists from now on (the graph's), so the
 * captured work can name it. */
static CUresult graph_alloc(pool_t *p, size_t size, CUstream s, CUdeviceptr *out)
{
    size_t need = round_gran(size);
    if (need < size) return CUDA_ERROR_OUT_OF_MEMORY;
    graph_alloc_t *g = calloc(1, sizeof *g);
    if (!g) return CUDA_ERROR_OUT_OF_MEMORY;
    void *m = mmap(NULL, need, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) {
        free(g);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *g = (graph_alloc_t){GRAPH_MAGIC, (uintptr_t)m, need, size, p->device, true, false, false};
    CUresult res = td_capture_own(s, graph_released, g);
    if (res != CUDA_SUCCESS) {
        munmap(m, need);
        free(g);
        return res;
    }
    /* From here on the graph owns g: a failure leaves it to the graph. */
    pthread_mutex_lock(&lock);
    td_range_t r = {.base = g->base, .size = size, .kind = TD_KIND_POOL, .device = p->device,
                    .fd = -1, .owner = g};
    g->registered = (res = td_range_add(&r)) == CUDA_SUCCESS;
    pthread_mutex_unlock(&lock);
    if (res == CUDA_SUCCESS) res = td_enqueue(s, graph_alloc_node, &g, sizeof g);
    if (res != CUDA_SUCCESS) {
        pthread_mutex_lock(&lock);
        if (g->registered) td_range_remove(g->base, TD_KIND_POOL, NULL);
        g->registered = false;
        pthread_mutex_unlock(&lock);
        return res;
    }
    *out = (CUdeviceptr)g->base;
    return CUDA_SUCCESS;
}

/* ---- creation and the default pools ---- */

static bool numa_node_exists(int id)
{
    if (id == 0) return true;
    char path[64];
    snprintf(path, sizeof path, "/sys/devices/system/node/node%d", id);
    return id > 0 && access(path, F_OK) == 0;
}

static CUresult check_props(const CUmemPoolProps *pp)
{
    if (pp->allocType == CU_MEM_ALLOCATION_TYPE_MANAGED) return CUDA_ERROR_NOT_SUPPORTED;
    if (pp->allocType != CU_MEM_ALLOCATION_TYPE_PINNED || pp->win32SecurityAttributes)
        return CUDA_ERROR_INVALID_VALUE;
    if (pp->handleTypes & CU_MEM_HANDLE_TYPE_FABRIC) return CUDA_ERROR_NOT_PERMITTED; /* no IMEX */
    if (pp->handleTypes & ~(unsigned)CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_INVALID_VALUE;
    switch (pp->location.type) {
    case CU_MEM_LOCATION_TYPE_DEVICE:
        return pp->location.id >= 0 && pp->location.id < TD_DEVICE_COUNT ? CUDA_SUCCESS
                                                                          : CUDA_ERROR_INVALID_DEVICE;
    case CU_MEM_LOCATION_TYPE_HOST:
        /* the real driver refuses handle types on plain host pools */
        return pp->handleTypes == CU_MEM_HANDLE_TYPE_NONE ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    case CU_MEM_LOCATION_TYPE_HOST_NUMA:
        return numa_node_exists(pp->location.id) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
}

static pool_t *pool_new(const CUmemLocation *loc, CUmemAllocationHandleType types, size_t max_size,
                        uint64_t uid, int fd, bool imported)
{
    pool_t *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->magic = POOL_MAGIC;
    p->location = *loc;
    p->handle_types = types;
    p->device = loc->type == CU_MEM_LOCATION_TYPE_DEVICE ? loc->id : -1;
    p->max_size = max_size;
    p->imported = imported;
    p->fd = fd;
    p->uid = uid;
    p->threshold = 0;
    p->reuse_follow = p->reuse_opportunistic = p->reuse_internal = 1;
    /* The resident device of a device pool has access; the rest is granted. */
    if (p->device >= 0) p->access[p->device] = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    return p;
}

static uint64_t fresh_uid(void)
{
    uint64_t u = 0;
    while (getrandom(&u, sizeof u, 0) != (ssize_t)sizeof u || u == 0)
        if (errno != EINTR) u = (uint64_t)getpid() << 32 ^ (uint64_t)(uintptr_t)&u;
    return u;
}

static CUresult pool_create_locked(const CUmemPoolProps *pp, pool_t **out)
{
    uint64_t uid = fresh_uid();
    char name[80];
    snprintf(name, sizeof name, "pool:%d:%d:%" PRIx64, (int)pp->location.type, pp->location.id, uid);
    int fd = td_share_memfd(name, POOL_SPAN);
    if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
    pool_t *p = pool_new(&pp->location, pp->handleTypes, pp->maxSize, uid, fd, false);
    if (!p) {
        close(fd);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    p->next = pools;
    pools = p;
    *out = p;
    return CUDA_SUCCESS;
}

CUresult td_cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps_v1 *poolProps)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!pool || !poolProps) return CUDA_ERROR_INVALID_VALUE;
    if ((r = check_props(poolProps)) != CUDA_SUCCESS) return r;
    pthread_mutex_lock(&lock);
    pool_t *p = NULL;
    r = pool_create_locked(poolProps, &p);
    pthread_mutex_unlock(&lock);
    if (r == CUDA_SUCCESS) *pool = p;
    return r;
}

static CUresult default_pool(const CUmemLocation *loc, CUmemoryPool *out)
{
    pool_t **slot;
    if (loc->type == CU_MEM_LOCATION_TYPE_DEVICE) {
        CUresult r = td_check_device(loc->id);
        if (r != CUDA_SUCCESS) return r;
        slot = &default_pools[loc->id];
    } else if (loc->type == CU_MEM_LOCATION_TYPE_HOST) {
        slot = &default_host_pools[0];
    } else if (loc->type == CU_MEM_LOCATION_TYPE_HOST_NUMA && loc->id == 0) {
        slot = &default_host_pools[1];
    } else {
        return CUDA_ERROR_INVALID_VALUE;
    }
    CUresult r = CUDA_SUCCESS;
    pthread_mutex_lock(&lock);
    if (!*slot) {
        CUmemPoolProps pp;
        memset(&pp, 0, sizeof pp);
        pp.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
        pp.location = *loc;
        if ((r = pool_create_locked(&pp, slot)) == CUDA_SUCCESS) (*slot)->is_default = true;
    }
    if (r == CUDA_SUCCESS) *out = *slot;
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult td_cuDeviceGetDefaultMemPool(CUmemoryPool *pool_out, CUdevice_v1 dev)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!pool_out) return CUDA_ERROR_INVALID_VALUE;
    CUmemLocation loc = {CU_MEM_LOCATION_TYPE_DEVICE, (int)dev};
    return default_pool(&loc, pool_out);
}

/* cuDeviceSetMemPool is not in the table: the current pool is the default. */
CUresult td_cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice_v1 dev)
{
    return td_cuDeviceGetDefaultMemPool(pool, dev);
}

CUresult td_cuMemGetDefaultMemPool(CUmemoryPool *pool_out, CUmemLocation *location, CUmemAllocationType type)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!pool_out || !location) return CUDA_ERROR_INVALID_VALUE;
    if (type == CU_MEM_ALLOCATION_TYPE_MANAGED) return CUDA_ERROR_NOT_SUPPORTED;
    if (type != CU_MEM_ALLOCATION_TYPE_PINNED) return CUDA_ERROR_INVALID_VALUE;
    return default_pool(location, pool_out);
}

CUresult td_cuMemPoolDestroy(CUmemoryPool pool)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    pthread_mutex_lock(&lock);
    if (!pool_valid_locked(pool) || pool->is_default) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    for (pool_t **q = &pools; *q; q = &(*q)->next)
        if (*q == pool) {
            *q = pool->next;
            break;
        }
    pool->destroyed = true;
    if (!pool->imported) trim_locked(pool, 0);
    if (pool->live == 0 && pool->ops == 0) finalize_locked(pool);
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

/* ---- attributes, access, trim ---- */

CUresult td_cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    r = CUDA_SUCCESS;
    if (!pool_valid_locked(pool)) {
        r = CUDA_ERROR_INVALID_VALUE;
    } else {
        switch (attr) {
        case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: pool->threshold = *(cuuint64_t *)value; break;
        case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES: pool->reuse_follow = *(int *)value != 0; break;
        case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC: pool->reuse_opportunistic = *(int *)value != 0; break;
        case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES: pool->reuse_internal = *(int *)value != 0; break;
        case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH:
            if (*(cuuint64_t *)value != 0) r = CUDA_ERROR_INVALID_VALUE;
            else pool->reserved_high = pool->reserved;
            break;
        case CU_MEMPOOL_ATTR_USED_MEM_HIGH:
            if (*(cuuint64_t *)value != 0) r = CUDA_ERROR_INVALID_VALUE;
            else pool->used_high = pool->used;
            break;
        default: r = CUDA_ERROR_INVALID_VALUE; break;
        }
    }
    pthread_mutex_unlock(&lock);
    return r;
}

/* Potentially unsafe during capture: the H200 (driver 580) refuses it with
 * CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED while another thread's stream
 * captures in global mode, and invalidates that capture. */
CUresult td_cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    if ((r = td_capture_unsafe_call()) != CUDA_SUCCESS) return r;
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    r = CUDA_SUCCESS;
    if (!pool_valid_locked(pool)) {
        r = CUDA_ERROR_INVALID_VALUE;
    } else {
        switch (attr) {
        case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: *(cuuint64_t *)value = pool->threshold; break;
        case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES: *(int *)value = pool->reuse_follow; break;
        case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC: *(int *)value = pool->reuse_opportunistic; break;
        case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES: *(int *)value = pool->reuse_internal; break;
        case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: *(cuuint64_t *)value = pool->reserved; break;
        case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: *(cuuint64_t *)value = pool->reserved_high; break;
        case CU_MEMPOOL_ATTR_USED_MEM_CURRENT: *(cuuint64_t *)value = pool->used; break;
        case CU_MEMPOOL_ATTR_USED_MEM_HIGH: *(cuuint64_t *)value = pool->used_high; break;
        default: r = CUDA_ERROR_INVALID_VALUE; break;
        }
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult td_cuMemPoolSetAccess(CUmemoryPool pool, const CUmemAccessDesc_v1 *map, size_t count)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!map && count) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    r = pool_valid_locked(pool) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < count && r == CUDA_SUCCESS; i++) {
        const CUmemAccessDesc *d = &map[i];
        if (d->location.type != CU_MEM_LOCATION_TYPE_DEVICE) r = CUDA_ERROR_INVALID_VALUE;
        else if (d->location.id < 0 || d->location.id >= TD_DEVICE_COUNT) r = CUDA_ERROR_INVALID_DEVICE;
        else if (d->flags != CU_MEM_ACCESS_FLAGS_PROT_NONE && d->flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            r = CUDA_ERROR_INVALID_VALUE; /* pools grant read-write or nothing */
        else if (d->location.id == pool->device && d->flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            r = CUDA_ERROR_INVALID_DEVICE; /* the resident device keeps its access */
    }
    for (size_t i = 0; i < count && r == CUDA_SUCCESS; i++)
        pool->access[map[i].location.id] = map[i].flags;
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult td_cuMemPoolGetAccess(CUmemAccess_flags *flags, CUmemoryPool memPool, CUmemLocation_v1 *location)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!flags || !location) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    if (!pool_valid_locked(memPool)) r = CUDA_ERROR_INVALID_VALUE;
    else if (location->type != CU_MEM_LOCATION_TYPE_DEVICE) r = CUDA_ERROR_INVALID_VALUE;
    else if (location->id < 0 || location->id >= TD_DEVICE_COUNT) r = CUDA_ERROR_INVALID_DEVICE;
    else *flags = memPool->access[location->id];
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult td_cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    pthread_mutex_lock(&lock);
    if (!pool_valid_locked(pool)) r = CUDA_ERROR_INVALID_VALUE;
    else trim_locked(pool, minBytesToKeep);
    pthread_mutex_unlock(&lock);
    return r;
}

/* ---- allocation and free ---- */

CUresult td_cuMemAllocFromPoolAsync(CUdeviceptr_v2 *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!dptr || bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
    CUstreamCaptureStatus cs = CU_STREAM_CAPTURE_STATUS_NONE;
    if ((r = td_stream_capture_status(hStream, &cs)) != CUDA_SUCCESS) return r;
    if (cs == CU_STREAM_CAPTURE_STATUS_INVALIDATED) return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    pthread_mutex_lock(&lock);
    if (!pool_valid_locked(pool) || pool->imported) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    uintptr_t p = 0;
    if (cs == CU_STREAM_CAPTURE_STATUS_ACTIVE) {
        pthread_mutex_unlock(&lock); /* the graph's memory; nodes take the lock when they run */
        return graph_alloc(pool, bytesize, hStream, dptr);
    }
    CUcontext ctx = NULL;
    if ((r = td_stream_ctx(hStream, &ctx)) == CUDA_SUCCESS)
        r = pool_alloc_locked(pool, bytesize, hStream, ctx, &p);
    pthread_mutex_unlock(&lock);
    if (r == CUDA_SUCCESS) *dptr = (CUdeviceptr)p;
    return r;
}

CUresult td_cuMemAllocAsync(CUdeviceptr_v2 *dptr, size_t bytesize, CUstream hStream)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    CUcontext ctx = NULL;
    if ((r = td_stream_ctx(hStream, &ctx)) != CUDA_SUCCESS) return r;
    CUmemoryPool pool = NULL;
    CUmemLocation loc = {CU_MEM_LOCATION_TYPE_DEVICE, td_ctx_device(ctx)};
    if ((r = default_pool(&loc, &pool)) != CUDA_SUCCESS) return r;
    return td_cuMemAllocFromPoolAsync(dptr, bytesize, pool, hStream);
}

/* What a stream-ordered pointer is: a chunk of a pool (possibly imported)
 * or a graph allocation. */
typedef struct owned {
    pool_t *pool;
    chunk_t *chunk;
    graph_alloc_t *graph;
    td_kind_t kind;
} owned_t;

static bool owned_locked(const td_range_t *rg, uintptr_t ptr, owned_t *o)
{
    memset(o, 0, sizeof *o);
    if (rg->base != ptr || !rg->owner) return false;
    if (rg->kind != TD_KIND_POOL && rg->kind != TD_KIND_IPC) return false;
    uint32_t magic = *(const uint32_t *)rg->owner;
    o->kind = rg->kind;
    if (magic == GRAPH_MAGIC && rg->kind == TD_KIND_POOL) {
        o->graph = rg->owner;
        return true;
    }
    if (magic != POOL_MAGIC) return false;
    o->pool = rg->owner;
    o->chunk = find_chunk_locked(o->pool, ptr);
    return o->chunk && o->chunk->busy && !o->chunk->pending;
}

static void graph_free_now_locked(graph_alloc_t *g)
{
    g->live = false;
    if (!g->graph_alive) {
        graph_alloc_unmap_locked(g);
    } else if (g->registered) {
        td_range_remove(g->base, TD_KIND_POOL, NULL);
        g->registered = false;
    }
}

static void graph_free_outside(void *arg)
{
    graph_alloc_t *g = *(graph_alloc_t *const *)arg;
    pthread_mutex_lock(&lock);
    g->live = false;
    if (!g->graph_alive) graph_alloc_unmap_locked(g);
    pthread_mutex_unlock(&lock);
}

CUresult td_cuMemFreeAsync(CUdeviceptr_v2 dptr, CUstream hStream)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    CUstreamCaptureStatus cs = CU_STREAM_CAPTURE_STATUS_NONE;
    if ((r = td_stream_capture_status(hStream, &cs)) != CUDA_SUCCESS) return r;
    if (cs == CU_STREAM_CAPTURE_STATUS_INVALIDATED) return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    td_range_t rg;
    pthread_mutex_lock(&lock);
    owned_t o;
    if (!td_range_find((uintptr_t)dptr, &rg) || !owned_locked(&rg, (uintptr_t)dptr, &o)) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (cs == CU_STREAM_CAPTURE_STATUS_ACTIVE) {
        /* A free node may only free a graph allocation. */
        pthread_mutex_unlock(&lock);
        if (!o.graph) return CUDA_ERROR_INVALID_VALUE;
        return td_enqueue(hStream, graph_free_node, &o.graph, sizeof o.graph);
    }
    if (o.graph) {
        if (o.graph->registered) {
            td_range_remove(o.graph->base, TD_KIND_POOL, NULL);
            o.graph->registered = false;
        }
        pthread_mutex_unlock(&lock);
        r = td_enqueue(hStream, graph_free_outside, &o.graph, sizeof o.graph);
        if (r != CUDA_SUCCESS) {
            pthread_mutex_lock(&lock);
            td_range_t back = {.base = o.graph->base, .size = o.graph->alloc, .kind = TD_KIND_POOL,
                               .device = o.graph->device, .fd = -1, .owner = o.graph};
            o.graph->registered = td_range_add(&back) == CUDA_SUCCESS;
            pthread_mutex_unlock(&lock);
        }
        return r;
    }
    /* The pointer is gone for the API at once; the memory at the free.
     * Enqueued under the lock, so that no allocation takes the chunk
     * before its free is in the stream. */
    td_range_remove(rg.base, o.kind, NULL);
    CUcontext ctx = NULL;
    (void)td_stream_ctx(hStream, &ctx); /* valid: its capture status was just read */
    o.chunk->pending = true;
    o.chunk->free_stream = hStream;
    o.chunk->free_ctx = ctx;
    free_op_t op = {o.pool, o.chunk, ++o.chunk->gen};
    o.chunk->ops++;
    o.pool->ops++;
    r = td_enqueue(hStream, run_free, &op, sizeof op);
    if (r != CUDA_SUCCESS) {
        o.chunk->ops--;
        o.pool->ops--;
        o.chunk->pending = false;
        (void)register_chunk(o.pool, o.chunk, o.kind);
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult td_pool_free_sync(const td_range_t *range)
{
    td_range_t rg;
    pthread_mutex_lock(&lock);
    owned_t o;
    bool ok = td_range_find(range->base, &rg) && owned_locked(&rg, range->base, &o);
    if (ok) {
        if (o.graph) {
            o.graph->live = false; /* graph_free_now_locked below */
        } else {
            td_range_remove(rg.base, o.kind, NULL);
        }
    }
    pthread_mutex_unlock(&lock);
    if (!ok) return CUDA_ERROR_INVALID_VALUE;
    td_ctx_drain(NULL); /* cuMemFree waits for the device */
    pthread_mutex_lock(&lock);
    if (o.graph) graph_free_now_locked(o.graph);
    else complete_free_locked(o.pool, o.chunk);
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

/* ---- sharing with other processes ---- */

typedef struct export_data {
    uint32_t magic;
    uint32_t pad;
    uint64_t uid;
    uint64_t offset;
    uint64_t size;  /* chunk */
    uint64_t alloc; /* bytes asked for */
    uint64_t spare[2];
    uint64_t check;
} export_data_t;

_Static_assert(sizeof(export_data_t) == sizeof(CUmemPoolPtrExportData), "export data is 64 bytes");

static uint64_t export_check(const export_data_t *e)
{
    const unsigned char *p = (const unsigned char *)e;
    uint64_t x = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < offsetof(export_data_t, check); i++) x = (x ^ p[i]) * 0x100000001b3ull;
    return x;
}

CUresult td_cuMemPoolExportToShareableHandle(void *handle_out, CUmemoryPool pool,
                                             CUmemAllocationHandleType handleType, unsigned long long flags)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!handle_out || flags) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    if (!pool_valid_locked(pool) || pool->imported || handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR ||
        !(pool->handle_types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) {
        r = CUDA_ERROR_INVALID_VALUE;
    } else {
        int fd = fcntl(pool->fd, F_DUPFD, 0); /* the driver's fds are not close-on-exec */
        if (fd < 0) r = CUDA_ERROR_OUT_OF_MEMORY;
        else *(int *)handle_out = fd;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult td_cuMemPoolImportFromShareableHandle(CUmemoryPool *pool_out, void *handle,
                                               CUmemAllocationHandleType handleType,
                                               unsigned long long flags)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!pool_out || flags || handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return CUDA_ERROR_INVALID_VALUE;
    int fd = (int)(intptr_t)handle;
    char name[96];
    int type = 0, id = 0;
    uint64_t uid = 0;
    if (!td_share_name(fd, name, sizeof name) ||
        sscanf(name, "pool:%d:%d:%" SCNx64, &type, &id, &uid) != 3)
        return CUDA_ERROR_INVALID_VALUE; /* not a pool's fd */
    CUmemLocation loc = {(CUmemLocationType)type, id};
    int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (own < 0) return CUDA_ERROR_OUT_OF_MEMORY;
    pool_t *p = pool_new(&loc, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0, uid, own, true);
    if (!p) {
        close(own);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    pthread_mutex_lock(&lock);
    p->next = pools;
    pools = p;
    pthread_mutex_unlock(&lock);
    *pool_out = p;
    return CUDA_SUCCESS;
}

CUresult td_cuMemPoolExportPointer(CUmemPoolPtrExportData_v1 *shareData_out, CUdeviceptr_v2 ptr)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!shareData_out) return CUDA_ERROR_INVALID_VALUE;
    td_range_t rg;
    owned_t o;
    pthread_mutex_lock(&lock);
    if (!td_range_find((uintptr_t)ptr, &rg) || rg.kind != TD_KIND_POOL ||
        !owned_locked(&rg, rg.base, &o) || !o.pool || o.pool->imported ||
        !(o.pool->handle_types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    export_data_t e;
    memset(&e, 0, sizeof e);
    e.magic = EXPORT_MAGIC;
    e.uid = o.pool->uid;
    e.offset = o.chunk->offset;
    e.size = o.chunk->size;
    e.alloc = o.chunk->alloc;
    e.check = export_check(&e);
    pthread_mutex_unlock(&lock);
    memcpy(shareData_out->reserved, &e, sizeof e);
    return CUDA_SUCCESS;
}

CUresult td_cuMemPoolImportPointer(CUdeviceptr_v2 *ptr_out, CUmemoryPool pool, CUmemPoolPtrExportData_v1 *shareData)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!ptr_out || !shareData) return CUDA_ERROR_INVALID_VALUE;
    export_data_t e;
    memcpy(&e, shareData->reserved, sizeof e);
    pthread_mutex_lock(&lock);
    if (!pool_valid_locked(pool) || !pool->imported || e.magic != EXPORT_MAGIC ||
        e.check != export_check(&e) || e.uid != pool->uid || e.alloc == 0 || e.alloc > e.size ||
        e.size % TD_GRANULARITY || e.offset % TD_GRANULARITY || e.offset + e.size > POOL_SPAN) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    chunk_t *c = calloc(1, sizeof *c);
    void *m = c ? mmap(NULL, (size_t)e.size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, pool->fd,
                       (off_t)e.offset)
                : MAP_FAILED;
    if (m == MAP_FAILED) {
        free(c);
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    c->base = (uintptr_t)m;
    c->size = (size_t)e.size;
    c->alloc = (size_t)e.alloc;
    c->offset = e.offset;
    if ((r = register_chunk(pool, c, TD_KIND_IPC)) != CUDA_SUCCESS) {
        munmap(m, c->size);
        free(c);
        pthread_mutex_unlock(&lock);
        return r;
    }
    c->busy = true;
    c->next = pool->chunks;
    pool->chunks = c;
    pool->live++;
    pthread_mutex_unlock(&lock);
    *ptr_out = (CUdeviceptr)c->base;
    return CUDA_SUCCESS;
}
