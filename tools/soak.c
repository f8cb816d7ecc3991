/* cubuf_soak: a soak run of the library, by hand (not a ctest test, never
 * installed). For a given time, THREADS threads (default 16), each with its
 * own stream, mix these operations on shared resources of device 0, checking
 * every byte they read back:
 *   alloc        allocate (device pool, sync device memory, context buffer),
 *                fill, read back, close on the stream
 *   copy         host -> device, device -> device (copy_from, copy_to_new,
 *                a slice), device -> host, compared
 *   fill         1-, 2- and 4-byte patterns, read back
 *   grow         a virtual-memory buffer grown up to three times, the old
 *                data checked after each grow
 *   alias_close  a VMM buffer and its grown alias closed in either order, a
 *                slice keeping the last one open (close says BUSY)
 *   ipc          export (pool, VMM or legacy, as the device allows) to a
 *                helper child process (this program, re-executed with
 *                --child FD) over a socketpair: the child imports, reads the
 *                bytes back, writes its own, closes and answers; the parent
 *                checks both
 * Afterwards: the statistics of every resource (live bytes and buffers 0,
 * allocation counts equal to what the threads made), the device memory the
 * pools hold (the driver's accounting, after a trim) and the open fds are
 * compared with the baseline taken after a warm-up round.
 *
 * Usage: cubuf_soak [--seconds S] [--threads N]    (defaults 10 s, 16 threads)
 * Prints one closing line; exits 0 when every check held, 1 otherwise,
 * 77 without a GPU (with the reason), 2 for bad arguments.
 * Uses the public API only. Runs on any driver that cubuf loads, the
 * test driver too (CUBUF_LIBCUDA). */
#include <cubuf.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_THREADS 256
#define ALLOC_MAX ((size_t)4 << 20) /* pool and sync-device buffers: 1 .. 4 MiB */
#define HEAD_BYTES ((size_t)64 << 10) /* what a grow keeps and checks */
#define REPLY_TIMEOUT_MS 120000    /* the child under compute-sanitizer is slow */
#define MAX_MESSAGES 20

enum { OP_ALLOC, OP_COPY, OP_FILL, OP_GROW, OP_ALIAS, OP_IPC, OP_KINDS };
static const char *const op_names[OP_KINDS] = {"alloc", "copy", "fill", "grow", "alias_close",
                                               "ipc"};
enum { MECH_POOL, MECH_VMM, MECH_LEGACY, MECHS };
static const char *const mech_names[MECHS] = {"pool", "vmm", "legacy"};
enum { RES_POOL, RES_SYNC, RES_CTX, RES_VMM, RESOURCES };
static const char *const res_names[RESOURCES] = {"pool", "sync", "context pool", "vmm"};

/* What the child answers for each import. */
typedef struct reply {
    int32_t ok;        /* 1: imported, read, written, closed */
    uint32_t fill;     /* the byte it wrote over the whole buffer */
    uint64_t checksum; /* of the bytes it read */
    uint64_t size;
} reply_t;

typedef struct soak {
    cubuf_context_t *ctx;
    cubuf_resource_t *res[RESOURCES];
    bool mech[MECHS]; /* which IPC mechanisms this device offers */
    size_t gran;      /* the VMM resource's granularity */
    size_t host_cap;  /* bytes of each worker's host buffers */
    int sock;         /* to the child; one exchange at a time under ipc_lock */
    bool sock_broken; /* an exchange failed halfway: the stream is out of step */
    pid_t child;
    pthread_mutex_t ipc_lock;
    struct timespec deadline;
    atomic_ullong ops[OP_KINDS], ipc[MECHS];
    atomic_ullong allocs[RESOURCES]; /* allocate calls that succeeded */
    atomic_ullong errors;
    atomic_uint messages;
} soak_t;

typedef struct worker {
    soak_t *s;
    int index;
    uint64_t rng;
    CUstream stream;
    unsigned char *host, *back;
    int only_mech; /* the warm-up tries each IPC mechanism; -1: any */
    pthread_t tid;
} worker_t;

static void vsay(const char *fmt, va_list ap)
{
    fputs("cubuf_soak: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
}

/* An error of an operation: counted; the first MAX_MESSAGES are described. */
static void report(soak_t *s, const char *fmt, ...)
{
    atomic_fetch_add(&s->errors, 1);
    if (atomic_fetch_add(&s->messages, 1) >= MAX_MESSAGES) return;
    va_list ap;
    va_start(ap, fmt);
    vsay(fmt, ap);
    va_end(ap);
}

/* A failed final check: always described (the closing line says which). */
static void say(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsay(fmt, ap);
    va_end(ap);
}

/* A failed call: counted, and described with the thread's detail. */
#define TRY(w, op, call)                                                                    \
    do {                                                                                    \
        cubuf_status_t st_ = (call);                                                        \
        if (st_ != CUBUF_SUCCESS) {                                                         \
            report((w)->s, "thread %d, %s: %s: %s: %s", (w)->index, op_names[op], #call,   \
                   cubuf_status_name(st_), cubuf_last_error());                             \
            goto done;                                                                      \
        }                                                                                   \
    } while (0)

static uint64_t next(uint64_t *x) /* xorshift64* */
{
    *x ^= *x >> 12;
    *x ^= *x << 25;
    *x ^= *x >> 27;
    return *x * 2685821657736338717ull;
}

static size_t below(worker_t *w, size_t n) { return (size_t)(next(&w->rng) % n); }

static void random_bytes(worker_t *w, unsigned char *p, size_t n)
{
    for (size_t i = 0; i < n; i += 8) {
        uint64_t v = next(&w->rng);
        memcpy(p + i, &v, n - i < 8 ? n - i : 8);
    }
}

static uint64_t checksum(const unsigned char *p, size_t n) /* FNV-1a */
{
    uint64_t h = 14695981039346656037ull;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

/* Reads `n` bytes of buf back on `stream` and compares them with `want` (a
 * pattern of `period` bytes repeated, or n bytes when period is 0). */
static bool read_back_on(worker_t *w, int op, cubuf_buffer_t *buf, const unsigned char *want,
                         size_t period, size_t n, CUstream stream)
{
    size_t got = 0;
    cubuf_status_t st = cubuf_buffer_copy_to_host(buf, 0, (int64_t)n, w->back, w->s->host_cap,
                                                  stream, &got);
    if (st != CUBUF_SUCCESS || got != n) {
        report(w->s, "thread %d, %s: reading %zu bytes back: %s (%zu copied): %s", w->index,
               op_names[op], n, cubuf_status_name(st), got, cubuf_last_error());
        return false;
    }
    for (size_t i = 0; i < n; i++)
        if (w->back[i] != want[period ? i % period : i]) {
            report(w->s, "thread %d, %s: byte %zu of %zu is 0x%02x, not 0x%02x", w->index,
                   op_names[op], i, n, w->back[i], want[period ? i % period : i]);
            return false;
        }
    return true;
}

static bool read_back(worker_t *w, int op, cubuf_buffer_t *buf, const unsigned char *want,
                      size_t period, size_t n)
{
    return read_back_on(w, op, buf, want, period, n, w->stream);
}

static bool allocate(worker_t *w, int op, int res, size_t size, cubuf_buffer_t **out)
{
    cubuf_status_t st = res == RES_CTX ? cubuf_context_new_buffer(w->s->ctx, size, out)
                                       : cubuf_resource_allocate(w->s->res[res], size, w->stream, out);
    if (st != CUBUF_SUCCESS) {
        report(w->s, "thread %d, %s: allocating %zu bytes from the %s resource: %s: %s", w->index,
               op_names[op], size, res_names[res], cubuf_status_name(st), cubuf_last_error());
        return false;
    }
    atomic_fetch_add(&w->s->allocs[res], 1);
    return true;
}

/* Closes on the worker's stream, or with close_stream false on the recorded one. */
static bool finish_on(worker_t *w, int op, cubuf_buffer_t *buf, bool close_stream)
{
    cubuf_status_t st = close_stream ? cubuf_buffer_close_on(buf, w->stream) : cubuf_buffer_close(buf);
    cubuf_buffer_release(buf);
    if (st == CUBUF_SUCCESS) return true;
    report(w->s, "thread %d, %s: close: %s: %s", w->index, op_names[op], cubuf_status_name(st),
           cubuf_last_error());
    return false;
}

static bool finish(worker_t *w, int op, cubuf_buffer_t *buf) { return finish_on(w, op, buf, true); }

static bool op_alloc(worker_t *w)
{
    const int op = OP_ALLOC, res = (int)below(w, 3); /* pool, sync or context */
    size_t size = 1 + below(w, ALLOC_MAX);
    cubuf_buffer_t *buf = NULL;
    unsigned char v = (unsigned char)next(&w->rng);
    bool ok = false;
    /* A context buffer lives on the context's legacy stream: used there. */
    CUstream stream = res == RES_CTX ? CU_STREAM_LEGACY : w->stream;
    if (!allocate(w, op, res, size, &buf)) return false;
    TRY(w, op, cubuf_buffer_fill_byte(buf, v, stream));
    ok = read_back_on(w, op, buf, &v, 1, size, stream);
done:
    return finish_on(w, op, buf, res != RES_CTX) && ok;
}

static bool op_copy(worker_t *w)
{
    const int op = OP_COPY;
    size_t size = 1 + below(w, ALLOC_MAX), off = below(w, size);
    cubuf_buffer_t *a = NULL, *b = NULL, *slice = NULL;
    bool ok = false, to_new = below(w, 2);
    random_bytes(w, w->host, size);
    if (!allocate(w, op, RES_POOL, size, &a)) return false;
    TRY(w, op, cubuf_buffer_copy_from_host(a, w->host, size, 0, -1, w->stream, NULL));
    if (to_new) {
        TRY(w, op, cubuf_buffer_copy_to_new(a, w->stream, NULL, &b));
        atomic_fetch_add(&w->s->allocs[RES_POOL], 1);
    } else {
        if (!allocate(w, op, RES_SYNC, size, &b)) goto done;
        TRY(w, op, cubuf_buffer_copy_from(b, a, w->stream, NULL));
    }
    if (!read_back(w, op, b, w->host, 0, size)) goto done;
    TRY(w, op, cubuf_buffer_slice(b, off, size - off, &slice));
    ok = read_back(w, op, slice, w->host + off, 0, size - off);
done:
    cubuf_buffer_release(slice); /* before b, whose close it would keep BUSY */
    if (b && !finish(w, op, b)) ok = false;
    return finish(w, op, a) && ok;
}

static bool op_fill(worker_t *w)
{
    const int op = OP_FILL;
    size_t unit = (size_t)1 << below(w, 3), size = unit * (1 + below(w, ALLOC_MAX / unit));
    unsigned char pattern[4];
    cubuf_buffer_t *buf = NULL;
    bool ok = false;
    random_bytes(w, pattern, sizeof pattern);
    if (!allocate(w, op, RES_POOL, size, &buf)) return false;
    TRY(w, op, cubuf_buffer_fill(buf, pattern, unit, w->stream));
    ok = read_back(w, op, buf, pattern, unit, size);
done:
    return finish(w, op, buf) && ok;
}

/* A VMM buffer of `granules` granules whose first HEAD_BYTES hold w->host. */
static bool vmm_start(worker_t *w, int op, size_t granules, cubuf_buffer_t **out)
{
    size_t head = HEAD_BYTES < w->s->gran ? HEAD_BYTES : w->s->gran;
    random_bytes(w, w->host, head);
    if (!allocate(w, op, RES_VMM, granules * w->s->gran, out)) return false;
    cubuf_status_t st = cubuf_buffer_copy_from_host(*out, w->host, head, 0, -1, w->stream, NULL);
    if (st == CUBUF_SUCCESS) return true;
    report(w->s, "thread %d, %s: writing the head: %s: %s", w->index, op_names[op],
           cubuf_status_name(st), cubuf_last_error());
    finish(w, op, *out);
    *out = NULL;
    return false;
}

static bool grow(worker_t *w, int op, cubuf_buffer_t *buf, size_t size, cubuf_buffer_t **out)
{
    cubuf_status_t st = cubuf_vmm_modify_allocation(w->s->res[RES_VMM], buf, size, NULL, out);
    if (st == CUBUF_SUCCESS && cubuf_buffer_size(*out) >= size) return true;
    report(w->s, "thread %d, %s: growing to %zu bytes: %s (size %zu): %s", w->index,
           op_names[op], size, cubuf_status_name(st), st ? 0 : cubuf_buffer_size(*out),
           cubuf_last_error());
    if (st == CUBUF_SUCCESS) finish(w, op, *out);
    return false;
}

static bool op_grow(worker_t *w)
{
    const int op = OP_GROW;
    size_t head = HEAD_BYTES < w->s->gran ? HEAD_BYTES : w->s->gran, granules = 1;
    cubuf_buffer_t *buf = NULL, *grown = NULL;
    bool ok = false;
    if (!vmm_start(w, op, 1, &buf)) return false;
    for (int i = 0, n = 1 + (int)below(w, 3); i < n; i++) {
        granules++;
        if (!grow(w, op, buf, granules * w->s->gran, &grown)) goto done;
        /* The old buffer aliases the new one: closing it unmaps nothing. */
        if (!finish(w, op, buf)) {
            buf = grown;
            goto done;
        }
        buf = grown;
        if (!read_back(w, op, buf, w->host, 0, head)) goto done;
    }
    unsigned char v = (unsigned char)next(&w->rng);
    TRY(w, op, cubuf_buffer_fill_byte(buf, v, w->stream));
    ok = read_back(w, op, buf, &v, 1, cubuf_buffer_size(buf));
done:
    return finish(w, op, buf) && ok;
}

static bool op_alias(worker_t *w)
{
    const int op = OP_ALIAS;
    size_t head = HEAD_BYTES < w->s->gran ? HEAD_BYTES : w->s->gran;
    cubuf_buffer_t *a = NULL, *b = NULL, *slice = NULL;
    bool ok = false;
    if (!vmm_start(w, op, 1, &a)) return false;
    if (!grow(w, op, a, (2 + below(w, 2)) * w->s->gran, &b)) goto done;
    if (below(w, 2)) { /* close the newer alias first */
        cubuf_buffer_t *t = a;
        a = b;
        b = t;
    }
    cubuf_status_t st = cubuf_buffer_close_on(a, w->stream);
    cubuf_buffer_release(a);
    a = NULL;
    TRY(w, op, st);
    if (!read_back(w, op, b, w->host, 0, head)) goto done;
    /* A slice keeps the survivor open: its close is refused until the slice goes. */
    TRY(w, op, cubuf_buffer_slice(b, 0, head, &slice));
    if ((st = cubuf_buffer_close(b)) != CUBUF_ERROR_BUSY) {
        report(w->s, "thread %d, %s: close under an open slice returned %s, not CUBUF_ERROR_BUSY",
               w->index, op_names[op], cubuf_status_name(st));
        goto done;
    }
    ok = read_back(w, op, slice, w->host, 0, head);
done:
    cubuf_buffer_release(slice);
    if (a && !finish(w, op, a)) ok = false;
    return (b ? finish(w, op, b) : true) && ok;
}

/* Exchanges one descriptor with the child; false (reported) on any failure. */
static bool ipc_exchange(worker_t *w, const cubuf_ipc_descriptor_t *desc, reply_t *r)
{
    soak_t *s = w->s;
    size_t got = 0;
    bool ok = false;
    pthread_mutex_lock(&s->ipc_lock);
    if (s->sock_broken) {
        report(s, "thread %d, ipc: an earlier exchange with the child failed", w->index);
        goto done;
    }
    cubuf_status_t st = cubuf_ipc_send(s->sock, desc);
    if (st != CUBUF_SUCCESS) {
        report(s, "thread %d, ipc: cubuf_ipc_send: %s: %s", w->index, cubuf_status_name(st),
               cubuf_last_error());
        goto done;
    }
    while (got < sizeof *r) {
        struct pollfd p = {s->sock, POLLIN, 0};
        int n = poll(&p, 1, REPLY_TIMEOUT_MS);
        ssize_t k = n > 0 ? recv(s->sock, (char *)r + got, sizeof *r - got, 0) : -1;
        if (n < 0 && errno == EINTR) continue;
        if (k <= 0) {
            report(s, "thread %d, ipc: no answer from the child (%s)", w->index,
                   n == 0 ? "timed out" : k == 0 ? "it closed the socket" : strerror(errno));
            goto done;
        }
        got += (size_t)k;
    }
    ok = true;
done:
    s->sock_broken = !ok;
    pthread_mutex_unlock(&s->ipc_lock);
    return ok;
}

static bool op_ipc(worker_t *w)
{
    const int op = OP_IPC;
    soak_t *s = w->s;
    int mech = w->only_mech >= 0 ? w->only_mech : (int)below(w, MECHS);
    if (!s->mech[0] && !s->mech[1] && !s->mech[2]) return false; /* no sharing here */
    while (!s->mech[mech]) mech = (mech + 1) % MECHS;
    static const int res_of[MECHS] = {RES_POOL, RES_VMM, RES_SYNC};
    size_t size = mech == MECH_VMM ? (1 + below(w, 2)) * s->gran : 1 + below(w, ALLOC_MAX);
    cubuf_buffer_t *buf = NULL;
    cubuf_ipc_descriptor_t *desc = NULL;
    reply_t r = {0, 0, 0, 0};
    bool ok = false;
    if (!allocate(w, op, res_of[mech], size, &buf)) return false;
    size = cubuf_buffer_size(buf); /* VMM: rounded */
    random_bytes(w, w->host, size);
    TRY(w, op, cubuf_buffer_copy_from_host(buf, w->host, size, 0, -1, w->stream, NULL));
    cubuf_status_t st = cubuf_buffer_ipc_descriptor(buf, &desc);
    if (st == CUBUF_ERROR_NOT_SUPPORTED && w->only_mech >= 0) {
        s->mech[mech] = false; /* found in the warm-up: this device cannot share so */
        goto done;
    }
    TRY(w, op, st);
    if (!ipc_exchange(w, desc, &r)) goto done;
    if (!r.ok || r.size != size || r.checksum != checksum(w->host, size)) {
        report(s, "thread %d, ipc (%s): the child %s (%llu bytes, checksum %s)", w->index,
               mech_names[mech], r.ok ? "read other bytes" : "failed",
               (unsigned long long)r.size, r.checksum == checksum(w->host, size) ? "equal" : "differs");
        goto done;
    }
    unsigned char v = (unsigned char)r.fill;
    if ((ok = read_back(w, op, buf, &v, 1, size))) atomic_fetch_add(&s->ipc[mech], 1);
done:
    cubuf_ipc_descriptor_destroy(desc);
    return finish(w, op, buf) && ok; /* the child closed its import first */
}

static bool (*const ops[OP_KINDS])(worker_t *) = {op_alloc, op_copy, op_fill,
                                                  op_grow,  op_alias, op_ipc};

static bool before_deadline(const soak_t *s)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return now.tv_sec < s->deadline.tv_sec ||
           (now.tv_sec == s->deadline.tv_sec && now.tv_nsec < s->deadline.tv_nsec);
}

static void *work(void *arg)
{
    worker_t *w = arg;
    while (before_deadline(w->s)) {
        /* ipc is serialized through one child: pick it less often. */
        int op = (int)below(w, 2 * OP_KINDS - 1) / 2;
        if (ops[op](w)) atomic_fetch_add(&w->s->ops[op], 1);
    }
    return NULL;
}

/* ---- the child: imports what the parent sends -------------------------------- */

static int child_main(int sock)
{
    cubuf_context_t *ctx = NULL;
    unsigned char *host = NULL;
    size_t cap = 0;
    int rc = 1;
    cubuf_ipc_recv_options_t ro = CUBUF_IPC_RECV_OPTIONS_INIT;
    ro.check_pid = true; /* a socketpair's peer is the process that made it */
    ro.pid = getppid();
    cubuf_status_t st = cubuf_context_create(0, &ctx);
    for (unsigned n = 0; st == CUBUF_SUCCESS; n++) {
        cubuf_ipc_descriptor_t *desc = NULL;
        cubuf_buffer_t *buf = NULL;
        reply_t r = {0, 0, 0, 0};
        const char *step = "cubuf_ipc_recv";
        if ((st = cubuf_ipc_recv(sock, &ro, &desc)) != CUBUF_SUCCESS) {
            if (st == CUBUF_ERROR_SYSTEM && strstr(cubuf_last_error(), "peer closed")) rc = 0;
            break; /* the parent is done (or the stream is broken) */
        }
        step = "cubuf_context_open_ipc_buffer";
        if ((st = cubuf_context_open_ipc_buffer(ctx, desc, &buf)) != CUBUF_SUCCESS) goto answer;
        r.size = cubuf_buffer_size(buf);
        if (r.size > cap) {
            free(host);
            cap = 0;
            if (!(host = malloc(r.size))) {
                st = CUBUF_ERROR_OUT_OF_MEMORY;
                step = "malloc";
                goto answer;
            }
            cap = r.size;
        }
        step = "cubuf_buffer_copy_to_host";
        if ((st = cubuf_buffer_copy_to_host(buf, 0, -1, host, cap, 0, NULL)) != CUBUF_SUCCESS)
            goto answer;
        r.checksum = checksum(host, r.size);
        r.fill = (uint32_t)((r.checksum ^ n) & 0xff);
        step = "cubuf_buffer_fill_byte";
        if ((st = cubuf_buffer_fill_byte(buf, r.fill, 0)) != CUBUF_SUCCESS) goto answer;
        step = "cubuf_context_synchronize";
        if ((st = cubuf_context_synchronize(ctx)) != CUBUF_SUCCESS) goto answer;
        step = "cubuf_buffer_close";
        if ((st = cubuf_buffer_close(buf)) != CUBUF_SUCCESS) goto answer;
        step = "cubuf_context_synchronize"; /* the close's free, before the exporter's */
        if ((st = cubuf_context_synchronize(ctx)) != CUBUF_SUCCESS) goto answer;
        r.ok = 1;
    answer:
        if (st != CUBUF_SUCCESS)
            fprintf(stderr, "cubuf_soak child: %s: %s: %s\n", step, cubuf_status_name(st),
                    cubuf_last_error());
        cubuf_buffer_release(buf);
        cubuf_ipc_descriptor_destroy(desc);
        if (send(sock, &r, sizeof r, MSG_NOSIGNAL) != (ssize_t)sizeof r) {
            perror("cubuf_soak child: send");
            break;
        }
        st = CUBUF_SUCCESS; /* a failed import is the parent's to count; go on */
    }
    if (rc != 0) fprintf(stderr, "cubuf_soak child: stopped: %s\n", cubuf_last_error());
    free(host);
    cubuf_context_destroy(ctx);
    return rc;
}

/* Starts the child with its end of a socketpair; s->sock is ours. */
static bool start_child(soak_t *s, const char *argv0)
{
    int sv[2];
    char fd[16];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
        perror("cubuf_soak: socketpair");
        return false;
    }
    snprintf(fd, sizeof fd, "%d", sv[1]);
    if ((s->child = fork()) < 0) {
        perror("cubuf_soak: fork");
        close(sv[0]);
        close(sv[1]);
        return false;
    }
    if (s->child == 0) {
        fcntl(sv[1], F_SETFD, 0); /* the child's end survives exec; ours does not */
        execl("/proc/self/exe", argv0, "--child", fd, (char *)NULL);
        _exit(127);
    }
    close(sv[1]);
    s->sock = sv[0];
    return true;
}

/* ---- setup and the final checks --------------------------------------------- */

static int open_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    int n = 0;
    if (!d) return -1;
    for (struct dirent *e; (e = readdir(d));)
        if (e->d_name[0] != '.') n++;
    closedir(d);
    return n - 1; /* the directory's own fd */
}

typedef struct snapshot {
    cubuf_resource_stats_t stats[RESOURCES];
    unsigned long long allocs[RESOURCES]; /* what the soak allocated so far */
    size_t live, ctx_bytes;           /* cubuf's accounting */
    uint64_t pool_used, pool_reserved; /* the driver's, of the two device pools */
    int fds;
} snapshot_t;

/* Waits for all work, gives cached pool memory back, reads everything. */
static bool take_snapshot(soak_t *s, snapshot_t *snap)
{
    cubuf_status_t st = cubuf_context_synchronize(s->ctx);
    memset(snap, 0, sizeof *snap);
    for (int i = 0; i < RESOURCES && st == CUBUF_SUCCESS; i++) {
        if (i == RES_POOL || i == RES_CTX) st = cubuf_resource_trim(s->res[i], 0);
        snap->stats[i] = (cubuf_resource_stats_t)CUBUF_RESOURCE_STATS_INIT;
        snap->allocs[i] = atomic_load(&s->allocs[i]);
        if (st == CUBUF_SUCCESS) st = cubuf_resource_stats(s->res[i], &snap->stats[i]);
        snap->live += snap->stats[i].current_bytes;
        snap->pool_used += snap->stats[i].pool_used_current;
        snap->pool_reserved += snap->stats[i].pool_reserved_current;
    }
    if (st == CUBUF_SUCCESS) st = cubuf_context_bytes_allocated(s->ctx, &snap->ctx_bytes);
    snap->fds = open_fds();
    if (st != CUBUF_SUCCESS)
        report(s, "snapshot: %s: %s", cubuf_status_name(st), cubuf_last_error());
    return st == CUBUF_SUCCESS;
}

/* Every allocation counted once, none left, peaks within what the threads can hold. */
static bool stats_consistent(const snapshot_t *a, const snapshot_t *b, long threads)
{
    bool ok = true;
    for (int i = 0; i < RESOURCES; i++) {
        const cubuf_resource_stats_t *x = &a->stats[i], *y = &b->stats[i];
        uint64_t made = y->total_allocations - x->total_allocations;
        unsigned long long want = b->allocs[i] - a->allocs[i];
        /* A VMM grow adds physical allocations of its own: at least one each. */
        bool count_ok = i == RES_VMM ? made >= want : made == want;
        if (y->current_bytes || y->current_count || !count_ok ||
            y->peak_count > (size_t)4 * (size_t)(threads + 1)) {
            say("%s resource: %zu bytes and %zu buffers live, %llu allocations counted, "
                "%llu made, peak %zu buffers",
                   res_names[i], y->current_bytes, y->current_count, (unsigned long long)made,
                   want, y->peak_count);
            ok = false;
        }
    }
    if (b->ctx_bytes != 0) {
        say("the context still counts %zu bytes allocated", b->ctx_bytes);
        ok = false;
    }
    return ok;
}

static bool setup(soak_t *s)
{
    cubuf_status_t st;
    cubuf_device_resource_options_t po = CUBUF_DEVICE_RESOURCE_OPTIONS_INIT;
    cubuf_vmm_options_t vo = CUBUF_VMM_OPTIONS_INIT;
    cubuf_buffer_t *probe = NULL;
    po.private_pool = true;
    po.ipc_enabled = true;
    vo.handle_type = CUBUF_VMM_HANDLE_POSIX_FD;
    if ((st = cubuf_context_create(0, &s->ctx)) != CUBUF_SUCCESS) goto fail;
    /* Without exportable pools or VMM fds that mechanism is off (the closing line says so). */
    st = cubuf_device_resource_create(0, &po, &s->res[RES_POOL]);
    s->mech[MECH_POOL] = st == CUBUF_SUCCESS;
    if (st == CUBUF_ERROR_NOT_SUPPORTED) {
        po.ipc_enabled = false;
        st = cubuf_device_resource_create(0, &po, &s->res[RES_POOL]);
    }
    if (st != CUBUF_SUCCESS) goto fail;
    st = cubuf_vmm_resource_create(0, &vo, &s->res[RES_VMM]);
    s->mech[MECH_VMM] = st == CUBUF_SUCCESS;
    if (st == CUBUF_ERROR_NOT_SUPPORTED) {
        vo.handle_type = CUBUF_VMM_HANDLE_NONE;
        st = cubuf_vmm_resource_create(0, &vo, &s->res[RES_VMM]);
    }
    if (st != CUBUF_SUCCESS) goto fail;
    if ((st = cubuf_vmm_granularity(s->res[RES_VMM], &s->gran)) != CUBUF_SUCCESS) goto fail;
    if ((st = cubuf_sync_device_resource_create(0, &s->res[RES_SYNC])) != CUBUF_SUCCESS) goto fail;
    s->mech[MECH_LEGACY] = true;
    /* The context's device pool, made on first use: held for its statistics. */
    if ((st = cubuf_context_new_buffer(s->ctx, 1, &probe)) != CUBUF_SUCCESS) goto fail;
    s->res[RES_CTX] = cubuf_resource_retain(cubuf_buffer_resource(probe));
    atomic_fetch_add(&s->allocs[RES_CTX], 1);
    cubuf_buffer_release(probe);
    s->host_cap = ALLOC_MAX > 4 * s->gran ? ALLOC_MAX : 4 * s->gran;
    return true;
fail:
    report(s, "setup: %s: %s", cubuf_status_name(st), cubuf_last_error());
    return false;
}

static bool worker_init(worker_t *w, soak_t *s, int index)
{
    *w = (worker_t){s, index, 0x9e3779b97f4a7c15ull * (uint64_t)(index + 1), NULL, NULL, NULL, -1, 0};
    w->host = malloc(s->host_cap);
    w->back = malloc(s->host_cap);
    cubuf_status_t st = cubuf_stream_create(s->ctx, CU_STREAM_NON_BLOCKING, 0, &w->stream);
    if (st != CUBUF_SUCCESS)
        report(s, "thread %d: cubuf_stream_create: %s", index, cubuf_last_error());
    else if (!w->host || !w->back)
        report(s, "thread %d: out of host memory", index);
    return st == CUBUF_SUCCESS && w->host && w->back;
}

static void worker_fini(worker_t *w)
{
    if (w->stream && cubuf_stream_destroy(w->stream) != CUBUF_SUCCESS)
        report(w->s, "thread %d: cubuf_stream_destroy: %s", w->index, cubuf_last_error());
    free(w->host);
    free(w->back);
}

static bool parse_count(const char *text, long lo, long hi, long *out)
{
    char *end = NULL;
    errno = 0;
    long v = text ? strtol(text, &end, 10) : 0;
    if (!text || errno || *end || v < lo || v > hi) return false;
    *out = v;
    return true;
}

int main(int argc, char **argv)
{
    long seconds = 10, threads = 16, fd = -1;
    if (argc == 3 && strcmp(argv[1], "--child") == 0 && parse_count(argv[2], 0, 1 << 20, &fd))
        return child_main((int)fd);
    for (int i = 1; i < argc; i += 2) {
        bool ok = i + 1 < argc;
        if (ok && strcmp(argv[i], "--seconds") == 0)
            ok = parse_count(argv[i + 1], 1, 7 * 24 * 3600, &seconds);
        else if (ok && strcmp(argv[i], "--threads") == 0)
            ok = parse_count(argv[i + 1], 1, MAX_THREADS, &threads);
        else
            ok = false;
        if (!ok) {
            fprintf(stderr, "usage: cubuf_soak [--seconds S (default 10)] [--threads N (1..%d, "
                            "default 16)]\n", MAX_THREADS);
            return 2;
        }
    }
    int count = 0;
    cubuf_status_t st = cubuf_device_count(&count);
    if (st != CUBUF_SUCCESS || count == 0) {
        printf("SKIP: cubuf_soak needs a CUDA device: %s\n",
               st != CUBUF_SUCCESS ? cubuf_last_error() : "the driver reports none");
        return 77;
    }

    static soak_t s;
    static worker_t w[MAX_THREADS + 1]; /* the last one: the warm-up on this thread */
    worker_t *warm = &w[MAX_THREADS];
    snapshot_t before, after;
    int started = 0, child_status = -1;
    bool measured = false, stats_ok = false;
    s.sock = -1;
    pthread_mutex_init(&s.ipc_lock, NULL);
    if (!setup(&s) || !start_child(&s, argv[0]) || !worker_init(warm, &s, (int)threads)) goto out;
    /* Warm-up: every operation once (ipc once per mechanism), so that what
     * the driver opens or keeps on first use belongs to the baseline. */
    for (int op = 0; op < OP_KINDS; op++)
        for (int m = 0; m < (op == OP_IPC ? MECHS : 1); m++) {
            warm->only_mech = op == OP_IPC ? m : -1;
            if ((op != OP_IPC || s.mech[m]) && ops[op](warm)) atomic_fetch_add(&s.ops[op], 1);
        }
    warm->only_mech = -1;
    if (!take_snapshot(&s, &before)) goto out;
    clock_gettime(CLOCK_MONOTONIC, &s.deadline);
    s.deadline.tv_sec += seconds;
    for (; started < threads; started++) {
        if (!worker_init(&w[started], &s, started)) break;
        if (pthread_create(&w[started].tid, NULL, work, &w[started]) != 0) {
            report(&s, "pthread_create failed");
            break;
        }
    }
    for (int i = 0; i < started; i++) pthread_join(w[i].tid, NULL);
    for (int i = 0; i <= started && i < MAX_THREADS; i++) worker_fini(&w[i]);
    started = -1; /* finished */
    if ((measured = take_snapshot(&s, &after)))
        stats_ok = stats_consistent(&before, &after, threads);
out:
    for (int i = 0; i <= started && i < MAX_THREADS; i++) worker_fini(&w[i]);
    worker_fini(warm);
    if (s.sock >= 0) close(s.sock); /* the child sees the end and exits */
    if (s.child > 0 && waitpid(s.child, &child_status, 0) == s.child &&
        !(WIFEXITED(child_status) && WEXITSTATUS(child_status) == 0))
        report(&s, "the child exited with status 0x%x", (unsigned)child_status);
    bool mem_ok = measured && after.live == before.live && after.pool_used == before.pool_used &&
                  after.pool_reserved == before.pool_reserved && after.ctx_bytes == before.ctx_bytes;
    bool fds_ok = measured && after.fds == before.fds;
    unsigned long long errors = atomic_load(&s.errors);
    bool ok = measured && stats_ok && mem_ok && fds_ok && errors == 0;

    char line[1024];
    size_t n = 0;
#define ADD(...) (n += (size_t)snprintf(line + n, sizeof line - n, __VA_ARGS__), \
                  n = n < sizeof line ? n : sizeof line - 1)
    ADD("cubuf_soak: %ld s, %ld threads:", seconds, threads);
    for (int op = 0; op < OP_KINDS; op++)
        ADD(" %s %llu", op_names[op], (unsigned long long)atomic_load(&s.ops[op]));
    for (int m = 0; m < MECHS; m++)
        if (s.mech[m]) ADD("%s%s %llu", m ? ", " : " (", mech_names[m], (unsigned long long)atomic_load(&s.ipc[m]));
        else ADD("%s%s off", m ? ", " : " (", mech_names[m]);
    ADD("); errors %llu; statistics %s", errors, stats_ok ? "consistent" : "INCONSISTENT");
    if (measured)
        ADD("; device memory: cubuf live %zu -> %zu B, pools used %llu -> %llu B, reserved %llu -> %llu B"
            "; fds %d -> %d",
            before.live, after.live, (unsigned long long)before.pool_used,
            (unsigned long long)after.pool_used, (unsigned long long)before.pool_reserved,
            (unsigned long long)after.pool_reserved, before.fds, after.fds);
    else
        ADD("; device memory and fds not measured");
    ADD(": %s", ok ? "OK" : "FAILED");
#undef ADD
    puts(line);
    for (int i = 0; i < RESOURCES; i++) cubuf_resource_release(s.res[i]);
    cubuf_context_destroy(s.ctx);
    return ok ? 0 : 1;
}
