/* Option and result structs across library versions (src/abi.h), without a
 * GPU or driver. For each struct type:
 *  - a struct of its first released size (CUBUF_<TYPE>_SIZE_V1) is accepted;
 *    an input is placed right before an inaccessible page, so reading past
 *    what the caller gave faults; an output is followed by guard bytes,
 *    which must stay untouched;
 *  - one byte short is refused with CUBUF_ERROR_INVALID_ARGUMENT naming the
 *    type and the sizes (and an output is not written);
 *  - a bigger struct (a newer header) is accepted.
 * Calls that get past the struct need the driver: with none they stop at
 * CUBUF_ERROR_NO_DRIVER, which shows the struct was accepted. User resource
 * ops are read by their declared version. */
#include <stdint.h>
#include <sys/socket.h>
#include <unistd.h>

#include "abi_test.h"
#include "cubuf/adaptor.h"
#include "cubuf/caching.h"
#include "cubuf/dist.h"
#include "cubuf/dlpack.h"
#include "../fuzz/ipc_seeds.h"

/* ---- a user resource ------------------------------------------------------- */

static int allocs;

static cubuf_status_t u_alloc(void *state, size_t size, CUstream stream, CUdeviceptr *ptr)
{
    (void)state, (void)size, (void)stream;
    allocs++;
    *ptr = 0x10000;
    return CUBUF_SUCCESS;
}

static cubuf_status_t u_free(void *state, CUdeviceptr ptr, size_t size, CUstream stream)
{
    (void)state, (void)ptr, (void)size, (void)stream;
    return CUBUF_SUCCESS;
}

static const cubuf_resource_ops_t k_ops = {CUBUF_RESOURCE_OPS_VERSION, u_alloc, u_free, NULL};
static const CUstream k_stream = (CUstream)(uintptr_t)0x5000; /* needs no driver */

static cubuf_status_t make_user(const cubuf_resource_props_t *props, cubuf_resource_t **out)
{
    *out = NULL;
    return cubuf_resource_create(&k_ops, props, NULL, out);
}

static bool same_props(const cubuf_resource_props_t *a, const cubuf_resource_props_t *b)
{
    return a->device_id == b->device_id && a->device_accessible == b->device_accessible &&
           a->host_accessible == b->host_accessible && a->managed == b->managed &&
           a->ipc_enabled == b->ipc_enabled;
}

static bool same_desc_info(const cubuf_ipc_descriptor_info_t *a, const cubuf_ipc_descriptor_info_t *b)
{
    return a->mechanism == b->mechanism && a->size == b->size && a->offset == b->offset &&
           a->extent == b->extent && a->fd_count == b->fd_count &&
           a->chunk_count == b->chunk_count && a->host_accessible == b->host_accessible;
}

/* Creates a user resource with `props`, checks it took them, releases it. */
static cubuf_status_t create_and_check(const cubuf_resource_props_t *props)
{
    cubuf_resource_t *res = NULL;
    cubuf_status_t st = make_user(props, &res);
    if (st != CUBUF_SUCCESS) return st;
    cubuf_resource_props_t got = CUBUF_RESOURCE_PROPS_INIT;
    T_OK(cubuf_resource_props(res, &got));
    T_CHECK(got.device_id == 3 && got.host_accessible && got.ipc_enabled && !got.device_accessible &&
            got.struct_size == sizeof got);
    cubuf_resource_release(res);
    return CUBUF_SUCCESS;
}

static void test_resource_props(void)
{
    /* Input: cubuf_resource_create copies what it is given. */
    cubuf_resource_props_t p = CUBUF_RESOURCE_PROPS_INIT;
    p.device_id = 3;
    p.host_accessible = true;
    p.ipc_enabled = true;
    cubuf_resource_t *res = NULL;
    INPUTS(cubuf_resource_props_t, p, CUBUF_RESOURCE_PROPS_SIZE_V1, create_and_check(o_),
           CUBUF_SUCCESS);

    /* Output: cubuf_resource_props writes no further than struct_size. */
    T_REQUIRE(make_user(&p, &res));
    cubuf_resource_props_t full = CUBUF_RESOURCE_PROPS_INIT;
    T_OK(cubuf_resource_props(res, &full));
    OUTPUTS(cubuf_resource_props_t, CUBUF_RESOURCE_PROPS_SIZE_V1, cubuf_resource_props(res, o_),
            same_props, full);
    cubuf_resource_release(res);
}

static void test_resource_ops(void)
{
    /* Version 1 ops of exactly their size, ending at the guard page: read no
     * further, and working. */
    cubuf_resource_ops_t *ops = (cubuf_resource_ops_t *)(void *)(guard_page - CUBUF_RESOURCE_OPS_SIZE_V1);
    memcpy(ops, &k_ops, CUBUF_RESOURCE_OPS_SIZE_V1);
    ops->version = 1;
    cubuf_resource_t *res = NULL;
    T_OK(cubuf_resource_create(ops, NULL, NULL, &res));
    cubuf_buffer_t *buf = NULL;
    allocs = 0;
    T_OK(cubuf_resource_allocate(res, 64, k_stream, &buf));
    T_CHECK(allocs == 1 && cubuf_buffer_ptr(buf) == 0x10000);
    cubuf_buffer_release(buf);
    cubuf_resource_release(res);
    ops->version = 0;
    T_STATUS(cubuf_resource_create(ops, NULL, NULL, &res), CUBUF_ERROR_NOT_SUPPORTED);
    ops->version = CUBUF_RESOURCE_OPS_VERSION + 1;
    T_STATUS(cubuf_resource_create(ops, NULL, NULL, &res), CUBUF_ERROR_NOT_SUPPORTED);
}

static void test_driver_options(void)
{
    cubuf_resource_t *res = NULL;
    /* cubuf_device_resource_create reads its options before the device. */
    cubuf_device_resource_options_t pool = CUBUF_DEVICE_RESOURCE_OPTIONS_INIT;
    INPUTS(cubuf_device_resource_options_t, pool, CUBUF_DEVICE_RESOURCE_OPTIONS_SIZE_V1,
           cubuf_device_resource_create(0, o_, &res), CUBUF_ERROR_NO_DRIVER);
    /* So do the VMM create and the copies. */
    cubuf_vmm_options_t vmm = CUBUF_VMM_OPTIONS_INIT;
    vmm.peer_access = CUBUF_VMM_ACCESS_READ; /* the last field of version 1 */
    INPUTS(cubuf_vmm_options_t, vmm, CUBUF_VMM_OPTIONS_SIZE_V1,
           cubuf_vmm_resource_create(0, o_, &res), CUBUF_ERROR_NO_DRIVER);
    T_CHECK(res == NULL);
    const cubuf_copy_t copy = {0x10000, 0x20000, 16};
    cubuf_copy_options_t c = CUBUF_COPY_OPTIONS_INIT;
    c.prefer_overlap_with_compute = true;
    INPUTS(cubuf_copy_options_t, c, CUBUF_COPY_OPTIONS_SIZE_V1,
           cubuf_copy_batch(&copy, 1, CU_STREAM_PER_THREAD, o_, NULL), CUBUF_ERROR_NO_DRIVER);
    /* Device info is an output, checked before the driver is loaded. */
    cubuf_device_info_t *info = output(CUBUF_DEVICE_INFO_SIZE_V1);
    T_STATUS(cubuf_device_get_info(0, info), CUBUF_ERROR_NO_DRIVER);
    info = output(CUBUF_DEVICE_INFO_SIZE_V1 - 1);
    T_STATUS(cubuf_device_get_info(0, info), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(detail_names("cubuf_device_info_t", CUBUF_DEVICE_INFO_SIZE_V1 - 1,
                         CUBUF_DEVICE_INFO_SIZE_V1));
    info = output(sizeof *info + MORE);
    T_STATUS(cubuf_device_get_info(0, info), CUBUF_ERROR_NO_DRIVER);
    T_CHECK(untouched_from(sizeof(size_t)));
}

static void test_ipc(void)
{
    /* A legacy descriptor (no fds) made from its wire format. */
    uint8_t bytes[CUBUF_IPC_LEGACY_BYTES];
    seed_legacy(bytes);
    cubuf_ipc_descriptor_t *desc = NULL;
    T_REQUIRE(cubuf_ipc_descriptor_deserialize(bytes, sizeof bytes, NULL, 0, &desc));
    cubuf_ipc_descriptor_info_t full = CUBUF_IPC_DESCRIPTOR_INFO_INIT;
    T_OK(cubuf_ipc_descriptor_info(desc, &full));
    T_CHECK(full.size == 1000 && full.offset == 24 && full.mechanism == CUBUF_IPC_MECHANISM_LEGACY);
    OUTPUTS(cubuf_ipc_descriptor_info_t, CUBUF_IPC_DESCRIPTOR_INFO_SIZE_V1,
            cubuf_ipc_descriptor_info(desc, o_), same_desc_info, full);

    cubuf_buffer_t *buf = NULL;
    cubuf_ipc_import_options_t imp = CUBUF_IPC_IMPORT_OPTIONS_INIT;
    imp.access = CUBUF_IPC_ACCESS_READ;
    INPUTS(cubuf_ipc_import_options_t, imp, CUBUF_IPC_IMPORT_OPTIONS_SIZE_V1,
           cubuf_buffer_from_ipc_descriptor(NULL, o_, desc, NULL, &buf), CUBUF_ERROR_NO_DRIVER);
    T_CHECK(buf == NULL);
    cubuf_ipc_descriptor_destroy(desc);

    /* Receive options: the timeout (a version-1 field) is honoured, so an
     * idle socket times out instead of waiting forever. */
    int sv[2];
    T_CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    cubuf_ipc_recv_options_t r = CUBUF_IPC_RECV_OPTIONS_INIT;
    r.timeout_ms = 20;
    cubuf_ipc_descriptor_t *got = NULL;
    INPUTS(cubuf_ipc_recv_options_t, r, CUBUF_IPC_RECV_OPTIONS_SIZE_V1,
           cubuf_ipc_recv(sv[0], o_, &got), CUBUF_ERROR_SYSTEM);
    T_CHECK(got == NULL && strstr(cubuf_last_error(), "timed out"));
    close(sv[0]);
    close(sv[1]);
}

/* ---- adaptors, the caching resource, DLPack and dist.h over host memory ---- */

static cubuf_resource_t *host_res; /* a user resource of host memory: no driver needed */

static cubuf_status_t caching_create(const cubuf_caching_options_t *o)
{
    cubuf_resource_t *res = NULL;
    cubuf_status_t st = cubuf_caching_resource_create(host_res, o, &res);
    cubuf_resource_release(res);
    return st;
}

static void log_line(void *user, const char *line) { (void)user, (void)line; }

static cubuf_status_t log_create(const cubuf_log_options_t *o)
{
    cubuf_resource_t *res = NULL;
    cubuf_status_t st = cubuf_log_adaptor_create(host_res, o, &res);
    cubuf_resource_release(res);
    return st;
}

/* A scope pushed and popped into *o (closed again when the pop is refused). */
static cubuf_status_t scope_pop(cubuf_resource_t *stats, cubuf_statistics_t *o)
{
    T_OK(cubuf_statistics_push(stats));
    cubuf_status_t st = cubuf_statistics_pop(stats, o);
    if (st != CUBUF_SUCCESS) T_OK(cubuf_statistics_pop(stats, NULL));
    return st;
}

static cubuf_status_t dlpack_export(cubuf_buffer_t *buf, const cubuf_dlpack_options_t *o)
{
    DLManagedTensorVersioned *t = NULL;
    cubuf_status_t st = cubuf_buffer_to_dlpack(buf, o, &t);
    if (t) t->deleter(t);
    return st;
}

static bool same_caching_stats(const cubuf_caching_stats_t *a, const cubuf_caching_stats_t *b)
{
    return a->live_bytes == b->live_bytes && a->requested_bytes == b->requested_bytes &&
           a->held_bytes == b->held_bytes && a->live_count == b->live_count &&
           a->misses == b->misses && a->upstream_allocations == b->upstream_allocations &&
           a->oom_retries == b->oom_retries;
}

static bool same_statistics(const cubuf_statistics_t *a, const cubuf_statistics_t *b)
{
    return a->current_bytes == b->current_bytes && a->peak_bytes == b->peak_bytes &&
           a->current_count == b->current_count && a->current_requested == b->current_requested &&
           a->total_bytes == b->total_bytes && a->total_count == b->total_count &&
           a->total_requested == b->total_requested;
}

static bool same_resource_stats(const cubuf_resource_stats_t *a, const cubuf_resource_stats_t *b)
{
    return a->current_bytes == b->current_bytes && a->peak_bytes == b->peak_bytes &&
           a->current_count == b->current_count && a->peak_count == b->peak_count &&
           a->total_allocations == b->total_allocations;
}

static void test_adaptors_and_caching(void)
{
    cubuf_resource_props_t p = CUBUF_RESOURCE_PROPS_INIT;
    p.host_accessible = true;
    T_REQUIRE(make_user(&p, &host_res));

    cubuf_caching_options_t co = CUBUF_CACHING_OPTIONS_INIT;
    co.cross_stream = false; /* the last field of version 1 */
    INPUTS(cubuf_caching_options_t, co, CUBUF_CACHING_OPTIONS_SIZE_V1, caching_create(o_),
           CUBUF_SUCCESS);
    cubuf_resource_t *cache = NULL;
    cubuf_buffer_t *buf = NULL;
    T_REQUIRE(cubuf_caching_resource_create(host_res, NULL, &cache));
    T_REQUIRE(cubuf_resource_allocate(cache, 100, k_stream, &buf));
    cubuf_caching_stats_t cfull = CUBUF_CACHING_STATS_INIT;
    T_OK(cubuf_caching_stats(cache, &cfull));
    T_CHECK(cfull.live_count == 1 && cfull.requested_bytes == 100);
    OUTPUTS(cubuf_caching_stats_t, CUBUF_CACHING_STATS_SIZE_V1, cubuf_caching_stats(cache, o_),
            same_caching_stats, cfull);
    cubuf_buffer_release(buf);
    cubuf_resource_release(cache);

    cubuf_log_options_t lo = CUBUF_LOG_OPTIONS_INIT;
    lo.callback = log_line;
    INPUTS(cubuf_log_options_t, lo, CUBUF_LOG_OPTIONS_SIZE_V1, log_create(o_), CUBUF_SUCCESS);

    cubuf_resource_t *stats = NULL;
    T_REQUIRE(cubuf_statistics_adaptor_create(host_res, &stats));
    T_REQUIRE(cubuf_resource_allocate(stats, 100, k_stream, &buf));
    cubuf_statistics_t sfull = CUBUF_STATISTICS_INIT;
    T_OK(cubuf_statistics_get(stats, &sfull));
    T_CHECK(sfull.current_requested == 100 && sfull.total_count == 1);
    OUTPUTS(cubuf_statistics_t, CUBUF_STATISTICS_SIZE_V1, cubuf_statistics_get(stats, o_),
            same_statistics, sfull);
    cubuf_statistics_t pfull = CUBUF_STATISTICS_INIT;
    T_OK(scope_pop(stats, &pfull));
    OUTPUTS(cubuf_statistics_t, CUBUF_STATISTICS_SIZE_V1, scope_pop(stats, o_), same_statistics,
            pfull);
    cubuf_resource_stats_t rfull = CUBUF_RESOURCE_STATS_INIT;
    T_OK(cubuf_resource_stats(stats, &rfull));
    T_CHECK(rfull.current_count == 1 && rfull.total_allocations == 1);
    OUTPUTS(cubuf_resource_stats_t, CUBUF_RESOURCE_STATS_SIZE_V1, cubuf_resource_stats(stats, o_),
            same_resource_stats, rfull);
    cubuf_buffer_release(buf);
    cubuf_resource_release(stats);

    /* DLPack options: read_only, the last field of version 1, is honoured. */
    T_REQUIRE(cubuf_resource_allocate(host_res, 64, k_stream, &buf));
    cubuf_dlpack_options_t dl = CUBUF_DLPACK_OPTIONS_INIT;
    dl.read_only = true;
    INPUTS(cubuf_dlpack_options_t, dl, CUBUF_DLPACK_OPTIONS_SIZE_V1, dlpack_export(buf, o_),
           CUBUF_SUCCESS);
    DLManagedTensor *t = NULL;
    const cubuf_dlpack_options_t *o = input(&dl, sizeof dl, CUBUF_DLPACK_OPTIONS_SIZE_V1);
    T_STATUS(cubuf_buffer_to_dlpack_unversioned(buf, o, &t), CUBUF_ERROR_NOT_SUPPORTED);
    T_CHECK(t == NULL);

    /* dist.h: the structs are checked before the driver is needed. */
    cubuf_dmabuf_options_t dmo = CUBUF_DMABUF_OPTIONS_INIT;
    cubuf_dmabuf_t dmabuf = CUBUF_DMABUF_INIT;
    INPUTS(cubuf_dmabuf_options_t, dmo, CUBUF_DMABUF_OPTIONS_SIZE_V1,
           cubuf_buffer_export_dmabuf(buf, o_, &dmabuf), CUBUF_ERROR_NO_DRIVER);
    T_CHECK(dmabuf.fd == -1);
#define DIST_OUTPUT(type, v1, call)                                                      \
    do {                                                                                 \
        type *o_ = output(v1);                                                           \
        T_STATUS(call, CUBUF_ERROR_NO_DRIVER);                                           \
        o_ = output((v1) - 1);                                                           \
        T_STATUS(call, CUBUF_ERROR_INVALID_ARGUMENT);                                    \
        T_CHECK(detail_names(#type, (v1) - 1, (v1)));                                    \
        o_ = output(0);                                                                  \
        T_STATUS(call, CUBUF_ERROR_INVALID_ARGUMENT);                                    \
        o_ = output(SIZE_MAX);                                                           \
        T_STATUS(call, CUBUF_ERROR_NO_DRIVER);                                           \
        T_CHECK(untouched_from(sizeof(size_t)));                                         \
    } while (0)
    DIST_OUTPUT(cubuf_dmabuf_t, CUBUF_DMABUF_SIZE_V1, cubuf_buffer_export_dmabuf(buf, NULL, o_));
    DIST_OUTPUT(cubuf_memory_info_t, CUBUF_MEMORY_INFO_SIZE_V1, cubuf_buffer_memory_info(buf, o_));
    DIST_OUTPUT(cubuf_physical_info_t, CUBUF_PHYSICAL_INFO_SIZE_V1,
                cubuf_buffer_physical_allocation(buf, 0, o_));
    DIST_OUTPUT(cubuf_dist_caps_t, CUBUF_DIST_CAPS_SIZE_V1, cubuf_device_dist_caps(0, o_));
#undef DIST_OUTPUT
    cubuf_buffer_release(buf);
    cubuf_resource_release(host_res);
}

int main(void)
{
    setenv("CUBUF_LIBCUDA", "/nonexistent/libcuda-for-cubuf-test_abi.so.1", 1);
    guard_init();
    test_resource_props();
    test_resource_ops();
    test_driver_options();
    test_ipc();
    test_adaptors_and_caching();
    return t_finish("test_abi");
}
