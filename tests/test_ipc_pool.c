/* Sharing stream-ordered pool memory (device and pinned pools, and a
 * context's own pool) with another
 * process started with fork+exec: data both ways from 2 MiB to 1 GiB and
 * through a slice at an odd offset, duplicate imports over one pool import,
 * import failures at every driver call, descriptors that lie, either side
 * exiting or being killed first, fds and memory back to their baselines. */
#include "helper_ipc_suite.h"

static void run(peer_t *me, helper_t *h, peer_mech_t m)
{
    printf("%s\n", peer_mech_name(m));
    suite_arguments(me, m);
    suite_transfer(me, h, m, 2 * PEER_MIB, 0, 0, 0, false); /* warm-up */
    /* From here on the driver's once-per-process files are open: every fd
     * opened later must be closed again (the helper's socket aside). */
    static fd_snap_t warm;
    fds_take(&warm, 0, h->sock);
    suite_transfer(me, h, m, 2 * PEER_MIB, 0, 0, 0, true);
    suite_transfer(me, h, m, 64 * PEER_MIB + 4096, 5 * PEER_MIB + 12, 3 * PEER_MIB + 100, 0, true);
    suite_transfer(me, h, m, PEER_GIB, 0, 0, 0, true);
    suite_duplicate(me, h, m);
    suite_faults(me, h, m, 0);
    suite_malformed(me, h, m);
    suite_exporter_exits(me, h, m);
    suite_importer_exits(me, h, m, false);
    suite_importer_exits(me, h, m, true);
    suite_exporter_killed(me, h, m);
    char what[80];
    snprintf(what, sizeof what, "%s: all scenarios after the warm-up", peer_mech_name(m));
    T_CHECK(fds_back(what, &warm, h->sock));
}

/* The context's own pool (cubuf_context_new_buffer's) goes to another
 * process as a private pool does. Free memory is not compared with a
 * baseline: the context's pool keeps freed memory for reuse. */
static void run_context(peer_t *me, helper_t *h)
{
    printf("context\n");
    suite_arguments(me, PEER_CONTEXT);
    suite_transfer(me, h, PEER_CONTEXT, 2 * PEER_MIB, 0, 0, 0, false);
    suite_transfer(me, h, PEER_CONTEXT, 64 * PEER_MIB + 4096, 5 * PEER_MIB + 12, 3 * PEER_MIB + 100, 0,
                   false);
}

int main(void)
{
    t_require_gpu();
    peer_t me;
    T_REQUIRE(peer_init(&me, -1));
    track_install();
    suite_require(PEER_POOL_DEVICE);
    suite_require(PEER_POOL_PINNED);
    suite_require(PEER_CONTEXT);
    static fd_snap_t start;
    fds_take(&start, 0, -1);
    helper_t h = helper_start();
    run(&me, &h, PEER_POOL_DEVICE);
    run(&me, &h, PEER_POOL_PINNED);
    run_context(&me, &h);
    helper_stop(&h);
    cubuf_context_destroy(me.ctx);
    suite_end_fds("test_ipc_pool", &start);
    return t_finish("test_ipc_pool");
}
