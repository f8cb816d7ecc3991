/* Sharing cuMemAlloc memory (the sync device resource) with legacy IPC
 * handles, as pyarrow's open_ipc_buffer does, with another process started
 * with fork+exec: data both ways from 2 MiB to 1 GiB, a slice keeping its
 * offset (pyarrow loses it), duplicate opens, import failures at every
 * driver call, descriptors that lie, either side exiting or being killed
 * first, fds and memory back to their baselines. */
#include "helper_ipc_suite.h"

int main(void)
{
    t_require_gpu();
    peer_t me;
    T_REQUIRE(peer_init(&me, -1));
    track_install();
    suite_require(PEER_LEGACY);
    static fd_snap_t start;
    fds_take(&start, 0, -1);
    helper_t h = helper_start();
    peer_mech_t m = PEER_LEGACY;
    suite_arguments(&me, m);
    suite_transfer(&me, &h, m, 2 * PEER_MIB, 0, 0, 0, false); /* warm-up */
    /* From here on the driver's once-per-process files are open: every fd
     * opened later must be closed again (the helper's socket aside). */
    static fd_snap_t warm;
    fds_take(&warm, 0, h.sock);
    suite_transfer(&me, &h, m, 2 * PEER_MIB, 0, 0, 0, true);
    suite_transfer(&me, &h, m, 48 * PEER_MIB, 7 * PEER_MIB + 3, 9 * PEER_MIB + 5, 0, true);
    suite_transfer(&me, &h, m, PEER_GIB, 0, 0, 0, true);
    suite_duplicate(&me, &h, m);
    suite_wrap_refused(&h, m);
    suite_faults(&me, &h, m, 0);
    suite_malformed(&me, &h, m);
    suite_exporter_exits(&me, &h, m);
    suite_importer_exits(&me, &h, m, false);
    suite_importer_exits(&me, &h, m, true);
    suite_exporter_killed(&me, &h, m);
    T_CHECK(fds_back("legacy: all scenarios after the warm-up", &warm, h.sock));
    helper_stop(&h);
    cubuf_context_destroy(me.ctx);
    suite_end_fds("test_ipc_legacy", &start);
    return t_finish("test_ipc_legacy");
}
