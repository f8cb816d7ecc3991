/* IPC descriptors without a GPU: the wire format's rules (every seed of the
 * fuzz corpus, valid and malformed), a bounded mutation run of the fuzz
 * properties without libFuzzer, serialize's contract, and passing
 * descriptors over Unix sockets (stream, seqpacket, datagram; more than one
 * message of fds; EOF, truncation, timeouts, credentials, a killed peer),
 * and each of deserialize, send and recv with its host allocations failing
 * in turn, with fd counts back to their baseline. */
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test.h"
#include "../fuzz/ipc_fuzz_one.h"
#include "../fuzz/ipc_seeds.h"

static int count_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    if (!d) return -1;
    int n = 0;
    while (readdir(d)) n++;
    closedir(d);
    return n;
}

static bool fd_open(int fd) { return fd >= 0 && fcntl(fd, F_GETFD) != -1; }

static bool detail_has(const char *piece)
{
    if (strstr(cubuf_last_error(), piece)) return true;
    fprintf(stderr, "  detail \"%s\" lacks \"%s\"\n", cubuf_last_error(), piece);
    return false;
}

static size_t fd_limit;

static void raise_fd_limit(void)
{
    struct rlimit r;
    if (getrlimit(RLIMIT_NOFILE, &r) == 0) {
        r.rlim_cur = r.rlim_max;
        (void)setrlimit(RLIMIT_NOFILE, &r);
        getrlimit(RLIMIT_NOFILE, &r);
        fd_limit = r.rlim_cur == RLIM_INFINITY ? (size_t)1 << 20 : (size_t)r.rlim_cur;
    }
}

/* ---- the seeds ---- */

static void check_seed(const ipc_seed_t *s)
{
    if (s->nfds + 64 > fd_limit) {
        printf("  seed %s: skipped, needs %zu fds (limit %zu)\n", s->name, s->nfds, fd_limit);
        return;
    }
    int *fds = calloc(s->nfds + 1, sizeof *fds);
    unsigned char *owned = calloc(s->nfds + 1, 1);
    T_CHECK(fds && owned);
    if (seed_open_fds(s, fds, owned) != 0) {
        fprintf(stderr, "seed %s: cannot open its fds\n", s->name);
        t_failures++;
        return;
    }
    cubuf_ipc_descriptor_t *d = NULL;
    cubuf_status_t st = cubuf_ipc_descriptor_deserialize(s->bytes, s->len, fds, s->nfds, &d);
    if (!s->expect) {
        if (st != CUBUF_SUCCESS) {
            fprintf(stderr, "seed %s: valid seed refused: %s\n", s->name, cubuf_last_error());
            t_failures++;
            seed_close_fds(fds, owned, s->nfds);
        } else {
            cubuf_ipc_descriptor_info_t info = CUBUF_IPC_DESCRIPTOR_INFO_INIT;
            T_OK(cubuf_ipc_descriptor_info(d, &info));
            T_CHECK(info.fd_count == s->nfds);
            T_CHECK((int)info.mechanism == (s->bytes[10] | s->bytes[11] << 8));
            size_t len = 0, n = 0;
            T_OK(cubuf_ipc_descriptor_serialize(d, NULL, &len, NULL, &n));
            uint8_t *again = malloc(len);
            int *back = calloc(n + 1, sizeof *back);
            T_OK(cubuf_ipc_descriptor_serialize(d, again, &len, back, &n));
            T_CHECK(len == s->len && memcmp(again, s->bytes, len) == 0);
            T_CHECK(n == s->nfds && (n == 0 || memcmp(back, fds, n * sizeof *fds) == 0));
            free(again);
            free(back);
            cubuf_ipc_descriptor_destroy(d);
            for (size_t i = 0; i < s->nfds; i++) T_CHECK(!fd_open(fds[i])); /* the descriptor owned them */
        }
    } else {
        if (st != CUBUF_ERROR_INVALID_DESCRIPTOR) {
            fprintf(stderr, "seed %s: expected CUBUF_ERROR_INVALID_DESCRIPTOR, got %s (%s)\n", s->name,
                    cubuf_status_name(st), cubuf_last_error());
            t_failures++;
            if (st == CUBUF_SUCCESS) {
                cubuf_ipc_descriptor_destroy(d);
                free(fds);
                free(owned);
                return;
            }
        } else if (!detail_has(s->expect)) {
            fprintf(stderr, "seed %s: wrong rule reported\n", s->name);
            t_failures++;
        }
        T_CHECK(d == NULL);
        for (size_t i = 0; i < s->nfds; i++)
            if (owned[i]) T_CHECK(fd_open(fds[i])); /* still the caller's */
        seed_close_fds(fds, owned, s->nfds);
    }
    free(fds);
    free(owned);
}

static void test_seeds(const ipc_seed_list_t *seeds)
{
    int base = count_fds();
    for (size_t i = 0; i < seeds->n; i++) check_seed(&seeds->v[i]);
    T_CHECK(count_fds() == base);
}

/* A deterministic mutation run of the fuzz properties (no libFuzzer). */
static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint64_t next_rand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

static void test_mutations(const ipc_seed_list_t *seeds, unsigned rounds)
{
    static uint8_t buf[CUBUF_IPC_MAX_BYTES + 64];
    unsigned made = 0;
    ipc_fuzz_one(buf, 0); /* opens its /dev/null once, before the baseline */
    int base = count_fds();
    for (unsigned r = 0; r < rounds; r++) {
        const ipc_seed_t *s = &seeds->v[next_rand() % seeds->n];
        size_t len = s->len > sizeof buf ? sizeof buf : s->len;
        memcpy(buf, s->bytes, len);
        unsigned edits = 1 + next_rand() % 4;
        for (unsigned e = 0; e < edits; e++) {
            switch (next_rand() % 5) {
            case 0: if (len) buf[next_rand() % len] ^= (uint8_t)(1u << (next_rand() % 8)); break;
            case 1: if (len) buf[next_rand() % len] = (uint8_t)next_rand(); break;
            case 2: if (len) len = next_rand() % len; break; /* truncate */
            case 3: if (len + 8 <= sizeof buf) { memset(buf + len, (int)(next_rand() & 0xff), 8); len += 8; } break;
            default: /* a field set to an edge value */
                if (len >= 48) {
                    static const uint64_t edges[] = {0, 1, 4095, 4096, 2097152, UINT32_MAX,
                                                     (uint64_t)1 << 44, UINT64_MAX};
                    uint64_t v = edges[next_rand() % 8];
                    size_t at = (next_rand() % (len / 4)) * 4;
                    for (int k = 0; k < 8 && at + k < len; k++) buf[at + k] = (uint8_t)(v >> (8 * k));
                }
            }
        }
        made += (unsigned)ipc_fuzz_one(buf, len);
    }
    printf("  %u mutated inputs, %u accepted\n", rounds, made);
    T_CHECK(count_fds() == base);
}

/* Files of a libFuzzer corpus (CUBUF_IPC_CORPUS=DIR), through the same properties. */
static void test_corpus_dir(void)
{
    const char *dir = getenv("CUBUF_IPC_CORPUS");
    if (!dir || !*dir) return;
    DIR *d = opendir(dir);
    if (!d) {
        fprintf(stderr, "CUBUF_IPC_CORPUS=%s: %s\n", dir, strerror(errno));
        t_failures++;
        return;
    }
    static uint8_t buf[1 << 16];
    unsigned n = 0;
    for (struct dirent *e; (e = readdir(d));) {
        if (e->d_name[0] == '.') continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        FILE *f = fopen(path, "rb");
        if (!f) continue;
        size_t len = fread(buf, 1, sizeof buf, f);
        fclose(f);
        ipc_fuzz_one(buf, len);
        n++;
    }
    closedir(d);
    printf("  %u corpus files from %s\n", n, dir);
}

/* ---- serialize and deserialize contracts ---- */

static cubuf_ipc_descriptor_t *make_desc(const ipc_seed_list_t *seeds, const char *name)
{
    for (size_t i = 0; i < seeds->n; i++) {
        const ipc_seed_t *s = &seeds->v[i];
        if (strcmp(s->name, name) != 0) continue;
        int *fds = calloc(s->nfds + 1, sizeof *fds);
        unsigned char *owned = calloc(s->nfds + 1, 1);
        if (seed_open_fds(s, fds, owned) != 0) abort();
        cubuf_ipc_descriptor_t *d = NULL;
        T_REQUIRE(cubuf_ipc_descriptor_deserialize(s->bytes, s->len, fds, s->nfds, &d));
        free(fds);
        free(owned);
        return d;
    }
    fprintf(stderr, "no seed %s\n", name);
    exit(1);
}

static void test_contracts(const ipc_seed_list_t *seeds)
{
    cubuf_ipc_descriptor_t *d = make_desc(seeds, "valid_vmm_3");
    size_t len = 0, n = 0;
    T_STATUS(cubuf_ipc_descriptor_serialize(NULL, NULL, &len, NULL, &n), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_ipc_descriptor_serialize(d, NULL, NULL, NULL, &n), CUBUF_ERROR_INVALID_ARGUMENT);
    T_OK(cubuf_ipc_descriptor_serialize(d, NULL, &len, NULL, &n));
    T_CHECK(len == CUBUF_IPC_VMM_BYTES(3) && n == 3);
    uint8_t bytes[256];
    int fds[3] = {-7, -7, -7};
    size_t small = len - 1, nf = 3;
    T_STATUS(cubuf_ipc_descriptor_serialize(d, bytes, &small, fds, &nf), CUBUF_ERROR_OUT_OF_RANGE);
    T_CHECK(small == len - 1 && fds[0] == -7); /* nothing written */
    size_t big = sizeof bytes, few = 2;
    T_STATUS(cubuf_ipc_descriptor_serialize(d, bytes, &big, fds, &few), CUBUF_ERROR_OUT_OF_RANGE);
    big = sizeof bytes;
    nf = 3;
    T_STATUS(cubuf_ipc_descriptor_serialize(d, bytes, &big, NULL, &nf), CUBUF_ERROR_OUT_OF_RANGE);
    T_OK(cubuf_ipc_descriptor_serialize(d, bytes, &big, fds, &nf));
    T_CHECK(big == len && nf == 3 && fd_open(fds[0]) && fd_open(fds[2]));
    cubuf_ipc_descriptor_info_t info = CUBUF_IPC_DESCRIPTOR_INFO_INIT;
    T_OK(cubuf_ipc_descriptor_info(d, &info));
    T_CHECK(info.mechanism == CUBUF_IPC_MECHANISM_VMM && info.chunk_count == 3 && info.fd_count == 3);
    T_CHECK(info.extent == 12u << 20 && info.offset == 2u << 20 && info.size == 8u << 20);
    info.struct_size = 4;
    T_STATUS(cubuf_ipc_descriptor_info(d, &info), CUBUF_ERROR_INVALID_ARGUMENT);
    cubuf_ipc_descriptor_destroy(d);
    T_CHECK(!fd_open(fds[0]) && !fd_open(fds[2]));
    cubuf_ipc_descriptor_destroy(NULL);

    cubuf_ipc_descriptor_t *out = NULL;
    T_STATUS(cubuf_ipc_descriptor_deserialize(bytes, len, NULL, 0, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_ipc_descriptor_deserialize(NULL, 10, NULL, 0, &out), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_ipc_descriptor_deserialize(bytes, len, NULL, 3, &out), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(out == NULL);
}

/* ---- sockets ---- */

/* The same bytes and, fd by fd, the same open files (new numbers). */
static void check_same(const cubuf_ipc_descriptor_t *a, const cubuf_ipc_descriptor_t *b)
{
    size_t la = 0, na = 0, lb = 0, nb = 0;
    T_OK(cubuf_ipc_descriptor_serialize(a, NULL, &la, NULL, &na));
    T_OK(cubuf_ipc_descriptor_serialize(b, NULL, &lb, NULL, &nb));
    T_CHECK(la == lb && na == nb);
    if (la != lb || na != nb) return;
    uint8_t *ba = malloc(la), *bb = malloc(lb);
    int *fa = calloc(na + 1, sizeof *fa), *fb = calloc(nb + 1, sizeof *fb);
    T_OK(cubuf_ipc_descriptor_serialize(a, ba, &la, fa, &na));
    T_OK(cubuf_ipc_descriptor_serialize(b, bb, &lb, fb, &nb));
    T_CHECK(memcmp(ba, bb, la) == 0);
    for (size_t i = 0; i < na; i++) {
        struct stat sa, sb;
        T_CHECK(fa[i] != fb[i]);
        T_CHECK(fstat(fa[i], &sa) == 0 && fstat(fb[i], &sb) == 0 && sa.st_rdev == sb.st_rdev &&
                sa.st_ino == sb.st_ino);
        T_CHECK(fcntl(fb[i], F_GETFD) & FD_CLOEXEC);
    }
    free(ba);
    free(bb);
    free(fa);
    free(fb);
}

static void test_round_trip(const ipc_seed_list_t *seeds, int type)
{
    int base = count_fds();
    int sv[2];
    T_CHECK(socketpair(AF_UNIX, type | SOCK_CLOEXEC, 0, sv) == 0);
    const char *names[] = {"valid_pool", "valid_pool_pinned", "valid_legacy", "valid_vmm_1",
                           "valid_vmm_3", "valid_vmm_300"};
    cubuf_ipc_recv_options_t o = CUBUF_IPC_RECV_OPTIONS_INIT;
    o.timeout_ms = 5000;
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
        cubuf_ipc_descriptor_t *d = make_desc(seeds, names[i]), *r = NULL;
        T_OK(cubuf_ipc_send(sv[0], d));
        T_OK(cubuf_ipc_recv(sv[1], &o, &r));
        if (r) check_same(d, r);
        cubuf_ipc_descriptor_destroy(r);
        cubuf_ipc_descriptor_destroy(d);
    }
    /* Back to back: the receiver takes exactly one descriptor each time. */
    cubuf_ipc_descriptor_t *a = make_desc(seeds, "valid_vmm_300"), *b = make_desc(seeds, "valid_legacy");
    cubuf_ipc_descriptor_t *c = make_desc(seeds, "valid_pool");
    T_OK(cubuf_ipc_send(sv[0], a));
    T_OK(cubuf_ipc_send(sv[0], b));
    T_OK(cubuf_ipc_send(sv[0], c));
    cubuf_ipc_descriptor_t *ra = NULL, *rb = NULL, *rc = NULL;
    T_OK(cubuf_ipc_recv(sv[1], &o, &ra));
    T_OK(cubuf_ipc_recv(sv[1], &o, &rb));
    T_OK(cubuf_ipc_recv(sv[1], &o, &rc));
    if (ra && rb && rc) {
        check_same(a, ra);
        check_same(b, rb);
        check_same(c, rc);
    }
    cubuf_ipc_descriptor_destroy(a);
    cubuf_ipc_descriptor_destroy(b);
    cubuf_ipc_descriptor_destroy(c);
    cubuf_ipc_descriptor_destroy(ra);
    cubuf_ipc_descriptor_destroy(rb);
    cubuf_ipc_descriptor_destroy(rc);
    close(sv[0]);
    close(sv[1]);
    T_CHECK(count_fds() == base);
}

/* ---- host allocation faults ---- */

/* After a call made with an allocation fault armed: disarms; true if the
 * fault fired, which must have failed the call with OUT_OF_MEMORY. */
static bool alloc_faulted(const char *what, unsigned n, cubuf_status_t st)
{
    bool fired = cubuf_fault_fired() && cubuf_fault_fired_alloc();
    cubuf_fault_reset();
    if (fired ? st != CUBUF_ERROR_OUT_OF_MEMORY : st != CUBUF_SUCCESS) {
        fprintf(stderr, "%s with host allocation %u %s: %s (%s)\n", what, n,
                fired ? "failing" : "not failing", cubuf_status_name(st), cubuf_last_error());
        t_failures++;
    }
    return fired;
}

static bool nothing_queued(int sock)
{
    char c;
    return recv(sock, &c, 1, MSG_DONTWAIT | MSG_PEEK) == -1 && errno == EAGAIN;
}

/* Deserialize, send and receive with their n-th host allocation failing,
 * n = 1, 2, ... until they succeed: CUBUF_ERROR_OUT_OF_MEMORY and no
 * descriptor; deserialize leaves the caller's fds open and the caller's,
 * send queues nothing and keeps the descriptor usable, recv closes every fd
 * it received; fd counts end at their baseline. */
static void test_alloc_faults(const ipc_seed_list_t *seeds)
{
    int base = count_fds();
    const char *names[] = {"valid_pool", "valid_legacy", "valid_vmm_3"};
    cubuf_ipc_recv_options_t o = CUBUF_IPC_RECV_OPTIONS_INIT;
    o.timeout_ms = 5000;
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
        const ipc_seed_t *s = NULL;
        for (size_t k = 0; k < seeds->n && !s; k++)
            if (strcmp(seeds->v[k].name, names[i]) == 0) s = &seeds->v[k];
        if (!s) {
            fprintf(stderr, "no seed %s\n", names[i]);
            t_failures++;
            continue;
        }
        int *fds = calloc(s->nfds + 1, sizeof *fds);
        unsigned char *owned = calloc(s->nfds + 1, 1);
        if (!fds || !owned || seed_open_fds(s, fds, owned) != 0) abort();
        unsigned n = 1;
        for (;; n++) {
            cubuf_ipc_descriptor_t *d = NULL;
            cubuf_fault_fail_alloc_nth(n);
            cubuf_status_t st = cubuf_ipc_descriptor_deserialize(s->bytes, s->len, fds, s->nfds, &d);
            if (!alloc_faulted("deserialize", n, st) || n == 64) {
                cubuf_ipc_descriptor_destroy(d); /* closes the fds it took */
                break;
            }
            T_CHECK(d == NULL);
            for (size_t k = 0; k < s->nfds; k++) T_CHECK(fd_open(fds[k]));
        }
        T_CHECK(n >= 2); /* at least the descriptor object */
        free(fds);
        free(owned);
        printf("  %s: deserialize failed by %u host allocation(s) in turn\n", names[i], n - 1);

        cubuf_ipc_descriptor_t *d = make_desc(seeds, names[i]);
        unsigned sends = 0, recvs = 0;
        for (int recv_side = 0; recv_side < 2; recv_side++) {
            for (n = 1;; n++) {
                int sv[2];
                T_CHECK(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) == 0);
                if (recv_side) T_OK(cubuf_ipc_send(sv[0], d));
                int before = count_fds();
                cubuf_ipc_descriptor_t *r = NULL;
                cubuf_fault_fail_alloc_nth(n);
                bool fired = recv_side ? alloc_faulted("recv", n, cubuf_ipc_recv(sv[1], &o, &r))
                                       : alloc_faulted("send", n, cubuf_ipc_send(sv[0], d));
                if (fired) {
                    T_CHECK(r == NULL);
                    T_CHECK(count_fds() == before); /* recv: every received fd closed */
                    if (!recv_side) T_CHECK(nothing_queued(sv[1]));
                } else {
                    if (!recv_side) T_OK(cubuf_ipc_recv(sv[1], &o, &r));
                    if (r) check_same(d, r); /* send: the descriptor is intact */
                    cubuf_ipc_descriptor_destroy(r);
                }
                close(sv[0]);
                close(sv[1]);
                if (!fired || n == 64) break;
            }
            *(recv_side ? &recvs : &sends) = n - 1;
        }
        T_CHECK(sends >= 1 && recvs >= 2); /* the wire bytes; the receive buffers */
        printf("  %s: send failed by %u, recv by %u host allocation(s) in turn\n", names[i], sends,
               recvs);
        cubuf_ipc_descriptor_destroy(d);
    }
    T_CHECK(count_fds() == base);
}

/* A VMM descriptor of n fds (on /dev/null) sent and received over a
 * socket pair, the receiver passing credentials (SO_PASSCRED) if asked:
 * it comes back the same, and every fd is closed after. */
static void round_trip_fds(int n, bool passcred)
{
    if (fd_limit < 3 * (size_t)n + 64) {
        printf("  round trip of %d fds skipped: fd limit %zu\n", n, fd_limit);
        return;
    }
    int base = count_fds();
    static uint8_t b[CUBUF_IPC_MAX_BYTES];
    size_t len = seed_vmm(b, n);
    int *fds = malloc(n * sizeof *fds);
    for (int i = 0; i < n; i++) fds[i] = open("/dev/null", O_RDONLY | O_CLOEXEC);
    cubuf_ipc_descriptor_t *d = NULL, *r = NULL;
    T_REQUIRE(cubuf_ipc_descriptor_deserialize(b, len, fds, n, &d));
    int sv[2], one = 1;
    T_CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
    if (passcred) T_CHECK(setsockopt(sv[1], SOL_SOCKET, SO_PASSCRED, &one, sizeof one) == 0);
    T_OK(cubuf_ipc_send(sv[0], d));
    T_OK(cubuf_ipc_recv(sv[1], NULL, &r));
    if (r) check_same(d, r);
    cubuf_ipc_descriptor_destroy(r);
    cubuf_ipc_descriptor_destroy(d);
    free(fds);
    close(sv[0]);
    close(sv[1]);
    T_CHECK(count_fds() == base);
}

/* The largest descriptor: CUBUF_IPC_MAX_CHUNKS fds in five messages. */
static void test_max_chunks(void) { round_trip_fds(CUBUF_IPC_MAX_CHUNKS, false); }

/* The receiving socket passes credentials (SO_PASSCRED): each message's
 * SCM_CREDENTIALS takes room in the control buffer besides the 250 fds. */
static void test_passcred_many_fds(void) { round_trip_fds(CUBUF_IPC_FDS_PER_MESSAGE, true); }

/* Raw sendmsg: `len` bytes with `nfds` fds attached. */
static void raw_send(int sock, const void *p, size_t len, const int *fds, size_t nfds)
{
    union {
        struct cmsghdr align;
        char buf[CMSG_SPACE(sizeof(int) * 8)];
    } cm;
    struct iovec iov = {(void *)p, len};
    struct msghdr m = {0};
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    if (nfds) {
        memset(&cm, 0, sizeof cm);
        m.msg_control = cm.buf;
        m.msg_controllen = CMSG_SPACE(nfds * sizeof(int));
        struct cmsghdr *c = CMSG_FIRSTHDR(&m);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(nfds * sizeof(int));
        memcpy(CMSG_DATA(c), fds, nfds * sizeof(int));
    }
    if (sendmsg(sock, &m, MSG_NOSIGNAL) != (ssize_t)len) {
        fprintf(stderr, "raw sendmsg failed: %s\n", strerror(errno));
        t_failures++;
    }
}

static void test_socket_failures(const ipc_seed_list_t *seeds)
{
    int base = count_fds();
    int sv[2];
    cubuf_ipc_descriptor_t *r = NULL;
    cubuf_ipc_recv_options_t o = CUBUF_IPC_RECV_OPTIONS_INIT;
    o.timeout_ms = 5000;
    uint8_t pool[CUBUF_IPC_POOL_BYTES];
    seed_pool(pool, 0);
    int nul = open("/dev/null", O_RDONLY | O_CLOEXEC);

    /* EOF before anything: a system error naming it, not a hang. */
    T_CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
    close(sv[0]);
    T_STATUS(cubuf_ipc_recv(sv[1], &o, &r), CUBUF_ERROR_SYSTEM);
    T_CHECK(detail_has("closed"));
    close(sv[1]);

    /* Half a descriptor, then EOF: truncated, and the fd that came along is closed. */
    T_CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
    raw_send(sv[0], pool, 60, &nul, 1);
    close(sv[0]);
    T_STATUS(cubuf_ipc_recv(sv[1], &o, &r), CUBUF_ERROR_INVALID_DESCRIPTOR);
    T_CHECK(detail_has("truncated"));
    close(sv[1]);

    /* Nothing arrives: the timeout. */
    T_CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
    cubuf_ipc_recv_options_t quick = o;
    quick.timeout_ms = 100;
    T_STATUS(cubuf_ipc_recv(sv[1], &quick, &r), CUBUF_ERROR_SYSTEM);
    T_CHECK(detail_has("timed out"));

    /* Wrong credentials: refused before anything is read; the right ones pass. */
    cubuf_ipc_descriptor_t *d = make_desc(seeds, "valid_pool");
    T_OK(cubuf_ipc_send(sv[0], d));
    cubuf_ipc_recv_options_t cred = o;
    cred.check_uid = true;
    cred.uid = getuid() + 1;
    T_STATUS(cubuf_ipc_recv(sv[1], &cred, &r), CUBUF_ERROR_INVALID_DESCRIPTOR);
    T_CHECK(detail_has("uid"));
    cred.uid = getuid();
    cred.check_pid = true;
    cred.pid = getpid() + 1;
    T_STATUS(cubuf_ipc_recv(sv[1], &cred, &r), CUBUF_ERROR_INVALID_DESCRIPTOR);
    T_CHECK(detail_has("pid"));
    cred.pid = getpid(); /* socketpair: the peer is the process that made the pair */
    T_OK(cubuf_ipc_recv(sv[1], &cred, &r));
    if (r) check_same(d, r);
    cubuf_ipc_descriptor_destroy(r);
    r = NULL;

    /* A timeout of 0 polls: a descriptor already queued is read, an empty
     * socket times out at once. */
    cubuf_ipc_recv_options_t now = o;
    now.timeout_ms = 0;
    T_OK(cubuf_ipc_send(sv[0], d));
    T_OK(cubuf_ipc_recv(sv[1], &now, &r));
    if (r) check_same(d, r);
    cubuf_ipc_descriptor_destroy(r);
    r = NULL;
    T_STATUS(cubuf_ipc_recv(sv[1], &now, &r), CUBUF_ERROR_SYSTEM);
    T_CHECK(detail_has("timed out"));
    T_CHECK(r == NULL);
    cubuf_ipc_descriptor_destroy(d);

    /* Garbage: wrong magic; its fd is closed. */
    uint8_t junk[CUBUF_IPC_POOL_BYTES];
    memcpy(junk, pool, sizeof junk);
    junk[0] = 'X';
    raw_send(sv[0], junk, sizeof junk, &nul, 1);
    T_STATUS(cubuf_ipc_recv(sv[1], &o, &r), CUBUF_ERROR_INVALID_DESCRIPTOR);
    T_CHECK(detail_has("magic"));
    close(sv[0]);
    close(sv[1]);

    /* More fds than announced (the stream is resynchronized by closing it). */
    T_CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
    uint8_t legacy[CUBUF_IPC_LEGACY_BYTES];
    seed_legacy(legacy);
    int two[2] = {nul, nul};
    raw_send(sv[0], legacy, sizeof legacy, two, 2);
    T_STATUS(cubuf_ipc_recv(sv[1], &o, &r), CUBUF_ERROR_INVALID_DESCRIPTOR);
    T_CHECK(detail_has("fds"));
    close(sv[0]);
    close(sv[1]);

    /* A header announcing an absurd length. */
    T_CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
    memcpy(junk, pool, sizeof junk);
    seed_put32(junk + 12, 0x7fffffff);
    raw_send(sv[0], junk, sizeof junk, NULL, 0);
    T_STATUS(cubuf_ipc_recv(sv[1], &o, &r), CUBUF_ERROR_INVALID_DESCRIPTOR);
    close(sv[0]);
    close(sv[1]);

    /* A seqpacket record longer than any descriptor. */
    T_CHECK(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) == 0);
    static uint8_t huge[CUBUF_IPC_MAX_BYTES + 100];
    seed_header(huge, 2, sizeof huge, 0, 0, 1, 0, 1);
    raw_send(sv[0], huge, sizeof huge, NULL, 0);
    T_STATUS(cubuf_ipc_recv(sv[1], &o, &r), CUBUF_ERROR_INVALID_DESCRIPTOR);
    T_CHECK(detail_has("oversized"));
    close(sv[0]);
    close(sv[1]);

    /* Sending to a peer that is gone: an error, never SIGPIPE. */
    T_CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
    close(sv[1]);
    d = make_desc(seeds, "valid_vmm_3");
    T_STATUS(cubuf_ipc_send(sv[0], d), CUBUF_ERROR_SYSTEM);
    cubuf_ipc_descriptor_destroy(d);
    close(sv[0]);

    T_STATUS(cubuf_ipc_send(-1, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_ipc_recv(0, NULL, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_ipc_recv(nul, NULL, &r), CUBUF_ERROR_SYSTEM); /* not a socket */
    close(nul);
    T_CHECK(r == NULL);
    T_CHECK(count_fds() == base);
}

/* A peer killed in the middle of a descriptor, and one killed before
 * sending: the receiver returns an error at once, with no fd left behind. */
static void test_killed_peer(const ipc_seed_list_t *seeds)
{
    int base = count_fds();
    cubuf_ipc_recv_options_t o = CUBUF_IPC_RECV_OPTIONS_INIT; /* no timeout: EOF must end it */
    for (int mid = 0; mid < 2; mid++) {
        int sv[2];
        T_CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
        pid_t pid = fork();
        if (pid == 0) {
            close(sv[1]);
            if (mid) {
                uint8_t pool[CUBUF_IPC_POOL_BYTES];
                seed_pool(pool, 0);
                int fd = open("/dev/null", O_RDONLY);
                raw_send(sv[0], pool, 70, &fd, 1);
            } else {
                char c;
                (void)!read(sv[0], &c, 1); /* wait to be killed */
            }
            raise(SIGKILL);
            _exit(0);
        }
        close(sv[0]);
        if (!mid) kill(pid, SIGKILL);
        cubuf_ipc_descriptor_t *r = NULL;
        cubuf_status_t st = cubuf_ipc_recv(sv[1], &o, &r);
        T_CHECK(st == (mid ? CUBUF_ERROR_INVALID_DESCRIPTOR : CUBUF_ERROR_SYSTEM));
        T_CHECK(r == NULL);
        int status = 0;
        waitpid(pid, &status, 0);
        T_CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
        close(sv[1]);
    }
    (void)seeds;
    T_CHECK(count_fds() == base);
}

int main(void)
{
    raise_fd_limit();
    ipc_seed_list_t seeds = ipc_seeds_build();
    printf("%zu seeds\n", seeds.n);
    test_seeds(&seeds);
    test_mutations(&seeds, 30000);
    test_corpus_dir();
    test_contracts(&seeds);
    test_round_trip(&seeds, SOCK_STREAM);
    test_round_trip(&seeds, SOCK_SEQPACKET);
    test_round_trip(&seeds, SOCK_DGRAM);
    test_max_chunks();
    test_passcred_many_fds();
    test_socket_failures(&seeds);
    test_killed_peer(&seeds);
    test_alloc_faults(&seeds);
    ipc_seeds_free(&seeds);
    return t_finish("test_ipc_wire");
}
