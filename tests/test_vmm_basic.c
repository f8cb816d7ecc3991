/* Virtual memory resource: options validation, allocation, growth in place
 * and by moving, aliasing (writes seen through every alias, closes in every
 * order), copies/fills/attributes on VMM buffers, host-located and managed
 * memory, the refusal of cubuf_buffer_wrap, and the chunk query the IPC code
 * uses. */
#include <stdint.h>

#include "test.h"
#include "vmm_test.h"
#include "vmm.h"

static CUcontext g_ctx;
static size_t g_gran;

/* ---- helpers ----------------------------------------------------------------- */

static cubuf_resource_stats_t stats_of(cubuf_resource_t *res)
{
    cubuf_resource_stats_t s = CUBUF_RESOURCE_STATS_INIT;
    T_OK(cubuf_resource_stats(res, &s));
    return s;
}

static bool live_equal(const cubuf_vmm_live_t *a, const cubuf_vmm_live_t *b)
{
    return a->reservations == b->reservations && a->mappings == b->mappings &&
           a->allocations == b->allocations && a->waiters == b->waiters;
}

static cubuf_vmm_live_t live_now(void)
{
    cubuf_vmm_live_t l;
    cubuf__vmm_live(&l);
    return l;
}

static cubuf_buffer_t *alloc_buf(cubuf_resource_t *res, size_t size)
{
    cubuf_buffer_t *b = NULL;
    T_REQUIRE(cubuf_resource_allocate(res, size, 0, &b));
    return b;
}

static cubuf_buffer_t *grow(cubuf_resource_t *res, cubuf_buffer_t *b, size_t size)
{
    cubuf_buffer_t *n = NULL;
    T_REQUIRE(cubuf_vmm_modify_allocation(res, b, size, NULL, &n));
    return n;
}

static void close_release(cubuf_buffer_t *b)
{
    T_OK(cubuf_buffer_close(b));
    T_CHECK(cubuf_buffer_is_closed(b));
    cubuf_buffer_release(b);
}

/* Grows `b` past its headroom where the addresses right after its space are
 * taken, so that the grow must move: by a reservation placed there when the
 * driver puts it there, else by the hook that makes the grow see its
 * reservation placed elsewhere, as the driver would. Either way the grow
 * runs the moving path; *blocked says which one blocked it. */
static cubuf_buffer_t *grow_blocked(cubuf_resource_t *res, cubuf_buffer_t *b, size_t extra,
                                    bool *blocked)
{
    CUdeviceptr end = 0, blk = 0;
    size_t headroom = 0;
    bool ext = false;
    T_REQUIRE(cubuf__vmm_tail(b, &end, &headroom, &ext));
    T_CHECK(ext);
    T_CU(cuMemAddressReserve, &blk, g_gran, 0, end, 0);
    *blocked = blk == end;
    if (!*blocked) {
        T_CU(cuMemAddressFree, blk, g_gran);
        cubuf__vmm_test_refuse_extension(true);
    }
    cubuf_buffer_t *n = grow(res, b, cubuf_buffer_size(b) + headroom + extra);
    if (*blocked) T_CU(cuMemAddressFree, blk, g_gran);
    else cubuf__vmm_test_refuse_extension(false);
    return n;
}

/* ---- options ------------------------------------------------------------------ */

static void expect_create(const cubuf_vmm_options_t *o, cubuf_status_t want, const char *what)
{
    cubuf_resource_t *r = NULL;
    cubuf_status_t st = cubuf_vmm_resource_create(0, o, &r);
    if (st != want) {
        fprintf(stderr, "options case '%s': got %s, expected %s (%s)\n", what,
                cubuf_status_name(st), cubuf_status_name(want), cubuf_last_error());
        t_failures++;
    } else if (st != CUBUF_SUCCESS && strlen(cubuf_last_error()) == 0) {
        fprintf(stderr, "options case '%s': no error message\n", what);
        t_failures++;
    }
    cubuf_resource_release(r);
}

static int dev_attr(CUdevice_attribute a)
{
    CUdevice dev;
    int v = 0;
    T_CU(cuDeviceGet, &dev, 0);
    T_CU(cuDeviceGetAttribute, &v, a, dev);
    return v;
}

static cubuf_status_t dummy_alloc(void *s, size_t n, CUstream st, CUdeviceptr *p)
{
    (void)s; (void)n; (void)st;
    *p = 0x1000;
    return CUBUF_SUCCESS;
}
static cubuf_status_t dummy_free(void *s, CUdeviceptr p, size_t n, CUstream st)
{
    (void)s; (void)p; (void)n; (void)st;
    return CUBUF_SUCCESS;
}

static void test_options(void)
{
    cubuf_vmm_options_t o;
#define CASE(mutation, want)                      \
    do {                                          \
        o = (cubuf_vmm_options_t)CUBUF_VMM_OPTIONS_INIT; \
        mutation;                                 \
        expect_create(&o, want, #mutation);       \
    } while (0)
    CASE((void)0, CUBUF_SUCCESS);
    CASE(o.struct_size = 0, CUBUF_ERROR_INVALID_ARGUMENT);
    CASE(o.struct_size = CUBUF_VMM_OPTIONS_SIZE_V1 - 1, CUBUF_ERROR_INVALID_ARGUMENT);
    CASE(o.allocation_type = (cubuf_vmm_allocation_type_t)7, CUBUF_ERROR_INVALID_ARGUMENT);
    CASE(o.location = (cubuf_vmm_location_t)9, CUBUF_ERROR_INVALID_ARGUMENT);
    CASE(o.location = (cubuf_vmm_location_t)-1, CUBUF_ERROR_INVALID_ARGUMENT);
    CASE(o.handle_type = (cubuf_vmm_handle_type_t)5, CUBUF_ERROR_INVALID_ARGUMENT);
    CASE(o.granularity = (cubuf_vmm_granularity_kind_t)3, CUBUF_ERROR_INVALID_ARGUMENT);
    CASE(o.owner_access = (cubuf_vmm_access_t)4, CUBUF_ERROR_INVALID_ARGUMENT);
    CASE(o.peer_access = (cubuf_vmm_access_t)4, CUBUF_ERROR_INVALID_ARGUMENT);
    CASE(o.peer_count = CUBUF_VMM_MAX_PEERS + 1, CUBUF_ERROR_INVALID_ARGUMENT);
    CASE(o.address_alignment = 3 * g_gran, CUBUF_ERROR_INVALID_ARGUMENT);
    CASE(o.address_hint = 4096 + 8 * g_gran, CUBUF_ERROR_INVALID_ARGUMENT);
    CASE(o.location_id = 12345, CUBUF_ERROR_INVALID_ARGUMENT);
    CASE((o.location = CUBUF_VMM_LOCATION_HOST, o.location_id = 0), CUBUF_ERROR_INVALID_ARGUMENT);
    CASE((o.location = CUBUF_VMM_LOCATION_HOST_NUMA_CURRENT, o.location_id = 0),
         CUBUF_ERROR_INVALID_ARGUMENT);
    CASE((o.location = CUBUF_VMM_LOCATION_HOST_NUMA, o.location_id = -5), CUBUF_ERROR_INVALID_ARGUMENT);
    CASE((o.location = CUBUF_VMM_LOCATION_HOST, o.handle_type = CUBUF_VMM_HANDLE_POSIX_FD),
         CUBUF_ERROR_INVALID_ARGUMENT);
    CASE((o.peers[0] = 0, o.peer_count = 1), CUBUF_ERROR_INVALID_ARGUMENT);
    CASE((o.peers[0] = 1000, o.peer_count = 1), CUBUF_ERROR_OUT_OF_RANGE);
    CASE((o.peers[0] = -2, o.peer_count = 1), CUBUF_ERROR_OUT_OF_RANGE);
    /* Features the device may lack. */
    CASE(o.gpu_direct_rdma = true,
         dev_attr(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED)
             ? CUBUF_SUCCESS
             : CUBUF_ERROR_NOT_SUPPORTED);
    CASE(o.handle_type = CUBUF_VMM_HANDLE_POSIX_FD,
         dev_attr(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)
             ? CUBUF_SUCCESS
             : CUBUF_ERROR_NOT_SUPPORTED);
    /* Fabric handles: made where the device and an IMEX channel allow, else
     * POSIX fds instead (tests/test_fabric.c checks the fallback). */
    CASE(o.handle_type = CUBUF_VMM_HANDLE_FABRIC, CUBUF_SUCCESS);
    CASE(o.handle_type = CUBUF_VMM_HANDLE_POSIX_FD_FABRIC, CUBUF_SUCCESS);
    CASE(o.address_alignment = 4 * g_gran, CUBUF_SUCCESS);
    CASE(o.granularity = CUBUF_VMM_GRANULARITY_MINIMUM, CUBUF_SUCCESS);
    CASE(o.owner_access = CUBUF_VMM_ACCESS_READ, CUBUF_SUCCESS);
    CASE(o.location_id = 0, CUBUF_SUCCESS);
#undef CASE

    int n = 0;
    T_OK(cubuf_device_count(&n));
    cubuf_resource_t *r = NULL;
    T_STATUS(cubuf_vmm_resource_create(-1, NULL, &r), CUBUF_ERROR_OUT_OF_RANGE);
    T_STATUS(cubuf_vmm_resource_create(n, NULL, &r), CUBUF_ERROR_OUT_OF_RANGE);
    T_STATUS(cubuf_vmm_resource_create(0, NULL, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(r == NULL);

    /* The queries. */
    T_REQUIRE(cubuf_vmm_resource_create(0, NULL, &r));
    size_t gran = 0;
    T_OK(cubuf_vmm_granularity(r, &gran));
    T_CHECK(gran == g_gran);
    cubuf_vmm_options_t got = CUBUF_VMM_OPTIONS_INIT;
    T_OK(cubuf_vmm_resource_options(r, &got));
    T_CHECK(got.location_id == 0 && got.address_alignment >= gran);
    got.struct_size = 1;
    T_STATUS(cubuf_vmm_resource_options(r, &got), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(cubuf__vmm_granularity(r) == gran);
    T_CHECK(cubuf__vmm_handle_type(r) == CU_MEM_HANDLE_TYPE_NONE);
    cubuf_resource_props_t props = CUBUF_RESOURCE_PROPS_INIT;
    T_OK(cubuf_resource_props(r, &props));
    T_CHECK(props.device_id == 0 && props.device_accessible && !props.host_accessible &&
            !props.managed && !props.ipc_enabled);

    cubuf_resource_ops_t ops = {CUBUF_RESOURCE_OPS_VERSION, dummy_alloc, dummy_free, NULL};
    cubuf_resource_t *user = NULL;
    T_REQUIRE(cubuf_resource_create(&ops, NULL, NULL, &user));
    T_STATUS(cubuf_vmm_granularity(user, &gran), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(cubuf__vmm_granularity(user) == 0);

    /* modify_allocation's arguments and options. */
    cubuf_resource_t *r2 = NULL;
    T_REQUIRE(cubuf_vmm_resource_create(0, NULL, &r2));
    cubuf_buffer_t *b = alloc_buf(r, g_gran), *b2 = alloc_buf(r2, g_gran), *out = NULL;
    T_STATUS(cubuf_vmm_modify_allocation(r, b2, 2 * g_gran, NULL, &out), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_vmm_modify_allocation(user, b, 2 * g_gran, NULL, &out), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_vmm_modify_allocation(r, b, 2 * g_gran, NULL, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_vmm_modify_allocation(r, NULL, 2 * g_gran, NULL, &out), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_vmm_modify_allocation(r, b, SIZE_MAX, NULL, &out), CUBUF_ERROR_OUT_OF_RANGE);
    cubuf_buffer_t *big = NULL;
    T_STATUS(cubuf_resource_allocate(r, SIZE_MAX - 1, 0, &big), CUBUF_ERROR_OUT_OF_RANGE);
#define GROW_CASE(mutation, want)                                                      \
    do {                                                                               \
        o = (cubuf_vmm_options_t)CUBUF_VMM_OPTIONS_INIT;                               \
        mutation;                                                                      \
        cubuf_status_t st_ = cubuf_vmm_modify_allocation(r, b, 2 * g_gran, &o, &out);  \
        if (st_ != (want)) {                                                           \
            fprintf(stderr, "grow options case '%s': got %s (%s)\n", #mutation,        \
                    cubuf_status_name(st_), cubuf_last_error());                       \
            t_failures++;                                                              \
        }                                                                              \
        if (st_ == CUBUF_SUCCESS) close_release(out);                                  \
    } while (0)
    GROW_CASE(o.struct_size = 0, CUBUF_ERROR_INVALID_ARGUMENT);
    GROW_CASE(o.location = CUBUF_VMM_LOCATION_HOST_NUMA, CUBUF_ERROR_INVALID_ARGUMENT);
    GROW_CASE(o.handle_type = CUBUF_VMM_HANDLE_POSIX_FD, CUBUF_ERROR_INVALID_ARGUMENT);
    GROW_CASE(o.allocation_type = CUBUF_VMM_ALLOCATION_MANAGED, CUBUF_ERROR_INVALID_ARGUMENT);
    GROW_CASE(o.granularity = CUBUF_VMM_GRANULARITY_MINIMUM, CUBUF_ERROR_INVALID_ARGUMENT);
    GROW_CASE(o.location_id = 7, CUBUF_ERROR_INVALID_ARGUMENT);
    GROW_CASE(o.address_hint = 4096, CUBUF_ERROR_INVALID_ARGUMENT);
    GROW_CASE((o.peers[0] = 1000, o.peer_count = 1), CUBUF_ERROR_OUT_OF_RANGE);
    GROW_CASE(o.owner_access = CUBUF_VMM_ACCESS_READ, CUBUF_SUCCESS);
    GROW_CASE((void)0, CUBUF_SUCCESS);
#undef GROW_CASE
    T_OK(cubuf_buffer_close(b));
    T_STATUS(cubuf_vmm_modify_allocation(r, b, 2 * g_gran, NULL, &out), CUBUF_ERROR_CLOSED);
    cubuf_buffer_release(b);
    close_release(b2);
    cubuf_resource_release(r2);
    cubuf_resource_release(user);
    cubuf_resource_stats_t s = stats_of(r);
    T_CHECK(s.current_bytes == 0 && s.current_count == 0);
    cubuf_resource_release(r);
}

/* ---- allocation and growth -------------------------------------------------------- */

static void test_allocate(cubuf_resource_t *res)
{
    cubuf_vmm_live_t live0 = live_now();
    cubuf_buffer_t *b = alloc_buf(res, 1);
    T_CHECK(cubuf_buffer_size(b) == g_gran);
    T_CHECK(cubuf_buffer_ptr(b) != 0 && cubuf_buffer_ptr(b) % g_gran == 0);
    T_CHECK(cubuf_buffer_is_device_accessible(b) && !cubuf_buffer_is_host_accessible(b));
    T_CHECK(!cubuf_buffer_is_managed(b) && !cubuf_buffer_is_mapped(b));
    T_CHECK(cubuf_buffer_device_id(b) == 0 && cubuf_buffer_resource(b) == res);
    cubuf_resource_stats_t s = stats_of(res);
    T_CHECK(s.current_bytes == g_gran && s.current_count == 1);
    cubuf_vmm_live_t live1 = live_now();
    T_CHECK(live1.reservations == live0.reservations + 1 && live1.mappings == live0.mappings + 1 &&
            live1.allocations == live0.allocations + 1);
    write_pattern(cubuf_buffer_ptr(b), g_gran, 0, 1);
    T_CHECK(check_pattern(cubuf_buffer_ptr(b), g_gran, 0, 1));

    cubuf_vmm_chunk_t *c = NULL;
    size_t n = 0, first = 99;
    T_OK(cubuf__vmm_chunks(b, &c, &n, &first));
    T_CHECK(n == 1 && first == 0 && c && c[0].offset == 0 && c[0].size == g_gran && c[0].handle);
    free(c);
    cubuf_buffer_t *sl = NULL;
    T_REQUIRE(cubuf_buffer_slice(b, g_gran / 2, 16, &sl));
    T_OK(cubuf__vmm_chunks(sl, &c, &n, &first));
    T_CHECK(n == 1 && first == g_gran / 2);
    free(c);
    cubuf_buffer_release(sl);

    /* Size 0: an open, empty buffer; no driver call. */
    cubuf_buffer_t *e = NULL;
    cubuf_fault_count_calls(true);
    T_OK(cubuf_resource_allocate(res, 0, 0, &e));
    T_CHECK(cubuf_fault_calls("cuMemCreate") == 0 && cubuf_fault_calls("cuMemAddressReserve") == 0);
    cubuf_fault_count_calls(false);
    T_CHECK(e && !cubuf_buffer_is_closed(e) && cubuf_buffer_size(e) == 0 && cubuf_buffer_ptr(e) == 0);
    T_OK(cubuf__vmm_chunks(e, &c, &n, &first));
    T_CHECK(n == 0 && c == NULL);
    /* Growing an empty buffer allocates; to 0 gives another empty one. */
    cubuf_buffer_t *e0 = NULL, *e1 = NULL;
    T_OK(cubuf_vmm_modify_allocation(res, e, 0, NULL, &e0));
    T_CHECK(e0 && cubuf_buffer_size(e0) == 0 && !cubuf_buffer_is_closed(e0));
    T_OK(cubuf_vmm_modify_allocation(res, e, 3 * g_gran - 5, NULL, &e1));
    T_CHECK(e1 && cubuf_buffer_size(e1) == 3 * g_gran);
    close_release(e1);
    close_release(e0);
    close_release(e);

    close_release(b);
    s = stats_of(res);
    T_CHECK(s.current_bytes == 0 && s.current_count == 0);
    cubuf_vmm_live_t live2 = live_now();
    T_CHECK(live_equal(&live0, &live2));
}

/* Data written before growth reads back after it, through both buffers;
 * writes through either are seen through the other. */
static void check_aliases(cubuf_buffer_t *old, cubuf_buffer_t *nw, unsigned seed)
{
    size_t os = cubuf_buffer_size(old);
    T_CHECK(check_pattern(cubuf_buffer_ptr(nw), os, 0, seed));
    /* Through the new buffer into the shared part, read through the old. */
    write_pattern(cubuf_buffer_ptr(nw), os / 2, 0, seed + 100);
    T_CHECK(check_pattern(cubuf_buffer_ptr(old), os / 2, 0, seed + 100));
    /* Through the old buffer, read through the new. */
    write_pattern(cubuf_buffer_ptr(old), os, 0, seed);
    T_CHECK(check_pattern(cubuf_buffer_ptr(nw), os, 0, seed));
    /* The new part is the new buffer's own: its two ends (it may be large). */
    size_t ns = cubuf_buffer_size(nw), part = ns - os;
    size_t span = part < 4 * g_gran ? part : 2 * g_gran;
    CUdeviceptr p = cubuf_buffer_ptr(nw);
    write_pattern(p + os, span, os, seed);
    write_pattern(p + ns - span, span, ns - span, seed);
    T_CHECK(check_pattern(p, os + span, 0, seed));
    T_CHECK(check_pattern(p + ns - span, span, ns - span, seed));
    T_CHECK(check_pattern(cubuf_buffer_ptr(old), os, 0, seed));
}

static void test_grow_in_place(cubuf_resource_t *res)
{
    cubuf_vmm_live_t live0 = live_now();
    cubuf_buffer_t *a = alloc_buf(res, 2 * g_gran);
    write_pattern(cubuf_buffer_ptr(a), 2 * g_gran, 0, 2);
    cubuf_buffer_t *b = grow(res, a, 5 * g_gran - 1);
    T_CHECK(cubuf_buffer_ptr(b) == cubuf_buffer_ptr(a)); /* the reservation had room */
    T_CHECK(cubuf_buffer_size(b) == 5 * g_gran && cubuf_buffer_size(a) == 2 * g_gran);
    T_CHECK(!cubuf_buffer_is_closed(a));
    check_aliases(a, b, 2);
    cubuf_resource_stats_t s = stats_of(res);
    T_CHECK(s.current_bytes == 5 * g_gran && s.current_count == 2);
    cubuf_vmm_chunk_t *c = NULL;
    size_t n = 0, first = 0;
    T_OK(cubuf__vmm_chunks(b, &c, &n, &first));
    T_CHECK(n == 2 && c[0].size == 2 * g_gran && c[1].offset == 2 * g_gran && c[1].size == 3 * g_gran);
    free(c);

    /* A size within the buffer: an alias over the same range, no driver call. */
    cubuf_buffer_t *w = NULL;
    cubuf_fault_count_calls(true);
    T_OK(cubuf_vmm_modify_allocation(res, b, 1, NULL, &w));
    T_CHECK(cubuf_fault_calls("cuMemCreate") == 0 && cubuf_fault_calls("cuMemMap") == 0);
    cubuf_fault_count_calls(false);
    T_CHECK(cubuf_buffer_ptr(w) == cubuf_buffer_ptr(b) && cubuf_buffer_size(w) == cubuf_buffer_size(b));
    s = stats_of(res);
    T_CHECK(s.current_bytes == 5 * g_gran && s.current_count == 2);

    /* Old first: nothing is freed while the others map everything. */
    close_release(a);
    s = stats_of(res);
    T_CHECK(s.current_bytes == 5 * g_gran);
    T_CHECK(check_pattern(cubuf_buffer_ptr(b), 5 * g_gran, 0, 2));
    close_release(w);
    T_CHECK(check_pattern(cubuf_buffer_ptr(b), 5 * g_gran, 0, 2));
    close_release(b);
    s = stats_of(res);
    T_CHECK(s.current_bytes == 0 && s.current_count == 0);

    /* New first: the new part goes, the old buffer keeps its data. */
    a = alloc_buf(res, 2 * g_gran);
    write_pattern(cubuf_buffer_ptr(a), 2 * g_gran, 0, 3);
    b = grow(res, a, 4 * g_gran);
    T_CHECK(cubuf_buffer_ptr(b) == cubuf_buffer_ptr(a));
    close_release(b);
    s = stats_of(res);
    T_CHECK(s.current_bytes == 2 * g_gran && s.current_count == 1);
    T_CHECK(check_pattern(cubuf_buffer_ptr(a), 2 * g_gran, 0, 3));
    /* And it can grow in place again into the addresses freed. */
    b = grow(res, a, 6 * g_gran);
    T_CHECK(cubuf_buffer_ptr(b) == cubuf_buffer_ptr(a));
    check_aliases(a, b, 3);
    close_release(a);
    close_release(b);
    cubuf_vmm_live_t live1 = live_now();
    T_CHECK(live_equal(&live0, &live1));
}

static void test_grow_moving(cubuf_resource_t *res)
{
    cubuf_vmm_live_t live0 = live_now();
    for (int order = 0; order < 2; order++) {
        bool blocked = false;
        cubuf_buffer_t *a = alloc_buf(res, 2 * g_gran);
        cubuf_buffer_t *b = grow_blocked(res, a, 2 * g_gran, &blocked);
        printf("moving path, order %d: blocked by %s\n", order,
               blocked ? "a reservation at the space's end" : "the test hook");
        /* grow_blocked wrote nothing: fill a through a, check through b. */
        T_CHECK(cubuf_buffer_ptr(b) != cubuf_buffer_ptr(a));
        write_pattern(cubuf_buffer_ptr(a), 2 * g_gran, 0, 4);
        check_aliases(a, b, 4);
        size_t bs = cubuf_buffer_size(b);
        cubuf_resource_stats_t s = stats_of(res);
        T_CHECK(s.current_bytes == bs && s.current_count == 2); /* shared, not doubled */
        cubuf_vmm_chunk_t *c = NULL;
        size_t n = 0, first = 0;
        T_OK(cubuf__vmm_chunks(b, &c, &n, &first));
        T_CHECK(n == 2 && c[0].size == 2 * g_gran && c[1].offset == 2 * g_gran);
        cubuf_vmm_chunk_t *ca = NULL;
        size_t na = 0;
        T_OK(cubuf__vmm_chunks(a, &ca, &na, &first));
        T_CHECK(na == 1 && ca[0].handle == c[0].handle); /* the same physical allocation */
        free(c);
        free(ca);
        if (order == 0) {
            close_release(a);
            s = stats_of(res);
            T_CHECK(s.current_bytes == bs); /* b still maps a's memory */
            /* what check_aliases wrote: a's part, the new part's two ends */
            T_CHECK(check_pattern(cubuf_buffer_ptr(b), 4 * g_gran, 0, 4));
            T_CHECK(check_pattern(cubuf_buffer_ptr(b) + bs - 2 * g_gran, 2 * g_gran, bs - 2 * g_gran, 4));
            close_release(b);
        } else {
            close_release(b);
            s = stats_of(res);
            T_CHECK(s.current_bytes == 2 * g_gran && s.current_count == 1);
            T_CHECK(check_pattern(cubuf_buffer_ptr(a), 2 * g_gran, 0, 4));
            close_release(a);
        }
        s = stats_of(res);
        T_CHECK(s.current_bytes == 0 && s.current_count == 0);
    }
    cubuf_vmm_live_t live1 = live_now();
    T_CHECK(live_equal(&live0, &live1));
}

/* Three aliases (an allocation, a grow in place and a grow that must move,
 * since the second maps the addresses right after the first) closed in all
 * six orders. */
static void test_close_orders(cubuf_resource_t *res)
{
    static const int orders[6][3] = {{0, 1, 2}, {0, 2, 1}, {1, 0, 2}, {1, 2, 0}, {2, 0, 1}, {2, 1, 0}};
    cubuf_vmm_live_t live0 = live_now();
    for (int k = 0; k < 6; k++) {
        cubuf_buffer_t *v[3];
        v[0] = alloc_buf(res, 2 * g_gran);
        write_pattern(cubuf_buffer_ptr(v[0]), 2 * g_gran, 0, 10 + k);
        v[1] = grow(res, v[0], 3 * g_gran);
        v[2] = grow(res, v[0], 4 * g_gran);
        T_CHECK(cubuf_buffer_ptr(v[1]) == cubuf_buffer_ptr(v[0]));
        T_CHECK(cubuf_buffer_ptr(v[2]) != cubuf_buffer_ptr(v[0]));
        /* Distinct new parts: v[1] and v[2] grew from the same buffer. */
        write_pattern(cubuf_buffer_ptr(v[1]) + 2 * g_gran, g_gran, 2 * g_gran, 20 + k);
        write_pattern(cubuf_buffer_ptr(v[2]) + 2 * g_gran, 2 * g_gran, 2 * g_gran, 30 + k);
        T_CHECK(check_pattern(cubuf_buffer_ptr(v[1]) + 2 * g_gran, g_gran, 2 * g_gran, 20 + k));
        T_CHECK(check_pattern(cubuf_buffer_ptr(v[2]), 2 * g_gran, 0, 10 + k));
        cubuf_resource_stats_t s = stats_of(res);
        T_CHECK(s.current_bytes == 5 * g_gran && s.current_count == 3);
        bool open[3] = {true, true, true};
        for (int i = 0; i < 3; i++) {
            int c = orders[k][i];
            close_release(v[c]);
            open[c] = false;
            if (open[0]) T_CHECK(check_pattern(cubuf_buffer_ptr(v[0]), 2 * g_gran, 0, 10 + k));
            if (open[1]) {
                T_CHECK(check_pattern(cubuf_buffer_ptr(v[1]), 2 * g_gran, 0, 10 + k));
                T_CHECK(check_pattern(cubuf_buffer_ptr(v[1]) + 2 * g_gran, g_gran, 2 * g_gran, 20 + k));
            }
            if (open[2]) {
                T_CHECK(check_pattern(cubuf_buffer_ptr(v[2]), 2 * g_gran, 0, 10 + k));
                T_CHECK(check_pattern(cubuf_buffer_ptr(v[2]) + 2 * g_gran, 2 * g_gran, 2 * g_gran,
                                      30 + k));
            }
            size_t want = (open[0] || open[1] || open[2] ? 2 * g_gran : 0) +
                          (open[1] ? g_gran : 0) + (open[2] ? 2 * g_gran : 0);
            s = stats_of(res);
            T_CHECK(s.current_bytes == want);
        }
    }
    cubuf_vmm_live_t live1 = live_now();
    T_CHECK(live_equal(&live0, &live1));
}

/* Options of a grow apply to the new part alone: a read-only part between
 * read-write ones keeps its access when the range moves (access is set per
 * run of allocations that share it). */
static void test_mixed_access(cubuf_resource_t *res)
{
    cubuf_buffer_t *a = alloc_buf(res, g_gran);
    write_pattern(cubuf_buffer_ptr(a), g_gran, 0, 80);
    cubuf_vmm_options_t o = CUBUF_VMM_OPTIONS_INIT;
    o.owner_access = CUBUF_VMM_ACCESS_READ;
    cubuf_buffer_t *g = NULL;
    T_REQUIRE(cubuf_vmm_modify_allocation(res, a, 2 * g_gran, &o, &g));
    T_CHECK(cubuf_buffer_ptr(g) == cubuf_buffer_ptr(a));
    cubuf_buffer_t *x = grow(res, g, 3 * g_gran); /* maps right after g */
    cubuf_buffer_t *m = grow(res, g, 4 * g_gran); /* so this one moves */
    T_CHECK(cubuf_buffer_ptr(m) != cubuf_buffer_ptr(g));
    T_CHECK(check_pattern(cubuf_buffer_ptr(m), g_gran, 0, 80));
    /* The read-only part reads the same through both mappings. */
    unsigned char *h1 = malloc(g_gran), *h2 = malloc(g_gran);
    T_REQUIRE(h1 && h2 ? CUBUF_SUCCESS : CUBUF_ERROR_OUT_OF_MEMORY);
    T_CU(cuMemcpyDtoH, h1, cubuf_buffer_ptr(g) + g_gran, g_gran);
    T_CU(cuMemcpyDtoH, h2, cubuf_buffer_ptr(m) + g_gran, g_gran);
    T_CHECK(memcmp(h1, h2, g_gran) == 0);
    free(h1);
    free(h2);
    /* The parts around it are writable through the moved mapping. */
    write_pattern(cubuf_buffer_ptr(m), g_gran, 0, 81);
    write_pattern(cubuf_buffer_ptr(m) + 2 * g_gran, 2 * g_gran, 2 * g_gran, 81);
    T_CHECK(check_pattern(cubuf_buffer_ptr(a), g_gran, 0, 81));
    T_CHECK(check_pattern(cubuf_buffer_ptr(m) + 2 * g_gran, 2 * g_gran, 2 * g_gran, 81));
    close_release(m);
    close_release(x);
    close_release(a);
    close_release(g);
    cubuf_resource_stats_t s = stats_of(res);
    T_CHECK(s.current_bytes == 0);
}

/* ---- what every buffer does ----------------------------------------------------------- */

static void test_buffer_ops(cubuf_resource_t *res)
{
    CUstream s;
    T_CU(cuStreamCreate, &s, CU_STREAM_NON_BLOCKING);
    cubuf_buffer_t *b = NULL;
    T_REQUIRE(cubuf_resource_allocate(res, 4 * g_gran, s, &b));
    T_OK(cubuf_buffer_set_deallocation_stream(b, 0));
    T_OK(cubuf_buffer_set_deallocation_stream(b, s));
    T_OK(cubuf_buffer_fill_byte(b, 0xab, s));
    T_CU(cuStreamSynchronize, s);
    T_CU(cuMemcpyDtoH, g_host, cubuf_buffer_ptr(b) + 4 * g_gran - 4096, 4096);
    bool ok = true;
    for (int i = 0; i < 4096; i++) ok &= g_host[i] == 0xab;
    T_CHECK(ok);
    uint32_t pat = 0x01020304;
    T_OK(cubuf_buffer_fill(b, &pat, 4, s));
    /* The grown buffer inherits the stream and works like any buffer. */
    cubuf_buffer_t *g = grow(res, b, 6 * g_gran);
    T_OK(cubuf_buffer_fill_byte(g, 0x5a, s)); /* overwrites b's part too: one memory */
    cubuf_buffer_t *c = NULL;
    T_OK(cubuf_buffer_copy_to_new(b, s, NULL, &c)); /* destination from the VMM resource */
    T_CU(cuStreamSynchronize, s);
    T_CHECK(c && cubuf_buffer_size(c) == cubuf_buffer_size(b) && cubuf_buffer_resource(c) == res);
    T_CU(cuMemcpyDtoH, g_host, cubuf_buffer_ptr(c), 4096);
    ok = true;
    for (int i = 0; i < 4096; i++) ok &= g_host[i] == 0x5a;
    T_CHECK(ok);
    write_pattern(cubuf_buffer_ptr(c), cubuf_buffer_size(c), 0, 40);
    cubuf_buffer_t *sl = NULL;
    T_REQUIRE(cubuf_buffer_slice(g, 4 * g_gran, 2 * g_gran, &sl));
    cubuf_buffer_t *csl = NULL;
    T_REQUIRE(cubuf_buffer_slice(c, 0, 2 * g_gran, &csl));
    T_OK(cubuf_buffer_copy_from(sl, csl, s, NULL));
    T_CU(cuStreamSynchronize, s);
    T_CHECK(check_pattern(cubuf_buffer_ptr(g) + 4 * g_gran, 2 * g_gran, 0, 40));
    cubuf_buffer_release(csl);
    cubuf_buffer_release(sl);
    /* A copy of a slice that is not a whole number of granules: the
     * resource rounds the new buffer up, and the copy fills its start. */
    T_REQUIRE(cubuf_buffer_slice(g, 4 * g_gran + 100, 1000, &sl));
    cubuf_buffer_t *cpart = NULL;
    T_OK(cubuf_buffer_copy_to_new(sl, s, NULL, &cpart));
    T_CU(cuStreamSynchronize, s);
    T_CHECK(cpart && cubuf_buffer_size(cpart) == g_gran && cubuf_buffer_resource(cpart) == res);
    if (cpart) {
        T_CU(cuMemcpyDtoH, g_host, cubuf_buffer_ptr(cpart), 1000);
        unsigned char *want = malloc(1000);
        T_CU(cuMemcpyDtoH, want, cubuf_buffer_ptr(g) + 4 * g_gran + 100, 1000);
        T_CHECK(memcmp(g_host, want, 1000) == 0);
        free(want);
        close_release(cpart);
    }
    cubuf_buffer_release(sl);
    T_CHECK(cubuf_buffer_owner(g) == NULL && cubuf_buffer_parent(g) == NULL);
    T_CHECK(cubuf_buffer_is_device_accessible(g) && !cubuf_buffer_is_mapped(g));
    T_OK(cubuf_buffer_close_on(b, s));
    close_release(c);
    T_OK(cubuf_buffer_close_on(g, CU_STREAM_PER_THREAD));
    cubuf_buffer_release(g);
    cubuf_buffer_release(b);
    /* The last release closes (on the recorded stream). */
    T_REQUIRE(cubuf_resource_allocate(res, g_gran, s, &b));
    cubuf_buffer_release(b);
    cubuf_resource_stats_t st = stats_of(res);
    T_CHECK(st.current_bytes == 0);
    T_CU(cuStreamDestroy, s);
}

/* ---- host-located and managed memory ------------------------------------------------------- */

static void check_host_buffer(cubuf_resource_t *res, const char *name)
{
    cubuf_buffer_t *b = NULL;
    T_REQUIRE(cubuf_resource_allocate(res, 2 * g_gran, 0, &b));
    T_CHECK(cubuf_buffer_is_host_accessible(b) && cubuf_buffer_is_device_accessible(b));
    size_t n = cubuf_buffer_size(b);
    unsigned char *h = (unsigned char *)(uintptr_t)cubuf_buffer_ptr(b);
    for (size_t i = 0; i < n; i++) h[i] = pattern_byte(i, 50);
    /* The device reads what the host wrote (copied into device memory). */
    CUdeviceptr d = 0;
    T_CU(cuMemAlloc, &d, n);
    T_CU(cuMemcpy, d, cubuf_buffer_ptr(b), n); /* device to device */
    T_CU(cuCtxSynchronize);
    T_CHECK(check_pattern(d, n, 0, 50));
    /* And the host reads what the device writes. */
    T_CU(cuMemsetD8, cubuf_buffer_ptr(b), 0x77, n);
    T_CU(cuCtxSynchronize);
    bool ok = true;
    for (size_t i = 0; i < n; i += 4093) ok &= h[i] == 0x77;
    T_CHECK(ok);
    /* Grown, the new part is host memory too. */
    cubuf_buffer_t *g = grow(res, b, 2 * n);
    unsigned char *gh = (unsigned char *)(uintptr_t)cubuf_buffer_ptr(g);
    for (size_t i = n; i < 2 * n; i += 4096) gh[i] = 0x33;
    T_CU(cuMemcpyDtoH, g_host, cubuf_buffer_ptr(g) + n, 1);
    T_CHECK(g_host[0] == 0x33 && gh[0] == 0x77);
    T_CU(cuMemFree, d);
    close_release(b);
    close_release(g);
    printf("host location %s: ok\n", name);
}

static void test_host_and_managed(void)
{
    static const struct {
        cubuf_vmm_location_t loc;
        const char *name;
    } locs[] = {{CUBUF_VMM_LOCATION_HOST_NUMA, "HOST_NUMA"},
                {CUBUF_VMM_LOCATION_HOST_NUMA_CURRENT, "HOST_NUMA_CURRENT"},
                {CUBUF_VMM_LOCATION_HOST, "HOST"}};
    for (size_t i = 0; i < sizeof locs / sizeof locs[0]; i++) {
        cubuf_vmm_options_t o = CUBUF_VMM_OPTIONS_INIT;
        o.location = locs[i].loc;
        cubuf_resource_t *r = NULL;
        cubuf_status_t st = cubuf_vmm_resource_create(0, &o, &r);
        if (st == CUBUF_ERROR_NOT_SUPPORTED) {
            printf("SKIP host location %s: %s\n", locs[i].name, cubuf_last_error());
            continue;
        }
        T_OK(st);
        if (st != CUBUF_SUCCESS) continue;
        cubuf_resource_props_t p = CUBUF_RESOURCE_PROPS_INIT;
        T_OK(cubuf_resource_props(r, &p));
        T_CHECK(p.host_accessible && p.device_accessible && p.device_id == -1);
        check_host_buffer(r, locs[i].name);
        cubuf_resource_stats_t s = stats_of(r);
        T_CHECK(s.current_bytes == 0);
        cubuf_resource_release(r);
    }

    cubuf_vmm_options_t o = CUBUF_VMM_OPTIONS_INIT;
    o.allocation_type = CUBUF_VMM_ALLOCATION_MANAGED;
    cubuf_resource_t *r = NULL;
    cubuf_status_t st = cubuf_vmm_resource_create(0, &o, &r);
    if (st == CUBUF_ERROR_NOT_SUPPORTED) {
        printf("SKIP managed allocations: %s\n", cubuf_last_error());
        return;
    }
    T_OK(st);
    if (st != CUBUF_SUCCESS) return;
    cubuf_buffer_t *b = NULL;
    T_REQUIRE(cubuf_resource_allocate(r, g_gran, 0, &b));
    T_CHECK(cubuf_buffer_is_managed(b) && cubuf_buffer_is_host_accessible(b));
    write_pattern(cubuf_buffer_ptr(b), cubuf_buffer_size(b), 0, 60);
    T_CHECK(check_pattern(cubuf_buffer_ptr(b), cubuf_buffer_size(b), 0, 60));
    /* The CPU is not made to touch it here: whether managed memory made by
     * cuMemCreate needs an access entry for the host is not documented. */
    close_release(b);
    cubuf_resource_release(r);
    printf("managed allocations: ok\n");
}

/* ---- memory mapped outside the resource -------------------------------------------------- */

/* cubuf_buffer_wrap refuses a VMM resource: its close would have to free a
 * range it does not know. Nothing changes: no buffer, the same statistics,
 * the caller's mapping intact. */
static void test_wrap_refused(cubuf_resource_t *res)
{
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    CUmemAccessDesc acc;
    memset(&acc, 0, sizeof acc);
    acc.location = prop.location;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    size_t n = 4 * g_gran;
    CUdeviceptr va = 0;
    CUmemGenericAllocationHandle h;
    T_CU(cuMemAddressReserve, &va, n, 0, 0, 0);
    T_CU(cuMemCreate, &h, n, &prop, 0);
    T_CU(cuMemMap, va, n, 0, h, 0);
    T_CU(cuMemSetAccess, va, n, &acc, 1);
    write_pattern(va, n, 0, 70);
    /* A live allocation of the resource, so that unchanged is not just zero. */
    cubuf_buffer_t *held = alloc_buf(res, g_gran);
    cubuf_resource_stats_t s0 = stats_of(res);
    cubuf_vmm_live_t live0 = live_now();
    cubuf_buffer_t *w = NULL;
    T_STATUS(cubuf_buffer_wrap(va, n, res, 0, &w), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(w == NULL);
    T_CHECK(strstr(cubuf_last_error(), "virtual memory") != NULL);
    T_STATUS(cubuf_buffer_wrap(va, n, res, CU_STREAM_PER_THREAD, &w), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(w == NULL);
    cubuf_resource_stats_t s1 = stats_of(res);
    T_CHECK(s1.current_bytes == s0.current_bytes && s1.current_count == s0.current_count &&
            s1.peak_bytes == s0.peak_bytes && s1.total_allocations == s0.total_allocations);
    cubuf_vmm_live_t live1 = live_now();
    T_CHECK(live_equal(&live0, &live1));
    T_CHECK(check_pattern(va, n, 0, 70)); /* still the caller's, still mapped */
    close_release(held);
    T_CU(cuMemUnmap, va, n);
    T_CU(cuMemRelease, h);
    T_CU(cuMemAddressFree, va, n);
    cubuf_resource_stats_t s2 = stats_of(res);
    T_CHECK(s2.current_bytes == 0);
}

int main(void)
{
    cubuf_context_t *ctx = NULL;
    cubuf_resource_t *res = vmm_test_start(&ctx, &g_ctx, &g_gran);
    g_host = malloc(SCRATCH);
    if (!g_host) return 1;
    printf("granularity %zu bytes\n", g_gran);
    t_held_t held0 = t_held();
    cubuf_vmm_live_t live0 = live_now();

    test_options();
    test_allocate(res);
    test_grow_in_place(res);
    test_grow_moving(res);
    test_close_orders(res);
    test_mixed_access(res);
    test_buffer_ops(res);
    test_host_and_managed();
    test_wrap_refused(res);

    cubuf_resource_stats_t s = stats_of(res);
    T_CHECK(s.current_bytes == 0 && s.current_count == 0);
    cubuf_vmm_live_t live1 = live_now();
    T_CHECK(live_equal(&live0, &live1));
    cubuf_resource_release(res);
    T_HELD_BACK(held0, "test_vmm_basic");
    free(g_host);
    cubuf_context_destroy(ctx);
    return t_finish("test_vmm_basic");
}
