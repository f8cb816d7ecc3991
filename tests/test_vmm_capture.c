/* Close rules of virtual memory buffers under stream capture:
 *  - a close whose own (non-default) deallocation stream is capturing fails
 *    with CUBUF_ERROR_STREAM_CAPTURING and leaves the buffer open;
 *  - a close that must wait for another alias's capturing stream fails the
 *    same way;
 *  - a legacy default stream that would disturb a capture of a blocking
 *    stream in the same context is not synchronized: the warning handler
 *    hears about it, the memory is released, and the capture still ends
 *    successfully and its graph runs;
 *  - a close that unmaps nothing, on a legacy default stream a capture keeps
 *    it from recording, warns of nothing: the close that later releases the
 *    memory checks that stream and, the capture over, synchronizes it. */
#include <stdint.h>

#include "fault.h"
#include "test.h"
#include "vmm_test.h"
#include "vmm.h"

static size_t g_gran;

static int g_warnings;
static cubuf_status_t g_warn_status;
static char g_warn_msg[1024];

static void on_warning(cubuf_status_t st, const char *msg, void *user)
{
    (void)user;
    g_warnings++;
    g_warn_status = st;
    snprintf(g_warn_msg, sizeof g_warn_msg, "%s", msg);
}

static cubuf_resource_stats_t stats_of(cubuf_resource_t *res)
{
    cubuf_resource_stats_t s = CUBUF_RESOURCE_STATS_INIT;
    T_OK(cubuf_resource_stats(res, &s));
    return s;
}

static bool reads_byte(CUdeviceptr p, size_t n, unsigned char v)
{
    unsigned char h[256];
    T_CU(cuMemcpyDtoH, h, p + n - sizeof h, sizeof h);
    for (size_t i = 0; i < sizeof h; i++)
        if (h[i] != v) return false;
    return true;
}

/* Captures one memset into `scratch` on `s`, then ends the capture and runs
 * the graph: the capture must have survived whatever happened meanwhile. */
static void begin(CUstream s) { T_CU(cuStreamBeginCapture, s, CU_STREAM_CAPTURE_MODE_GLOBAL); }

static void capture_work(CUstream s, CUdeviceptr scratch)
{
    T_CU(cuMemsetD8Async, scratch, 0x42, 4096, s);
}

static void end_and_run(CUstream s, CUdeviceptr scratch)
{
    CUgraph graph = NULL;
    CUresult r = cubuf__drv.cuStreamEndCapture(s, &graph);
    T_CHECK(r == CUDA_SUCCESS && graph != NULL);
    if (r != CUDA_SUCCESS || !graph) {
        fprintf(stderr, "cuStreamEndCapture: %d\n", (int)r);
        return;
    }
    CUgraphExec exec = NULL;
    T_CU(cuGraphInstantiateWithFlags, &exec, graph, 0);
    T_CU(cuMemsetD8, scratch, 0, 4096);
    T_CU(cuCtxSynchronize);
    T_CU(cuGraphLaunch, exec, s);
    T_CU(cuStreamSynchronize, s);
    T_CHECK(reads_byte(scratch, 4096, 0x42));
    T_CU(cuGraphExecDestroy, exec);
    T_CU(cuGraphDestroy, graph);
}

static void test_own_stream(cubuf_resource_t *res, CUdeviceptr scratch)
{
    CUstream s;
    T_CU(cuStreamCreate, &s, CU_STREAM_NON_BLOCKING);
    cubuf_buffer_t *b = NULL, *l = NULL;
    T_REQUIRE(cubuf_resource_allocate(res, g_gran, s, &b));
    T_REQUIRE(cubuf_resource_allocate(res, g_gran, 0, &l));
    CUdeviceptr bp = cubuf_buffer_ptr(b), lp = cubuf_buffer_ptr(l);
    T_CU(cuMemsetD8, bp, 0x11, g_gran);
    cubuf_buffer_t *extra = NULL; /* an alias of b, recording s too */
    T_REQUIRE(cubuf_vmm_modify_allocation(res, b, 1, NULL, &extra));

    begin(s);
    capture_work(s, scratch);
    T_STATUS(cubuf_buffer_close(b), CUBUF_ERROR_STREAM_CAPTURING);
    T_CHECK(!cubuf_buffer_is_closed(b) && cubuf_buffer_ptr(b) == bp && cubuf_buffer_size(b) == g_gran);
    /* close_on with the capturing stream: refused, and the recorded stream is kept. */
    T_STATUS(cubuf_buffer_close_on(l, s), CUBUF_ERROR_STREAM_CAPTURING);
    T_CHECK(!cubuf_buffer_is_closed(l) && cubuf_buffer_ptr(l) == lp);
    /* The last release of the alias cannot close it either: it warns, and
     * its membership goes with it (b still maps the memory and frees it). */
    int w0 = g_warnings;
    cubuf_buffer_release(extra);
    T_CHECK(g_warnings == w0 + 1);
    end_and_run(s, scratch);

    /* Still open and intact after the capture. */
    T_CHECK(reads_byte(bp, g_gran, 0x11));
    T_OK(cubuf_buffer_close(b));
    T_OK(cubuf_buffer_close(l)); /* on its recorded legacy stream */
    cubuf_buffer_release(b);
    cubuf_buffer_release(l);
    cubuf_resource_stats_t st = stats_of(res);
    T_CHECK(st.current_bytes == 0 && st.current_count == 0);
    T_CU(cuStreamDestroy, s);
}

static void test_other_alias_stream(cubuf_resource_t *res, CUdeviceptr scratch)
{
    size_t base_bytes = stats_of(res).current_bytes;
    CUstream s;
    T_CU(cuStreamCreate, &s, CU_STREAM_NON_BLOCKING);
    cubuf_buffer_t *a = NULL, *x = NULL, *b = NULL;
    T_REQUIRE(cubuf_resource_allocate(res, g_gran, 0, &a));
    /* x maps the addresses right after a, so b = grow(a) moves: a and b
     * then live in different spaces and closing a unmaps a's mapping. */
    T_REQUIRE(cubuf_vmm_modify_allocation(res, a, 2 * g_gran, NULL, &x));
    T_REQUIRE(cubuf_vmm_modify_allocation(res, a, 3 * g_gran, NULL, &b));
    T_CHECK(cubuf_buffer_ptr(b) != cubuf_buffer_ptr(a));
    T_OK(cubuf_buffer_close(x));
    cubuf_buffer_release(x);
    T_OK(cubuf_buffer_set_deallocation_stream(b, s));
    T_CU(cuMemsetD8, cubuf_buffer_ptr(a), 0x22, g_gran);

    begin(s);
    capture_work(s, scratch);
    T_STATUS(cubuf_buffer_close(a), CUBUF_ERROR_STREAM_CAPTURING);
    T_CHECK(!cubuf_buffer_is_closed(a));
    end_and_run(s, scratch);
    T_CHECK(reads_byte(cubuf_buffer_ptr(a), g_gran, 0x22));
    T_CHECK(reads_byte(cubuf_buffer_ptr(b), g_gran, 0x22));
    T_OK(cubuf_buffer_close(a));
    T_OK(cubuf_buffer_close(b));
    cubuf_buffer_release(a);
    cubuf_buffer_release(b);
    T_CHECK(stats_of(res).current_bytes == base_bytes);
    T_CU(cuStreamDestroy, s);
}

static void test_legacy_during_capture(cubuf_resource_t *res, CUdeviceptr scratch, bool alias)
{
    size_t base_bytes = stats_of(res).current_bytes;
    cubuf_vmm_live_t live0;
    cubuf__vmm_live(&live0);
    t_held_t held0 = t_held();
    CUstream blocking;
    T_CU(cuStreamCreate, &blocking, CU_STREAM_DEFAULT);
    cubuf_buffer_t *b = NULL, *g = NULL;
    T_REQUIRE(cubuf_resource_allocate(res, 64 * g_gran, CU_STREAM_LEGACY, &b));
    if (alias) T_REQUIRE(cubuf_vmm_modify_allocation(res, b, 1, NULL, &g));

    int w0 = g_warnings;
    begin(blocking);
    capture_work(blocking, scratch);
    /* The legacy stream would wait on the capturing blocking stream. */
    T_OK(cubuf_buffer_close(b));
    T_CHECK(cubuf_buffer_is_closed(b));
    if (g) T_OK(cubuf_buffer_close(g));
    T_CHECK(g_warnings >= w0 + 1);
    T_CHECK(g_warn_status == CUBUF_ERROR_STREAM_CAPTURING);
    if (g_warnings > w0) printf("warning as expected: %s\n", g_warn_msg);
    end_and_run(blocking, scratch);

    cubuf_buffer_release(b);
    cubuf_buffer_release(g);
    T_CHECK(stats_of(res).current_bytes == base_bytes);
    cubuf_vmm_live_t live1;
    cubuf__vmm_live(&live1);
    T_CHECK(live1.reservations == live0.reservations && live1.mappings == live0.mappings &&
            live1.allocations == live0.allocations && live1.waiters == live0.waiters);
    T_HELD_BACK(held0, alias ? "legacy stream during capture, with an alias"
                             : "legacy stream during capture");
    T_CU(cuStreamDestroy, blocking);
}

/* The old buffer of a grow in place closes on the legacy stream while a
 * blocking stream captures: nothing is unmapped and the legacy stream cannot
 * be recorded. The page: "a default stream is checked when the range is
 * released instead", so no warning now, and the release (the capture over)
 * synchronizes the legacy stream besides the grown buffer's own stream. */
static void test_legacy_checked_at_release(cubuf_resource_t *res, CUdeviceptr scratch)
{
    size_t base_bytes = stats_of(res).current_bytes;
    CUstream blocking, s2;
    T_CU(cuStreamCreate, &blocking, CU_STREAM_DEFAULT);
    T_CU(cuStreamCreate, &s2, CU_STREAM_NON_BLOCKING);
    cubuf_buffer_t *b = NULL, *g = NULL;
    T_REQUIRE(cubuf_resource_allocate(res, g_gran, CU_STREAM_LEGACY, &b));
    T_REQUIRE(cubuf_vmm_modify_allocation(res, b, 2 * g_gran, NULL, &g));
    T_CHECK(cubuf_buffer_ptr(g) == cubuf_buffer_ptr(b));
    T_OK(cubuf_buffer_set_deallocation_stream(g, s2));

    int w0 = g_warnings;
    begin(blocking);
    capture_work(blocking, scratch);
    T_OK(cubuf_buffer_close(b)); /* unmaps nothing: g maps it all */
    T_CHECK(g_warnings == w0);
    if (g_warnings != w0) fprintf(stderr, "warned at the close that unmapped nothing: %s\n", g_warn_msg);
    end_and_run(blocking, scratch);

    cubuf_fault_count_calls(true);
    T_OK(cubuf_buffer_close(g));
    unsigned long syncs = cubuf_fault_calls("cuStreamSynchronize");
    cubuf_fault_count_calls(false);
    /* s2 and the legacy stream b recorded. */
    T_CHECK(syncs == 2);
    if (syncs != 2) fprintf(stderr, "the release synchronized %lu streams, not 2\n", syncs);
    T_CHECK(g_warnings == w0);
    cubuf_buffer_release(b);
    cubuf_buffer_release(g);
    T_CHECK(stats_of(res).current_bytes == base_bytes);
    T_CU(cuStreamDestroy, s2);
    T_CU(cuStreamDestroy, blocking);
}

int main(void)
{
    cubuf_context_t *ctx = NULL;
    CUcontext cu = NULL;
    cubuf_resource_t *res = vmm_test_start(&ctx, &cu, &g_gran);
    cubuf_set_warning_handler(on_warning, NULL);
    t_held_t held0 = t_held();
    CUdeviceptr scratch = 0;
    T_CU(cuMemAlloc, &scratch, 4096);

    test_own_stream(res, scratch);
    test_other_alias_stream(res, scratch);
    test_legacy_during_capture(res, scratch, false);
    test_legacy_during_capture(res, scratch, true);
    test_legacy_checked_at_release(res, scratch);

    T_CU(cuMemFree, scratch);
    cubuf_set_warning_handler(NULL, NULL);
    cubuf_resource_stats_t s = stats_of(res);
    T_CHECK(s.current_bytes == 0 && s.current_count == 0);
    cubuf_resource_release(res);
    T_HELD_BACK(held0, "test_vmm_capture");
    cubuf_context_destroy(ctx);
    return t_finish("test_vmm_capture");
}
