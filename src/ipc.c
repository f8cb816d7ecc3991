/* Sharing buffers between processes: export and import through the driver
 * for the three mechanisms (stream-ordered pools, virtual memory, legacy
 * cuIpc handles). The wire format and the sockets are in ipc_wire.c. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "ipc.h"
#include "resource_pool.h"
#include "vmm.h"

/* ---- export ---- */

/* The buffer that owns the memory (a slice's root) and buf's offset in it. */
static cubuf_status_t root_of(const cubuf_buffer_t *buf, const cubuf_buffer_t **root, uint64_t *offset)
{
    const cubuf_buffer_t *r = buf;
    while (r->parent) r = r->parent;
    if (r->closed)
        return cubuf__fail(CUBUF_ERROR_CLOSED,
                           "cubuf_buffer_ipc_descriptor: the buffer this slice belongs to is closed");
    *root = r;
    *offset = buf->ptr - r->ptr;
    return CUBUF_SUCCESS;
}

bool cubuf__set_cloexec(int fd)
{
    int fl = fcntl(fd, F_GETFD);
    return fl >= 0 && fcntl(fd, F_SETFD, fl | FD_CLOEXEC) == 0;
}

static pthread_mutex_t identity_lock = PTHREAD_MUTEX_INITIALIZER;

static bool zero16(const unsigned char *p)
{
    for (int i = 0; i < 16; i++)
        if (p[i]) return false;
    return true;
}

/* The pool's identity, drawn once per resource from getrandom. Importers key
 * their pool imports by it, so it must never be reused by another pool. */
static cubuf_status_t pool_identity(cubuf_resource_t *res, uint8_t id[16])
{
    cubuf_status_t st = CUBUF_SUCCESS;
    pthread_mutex_lock(&identity_lock);
    while (zero16(res->ipc_pool_id)) {
        unsigned char fresh[16];
        size_t got = 0;
        while (got < sizeof fresh) {
            ssize_t r = getrandom(fresh + got, sizeof fresh - got, 0);
            if (r < 0 && errno == EINTR) continue;
            if (r < 0) {
                int e = errno;
                st = cubuf__fail(CUBUF_ERROR_SYSTEM, "getrandom failed for a pool identity: %s",
                                 strerror(e));
                goto out;
            }
            got += (size_t)r;
        }
        memcpy(res->ipc_pool_id, fresh, sizeof fresh);
    }
    memcpy(id, res->ipc_pool_id, 16);
out:
    pthread_mutex_unlock(&identity_lock);
    return st;
}

static cubuf_status_t export_pool(const cubuf_buffer_t *root, uint64_t offset, size_t size,
                                  cubuf_ipc_descriptor_t *d)
{
    cubuf_resource_t *res = root->resource;
    if (!res->props.ipc_enabled)
        return cubuf__fail(CUBUF_ERROR_NOT_SUPPORTED,
                           "cubuf_buffer_ipc_descriptor: the pool resource is not IPC-enabled "
                           "(create it with ipc_enabled)");
    CUmemoryPool pool = cubuf__pool_handle(res);
    if (!pool)
        return cubuf__fail(CUBUF_ERROR_NOT_SUPPORTED, "cubuf_buffer_ipc_descriptor: the resource has no pool");
    cubuf_status_t st = pool_identity(res, d->pool_id);
    if (st != CUBUF_SUCCESS) return st;
    cubuf_ctx_guard_t g = {false};
    CHECK(cubuf__ctx_push(res->ctx->handle, &g));
    int fd = -1;
    CHECK(CU(cuMemPoolExportToShareableHandle, &fd, pool, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    d->fds[0] = fd;
    (void)cubuf__set_cloexec(fd);
    CUmemPoolPtrExportData data;
    memset(&data, 0, sizeof data);
    CHECK(CU(cuMemPoolExportPointer, &data, root->ptr));
    memcpy(d->export_data, data.reserved, sizeof d->export_data);
    if (res->props.host_accessible) d->flags |= CUBUF__IPC_FLAG_HOST_ACCESSIBLE;
    d->size = size;
    d->offset = offset;
    d->extent = root->size;
fail:
    cubuf__ctx_pop(&g);
    return st;
}

/* The chunks of [start, start+size) out of a VMM buffer's chunk list, which
 * may begin before the buffer and run past it. */
static cubuf_status_t pick_chunks(const cubuf_vmm_chunk_t *chunks, size_t n, uint64_t start,
                                  uint64_t size, size_t *lo, size_t *hi, uint64_t *lo_pos)
{
    uint64_t pos = 0, end = start + size;
    *lo = n;
    *hi = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t cs = pos, ce = pos + chunks[i].size;
        if (ce > start && cs < end) {
            if (*lo == n) {
                *lo = i;
                *lo_pos = cs;
            }
            *hi = i + 1;
        }
        pos = ce;
    }
    if (*lo == n || pos < end)
        return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,
                           "cubuf_buffer_ipc_descriptor: the buffer's physical allocations (%zu, "
                           "%llu bytes) do not cover [%llu, %llu)",
                           n, (unsigned long long)pos, (unsigned long long)start,
                           (unsigned long long)end);
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf__ipc_export_vmm(const cubuf_buffer_t *root, uint64_t offset, size_t size,
                                     cubuf_ipc_descriptor_t **out)
{
    cubuf_resource_t *res = root->resource;
    unsigned types = (unsigned)cubuf__vmm_handle_type(res);
    /* Memory with fabric handles only travels as fabric handles; memory
     * with both as POSIX fds (the importer may lack an IMEX channel). */
    bool fabric = !(types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) &&
                  (types & CU_MEM_HANDLE_TYPE_FABRIC);
    if (!fabric && !(types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
        return cubuf__fail(CUBUF_ERROR_NOT_SUPPORTED,
                           "cubuf_buffer_ipc_descriptor: the VMM resource allows neither POSIX fd "
                           "nor fabric handles (set them in its options)");
    cubuf_vmm_chunk_t *chunks = NULL;
    size_t n = 0, first = 0, lo = 0, hi = 0;
    uint64_t lo_pos = 0;
    cubuf_ipc_descriptor_t *d = NULL;
    cubuf_ctx_guard_t g = {false};
    cubuf_status_t st = cubuf__vmm_chunks(root, &chunks, &n, &first);
    if (st != CUBUF_SUCCESS) return st;
    uint64_t start = first + offset;
    CHECK(pick_chunks(chunks, n, start, size, &lo, &hi, &lo_pos));
    size_t count = hi - lo;
    if (count > CUBUF_IPC_MAX_CHUNKS) {
        st = cubuf__fail(CUBUF_ERROR_NOT_SUPPORTED,
                         "cubuf_buffer_ipc_descriptor: the buffer spans %zu physical allocations; "
                         "a descriptor carries at most %d",
                         count, CUBUF_IPC_MAX_CHUNKS);
        goto fail;
    }
    CHECK(fabric ? cubuf__ipc_desc_new_fabric(count, &d)
                 : cubuf__ipc_desc_new(CUBUF_IPC_MECHANISM_VMM, count, &d));
    d->granularity = cubuf__vmm_granularity(res);
    d->size = size;
    d->offset = start - lo_pos;
    for (size_t k = 0; k < count; k++) {
        d->chunk_sizes[k] = chunks[lo + k].size;
        d->extent += chunks[lo + k].size;
    }
    CHECK(cubuf__ctx_push(res->ctx->handle, &g));
    for (size_t k = 0; k < count; k++) {
        if (fabric) {
            st = cubuf__ipc_fabric_export(chunks[lo + k].handle,
                                          d->fabric_handles + CUBUF__IPC_FABRIC_HANDLE_BYTES * k);
            if (st != CUBUF_SUCCESS) {
                cubuf__detail_append("chunk %zu of %zu (fabric handle)", k + 1, count);
                goto fail;
            }
            continue;
        }
        int fd = -1;
        st = CU(cuMemExportToShareableHandle, &fd, chunks[lo + k].handle,
                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
        if (st != CUBUF_SUCCESS) {
            cubuf__detail_append("chunk %zu of %zu", k + 1, count);
            goto fail;
        }
        d->fds[k] = fd;
        (void)cubuf__set_cloexec(fd);
    }
    cubuf__ctx_pop(&g);
    free(chunks);
    *out = d;
    return CUBUF_SUCCESS;
fail:
    cubuf__ctx_pop(&g);
    free(chunks);
    cubuf_ipc_descriptor_destroy(d); /* closes the fds exported so far */
    return st;
}

static cubuf_status_t export_legacy(const cubuf_buffer_t *root, uint64_t offset, size_t size,
                                    cubuf_ipc_descriptor_t *d)
{
    cubuf_resource_t *res = root->resource;
    cubuf_ctx_guard_t g = {false};
    cubuf_status_t st;
    CHECK(cubuf__ctx_push(res->ctx->handle, &g));
    CUdeviceptr base = 0;
    size_t alloc_size = 0;
    CHECK(CU(cuMemGetAddressRange, &base, &alloc_size, root->ptr));
    CUipcMemHandle h;
    memset(&h, 0, sizeof h);
    CHECK(CU(cuIpcGetMemHandle, &h, base));
    memcpy(d->ipc_handle, h.reserved, sizeof d->ipc_handle);
    d->size = size;
    d->offset = offset + (root->ptr - base);
    d->extent = alloc_size;
fail:
    cubuf__ctx_pop(&g);
    return st;
}

/* A descriptor of `mechanism` with `nfds` fds, filled by `fill`. */
static cubuf_status_t export_with(cubuf_ipc_mechanism_t mechanism, size_t nfds,
                                  cubuf_status_t (*fill)(const cubuf_buffer_t *, uint64_t, size_t,
                                                         cubuf_ipc_descriptor_t *),
                                  const cubuf_buffer_t *root, uint64_t offset, size_t size,
                                  cubuf_ipc_descriptor_t **out)
{
    cubuf_status_t st = cubuf__ipc_desc_new(mechanism, nfds, out);
    if (st == CUBUF_SUCCESS && (st = fill(root, offset, size, *out)) != CUBUF_SUCCESS) {
        cubuf_ipc_descriptor_destroy(*out);
        *out = NULL;
    }
    return st;
}

/* The vtbl entries of the pool and the synchronous device resources. */
cubuf_status_t cubuf__ipc_export_pool(const cubuf_buffer_t *root, uint64_t offset, size_t size,
                                      cubuf_ipc_descriptor_t **out)
{
    return export_with(CUBUF_IPC_MECHANISM_POOL, 1, export_pool, root, offset, size, out);
}

cubuf_status_t cubuf__ipc_export_legacy(const cubuf_buffer_t *root, uint64_t offset, size_t size,
                                        cubuf_ipc_descriptor_t **out)
{
    return export_with(CUBUF_IPC_MECHANISM_LEGACY, 0, export_legacy, root, offset, size, out);
}

cubuf_status_t cubuf_buffer_ipc_descriptor(const cubuf_buffer_t *buf, cubuf_ipc_descriptor_t **out)
{
    CHECK_ARG(buf && out, "cubuf_buffer_ipc_descriptor: NULL argument");
    cubuf_status_t st = cubuf__buffer_check_open(buf, "cubuf_buffer_ipc_descriptor");
    if (st != CUBUF_SUCCESS) return st;
    CHECK_ARG(buf->size > 0, "cubuf_buffer_ipc_descriptor: the buffer has size 0");
    const cubuf_buffer_t *root = NULL;
    uint64_t offset = 0;
    if ((st = root_of(buf, &root, &offset)) != CUBUF_SUCCESS) return st;
    const cubuf_resource_t *res = root->resource;
    if (!res)
        return cubuf__fail(CUBUF_ERROR_NOT_SUPPORTED,
                           "cubuf_buffer_ipc_descriptor: a view owns no memory to share");
    if ((st = cubuf__driver_load()) != CUBUF_SUCCESS) return st;
    if (!res->vt->export_ipc)
        return cubuf__fail(CUBUF_ERROR_NOT_SUPPORTED,
                           "cubuf_buffer_ipc_descriptor: the memory of this %s resource cannot be "
                           "shared: %s",
                           res->vt->name,
                           res->vt->no_export
                               ? res->vt->no_export
                               : "use an IPC-enabled device or pinned pool, a VMM resource with "
                                 "POSIX fd handles, or the sync device resource");
    cubuf_ipc_descriptor_t *d = NULL;
    CHECK(res->vt->export_ipc(root, offset, buf->size, &d));
    /* What we send must pass what the peer will check. */
    CHECK(cubuf__ipc_desc_validate(d));
    *out = d;
    return CUBUF_SUCCESS;
fail:
    cubuf_ipc_descriptor_destroy(d);
    return st;
}

/* ---- import: state ---- */

/* One pointer imported from a pool, shared by every buffer made from it. */
typedef struct pool_ptr {
    struct pool_ptr *next;
    uint8_t export_data[64];
    CUdeviceptr ptr;
    unsigned refs; /* imported buffers over it */
} pool_ptr_t;

/* One pool imported into this process, keyed by the exporter's identity. */
typedef struct pool_entry {
    struct pool_entry *next;
    uint8_t id[16];
    CUmemoryPool pool;
    unsigned refs;         /* pointers imported from it */
    uint64_t access_mask;  /* devices < 64 known to have read-write access */
    bool kept;             /* a device was granted access: never destroyed (see keep_pool_import) */
    bool dying;            /* its last pointer is closed: being destroyed (see retire_pool_import) */
    pool_ptr_t *ptrs;
} pool_entry_t;

/* The registry of imported pools. Import and the frees of close run their
 * driver calls under the lock (none of them waits for the device), which
 * keeps them atomic; nothing that waits for a stream runs under it, so one
 * slow stream never stalls the imports and closes of other pools. */
static pthread_mutex_t pools_lock = PTHREAD_MUTEX_INITIALIZER;
/* Signalled when a dying entry leaves the registry. */
static pthread_cond_t pools_gone = PTHREAD_COND_INITIALIZER;
static pool_entry_t *pools;
static unsigned pools_waiting; /* imports waiting for a dying entry (cubuf__ipc_pool_imports_waiting) */

/* What an imported buffer's resource owns. */
typedef struct ipc_import {
    CUdeviceptr base; /* pool: imported pointer; VMM: reservation; legacy: opened pointer */
    uint64_t extent;
    bool released;    /* the driver's side is gone */
    /* VMM */
    CUmemGenericAllocationHandle *handles;
    uint64_t *sizes;
    size_t nhandles; /* imported */
    size_t nmapped;  /* mapped, from the start */
    bool reserved;
    /* pool */
    pool_entry_t *pool;
    pool_ptr_t *pool_ptr;
} ipc_import_t;

/* ---- import: pools ---- */

static pool_entry_t *find_pool(const uint8_t id[16])
{
    for (pool_entry_t *e = pools; e; e = e->next)
        if (memcmp(e->id, id, 16) == 0) return e;
    return NULL;
}

static pool_ptr_t *find_ptr(pool_entry_t *e, const uint8_t data[64])
{
    for (pool_ptr_t *p = e->ptrs; p; p = p->next)
        if (memcmp(p->export_data, data, 64) == 0) return p;
    return NULL;
}

/* An imported pool is accessible from its resident device only (the
 * exporter's grants do not travel): grant the importing device. */
static cubuf_status_t grant_pool_access(pool_entry_t *e, const cubuf_context_t *c)
{
    int dev = (int)c->device;
    if (dev >= 0 && dev < 64 && (e->access_mask >> dev & 1)) return CUBUF_SUCCESS;
    CUmemLocation loc = {CU_MEM_LOCATION_TYPE_DEVICE, dev};
    CUmemAccess_flags flags = CU_MEM_ACCESS_FLAGS_PROT_NONE;
    cubuf_status_t st = CU(cuMemPoolGetAccess, &flags, e->pool, &loc);
    if (st != CUBUF_SUCCESS) return st;
    if (flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE) {
        CUmemAccessDesc a = {loc, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
        if ((st = CU(cuMemPoolSetAccess, e->pool, &a, 1)) != CUBUF_SUCCESS) {
            cubuf__detail_append("granting device %d access to the imported pool", c->ordinal);
            return st;
        }
        e->kept = true;
    }
    if (dev >= 0 && dev < 64) e->access_mask |= (uint64_t)1 << dev;
    return CUBUF_SUCCESS;
}

/* Whether a pool import stays in the registry for the life of the process.
 * The driver (580, CUDA 13.0 on an H200) breaks pinned pools once a process
 * destroys an imported pool that one of its devices was granted access to
 * (cuMemPoolSetAccess on the import; in practice the pinned, host-NUMA pools,
 * since an imported device pool is accessible from its resident device
 * already): the next pinned pool the process creates fails
 * cuMemAllocFromPoolAsync with CUDA_ERROR_OUT_OF_MEMORY. Revoking the grant
 * before the destroy does not help; without a grant there is no failure. So
 * an import that needed a grant is never destroyed: its pointers are still
 * freed at each close, and a later descriptor of the same pool reuses it.
 * The cost is one driver fd and the driver's bookkeeping per distinct
 * exporter pool, until the process exits. */
static bool keep_pool_import(const pool_entry_t *e)
{
    return e->kept;
}

/* Gives a pool import back: no pointer of it is left, and every free into
 * it has completed (see imported_pool_deallocate). Raw call: a failure here
 * must not replace the detail of a failure being unwound. */
static void destroy_pool_import(pool_entry_t *e)
{
    CUresult r = CU_CALL(cuMemPoolDestroy, e->pool);
    if (r != CUDA_SUCCESS)
        cubuf__warn(cubuf__cu_map(r), "cuMemPoolDestroy of an imported pool failed (%d)", (int)r);
}

/* What the exporter says of the pointer, checked against what the driver
 * of this process reports: the allocation must hold the buffer, and the
 * memory is pinned host memory exactly when the descriptor says so (a
 * descriptor that calls device memory host memory would have host code
 * dereference it). Both checks are best effort: where the driver tells no
 * range (neither cuMemGetAddressRange nor the pointer's attributes) or no
 * memory type (the attributes failed: a failure of this process's driver,
 * which no descriptor can cause), the export is trusted. */
static cubuf_status_t check_pool_ptr(CUdeviceptr ptr, const cubuf_ipc_descriptor_t *d)
{
    unsigned int type = 0;
    CUdeviceptr base = 0, attr_base = 0;
    size_t size = 0, attr_size = 0;
    CUpointer_attribute attrs[] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                                   CU_POINTER_ATTRIBUTE_RANGE_SIZE};
    void *data[] = {&type, &attr_base, &attr_size};
    CUresult r = CU_CALL(cuPointerGetAttributes, 3, attrs, data, ptr);
    if (CU_CALL(cuMemGetAddressRange, &base, &size, ptr) != CUDA_SUCCESS) {
        base = r == CUDA_SUCCESS ? attr_base : 0;
        size = r == CUDA_SUCCESS ? attr_size : 0;
    }
    if (size != 0 && ptr >= base && ptr - base <= size && d->offset + d->size > size - (ptr - base))
        return cubuf__fail(CUBUF_ERROR_INVALID_DESCRIPTOR,
                           "IPC descriptor: offset %llu + size %llu is past the imported pool "
                           "allocation (%zu bytes)",
                           (unsigned long long)d->offset, (unsigned long long)d->size, size - (size_t)(ptr - base));
    bool host = type == CU_MEMORYTYPE_HOST;
    bool claimed = (d->flags & CUBUF__IPC_FLAG_HOST_ACCESSIBLE) != 0;
    if (r == CUDA_SUCCESS && host != claimed)
        return cubuf__fail(CUBUF_ERROR_INVALID_DESCRIPTOR,
                           "IPC descriptor: it says %s memory; the driver reports %s memory for the "
                           "imported pointer",
                           claimed ? "pinned host" : "device", host ? "pinned host" : "device");
    return CUBUF_SUCCESS;
}

static cubuf_status_t import_pool_ptr(pool_entry_t *e, const cubuf_ipc_descriptor_t *d,
                                      pool_ptr_t **out)
{
    pool_ptr_t *p = cubuf__calloc(1, sizeof *p);
    if (!p) return cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "cannot allocate a pool import");
    memcpy(p->export_data, d->export_data, sizeof p->export_data);
    CUmemPoolPtrExportData data;
    memcpy(data.reserved, d->export_data, sizeof data.reserved);
    cubuf_status_t st = CU(cuMemPoolImportPointer, &p->ptr, e->pool, &data);
    if (st != CUBUF_SUCCESS) {
        free(p);
        return st;
    }
    if ((st = check_pool_ptr(p->ptr, d)) != CUBUF_SUCCESS) {
        CUresult r = CU_CALL(cuMemFree, p->ptr);
        if (r != CUDA_SUCCESS) cubuf__warn(cubuf__cu_map(r), "cuMemFree of a rejected pool import failed (%d)", (int)r);
        free(p);
        return st;
    }
    *out = p;
    return CUBUF_SUCCESS;
}

static cubuf_status_t import_pool(const cubuf_context_t *c, const cubuf_ipc_descriptor_t *d,
                                  ipc_import_t *imp)
{
    cubuf_status_t st = CUBUF_SUCCESS;
    pthread_mutex_lock(&pools_lock);
    pool_entry_t *e;
    /* A dying import of this pool is never used again: wait until it is
     * destroyed, then import the pool afresh (two live imports of one pool
     * in one process are not something the driver documents). */
    while ((e = find_pool(d->pool_id)) && e->dying) {
        pools_waiting++;
        pthread_cond_wait(&pools_gone, &pools_lock);
        pools_waiting--;
    }
    bool new_entry = false;
    if (!e) {
        e = cubuf__calloc(1, sizeof *e);
        if (!e) {
            st = cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "cannot allocate a pool import");
            goto out;
        }
        memcpy(e->id, d->pool_id, sizeof e->id);
        st = CU(cuMemPoolImportFromShareableHandle, &e->pool, (void *)(uintptr_t)d->fds[0],
                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
        if (st != CUBUF_SUCCESS) {
            cubuf__detail_append("pool fd %d", d->fds[0]);
            free(e);
            goto out;
        }
        new_entry = true;
    }
    if ((st = grant_pool_access(e, c)) != CUBUF_SUCCESS) goto undo;
    pool_ptr_t *p = find_ptr(e, d->export_data);
    if (!p) {
        if ((st = import_pool_ptr(e, d, &p)) != CUBUF_SUCCESS) goto undo;
        p->next = e->ptrs;
        e->ptrs = p;
        e->refs++;
    } else if ((st = check_pool_ptr(p->ptr, d)) != CUBUF_SUCCESS) {
        goto undo; /* the pointer is imported already: this descriptor is held to it too */
    }
    p->refs++;
    if (new_entry) {
        e->next = pools;
        pools = e;
    }
    imp->pool = e;
    imp->pool_ptr = p;
    imp->base = p->ptr;
    goto out;
undo:
    if (new_entry && keep_pool_import(e)) {
        /* granted before the failure: it stays, with no pointer of its own */
        e->next = pools;
        pools = e;
    } else if (new_entry) {
        destroy_pool_import(e);
        free(e);
    }
out:
    pthread_mutex_unlock(&pools_lock);
    return st;
}

static void unlink_ptr(pool_entry_t *e, pool_ptr_t *p)
{
    for (pool_ptr_t **q = &e->ptrs; *q; q = &(*q)->next)
        if (*q == p) {
            *q = p->next;
            return;
        }
}

static void unlink_pool(pool_entry_t *e)
{
    for (pool_entry_t **q = &pools; *q; q = &(*q)->next)
        if (*q == e) {
            *q = e->next;
            return;
        }
}

/* ---- import: virtual memory ---- */

/* Undoes a VMM import as far as it went. Uses raw calls so that a failure
 * here does not replace the detail of the failure being unwound. */
static void vmm_teardown(ipc_import_t *imp)
{
    uint64_t off = 0;
    for (size_t i = 0; i < imp->nmapped; i++) {
        CUresult r = CU_CALL(cuMemUnmap, imp->base + off, imp->sizes[i]);
        if (r != CUDA_SUCCESS)
            cubuf__warn(cubuf__cu_map(r), "cuMemUnmap of imported chunk %zu of %zu failed (%d)", i + 1,
                        imp->nhandles, (int)r);
        off += imp->sizes[i];
    }
    imp->nmapped = 0;
    if (imp->reserved) {
        CUresult r = CU_CALL(cuMemAddressFree, imp->base, imp->extent);
        if (r != CUDA_SUCCESS)
            cubuf__warn(cubuf__cu_map(r), "cuMemAddressFree of an imported range failed (%d)", (int)r);
        imp->reserved = false;
    }
    for (size_t i = 0; i < imp->nhandles; i++) {
        CUresult r = CU_CALL(cuMemRelease, imp->handles[i]);
        if (r != CUDA_SUCCESS)
            cubuf__warn(cubuf__cu_map(r), "cuMemRelease of imported chunk %zu failed (%d)", i + 1, (int)r);
    }
    imp->nhandles = 0;
}

static cubuf_status_t check_local_granularity(const cubuf_context_t *c, const cubuf_ipc_descriptor_t *d)
{
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = (int)c->device;
    size_t g = 0;
    cubuf_status_t st = CU(cuMemGetAllocationGranularity, &g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (st != CUBUF_SUCCESS) return st;
    if (g && d->granularity % g)
        return cubuf__fail(CUBUF_ERROR_INVALID_DESCRIPTOR,
                           "IPC descriptor: granularity %llu is not a multiple of device %d's "
                           "minimum granularity %zu",
                           (unsigned long long)d->granularity, c->ordinal, g);
    return CUBUF_SUCCESS;
}

static cubuf_status_t import_vmm(const cubuf_context_t *c, cubuf_ipc_access_t access,
                                 const cubuf_ipc_descriptor_t *d, ipc_import_t *imp)
{
    size_t n = d->nchunks;
    cubuf_status_t st;
    CHECK(check_local_granularity(c, d));
    imp->handles = cubuf__calloc(n, sizeof *imp->handles);
    imp->sizes = cubuf__malloc(n * sizeof *imp->sizes);
    if (!imp->handles || !imp->sizes) {
        st = cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "cannot allocate an import of %zu chunks", n);
        goto fail;
    }
    memcpy(imp->sizes, d->chunk_sizes, n * sizeof *imp->sizes);
    imp->extent = d->extent;
    bool fabric = d->handle_type == CUBUF__IPC_HANDLE_FABRIC;
    for (size_t i = 0; i < n; i++) {
        st = fabric ? cubuf__ipc_fabric_import(d->fabric_handles + CUBUF__IPC_FABRIC_HANDLE_BYTES * i,
                                               &imp->handles[i])
                    : CU(cuMemImportFromShareableHandle, &imp->handles[i],
                         (void *)(uintptr_t)d->fds[i], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
        if (st != CUBUF_SUCCESS) {
            if (fabric)
                cubuf__detail_append("chunk %zu of %zu: a fabric handle this process cannot "
                                     "import (an IMEX channel of the exporter's NVLink domain?)",
                                     i + 1, n);
            else
                cubuf__detail_append("chunk %zu of %zu, fd %d: not a CUDA allocation handle this "
                                     "process can import",
                                     i + 1, n, d->fds[i]);
            goto fail;
        }
        imp->nhandles = i + 1;
    }
    CHECK(CU(cuMemAddressReserve, &imp->base, d->extent, d->granularity, 0, 0));
    imp->reserved = true;
    uint64_t off = 0;
    for (size_t i = 0; i < n; i++) {
        st = CU(cuMemMap, imp->base + off, imp->sizes[i], 0, imp->handles[i], 0);
        if (st != CUBUF_SUCCESS) {
            cubuf__detail_append("mapping chunk %zu of %zu, %llu bytes at offset %llu", i + 1, n,
                                 (unsigned long long)imp->sizes[i], (unsigned long long)off);
            goto fail;
        }
        imp->nmapped = i + 1;
        off += imp->sizes[i];
    }
    CUmemAccessDesc a;
    memset(&a, 0, sizeof a);
    a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a.location.id = (int)c->device;
    a.flags = access == CUBUF_IPC_ACCESS_READ ? CU_MEM_ACCESS_FLAGS_PROT_READ
                                              : CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CHECK(CU(cuMemSetAccess, imp->base, d->extent, &a, 1));
    return CUBUF_SUCCESS;
fail:
    vmm_teardown(imp);
    return st;
}

/* ---- import: legacy handles ---- */

static cubuf_status_t import_legacy(const cubuf_ipc_descriptor_t *d, ipc_import_t *imp)
{
    CUipcMemHandle h;
    memcpy(h.reserved, d->ipc_handle, sizeof h.reserved);
    CUdeviceptr p = 0;
    cubuf_status_t st = CU(cuIpcOpenMemHandle, &p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
    if (st != CUBUF_SUCCESS) return st;
    /* The driver knows the real allocation: hold the descriptor to it. */
    CUdeviceptr base = 0;
    size_t size = 0;
    st = CU(cuMemGetAddressRange, &base, &size, p);
    if (st == CUBUF_SUCCESS && (p < base || p - base > size || d->offset + d->size > size - (p - base)))
        st = cubuf__fail(CUBUF_ERROR_INVALID_DESCRIPTOR,
                         "IPC descriptor: offset %llu + size %llu is past the opened allocation of "
                         "%zu bytes",
                         (unsigned long long)d->offset, (unsigned long long)d->size, size);
    if (st != CUBUF_SUCCESS) {
        CUresult r = CU_CALL(cuIpcCloseMemHandle, p);
        if (r != CUDA_SUCCESS) cubuf__warn(cubuf__cu_map(r), "cuIpcCloseMemHandle failed (%d)", (int)r);
        return st;
    }
    imp->base = p;
    imp->extent = d->extent;
    return CUBUF_SUCCESS;
}

/* ---- imported resources ---- */

static cubuf_status_t imported_allocate(cubuf_resource_t *res, cubuf_buffer_t *buf, CUstream stream,
                                        bool in_ctx, cubuf_charge_t *charge)
{
    return cubuf__fail(CUBUF_ERROR_NOT_SUPPORTED,
                       "an imported IPC mapping cannot allocate: allocate from a resource of "
                       "this process");
}

static void imported_destroy(cubuf_resource_t *res)
{
    ipc_import_t *imp = res->impl;
    if (!imp) return;
    /* Not released means the close failed and was reported: the mapping is
     * left in place rather than pulled from under work that may use it. */
    free(imp->handles);
    free(imp->sizes);
    free(imp);
}

/* The context a recorded stream's work runs in. */
static CUcontext token_ctx(const cubuf_resource_t *res, const cubuf_stream_token_t *t)
{
    return t->ctx ? t->ctx : res->ctx->handle;
}

/* Before unmapping: the deallocation stream must have finished with the
 * memory. A capturing stream refuses (the buffer stays open); a default
 * stream whose synchronization would disturb a capture is skipped with a
 * warning, as VMM buffers do. */
static cubuf_status_t drain_before_unmap(const cubuf_resource_t *res, const cubuf_stream_token_t *t,
                                         const char *what)
{
    CUstreamCaptureStatus cs = CU_STREAM_CAPTURE_STATUS_NONE;
    cubuf_status_t st = cubuf__stream_capture_status(t->stream, token_ctx(res, t), &cs);
    if (st != CUBUF_SUCCESS) return st;
    if (cs != CU_STREAM_CAPTURE_STATUS_NONE) {
        if (!cubuf__stream_is_default(t->stream))
            return cubuf__fail(CUBUF_ERROR_STREAM_CAPTURING,
                               "%s: the deallocation stream is capturing; the buffer stays open", what);
        cubuf__warn(CUBUF_ERROR_STREAM_CAPTURING,
                    "%s: synchronizing the default stream would disturb a capture; unmapping "
                    "without it",
                    what);
        return CUBUF_SUCCESS;
    }
    return cubuf__stream_sync(t);
}

static cubuf_status_t imported_vmm_deallocate(cubuf_resource_t *res, cubuf_buffer_t *buf,
                                              const cubuf_stream_token_t *token, cubuf_charge_t *charge)
{
    (void)charge;
    ipc_import_t *imp = res->impl;
    if (imp->released) return CUBUF_SUCCESS;
    cubuf_status_t st = drain_before_unmap(res, token, "closing an imported VMM buffer");
    if (st != CUBUF_SUCCESS) return st;
    cubuf_ctx_guard_t g = {false};
    if ((st = cubuf__ctx_push(res->ctx->handle, &g)) != CUBUF_SUCCESS) return st;
    vmm_teardown(imp); /* past this point nothing is left to retry: failures are warnings */
    cubuf__ctx_pop(&g);
    imp->released = true;
    return CUBUF_SUCCESS;
}

static cubuf_status_t imported_legacy_deallocate(cubuf_resource_t *res, cubuf_buffer_t *buf,
                                                 const cubuf_stream_token_t *token, cubuf_charge_t *charge)
{
    (void)charge;
    ipc_import_t *imp = res->impl;
    if (imp->released) return CUBUF_SUCCESS;
    cubuf_status_t st = drain_before_unmap(res, token, "closing an imported legacy IPC buffer");
    if (st != CUBUF_SUCCESS) return st;
    cubuf_ctx_guard_t g = {false};
    if ((st = cubuf__ctx_push(res->ctx->handle, &g)) != CUBUF_SUCCESS) return st;
    st = CU(cuIpcCloseMemHandle, imp->base);
    cubuf__ctx_pop(&g);
    if (st == CUBUF_SUCCESS) imp->released = true;
    return st;
}

/* Destroys a pool import whose last pointer was just freed on `token` and
 * which is marked dying (no import uses it any more; an import of the same
 * pool waits in import_pool), outside the registry lock, then takes it out
 * of the registry.
 * The free must have completed before the pool import goes: the driver
 * (580, CUDA 13.0 on an H200) never releases an imported pool destroyed
 * while a free into it is pending. Its fd and its mapping of the exporter's
 * memory stay until the process exits, whatever runs later. Once the free
 * has run, cuMemPoolDestroy gives both back at once. The synchronization
 * may take as long as the work queued on that stream: only the imports of
 * this same pool wait for it. */
static void retire_pool_import(pool_entry_t *e, const cubuf_stream_token_t *token)
{
    cubuf_status_t ss = cubuf__stream_sync(token);
    if (ss != CUBUF_SUCCESS)
        cubuf__warn(ss, "closing the last buffer of an imported pool: synchronizing the "
                        "deallocation stream failed (%s); the pool import may stay until "
                        "the process exits",
                    cubuf_last_error());
    destroy_pool_import(e);
    pthread_mutex_lock(&pools_lock);
    unlink_pool(e);
    pthread_cond_broadcast(&pools_gone);
    pthread_mutex_unlock(&pools_lock);
    free(e);
}

unsigned cubuf__ipc_pool_imports_waiting(void)
{
    pthread_mutex_lock(&pools_lock);
    unsigned n = pools_waiting;
    pthread_mutex_unlock(&pools_lock);
    return n;
}

static cubuf_status_t imported_pool_deallocate(cubuf_resource_t *res, cubuf_buffer_t *buf,
                                               const cubuf_stream_token_t *token, cubuf_charge_t *charge)
{
    (void)charge;
    ipc_import_t *imp = res->impl;
    if (imp->released) return CUBUF_SUCCESS;
    CUcontext cx = token_ctx(res, token);
    cubuf_status_t st = cubuf__stream_refuse_capture(token->stream, cx, "closing an imported pool buffer");
    if (st != CUBUF_SUCCESS) return st;
    pool_entry_t *e = imp->pool;
    pool_ptr_t *p = imp->pool_ptr;
    /* A close that leaves the pointer imported for other buffers frees
     * nothing, but the work queued on its stream may still use the memory,
     * and the last close's free, on another stream, must not run before
     * it: this close waits for its stream (outside the lock), as the close
     * of a VMM or legacy import does. Its reference still counts meanwhile,
     * so no other close is the last; if all the others closed meanwhile,
     * this one is the last and frees. Whether it is the last is decided
     * under the lock it then acts under: an import of the pointer may come
     * whenever the lock is free, and a close that saw itself last, let go
     * and found another reference after would drop its own unsynchronized. */
    pthread_mutex_lock(&pools_lock);
    if (p->refs > 1) { /* not the last now: wait, then look again (synchronized either way) */
        pthread_mutex_unlock(&pools_lock);
        if ((st = cubuf__stream_sync(token)) != CUBUF_SUCCESS) return st;
        pthread_mutex_lock(&pools_lock);
    }
    bool retire = false;
    if (p->refs == 1) {
        cubuf_ctx_guard_t g = {false};
        st = cubuf__ctx_push(cx, &g);
        if (st == CUBUF_SUCCESS) st = CU(cuMemFreeAsync, p->ptr, token->stream);
        cubuf__ctx_pop(&g);
        if (st != CUBUF_SUCCESS) goto out; /* nothing changed: the buffer stays open */
        unlink_ptr(e, p);
        free(p);
        /* A pool import that needed an access grant (pinned pools) is
         * never destroyed: see keep_pool_import. */
        retire = --e->refs == 0 && !keep_pool_import(e);
        if (retire) e->dying = true;
    } else {
        p->refs--;
    }
    imp->released = true;
    imp->pool = NULL;
    imp->pool_ptr = NULL;
out:
    pthread_mutex_unlock(&pools_lock);
    if (retire) retire_pool_import(e, token);
    return st;
}

/* An imported resource holds one import, the one its buffer maps: any
 * other pointer handed to it would be "freed" by undoing that import. */
static const char imported_no_export[] =
    "imported memory cannot be exported again; export it from the process that allocated it";
static const char imported_no_adopt[] =
    "an imported IPC resource frees only the mapping it imported (close the imported buffer "
    "instead)";

static const cubuf_resource_vtbl_t imported_pool_vtbl = {
    .name = "imported pool IPC",
    .no_export = imported_no_export,
    .raw_keeps_buffer = true, /* no raw allocation: a raw free is never one of its */
    .allocate = imported_allocate,
    .deallocate = imported_pool_deallocate,
    .destroy = imported_destroy,
    .no_adopt = imported_no_adopt,
};
static const cubuf_resource_vtbl_t imported_vmm_vtbl = {
    .name = "imported VMM IPC",
    .no_export = imported_no_export,
    .raw_keeps_buffer = true, /* no raw allocation: a raw free is never one of its */
    .allocate = imported_allocate,
    .deallocate = imported_vmm_deallocate,
    .destroy = imported_destroy,
    .no_adopt = imported_no_adopt,
};
static const cubuf_resource_vtbl_t imported_legacy_vtbl = {
    .name = "imported legacy IPC",
    .no_export = imported_no_export,
    .raw_keeps_buffer = true, /* no raw allocation: a raw free is never one of its */
    .allocate = imported_allocate,
    .deallocate = imported_legacy_deallocate,
    .destroy = imported_destroy,
    .no_adopt = imported_no_adopt,
};

/* ---- import ---- */

static const cubuf_resource_vtbl_t *import_vtbl(cubuf_ipc_mechanism_t m)
{
    switch (m) {
    case CUBUF_IPC_MECHANISM_POOL: return &imported_pool_vtbl;
    case CUBUF_IPC_MECHANISM_VMM: return &imported_vmm_vtbl;
    case CUBUF_IPC_MECHANISM_LEGACY: return &imported_legacy_vtbl;
    }
    return NULL;
}

static cubuf_status_t import_context(cubuf_context_t *ctx, int device, cubuf_context_t **out)
{
    if (ctx) {
        *out = cubuf__context_retain(ctx);
        return CUBUF_SUCCESS;
    }
    return cubuf__context_for_device(device, out);
}

cubuf_status_t cubuf_buffer_from_ipc_descriptor(cubuf_context_t *ctx,
                                                const cubuf_ipc_import_options_t *options,
                                                const cubuf_ipc_descriptor_t *desc, CUstream stream,
                                                cubuf_buffer_t **out)
{
    CHECK_ARG(desc && out, "cubuf_buffer_from_ipc_descriptor: NULL argument");
    cubuf_ipc_import_options_t o = CUBUF_IPC_IMPORT_OPTIONS_INIT;
    cubuf_status_t ost;
    if (options && (ost = cubuf__struct_in("cubuf_buffer_from_ipc_descriptor",
                                           "cubuf_ipc_import_options_t", &o, sizeof o, options,
                                           CUBUF_IPC_IMPORT_OPTIONS_SIZE_V1)) != CUBUF_SUCCESS)
        return ost;
    CHECK_ARG(o.access == CUBUF_IPC_ACCESS_READ_WRITE || o.access == CUBUF_IPC_ACCESS_READ,
              "cubuf_buffer_from_ipc_descriptor: unknown access %d", (int)o.access);
    cubuf_status_t st = cubuf__ipc_desc_validate(desc);
    if (st != CUBUF_SUCCESS) return st;
    if ((st = cubuf__driver_load()) != CUBUF_SUCCESS) return st;
    cubuf_context_t *c = NULL;
    if ((st = import_context(ctx, o.device, &c)) != CUBUF_SUCCESS) return st;
    cubuf_resource_t *res = NULL;
    cubuf_buffer_t *buf = NULL;
    ipc_import_t *imp = NULL;
    cubuf_ctx_guard_t g = {false};
    if ((st = cubuf__resource_new(import_vtbl(desc->mechanism), c, 0, &res)) !=
        CUBUF_SUCCESS) {
        cubuf__context_release(c);
        return st;
    }
    /* Pinned host memory belongs to no device, as on the exporter's side. */
    res->props.host_accessible = (desc->flags & CUBUF__IPC_FLAG_HOST_ACCESSIBLE) != 0;
    res->props.device_id = res->props.host_accessible ? -1 : c->ordinal;
    res->props.device_accessible = true;
    CHECK(cubuf__buffer_new(&buf));
    imp = cubuf__calloc(1, sizeof *imp);
    if (!imp) {
        st = cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "cannot allocate an IPC import");
        goto fail;
    }
    CHECK(cubuf__ctx_push(c->handle, &g));
    CHECK(cubuf__stream_record(&buf->dealloc, stream, c->handle));
    switch (desc->mechanism) {
    case CUBUF_IPC_MECHANISM_POOL: CHECK(import_pool(c, desc, imp)); break;
    case CUBUF_IPC_MECHANISM_VMM: CHECK(import_vmm(c, o.access, desc, imp)); break;
    case CUBUF_IPC_MECHANISM_LEGACY: CHECK(import_legacy(desc, imp)); break;
    }
    cubuf__ctx_pop(&g);
    res->impl = imp;
    buf->ptr = imp->base + desc->offset;
    buf->size = desc->size;
    cubuf__buffer_take_props(buf, res);
    buf->flags |= CUBUF__MAPPED;
    buf->resource = res; /* takes our reference */
    cubuf__resource_count(res, +1, buf->size, &(cubuf_charge_t){buf->size, 1});
    *out = buf;
    return CUBUF_SUCCESS;
fail:
    cubuf__ctx_pop(&g);
    if (imp) {
        free(imp->handles);
        free(imp->sizes);
        free(imp);
    }
    if (buf) cubuf__buffer_discard(buf);
    cubuf_resource_release(res); /* releases c */
    return st;
}

cubuf_status_t cubuf_context_open_ipc_buffer(cubuf_context_t *ctx, const cubuf_ipc_descriptor_t *desc,
                                             cubuf_buffer_t **out)
{
    CHECK_ARG(ctx, "cubuf_context_open_ipc_buffer: ctx is NULL");
    return cubuf_buffer_from_ipc_descriptor(ctx, NULL, desc, CU_STREAM_LEGACY, out);
}
