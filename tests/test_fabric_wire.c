/* Fabric-handle IPC descriptors without a GPU: the VMM body with handle
 * type 8 (64 bytes per physical allocation, no fd) is read, validated and
 * written back byte for byte; each broken rule is refused with a detail
 * naming it; such a descriptor travels over a socket and by pid (no fd to
 * take); an import is refused with CUBUF_ERROR_NOT_SUPPORTED until the
 * import path maps fabric handles; no fd leaks. */
#include <sys/socket.h>

#include "dist_test.h"

#define MIB ((uint64_t)1 << 20)

static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* A valid fabric descriptor of two chunks (2 MiB and 4 MiB), buffer
 * [1 MiB, +4 MiB) of the 6 MiB extent. Returns its length. */
static size_t make(uint8_t *b)
{
    size_t len = CUBUF_IPC_VMM_FABRIC_BYTES(2);
    memset(b, 0, len);
    memcpy(b, "CUBUFIPC", 8);
    b[8] = 1;                          /* version */
    b[10] = CUBUF_IPC_MECHANISM_VMM;   /* mechanism */
    put32(b + 12, (uint32_t)len);      /* length */
    put32(b + 16, 0);                  /* fds */
    put64(b + 24, 4 * MIB);            /* size */
    put64(b + 32, 1 * MIB);            /* offset */
    put64(b + 40, 6 * MIB);            /* extent */
    put32(b + 48, CU_MEM_HANDLE_TYPE_FABRIC);
    put32(b + 52, 2);                  /* chunks */
    put64(b + 56, 2 * MIB);            /* granularity */
    put64(b + 64, 2 * MIB);
    put64(b + 72, 4 * MIB);
    for (int i = 0; i < 128; i++) b[80 + i] = (uint8_t)(i * 7 + 1); /* two handles */
    return len;
}

static bool detail_has(const char *piece)
{
    if (strstr(cubuf_last_error(), piece)) return true;
    fprintf(stderr, "  detail \"%s\" lacks \"%s\"\n", cubuf_last_error(), piece);
    return false;
}

static void refused(const uint8_t *b, size_t len, const int *fds, size_t nfds, const char *piece)
{
    cubuf_ipc_descriptor_t *d = NULL;
    T_STATUS(cubuf_ipc_descriptor_deserialize(b, len, fds, nfds, &d), CUBUF_ERROR_INVALID_DESCRIPTOR);
    T_CHECK(d == NULL);
    T_CHECK(detail_has(piece));
}

static void valid(void)
{
    uint8_t b[512], out[512];
    size_t len = make(b);
    T_CHECK(len == 64 + 72 * 2);
    cubuf_ipc_descriptor_t *d = NULL;
    T_REQUIRE(cubuf_ipc_descriptor_deserialize(b, len, NULL, 0, &d));
    cubuf_ipc_descriptor_info_t info = CUBUF_IPC_DESCRIPTOR_INFO_INIT;
    T_OK(cubuf_ipc_descriptor_info(d, &info));
    T_CHECK(info.mechanism == CUBUF_IPC_MECHANISM_VMM && info.fd_count == 0 && info.chunk_count == 2);
    T_CHECK(info.size == 4 * MIB && info.offset == MIB && info.extent == 6 * MIB);
    /* Written back byte for byte, with no fd. */
    size_t n = 0, nfds = 0;
    T_OK(cubuf_ipc_descriptor_serialize(d, NULL, &n, NULL, &nfds));
    T_CHECK(n == len && nfds == 0);
    n = sizeof out;
    T_OK(cubuf_ipc_descriptor_serialize(d, out, &n, NULL, &nfds));
    T_CHECK(n == len && memcmp(out, b, len) == 0);
    /* Importing needs the driver (and an IMEX channel): here it fails cleanly. */
    cubuf_buffer_t *buf = NULL;
    T_CHECK(cubuf_buffer_from_ipc_descriptor(NULL, NULL, d, CU_STREAM_LEGACY, &buf) != CUBUF_SUCCESS);
    T_CHECK(buf == NULL);
    cubuf_ipc_descriptor_destroy(d);
}

static void broken(void)
{
    uint8_t b[512];
    size_t len = make(b);
    int fd = 0; /* any open fd */

    memset(b + 80 + 64, 0, 64);
    refused(b, len, NULL, 0, "fabric handle of chunk 2 of 2 is all zero");
    make(b);
    memset(b + 80, 0, 64);
    refused(b, len, NULL, 0, "fabric handle of chunk 1 of 2 is all zero");

    make(b);
    put32(b + 16, 1); /* one fd announced and given */
    refused(b, len, &fd, 1, "carries none");

    make(b);
    put32(b + 48, 4); /* a handle type that is neither: read as the fd variant's length */
    refused(b, len, NULL, 0, "is 80 bytes");
    make(b);
    put32(b + 48, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR); /* fd variant's length differs */
    refused(b, len, NULL, 0, "is 80 bytes");

    make(b);
    refused(b, len - 1, NULL, 0, "truncated");
    make(b);
    put32(b + 12, (uint32_t)len + 1);
    b[len] = 0;
    refused(b, len + 1, NULL, 0, "is 208 bytes");

    make(b);
    put64(b + 72, 2 * MIB); /* chunks no longer add up to the extent */
    refused(b, len, NULL, 0, "add up to");
    make(b);
    put32(b + 52, 0);
    refused(b, len, NULL, 0, "chunk count 0");
}

static void travels(void)
{
    uint8_t b[512];
    size_t len = make(b);
    cubuf_ipc_descriptor_t *d = NULL, *got = NULL;
    T_REQUIRE(cubuf_ipc_descriptor_deserialize(b, len, NULL, 0, &d));
    int sv[2];
    T_CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
    int fds = dist_open_fds();
    T_OK(cubuf_ipc_send(sv[0], d));
    T_OK(cubuf_ipc_recv(sv[1], NULL, &got));
    uint8_t out[512];
    size_t n = sizeof out, nfds = 0;
    if (got) {
        T_OK(cubuf_ipc_descriptor_serialize(got, out, &n, NULL, &nfds));
        T_CHECK(n == len && nfds == 0 && memcmp(out, b, len) == 0);
    }
    cubuf_ipc_descriptor_destroy(got);
    got = NULL;
    /* By pid: no fd to take, so no pidfd is needed either. */
    T_OK(cubuf_ipc_descriptor_from_pid(getpid(), b, len, NULL, 0, &got));
    T_CHECK(got != NULL);
    cubuf_ipc_descriptor_destroy(got);
    T_CHECK(dist_open_fds() == fds);
    close(sv[0]);
    close(sv[1]);
    cubuf_ipc_descriptor_destroy(d);
}

/* Each host allocation of deserialize and of the by-pid path failing in
 * turn: CUBUF_ERROR_OUT_OF_MEMORY, nothing made, no fd leaked. */
static void allocations_fail(void)
{
    uint8_t b[512];
    size_t len = make(b);
    int fds = dist_open_fds();
    for (int by_pid = 0; by_pid < 2; by_pid++) {
        unsigned nth = 1;
        for (;; nth++) {
            cubuf_ipc_descriptor_t *d = NULL;
            cubuf_fault_fail_alloc_nth(nth);
            cubuf_status_t st = by_pid ? cubuf_ipc_descriptor_from_pid(getpid(), b, len, NULL, 0, &d)
                                       : cubuf_ipc_descriptor_deserialize(b, len, NULL, 0, &d);
            bool fired = cubuf_fault_fired();
            cubuf_fault_reset();
            if (!fired) {
                T_OK(st);
                cubuf_ipc_descriptor_destroy(d);
                break;
            }
            T_STATUS(st, CUBUF_ERROR_OUT_OF_MEMORY);
            T_CHECK(d == NULL);
            if (nth > 16) {
                fprintf(stderr, "allocation faults never stop firing\n");
                t_failures++;
                break;
            }
        }
        T_CHECK(nth >= 2); /* at least one allocation was failed */
    }
    T_CHECK(dist_open_fds() == fds);
}

int main(void)
{
    T_CHECK(CUBUF_IPC_MAX_BYTES == CUBUF_IPC_VMM_FABRIC_BYTES(CUBUF_IPC_MAX_CHUNKS));
    valid();
    broken();
    travels();
    allocations_fail();
    return t_finish("test_fabric_wire");
}
