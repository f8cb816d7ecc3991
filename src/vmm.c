/* Virtual memory: VirtualMemoryResource and VirtualMemoryBuffer.
 *
 * Model. Buffers that alias one another (an allocation and everything
 * modify_allocation made from it) share one range (vmm_range_t, reached from
 * each buffer's membership, buf->impl). The range owns:
 *  - physical allocations (vmm_phys_t, one per cuMemCreate), each counting
 *    the live mappings of it: it is released with its last mapping;
 *  - spaces (vmm_space_t): one contiguous stretch of address space made of
 *    one or more reservations, with its mappings in address order. A grow in
 *    place extends a space; a grow that moves makes a new space that maps
 *    the same physical allocations again;
 *  - members (vmm_member_t): one per open buffer, naming its space and how
 *    many of the space's mappings it covers. A buffer always covers a prefix
 *    of its space (allocations, grows and aliases all start at the base).
 * A mapping is needed while an open buffer's prefix covers it. Each mapping
 * counts the buffers whose prefix ends there (`ends`), so a close finds what
 * to unmap by walking down from its own end, and a grow in place appends:
 * neither touches the rest of the range.
 *
 * Every driver call runs with the resource's context pushed and the calling
 * thread's capture mode relaxed (vmm_guard_t).
 *
 * Failure: allocate and grow create everything first and publish nothing
 * until the last driver call succeeded; on failure they undo what they made,
 * in reverse. Close unmaps first (undone by mapping again, since the
 * physical allocations are still held) and only then releases allocations
 * and reservations, which can no longer fail the close. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "vmm.h"

/* Reservations are at least this large and leave room to double, so that a
 * growing buffer rarely needs a new reservation (address space is cheap;
 * cuMemAddressReserve is not, next to mapping a small new part). */
#define VMM_MIN_RESERVE ((size_t)1 << 30)
/* A host-memory CPU entry, the owner and the peers. */
#define VMM_MAX_DESCS (2 + CUBUF_VMM_MAX_PEERS)

/* ---- state ------------------------------------------------------------- */

typedef struct vmm_access {
    CUmemAccessDesc desc[VMM_MAX_DESCS];
    unsigned count;
} vmm_access_t;

typedef struct vmm_res {
    cubuf_vmm_options_t opts; /* validated; location_id resolved; alignment >= gran */
    CUdevice device;
    int ordinal;
    size_t gran;
    bool rdma_supported;
    vmm_access_t access; /* what the resource's own options grant */
} vmm_res_t;

typedef struct vmm_phys {
    CUmemGenericAllocationHandle handle;
    size_t size;
    unsigned maps;   /* live mappings of it, over all spaces */
    unsigned access; /* index into the range's access profiles */
} vmm_phys_t;

typedef struct vmm_mapping {
    size_t offset; /* from the space's base */
    vmm_phys_t *phys;
    size_t ends; /* open buffers whose prefix ends with this mapping */
} vmm_mapping_t;

typedef struct vmm_resv {
    size_t offset; /* from the space's base */
    size_t size;
} vmm_resv_t;

typedef struct vmm_space {
    CUdeviceptr base;
    vmm_mapping_t *maps; /* in address order, contiguous from base */
    size_t nmaps, cap_maps;
    size_t mapped; /* bytes the mappings cover */
    vmm_resv_t *resv; /* in address order, contiguous from base */
    size_t nresv, cap_resv;
    size_t reserved; /* bytes the reservations cover */
    size_t buffers;  /* open buffers in this space */
} vmm_space_t;

typedef struct vmm_range vmm_range_t;

typedef struct vmm_member {
    vmm_range_t *range;
    vmm_space_t *space;
    size_t count; /* the buffer covers space->maps[0, count) */
    cubuf_buffer_t *buf;
    struct vmm_member *prev, *next;
} vmm_member_t;

struct vmm_range {
    pthread_mutex_t lock;
    vmm_member_t *members; /* open buffers: their deallocation streams */
    size_t nmembers;
    vmm_access_t *access; /* distinct access profiles of the allocations */
    unsigned naccess, cap_access;
};

static atomic_long live_resv, live_maps, live_phys;

void cubuf__vmm_live(cubuf_vmm_live_t *live)
{
    live->reservations = atomic_load(&live_resv);
    live->mappings = atomic_load(&live_maps);
    live->allocations = atomic_load(&live_phys);
}

/* ---- small helpers --------------------------------------------------------- */

static bool round_up(size_t size, size_t gran, size_t *out)
{
    size_t rem = size % gran;
    if (rem == 0) {
        *out = size;
        return true;
    }
    if (size > SIZE_MAX - (gran - rem)) return false;
    *out = size + (gran - rem);
    return true;
}

/* How much to reserve for a space that maps `total` bytes: the next power
 * of two, doubled, at least VMM_MIN_RESERVE. A doubling grow then finds its
 * addresses reserved every other step, and small grows almost always. */
static size_t reserve_target(size_t total, size_t gran)
{
    size_t t = 1;
    while (t < total && t <= SIZE_MAX / 2) t <<= 1;
    if (t < total) return total;
    if (t <= SIZE_MAX / 2) t <<= 1;
    if (t < VMM_MIN_RESERVE) t = VMM_MIN_RESERVE;
    size_t r;
    return round_up(t, gran, &r) ? r : total;
}

/* Grows an array's capacity to at least `need` elements. Returns the array
 * (possibly moved) or NULL when out of memory (the old one is kept). */
static void *ensure_cap(void *arr, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap) return arr;
    size_t n = *cap ? *cap : 4;
    while (n < need) n *= 2;
    void *p = realloc(arr, n * elem);
    if (p) *cap = n;
    return p;
}

static int current_numa_node(void)
{
    unsigned cpu = 0, node = 0;
    if (syscall(SYS_getcpu, &cpu, &node, NULL) != 0) return 0;
    return (int)node;
}

static bool is_host_location(cubuf_vmm_location_t loc) { return loc != CUBUF_VMM_LOCATION_DEVICE; }

/* ---- driver calls ---------------------------------------------------------- */

static cubuf_status_t va_reserve(CUdeviceptr *va, size_t size, size_t align, CUdeviceptr hint)
{
    cubuf_status_t st = CU(cuMemAddressReserve, va, size, align, hint, 0);
    if (st != CUBUF_SUCCESS) {
        cubuf__detail_append("reserving %zu bytes, alignment %zu, hint 0x%llx", size, align,
                             (unsigned long long)hint);
        return st;
    }
    atomic_fetch_add(&live_resv, 1);
    return CUBUF_SUCCESS;
}

static cubuf_status_t phys_create(CUmemGenericAllocationHandle *h, size_t size,
                                  const CUmemAllocationProp *prop)
{
    cubuf_status_t st = CU(cuMemCreate, h, size, prop, 0);
    if (st != CUBUF_SUCCESS) {
        cubuf__detail_append("size %zu", size);
        return st;
    }
    atomic_fetch_add(&live_phys, 1);
    return CUBUF_SUCCESS;
}

static cubuf_status_t map_phys(CUdeviceptr va, const vmm_phys_t *p)
{
    cubuf_status_t st = CU(cuMemMap, va, p->size, 0, p->handle, 0);
    if (st != CUBUF_SUCCESS) {
        cubuf__detail_append("mapping %zu bytes at 0x%llx", p->size, (unsigned long long)va);
        return st;
    }
    atomic_fetch_add(&live_maps, 1);
    return CUBUF_SUCCESS;
}

static cubuf_status_t set_access(CUdeviceptr va, size_t size, const vmm_access_t *a)
{
    if (a->count == 0) return CUBUF_SUCCESS; /* nothing granted: mappings start without access */
    cubuf_status_t st = CU(cuMemSetAccess, va, size, a->desc, a->count);
    if (st != CUBUF_SUCCESS)
        cubuf__detail_append("%zu bytes at 0x%llx, %u access entries", size, (unsigned long long)va,
                             a->count);
    return st;
}

/* Undoing and releasing: no caller can be told about these, and the thread's
 * last error must keep describing the failure being unwound. A failed call
 * is tried once more (a transient or injected failure must not leak), then
 * reported to the warning handler. */
static CUresult retry_once(CUresult r, CUresult (*again)(const void *), const void *arg)
{
    return r == CUDA_SUCCESS ? r : again(arg);
}

typedef struct vmm_span {
    CUdeviceptr va;
    size_t size;
} vmm_span_t;

static CUresult free_va_call(const void *arg)
{
    const vmm_span_t *s = arg;
    return CU_CALL(cuMemAddressFree, s->va, s->size);
}

static CUresult unmap_call(const void *arg)
{
    const vmm_span_t *s = arg;
    return CU_CALL(cuMemUnmap, s->va, s->size);
}

static CUresult release_call(const void *arg)
{
    return CU_CALL(cuMemRelease, *(const CUmemGenericAllocationHandle *)arg);
}

static void va_free_quiet(CUdeviceptr va, size_t size)
{
    vmm_span_t s = {va, size};
    CUresult r = retry_once(free_va_call(&s), free_va_call, &s);
    if (r == CUDA_SUCCESS)
        atomic_fetch_sub(&live_resv, 1);
    else
        cubuf__warn(cubuf__cu_map(r),
                    "cuMemAddressFree of %zu bytes at 0x%llx failed (CUresult %d): the address "
                    "range stays reserved",
                    size, (unsigned long long)va, (int)r);
}

static void unmap_quiet(CUdeviceptr va, size_t size)
{
    vmm_span_t s = {va, size};
    CUresult r = retry_once(unmap_call(&s), unmap_call, &s);
    if (r == CUDA_SUCCESS)
        atomic_fetch_sub(&live_maps, 1);
    else
        cubuf__warn(cubuf__cu_map(r),
                    "cuMemUnmap of %zu bytes at 0x%llx failed (CUresult %d): the mapping stays",
                    size, (unsigned long long)va, (int)r);
}

static void release_quiet(CUmemGenericAllocationHandle h, size_t size)
{
    CUresult r = retry_once(release_call(&h), release_call, &h);
    if (r == CUDA_SUCCESS)
        atomic_fetch_sub(&live_phys, 1);
    else
        cubuf__warn(cubuf__cu_map(r),
                    "cuMemRelease of a %zu-byte physical allocation failed (CUresult %d): the "
                    "memory is lost",
                    size, (int)r);
}

/* Maps a physical allocation again where a failed close had unmapped it. */
static void remap_quiet(CUdeviceptr va, const vmm_phys_t *p, const vmm_access_t *a)
{
    CUresult r = CU_CALL(cuMemMap, va, p->size, 0, p->handle, 0);
    if (r != CUDA_SUCCESS) r = CU_CALL(cuMemMap, va, p->size, 0, p->handle, 0);
    if (r != CUDA_SUCCESS) {
        cubuf__warn(cubuf__cu_map(r),
                    "restoring a mapping of %zu bytes at 0x%llx after a failed close failed "
                    "(CUresult %d): the buffer no longer maps that part",
                    p->size, (unsigned long long)va, (int)r);
        return;
    }
    atomic_fetch_add(&live_maps, 1);
    if (a->count == 0) return;
    r = CU_CALL(cuMemSetAccess, va, p->size, a->desc, a->count);
    if (r != CUDA_SUCCESS) r = CU_CALL(cuMemSetAccess, va, p->size, a->desc, a->count);
    if (r != CUDA_SUCCESS)
        cubuf__warn(cubuf__cu_map(r),
                    "restoring access to %zu bytes at 0x%llx after a failed close failed "
                    "(CUresult %d)",
                    p->size, (unsigned long long)va, (int)r);
}

/* The resource's context pushed and the thread's capture mode relaxed: the
 * mapping calls are synchronous, and in the default (global) capture mode a
 * capture anywhere in the process would make them fail and invalidate it. */
typedef struct vmm_guard {
    cubuf_ctx_guard_t ctx;
    CUstreamCaptureMode mode;
    bool relaxed;
} vmm_guard_t;

static cubuf_status_t guard_enter(const cubuf_resource_t *res, vmm_guard_t *g)
{
    g->relaxed = false;
    cubuf_status_t st = cubuf__ctx_push(res->ctx->handle, &g->ctx);
    if (st != CUBUF_SUCCESS) return st;
    g->mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    st = CU(cuThreadExchangeStreamCaptureMode, &g->mode);
    if (st != CUBUF_SUCCESS) {
        cubuf__ctx_pop(&g->ctx);
        return st;
    }
    g->relaxed = true;
    return CUBUF_SUCCESS;
}

static void guard_exit(vmm_guard_t *g)
{
    if (g->relaxed) {
        /* Restoring the caller's mode bypasses fault injection, as
         * cubuf__ctx_pop does: it cannot fail short of a broken driver. */
        CUstreamCaptureMode mode = g->mode;
        CUresult r = cubuf__drv.cuThreadExchangeStreamCaptureMode(&mode);
        if (r != CUDA_SUCCESS)
            cubuf__warn(cubuf__cu_map(r), "restoring the thread's stream capture mode failed (CUresult %d)",
                        (int)r);
        g->relaxed = false;
    }
    cubuf__ctx_pop(&g->ctx);
}

/* ---- options --------------------------------------------------------------- */

static const char *location_name(cubuf_vmm_location_t loc)
{
    switch (loc) {
    case CUBUF_VMM_LOCATION_DEVICE: return "DEVICE";
    case CUBUF_VMM_LOCATION_HOST: return "HOST";
    case CUBUF_VMM_LOCATION_HOST_NUMA: return "HOST_NUMA";
    case CUBUF_VMM_LOCATION_HOST_NUMA_CURRENT: return "HOST_NUMA_CURRENT";
    }
    return "?";
}

/* What needs no driver: the struct size, enums, counts, alignment. */
static cubuf_status_t check_shape(const cubuf_vmm_options_t *o, const char *what)
{
    if (o->struct_size < sizeof *o)
        return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,
                           "%s: options->struct_size is %zu, expected at least %zu; initialize "
                           "the options with CUBUF_VMM_OPTIONS_INIT",
                           what, o->struct_size, sizeof *o);
#define CUBUF_VMM_ENUM_CHECK_(field, last)                                                      \
    if ((unsigned)o->field > (unsigned)(last))                                                  \
        return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,                                        \
                           "%s: options->" #field " is %d, not a value of its enum (0 to %d)", \
                           what, (int)o->field, (int)(last));
    CUBUF_VMM_ENUM_CHECK_(allocation_type, CUBUF_VMM_ALLOCATION_MANAGED)
    CUBUF_VMM_ENUM_CHECK_(location, CUBUF_VMM_LOCATION_HOST_NUMA_CURRENT)
    CUBUF_VMM_ENUM_CHECK_(handle_type, CUBUF_VMM_HANDLE_FABRIC)
    CUBUF_VMM_ENUM_CHECK_(granularity, CUBUF_VMM_GRANULARITY_MINIMUM)
    CUBUF_VMM_ENUM_CHECK_(owner_access, CUBUF_VMM_ACCESS_NONE)
    CUBUF_VMM_ENUM_CHECK_(peer_access, CUBUF_VMM_ACCESS_NONE)
#undef CUBUF_VMM_ENUM_CHECK_
    if (o->peer_count > CUBUF_VMM_MAX_PEERS)
        return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,
                           "%s: options->peer_count is %u; at most %d peers (CUBUF_VMM_MAX_PEERS)",
                           what, o->peer_count, CUBUF_VMM_MAX_PEERS);
    size_t a = o->address_alignment;
    if (a & (a - 1))
        return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,
                           "%s: options->address_alignment is %zu, not 0 or a power of two", what,
                           a);
    if (o->location == CUBUF_VMM_LOCATION_HOST && o->handle_type != CUBUF_VMM_HANDLE_NONE)
        return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,
                           "%s: memory at the HOST location cannot be exported; pass "
                           "handle_type CUBUF_VMM_HANDLE_NONE (or use HOST_NUMA)",
                           what);
    return CUBUF_SUCCESS;
}

/* Refuses what the device cannot do, naming it. */
static cubuf_status_t check_support(vmm_res_t *vr, const char *what)
{
    const cubuf_vmm_options_t *o = &vr->opts;
    int v = 0;
    cubuf_status_t st;
    if ((st = cubuf__device_attr(vr->device, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, &v)))
        return st;
    if (!v)
        return cubuf__fail(CUBUF_ERROR_NOT_SUPPORTED,
                           "%s: device %d does not support virtual memory management", what,
                           vr->ordinal);
    if ((st = cubuf__device_attr(vr->device, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
                          &v)))
        return st;
    vr->rdma_supported = v != 0;
    if (o->gpu_direct_rdma && !vr->rdma_supported)
        return cubuf__fail(CUBUF_ERROR_NOT_SUPPORTED,
                           "%s: device %d does not support GPUDirect RDMA with virtual memory "
                           "(options->gpu_direct_rdma)",
                           what, vr->ordinal);
    struct {
        bool wanted;
        CUdevice_attribute attr;
        const char *feature;
    } needs[] = {
        {o->handle_type == CUBUF_VMM_HANDLE_POSIX_FD,
         CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
         "POSIX file descriptor handles (options->handle_type)"},
        {o->handle_type == CUBUF_VMM_HANDLE_FABRIC, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED,
         "fabric handles (options->handle_type)"},
        {o->location == CUBUF_VMM_LOCATION_HOST,
         CU_DEVICE_ATTRIBUTE_HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
         "virtual memory at the HOST location (options->location)"},
        {o->location == CUBUF_VMM_LOCATION_HOST_NUMA ||
             o->location == CUBUF_VMM_LOCATION_HOST_NUMA_CURRENT,
         CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
         "virtual memory at a HOST_NUMA location (options->location)"},
        {o->allocation_type == CUBUF_VMM_ALLOCATION_MANAGED, CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY,
         "managed memory (options->allocation_type)"},
    };
    for (size_t i = 0; i < sizeof needs / sizeof needs[0]; i++) {
        if (!needs[i].wanted) continue;
        if ((st = cubuf__device_attr(vr->device, needs[i].attr, &v))) return st;
        if (!v)
            return cubuf__fail(CUBUF_ERROR_NOT_SUPPORTED, "%s: device %d does not support %s",
                               what, vr->ordinal, needs[i].feature);
    }
    return CUBUF_SUCCESS;
}

/* The id the location means: the device ordinal, the NUMA node, or -1. */
static cubuf_status_t resolve_location_id(CUdevice dev, int ordinal, const cubuf_vmm_options_t *o,
                                          int *id, const char *what)
{
    int given = o->location_id;
    switch (o->location) {
    case CUBUF_VMM_LOCATION_DEVICE:
        if (given != CUBUF_VMM_LOCATION_ID_DEFAULT && given != ordinal)
            return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,
                               "%s: options->location_id is %d, but device memory of this "
                               "resource lives on device %d; pass -1 or %d",
                               what, given, ordinal, ordinal);
        *id = ordinal;
        return CUBUF_SUCCESS;
    case CUBUF_VMM_LOCATION_HOST_NUMA:
        if (given < CUBUF_VMM_LOCATION_ID_DEFAULT)
            return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,
                               "%s: options->location_id is %d, not a NUMA node (or -1 for the "
                               "node closest to the device)",
                               what, given);
        if (given == CUBUF_VMM_LOCATION_ID_DEFAULT) {
            /* A driver that cannot tell, like a system without NUMA (-1),
             * gets node 0, which is what the driver then expects. */
            int node = -1;
            if (CU_CALL(cuDeviceGetAttribute, &node, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, dev) !=
                CUDA_SUCCESS)
                node = -1;
            given = node < 0 ? 0 : node;
        }
        *id = given;
        return CUBUF_SUCCESS;
    case CUBUF_VMM_LOCATION_HOST:
    case CUBUF_VMM_LOCATION_HOST_NUMA_CURRENT:
        if (given != CUBUF_VMM_LOCATION_ID_DEFAULT)
            return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,
                               "%s: options->location_id is %d, but the %s location takes no id; "
                               "pass -1",
                               what, given, location_name(o->location));
        *id = CUBUF_VMM_LOCATION_ID_DEFAULT;
        return CUBUF_SUCCESS;
    }
    return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT, "%s: bad location", what);
}

static cubuf_status_t check_peers(const vmm_res_t *vr, const cubuf_vmm_options_t *o, const char *what)
{
    if (o->peer_count == 0) return CUBUF_SUCCESS;
    int n = 0;
    cubuf_status_t st = CU(cuDeviceGetCount, &n);
    if (st != CUBUF_SUCCESS) return st;
    for (unsigned i = 0; i < o->peer_count; i++) {
        int p = o->peers[i];
        if (p < 0 || p >= n)
            return cubuf__fail(CUBUF_ERROR_OUT_OF_RANGE,
                               "%s: options->peers[%u] is %d, not a device: valid ordinals are 0 "
                               "to %d",
                               what, i, p, n - 1);
        if (p == vr->ordinal)
            return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,
                               "%s: options->peers[%u] is the resource's own device %d, whose "
                               "access is options->owner_access",
                               what, i, p);
        for (unsigned j = 0; j < i; j++)
            if (o->peers[j] == p)
                return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,
                                   "%s: options->peers names device %d twice", what, p);
        /* Host memory is reachable from every device; device memory needs
         * peer access. */
        if (is_host_location(vr->opts.location)) continue;
        CUdevice pd;
        int can = 0;
        if ((st = CU(cuDeviceGet, &pd, p)) != CUBUF_SUCCESS) return st;
        if ((st = CU(cuDeviceCanAccessPeer, &can, pd, vr->device)) != CUBUF_SUCCESS) return st;
        if (!can)
            return cubuf__fail(CUBUF_ERROR_NOT_SUPPORTED,
                               "%s: device %d cannot access the memory of device %d "
                               "(options->peers[%u])",
                               what, p, vr->ordinal, i);
    }
    return CUBUF_SUCCESS;
}

static CUmemAccess_flags access_flags(cubuf_vmm_access_t a)
{
    return a == CUBUF_VMM_ACCESS_READ ? CU_MEM_ACCESS_FLAGS_PROT_READ
                                      : CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
}

/* The access entries for memory made with `o`: the CPU for host memory, the
 * owning device, then the peers. Zeroed first, so profiles compare with memcmp. */
static void build_access(const vmm_res_t *vr, const cubuf_vmm_options_t *o, vmm_access_t *a)
{
    memset(a, 0, sizeof *a);
    switch (vr->opts.location) {
    case CUBUF_VMM_LOCATION_DEVICE: break;
    case CUBUF_VMM_LOCATION_HOST:
        a->desc[a->count].location.type = CU_MEM_LOCATION_TYPE_HOST;
        a->desc[a->count++].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        break;
    case CUBUF_VMM_LOCATION_HOST_NUMA:
    case CUBUF_VMM_LOCATION_HOST_NUMA_CURRENT:
        /* The id of a HOST_NUMA access entry is ignored by the driver. */
        a->desc[a->count].location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
        a->desc[a->count].location.id = vr->opts.location_id < 0 ? 0 : vr->opts.location_id;
        a->desc[a->count++].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        break;
    }
    if (o->owner_access != CUBUF_VMM_ACCESS_NONE) {
        a->desc[a->count].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        a->desc[a->count].location.id = vr->ordinal;
        a->desc[a->count++].flags = access_flags(o->owner_access);
    }
    if (o->peer_access != CUBUF_VMM_ACCESS_NONE) {
        for (unsigned i = 0; i < o->peer_count; i++) {
            a->desc[a->count].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
            a->desc[a->count].location.id = o->peers[i];
            a->desc[a->count++].flags = access_flags(o->peer_access);
        }
    }
}

/* The properties of a new physical allocation. */
static void fill_prop(const vmm_res_t *vr, bool rdma, CUmemAllocationProp *prop)
{
    const cubuf_vmm_options_t *o = &vr->opts;
    memset(prop, 0, sizeof *prop);
    prop->type = o->allocation_type == CUBUF_VMM_ALLOCATION_MANAGED ? CU_MEM_ALLOCATION_TYPE_MANAGED
                                                                     : CU_MEM_ALLOCATION_TYPE_PINNED;
    switch (o->handle_type) {
    case CUBUF_VMM_HANDLE_NONE: prop->requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE; break;
    case CUBUF_VMM_HANDLE_POSIX_FD:
        prop->requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        break;
    case CUBUF_VMM_HANDLE_FABRIC: prop->requestedHandleTypes = CU_MEM_HANDLE_TYPE_FABRIC; break;
    }
    switch (o->location) {
    case CUBUF_VMM_LOCATION_DEVICE:
        prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop->location.id = vr->ordinal;
        break;
    case CUBUF_VMM_LOCATION_HOST:
        prop->location.type = CU_MEM_LOCATION_TYPE_HOST; /* id ignored */
        break;
    case CUBUF_VMM_LOCATION_HOST_NUMA:
        prop->location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
        prop->location.id = o->location_id;
        break;
    case CUBUF_VMM_LOCATION_HOST_NUMA_CURRENT:
        /* cuMemCreate refuses HOST_NUMA_CURRENT: name the node ourselves. */
        prop->location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
        prop->location.id = current_numa_node();
        break;
    }
    prop->allocFlags.gpuDirectRDMACapable = rdma ? 1 : 0;
}

/* Validates the options of a grow against the resource: what must stay the
 * resource's, and the rest as at creation. */
static cubuf_status_t grow_options(const vmm_res_t *vr, const cubuf_vmm_options_t *given,
                                   cubuf_vmm_options_t *o, const char *what)
{
    if (!given) {
        *o = vr->opts;
        o->address_hint = 0; /* the resource's hint is for its first reservations */
        return CUBUF_SUCCESS;
    }
    cubuf_status_t st = check_shape(given, what);
    if (st != CUBUF_SUCCESS) return st;
    memcpy(o, given, sizeof *o);
    o->struct_size = sizeof *o;
#define CUBUF_VMM_SAME_(field)                                                             \
    if (o->field != vr->opts.field)                                                        \
        return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,                                   \
                           "%s: options->" #field " (%d) differs from the resource's (%d); " \
                           "a range keeps one " #field,                                    \
                           what, (int)o->field, (int)vr->opts.field);
    CUBUF_VMM_SAME_(allocation_type)
    CUBUF_VMM_SAME_(location)
    CUBUF_VMM_SAME_(handle_type)
    CUBUF_VMM_SAME_(granularity)
#undef CUBUF_VMM_SAME_
    int id = 0;
    if ((st = resolve_location_id(vr->device, vr->ordinal, o, &id, what)) != CUBUF_SUCCESS) return st;
    if (id != vr->opts.location_id)
        return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,
                           "%s: options->location_id names NUMA node %d, the resource's memory is "
                           "on node %d",
                           what, id, vr->opts.location_id);
    o->location_id = id;
    if (o->gpu_direct_rdma && !vr->rdma_supported)
        return cubuf__fail(CUBUF_ERROR_NOT_SUPPORTED,
                           "%s: device %d does not support GPUDirect RDMA with virtual memory "
                           "(options->gpu_direct_rdma)",
                           what, vr->ordinal);
    if ((st = check_peers(vr, o, what)) != CUBUF_SUCCESS) return st;
    if (o->address_hint % vr->gran)
        return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,
                           "%s: options->address_hint 0x%llx is not a multiple of the %zu-byte "
                           "granularity",
                           what, (unsigned long long)o->address_hint, vr->gran);
    if (o->address_alignment < vr->gran) o->address_alignment = vr->gran;
    return CUBUF_SUCCESS;
}

/* ---- the resource ---------------------------------------------------------- */

static cubuf_status_t vmm_allocate(cubuf_resource_t *res, cubuf_buffer_t *buf, CUstream stream);
static cubuf_status_t vmm_deallocate(cubuf_resource_t *res, cubuf_buffer_t *buf,
                                     const cubuf_stream_token_t *token);
static void vmm_destroy(cubuf_resource_t *res) { free(res->impl); }

static const cubuf_resource_vtbl_t vmm_vtbl = {vmm_allocate, vmm_deallocate, vmm_destroy, true};

static const vmm_res_t *vmm_of(const cubuf_resource_t *res)
{
    return res && res->kind == CUBUF_RES_VMM && res->vt == &vmm_vtbl ? res->impl : NULL;
}

static cubuf_status_t query_granularity(vmm_res_t *vr, const char *what)
{
    CUmemAllocationProp prop;
    fill_prop(vr, vr->opts.gpu_direct_rdma, &prop);
    CUmemAllocationGranularity_flags flag = vr->opts.granularity == CUBUF_VMM_GRANULARITY_MINIMUM
                                                ? CU_MEM_ALLOC_GRANULARITY_MINIMUM
                                                : CU_MEM_ALLOC_GRANULARITY_RECOMMENDED;
    size_t gran = 0;
    cubuf_status_t st = CU(cuMemGetAllocationGranularity, &gran, &prop, flag);
    if (st != CUBUF_SUCCESS) return st;
    if (gran == 0 || (gran & (gran - 1)))
        return cubuf__fail(CUBUF_ERROR_DRIVER, "%s: the driver reports a granularity of %zu bytes",
                           what, gran);
    vr->gran = gran;
    return CUBUF_SUCCESS;
}

/* Some memory kinds depend on more than a device attribute says (managed
 * memory through cuMemCreate is new in CUDA 13, fabric handles need an IMEX
 * channel, host memory and its CPU access need the driver's support): making,
 * mapping and granting access to one granule now turns a refusal into a
 * clear CUBUF_ERROR_NOT_SUPPORTED at creation instead of a failed allocation. */
static cubuf_status_t probe(const vmm_res_t *vr, const char *what)
{
    const cubuf_vmm_options_t *o = &vr->opts;
    const char *kind = NULL;
    if (o->allocation_type == CUBUF_VMM_ALLOCATION_MANAGED)
        kind = "managed memory";
    else if (o->handle_type == CUBUF_VMM_HANDLE_FABRIC)
        kind = "memory with fabric handles";
    else if (is_host_location(o->location))
        kind = "host memory";
    if (!kind) return CUBUF_SUCCESS;
    CUmemAllocationProp prop;
    fill_prop(vr, o->gpu_direct_rdma, &prop);
    CUmemGenericAllocationHandle h = 0;
    CUdeviceptr va = 0;
    size_t g = vr->gran;
    bool created = false, reserved = false, mapped = false;
    const char *call = "cuMemCreate";
    CUresult r = CU_CALL(cuMemCreate, &h, g, &prop, 0);
    if (r == CUDA_SUCCESS) {
        created = true;
        atomic_fetch_add(&live_phys, 1);
        call = "cuMemAddressReserve";
        r = CU_CALL(cuMemAddressReserve, &va, g, g, 0, 0);
    }
    if (r == CUDA_SUCCESS) {
        reserved = true;
        atomic_fetch_add(&live_resv, 1);
        call = "cuMemMap";
        r = CU_CALL(cuMemMap, va, g, 0, h, 0);
    }
    if (r == CUDA_SUCCESS) {
        mapped = true;
        atomic_fetch_add(&live_maps, 1);
        call = "cuMemSetAccess";
        if (vr->access.count) r = CU_CALL(cuMemSetAccess, va, g, vr->access.desc, vr->access.count);
    }
    if (mapped) unmap_quiet(va, g);
    if (reserved) va_free_quiet(va, g);
    if (created) release_quiet(h, g);
    if (r == CUDA_SUCCESS) return CUBUF_SUCCESS;
    cubuf_status_t st = cubuf__cu_status(r, call);
    if (st == CUBUF_ERROR_OUT_OF_MEMORY) return st;
    return cubuf__fail(CUBUF_ERROR_NOT_SUPPORTED,
                       "%s: the driver refuses %s at the %s location for device %d: %s", what, kind,
                       location_name(o->location), vr->ordinal, cubuf_last_error());
}

cubuf_status_t cubuf_vmm_resource_create(int ordinal, const cubuf_vmm_options_t *options,
                                         cubuf_resource_t **out)
{
    static const char what[] = "cubuf_vmm_resource_create";
    CHECK_ARG(out, "%s: out is NULL", what);
    cubuf_vmm_options_t o = CUBUF_VMM_OPTIONS_INIT;
    cubuf_status_t st;
    if (options) {
        if ((st = check_shape(options, what)) != CUBUF_SUCCESS) return st;
        memcpy(&o, options, sizeof o);
        o.struct_size = sizeof o;
    }
    cubuf_context_t *ctx = NULL;
    cubuf_resource_t *res = NULL;
    vmm_res_t *vr = NULL;
    cubuf_ctx_guard_t g = {false};
    bool pushed = false;
    CHECK(cubuf__context_for_device(ordinal, &ctx));
    vr = calloc(1, sizeof *vr);
    if (!vr) {
        st = cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "%s: out of host memory", what);
        goto fail;
    }
    vr->opts = o;
    vr->device = ctx->device;
    vr->ordinal = ordinal;
    CHECK(check_support(vr, what));
    CHECK(resolve_location_id(vr->device, ordinal, &o, &vr->opts.location_id, what));
    CHECK(check_peers(vr, &vr->opts, what));
    CHECK(cubuf__ctx_push(ctx->handle, &g));
    pushed = true;
    CHECK(query_granularity(vr, what));
    if (vr->opts.address_hint % vr->gran) {
        st = cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,
                         "%s: options->address_hint 0x%llx is not a multiple of the %zu-byte "
                         "granularity",
                         what, (unsigned long long)vr->opts.address_hint, vr->gran);
        goto fail;
    }
    if (vr->opts.address_alignment < vr->gran) vr->opts.address_alignment = vr->gran;
    build_access(vr, &vr->opts, &vr->access);
    CHECK(probe(vr, what));
    cubuf__ctx_pop(&g);
    pushed = false;
    CHECK(cubuf__resource_new(&vmm_vtbl, CUBUF_RES_VMM, ctx, &res));
    ctx = NULL; /* the resource holds it now */
    res->impl = vr;
    bool host = is_host_location(vr->opts.location);
    bool managed = vr->opts.allocation_type == CUBUF_VMM_ALLOCATION_MANAGED;
    res->props.device_id = host ? -1 : ordinal;
    res->props.device_accessible = vr->opts.owner_access != CUBUF_VMM_ACCESS_NONE;
    res->props.host_accessible = host || managed;
    res->props.managed = managed;
    res->props.ipc_enabled = vr->opts.handle_type != CUBUF_VMM_HANDLE_NONE;
    *out = res;
    return CUBUF_SUCCESS;
fail:
    if (pushed) cubuf__ctx_pop(&g);
    free(vr);
    cubuf__context_release(ctx);
    return st;
}

cubuf_status_t cubuf_vmm_granularity(const cubuf_resource_t *res, size_t *granularity)
{
    CHECK_ARG(res && granularity, "cubuf_vmm_granularity: NULL argument");
    const vmm_res_t *vr = vmm_of(res);
    CHECK_ARG(vr, "cubuf_vmm_granularity: the resource is not a virtual memory resource");
    *granularity = vr->gran;
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf_vmm_resource_options(const cubuf_resource_t *res, cubuf_vmm_options_t *options)
{
    CHECK_ARG(res && options, "cubuf_vmm_resource_options: NULL argument");
    CHECK_ARG(options->struct_size >= sizeof *options,
              "cubuf_vmm_resource_options: options->struct_size is %zu; use CUBUF_VMM_OPTIONS_INIT",
              options->struct_size);
    const vmm_res_t *vr = vmm_of(res);
    CHECK_ARG(vr, "cubuf_vmm_resource_options: the resource is not a virtual memory resource");
    *options = vr->opts;
    return CUBUF_SUCCESS;
}

CUmemAllocationHandleType cubuf__vmm_handle_type(const cubuf_resource_t *res)
{
    const vmm_res_t *vr = vmm_of(res);
    if (!vr) return CU_MEM_HANDLE_TYPE_NONE;
    switch (vr->opts.handle_type) {
    case CUBUF_VMM_HANDLE_POSIX_FD: return CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    case CUBUF_VMM_HANDLE_FABRIC: return CU_MEM_HANDLE_TYPE_FABRIC;
    case CUBUF_VMM_HANDLE_NONE: break;
    }
    return CU_MEM_HANDLE_TYPE_NONE;
}

size_t cubuf__vmm_granularity(const cubuf_resource_t *res)
{
    const vmm_res_t *vr = vmm_of(res);
    return vr ? vr->gran : 0;
}

/* ---- ranges, spaces, members ------------------------------------------------ */

static vmm_range_t *range_new(const vmm_access_t *first)
{
    vmm_range_t *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    r->access = malloc(sizeof *r->access);
    if (!r->access || pthread_mutex_init(&r->lock, NULL) != 0) {
        free(r->access);
        free(r);
        return NULL;
    }
    r->access[0] = *first;
    r->naccess = r->cap_access = 1;
    return r;
}

static void range_free(vmm_range_t *r)
{
    if (!r) return;
    pthread_mutex_destroy(&r->lock);
    free(r->access);
    free(r);
}

/* The index of an access profile in the range, added if new. */
static cubuf_status_t range_access_index(vmm_range_t *r, const vmm_access_t *a, unsigned *index)
{
    for (unsigned i = 0; i < r->naccess; i++)
        if (memcmp(&r->access[i], a, sizeof *a) == 0) {
            *index = i;
            return CUBUF_SUCCESS;
        }
    size_t cap = r->cap_access;
    vmm_access_t *p = ensure_cap(r->access, &cap, (size_t)r->naccess + 1, sizeof *p);
    if (!p) return cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "out of host memory for an access profile");
    r->access = p;
    r->cap_access = (unsigned)cap;
    r->access[r->naccess] = *a;
    *index = r->naccess++;
    return CUBUF_SUCCESS;
}

static void range_link(vmm_range_t *r, vmm_member_t *m)
{
    m->range = r;
    m->prev = NULL;
    m->next = r->members;
    if (r->members) r->members->prev = m;
    r->members = m;
    r->nmembers++;
}

static void range_unlink(vmm_range_t *r, vmm_member_t *m)
{
    if (m->prev) m->prev->next = m->next;
    else r->members = m->next;
    if (m->next) m->next->prev = m->prev;
    r->nmembers--;
}

/* A space with room for `maps` mappings and `resv` reservations. */
static vmm_space_t *space_new(size_t maps, size_t resv)
{
    vmm_space_t *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->maps = ensure_cap(NULL, &s->cap_maps, maps, sizeof *s->maps);
    s->resv = ensure_cap(NULL, &s->cap_resv, resv, sizeof *s->resv);
    if (!s->maps || !s->resv) {
        free(s->maps);
        free(s->resv);
        free(s);
        return NULL;
    }
    return s;
}

static void space_free(vmm_space_t *s)
{
    if (!s) return;
    free(s->maps);
    free(s->resv);
    free(s);
}

/* Makes room for `maps` more mappings and `resv` more reservations. */
static bool space_make_room(vmm_space_t *s, size_t maps, size_t resv)
{
    vmm_mapping_t *m = ensure_cap(s->maps, &s->cap_maps, s->nmaps + maps, sizeof *m);
    if (!m) return false;
    s->maps = m;
    vmm_resv_t *r = ensure_cap(s->resv, &s->cap_resv, s->nresv + resv, sizeof *r);
    if (!r) return false;
    s->resv = r;
    return true;
}

/* ---- allocate ---------------------------------------------------------------- */

/* A new range of `size` bytes (rounded up) whose first member is buf. */
static cubuf_status_t range_create(cubuf_resource_t *res, const cubuf_vmm_options_t *o, size_t size,
                                   cubuf_buffer_t *buf, const char *what)
{
    const vmm_res_t *vr = res->impl;
    size_t total;
    if (!round_up(size, vr->gran, &total))
        return cubuf__fail(CUBUF_ERROR_OUT_OF_RANGE,
                           "%s: %zu bytes rounded up to the %zu-byte granularity do not fit in "
                           "size_t",
                           what, size, vr->gran);
    vmm_access_t access;
    build_access(vr, o, &access);
    CUmemAllocationProp prop;
    fill_prop(vr, o->gpu_direct_rdma, &prop);
    size_t rsize = reserve_target(total, vr->gran);

    cubuf_status_t st;
    vmm_range_t *r = range_new(&access);
    vmm_space_t *s = space_new(1, 1);
    vmm_member_t *m = calloc(1, sizeof *m);
    vmm_phys_t *p = calloc(1, sizeof *p);
    vmm_guard_t g;
    bool entered = false, reserved = false, created = false, mapped = false;
    CUdeviceptr va = 0;
    if (!r || !s || !m || !p) {
        st = cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "%s: out of host memory", what);
        goto fail;
    }
    CHECK(guard_enter(res, &g));
    entered = true;
    CHECK(va_reserve(&va, rsize, o->address_alignment, o->address_hint));
    reserved = true;
    p->size = total;
    CHECK(phys_create(&p->handle, total, &prop));
    created = true;
    CHECK(map_phys(va, p));
    mapped = true;
    CHECK(set_access(va, total, &access));
    guard_exit(&g);

    p->maps = 1;
    p->access = 0;
    s->base = va;
    s->resv[0] = (vmm_resv_t){0, rsize};
    s->nresv = 1;
    s->reserved = rsize;
    s->maps[0] = (vmm_mapping_t){0, p, 1};
    s->nmaps = 1;
    s->mapped = total;
    s->buffers = 1;
    m->space = s;
    m->count = 1;
    m->buf = buf;
    range_link(r, m);
    cubuf__stats_add(res, total);
    buf->ptr = va;
    buf->size = total;
    buf->impl = m;
    return CUBUF_SUCCESS;
fail:
    if (mapped) unmap_quiet(va, total);
    if (created) release_quiet(p->handle, total);
    if (reserved) va_free_quiet(va, rsize);
    if (entered) guard_exit(&g);
    free(p);
    free(m);
    space_free(s);
    range_free(r);
    return st;
}

static cubuf_status_t vmm_allocate(cubuf_resource_t *res, cubuf_buffer_t *buf, CUstream stream)
{
    (void)stream; /* virtual memory operations are synchronous */
    const vmm_res_t *vr = res->impl;
    return range_create(res, &vr->opts, buf->size, buf, "allocating virtual memory");
}

/* ---- grow ---------------------------------------------------------------------- */

typedef struct vmm_piece {
    size_t offset; /* from the space's base */
    size_t size;
    vmm_phys_t *phys;
} vmm_piece_t;

/* What one grow needs, gathered before any driver call. */
typedef struct vmm_grow {
    cubuf_resource_t *res;
    const vmm_res_t *vr;
    vmm_range_t *range;
    vmm_member_t *from; /* the buffer grown */
    vmm_member_t *to;   /* the new buffer's membership */
    size_t cur, want;   /* bytes: covered by `from`, and by the new buffer */
    CUmemAllocationProp prop;
    unsigned access; /* profile of the new part */
    const cubuf_vmm_options_t *o;
    CUdeviceptr move_hint;
} vmm_grow_t;

static void free_pieces(vmm_piece_t *pieces, size_t n)
{
    for (size_t i = 0; i < n; i++) free(pieces[i].phys);
    free(pieces);
}

/* Grows into the addresses right after `from`: the space's own reservations
 * first, then a reservation requested right at the space's end. Sets *must_move
 * (and does nothing) when those addresses are taken: then the range moves. */
static cubuf_status_t grow_in_place(vmm_grow_t *gr, bool *must_move)
{
    vmm_space_t *s = gr->from->space;
    *must_move = false;
    if (gr->from->count != s->nmaps) { /* another alias maps right after us */
        *must_move = true;
        return CUBUF_SUCCESS;
    }
    size_t start = s->mapped, end = gr->want;
    /* The reservation holding `start`, counted from the end: a space has a
     * few reservations (each at least doubles it), so this is short. */
    size_t ri = s->nresv;
    while (ri > 0 && s->resv[ri - 1].offset + s->resv[ri - 1].size > start) ri--;
    size_t cap = s->nresv - ri + 1;
    vmm_piece_t *pieces = calloc(cap, sizeof *pieces);
    if (!pieces) return cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "out of host memory");
    size_t np = 0, pos = start;
    for (size_t i = ri; i < s->nresv && pos < end; i++) {
        size_t rend = s->resv[i].offset + s->resv[i].size;
        size_t stop = rend < end ? rend : end;
        pieces[np++] = (vmm_piece_t){pos, stop - pos, NULL};
        pos = stop;
    }
    bool extend = pos < end;
    size_t npieces = np + (extend ? 1 : 0);
    cubuf_status_t st = CUBUF_SUCCESS;
    vmm_guard_t g;
    bool entered = false;
    CUdeviceptr ext_va = 0;
    size_t ext_size = 0, created = 0, mapped = 0;
    for (size_t i = 0; i < npieces; i++)
        if (!(pieces[i].phys = calloc(1, sizeof *pieces[i].phys))) {
            st = cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "out of host memory");
            goto fail;
        }
    if (!space_make_room(s, npieces, extend ? 1 : 0)) {
        st = cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "out of host memory");
        goto fail;
    }
    CHECK(guard_enter(gr->res, &g));
    entered = true;
    if (extend) {
        CUdeviceptr hint = s->base + s->reserved;
        ext_size = reserve_target(end, gr->vr->gran) - s->reserved;
        CHECK(va_reserve(&ext_va, ext_size, gr->vr->gran, hint));
        if (ext_va != hint) { /* granted elsewhere: give it back and move */
            va_free_quiet(ext_va, ext_size);
            guard_exit(&g);
            free_pieces(pieces, npieces);
            *must_move = true;
            return CUBUF_SUCCESS;
        }
        pieces[np].offset = pos;
        pieces[np].size = end - pos;
        np++;
    }
    const vmm_access_t *a = &gr->range->access[gr->access];
    for (size_t i = 0; i < npieces; i++) {
        vmm_phys_t *p = pieces[i].phys;
        CUdeviceptr va = s->base + pieces[i].offset;
        p->size = pieces[i].size;
        CHECK(phys_create(&p->handle, p->size, &gr->prop));
        created++;
        CHECK(map_phys(va, p));
        mapped++;
        /* Access for the new mapping only: the cost follows the new part. */
        CHECK(set_access(va, p->size, a));
    }
    guard_exit(&g);

    if (extend) {
        s->resv[s->nresv++] = (vmm_resv_t){s->reserved, ext_size};
        s->reserved += ext_size;
    }
    for (size_t i = 0; i < npieces; i++) {
        vmm_phys_t *p = pieces[i].phys;
        p->maps = 1;
        p->access = gr->access;
        s->maps[s->nmaps++] = (vmm_mapping_t){pieces[i].offset, p, 0};
        cubuf__stats_add(gr->res, p->size);
    }
    s->maps[s->nmaps - 1].ends = 1;
    s->mapped = end;
    s->buffers++;
    gr->to->space = s;
    gr->to->count = s->nmaps;
    free(pieces); /* the allocations now belong to the space */
    return CUBUF_SUCCESS;
fail:
    while (mapped > 0) {
        mapped--;
        unmap_quiet(s->base + pieces[mapped].offset, pieces[mapped].size);
    }
    while (created > 0) {
        created--;
        release_quiet(pieces[created].phys->handle, pieces[created].size);
    }
    if (ext_va) va_free_quiet(ext_va, ext_size);
    if (entered) guard_exit(&g);
    free_pieces(pieces, npieces);
    return st;
}

/* Reserves a larger range elsewhere and maps every physical allocation of
 * `from` into it, then the new part; `from` keeps its own mapping. */
static cubuf_status_t grow_moving(vmm_grow_t *gr)
{
    const vmm_space_t *old = gr->from->space;
    size_t c = gr->from->count, extra = gr->want - gr->cur;
    size_t rsize = reserve_target(gr->want, gr->vr->gran);
    cubuf_status_t st = CUBUF_SUCCESS;
    vmm_space_t *ns = space_new(c + 1, 1);
    vmm_phys_t *np = calloc(1, sizeof *np);
    vmm_guard_t g;
    bool entered = false, created = false, mapped_new = false;
    size_t mapped = 0;
    CUdeviceptr base = 0;
    if (!ns || !np) {
        st = cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "out of host memory");
        goto fail;
    }
    CHECK(guard_enter(gr->res, &g));
    entered = true;
    CHECK(va_reserve(&base, rsize, gr->o->address_alignment, gr->move_hint));
    for (; mapped < c; mapped++)
        CHECK(map_phys(base + old->maps[mapped].offset, old->maps[mapped].phys));
    np->size = extra;
    CHECK(phys_create(&np->handle, extra, &gr->prop));
    created = true;
    CHECK(map_phys(base + gr->cur, np));
    mapped_new = true;
    /* Access on the whole new range, one call per run of allocations that
     * share an access profile (one call unless grows used other options).
     * Entries 0..c-1 are the old allocations, entry c the new one. */
    np->access = gr->access;
    for (size_t i = 0; i <= c;) {
        unsigned prof = i < c ? old->maps[i].phys->access : np->access;
        size_t j = i + 1;
        while (j <= c && (j < c ? old->maps[j].phys->access : np->access) == prof) j++;
        size_t off = i < c ? old->maps[i].offset : gr->cur;
        size_t stop = j < c ? old->maps[j].offset : j == c ? gr->cur : gr->want;
        CHECK(set_access(base + off, stop - off, &gr->range->access[prof]));
        i = j;
    }
    guard_exit(&g);

    for (size_t i = 0; i < c; i++) {
        old->maps[i].phys->maps++;
        ns->maps[i] = (vmm_mapping_t){old->maps[i].offset, old->maps[i].phys, 0};
    }
    np->maps = 1;
    ns->maps[c] = (vmm_mapping_t){gr->cur, np, 1};
    ns->nmaps = c + 1;
    ns->mapped = gr->want;
    ns->base = base;
    ns->resv[0] = (vmm_resv_t){0, rsize};
    ns->nresv = 1;
    ns->reserved = rsize;
    ns->buffers = 1;
    cubuf__stats_add(gr->res, extra);
    gr->to->space = ns;
    gr->to->count = c + 1;
    return CUBUF_SUCCESS;
fail:
    if (mapped_new) unmap_quiet(base + gr->cur, extra);
    if (created) release_quiet(np->handle, extra);
    while (mapped > 0) {
        mapped--;
        unmap_quiet(base + old->maps[mapped].offset, old->maps[mapped].phys->size);
    }
    if (base) va_free_quiet(base, rsize);
    if (entered) guard_exit(&g);
    free(np);
    space_free(ns);
    return st;
}

/* The new buffer `nb` over `from`'s range: an alias, a grow in place or a
 * grow that moves. */
static cubuf_status_t grow_member(cubuf_resource_t *res, vmm_member_t *from, size_t cur,
                                  size_t new_size, const cubuf_vmm_options_t *o, CUdeviceptr move_hint,
                                  cubuf_buffer_t *nb, const char *what)
{
    const vmm_res_t *vr = res->impl;
    size_t want;
    if (!round_up(new_size, vr->gran, &want))
        return cubuf__fail(CUBUF_ERROR_OUT_OF_RANGE,
                           "%s: %zu bytes rounded up to the %zu-byte granularity do not fit in "
                           "size_t",
                           what, new_size, vr->gran);
    vmm_member_t *to = calloc(1, sizeof *to);
    if (!to) return cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "%s: out of host memory", what);
    vmm_range_t *r = from->range;
    cubuf_status_t st = CUBUF_SUCCESS;
    pthread_mutex_lock(&r->lock);
    if (want <= cur) {
        /* Within the buffer: the same mappings again, no driver call. */
        to->space = from->space;
        to->count = from->count;
        from->space->maps[from->count - 1].ends++;
        from->space->buffers++;
        want = cur;
    } else {
        vmm_grow_t gr = {.res = res, .vr = vr, .range = r, .from = from, .to = to, .cur = cur,
                         .want = want, .o = o, .move_hint = move_hint};
        vmm_access_t access;
        build_access(vr, o, &access);
        fill_prop(vr, o->gpu_direct_rdma, &gr.prop);
        bool must_move = false;
        CHECK(range_access_index(r, &access, &gr.access));
        CHECK(grow_in_place(&gr, &must_move));
        if (must_move) CHECK(grow_moving(&gr));
    }
    to->buf = nb;
    range_link(r, to);
    pthread_mutex_unlock(&r->lock);
    nb->ptr = to->space->base;
    nb->size = want;
    nb->impl = to;
    return CUBUF_SUCCESS;
fail:
    pthread_mutex_unlock(&r->lock);
    free(to);
    return st;
}

cubuf_status_t cubuf_vmm_modify_allocation(cubuf_resource_t *res, cubuf_buffer_t *buf,
                                           size_t new_size, const cubuf_vmm_options_t *options,
                                           cubuf_buffer_t **out)
{
    static const char what[] = "cubuf_vmm_modify_allocation";
    CHECK_ARG(res && buf && out, "%s: NULL argument", what);
    const vmm_res_t *vr = vmm_of(res);
    CHECK_ARG(vr, "%s: the resource is not a virtual memory resource", what);
    cubuf_status_t st = cubuf__buffer_check_open(buf, what);
    if (st != CUBUF_SUCCESS) return st;
    CHECK_ARG(buf->resource == res, "%s: the buffer was not made by this resource", what);
    CHECK_ARG(buf->impl || buf->size == 0,
              "%s: the buffer wraps memory this resource did not allocate (cubuf_buffer_wrap)",
              what);
    cubuf_vmm_options_t o;
    if ((st = grow_options(vr, options, &o, what)) != CUBUF_SUCCESS) return st;
    cubuf_buffer_t *nb = NULL;
    if ((st = cubuf__buffer_new(&nb)) != CUBUF_SUCCESS) return st;
    cubuf__buffer_take_props(nb, res);
    nb->dealloc = buf->dealloc;
    vmm_member_t *from = buf->impl;
    if (!from) {
        /* Growing an empty buffer is a fresh allocation (the hint applies). */
        if (new_size) {
            if (!options) o.address_hint = vr->opts.address_hint;
            CHECK(range_create(res, &o, new_size, nb, what));
        }
    } else {
        CHECK(grow_member(res, from, buf->size, new_size, &o, o.address_hint, nb, what));
    }
    nb->resource = cubuf_resource_retain(res);
    *out = nb;
    return CUBUF_SUCCESS;
fail:
    cubuf__buffer_discard(nb);
    return st;
}

/* ---- close ------------------------------------------------------------------- */

/* What closing `m` unmaps: space->maps[lo, hi), and whether its space goes. */
static void plan_close(const vmm_member_t *m, size_t *lo, size_t *hi, bool *dies)
{
    const vmm_space_t *s = m->space;
    size_t c = m->count;
    *dies = s->buffers == 1;
    *lo = *hi = c;
    if (*dies) {
        *lo = 0;
        *hi = s->nmaps;
        return;
    }
    if (c != s->nmaps || s->maps[c - 1].ends != 1) return; /* someone still covers our end */
    /* Down to the next end of another buffer of the space; one exists, since
     * the space keeps other buffers and none reaches past us. */
    size_t j = c - 1;
    while (j > 0 && s->maps[j - 1].ends == 0) j--;
    *lo = j;
}

typedef struct vmm_wait {
    cubuf_stream_token_t t;
    bool skip;     /* not synchronized */
    bool captured; /* ... because a capture would be disturbed: warn */
} vmm_wait_t;

static bool same_token(const cubuf_stream_token_t *a, const cubuf_stream_token_t *b)
{
    return a->stream == b->stream && a->ctx == b->ctx;
}

static const char *default_stream_name(CUstream s)
{
    return s == CU_STREAM_PER_THREAD ? "per-thread" : "legacy";
}

/* Checks and synchronizes the streams a close waits for: its own, and when
 * it releases memory those of the other open buffers of the range. Changes
 * nothing: any failure leaves the close undone. */
static cubuf_status_t wait_streams(const vmm_range_t *r, const vmm_member_t *m,
                                   const cubuf_stream_token_t *token, bool releasing,
                                   vmm_wait_t *w, size_t *n, const char *what)
{
    size_t k = 0;
    w[k++] = (vmm_wait_t){*token, false, false};
    if (releasing) {
        for (const vmm_member_t *o = r->members; o; o = o->next) {
            if (o == m) continue;
            const cubuf_stream_token_t *t = &o->buf->dealloc;
            bool dup = false;
            for (size_t i = 0; i < k && !dup; i++) dup = same_token(&w[i].t, t);
            if (!dup) w[k++] = (vmm_wait_t){*t, false, false};
        }
    }
    *n = k;
    cubuf_status_t st;
    for (size_t i = 0; i < k; i++) {
        const cubuf_stream_token_t *t = &w[i].t;
        bool def = cubuf__stream_is_default(t->stream);
        if (def && !t->ctx) {
            w[i].skip = true; /* host-only memory records no context: nothing to wait for */
            continue;
        }
        if (i == 0 && !def) continue; /* checked before the close began */
        CUstreamCaptureStatus cs = CU_STREAM_CAPTURE_STATUS_NONE;
        if ((st = cubuf__stream_capture_status(t->stream, t->ctx, &cs)) != CUBUF_SUCCESS) return st;
        if (cs == CU_STREAM_CAPTURE_STATUS_NONE) continue;
        if (!def)
            return cubuf__fail(CUBUF_ERROR_STREAM_CAPTURING,
                               "%s: another buffer of the same range records a deallocation "
                               "stream that is capturing; unmapping would have to wait for it",
                               what);
        w[i].skip = w[i].captured = true;
    }
    for (size_t i = 0; i < k; i++) {
        if (w[i].skip) continue;
        if ((st = cubuf__stream_sync(&w[i].t)) != CUBUF_SUCCESS) return st;
    }
    return CUBUF_SUCCESS;
}

/* Unmaps space->maps[lo, hi), last first. On failure maps back what it had
 * unmapped (the physical allocations are still held) and returns the error. */
static cubuf_status_t unmap_span(const vmm_range_t *r, vmm_space_t *s, size_t lo, size_t hi)
{
    size_t k = hi;
    cubuf_status_t st = CUBUF_SUCCESS;
    while (k > lo) {
        const vmm_mapping_t *mp = &s->maps[k - 1];
        st = CU(cuMemUnmap, s->base + mp->offset, mp->phys->size);
        if (st != CUBUF_SUCCESS) {
            cubuf__detail_append("unmapping %zu bytes at 0x%llx", mp->phys->size,
                                 (unsigned long long)(s->base + mp->offset));
            break;
        }
        atomic_fetch_sub(&live_maps, 1);
        k--;
    }
    if (k == lo) return CUBUF_SUCCESS;
    for (size_t i = k; i < hi; i++) {
        const vmm_mapping_t *mp = &s->maps[i];
        remap_quiet(s->base + mp->offset, mp->phys, &r->access[mp->phys->access]);
    }
    return st;
}

/* After the unmap: allocations no other mapping holds and, when the space
 * goes, its reservations. */
static void release_span(cubuf_resource_t *res, vmm_space_t *s, size_t lo, size_t hi, bool dies)
{
    for (size_t i = lo; i < hi; i++) {
        vmm_phys_t *p = s->maps[i].phys;
        if (--p->maps > 0) continue;
        release_quiet(p->handle, p->size);
        cubuf__stats_sub(res, p->size);
        free(p);
    }
    if (!dies) return;
    for (size_t i = 0; i < s->nresv; i++) va_free_quiet(s->base + s->resv[i].offset, s->resv[i].size);
}

static void warn_skipped(const vmm_wait_t *w, size_t n, bool releasing, const char *what)
{
    for (size_t i = 0; i < n; i++) {
        if (!w[i].captured) continue;
        cubuf__warn(CUBUF_ERROR_STREAM_CAPTURING,
                    "%s: the %s default stream was not synchronized, because that would "
                    "invalidate a stream capture in its context; %s without waiting for it",
                    what, default_stream_name(w[i].t.stream),
                    releasing ? "unmapped" : "closed");
    }
}

/* A buffer made by cubuf_buffer_wrap over this resource (cuda.core's
 * deallocate): [ptr, ptr+size) is one reservation, fully mapped, whose
 * physical handles the caller released; unmapping frees the memory. */
static cubuf_status_t release_wrapped(cubuf_resource_t *res, cubuf_buffer_t *buf,
                                      const cubuf_stream_token_t *token, const char *what)
{
    cubuf_status_t st;
    bool def = cubuf__stream_is_default(token->stream);
    if (!def && (st = cubuf__stream_refuse_capture(token->stream, NULL, what)) != CUBUF_SUCCESS)
        return st;
    vmm_wait_t w = {*token, false, false};
    size_t n = 0;
    vmm_guard_t g;
    if ((st = guard_enter(res, &g)) != CUBUF_SUCCESS) return st;
    if ((st = wait_streams(NULL, NULL, token, false, &w, &n, what)) == CUBUF_SUCCESS) {
        st = CU(cuMemUnmap, buf->ptr, buf->size);
        if (st == CUBUF_SUCCESS) {
            vmm_span_t s = {buf->ptr, buf->size};
            CUresult r = retry_once(free_va_call(&s), free_va_call, &s);
            if (r != CUDA_SUCCESS)
                cubuf__warn(cubuf__cu_map(r), "%s: cuMemAddressFree failed (CUresult %d)", what,
                            (int)r);
            cubuf__stats_sub(res, buf->size); /* cubuf_buffer_wrap counted it */
        }
    }
    guard_exit(&g);
    warn_skipped(&w, n, true, what);
    return st;
}

static cubuf_status_t close_member(cubuf_resource_t *res, vmm_member_t *m,
                                   const cubuf_stream_token_t *token, const char *what)
{
    cubuf_status_t st;
    /* Refused before anything changes: the buffer stays open. */
    if (!cubuf__stream_is_default(token->stream) &&
        (st = cubuf__stream_refuse_capture(token->stream, NULL, what)) != CUBUF_SUCCESS)
        return st;
    vmm_range_t *r = m->range;
    vmm_space_t *s = m->space;
    vmm_guard_t g;
    if ((st = guard_enter(res, &g)) != CUBUF_SUCCESS) return st;
    pthread_mutex_lock(&r->lock);

    size_t lo, hi, n = 0;
    bool dies;
    plan_close(m, &lo, &hi, &dies);
    bool releasing = hi > lo;
    vmm_wait_t small[8], *w = small;
    if (releasing && r->nmembers > sizeof small / sizeof small[0] &&
        !(w = malloc(r->nmembers * sizeof *w))) {
        st = cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "%s: out of host memory", what);
        w = small;
        goto out;
    }
    if ((st = wait_streams(r, m, token, releasing, w, &n, what)) != CUBUF_SUCCESS) goto out;
    if (releasing) {
        if ((st = unmap_span(r, s, lo, hi)) != CUBUF_SUCCESS) goto out;
        /* The close is done from here on: nothing below can fail it. */
        release_span(res, s, lo, hi, dies);
    }
    if (dies) {
        space_free(s);
    } else {
        if (releasing) {
            s->nmaps = lo;
            s->mapped = s->maps[lo].offset;
        } else {
            s->maps[m->count - 1].ends--;
        }
        s->buffers--;
    }
    range_unlink(r, m);
out:;
    bool last = st == CUBUF_SUCCESS && r->nmembers == 0;
    pthread_mutex_unlock(&r->lock);
    guard_exit(&g);
    if (st == CUBUF_SUCCESS) warn_skipped(w, n, releasing, what);
    if (w != small) free(w);
    if (st != CUBUF_SUCCESS) return st;
    if (last) range_free(r);
    free(m);
    return CUBUF_SUCCESS;
}

/* The last reference of a buffer whose close failed is going away
 * (cubuf_buffer_release warns that its memory is lost): its membership must
 * not outlive it. Mappings other buffers cover are theirs to release; a
 * space only it held keeps its mappings, since nothing can wait for its
 * stream now. */
static void forget_member(vmm_member_t *m)
{
    vmm_range_t *r = m->range;
    vmm_space_t *s = m->space;
    pthread_mutex_lock(&r->lock);
    if (--s->buffers > 0) s->maps[m->count - 1].ends--;
    range_unlink(r, m);
    bool last = r->nmembers == 0;
    pthread_mutex_unlock(&r->lock);
    if (last) range_free(r);
    free(m);
}

static cubuf_status_t vmm_deallocate(cubuf_resource_t *res, cubuf_buffer_t *buf,
                                     const cubuf_stream_token_t *token)
{
    static const char what[] = "closing a virtual memory buffer";
    vmm_member_t *m = buf->impl;
    if (!m) return release_wrapped(res, buf, token, what);
    cubuf_status_t st = close_member(res, m, token, what);
    if (st != CUBUF_SUCCESS && atomic_load(&buf->refs) == 0) forget_member(m);
    return st;
}

/* ---- queries for IPC and tests ---------------------------------------------------- */

/* The VMM buffer a buffer or slice lives in, checked open. */
static cubuf_status_t root_of(const cubuf_buffer_t *buf, const cubuf_buffer_t **root, const char *what)
{
    CHECK_ARG(buf, "%s: buf is NULL", what);
    const cubuf_buffer_t *b = buf;
    while (b->parent) b = b->parent;
    if (buf->closed || b->closed)
        return cubuf__fail(CUBUF_ERROR_CLOSED, "%s: the buffer is closed", what);
    CHECK_ARG(vmm_of(b->resource) && (b->impl || b->size == 0),
              "%s: not a buffer made by a virtual memory resource", what);
    *root = b;
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf__vmm_chunks(const cubuf_buffer_t *buf, cubuf_vmm_chunk_t **chunks, size_t *count,
                                 size_t *first_offset)
{
    static const char what[] = "cubuf__vmm_chunks";
    CHECK_ARG(chunks && count && first_offset, "%s: NULL argument", what);
    const cubuf_buffer_t *root = NULL;
    cubuf_status_t st = root_of(buf, &root, what);
    if (st != CUBUF_SUCCESS) return st;
    const vmm_member_t *m = root->impl;
    if (!m || buf->size == 0) {
        *chunks = NULL;
        *count = 0;
        *first_offset = 0;
        return CUBUF_SUCCESS;
    }
    pthread_mutex_lock(&m->range->lock);
    const vmm_space_t *s = m->space;
    size_t off = (size_t)(buf->ptr - root->ptr), end = off + buf->size;
    /* First mapping that ends after `off`, by bisection over the prefix. */
    size_t lo = 0, hi = m->count;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (s->maps[mid].offset + s->maps[mid].phys->size <= off) lo = mid + 1;
        else hi = mid;
    }
    size_t first = lo, last = first;
    while (last + 1 < m->count && s->maps[last + 1].offset < end) last++;
    size_t n = last - first + 1;
    cubuf_vmm_chunk_t *c = malloc(n * sizeof *c);
    if (!c) {
        pthread_mutex_unlock(&m->range->lock);
        return cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "%s: out of host memory", what);
    }
    size_t base = s->maps[first].offset;
    for (size_t i = 0; i < n; i++) {
        const vmm_mapping_t *mp = &s->maps[first + i];
        c[i] = (cubuf_vmm_chunk_t){mp->phys->handle, mp->offset - base, mp->phys->size};
    }
    pthread_mutex_unlock(&m->range->lock);
    *chunks = c;
    *count = n;
    *first_offset = off - base;
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf__vmm_tail(const cubuf_buffer_t *buf, CUdeviceptr *end, size_t *headroom,
                               bool *extendable)
{
    static const char what[] = "cubuf__vmm_tail";
    CHECK_ARG(end && headroom && extendable, "%s: NULL argument", what);
    const cubuf_buffer_t *root = NULL;
    cubuf_status_t st = root_of(buf, &root, what);
    if (st != CUBUF_SUCCESS) return st;
    CHECK_ARG(root == buf && buf->impl, "%s: not an open, non-empty VMM buffer", what);
    const vmm_member_t *m = buf->impl;
    pthread_mutex_lock(&m->range->lock);
    const vmm_space_t *s = m->space;
    *end = s->base + s->reserved;
    *extendable = m->count == s->nmaps;
    *headroom = *extendable ? s->reserved - s->mapped : 0;
    pthread_mutex_unlock(&m->range->lock);
    return CUBUF_SUCCESS;
}
