/* The peer process of the multi-process IPC tests: started by a test with
 * fork+exec as `helper_ipc FD`, it serves the commands of helper_ipc.h on
 * socket FD (exporting, importing, checking data) until the test closes the
 * socket or tells it to exit. */
#include "helper_ipc.h"

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s SOCKET_FD (started by the IPC tests)\n", argv[0]);
        return 2;
    }
    (void)t_failures; /* of test.h, whose leak counts (OP_HELD) the helper serves */
    int sock = atoi(argv[1]);
    (void)fcntl(sock, F_SETFD, FD_CLOEXEC);
    peer_t p;
    cubuf_status_t st = peer_init(&p, sock);
    peer_reply_t hello;
    memset(&hello, 0, sizeof hello);
    hello.status = st;
    hello.value = (uint64_t)getpid();
    snprintf(hello.detail, sizeof hello.detail, "%s", st == CUBUF_SUCCESS ? "" : p.detail);
    if (!peer_write_exact(sock, &hello, sizeof hello) || st != CUBUF_SUCCESS) return 1;
    int rc = peer_serve(&p);
    for (int i = 0; i < PEER_SLOTS; i++) peer_slot_clear(&p.slot[i]);
    cubuf_context_destroy(p.ctx);
    return rc;
}
