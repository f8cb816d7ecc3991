/* What the virtual-memory tests share. */
#ifndef CUBUF_VMM_TEST_H
#define CUBUF_VMM_TEST_H

#include "test.h"

/* The first use of a stream, a memset, a copy, a graph and of virtual
 * memory may make the driver allocate memory for itself, for good: do each
 * once before taking device-memory baselines. */
static void warm_up(cubuf_resource_t *res, bool graph)
{
    size_t gran = 0;
    T_REQUIRE(cubuf_vmm_granularity(res, &gran));
    CUstream s;
    T_CU(cuStreamCreate, &s, CU_STREAM_NON_BLOCKING);
    CUdeviceptr d = 0;
    T_CU(cuMemAlloc, &d, (size_t)1 << 20);
    T_CU(cuMemsetD8Async, d, 1, (size_t)1 << 20, s);
    T_CU(cuMemsetD32Async, d, 1, (size_t)1 << 18, s);
    T_CU(cuMemsetD8Async, d, 1, (size_t)1 << 20, NULL);
    T_CU(cuStreamSynchronize, s);
    unsigned char h[64];
    T_CU(cuMemcpyDtoH, h, d, sizeof h);
    T_CU(cuMemcpyHtoD, d, h, sizeof h);
    T_CU(cuMemcpy, d, d + 4096, sizeof h);
    T_CU(cuMemsetD8, d, 0, 4096);
    if (graph) {
        CUgraph gr = NULL;
        CUgraphExec ex = NULL;
        T_CU(cuStreamBeginCapture, s, CU_STREAM_CAPTURE_MODE_GLOBAL);
        T_CU(cuMemsetD8Async, d, 2, 4096, s);
        T_CU(cuStreamEndCapture, s, &gr);
        T_CU(cuGraphInstantiateWithFlags, &ex, gr, 0);
        T_CU(cuGraphLaunch, ex, s);
        T_CU(cuStreamSynchronize, s);
        T_CU(cuGraphExecDestroy, ex);
        T_CU(cuGraphDestroy, gr);
    }
    cubuf_buffer_t *b = NULL, *g = NULL, *m = NULL;
    T_REQUIRE(cubuf_resource_allocate(res, 1, s, &b));
    T_REQUIRE(cubuf_vmm_modify_allocation(res, b, 2 * gran, NULL, &g));
    T_REQUIRE(cubuf_vmm_modify_allocation(res, b, 3 * gran, NULL, &m)); /* moves */
    T_REQUIRE(cubuf_buffer_fill_byte(g, 0, s));
    T_CU(cuStreamSynchronize, s);
    T_REQUIRE(cubuf_buffer_close(m));
    T_REQUIRE(cubuf_buffer_close(g));
    T_REQUIRE(cubuf_buffer_close(b));
    cubuf_buffer_release(m);
    cubuf_buffer_release(g);
    cubuf_buffer_release(b);
    T_CU(cuMemFree, d);
    T_CU(cuStreamDestroy, s);
}

#endif
