/* Virtual memory: the resource. Options (validated field by field, each
 * refusal naming the field), what the device supports, the access entries
 * and allocation properties the options mean, and the resource with its
 * getters. The model is in vmm.h. */
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "vmm.h"
#include "ipc.h"

static int current_numa_node(void)
{
    unsigned cpu = 0, node = 0;
    if (syscall(SYS_getcpu, &cpu, &node, NULL) != 0) return 0;
    return (int)node;
}

static bool is_host_location(cubuf_vmm_location_t loc) { return loc != CUBUF_VMM_LOCATION_DEVICE; }

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

/* What needs no driver: enums, counts, alignment (of options read with read_options). */
static cubuf_status_t check_shape(const cubuf_vmm_options_t *o, const char *what)
{
#define CUBUF_VMM_ENUM_CHECK_(field, last)                                                      \
    if ((unsigned)o->field > (unsigned)(last))                                                  \
        return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,                                        \
                           "%s: options->" #field " is %d, not a value of its enum (0 to %d)", \
                           what, (int)o->field, (int)(last));
    CUBUF_VMM_ENUM_CHECK_(allocation_type, CUBUF_VMM_ALLOCATION_MANAGED)
    CUBUF_VMM_ENUM_CHECK_(location, CUBUF_VMM_LOCATION_HOST_NUMA_CURRENT)
    CUBUF_VMM_ENUM_CHECK_(handle_type, CUBUF_VMM_HANDLE_POSIX_FD_FABRIC)
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
        /* Fabric handles are not checked here: where they are refused the
         * resource falls back to POSIX fds (fabric_fallback), which are. */
        {o->handle_type != CUBUF_VMM_HANDLE_NONE,
         CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
         "POSIX file descriptor handles (options->handle_type)"},
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
void cubuf__vmm_build_access(const vmm_res_t *vr, const cubuf_vmm_options_t *o, vmm_access_t *a)
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
void cubuf__vmm_fill_prop(const vmm_res_t *vr, bool rdma, CUmemAllocationProp *prop)
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
    case CUBUF_VMM_HANDLE_POSIX_FD_FABRIC:
        prop->requestedHandleTypes = (CUmemAllocationHandleType)(
            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | CU_MEM_HANDLE_TYPE_FABRIC);
        break;
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
cubuf_status_t cubuf__vmm_grow_options(const vmm_res_t *vr, const cubuf_vmm_options_t *given,
                                       cubuf_vmm_options_t *o, const char *what)
{
    if (!given) {
        *o = vr->opts;
        o->address_hint = 0; /* the resource's hint is for its first reservations */
        return CUBUF_SUCCESS;
    }
    *o = (cubuf_vmm_options_t)CUBUF_VMM_OPTIONS_INIT;
    cubuf_status_t st = cubuf__struct_in(what, "cubuf_vmm_options_t", o, sizeof *o, given,
                                         CUBUF_VMM_OPTIONS_SIZE_V1);
    if (st == CUBUF_SUCCESS) st = check_shape(o, what);
    if (st != CUBUF_SUCCESS) return st;
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

static void vmm_destroy(cubuf_resource_t *res) { free(res->impl); }

/* allocate is in vmm_range.c, deallocate and set_token in vmm_close.c. */
static const cubuf_resource_vtbl_t vmm_vtbl = {
    .name = "virtual memory",
    .export_ipc = cubuf__ipc_export_vmm,
    .raw_keeps_buffer = true,
    .allocate = cubuf__vmm_allocate,
    .deallocate = cubuf__vmm_deallocate,
    .destroy = vmm_destroy,
    .set_token = cubuf__vmm_set_token,
    .no_adopt = "a virtual memory resource frees only ranges it allocated (a close must know "
                "which aliases still map the memory); wrap memory mapped elsewhere with "
                "cubuf_buffer_wrap_external",
};

const vmm_res_t *cubuf__vmm_of(const cubuf_resource_t *res)
{
    return res && res->vt == &vmm_vtbl ? res->impl : NULL;
}

static cubuf_status_t query_granularity(vmm_res_t *vr, const char *what)
{
    CUmemAllocationProp prop;
    cubuf__vmm_fill_prop(vr, vr->opts.gpu_direct_rdma, &prop);
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
    else if (o->handle_type == CUBUF_VMM_HANDLE_FABRIC ||
             o->handle_type == CUBUF_VMM_HANDLE_POSIX_FD_FABRIC)
        kind = "memory with fabric handles";
    else if (is_host_location(o->location))
        kind = "host memory";
    if (!kind) return CUBUF_SUCCESS;
    CUmemAllocationProp prop;
    cubuf__vmm_fill_prop(vr, o->gpu_direct_rdma, &prop);
    const char *call = NULL;
    CUresult r = cubuf__vmm_try_granule(&prop, vr->gran, &vr->access, &call);
    if (r == CUDA_SUCCESS) return CUBUF_SUCCESS;
    cubuf_status_t st = cubuf__cu_status(r, call);
    if (st == CUBUF_ERROR_OUT_OF_MEMORY) return st;
    return cubuf__fail(CUBUF_ERROR_NOT_SUPPORTED,
                       "%s: the driver refuses %s at the %s location for device %d: %s", what, kind,
                       location_name(o->location), vr->ordinal, cubuf_last_error());
}

/* Fabric handles asked for: made once (the probe), or, where the device or
 * the driver refuses them (CUDA_ERROR_NOT_SUPPORTED: no multi-node NVLink;
 * CUDA_ERROR_NOT_PERMITTED: no IMEX channel), POSIX fds instead, as NCCL's
 * ncclMemAlloc does. Other failures stay failures. */
static cubuf_status_t fabric_or_fallback(vmm_res_t *vr, const char *what)
{
    cubuf_vmm_options_t *o = &vr->opts;
    if (o->handle_type != CUBUF_VMM_HANDLE_FABRIC && o->handle_type != CUBUF_VMM_HANDLE_POSIX_FD_FABRIC)
        return CUBUF_SUCCESS;
    int v = 0;
    cubuf_status_t st =
        cubuf__device_attr(vr->device, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, &v);
    if (st != CUBUF_SUCCESS) return st;
    if (v) {
        /* The granularity of fabric memory, then one granule of it. */
        CUresult r;
        if ((st = query_granularity(vr, what)) != CUBUF_SUCCESS) {
            r = cubuf_last_cuda_result();
        } else {
            CUmemAllocationProp prop;
            cubuf__vmm_fill_prop(vr, o->gpu_direct_rdma, &prop);
            cubuf__vmm_build_access(vr, o, &vr->access);
            const char *call = NULL;
            if ((r = cubuf__vmm_try_granule(&prop, vr->gran, &vr->access, &call)) == CUDA_SUCCESS)
                return CUBUF_SUCCESS;
            st = cubuf__cu_status(r, call);
            cubuf__detail_append("%s: a granule with fabric handles on device %d", what, vr->ordinal);
        }
        if (r != CUDA_ERROR_NOT_PERMITTED && r != CUDA_ERROR_NOT_SUPPORTED) return st;
    }
    o->handle_type = CUBUF_VMM_HANDLE_POSIX_FD;
    vr->fabric_fallback = true;
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf_vmm_resource_create(int ordinal, const cubuf_vmm_options_t *options,
                                         cubuf_resource_t **out)
{
    static const char what[] = "cubuf_vmm_resource_create";
    CHECK_ARG(out, "%s: out is NULL", what);
    cubuf_vmm_options_t o = CUBUF_VMM_OPTIONS_INIT;
    cubuf_status_t st;
    if (options) {
        if ((st = cubuf__struct_in(what, "cubuf_vmm_options_t", &o, sizeof o, options,
                                   CUBUF_VMM_OPTIONS_SIZE_V1)) != CUBUF_SUCCESS ||
            (st = check_shape(&o, what)) != CUBUF_SUCCESS)
            return st;
    }
    cubuf_context_t *ctx = NULL;
    cubuf_resource_t *res = NULL;
    vmm_res_t *vr = NULL;
    cubuf_ctx_guard_t g = {false};
    bool pushed = false;
    CHECK(cubuf__context_for_device(ordinal, &ctx));
    vr = cubuf__calloc(1, sizeof *vr);
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
    CHECK(fabric_or_fallback(vr, what));
    CHECK(query_granularity(vr, what));
    if (vr->opts.address_hint % vr->gran) {
        st = cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,
                         "%s: options->address_hint 0x%llx is not a multiple of the %zu-byte "
                         "granularity",
                         what, (unsigned long long)vr->opts.address_hint, vr->gran);
        goto fail;
    }
    if (vr->opts.address_alignment < vr->gran) vr->opts.address_alignment = vr->gran;
    cubuf__vmm_build_access(vr, &vr->opts, &vr->access);
    CHECK(probe(vr, what));
    cubuf__ctx_pop(&g);
    pushed = false;
    CHECK(cubuf__resource_new(&vmm_vtbl, ctx, 0, &res));
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
    const vmm_res_t *vr = cubuf__vmm_of(res);
    CHECK_ARG(vr, "cubuf_vmm_granularity: the resource is not a virtual memory resource");
    *granularity = vr->gran;
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf_vmm_resource_options(const cubuf_resource_t *res, cubuf_vmm_options_t *options)
{
    CHECK_ARG(res && options, "cubuf_vmm_resource_options: NULL argument");
    cubuf_status_t st = cubuf__struct_check("cubuf_vmm_resource_options", "cubuf_vmm_options_t",
                                            options->struct_size, CUBUF_VMM_OPTIONS_SIZE_V1,
                                            sizeof *options);
    if (st != CUBUF_SUCCESS) return st;
    const vmm_res_t *vr = cubuf__vmm_of(res);
    CHECK_ARG(vr, "cubuf_vmm_resource_options: the resource is not a virtual memory resource");
    cubuf__struct_out(options, &vr->opts, sizeof *options);
    return CUBUF_SUCCESS;
}

CUmemAllocationHandleType cubuf__vmm_handle_type(const cubuf_resource_t *res)
{
    const vmm_res_t *vr = cubuf__vmm_of(res);
    if (!vr) return CU_MEM_HANDLE_TYPE_NONE;
    switch (vr->opts.handle_type) {
    case CUBUF_VMM_HANDLE_POSIX_FD: return CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    case CUBUF_VMM_HANDLE_FABRIC: return CU_MEM_HANDLE_TYPE_FABRIC;
    case CUBUF_VMM_HANDLE_POSIX_FD_FABRIC:
        return (CUmemAllocationHandleType)(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR |
                                           CU_MEM_HANDLE_TYPE_FABRIC);
    case CUBUF_VMM_HANDLE_NONE: break;
    }
    return CU_MEM_HANDLE_TYPE_NONE;
}

size_t cubuf__vmm_granularity(const cubuf_resource_t *res)
{
    const vmm_res_t *vr = cubuf__vmm_of(res);
    return vr ? vr->gran : 0;
}
