/* The fabric fallback of the VMM resource: asked for fabric handles (alone
 * or with POSIX fds), a resource is made; where the device or the driver
 * refuses fabric (no IMEX channel on the H200, none on the test driver) it
 * has POSIX fds instead and says so (cubuf_resource_fabric_fallback,
 * cubuf_vmm_resource_options, the handle types of its memory), and its
 * buffers export as POSIX-fd descriptors; a failure of another kind while
 * trying fabric stays a failure. */
#include "dist_test.h"

static void check_kind(cubuf_vmm_handle_type_t asked, const char *name, bool fabric_device)
{
    cubuf_vmm_options_t o = CUBUF_VMM_OPTIONS_INIT;
    o.handle_type = asked;
    cubuf_resource_t *res = NULL;
    T_REQUIRE(cubuf_vmm_resource_create(0, &o, &res));
    bool fell_back = false;
    T_OK(cubuf_resource_fabric_fallback(res, &fell_back));
    cubuf_vmm_options_t applied = CUBUF_VMM_OPTIONS_INIT;
    T_OK(cubuf_vmm_resource_options(res, &applied));
    size_t gran = 0;
    T_REQUIRE(cubuf_vmm_granularity(res, &gran));
    cubuf_buffer_t *buf = NULL, *grown = NULL;
    T_REQUIRE(cubuf_resource_allocate(res, gran, CU_STREAM_LEGACY, &buf));
    cubuf_memory_info_t m = CUBUF_MEMORY_INFO_INIT;
    T_OK(cubuf_buffer_memory_info(buf, &m));
    printf("%s: %s; handle types of the memory 0x%x\n", name,
           fell_back ? "fell back to POSIX fds" : "fabric handles made", m.handle_types);
    if (!fabric_device) T_CHECK(fell_back); /* the device cannot have fabric handles */
    if (fell_back) {
        T_CHECK(applied.handle_type == CUBUF_VMM_HANDLE_POSIX_FD);
        T_CHECK(m.handle_types == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
        /* Shared as POSIX fds: one per physical allocation. */
        cubuf_ipc_descriptor_t *desc = NULL;
        T_OK(cubuf_buffer_ipc_descriptor(buf, &desc));
        cubuf_ipc_descriptor_info_t info = CUBUF_IPC_DESCRIPTOR_INFO_INIT;
        if (desc) {
            T_OK(cubuf_ipc_descriptor_info(desc, &info));
            T_CHECK(info.mechanism == CUBUF_IPC_MECHANISM_VMM && info.fd_count == 1);
        }
        cubuf_ipc_descriptor_destroy(desc);
        /* A grow takes the options as applied (or NULL), not the ones asked. */
        T_STATUS(cubuf_vmm_modify_allocation(res, buf, 2 * gran, &o, &grown),
                 CUBUF_ERROR_INVALID_ARGUMENT);
        T_OK(cubuf_vmm_modify_allocation(res, buf, 2 * gran, &applied, &grown));
    } else {
        T_CHECK(applied.handle_type == asked);
        T_CHECK(m.handle_types & CU_MEM_HANDLE_TYPE_FABRIC);
        T_OK(cubuf_vmm_modify_allocation(res, buf, 2 * gran, &o, &grown));
    }
    cubuf_buffer_release(grown);
    cubuf_buffer_release(buf);
    cubuf_resource_release(res);
}

/* A private pool asking for fabric handles: made with them where the
 * driver grants them, else with POSIX fds (then exportable over IPC);
 * refusals are forced with an injected result, so both ways run here. */
static void pool_with(CUresult injected, bool expect_fallback)
{
    cubuf_device_resource_options_t o = CUBUF_DEVICE_RESOURCE_OPTIONS_INIT;
    o.private_pool = true;
    o.fabric = true;
    cubuf_resource_t *res = NULL;
    if (injected != CUDA_SUCCESS) T_CHECK(cubuf_fault_fail_nth("cuMemPoolCreate", 1, injected));
    cubuf_status_t st = cubuf_device_resource_create(0, &o, &res);
    bool fired = cubuf_fault_fired();
    cubuf_fault_reset();
    if (injected == CUDA_ERROR_OUT_OF_MEMORY) { /* not a refusal of fabric: the failure stays */
        T_CHECK(fired);
        T_STATUS(st, CUBUF_ERROR_OUT_OF_MEMORY);
        T_CHECK(res == NULL);
        return;
    }
    T_REQUIRE(st);
    bool fell_back = !expect_fallback;
    T_OK(cubuf_resource_fabric_fallback(res, &fell_back));
    cubuf_resource_props_t p = CUBUF_RESOURCE_PROPS_INIT;
    T_OK(cubuf_resource_props(res, &p));
    printf("pool asking for fabric (%s injected): %s\n", injected ? "a refusal" : "nothing",
           fell_back ? "fell back to POSIX fds" : "made with fabric handles");
    if (injected != CUDA_SUCCESS) T_CHECK(fired && fell_back);
    T_CHECK(p.ipc_enabled == fell_back);
    cubuf_buffer_t *b = NULL;
    T_REQUIRE(cubuf_resource_allocate(res, 1 << 20, CU_STREAM_LEGACY, &b));
    T_OK(cubuf_buffer_fill_byte(b, 7, CU_STREAM_LEGACY));
    if (fell_back) { /* POSIX fds: the pool travels to another process */
        cubuf_ipc_descriptor_t *d = NULL;
        T_OK(cubuf_buffer_ipc_descriptor(b, &d));
        cubuf_ipc_descriptor_destroy(d);
    }
    T_OK(cubuf_buffer_close(b));
    cubuf_buffer_release(b);
    cubuf_resource_release(res);
}

static void test_pool_fallback(void)
{
    cubuf_device_resource_options_t o = CUBUF_DEVICE_RESOURCE_OPTIONS_INIT;
    o.fabric = true;
    cubuf_resource_t *res = NULL;
    T_STATUS(cubuf_device_resource_create(0, &o, &res), CUBUF_ERROR_INVALID_ARGUMENT); /* shared pool */
    pool_with(CUDA_SUCCESS, false);
    pool_with(CUDA_ERROR_NOT_PERMITTED, true);
    pool_with(CUDA_ERROR_NOT_SUPPORTED, true);
    pool_with(CUDA_ERROR_OUT_OF_MEMORY, false);
}

int main(void)
{
    t_require_gpu();
    cubuf_dist_caps_t caps = CUBUF_DIST_CAPS_INIT;
    T_REQUIRE(cubuf_device_dist_caps(0, &caps));
    check_kind(CUBUF_VMM_HANDLE_FABRIC, "fabric", caps.fabric_handles);
    check_kind(CUBUF_VMM_HANDLE_POSIX_FD_FABRIC, "POSIX fd + fabric", caps.fabric_handles);

    /* Resources that got what they asked for. */
    cubuf_vmm_options_t o = CUBUF_VMM_OPTIONS_INIT;
    o.handle_type = CUBUF_VMM_HANDLE_POSIX_FD;
    cubuf_resource_t *res = NULL;
    bool fell_back = true;
    T_REQUIRE(cubuf_vmm_resource_create(0, &o, &res));
    T_OK(cubuf_resource_fabric_fallback(res, &fell_back));
    T_CHECK(!fell_back);
    cubuf_resource_release(res);
    fell_back = true;
    T_REQUIRE(cubuf_sync_device_resource_create(0, &res));
    T_OK(cubuf_resource_fabric_fallback(res, &fell_back));
    T_CHECK(!fell_back);
    T_STATUS(cubuf_resource_fabric_fallback(res, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_resource_fabric_fallback(NULL, &fell_back), CUBUF_ERROR_INVALID_ARGUMENT);
    cubuf_resource_release(res);

    /* Where the device has fabric handles, creating them is tried: a
     * refusal of fabric falls back, any other failure is the result. */
    if (caps.fabric_handles) {
        /* (Where the driver refuses even the granularity of fabric memory,
         * the fallback comes before any cuMemCreate and the fault cannot
         * fire: then the resource is made with POSIX fds.) */
        o.handle_type = CUBUF_VMM_HANDLE_FABRIC;
        res = NULL;
        T_CHECK(cubuf_fault_fail_nth("cuMemCreate", 1, CUDA_ERROR_OUT_OF_MEMORY));
        cubuf_status_t st = cubuf_vmm_resource_create(0, &o, &res);
        bool fired = cubuf_fault_fired();
        cubuf_fault_reset();
        printf("fabric granule failing with CUDA_ERROR_OUT_OF_MEMORY: %s (%s)\n",
               cubuf_status_name(st), fired ? "fault fired" : "refused before cuMemCreate");
        if (fired) {
            T_STATUS(st, CUBUF_ERROR_OUT_OF_MEMORY);
            T_CHECK(res == NULL);
        } else {
            T_OK(st);
            T_OK(cubuf_resource_fabric_fallback(res, &fell_back));
            T_CHECK(fell_back);
        }
        cubuf_resource_release(res);
        res = NULL;
        T_CHECK(cubuf_fault_fail_nth("cuMemCreate", 1, CUDA_ERROR_NOT_SUPPORTED));
        T_REQUIRE(cubuf_vmm_resource_create(0, &o, &res));
        cubuf_fault_reset();
        fell_back = false;
        T_OK(cubuf_resource_fabric_fallback(res, &fell_back));
        T_CHECK(fell_back);
        cubuf_resource_release(res);
    }
    test_pool_fallback();
    return t_finish("test_fabric");
}
