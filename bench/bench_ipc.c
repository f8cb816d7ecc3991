/* Sharing a buffer with another process, cubuf against the raw driver
 * sequence, per mechanism (device pool, pinned pool, VMM, legacy handle).
 *
 * The program starts a copy of itself (fork+exec, "--peer FD") as the
 * importer. One operation is: export the buffer (a fresh descriptor and
 * fds), send it over a Unix socket with SCM_RIGHTS, receive it in the peer,
 * import it, read its first 4 KiB to the host (the first read), then close
 * the import and synchronize, and acknowledge. The raw side does the same
 * with the driver calls alone and a plain struct on the wire; the cubuf
 * side with cubuf_buffer_ipc_descriptor, cubuf_ipc_send / cubuf_ipc_recv,
 * cubuf_buffer_from_ipc_descriptor and cubuf_buffer_close. Same memory,
 * same socket, same peer. Target: cubuf <= 1.10x raw.
 *
 * Then copy bandwidth through an imported mapping: the peer exports 256 MiB
 * of each mechanism, this process imports it and copies from it and into it
 * (cuMemcpyAsync) against the same copies between two local buffers.
 * ratio = imported GB/s / local GB/s (informational: the mapping is the
 * driver's, cubuf adds no code to the copy). */
#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench_common.h"
#include "resource_pool.h"
#include "vmm.h"

enum { MECH_DEVICE_POOL = 1, MECH_PINNED_POOL, MECH_VMM, MECH_LEGACY };
static const char *const mech_names[] = {"", "device_pool", "pinned_pool", "vmm", "legacy"};
enum { OP_LIB = 1, OP_RAW, OP_EXPORT_BW, OP_RELEASE_BW, OP_QUIT };

typedef struct cmd {
    uint32_t op, mech;
    uint64_t size;
} cmd_t;

#define RAW_MAX_CHUNKS 64
/* The raw side's wire message: what the importer needs, fds alongside. */
typedef struct raw_msg {
    uint32_t mech, nchunks;
    uint64_t granularity, size;
    uint64_t chunk[RAW_MAX_CHUNKS];
    unsigned char data[64]; /* CUmemPoolPtrExportData or CUipcMemHandle */
} raw_msg_t;

#define FIRST_READ 4096

static bool read_exact(int fd, void *p, size_t n)
{
    for (size_t got = 0; got < n;) {
        ssize_t k = read(fd, (char *)p + got, n - got);
        if (k <= 0) return false;
        got += (size_t)k;
    }
    return true;
}

static void write_exact(int fd, const void *p, size_t n)
{
    for (size_t put = 0; put < n;) {
        ssize_t k = send(fd, (const char *)p + put, n - put, MSG_NOSIGNAL);
        if (k <= 0) {
            fprintf(stderr, "error: send to the peer failed\n");
            exit(1);
        }
        put += (size_t)k;
    }
}

static void send_with_fds(int sock, const void *p, size_t n, const int *fds, size_t nfds)
{
    union {
        struct cmsghdr a;
        char b[CMSG_SPACE(sizeof(int) * RAW_MAX_CHUNKS)];
    } cm;
    struct iovec iov = {(void *)p, n};
    struct msghdr m = {0};
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    if (nfds) {
        memset(&cm, 0, sizeof cm);
        m.msg_control = cm.b;
        m.msg_controllen = CMSG_SPACE(nfds * sizeof(int));
        struct cmsghdr *c = CMSG_FIRSTHDR(&m);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(nfds * sizeof(int));
        memcpy(CMSG_DATA(c), fds, nfds * sizeof(int));
    }
    if (sendmsg(sock, &m, MSG_NOSIGNAL) != (ssize_t)n) {
        fprintf(stderr, "error: sendmsg failed\n");
        exit(1);
    }
}

static size_t recv_with_fds(int sock, void *p, size_t n, int *fds, size_t max_fds)
{
    union {
        struct cmsghdr a;
        char b[CMSG_SPACE(sizeof(int) * RAW_MAX_CHUNKS)];
    } cm;
    struct iovec iov = {p, n};
    struct msghdr m = {0};
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    m.msg_control = cm.b;
    m.msg_controllen = sizeof cm.b;
    ssize_t got = recvmsg(sock, &m, MSG_CMSG_CLOEXEC | MSG_WAITALL);
    if (got != (ssize_t)n) {
        fprintf(stderr, "error: recvmsg got %zd of %zu bytes\n", got, n);
        exit(1);
    }
    size_t k = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
            size_t cnt = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            for (size_t i = 0; i < cnt && k < max_fds; i++) memcpy(&fds[k++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        }
    return k;
}

static cubuf_status_t make_resource(int mech, cubuf_resource_t **res)
{
    switch (mech) {
    case MECH_DEVICE_POOL: {
        cubuf_device_resource_options_t o = CUBUF_DEVICE_RESOURCE_OPTIONS_INIT;
        o.private_pool = true;
        o.ipc_enabled = true;
        return cubuf_device_resource_create(0, &o, res);
    }
    case MECH_PINNED_POOL: return cubuf_pinned_resource_create(0, true, res);
    case MECH_VMM: {
        cubuf_vmm_options_t o = CUBUF_VMM_OPTIONS_INIT;
        o.handle_type = CUBUF_VMM_HANDLE_POSIX_FD;
        return cubuf_vmm_resource_create(0, &o, res);
    }
    default: return cubuf_sync_device_resource_create(0, res);
    }
}

/* ---- the peer (importer) ---- */

static void peer_raw_import(int sock, CUstream stream, void *host)
{
    raw_msg_t msg;
    int fds[RAW_MAX_CHUNKS];
    size_t nfds = recv_with_fds(sock, &msg, sizeof msg, fds, RAW_MAX_CHUNKS);
    CUdevice dev = 0;
    B_CU(cuCtxGetDevice, &dev);
    if (msg.mech == MECH_DEVICE_POOL || msg.mech == MECH_PINNED_POOL) {
        CUmemoryPool pool = NULL;
        B_CU(cuMemPoolImportFromShareableHandle, &pool, (void *)(uintptr_t)fds[0],
             CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
        if (msg.mech == MECH_PINNED_POOL) { /* an imported host pool grants no device access */
            CUmemAccessDesc a = {{CU_MEM_LOCATION_TYPE_DEVICE, (int)dev}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
            B_CU(cuMemPoolSetAccess, pool, &a, 1);
        }
        CUmemPoolPtrExportData data;
        memcpy(data.reserved, msg.data, sizeof data.reserved);
        CUdeviceptr p = 0;
        B_CU(cuMemPoolImportPointer, &p, pool, &data);
        B_CU(cuMemcpy, (CUdeviceptr)(uintptr_t)host, p, FIRST_READ); /* host or device memory */
        B_CU(cuMemFreeAsync, p, stream);
        B_CU(cuStreamSynchronize, stream);
        B_CU(cuMemPoolDestroy, pool);
    } else if (msg.mech == MECH_VMM) {
        CUmemGenericAllocationHandle h[RAW_MAX_CHUNKS];
        uint64_t extent = 0;
        for (uint32_t i = 0; i < msg.nchunks; i++) {
            B_CU(cuMemImportFromShareableHandle, &h[i], (void *)(uintptr_t)fds[i],
                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
            extent += msg.chunk[i];
        }
        CUdeviceptr base = 0;
        B_CU(cuMemAddressReserve, &base, extent, msg.granularity, 0, 0);
        uint64_t off = 0;
        for (uint32_t i = 0; i < msg.nchunks; i++) {
            B_CU(cuMemMap, base + off, msg.chunk[i], 0, h[i], 0);
            off += msg.chunk[i];
        }
        CUmemAccessDesc a = {{CU_MEM_LOCATION_TYPE_DEVICE, (int)dev}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
        B_CU(cuMemSetAccess, base, extent, &a, 1);
        B_CU(cuMemcpy, (CUdeviceptr)(uintptr_t)host, base, FIRST_READ);
        B_CU(cuStreamSynchronize, stream);
        off = 0;
        for (uint32_t i = 0; i < msg.nchunks; i++) {
            B_CU(cuMemUnmap, base + off, msg.chunk[i]);
            off += msg.chunk[i];
        }
        B_CU(cuMemAddressFree, base, extent);
        for (uint32_t i = 0; i < msg.nchunks; i++) B_CU(cuMemRelease, h[i]);
    } else {
        CUipcMemHandle ih;
        memcpy(ih.reserved, msg.data, sizeof ih.reserved);
        CUdeviceptr p = 0;
        B_CU(cuIpcOpenMemHandle, &p, ih, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
        B_CU(cuMemcpy, (CUdeviceptr)(uintptr_t)host, p, FIRST_READ); /* host or device memory */
        B_CU(cuStreamSynchronize, stream);
        B_CU(cuIpcCloseMemHandle, p);
    }
    for (size_t i = 0; i < nfds; i++) close(fds[i]);
}

static void peer_lib_import(int sock, CUstream stream, void *host)
{
    cubuf_ipc_descriptor_t *d = NULL;
    B_OK(cubuf_ipc_recv(sock, NULL, &d));
    cubuf_buffer_t *b = NULL;
    B_OK(cubuf_buffer_from_ipc_descriptor(NULL, NULL, d, stream, &b));
    cubuf_ipc_descriptor_destroy(d);
    B_CU(cuMemcpy, (CUdeviceptr)(uintptr_t)host, cubuf_buffer_ptr(b), FIRST_READ);
    B_OK(cubuf_buffer_close(b));
    B_CU(cuStreamSynchronize, stream);
    cubuf_buffer_release(b);
}

static int peer_main(int sock)
{
    cubuf_context_t *ctx = NULL;
    B_OK(cubuf_context_create(0, &ctx));
    CUcontext h = NULL;
    B_OK(cubuf_context_handle(ctx, &h));
    B_CU(cuCtxSetCurrent, h);
    CUstream stream = NULL;
    B_CU(cuStreamCreate, &stream, CU_STREAM_NON_BLOCKING);
    void *host = NULL;
    B_CU(cuMemAllocHost, &host, FIRST_READ);
    cubuf_resource_t *res = NULL;
    cubuf_buffer_t *bw = NULL;
    char ack = 1;
    for (cmd_t c; read_exact(sock, &c, sizeof c);) {
        switch (c.op) {
        case OP_RAW: peer_raw_import(sock, stream, host); break;
        case OP_LIB: peer_lib_import(sock, stream, host); break;
        case OP_EXPORT_BW: {
            B_OK(make_resource((int)c.mech, &res));
            B_OK(cubuf_resource_allocate(res, c.size, stream, &bw));
            B_CU(cuStreamSynchronize, stream);
            cubuf_ipc_descriptor_t *d = NULL;
            B_OK(cubuf_buffer_ipc_descriptor(bw, &d));
            write_exact(sock, &ack, 1);
            B_OK(cubuf_ipc_send(sock, d));
            cubuf_ipc_descriptor_destroy(d);
            continue;
        }
        case OP_RELEASE_BW:
            cubuf_buffer_release(bw);
            cubuf_resource_release(res);
            B_CU(cuCtxSynchronize);
            bw = NULL;
            res = NULL;
            break;
        case OP_QUIT: goto out;
        }
        write_exact(sock, &ack, 1);
    }
out:
    B_CU(cuMemFreeHost, host);
    B_CU(cuStreamDestroy, stream);
    cubuf_context_destroy(ctx);
    return 0;
}

/* ---- the exporter (this process) ---- */

typedef struct ipc_arg {
    int sock;
    int mech;
    cubuf_buffer_t *buf;
    cubuf_resource_t *res;
} ipc_arg_t;

static void wait_ack(int sock)
{
    char a;
    if (!read_exact(sock, &a, 1)) {
        fprintf(stderr, "error: the peer died\n");
        exit(1);
    }
}

static void raw_share(void *p)
{
    ipc_arg_t *a = p;
    raw_msg_t msg;
    memset(&msg, 0, sizeof msg);
    msg.mech = (uint32_t)a->mech;
    int fds[RAW_MAX_CHUNKS];
    size_t nfds = 0;
    CUdeviceptr ptr = cubuf_buffer_ptr(a->buf);
    if (a->mech == MECH_DEVICE_POOL || a->mech == MECH_PINNED_POOL) {
        B_CU(cuMemPoolExportToShareableHandle, &fds[0], cubuf__pool_handle(a->res),
             CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
        nfds = 1;
        CUmemPoolPtrExportData data;
        B_CU(cuMemPoolExportPointer, &data, ptr);
        memcpy(msg.data, data.reserved, sizeof msg.data);
    } else if (a->mech == MECH_VMM) {
        cubuf_vmm_chunk_t *chunks = NULL;
        size_t n = 0, first = 0;
        B_OK(cubuf__vmm_chunks(a->buf, &chunks, &n, &first));
        msg.nchunks = (uint32_t)n;
        msg.granularity = cubuf__vmm_granularity(a->res);
        for (size_t i = 0; i < n && i < RAW_MAX_CHUNKS; i++) {
            B_CU(cuMemExportToShareableHandle, &fds[i], chunks[i].handle,
                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
            msg.chunk[i] = chunks[i].size;
        }
        nfds = n;
        free(chunks);
    } else {
        CUipcMemHandle h;
        B_CU(cuIpcGetMemHandle, &h, ptr);
        memcpy(msg.data, h.reserved, sizeof msg.data);
    }
    cmd_t c = {OP_RAW, (uint32_t)a->mech, 0};
    write_exact(a->sock, &c, sizeof c);
    send_with_fds(a->sock, &msg, sizeof msg, fds, nfds);
    for (size_t i = 0; i < nfds; i++) close(fds[i]);
    wait_ack(a->sock);
}

static void lib_share(void *p)
{
    ipc_arg_t *a = p;
    cubuf_ipc_descriptor_t *d = NULL;
    B_OK(cubuf_buffer_ipc_descriptor(a->buf, &d));
    cmd_t c = {OP_LIB, (uint32_t)a->mech, 0};
    write_exact(a->sock, &c, sizeof c);
    B_OK(cubuf_ipc_send(a->sock, d));
    cubuf_ipc_descriptor_destroy(d);
    wait_ack(a->sock);
}

typedef struct copy_arg {
    CUdeviceptr dst, src;
    size_t size;
    CUstream stream;
} copy_arg_t;

static void copy_local(void *p)
{
    copy_arg_t *a = p;
    B_CU(cuMemcpyAsync, a->dst, a->src, a->size, a->stream);
}
/* same call; arg points at the pair whose one side is the imported mapping */
static void copy_imported(void *p) { copy_local((copy_arg_t *)p + 1); }

static void bandwidth(bench_env_t *env, int sock, int mech, size_t size)
{
    cmd_t c = {OP_EXPORT_BW, (uint32_t)mech, size};
    write_exact(sock, &c, sizeof c);
    wait_ack(sock);
    cubuf_ipc_descriptor_t *d = NULL;
    B_OK(cubuf_ipc_recv(sock, NULL, &d));
    cubuf_buffer_t *imp = NULL;
    B_OK(cubuf_buffer_from_ipc_descriptor(env->ctx, NULL, d, env->stream, &imp));
    cubuf_ipc_descriptor_destroy(d);
    CUdeviceptr a = 0, b = 0;
    B_CU(cuMemAlloc, &a, size);
    B_CU(cuMemAlloc, &b, size);
    char name[64];
    for (int dir = 0; dir < 2; dir++) {
        /* [0]: local to local; [1]: the same with the imported mapping as source or destination */
        copy_arg_t pair[2] = {{dir ? b : a, dir ? a : b, size, env->stream},
                              {dir ? cubuf_buffer_ptr(imp) : a, dir ? a : cubuf_buffer_ptr(imp), size, env->stream}};
        snprintf(name, sizeof name, "%s_%s", mech_names[mech], dir ? "into_import" : "from_import");
        bench_case_t bc = {.group = "ipc_bw", .name = name, .size = size, .mode = BENCH_BANDWIDTH,
                           .stream = env->stream, .raw = copy_local, .lib = copy_imported, .arg = pair,
                           .sample_s = 0.05, .max_batch = 64, .budget_s = 1.0, .min_pairs = 5,
                           .max_pairs = 21, .target = BENCH_TARGET_NONE};
        bench_compare(env, &bc);
    }
    B_OK(cubuf_buffer_close(imp));
    cubuf_buffer_release(imp);
    B_CU(cuCtxSynchronize);
    B_CU(cuMemFree, a);
    B_CU(cuMemFree, b);
    c.op = OP_RELEASE_BW;
    write_exact(sock, &c, sizeof c);
    wait_ack(sock);
}

int main(int argc, char **argv)
{
    if (argc == 3 && strcmp(argv[1], "--peer") == 0) return peer_main(atoi(argv[2]));
    bench_env_t env;
    bench_init(&env, "bench_ipc");
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
        perror("socketpair");
        return 1;
    }
    pid_t pid = fork();
    if (pid == 0) {
        char arg[16];
        snprintf(arg, sizeof arg, "%d", sv[1]);
        fcntl(sv[1], F_SETFD, 0);
        execl("/proc/self/exe", "bench_ipc", "--peer", arg, (char *)NULL);
        _exit(127);
    }
    close(sv[1]);
    int sock = sv[0];
    printf("One operation: export, send (SCM_RIGHTS), receive, import, first %d-byte read, and the\n"
           "importer's close, across two processes.\n", FIRST_READ);
    bench_section("share a buffer with another process: raw driver sequence vs cubuf");
    static const size_t sizes[] = {2 * BENCH_MIB, 256 * BENCH_MIB};
    for (int mech = MECH_DEVICE_POOL; mech <= MECH_LEGACY; mech++) {
        cubuf_resource_t *res = NULL;
        cubuf_status_t st = make_resource(mech, &res);
        if (st == CUBUF_ERROR_NOT_SUPPORTED) {
            bench_note("%s: not supported here (%s)", mech_names[mech], cubuf_last_error());
            continue;
        }
        B_OK(st);
        for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++) {
            ipc_arg_t a = {sock, mech, NULL, res};
            B_OK(cubuf_resource_allocate(res, sizes[s], env.stream, &a.buf));
            B_CU(cuStreamSynchronize, env.stream);
            bench_case_t bc = {.group = "ipc", .name = mech_names[mech], .size = sizes[s],
                               .mode = BENCH_LATENCY, .stream = env.stream, .raw = raw_share,
                               .lib = lib_share, .arg = &a, .sample_s = 0.05, .max_batch = 32,
                               .budget_s = 1.5, .min_pairs = 5, .max_pairs = 31,
                               .target = BENCH_TARGET_LE, .bound = 1.10};
            bench_compare(&env, &bc);
            cubuf_buffer_release(a.buf);
            B_CU(cuStreamSynchronize, env.stream);
        }
        cubuf_resource_release(res);
    }
    bench_section("copy through an imported mapping (cubuf column) vs between local buffers (raw column)");
    for (int mech = MECH_DEVICE_POOL; mech <= MECH_LEGACY; mech++) {
        cubuf_resource_t *res = NULL;
        if (make_resource(mech, &res) != CUBUF_SUCCESS) continue;
        cubuf_resource_release(res);
        bandwidth(&env, sock, mech, 256 * BENCH_MIB);
    }
    cmd_t q = {OP_QUIT, 0, 0};
    write_exact(sock, &q, sizeof q);
    close(sock);
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) bench_error(&env, "the peer process failed");
    bench_fini(&env);
    return bench_summary(&env, "bench_ipc");
}
