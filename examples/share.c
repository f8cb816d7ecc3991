/* Share a device buffer with another process. The parent allocates from its
 * context's pool (an exportable pool), writes a pattern, and sends the
 * buffer's IPC descriptor over a Unix socket to a child it starts with
 * fork+exec. The child imports the buffer, checks the parent's bytes, writes
 * its own, closes its import and exits; then the parent reads the child's
 * bytes. The importer closes first: the exporter frees only after that.
 * Build: part of the cubuf build (example_share). Run: ./build/examples/example_share */
#define _POSIX_C_SOURCE 200809L
#include <cubuf.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#define SIZE ((size_t)1 << 20)
#define PARENT_SEED 11
#define CHILD_SEED 97

#define TRY(expr)                                                                            \
    do {                                                                                     \
        if ((st = (expr)) != CUBUF_SUCCESS) {                                                \
            fprintf(stderr, "%s: %s: %s\n", #expr, cubuf_status_name(st), cubuf_last_error()); \
            goto done;                                                                       \
        }                                                                                    \
    } while (0)

static unsigned char host[SIZE];

static void fill_pattern(unsigned char *p, unsigned seed)
{
    for (size_t i = 0; i < SIZE; i++) p[i] = (unsigned char)(i * 31 + seed + (i >> 12));
}

static bool holds_pattern(const unsigned char *p, unsigned seed, const char *who)
{
    for (size_t i = 0; i < SIZE; i++)
        if (p[i] != (unsigned char)(i * 31 + seed + (i >> 12))) {
            fprintf(stderr, "%s: byte %zu is %u, not the expected pattern\n", who, i, p[i]);
            return false;
        }
    return true;
}

/* The child: started as `example_share --child FD`. */
static int child(int sock)
{
    int rc = 1;
    cubuf_status_t st;
    cubuf_context_t *ctx = NULL;
    cubuf_ipc_descriptor_t *desc = NULL;
    cubuf_buffer_t *buf = NULL;
    size_t n = 0;
    cubuf_ipc_recv_options_t ro = CUBUF_IPC_RECV_OPTIONS_INIT;
    ro.timeout_ms = 60000;
    ro.check_pid = true; /* a socketpair's peer is the process that made it: our parent */
    ro.pid = getppid();
    TRY(cubuf_context_create(0, &ctx));
    TRY(cubuf_ipc_recv(sock, &ro, &desc));
    TRY(cubuf_context_open_ipc_buffer(ctx, desc, &buf));
    cubuf_ipc_descriptor_destroy(desc); /* its fds are needed only until the import returns */
    desc = NULL;
    TRY(cubuf_buffer_copy_to_host(buf, 0, -1, host, sizeof host, 0, &n));
    if (n != SIZE) fprintf(stderr, "child: %zu bytes copied, not %zu\n", n, SIZE);
    if (n != SIZE || !holds_pattern(host, PARENT_SEED, "child")) goto done;
    fill_pattern(host, CHILD_SEED);
    TRY(cubuf_buffer_copy_from_host(buf, host, sizeof host, 0, -1, 0, &n));
    TRY(cubuf_buffer_close(buf)); /* frees the import on the context's legacy stream... */
    TRY(cubuf_context_synchronize(ctx)); /* ...and this waits for that free */
    printf("child: read the parent's %zu bytes, wrote %zu of its own\n", SIZE, n);
    rc = 0;
done:
    cubuf_buffer_release(buf);
    cubuf_ipc_descriptor_destroy(desc);
    cubuf_context_destroy(ctx);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc == 3 && strcmp(argv[1], "--child") == 0) return child(atoi(argv[2]));
    int count = 0, rc = 1, sv[2] = {-1, -1}, status = 0;
    cubuf_status_t st = cubuf_device_count(&count);
    if (st != CUBUF_SUCCESS || count == 0) {
        printf("SKIP: needs 1 CUDA device(s): %s\n", /* the tests' words */
               st != CUBUF_SUCCESS ? cubuf_last_error() : "not enough devices");
        return 77;
    }
    cubuf_context_t *ctx = NULL;
    cubuf_buffer_t *buf = NULL;
    cubuf_ipc_descriptor_t *desc = NULL;
    pid_t pid = -1;
    char fd[16];
    TRY(cubuf_context_create(0, &ctx));
    TRY(cubuf_context_new_buffer(ctx, SIZE, &buf));
    fill_pattern(host, PARENT_SEED);
    TRY(cubuf_buffer_copy_from_host(buf, host, sizeof host, 0, -1, 0, NULL));
    if ((st = cubuf_buffer_ipc_descriptor(buf, &desc)) == CUBUF_ERROR_NOT_SUPPORTED) {
        printf("SKIP: example_share: this device's pools cannot be exported: %s\n",
               cubuf_last_error());
        rc = 77;
        goto done;
    }
    TRY(st);

    /* Our end is close-on-exec, so the child holds only its own: if we fail
     * and exit, its receive sees the connection closed instead of waiting. */
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0 || fcntl(sv[0], F_SETFD, FD_CLOEXEC) != 0) {
        perror("socketpair");
        goto done;
    }
    snprintf(fd, sizeof fd, "%d", sv[1]);
    if ((pid = fork()) < 0) {
        perror("fork");
        goto done;
    }
    if (pid == 0) {
        execl("/proc/self/exe", argv[0], "--child", fd, (char *)NULL);
        perror("execl");
        _exit(127);
    }
    close(sv[1]);
    sv[1] = -1;
    TRY(cubuf_ipc_send(sv[0], desc)); /* the kernel passes copies of the fds */
    if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "parent: the child failed (wait status 0x%x)\n", (unsigned)status);
        pid = -1;
        goto done;
    }
    pid = -1;
    memset(host, 0, sizeof host);
    TRY(cubuf_buffer_copy_to_host(buf, 0, -1, host, sizeof host, 0, NULL));
    if (!holds_pattern(host, CHILD_SEED, "parent")) goto done;
    printf("parent: the buffer holds the child's %zu bytes\n", SIZE);
    TRY(cubuf_buffer_close(buf)); /* the child's import is gone: now the memory may go */
    rc = 0;
done:
    if (sv[0] >= 0) close(sv[0]);
    if (sv[1] >= 0) close(sv[1]);
    if (pid > 0) waitpid(pid, &status, 0);
    cubuf_ipc_descriptor_destroy(desc);
    cubuf_buffer_release(buf);
    cubuf_context_destroy(ctx);
    return rc;
}
