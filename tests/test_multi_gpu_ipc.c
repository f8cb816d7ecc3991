/* IPC across devices: this process exports memory of device 0 (a device
 * pool, virtual memory read-write and read-only, and a legacy cuMemAlloc
 * allocation); a second process, started with fork+exec, imports each into a
 * context of device 1, reads it with device 1's copy engines and, where it
 * was given write access, writes it back with them. Exits 77 with fewer than
 * two devices. */
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cubuf/ipc.h"
#include "cubuf/vmm.h"
#include "internal.h"
#include "test.h"

#define N ((size_t)4 << 20)

typedef struct mech {
    const char *name;
    cubuf_ipc_access_t access;
} mech_t;

static const mech_t mechs[] = {
    {"device pool", CUBUF_IPC_ACCESS_READ_WRITE},
    {"virtual memory, read-write", CUBUF_IPC_ACCESS_READ_WRITE},
    {"virtual memory, read-only", CUBUF_IPC_ACCESS_READ},
    {"legacy handle", CUBUF_IPC_ACCESS_READ_WRITE},
};
#define NMECH (sizeof mechs / sizeof mechs[0])

static unsigned char first_value(size_t m) { return (unsigned char)(0x50 + m); }
static unsigned char second_value(size_t m) { return (unsigned char)(0x60 + m); }

/* Bytes of [p, p+n) that are not `value`, read through a device-local
 * buffer of the current context: its copy engines read p. */
static size_t count_not(CUdeviceptr p, size_t n, unsigned char value)
{
    static unsigned char h[N];
    CUdeviceptr local = 0;
    T_CU(cuMemAlloc, &local, n);
    T_CU(cuMemcpy, local, p, n);
    T_CU(cuMemcpyDtoH, h, local, n);
    T_CU(cuMemFree, local);
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) bad += h[i] != value;
    return bad;
}

/* ---- the importer, on device 1 ---- */

static int child(int sock)
{
    cubuf_context_t *c1 = NULL;
    T_REQUIRE(cubuf_context_create(1, &c1));
    T_CU(cuCtxSetCurrent, t_cu(c1));
    for (size_t m = 0; m < NMECH; m++) {
        cubuf_ipc_descriptor_t *desc = NULL;
        T_REQUIRE(cubuf_ipc_recv(sock, NULL, &desc));
        /* A device that does not exist is refused, naming the range. */
        cubuf_ipc_import_options_t bad = CUBUF_IPC_IMPORT_OPTIONS_INIT;
        bad.device = 2;
        cubuf_buffer_t *b = NULL;
        int count = 0;
        T_OK(cubuf_device_count(&count));
        if (count == 2) {
            T_STATUS(cubuf_buffer_from_ipc_descriptor(NULL, &bad, desc, CU_STREAM_LEGACY, &b),
                     CUBUF_ERROR_OUT_OF_RANGE);
            T_CHECK(b == NULL);
        }
        cubuf_ipc_import_options_t o = CUBUF_IPC_IMPORT_OPTIONS_INIT;
        o.access = mechs[m].access;
        T_REQUIRE(cubuf_buffer_from_ipc_descriptor(c1, &o, desc, CU_STREAM_LEGACY, &b));
        T_CHECK(cubuf_buffer_device_id(b) == 1 && cubuf_buffer_is_mapped(b));
        T_CHECK(cubuf_buffer_size(b) == N);
        size_t wrong = count_not(cubuf_buffer_ptr(b), N, first_value(m));
        if (wrong) fprintf(stderr, "%s: device 1 read %zu wrong bytes\n", mechs[m].name, wrong);
        T_CHECK(wrong == 0);
        if (mechs[m].access == CUBUF_IPC_ACCESS_READ_WRITE) {
            T_CU(cuMemsetD8, cubuf_buffer_ptr(b), second_value(m), N); /* device 1 writes */
            T_CU(cuCtxSynchronize);
        }
        T_OK(cubuf_buffer_close(b));
        cubuf_buffer_release(b);
        cubuf_ipc_descriptor_destroy(desc);
        unsigned char done = (unsigned char)(t_failures != 0);
        T_CHECK(write(sock, &done, 1) == 1);
    }
    T_CU(cuCtxSetCurrent, NULL);
    cubuf_context_destroy(c1);
    return t_finish("test_multi_gpu_ipc (importer on device 1)");
}

/* ---- the exporter, on device 0 ---- */

static cubuf_resource_t *exporter_resource(size_t m)
{
    cubuf_resource_t *r = NULL;
    if (m == 0) {
        cubuf_device_resource_options_t o = CUBUF_DEVICE_RESOURCE_OPTIONS_INIT;
        o.private_pool = true;
        o.ipc_enabled = true;
        T_REQUIRE(cubuf_device_resource_create(0, &o, &r));
    } else if (m <= 2) {
        cubuf_vmm_options_t o = CUBUF_VMM_OPTIONS_INIT;
        o.handle_type = CUBUF_VMM_HANDLE_POSIX_FD;
        T_REQUIRE(cubuf_vmm_resource_create(0, &o, &r));
    } else {
        T_REQUIRE(cubuf_sync_device_resource_create(0, &r));
    }
    return r;
}

static pid_t spawn_child(int sock, const char *self)
{
    char fd[16];
    snprintf(fd, sizeof fd, "%d", sock);
    pid_t pid = fork();
    if (pid < 0) {
        perror("fork");
        exit(1);
    }
    if (pid == 0) {
        execl(self, self, "--importer", fd, (char *)NULL);
        _exit(127);
    }
    return pid;
}

int main(int argc, char **argv)
{
    if (argc == 3 && strcmp(argv[1], "--importer") == 0) return child(atoi(argv[2]));
    t_require_gpus(2);
    bool can = false;
    T_OK(cubuf_device_can_access_peer(1, 0, &can));
    if (!can) {
        printf("test_multi_gpu_ipc: device 1 cannot access device 0's memory; nothing to test\n");
        return 77;
    }
    int sv[2];
    /* Our end is close-on-exec: should this process fail and exit early,
     * the importer's receive then sees the connection closed, not a hang. */
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0 || fcntl(sv[0], F_SETFD, FD_CLOEXEC) != 0) {
        perror("socketpair");
        return 1;
    }
    pid_t pid = spawn_child(sv[1], "/proc/self/exe");
    close(sv[1]);

    cubuf_context_t *c0 = NULL;
    T_REQUIRE(cubuf_context_create(0, &c0));
    T_CU(cuCtxSetCurrent, t_cu(c0));
    for (size_t m = 0; m < NMECH; m++) {
        printf("%s\n", mechs[m].name);
        cubuf_resource_t *r = exporter_resource(m);
        cubuf_buffer_t *b = NULL;
        T_REQUIRE(cubuf_resource_allocate(r, N, CU_STREAM_LEGACY, &b));
        T_OK(cubuf_buffer_fill_byte(b, first_value(m), CU_STREAM_LEGACY));
        T_CU(cuCtxSynchronize);
        cubuf_ipc_descriptor_t *desc = NULL;
        T_REQUIRE(cubuf_buffer_ipc_descriptor(b, &desc));
        T_REQUIRE(cubuf_ipc_send(sv[0], desc));
        unsigned char done = 0xff;
        T_CHECK(read(sv[0], &done, 1) == 1 && done == 0);
        /* Device 1's writes are here; a read-only import left the bytes. */
        unsigned char want =
            mechs[m].access == CUBUF_IPC_ACCESS_READ_WRITE ? second_value(m) : first_value(m);
        size_t wrong = count_not(cubuf_buffer_ptr(b), N, want);
        if (wrong) fprintf(stderr, "%s: %zu bytes are not device 1's\n", mechs[m].name, wrong);
        T_CHECK(wrong == 0);
        cubuf_ipc_descriptor_destroy(desc);
        T_OK(cubuf_buffer_close(b));
        cubuf_buffer_release(b);
        cubuf_resource_release(r);
    }
    close(sv[0]);
    int status = 0;
    T_CHECK(waitpid(pid, &status, 0) == pid);
    T_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    T_CU(cuCtxSetCurrent, NULL);
    cubuf_context_destroy(c0);
    return t_finish("test_multi_gpu_ipc");
}
