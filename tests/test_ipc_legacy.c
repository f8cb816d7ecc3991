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
    suite_require(PEER_LEGACY);
    int fds0 = peer_fd_count();
    helper_t h = helper_start();
    peer_mech_t m = PEER_LEGACY;
    suite_arguments(&me, m);
    suite_transfer(&me, &h, m, 2 * PEER_MIB, 0, 0, 0, false); /* warm-up */
    suite_transfer(&me, &h, m, 2 * PEER_MIB, 0, 0, 0, true);
    suite_transfer(&me, &h, m, 48 * PEER_MIB, 7 * PEER_MIB + 3, 9 * PEER_MIB + 5, 0, true);
    suite_transfer(&me, &h, m, PEER_GIB, 0, 0, 0, true);
    suite_duplicate(&me, &h, m);
    suite_faults(&me, &h, m, 0);
    suite_malformed(&me, &h, m);
    suite_exporter_exits(&me, &h, m);
    suite_importer_exits(&me, &h, m, false);
    suite_importer_exits(&me, &h, m, true);
    suite_exporter_killed(&me, &h, m);
    helper_stop(&h);
    cubuf_context_destroy(me.ctx);
    T_CHECK(peer_fd_count() <= fds0 + 8);
    return t_finish("test_ipc_legacy");
}
