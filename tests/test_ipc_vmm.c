/* Sharing virtual memory (one POSIX fd per physical allocation) with
 * another process started with fork+exec: data both ways from 2 MiB to
 * 1 GiB, a slice at an odd offset, a buffer of several physical allocations
 * made by a moving grow, a read-only import, duplicate imports, import
 * failures at every driver call, descriptors that lie or carry fds that are
 * not CUDA handles (the error names the chunk), the exporter exiting first
 * (the mapping keeps its data), the importer exiting or killed first, fds
 * and memory back to their baselines. */
#include "helper_ipc_suite.h"

/* Imported with read access only: reads work. */
static void read_only(peer_t *me, helper_t *h)
{
    static fd_snap_t fds;
    fds_take(&fds, 0, -1);
    track_begin();
    if (H_OK(h, .op = OP_EXPORT, .mech = PEER_VMM, .size = 6 * PEER_MIB, .seed = 77, .slot = 1).status)
        return;
    cubuf_ipc_descriptor_t *d = suite_recv(h);
    cubuf_ipc_import_options_t o = CUBUF_IPC_IMPORT_OPTIONS_INIT;
    o.access = CUBUF_IPC_ACCESS_READ;
    cubuf_buffer_t *b = NULL;
    if (d) T_OK(cubuf_buffer_from_ipc_descriptor(me->ctx, &o, d, CU_STREAM_LEGACY, &b));
    o.access = (cubuf_ipc_access_t)7;
    cubuf_buffer_t *no = NULL;
    if (d) T_STATUS(cubuf_buffer_from_ipc_descriptor(me->ctx, &o, d, CU_STREAM_LEGACY, &no), CUBUF_ERROR_INVALID_ARGUMENT);
    cubuf_ipc_descriptor_destroy(d);
    if (b) {
        size_t bad = 0;
        T_OK(peer_verify(b, 77, 0, &bad));
        T_CHECK(bad == SIZE_MAX);
        unsigned long long flags = 0;
        CUmemLocation loc = {CU_MEM_LOCATION_TYPE_DEVICE, 0};
        T_CU(cuMemGetAccess, &flags, &loc, cubuf_buffer_ptr(b));
        T_CHECK(flags == CU_MEM_ACCESS_FLAGS_PROT_READ);
    }
    cubuf_buffer_release(b);
    cubuf__drv.cuCtxSynchronize();
    T_CHECK(track_end("vmm: read-only import") == 0);
    H_OK(h, .op = OP_CLEAR, .slot = 1);
    T_CHECK(fds_back("vmm: read-only import", &fds, -1));
}

int main(void)
{
    t_require_gpu();
    peer_t me;
    T_REQUIRE(peer_init(&me, -1));
    track_install();
    suite_require(PEER_VMM);
    static fd_snap_t start;
    fds_take(&start, 0, -1);
    helper_t h = helper_start();
    peer_mech_t m = PEER_VMM;
    suite_arguments(&me, m);
    suite_transfer(&me, &h, m, 2 * PEER_MIB, 0, 0, 0, false); /* warm-up */
    /* From here on the driver's once-per-process files are open: every fd
     * opened later must be closed again (the helper's socket aside). */
    static fd_snap_t warm;
    fds_take(&warm, 0, h.sock);
    suite_transfer(&me, &h, m, 2 * PEER_MIB, 0, 0, 0, true);
    suite_transfer(&me, &h, m, 64 * PEER_MIB, 5 * PEER_MIB + 12, 30 * PEER_MIB + 100, 0, true);
    suite_transfer(&me, &h, m, 64 * PEER_MIB, 0, 0, PEER_GROWN, true);
    suite_transfer(&me, &h, m, 64 * PEER_MIB, 3 * PEER_MIB + 1, 60 * PEER_MIB, PEER_GROWN, true); /* spans all three chunks */
    suite_transfer(&me, &h, m, PEER_GIB, 0, 0, 0, true);
    read_only(&me, &h);
    suite_wrap_refused(&h, m);
    suite_duplicate(&me, &h, m);
    suite_faults(&me, &h, m, PEER_GROWN);
    suite_malformed(&me, &h, m);
    suite_exporter_exits(&me, &h, m);
    suite_importer_exits(&me, &h, m, false);
    suite_importer_exits(&me, &h, m, true);
    suite_exporter_killed(&me, &h, m);
    T_CHECK(fds_back("vmm: all scenarios after the warm-up", &warm, h.sock));
    helper_stop(&h);
    cubuf_context_destroy(me.ctx);
    suite_end_fds("test_ipc_vmm", &start);
    return t_finish("test_ipc_vmm");
}
