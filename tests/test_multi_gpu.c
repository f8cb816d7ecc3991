/* Two GPUs: pool peer access, VMM peers, and copies between devices (plain,
 * captured into a graph, and failing). Exits 77 with fewer than two devices. */
#include <string.h>

#include "fault.h"
#include "internal.h"
#include "test.h"

#define N ((size_t)2 << 20)

/* Device `ctx`'s engines write `value` over [p, p+n): from another device
 * this needs access to p's memory. */
static void write_from(CUcontext ctx, CUdeviceptr p, size_t n, unsigned char value)
{
    T_CU(cuCtxPushCurrent, ctx);
    T_CU(cuMemsetD8, p, value, n);
    T_CU(cuCtxSynchronize);
    CUcontext popped;
    T_CU(cuCtxPopCurrent, &popped);
}

static size_t count_not(CUdeviceptr p, size_t n, unsigned char value)
{
    static unsigned char h[N];
    T_CU(cuMemcpyDtoH, h, p, n);
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) bad += h[i] != value;
    return bad;
}

int main(void)
{
    t_require_gpus(2);
    bool can01 = false, can10 = false;
    T_OK(cubuf_device_can_access_peer(1, 0, &can10));
    T_OK(cubuf_device_can_access_peer(0, 1, &can01));
    printf("peer access: 1 -> 0 %s, 0 -> 1 %s\n", can10 ? "yes" : "no", can01 ? "yes" : "no");
    cubuf_context_t *c0 = NULL, *c1 = NULL;
    T_REQUIRE(cubuf_context_create(0, &c0));
    T_REQUIRE(cubuf_context_create(1, &c1));
    T_CU(cuCtxSetCurrent, t_cu(c0));

    /* 1. A private pool on device 0: device 1 has no access until granted. */
    cubuf_device_resource_options_t o = CUBUF_DEVICE_RESOURCE_OPTIONS_INIT;
    o.private_pool = true;
    cubuf_resource_t *pool = NULL;
    T_REQUIRE(cubuf_device_resource_create(0, &o, &pool));
    bool granted = true;
    T_OK(cubuf_resource_peer_access(pool, 1, &granted));
    T_CHECK(!granted);
    if (!can10) {
        T_STATUS(cubuf_resource_set_peer_access(pool, 1, true), CUBUF_ERROR_NOT_SUPPORTED);
    } else {
        T_OK(cubuf_resource_set_peer_access(pool, 1, true));
        T_OK(cubuf_resource_peer_access(pool, 1, &granted));
        T_CHECK(granted);
        cubuf_buffer_t *b = NULL;
        T_REQUIRE(cubuf_resource_allocate(pool, N, CU_STREAM_LEGACY, &b));
        T_CU(cuCtxSynchronize);
        write_from(t_cu(c1), cubuf_buffer_ptr(b), N, 0x21);
        T_CHECK(count_not(cubuf_buffer_ptr(b), N, 0x21) == 0);
        cubuf_buffer_release(b);
        T_OK(cubuf_resource_set_peer_access(pool, 1, false));
        T_OK(cubuf_resource_peer_access(pool, 1, &granted));
        T_CHECK(!granted);
    }
    cubuf_resource_release(pool);

    /* 2. Virtual memory on device 0 with device 1 as a peer: device 1 writes
     * the first part and, after a grow, the new part. */
    cubuf_vmm_options_t vo = CUBUF_VMM_OPTIONS_INIT;
    vo.peers[0] = 1;
    vo.peer_count = 1;
    cubuf_resource_t *vmm = NULL;
    cubuf_status_t st = cubuf_vmm_resource_create(0, &vo, &vmm);
    if (!can10) {
        T_CHECK(st == CUBUF_ERROR_NOT_SUPPORTED);
    } else {
        T_REQUIRE(st);
        cubuf_buffer_t *a = NULL, *g = NULL;
        T_REQUIRE(cubuf_resource_allocate(vmm, N, CU_STREAM_LEGACY, &a));
        write_from(t_cu(c1), cubuf_buffer_ptr(a), N, 0x31);
        T_CHECK(count_not(cubuf_buffer_ptr(a), N, 0x31) == 0);
        T_REQUIRE(cubuf_vmm_modify_allocation(vmm, a, 2 * N, NULL, &g));
        write_from(t_cu(c1), cubuf_buffer_ptr(g) + N, N, 0x32);
        T_CHECK(count_not(cubuf_buffer_ptr(g), N, 0x31) == 0);
        T_CHECK(count_not(cubuf_buffer_ptr(g) + N, N, 0x32) == 0);
        cubuf_buffer_release(a);
        cubuf_buffer_release(g);
        cubuf_resource_release(vmm);
    }

    /* 3. Copies between buffers of the two devices, each way, with the
     * contexts of both (pyarrow's copy from another device). */
    cubuf_buffer_t *x = NULL, *y = NULL;
    T_REQUIRE(cubuf_context_new_buffer(c0, N, &x));
    T_REQUIRE(cubuf_context_new_buffer(c1, N, &y));
    T_CHECK(cubuf_buffer_device_id(x) == 0 && cubuf_buffer_device_id(y) == 1);
    T_OK(cubuf_buffer_fill_byte(x, 0x41, CU_STREAM_PER_THREAD));
    T_OK(cubuf_context_synchronize(c0));
    T_OK(cubuf_buffer_copy_from(y, x, CU_STREAM_PER_THREAD, NULL)); /* runs in y's context */
    T_OK(cubuf_context_synchronize(c1));
    T_CU(cuCtxSetCurrent, t_cu(c1));
    T_CHECK(count_not(cubuf_buffer_ptr(y), N, 0x41) == 0);
    T_OK(cubuf_buffer_fill_byte(y, 0x42, CU_STREAM_PER_THREAD));
    T_OK(cubuf_context_synchronize(c1));
    T_OK(cubuf_buffer_copy_from(x, y, CU_STREAM_PER_THREAD, NULL));
    T_OK(cubuf_context_synchronize(c0));
    T_CU(cuCtxSetCurrent, t_cu(c0));
    T_CHECK(count_not(cubuf_buffer_ptr(x), N, 0x42) == 0);

    /* 4. The peer copy captured into a graph (on device 0's stream): nothing
     * moves until the graph runs, then device 1's bytes arrive. */
    T_CU(cuCtxSetCurrent, t_cu(c0));
    T_OK(cubuf_buffer_fill_byte(y, 0x43, CU_STREAM_PER_THREAD));
    T_OK(cubuf_context_synchronize(c1));
    CUstream cs = NULL;
    T_CU(cuStreamCreate, &cs, CU_STREAM_NON_BLOCKING);
    T_CU(cuStreamBeginCapture, cs, CU_STREAM_CAPTURE_MODE_RELAXED);
    T_OK(cubuf_buffer_copy_from(x, y, cs, NULL));
    CUgraph graph = NULL;
    T_CU(cuStreamEndCapture, cs, &graph);
    T_CHECK(count_not(cubuf_buffer_ptr(x), N, 0x42) == 0); /* captured, not run */
    if (graph) {
        CUgraphExec exec = NULL;
        T_CU(cuGraphInstantiateWithFlags, &exec, graph, 0);
        if (exec) {
            T_CU(cuGraphLaunch, exec, cs);
            T_CU(cuStreamSynchronize, cs);
            T_CU(cuGraphExecDestroy, exec);
        }
        T_CU(cuGraphDestroy, graph);
    }
    T_CHECK(count_not(cubuf_buffer_ptr(x), N, 0x43) == 0);
    T_CU(cuStreamDestroy, cs);

    /* 5. A failing peer copy: the error names the call and both devices,
     * the destination keeps its bytes, nothing leaks. */
    T_OK(cubuf_buffer_fill_byte(y, 0x44, CU_STREAM_PER_THREAD));
    T_OK(cubuf_context_synchronize(c1));
    T_CHECK(cubuf_fault_fail_nth("cuMemcpyPeerAsync", 1, CUDA_ERROR_INVALID_VALUE));
    T_STATUS(cubuf_buffer_copy_from(x, y, CU_STREAM_PER_THREAD, NULL), CUBUF_ERROR_DRIVER);
    T_CHECK(cubuf_fault_fired() && cubuf_last_cuda_result() == CUDA_ERROR_INVALID_VALUE);
    cubuf_fault_reset();
    T_CHECK(strstr(cubuf_last_error(), "cuMemcpyPeerAsync") != NULL);
    T_CHECK(strstr(cubuf_last_error(), "from device 1 to device 0") != NULL);
    T_OK(cubuf_context_synchronize(c0));
    T_CHECK(count_not(cubuf_buffer_ptr(x), N, 0x43) == 0);

    cubuf_buffer_release(x);
    cubuf_buffer_release(y);
    size_t b0 = 1, b1 = 1;
    T_OK(cubuf_context_bytes_allocated(c0, &b0));
    T_OK(cubuf_context_bytes_allocated(c1, &b1));
    T_CHECK(b0 == 0 && b1 == 0);

    T_CU(cuCtxSetCurrent, NULL);
    cubuf_context_destroy(c0);
    cubuf_context_destroy(c1);
    return t_finish("test_multi_gpu");
}
