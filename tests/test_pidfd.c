/* Descriptors fetched by pid (cubuf_ipc_descriptor_from_pid): a child
 * process (this program again, exec'd with "exporter") exports a VMM buffer
 * of two physical allocations and sends the descriptor's bytes and its fd
 * numbers over a socket without the fds, then the descriptor with its fds
 * (cubuf_ipc_send); the parent imports the second and reads the child's
 * bytes back, then takes the fds of the first with pidfd_getfd and does the
 * same. Where the kernel refuses (EPERM in many containers, ENOSYS before
 * 5.6), the error says so and the socket path works all the same: both
 * paths run every time; where it allows, a process of another user is
 * refused with EPERM for certain. Errors: a bad pid, an fd not open in the
 * exporter, a malformed descriptor; no fd leaks. */
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>

#include "dist_test.h"

#define SEED 0x5a
#define MAX_FDS 8

typedef struct wire_head {
    int32_t pid;
    uint32_t len;
    uint32_t nfds;
    int32_t fds[MAX_FDS];
} wire_head_t;

static uint8_t pat(size_t i) { return (uint8_t)(i * 131 + SEED + (i >> 12)); }

static bool read_full(int fd, void *p, size_t n)
{
    for (size_t got = 0; got < n;) {
        ssize_t k = read(fd, (char *)p + got, n - got);
        if (k <= 0) return false;
        got += (size_t)k;
    }
    return true;
}

static bool write_full(int fd, const void *p, size_t n)
{
    for (size_t put = 0; put < n;) {
        ssize_t k = write(fd, (const char *)p + put, n - put);
        if (k <= 0) return false;
        put += (size_t)k;
    }
    return true;
}

/* The child: export, send the bytes and fd numbers, then the descriptor over
 * the socket, and keep the descriptor (its fds) until the parent is done. */
static int exporter(int sock)
{
    cubuf_vmm_options_t o = CUBUF_VMM_OPTIONS_INIT;
    o.handle_type = CUBUF_VMM_HANDLE_POSIX_FD;
    cubuf_resource_t *res = NULL;
    cubuf_buffer_t *one = NULL, *buf = NULL;
    size_t gran = 0;
    T_REQUIRE(cubuf_vmm_resource_create(0, &o, &res));
    T_REQUIRE(cubuf_vmm_granularity(res, &gran));
    T_REQUIRE(cubuf_resource_allocate(res, gran, CU_STREAM_LEGACY, &one));
    T_REQUIRE(cubuf_vmm_modify_allocation(res, one, 2 * gran, NULL, &buf));
    size_t size = cubuf_buffer_size(buf);
    uint8_t *host = malloc(size);
    if (!host) return 1;
    for (size_t i = 0; i < size; i++) host[i] = pat(i);
    T_REQUIRE(cubuf_buffer_copy_from_host(buf, host, size, 0, -1, CU_STREAM_LEGACY, NULL));
    free(host);
    cubuf_ipc_descriptor_t *desc = NULL;
    T_REQUIRE(cubuf_buffer_ipc_descriptor(buf, &desc));
    uint8_t bytes[CUBUF_IPC_VMM_BYTES(MAX_FDS)];
    wire_head_t h = {.pid = (int32_t)getpid()};
    size_t len = sizeof bytes, nfds = MAX_FDS;
    int fds[MAX_FDS];
    T_REQUIRE(cubuf_ipc_descriptor_serialize(desc, bytes, &len, fds, &nfds));
    h.len = (uint32_t)len;
    h.nfds = (uint32_t)nfds;
    for (size_t i = 0; i < nfds; i++) h.fds[i] = fds[i];
    if (!write_full(sock, &h, sizeof h) || !write_full(sock, bytes, len)) return 1;
    T_REQUIRE(cubuf_ipc_send(sock, desc));
    char done = 0;
    if (!read_full(sock, &done, 1)) return 1; /* the parent has imported both ways */
    cubuf_ipc_descriptor_destroy(desc);
    cubuf_buffer_release(buf);
    cubuf_buffer_release(one);
    cubuf_resource_release(res);
    return t_finish("test_pidfd exporter");
}

/* Imports desc, reads it back and compares with the child's pattern. */
static void import_and_check(const char *what, cubuf_context_t *ctx, const cubuf_ipc_descriptor_t *desc)
{
    cubuf_buffer_t *buf = NULL;
    T_REQUIRE(cubuf_buffer_from_ipc_descriptor(ctx, NULL, desc, CU_STREAM_LEGACY, &buf));
    size_t size = cubuf_buffer_size(buf);
    uint8_t *host = malloc(size);
    T_CHECK(host != NULL);
    if (!host) return;
    size_t copied = 0;
    T_OK(cubuf_buffer_copy_to_host(buf, 0, -1, host, size, CU_STREAM_LEGACY, &copied));
    T_CHECK(copied == size);
    size_t bad = size;
    for (size_t i = 0; i < size && bad == size; i++)
        if (host[i] != pat(i)) bad = i;
    if (bad != size) {
        fprintf(stderr, "%s: byte %zu is 0x%02x, expected 0x%02x\n", what, bad, host[bad], pat(bad));
        t_failures++;
    }
    printf("%s: %zu bytes read back\n", what, size);
    free(host);
    T_OK(cubuf_buffer_close(buf));
    cubuf_buffer_release(buf);
}

static void errors(const wire_head_t *h, const uint8_t *bytes, bool pidfd_works)
{
    cubuf_ipc_descriptor_t *d = NULL;
    T_REFUSED(cubuf_ipc_descriptor_from_pid(h->pid, bytes, h->len, h->fds, h->nfds, NULL),
              CUBUF_ERROR_INVALID_ARGUMENT);
    T_REFUSED(cubuf_ipc_descriptor_from_pid(0, bytes, h->len, h->fds, h->nfds, &d),
              CUBUF_ERROR_INVALID_ARGUMENT);
    T_REFUSED(cubuf_ipc_descriptor_from_pid(h->pid, NULL, h->len, h->fds, h->nfds, &d),
              CUBUF_ERROR_INVALID_ARGUMENT);
    T_REFUSED(cubuf_ipc_descriptor_from_pid(h->pid, bytes, h->len, NULL, h->nfds, &d),
              CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(d == NULL);
    if (!pidfd_works) return;
    /* A pid no process has (above the kernel's largest, 2^22). */
    T_REFUSED(cubuf_ipc_descriptor_from_pid((pid_t)0x7ffffff0, bytes, h->len, h->fds, h->nfds, &d),
              CUBUF_ERROR_SYSTEM);
    /* An fd number not open in the exporter: the second, after the first was taken. */
    int fds[MAX_FDS];
    memcpy(fds, h->fds, sizeof fds);
    fds[1] = 1000;
    T_REFUSED(cubuf_ipc_descriptor_from_pid(h->pid, bytes, h->len, fds, h->nfds, &d),
              CUBUF_ERROR_INVALID_DESCRIPTOR);
    T_CHECK(strstr(cubuf_last_error(), "fd 1000 (2 of 2) is not open") != NULL);
    /* Valid fds, malformed bytes: the fetched fds are closed again. */
    uint8_t broken[CUBUF_IPC_VMM_BYTES(MAX_FDS)];
    memcpy(broken, bytes, h->len);
    broken[0] ^= 1; /* the magic */
    T_REFUSED(cubuf_ipc_descriptor_from_pid(h->pid, broken, h->len, h->fds, h->nfds, &d),
              CUBUF_ERROR_INVALID_DESCRIPTOR);
    T_CHECK(d == NULL);
}

/* EPERM for certain: a process of another user without CAP_SYS_PTRACE (a
 * fork of this one that gave up root; it makes no driver call) asks for
 * the exporter's fds. Exit 0: refused with the documented status and
 * detail, nothing left open; 77: this test does not run as root, so no
 * other user can be taken on. */
static void eperm_from_another_user(const wire_head_t *h, const uint8_t *bytes)
{
    fflush(NULL); /* the child's stdio must not repeat what is buffered */
    pid_t pid = fork();
    if (pid < 0) {
        perror("fork");
        t_failures++;
        return;
    }
    if (pid == 0) {
        if (getuid() != 0 || setgid(65534) != 0 || setuid(65534) != 0) _exit(77);
        int fds = dist_open_fds();
        cubuf_ipc_descriptor_t *d = NULL;
        cubuf_status_t st = cubuf_ipc_descriptor_from_pid(h->pid, bytes, h->len, h->fds, h->nfds, &d);
        bool ok = st == CUBUF_ERROR_SYSTEM && d == NULL && strstr(cubuf_last_error(), "EPERM") &&
                  strstr(cubuf_last_error(), "cubuf_ipc_send") && dist_open_fds() == fds;
        if (!ok)
            fprintf(stderr, "another user's from_pid: %s (%s)\n", cubuf_status_name(st),
                    cubuf_last_error());
        else
            printf("another user's from_pid: %s\n", cubuf_last_error());
        fflush(NULL);
        _exit(ok ? 0 : 1);
    }
    int status = 0;
    T_CHECK(waitpid(pid, &status, 0) == pid);
    T_CHECK(WIFEXITED(status));
    int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    if (code == 77) printf("EPERM case not run: the test is not root\n");
    else T_CHECK(code == 0);
}

int main(int argc, char **argv)
{
    if (argc == 3 && strcmp(argv[1], "exporter") == 0) return exporter(atoi(argv[2]));
    t_require_gpu();
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
        perror("socketpair");
        return 1;
    }
    pid_t child = fork();
    if (child < 0) {
        perror("fork");
        return 1;
    }
    if (child == 0) {
        /* A new program: a CUDA process must not use its driver state after fork. */
        int fd = dup(sv[1]); /* without close-on-exec */
        char arg[16];
        snprintf(arg, sizeof arg, "%d", fd);
        execl("/proc/self/exe", argv[0], "exporter", arg, (char *)NULL);
        _exit(127);
    }
    close(sv[1]);
    int sock = sv[0];
    wire_head_t h;
    uint8_t bytes[CUBUF_IPC_VMM_BYTES(MAX_FDS)];
    if (!read_full(sock, &h, sizeof h) || h.len > sizeof bytes || h.nfds > MAX_FDS ||
        !read_full(sock, bytes, h.len)) {
        fprintf(stderr, "the exporter sent no descriptor\n");
        kill(child, SIGKILL);
        waitpid(child, NULL, 0);
        return 1;
    }
    T_CHECK(h.pid == child && h.nfds == 2);

    /* Over the socket first: it always works, and it is the warm-up (the
     * driver may open files of its own at a process's first import). */
    cubuf_context_t *ctx = NULL;
    T_REQUIRE(cubuf_context_create(0, &ctx));
    cubuf_ipc_descriptor_t *by_socket = NULL;
    T_REQUIRE(cubuf_ipc_recv(sock, NULL, &by_socket));
    import_and_check("over the socket", ctx, by_socket);
    cubuf_ipc_descriptor_destroy(by_socket);

    /* By pid. */
    int fds_before = dist_open_fds();
    cubuf_ipc_descriptor_t *by_pid = NULL;
    cubuf_status_t st = cubuf_ipc_descriptor_from_pid(h.pid, bytes, h.len, h.fds, h.nfds, &by_pid);
    bool pidfd_works = st == CUBUF_SUCCESS;
    if (pidfd_works) {
        T_CHECK(dist_open_fds() == fds_before + (int)h.nfds);
        cubuf_ipc_descriptor_info_t info = CUBUF_IPC_DESCRIPTOR_INFO_INIT;
        T_OK(cubuf_ipc_descriptor_info(by_pid, &info));
        T_CHECK(info.mechanism == CUBUF_IPC_MECHANISM_VMM && info.fd_count == 2 &&
                info.chunk_count == 2);
        import_and_check("by pidfd_getfd", ctx, by_pid);
        cubuf_ipc_descriptor_destroy(by_pid);
    } else {
        /* The kernel refused: a clear error, and nothing left open; the
         * socket path above worked all the same. */
        printf("pidfd_getfd refused here: %s: %s\n", cubuf_status_name(st), cubuf_last_error());
        T_CHECK(st == CUBUF_ERROR_SYSTEM || st == CUBUF_ERROR_NOT_SUPPORTED);
        T_CHECK(strstr(cubuf_last_error(), "cubuf_ipc_send") != NULL);
        T_CHECK(by_pid == NULL);
    }
    T_CHECK(dist_open_fds() == fds_before);
    errors(&h, bytes, pidfd_works);
    if (pidfd_works) eperm_from_another_user(&h, bytes);
    T_CHECK(dist_open_fds() == fds_before);

    char done = 1;
    T_CHECK(write_full(sock, &done, 1));
    int status = 0;
    T_CHECK(waitpid(child, &status, 0) == child);
    T_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    close(sock);
    cubuf_context_destroy(ctx);
    return t_finish("test_pidfd");
}
