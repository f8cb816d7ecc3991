/* The scenarios of the multi-process IPC tests, run by tests/test_ipc_*.c
 * for their mechanism against a peer process (tests/helper_ipc.c) started
 * with fork+exec. The test process is "me": it exports to the peer, or
 * imports what the peer exports. Each scenario checks data both ways; the
 * fds in /proc/PID/fd of both processes (number and target) and the driver
 * objects each process holds (t_held: its own calls, never the device's free
 * memory) against baselines; and that every driver object an import
 * acquired was released (a tracker in front of the driver table). A failed
 * check prints what it compared: the fds opened or closed since the
 * baseline, the object counts, the objects still held. */
#ifndef CUBUF_TEST_HELPER_IPC_SUITE_H
#define CUBUF_TEST_HELPER_IPC_SUITE_H

#include <libgen.h>

#include "alloc_fault_test.h"
#include "test.h"
#include "helper_ipc.h"

typedef struct helper {
    pid_t pid;
    int sock;
    bool alive;
} helper_t;

/* Starts tests' helper_ipc with one end of a socketpair. */
static inline helper_t helper_start(void)
{
    helper_t h = {-1, -1, false};
    char path[4096];
    const char *dir = getenv("CUBUF_TEST_HELPER_DIR");
    if (dir && *dir) {
        snprintf(path, sizeof path, "%s/helper_ipc", dir);
    } else {
        char self[4096];
        ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
        self[n > 0 ? n : 0] = '\0';
        snprintf(path, sizeof path, "%s/helper_ipc", dirname(self));
    }
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
        perror("socketpair");
        exit(1);
    }
    pid_t pid = fork();
    if (pid == 0) {
        /* Only async-signal-safe calls between fork and exec: CUDA is live here. */
        char arg[16];
        int fd = sv[1], k = 0;
        char digits[16];
        do digits[k++] = (char)('0' + fd % 10); while ((fd /= 10) && k < 15);
        for (int i = 0; i < k; i++) arg[i] = digits[k - 1 - i];
        arg[k] = '\0';
        fcntl(sv[1], F_SETFD, 0);
        execl(path, path, arg, (char *)NULL);
        _exit(127);
    }
    close(sv[1]);
    if (pid < 0) {
        perror("fork");
        exit(1);
    }
    h.pid = pid;
    h.sock = sv[0];
    peer_reply_t hello;
    if (!peer_read_exact(h.sock, &hello, sizeof hello, 60000) || hello.status != CUBUF_SUCCESS) {
        fprintf(stderr, "helper %s did not start: %s\n", path, hello.detail);
        exit(1);
    }
    h.alive = true;
    return h;
}

/* Sends a command and waits for its reply; a dead or silent helper gives
 * status -1 instead of a hang. */
static inline peer_reply_t helper_call(helper_t *h, peer_cmd_t c)
{
    peer_reply_t r;
    memset(&r, 0, sizeof r);
    r.status = -1;
    if (!h->alive || !peer_write_exact(h->sock, &c, sizeof c) ||
        !peer_read_exact(h->sock, &r, sizeof r, PEER_REPLY_TIMEOUT_MS)) {
        snprintf(r.detail, sizeof r.detail, "no reply from the helper (op %u)", c.op);
        r.status = -1;
    }
    return r;
}

#define H_OK(h, ...)                                                                           \
    __extension__({                                                                            \
        peer_reply_t h_r_ = helper_call((h), (peer_cmd_t){__VA_ARGS__});                       \
        if (h_r_.status != CUBUF_SUCCESS) {                                                    \
            fprintf(stderr, "%s:%d: helper op failed: status %d: %s\n", __FILE__, __LINE__,    \
                    (int)h_r_.status, h_r_.detail);                                            \
            t_failures++;                                                                      \
        }                                                                                      \
        h_r_;                                                                                  \
    })

/* Waits for the helper to end; returns its wait status. */
static inline int helper_reap(helper_t *h)
{
    int status = 0;
    if (h->pid > 0) waitpid(h->pid, &status, 0);
    if (h->sock >= 0) close(h->sock);
    h->pid = -1;
    h->sock = -1;
    h->alive = false;
    return status;
}

/* Closes the socket: the helper cleans up and exits 0. */
static inline void helper_stop(helper_t *h)
{
    if (h->sock >= 0) close(h->sock);
    h->sock = -1;
    int status = helper_reap(h);
    T_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

static inline cubuf_ipc_recv_options_t suite_recv_options(void)
{
    cubuf_ipc_recv_options_t o = CUBUF_IPC_RECV_OPTIONS_INIT;
    o.timeout_ms = 120000;
    o.check_uid = true;
    o.uid = getuid();
    return o;
}

/* The descriptor the helper sends after a successful OP_EXPORT. */
static inline cubuf_ipc_descriptor_t *suite_recv(helper_t *h)
{
    cubuf_ipc_recv_options_t o = suite_recv_options();
    cubuf_ipc_descriptor_t *d = NULL;
    T_OK(cubuf_ipc_recv(h->sock, &o, &d));
    return d;
}

/* ---- fds: what /proc/PID/fd holds, and what changed ---- */

#define FD_SNAP_MAX 512

typedef struct fd_entry {
    int fd;
    char target[72]; /* readlink of /proc/PID/fd/N: "/dev/nvidia-uvm", "socket:[123]" */
} fd_entry_t;

typedef struct fd_snap {
    pid_t pid; /* 0: this process */
    int n;
    bool ok;   /* false: /proc/PID/fd could not be read, or had more than FD_SNAP_MAX */
    fd_entry_t e[FD_SNAP_MAX];
} fd_snap_t;

static inline int fd_entry_cmp(const void *a, const void *b)
{
    return ((const fd_entry_t *)a)->fd - ((const fd_entry_t *)b)->fd;
}

/* The open fds of process `pid` (0: mine) with their targets, leaving out
 * `skip` (an fd the scenario closes on purpose, such as the helper's socket;
 * -1 for none) and, for mine, the directory stream reading them. */
static inline void fds_take(fd_snap_t *s, pid_t pid, int skip)
{
    char path[64];
    if (pid)
        snprintf(path, sizeof path, "/proc/%d/fd", (int)pid);
    else
        snprintf(path, sizeof path, "/proc/self/fd");
    s->pid = pid;
    s->n = 0;
    s->ok = false;
    DIR *d = opendir(path);
    if (!d) return;
    s->ok = true;
    struct dirent *ent;
    while ((ent = readdir(d))) {
        if (ent->d_name[0] < '0' || ent->d_name[0] > '9') continue;
        int fd = atoi(ent->d_name);
        if (fd == skip || (!pid && fd == dirfd(d))) continue;
        if (s->n == FD_SNAP_MAX) {
            s->ok = false;
            break;
        }
        fd_entry_t *e = &s->e[s->n++];
        e->fd = fd;
        ssize_t k = readlinkat(dirfd(d), ent->d_name, e->target, sizeof e->target - 1);
        e->target[k > 0 ? k : 0] = '\0';
        if (k <= 0) snprintf(e->target, sizeof e->target, "(gone)");
    }
    closedir(d);
    qsort(s->e, (size_t)s->n, sizeof s->e[0], fd_entry_cmp);
}

/* Writes the fds opened (+) and closed (-) between `base` and `now` into
 * `out` (" +7 /dev/nvidia-uvm -5 socket:[123]"); returns how many. An fd
 * whose target changed counts as closed and opened. */
static inline int fds_diff(const fd_snap_t *base, const fd_snap_t *now, char *out, size_t cap)
{
    size_t used = 0;
    int i = 0, j = 0, count = 0;
    out[0] = '\0';
    while (i < base->n || j < now->n) {
        const fd_entry_t *a = i < base->n ? &base->e[i] : NULL, *b = j < now->n ? &now->e[j] : NULL;
        const fd_entry_t *gone = NULL, *added = NULL;
        if (a && b && a->fd == b->fd) {
            i++, j++;
            if (strcmp(a->target, b->target) == 0) continue;
            gone = a;
            added = b;
        } else if (b && (!a || b->fd < a->fd)) {
            added = b;
            j++;
        } else {
            gone = a;
            i++;
        }
        for (int k = 0; k < 2; k++) {
            const fd_entry_t *e = k ? added : gone;
            if (!e) continue;
            count++;
            int w = snprintf(out + used, cap - used, " %c%d %s", k ? '+' : '-', e->fd, e->target);
            if (w > 0 && (size_t)w < cap - used) used += (size_t)w;
        }
    }
    return count;
}

/* True if `now` holds exactly the fds of `base` (same numbers, same
 * targets). Otherwise prints "what: fds 23 -> 25: +7 /dev/nvidia-uvm ..."
 * and returns false. */
static inline bool fds_same(const char *what, const fd_snap_t *base, const fd_snap_t *now)
{
    if (!base->ok || !now->ok) {
        fprintf(stderr, "  %s: cannot read /proc/%d/fd (or more than %d fds)\n", what, (int)now->pid,
                FD_SNAP_MAX);
        return false;
    }
    char diff[2048];
    if (!fds_diff(base, now, diff, sizeof diff)) return true;
    fprintf(stderr, "  %s: fds %d -> %d:%s\n", what, base->n, now->n, diff);
    return false;
}

/* Drops from `now` the fds in res[0..nres) that `base` lacks (or had with
 * another target): the fds of pool imports the library keeps (see pw_* in
 * helper_ipc.h). Returns how many were dropped. */
static inline int fds_drop_residue(const fd_snap_t *base, fd_snap_t *now, const int *res, int nres)
{
    int kept = 0, dropped = 0;
    for (int i = 0; i < now->n; i++) {
        bool residue = false;
        for (int k = 0; k < nres && !residue; k++) residue = res[k] == now->e[i].fd;
        for (int j = 0; j < base->n && residue; j++)
            if (base->e[j].fd == now->e[i].fd && strcmp(base->e[j].target, now->e[i].target) == 0)
                residue = false;
        if (residue)
            dropped++;
        else
            now->e[kept++] = now->e[i];
    }
    now->n = kept;
    return dropped;
}

/* The fds of base->pid now, compared with `base` (see fds_same), leaving
 * out the fds held by pool imports kept since (res[0..nres)). */
static inline bool fds_back_except(const char *what, const fd_snap_t *base, int skip, const int *res, int nres)
{
    static fd_snap_t now;
    fds_take(&now, base->pid, skip);
    fds_drop_residue(base, &now, res, nres);
    return fds_same(what, base, &now);
}

/* The fds of base->pid now, compared with `base` (see fds_same). `skip` as
 * for fds_take. For this process, the fds of the pinned pool imports the
 * library keeps are left out (exactly those: fds the driver opened in calls
 * on a pool import that is still alive); every other fd must balance. */
static inline bool fds_back(const char *what, const fd_snap_t *base, int skip)
{
    int res[PW_MAX], nres = base->pid ? 0 : pw_residue_fds(res, PW_MAX);
    return fds_back_except(what, base, skip, res, nres);
}

/* Whether a process holds the driver objects (t_held) of `base` plus
 * `kept` pool imports it keeps; prints both where not. */
static inline bool held_back(const char *what, t_held_t base, int kept, t_held_t now)
{
    base.pools += kept;
    return t_held_same(__FILE__, __LINE__, what, &base, &now);
}

/* ---- driver objects acquired and released (a tracker over the table) ---- */

/* The test process puts wrappers into the driver table in front of the
 * calls that acquire and release what an import holds. A wrapper records
 * only what the driver really gave or took back: a call the fault seam
 * failed never reaches it, and a call the driver refused acquired nothing.
 * Between track_begin and track_end, every object acquired must be
 * released again. */
typedef enum track_kind {
    TK_POOL,        /* cuMemPoolImportFromShareableHandle / cuMemPoolDestroy */
    TK_POOL_PTR,    /* cuMemPoolImportPointer / cuMemFreeAsync, cuMemFree */
    TK_HANDLE,      /* cuMemImportFromShareableHandle / cuMemRelease */
    TK_RESERVATION, /* cuMemAddressReserve / cuMemAddressFree */
    TK_MAPPING,     /* cuMemMap / cuMemUnmap */
    TK_LEGACY,      /* cuIpcOpenMemHandle / cuIpcCloseMemHandle */
} track_kind_t;

static const char *const track_names[] = {
    "imported pool (cuMemPoolImportFromShareableHandle)", "imported pool pointer (cuMemPoolImportPointer)",
    "imported allocation handle (cuMemImportFromShareableHandle)", "address reservation (cuMemAddressReserve)",
    "mapping (cuMemMap)", "opened legacy handle (cuIpcOpenMemHandle)"};

typedef struct track_rec {
    track_kind_t kind;
    uint64_t key, size;
} track_rec_t;

#define TRACK_MAX 4096

static struct {
    bool installed, on;
    cubuf_driver_t real;
    int n, acquired, released;
    track_rec_t live[TRACK_MAX];
} g_track;

static inline void track_add(track_kind_t kind, uint64_t key, uint64_t size)
{
    if (!g_track.on) return;
    g_track.acquired++;
    if (g_track.n < TRACK_MAX) g_track.live[g_track.n++] = (track_rec_t){kind, key, size};
}

/* Forgets the objects of `kind` whose key lies in [lo, hi]. */
static inline void track_remove(track_kind_t kind, uint64_t lo, uint64_t hi)
{
    if (!g_track.on) return;
    for (int i = 0; i < g_track.n;) {
        track_rec_t *r = &g_track.live[i];
        if (r->kind == kind && r->key >= lo && r->key <= hi) {
            *r = g_track.live[--g_track.n];
            g_track.released++;
        } else {
            i++;
        }
    }
}

static CUresult CUDAAPI track_cuMemPoolImportFromShareableHandle(CUmemoryPool *out, void *handle,
                                                                 CUmemAllocationHandleType type,
                                                                 unsigned long long flags)
{
    CUresult r = g_track.real.cuMemPoolImportFromShareableHandle(out, handle, type, flags);
    if (r == CUDA_SUCCESS) track_add(TK_POOL, (uint64_t)(uintptr_t)*out, 0);
    return r;
}
static CUresult CUDAAPI track_cuMemPoolDestroy(CUmemoryPool pool)
{
    CUresult r = g_track.real.cuMemPoolDestroy(pool);
    if (r == CUDA_SUCCESS) track_remove(TK_POOL, (uint64_t)(uintptr_t)pool, (uint64_t)(uintptr_t)pool);
    return r;
}
static CUresult CUDAAPI track_cuMemPoolImportPointer(CUdeviceptr *out, CUmemoryPool pool,
                                                     CUmemPoolPtrExportData *data)
{
    CUresult r = g_track.real.cuMemPoolImportPointer(out, pool, data);
    if (r == CUDA_SUCCESS) track_add(TK_POOL_PTR, *out, 0);
    return r;
}
static CUresult CUDAAPI track_cuMemFreeAsync(CUdeviceptr p, CUstream s)
{
    CUresult r = g_track.real.cuMemFreeAsync(p, s);
    if (r == CUDA_SUCCESS) track_remove(TK_POOL_PTR, p, p);
    return r;
}
static CUresult CUDAAPI track_cuMemFree(CUdeviceptr p)
{
    CUresult r = g_track.real.cuMemFree(p);
    if (r == CUDA_SUCCESS) track_remove(TK_POOL_PTR, p, p);
    return r;
}
static CUresult CUDAAPI track_cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *h, void *os,
                                                             CUmemAllocationHandleType type)
{
    CUresult r = g_track.real.cuMemImportFromShareableHandle(h, os, type);
    if (r == CUDA_SUCCESS) track_add(TK_HANDLE, *h, 0);
    return r;
}
static CUresult CUDAAPI track_cuMemRelease(CUmemGenericAllocationHandle h)
{
    CUresult r = g_track.real.cuMemRelease(h);
    if (r == CUDA_SUCCESS) track_remove(TK_HANDLE, h, h);
    return r;
}
static CUresult CUDAAPI track_cuMemAddressReserve(CUdeviceptr *p, size_t size, size_t align, CUdeviceptr addr,
                                                  unsigned long long flags)
{
    CUresult r = g_track.real.cuMemAddressReserve(p, size, align, addr, flags);
    if (r == CUDA_SUCCESS) track_add(TK_RESERVATION, *p, size);
    return r;
}
static CUresult CUDAAPI track_cuMemAddressFree(CUdeviceptr p, size_t size)
{
    CUresult r = g_track.real.cuMemAddressFree(p, size);
    if (r == CUDA_SUCCESS) track_remove(TK_RESERVATION, p, p);
    return r;
}
static CUresult CUDAAPI track_cuMemMap(CUdeviceptr p, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                                       unsigned long long flags)
{
    CUresult r = g_track.real.cuMemMap(p, size, offset, h, flags);
    if (r == CUDA_SUCCESS) track_add(TK_MAPPING, p, size);
    return r;
}
static CUresult CUDAAPI track_cuMemUnmap(CUdeviceptr p, size_t size)
{
    CUresult r = g_track.real.cuMemUnmap(p, size);
    if (r == CUDA_SUCCESS && size) track_remove(TK_MAPPING, p, p + size - 1);
    return r;
}
static CUresult CUDAAPI track_cuIpcOpenMemHandle(CUdeviceptr *p, CUipcMemHandle h, unsigned int flags)
{
    CUresult r = g_track.real.cuIpcOpenMemHandle(p, h, flags);
    if (r == CUDA_SUCCESS) track_add(TK_LEGACY, *p, 0);
    return r;
}
static CUresult CUDAAPI track_cuIpcCloseMemHandle(CUdeviceptr p)
{
    CUresult r = g_track.real.cuIpcCloseMemHandle(p);
    if (r == CUDA_SUCCESS) track_remove(TK_LEGACY, p, p);
    return r;
}

/* Puts the wrappers into the table (once; the driver is loaded). */
static inline void track_install(void)
{
    if (g_track.installed) return;
    g_track.installed = true;
    g_track.real = cubuf__drv;
    cubuf__drv.cuMemPoolImportFromShareableHandle = track_cuMemPoolImportFromShareableHandle;
    cubuf__drv.cuMemPoolDestroy = track_cuMemPoolDestroy;
    cubuf__drv.cuMemPoolImportPointer = track_cuMemPoolImportPointer;
    cubuf__drv.cuMemFreeAsync = track_cuMemFreeAsync;
    cubuf__drv.cuMemFree = track_cuMemFree;
    cubuf__drv.cuMemImportFromShareableHandle = track_cuMemImportFromShareableHandle;
    cubuf__drv.cuMemRelease = track_cuMemRelease;
    cubuf__drv.cuMemAddressReserve = track_cuMemAddressReserve;
    cubuf__drv.cuMemAddressFree = track_cuMemAddressFree;
    cubuf__drv.cuMemMap = track_cuMemMap;
    cubuf__drv.cuMemUnmap = track_cuMemUnmap;
    cubuf__drv.cuIpcOpenMemHandle = track_cuIpcOpenMemHandle;
    cubuf__drv.cuIpcCloseMemHandle = track_cuIpcCloseMemHandle;
}

static inline void track_begin(void)
{
    g_track.on = true;
    g_track.n = g_track.acquired = g_track.released = 0;
}

/* The pinned pool imports this process is expected to hold for good: the
 * scenarios add one per distinct exporter pool whose import they made. */
static unsigned g_kept_expected;

/* Stops tracking. Exactly `kept` pool imports acquired since track_begin
 * may still be held, each one a pool that a device was granted access to
 * (a pinned pool import the library keeps); nothing else may. Returns 0 if
 * so; otherwise the number of objects held, listing them as "what: 3
 * acquired, 2 released, 1 held: ...". */
static inline int track_end_kept(const char *what, int kept)
{
    g_track.on = false;
    int pools = 0, granted = 0;
    for (int i = 0; i < g_track.n; i++) {
        if (g_track.live[i].kind != TK_POOL) continue;
        pools++;
        const pw_pool_t *rec = pw_find((CUmemoryPool)(uintptr_t)g_track.live[i].key);
        granted += rec && rec->granted;
    }
    if (pools == kept && granted == kept && g_track.n == kept) {
        g_kept_expected += (unsigned)kept;
        return 0;
    }
    fprintf(stderr, "  %s: driver objects %d acquired, %d released, %d still held (%d kept pool import(s) "
            "expected, %d held, %d of them granted):\n", what, g_track.acquired, g_track.released, g_track.n,
            kept, pools, granted);
    for (int i = 0; i < g_track.n; i++)
        fprintf(stderr, "    %s 0x%llx%s%llu\n", track_names[g_track.live[i].kind],
                (unsigned long long)g_track.live[i].key, g_track.live[i].size ? ", bytes " : "",
                g_track.live[i].size ? (unsigned long long)g_track.live[i].size : 0ull);
    return g_track.n ? g_track.n : 1;
}

/* Stops tracking; nothing acquired since track_begin may be held. */
static inline int track_end(const char *what)
{
    return track_end_kept(what, 0);
}

/* The number of pinned pool imports a scenario of mechanism m leaves kept
 * per distinct exporter pool it imports: one for pinned pools, none for the
 * rest (a device pool import is destroyed at its last close). */
static inline int suite_kept(peer_mech_t m)
{
    return m == PEER_POOL_PINNED ? 1 : 0;
}

/* The helper's live pool imports (-1 if it did not answer), how many of
 * them were granted access, and in fds[0..*nfds) the fds they hold
 * (OP_POOLS). */
static inline int helper_pools(helper_t *h, int *granted, int *fds, int cap, int *nfds)
{
    peer_reply_t r = helper_call(h, (peer_cmd_t){.op = OP_POOLS});
    *nfds = 0;
    *granted = 0;
    if (r.status != CUBUF_SUCCESS) return -1;
    for (char *p = r.detail, *end; *nfds < cap; p = end) {
        long v = strtol(p, &end, 10);
        if (end == p) break;
        fds[(*nfds)++] = (int)v;
    }
    *granted = (int)(r.value >> 32);
    return (int)(r.value & 0xffffffffu);
}

/* The driver objects the helper holds now (OP_HELD; zeros, with the
 * failure counted, if it did not answer). */
static inline t_held_t helper_held(helper_t *h)
{
    return H_OK(h, .op = OP_HELD).held;
}

/* ---- scenarios ---- */

/* The peer exports (slice [off, off+len) of a `size`-byte buffer, or all of
 * it with len 0); I import, read its data, write mine, and the peer reads
 * mine through its own buffer. Then the same the other way round. Importers
 * close first; fds and driver objects are back to their baselines on both
 * sides, but for the pinned pool imports kept. */
static inline void suite_transfer(peer_t *me, helper_t *h, peer_mech_t m, size_t size, size_t off,
                                  size_t len, uint32_t export_flags, bool check_baselines)
{
    static fd_snap_t my_fds, its_fds;
    fds_take(&my_fds, 0, -1);
    fds_take(&its_fds, h->pid, -1);
    t_held_t my_held = t_held(), its_held = helper_held(h);
    int my_pools = g_pw.n, its_granted = 0, its_res[64], its_nres = 0;
    int its_pools = helper_pools(h, &its_granted, its_res, 64, &its_nres);
    size_t pos = len ? off : 0;
    uint64_t seed = size + off * 7 + len * 13 + m;
    char what[160];
    snprintf(what, sizeof what, "%s: transfer of %zu bytes (slice %zu + %zu)", peer_mech_name(m), size, off, len);

    /* peer -> me */
    peer_reply_t r = H_OK(h, .op = OP_EXPORT, .mech = m, .size = size, .offset = off, .length = len,
                          .seed = seed, .slot = 1, .flags = export_flags);
    if (r.status != CUBUF_SUCCESS) return;
    if (export_flags & PEER_GROWN) {
        T_CHECK((r.value & 0xffffffffu) >= 3);     /* several physical allocations */
        T_CHECK(r.value >> 32);                    /* the last grow moved */
    }
    cubuf_ipc_descriptor_t *d = suite_recv(h);
    if (!d) return;
    cubuf_ipc_descriptor_info_t info = CUBUF_IPC_DESCRIPTOR_INFO_INIT;
    T_OK(cubuf_ipc_descriptor_info(d, &info));
    T_CHECK(len ? info.size == len : info.size >= size); /* VMM rounds up to its granularity */
    cubuf_buffer_t *imp = NULL;
    T_OK(cubuf_buffer_from_ipc_descriptor(NULL, NULL, d, CU_STREAM_LEGACY, &imp));
    cubuf_ipc_descriptor_destroy(d); /* the import does not need the fds any more */
    if (!imp) return;
    T_CHECK(cubuf_buffer_is_mapped(imp) && cubuf_buffer_is_device_accessible(imp));
    T_CHECK(cubuf_buffer_device_id(imp) == (m == PEER_POOL_PINNED ? -1 : 0));
    if (len) T_CHECK(cubuf_buffer_size(imp) == len);
    if (m == PEER_POOL_PINNED) T_CHECK(cubuf_buffer_is_host_accessible(imp));
    size_t bad = 0;
    T_OK(peer_verify(imp, seed, pos, &bad));
    if (bad != SIZE_MAX) fprintf(stderr, "  %s: import differs at byte %zu\n", peer_mech_name(m), bad);
    T_CHECK(bad == SIZE_MAX);
    /* imported memory is not exported again, nor is a slice of it */
    cubuf_ipc_descriptor_t *again = NULL;
    T_STATUS(cubuf_buffer_ipc_descriptor(imp, &again), CUBUF_ERROR_NOT_SUPPORTED);
    cubuf_buffer_t *piece = NULL;
    T_OK(cubuf_buffer_slice(imp, 0, cubuf_buffer_size(imp) / 2, &piece));
    T_STATUS(cubuf_buffer_ipc_descriptor(piece, &again), CUBUF_ERROR_NOT_SUPPORTED);
    T_CHECK(cubuf_buffer_is_mapped(piece));
    cubuf_buffer_release(piece);
    /* and the reverse direction through the same mapping */
    T_OK(peer_write(imp, seed + 1, pos));
    r = H_OK(h, .op = OP_VERIFY, .slot = 1, .seed = seed + 1, .offset = pos);
    T_CHECK(r.value == 0);
    T_OK(cubuf_buffer_close(imp));
    T_OK(cubuf_buffer_close(imp)); /* a second close is a no-op */
    cubuf_buffer_release(imp);
    cubuf__drv.cuCtxSynchronize();
    H_OK(h, .op = OP_CLEAR, .slot = 1);

    /* me -> peer */
    peer_cmd_t c = {.op = OP_EXPORT, .mech = m, .size = size, .offset = off, .length = len,
                    .seed = seed + 2, .slot = 2, .flags = export_flags & PEER_GROWN};
    uint64_t value = 0;
    cubuf_status_t st = peer_export(me, &c, &d, &value);
    if (st != CUBUF_SUCCESS) fprintf(stderr, "  %s: my export failed: %s\n", what, me->detail);
    T_OK(st);
    if (st == CUBUF_SUCCESS) {
        T_CHECK(!cubuf_buffer_is_mapped(me->slot[2].buf));
        peer_cmd_t ic = {.op = OP_IMPORT, .slot = 3, .offset = pos};
        T_CHECK(peer_write_exact(h->sock, &ic, sizeof ic));
        T_OK(cubuf_ipc_send(h->sock, d));
        peer_reply_t ir;
        T_CHECK(peer_read_exact(h->sock, &ir, sizeof ir, PEER_REPLY_TIMEOUT_MS));
        if (ir.status != CUBUF_SUCCESS) fprintf(stderr, "  helper import: %s\n", ir.detail);
        T_CHECK(ir.status == CUBUF_SUCCESS && ir.value == 1);
        cubuf_ipc_descriptor_destroy(d);
        r = H_OK(h, .op = OP_VERIFY, .slot = 3, .seed = seed + 2, .offset = pos);
        T_CHECK(r.value == 0);
        H_OK(h, .op = OP_WRITE, .slot = 3, .seed = seed + 3, .offset = pos);
        T_OK(peer_verify(me->slot[2].buf, seed + 3, pos, &bad));
        T_CHECK(bad == SIZE_MAX);
        H_OK(h, .op = OP_CLOSE, .slot = 3); /* the importer first */
        H_OK(h, .op = OP_CLEAR, .slot = 3);
    }
    peer_slot_clear(&me->slot[2]);
    /* Each side imported one pool: a pinned one stays imported (granted
     * access), a device one is gone; no other pool import is left. */
    int k = suite_kept(m), its_k = st == CUBUF_SUCCESS ? k : 0;
    int my_now = g_pw.n, its_now = helper_pools(h, &its_granted, its_res, 64, &its_nres);
    if (my_now != my_pools + k || pw_ungranted() != 0 || its_now != its_pools + its_k || its_granted != its_now) {
        fprintf(stderr, "  %s: pool imports: mine %d -> %d (%d never granted), the helper's %d -> %d (%d granted); "
                "expected +%d and +%d, all granted\n", what, my_pools, my_now, pw_ungranted(), its_pools, its_now,
                its_granted, k, its_k);
        t_failures++;
    }
    g_kept_expected += (unsigned)k;
    if (!check_baselines) return; /* a warm-up: the driver may open files once per process */
    char who[200];
    snprintf(who, sizeof who, "%s, mine", what);
    T_CHECK(fds_back(who, &my_fds, -1));
    snprintf(who, sizeof who, "%s, the helper's", what);
    T_CHECK(fds_back_except(who, &its_fds, -1, its_res, its_nres));
    /* Each process's own calls, mine and the helper's: what each made is
     * given back but the pinned pool import it keeps. */
    snprintf(who, sizeof who, "%s, mine", what);
    T_CHECK(held_back(who, my_held, k, t_held()));
    snprintf(who, sizeof who, "%s, the helper's", what);
    T_CHECK(held_back(who, its_held, its_k, helper_held(h)));
}

/* One descriptor imported twice, and a copy of it (the wire format with
 * duplicated fds, as a second receive would give) imported a third time:
 * three buffers over one memory. For pools the pool
 * and the pointer are imported once (the registry). Each close is
 * independent; double closes are harmless; everything is released at the end. */
static inline void suite_duplicate(peer_t *me, helper_t *h, peer_mech_t m)
{
    static fd_snap_t my_fds;
    fds_take(&my_fds, 0, -1);
    char what[80];
    snprintf(what, sizeof what, "%s: duplicate imports", peer_mech_name(m));
    uint64_t seed = 0xd0d0 + m;
    size_t size = 4 * PEER_MIB;
    if (H_OK(h, .op = OP_EXPORT, .mech = m, .size = size, .seed = seed, .slot = 1).status) return;
    cubuf_ipc_descriptor_t *d1 = suite_recv(h);
    cubuf_fault_count_calls(true);
    track_begin();
    cubuf_buffer_t *b[3] = {NULL, NULL, NULL};
    if (d1) {
        T_OK(cubuf_buffer_from_ipc_descriptor(NULL, NULL, d1, CU_STREAM_LEGACY, &b[0]));
        T_OK(cubuf_context_open_ipc_buffer(me->ctx, d1, &b[1]));
        cubuf_ipc_descriptor_t *d2 = NULL;
        /* a copy of d1 through the wire format with duplicated fds */
        size_t len = 0, n = 0;
        T_OK(cubuf_ipc_descriptor_serialize(d1, NULL, &len, NULL, &n));
        uint8_t *bytes = malloc(len);
        int fds[CUBUF_IPC_MAX_FDS];
        T_OK(cubuf_ipc_descriptor_serialize(d1, bytes, &len, fds, &n));
        for (size_t i = 0; i < n; i++) fds[i] = fcntl(fds[i], F_DUPFD_CLOEXEC, 0);
        T_OK(cubuf_ipc_descriptor_deserialize(bytes, len, fds, n, &d2));
        free(bytes);
        cubuf_ipc_descriptor_destroy(d1);
        if (d2) T_OK(cubuf_buffer_from_ipc_descriptor(NULL, NULL, d2, CU_STREAM_LEGACY, &b[2]));
        cubuf_ipc_descriptor_destroy(d2);
    }
    if (m == PEER_POOL_DEVICE || m == PEER_POOL_PINNED) {
        /* the registry: one pool import and one pointer import for three buffers */
        unsigned long pools = cubuf_fault_calls("cuMemPoolImportFromShareableHandle"),
                      ptrs = cubuf_fault_calls("cuMemPoolImportPointer");
        if (pools != 1 || ptrs != 1)
            fprintf(stderr, "  %s: %lu pool imports, %lu pointer imports; expected 1 and 1\n", what, pools, ptrs);
        T_CHECK(pools == 1 && ptrs == 1);
    }
    size_t bad = 0;
    for (int i = 0; i < 3; i++) {
        if (!b[i]) continue;
        T_OK(peer_verify(b[i], seed, 0, &bad));
        T_CHECK(bad == SIZE_MAX);
    }
    if (b[0] && b[1] && b[2]) {
        T_CHECK(cubuf_buffer_ptr(b[2]) == cubuf_buffer_ptr(b[0]) || m == PEER_VMM);
        T_OK(cubuf_buffer_close(b[0]));
        T_OK(cubuf_buffer_close(b[0]));
        T_OK(peer_verify(b[1], seed, 0, &bad)); /* the others still map it */
        T_CHECK(bad == SIZE_MAX);
        T_OK(peer_write(b[2], seed + 5, 0));
        T_OK(peer_verify(b[1], seed + 5, 0, &bad));
        T_CHECK(bad == SIZE_MAX);
    }
    for (int i = 0; i < 3; i++) {
        cubuf_buffer_close(b[i]);
        cubuf_buffer_release(b[i]);
    }
    cubuf__drv.cuCtxSynchronize();
    T_CHECK(track_end_kept(what, suite_kept(m)) == 0); /* one pool: a pinned import stays */
    cubuf_fault_count_calls(false);
    peer_reply_t r = H_OK(h, .op = OP_VERIFY, .slot = 1, .seed = seed + 5, .offset = 0);
    T_CHECK(r.value == 0);
    H_OK(h, .op = OP_CLEAR, .slot = 1);
    T_CHECK(fds_back(what, &my_fds, -1));
}

/* The exporter exits (without closing) while I hold its memory. For VMM the
 * mapping stays valid with its data; for pools and legacy handles the
 * contents are undefined, but closing returns and leaks nothing. */
static inline void suite_exporter_exits(peer_t *me, helper_t *h, peer_mech_t m)
{
    /* the socket to the helper goes with it */
    static fd_snap_t my_fds;
    fds_take(&my_fds, 0, h->sock);
    char what[80];
    snprintf(what, sizeof what, "%s: the exporter exits first", peer_mech_name(m));
    track_begin();
    uint64_t seed = 0xe0e0 + m;
    if (H_OK(h, .op = OP_EXPORT, .mech = m, .size = 8 * PEER_MIB, .seed = seed, .slot = 1).status) return;
    cubuf_ipc_descriptor_t *d = suite_recv(h);
    cubuf_buffer_t *imp = NULL;
    if (d) T_OK(cubuf_buffer_from_ipc_descriptor(NULL, NULL, d, CU_STREAM_LEGACY, &imp));
    cubuf_ipc_descriptor_destroy(d);
    size_t bad = 0;
    if (imp) {
        T_OK(peer_verify(imp, seed, 0, &bad));
        T_CHECK(bad == SIZE_MAX);
    }
    H_OK(h, .op = OP_EXIT, .seed = 0);
    int status = helper_reap(h);
    T_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    if (imp && m == PEER_VMM) {
        T_OK(peer_verify(imp, seed, 0, &bad));
        T_CHECK(bad == SIZE_MAX);
        T_OK(peer_write(imp, seed + 1, 0));
        T_OK(peer_verify(imp, seed + 1, 0, &bad));
        T_CHECK(bad == SIZE_MAX);
    }
    if (imp) {
        cubuf_status_t st = cubuf_buffer_close(imp);
        if (m == PEER_VMM) T_OK(st);
        else T_CHECK(st == CUBUF_SUCCESS || st == CUBUF_ERROR_DRIVER);
        if (st != CUBUF_SUCCESS) printf("  %s: close after the exporter exited: %s\n", peer_mech_name(m), cubuf_last_error());
        cubuf__drv.cuCtxSynchronize();
        cubuf_buffer_release(imp);
    }
    T_CHECK(track_end_kept(what, suite_kept(m)) == 0); /* a pinned import stays, its exporter gone */
    T_CHECK(fds_back(what, &my_fds, -1));
    *h = helper_start();
}

/* I export; the peer imports, writes, and exits (or is killed) holding the
 * mapping. My buffer keeps the peer's data; closing it frees the memory. */
static inline void suite_importer_exits(peer_t *me, helper_t *h, peer_mech_t m, bool kill_it)
{
    /* the socket to the helper goes with it */
    static fd_snap_t my_fds;
    fds_take(&my_fds, 0, h->sock);
    t_held_t my_held = t_held();
    char what[80];
    snprintf(what, sizeof what, "%s: the importer %s first", peer_mech_name(m), kill_it ? "is killed" : "exits");
    uint64_t seed = 0xf0f0 + m + kill_it;
    peer_cmd_t c = {.op = OP_EXPORT, .mech = m, .size = 16 * PEER_MIB, .seed = seed, .slot = 4};
    cubuf_ipc_descriptor_t *d = NULL;
    uint64_t value = 0;
    cubuf_status_t st = peer_export(me, &c, &d, &value);
    if (st != CUBUF_SUCCESS) fprintf(stderr, "  %s: my export failed: %s\n", what, me->detail);
    T_OK(st);
    if (!d) {
        peer_slot_clear(&me->slot[4]);
        return;
    }
    peer_cmd_t ic = {.op = OP_IMPORT, .slot = 1, .flags = m == PEER_LEGACY ? PEER_OPEN_IN_CTX : 0};
    T_CHECK(peer_write_exact(h->sock, &ic, sizeof ic));
    T_OK(cubuf_ipc_send(h->sock, d));
    cubuf_ipc_descriptor_destroy(d);
    peer_reply_t ir;
    T_CHECK(peer_read_exact(h->sock, &ir, sizeof ir, PEER_REPLY_TIMEOUT_MS) && ir.status == 0);
    H_OK(h, .op = OP_WRITE, .slot = 1, .seed = seed + 1);
    if (kill_it) {
        kill(h->pid, SIGKILL);
        int status = helper_reap(h);
        T_CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
    } else {
        H_OK(h, .op = OP_EXIT, .seed = 0);
        helper_reap(h);
    }
    size_t bad = 0;
    T_OK(peer_verify(me->slot[4].buf, seed + 1, 0, &bad));
    T_CHECK(bad == SIZE_MAX);
    T_OK(cubuf_buffer_close(me->slot[4].buf));
    peer_slot_clear(&me->slot[4]);
    T_CHECK(fds_back(what, &my_fds, -1));
    T_CHECK(held_back(what, my_held, 0, t_held()));
    *h = helper_start();
}

/* The exporter is killed halfway through sending its descriptor: my receive
 * fails at once (no hang), and the fd that arrived is closed. */
static inline void suite_exporter_killed(peer_t *me, helper_t *h, peer_mech_t m)
{
    /* the socket to the helper goes with it */
    static fd_snap_t my_fds;
    fds_take(&my_fds, 0, h->sock);
    char what[80];
    snprintf(what, sizeof what, "%s: the exporter is killed mid-send", peer_mech_name(m));
    peer_reply_t r = H_OK(h, .op = OP_EXPORT, .mech = m, .size = 2 * PEER_MIB, .seed = 1, .slot = 1,
                          .flags = PEER_DIE_MID_SEND);
    if (r.status == CUBUF_SUCCESS) {
        cubuf_ipc_recv_options_t o = CUBUF_IPC_RECV_OPTIONS_INIT; /* no timeout: EOF ends it */
        cubuf_ipc_descriptor_t *d = NULL;
        cubuf_status_t st = cubuf_ipc_recv(h->sock, &o, &d);
        T_CHECK(st == CUBUF_ERROR_INVALID_DESCRIPTOR || st == CUBUF_ERROR_SYSTEM);
        T_CHECK(d == NULL);
    }
    int status = helper_reap(h);
    T_CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
    T_CHECK(fds_back(what, &my_fds, -1));
    *h = helper_start();
}

/* The peer exports again, from a new pool, into slot 1: *d becomes its
 * descriptor (NULL if that failed). */
static inline void suite_new_export(helper_t *h, peer_mech_t m, uint32_t export_flags, uint64_t seed,
                                    cubuf_ipc_descriptor_t **d)
{
    cubuf_ipc_descriptor_destroy(*d);
    *d = NULL;
    H_OK(h, .op = OP_CLEAR, .slot = 1);
    if (H_OK(h, .op = OP_EXPORT, .mech = m, .size = 8 * PEER_MIB, .offset = 4096,
             .length = 6 * PEER_MIB, .seed = seed, .slot = 1, .flags = export_flags)
            .status == CUBUF_SUCCESS)
        *d = suite_recv(h);
}

/* One pass of suite_faults over *d (the peer's slot 1, pattern `seed` from
 * byte 4096): fails driver call n = 1, 2, ... (with `alloc`, host allocation
 * n, each failure then CUBUF_ERROR_OUT_OF_MEMORY) of an import until the
 * import succeeds. Every failure leaves nothing imported or mapped but what the
 * library keeps on purpose: a pool import that a device was granted access
 * to before the failure (pinned pools; never a device pool). The acquiring
 * and releasing calls balance otherwise, fds and driver objects are back, the
 * descriptor stays usable; the final import reads the right data. With
 * `fresh`, each attempt imports a pool this process holds no import of:
 * after an attempt that left one kept, the peer exports again from a new
 * pool, so that call n is the same step every time. */
static inline void suite_fault_pass(helper_t *h, peer_mech_t m, uint32_t export_flags, uint64_t seed,
                                    cubuf_ipc_descriptor_t **d, bool fresh, const char *label,
                                    bool alloc)
{
    static fd_snap_t fds0;
    fds_take(&fds0, 0, -1);
    t_held_t held0 = t_held();
    unsigned n = 1, failures = 0, survived = 0;
    int kept_total = 0;
    for (; n < 200 && *d; n++) {
        unsigned grants0 = g_pw.grants;
        int pools0 = g_pw.n;
        track_begin();
        if (alloc) t_fail_alloc_nth(n);
        else cubuf_fault_fail_any_nth(n, CUDA_ERROR_OUT_OF_MEMORY);
        cubuf_buffer_t *b = NULL;
        cubuf_status_t st = cubuf_buffer_from_ipc_descriptor(NULL, NULL, *d, CU_STREAM_LEGACY, &b);
        bool fired = cubuf_fault_fired();
        if (fired && alloc && st != CUBUF_SUCCESS) T_STATUS(st, CUBUF_ERROR_OUT_OF_MEMORY);
        char what[200];
        if (fired)
            snprintf(what, sizeof what, "%s: import %s with %s %u (%s) failing", peer_mech_name(m), label,
                     alloc ? "host allocation" : "driver call", n, cubuf_fault_fired_name());
        else
            snprintf(what, sizeof what, "%s: import %s with no call failing (call %u was past the end)",
                     peer_mech_name(m), label, n);
        cubuf_fault_reset();
        if (!fired) {
            T_OK(st);
            size_t bad = 0;
            if (b) {
                T_OK(peer_verify(b, seed, 4096, &bad));
                T_CHECK(bad == SIZE_MAX);
                T_OK(cubuf_buffer_close(b));
                cubuf_buffer_release(b);
            }
        } else {
            failures++;
            if (st == CUBUF_SUCCESS) {
                /* a failure that does not matter (a best-effort query) */
                survived++;
                cubuf_buffer_close(b);
                cubuf_buffer_release(b);
            } else {
                T_CHECK(b == NULL);
            }
        }
        cubuf__drv.cuCtxSynchronize();
        /* kept: the pool imports this attempt granted access to (0 or 1) */
        int kept = (int)(g_pw.grants - grants0);
        if (kept > (fresh ? suite_kept(m) : 0) || (fresh && st == CUBUF_SUCCESS && kept != suite_kept(m))) {
            fprintf(stderr, "  %s: %d pool import(s) granted access, expected %s%d\n", what, kept,
                    st == CUBUF_SUCCESS ? "" : "at most ", fresh ? suite_kept(m) : 0);
            t_failures++;
        }
        T_CHECK(track_end_kept(what, kept) == 0);
        T_CHECK(g_pw.n == pools0 + kept && pw_ungranted() == 0);
        T_CHECK(fds_back(what, &fds0, -1));
        kept_total += kept;
        T_CHECK(held_back(what, held0, kept_total, t_held()));
        if (!fired) break;
        if (fresh && kept) {
            /* that pool is imported for good now: a new one from the peer */
            suite_new_export(h, m, export_flags, seed, d);
            fds_take(&fds0, 0, -1); /* the new descriptor's fd */
        }
    }
    printf("  %s: import %s failed at each of its %u %s in turn (%u of them best-effort, "
           "the import went on); %d pool import(s) kept\n",
           peer_mech_name(m), label, failures, alloc ? "host allocations" : "driver calls", survived,
           kept_total);
    T_CHECK(*d && n < 200 && failures > 0);
}

/* Fails each driver call of an import in turn (see suite_fault_pass): of a
 * pool not imported yet, then, for pinned pools, of a pool whose import this
 * process kept from a previous import (no new pool import, no new grant);
 * then each host allocation of an import of a pool not imported yet. */
static inline void suite_faults(peer_t *me, helper_t *h, peer_mech_t m, uint32_t export_flags)
{
    uint64_t seed = 0xfa0 + m;
    if (H_OK(h, .op = OP_EXPORT, .mech = m, .size = 8 * PEER_MIB, .offset = 4096,
             .length = 6 * PEER_MIB, .seed = seed, .slot = 1, .flags = export_flags)
            .status)
        return;
    cubuf_ipc_descriptor_t *d = suite_recv(h);
    if (!d) return;
    suite_fault_pass(h, m, export_flags, seed, &d, true, "of a new pool", false);
    if (d && m == PEER_POOL_PINNED)
        suite_fault_pass(h, m, export_flags, seed, &d, false, "over a kept pool import", false);
    if (d && suite_kept(m)) suite_new_export(h, m, export_flags, seed, &d); /* a pool not imported */
    if (d) suite_fault_pass(h, m, export_flags, seed, &d, true, "of a new pool", true);
    cubuf_ipc_descriptor_destroy(d);
    H_OK(h, .op = OP_CLEAR, .slot = 1);
    (void)me;
}

/* A copy of d through the wire format, with its bytes changed by `edit`
 * and fd `swap_fd` (if >= 0) replaced by `replacement` (owned by the copy on
 * success). NULL if deserialize refuses it (that status is returned in *st). */
typedef void (*suite_edit_fn)(uint8_t *bytes, size_t len);

static inline cubuf_ipc_descriptor_t *suite_altered(const cubuf_ipc_descriptor_t *d, suite_edit_fn edit,
                                                    int swap_fd, int replacement, cubuf_status_t *st)
{
    size_t len = 0, n = 0;
    cubuf_ipc_descriptor_serialize(d, NULL, &len, NULL, &n);
    uint8_t *bytes = malloc(len);
    int fds[CUBUF_IPC_MAX_FDS];
    cubuf_ipc_descriptor_serialize(d, bytes, &len, fds, &n);
    for (size_t i = 0; i < n; i++)
        fds[i] = (int)i == swap_fd ? replacement : fcntl(fds[i], F_DUPFD_CLOEXEC, 0);
    if (edit) edit(bytes, len);
    cubuf_ipc_descriptor_t *out = NULL;
    *st = cubuf_ipc_descriptor_deserialize(bytes, len, fds, n, &out);
    if (*st != CUBUF_SUCCESS)
        for (size_t i = 0; i < n; i++) close(fds[i]);
    free(bytes);
    return out;
}

static inline uint64_t suite_get64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}
static inline void suite_put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* size and extent four times larger than the real allocation */
static inline void edit_inflate(uint8_t *b, size_t len)
{
    suite_put64(b + 24, suite_get64(b + 24) + 3 * suite_get64(b + 40));
    suite_put64(b + 40, 4 * suite_get64(b + 40));
    (void)len;
}
/* VMM: chunk sizes doubled (extent and size follow) */
static inline void edit_vmm_double_chunks(uint8_t *b, size_t len)
{
    uint32_t n = (uint32_t)b[52] | (uint32_t)b[53] << 8;
    for (uint32_t i = 0; i < n; i++) suite_put64(b + 64 + 8 * i, 2 * suite_get64(b + 64 + 8 * i));
    suite_put64(b + 40, 2 * suite_get64(b + 40));
    (void)len;
}
/* VMM: first and last chunk sizes swapped */
static inline void edit_vmm_swap_chunks(uint8_t *b, size_t len)
{
    uint32_t n = (uint32_t)b[52] | (uint32_t)b[53] << 8;
    uint64_t first = suite_get64(b + 64), last = suite_get64(b + 64 + 8 * (n - 1));
    suite_put64(b + 64, last);
    suite_put64(b + 64 + 8 * (n - 1), first);
    (void)len;
}
/* VMM: a granularity of 4 KiB, which a device with 2 MiB granularity cannot map */
static inline void edit_vmm_small_granularity(uint8_t *b, size_t len)
{
    suite_put64(b + 56, 4096);
    (void)len;
}
/* pool export data or legacy handle scrambled */
static inline void edit_scramble_pool(uint8_t *b, size_t len)
{
    for (int i = 0; i < 64; i++) b[72 + i] ^= 0xff;
    (void)len;
}
/* pool: the host-accessible flag (bit 0 of the flags at byte 20) flipped:
 * device memory called pinned host memory, or the other way round */
static inline void edit_flip_host(uint8_t *b, size_t len)
{
    b[20] ^= 1;
    (void)len;
}
static inline void edit_scramble_legacy(uint8_t *b, size_t len)
{
    for (int i = 0; i < 64; i++) b[48 + i] ^= 0xff;
    (void)len;
}

/* Imports an altered descriptor expecting a failure whose detail holds
 * `piece` (NULL: any), with nothing left behind but `kept` pool imports
 * (a pinned pool granted access before the failure). */
static inline void suite_import_fails(peer_mech_t m, const cubuf_ipc_descriptor_t *bad,
                                      cubuf_status_t expected, const char *piece, const char *what, int kept)
{
    static fd_snap_t fds0;
    fds_take(&fds0, 0, -1);
    char label[160];
    snprintf(label, sizeof label, "%s: import of a descriptor with %s", peer_mech_name(m), what);
    track_begin();
    cubuf_buffer_t *b = NULL;
    cubuf_status_t st = cubuf_buffer_from_ipc_descriptor(NULL, NULL, bad, CU_STREAM_LEGACY, &b);
    if (st == CUBUF_SUCCESS || (expected != CUBUF_SUCCESS && st != expected) ||
        (piece && !strstr(cubuf_last_error(), piece))) {
        fprintf(stderr, "  %s, %s: import gave %s (%s); expected %s with \"%s\"\n", peer_mech_name(m),
                what, cubuf_status_name(st), cubuf_last_error(),
                expected ? cubuf_status_name(expected) : "a failure", piece ? piece : "");
        t_failures++;
    }
    if (b) {
        cubuf_buffer_close(b);
        cubuf_buffer_release(b);
    }
    cubuf__drv.cuCtxSynchronize();
    T_CHECK(track_end_kept(label, kept) == 0);
    T_CHECK(fds_back(label, &fds0, -1));
}

/* Descriptors that pass the wire checks but lie about what the driver
 * holds, and fds that are not CUDA handles: each import fails, naming the
 * step (and the chunk), and leaves nothing behind. */
static inline void suite_malformed(peer_t *me, helper_t *h, peer_mech_t m)
{
    static fd_snap_t my_fds;
    fds_take(&my_fds, 0, -1);
    char what[80];
    snprintf(what, sizeof what, "%s: descriptors that lie", peer_mech_name(m));
    uint32_t flags = m == PEER_VMM ? PEER_GROWN : 0;
    if (H_OK(h, .op = OP_EXPORT, .mech = m, .size = 16 * PEER_MIB, .seed = 3, .slot = 1, .flags = flags).status)
        return;
    cubuf_ipc_descriptor_t *d = suite_recv(h);
    if (!d) return;
    cubuf_ipc_descriptor_info_t info = CUBUF_IPC_DESCRIPTOR_INFO_INIT;
    cubuf_ipc_descriptor_info(d, &info);
    cubuf_status_t st;
    cubuf_ipc_descriptor_t *bad;
    int nul = open("/dev/null", O_RDWR | O_CLOEXEC);
    switch (m) {
    case PEER_VMM: {
        char piece[64];
        snprintf(piece, sizeof piece, "chunk 2 of %zu", info.chunk_count);
        /* a character device that is not a CUDA handle: the driver refuses it */
        bad = suite_altered(d, NULL, 1, nul, &st);
        T_OK(st);
        if (bad) suite_import_fails(m, bad, CUBUF_SUCCESS, piece, "/dev/null as chunk 2", 0);
        cubuf_ipc_descriptor_destroy(bad);
        nul = open("/dev/null", O_RDWR | O_CLOEXEC);
        /* a regular file: refused before any driver call */
        char path[] = "/tmp/cubuf-ipc-XXXXXX";
        int file = mkstemp(path);
        unlink(path);
        bad = suite_altered(d, NULL, 1, file, &st);
        T_STATUS(st, CUBUF_ERROR_INVALID_DESCRIPTOR);
        T_CHECK(bad == NULL && strstr(cubuf_last_error(), piece) != NULL);
        close(file);
        bad = suite_altered(d, edit_vmm_double_chunks, -1, -1, &st);
        T_OK(st);
        if (bad) suite_import_fails(m, bad, CUBUF_SUCCESS, "chunk 1 of", "chunks twice their size", 0);
        cubuf_ipc_descriptor_destroy(bad);
        bad = suite_altered(d, edit_vmm_swap_chunks, -1, -1, &st);
        T_OK(st);
        if (bad) suite_import_fails(m, bad, CUBUF_SUCCESS, "chunk", "chunk sizes swapped", 0);
        cubuf_ipc_descriptor_destroy(bad);
        bad = suite_altered(d, edit_vmm_small_granularity, -1, -1, &st);
        T_OK(st);
        if (bad) suite_import_fails(m, bad, CUBUF_ERROR_INVALID_DESCRIPTOR, "granularity", "4 KiB granularity", 0);
        cubuf_ipc_descriptor_destroy(bad);
        break;
    }
    case PEER_POOL_DEVICE:
    case PEER_CONTEXT:
    case PEER_POOL_PINNED:
        bad = suite_altered(d, NULL, 0, nul, &st);
        T_OK(st);
        nul = -1; /* owned by bad now */
        if (bad) suite_import_fails(m, bad, CUBUF_SUCCESS, "pool fd", "/dev/null as the pool fd", 0);
        cubuf_ipc_descriptor_destroy(bad);
        bad = suite_altered(d, edit_scramble_pool, -1, -1, &st);
        T_OK(st);
        if (bad) suite_import_fails(m, bad, CUBUF_SUCCESS, "cuMemPoolImportPointer", "scrambled export data",
                                      suite_kept(m)); /* the pool was imported and granted first */
        cubuf_ipc_descriptor_destroy(bad);
        /* the driver bounds the allocation (for pinned pools too) */
        bad = suite_altered(d, edit_inflate, -1, -1, &st);
        T_OK(st);
        if (bad) suite_import_fails(m, bad, CUBUF_ERROR_INVALID_DESCRIPTOR, "past the imported pool",
                                      "size beyond the allocation", 0);
        cubuf_ipc_descriptor_destroy(bad);
        bad = suite_altered(d, edit_flip_host, -1, -1, &st);
        T_OK(st);
        if (bad) {
            T_CHECK(cubuf_ipc_descriptor_info(bad, &info) == CUBUF_SUCCESS &&
                    info.host_accessible == (m != PEER_POOL_PINNED));
            suite_import_fails(m, bad, CUBUF_ERROR_INVALID_DESCRIPTOR, "the driver reports",
                               m == PEER_POOL_PINNED ? "pinned memory called device memory"
                                                     : "device memory called pinned host memory",
                               0); /* pinned: the pool import kept above is used again */
        }
        cubuf_ipc_descriptor_destroy(bad);
        break;
    case PEER_LEGACY:
        bad = suite_altered(d, edit_inflate, -1, -1, &st);
        T_OK(st);
        if (bad) suite_import_fails(m, bad, CUBUF_ERROR_INVALID_DESCRIPTOR, "past the opened allocation", "size beyond the allocation", 0);
        cubuf_ipc_descriptor_destroy(bad);
        bad = suite_altered(d, edit_scramble_legacy, -1, -1, &st);
        T_OK(st);
        if (bad) suite_import_fails(m, bad, CUBUF_SUCCESS, "cuIpcOpenMemHandle", "scrambled handle", 0);
        cubuf_ipc_descriptor_destroy(bad);
        break;
    }
    if (nul >= 0) close(nul);
    /* the original still imports */
    track_begin();
    cubuf_buffer_t *b = NULL;
    T_OK(cubuf_buffer_from_ipc_descriptor(me->ctx, NULL, d, CU_STREAM_LEGACY, &b));
    size_t badpos = 0;
    if (b) {
        T_OK(peer_verify(b, 3, 0, &badpos));
        T_CHECK(badpos == SIZE_MAX);
    }
    cubuf_buffer_release(b);
    cubuf__drv.cuCtxSynchronize();
    T_CHECK(track_end(what) == 0); /* pinned: the kept pool import is reused, nothing new stays */
    cubuf_ipc_descriptor_destroy(d);
    H_OK(h, .op = OP_CLEAR, .slot = 1);
    T_CHECK(fds_back(what, &my_fds, -1));
}

/* Argument checks that need a driver but no peer. */
static inline void suite_arguments(peer_t *me, peer_mech_t m)
{
    cubuf_buffer_t *b = NULL;
    cubuf_ipc_descriptor_t *d = NULL;
    T_STATUS(cubuf_buffer_ipc_descriptor(NULL, &d), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_buffer_from_ipc_descriptor(NULL, NULL, NULL, 0, &b), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_context_open_ipc_buffer(NULL, NULL, &b), CUBUF_ERROR_INVALID_ARGUMENT);
    /* a resource of the mechanism: export works; a closed buffer, size 0 and a view do not */
    cubuf_resource_t *res = NULL;
    T_REQUIRE(peer_resource(m, &res));
    cubuf_buffer_t *buf = NULL, *empty = NULL, *view = NULL;
    T_OK(cubuf_resource_allocate(res, 2 * PEER_MIB, CU_STREAM_LEGACY, &buf));
    T_OK(cubuf_resource_allocate(res, 0, CU_STREAM_LEGACY, &empty));
    cubuf__drv.cuCtxSynchronize();
    T_STATUS(cubuf_buffer_ipc_descriptor(empty, &d), CUBUF_ERROR_INVALID_ARGUMENT);
    T_OK(cubuf_buffer_view(cubuf_buffer_ptr(buf), 4096, &view));
    T_STATUS(cubuf_buffer_ipc_descriptor(view, &d), CUBUF_ERROR_NOT_SUPPORTED);
    /* Export with each of its host allocations failing in turn:
     * OUT_OF_MEMORY, no descriptor, every fd exported so far closed. */
    static fd_snap_t fds0;
    /* The driver opens a device file of its own on the first export (seen on
     * the H200: one more /dev/nvidiactl): export once before the baseline. */
    cubuf_ipc_descriptor_t *warm = NULL;
    T_OK(cubuf_buffer_ipc_descriptor(buf, &warm));
    cubuf_ipc_descriptor_destroy(warm);
    fds_take(&fds0, 0, -1);
    unsigned n = 1;
    for (;; n++) {
        cubuf_ipc_descriptor_t *e = NULL;
        t_fail_alloc_nth(n);
        cubuf_status_t st = cubuf_buffer_ipc_descriptor(buf, &e);
        bool fired = cubuf_fault_fired();
        cubuf_fault_reset();
        if (!fired || n == 32) {
            T_OK(st);
            cubuf_ipc_descriptor_destroy(e);
            break;
        }
        T_STATUS(st, CUBUF_ERROR_OUT_OF_MEMORY);
        T_CHECK(e == NULL);
        T_CHECK(fds_back("export with a host allocation failing", &fds0, -1));
    }
    T_CHECK(n >= 2); /* at least the descriptor */
    T_CHECK(fds_back("export after the host allocation faults", &fds0, -1));
    T_OK(cubuf_buffer_ipc_descriptor(buf, &d));
    cubuf_ipc_descriptor_info_t info = CUBUF_IPC_DESCRIPTOR_INFO_INIT;
    T_OK(cubuf_ipc_descriptor_info(d, &info));
    T_CHECK(info.size == cubuf_buffer_size(buf) && info.offset == 0);
    T_CHECK(info.mechanism == (m == PEER_VMM      ? CUBUF_IPC_MECHANISM_VMM
                               : m == PEER_LEGACY ? CUBUF_IPC_MECHANISM_LEGACY
                                                  : CUBUF_IPC_MECHANISM_POOL));
    cubuf_ipc_import_options_t o = CUBUF_IPC_IMPORT_OPTIONS_INIT;
    o.struct_size = 1;
    T_STATUS(cubuf_buffer_from_ipc_descriptor(NULL, &o, d, 0, &b), CUBUF_ERROR_INVALID_ARGUMENT);
    o = (cubuf_ipc_import_options_t)CUBUF_IPC_IMPORT_OPTIONS_INIT;
    o.device = 4096;
    T_STATUS(cubuf_buffer_from_ipc_descriptor(NULL, &o, d, 0, &b), CUBUF_ERROR_OUT_OF_RANGE);
    cubuf_ipc_descriptor_destroy(d);
    cubuf_buffer_release(view);
    T_OK(cubuf_buffer_close(buf));
    T_STATUS(cubuf_buffer_ipc_descriptor(buf, &d), CUBUF_ERROR_CLOSED);
    cubuf_buffer_release(buf);
    cubuf_buffer_release(empty);
    /* a resource that cannot share */
    cubuf_resource_t *plain = NULL;
    T_OK(cubuf_device_resource_create(0, NULL, &plain));
    T_OK(cubuf_resource_allocate(plain, PEER_MIB, CU_STREAM_LEGACY, &buf));
    T_STATUS(cubuf_buffer_ipc_descriptor(buf, &d), CUBUF_ERROR_NOT_SUPPORTED);
    cubuf_buffer_release(buf);
    cubuf_resource_release(plain);
    cubuf_resource_release(res);
    cubuf__drv.cuCtxSynchronize();
    (void)me;
}

/* cubuf_buffer_wrap refuses an imported buffer's resource (it frees only
 * the import it made; given another pointer, or its own again, it would
 * undo that import under the open buffer): nothing is counted, and the
 * imported buffer stays open with the exporter's bytes. */
static inline void suite_wrap_refused(helper_t *h, peer_mech_t m)
{
    char what[80];
    snprintf(what, sizeof what, "%s: wrap with an imported resource", peer_mech_name(m));
    static fd_snap_t my_fds;
    fds_take(&my_fds, 0, -1);
    uint64_t seed = 0x3a90 + m;
    if (H_OK(h, .op = OP_EXPORT, .mech = m, .size = 4 * PEER_MIB, .seed = seed, .slot = 1).status) return;
    cubuf_ipc_descriptor_t *d = suite_recv(h);
    cubuf_buffer_t *b = NULL;
    if (d) T_OK(cubuf_buffer_from_ipc_descriptor(NULL, NULL, d, CU_STREAM_LEGACY, &b));
    cubuf_ipc_descriptor_destroy(d);
    if (b) {
        cubuf_resource_t *res = cubuf_buffer_resource(b);
        cubuf_resource_stats_t before = CUBUF_RESOURCE_STATS_INIT, after = CUBUF_RESOURCE_STATS_INIT;
        T_OK(cubuf_resource_stats(res, &before));
        const CUdeviceptr ptrs[2] = {cubuf_buffer_ptr(b), cubuf_buffer_ptr(b) + PEER_MIB};
        const size_t sizes[2] = {cubuf_buffer_size(b), PEER_MIB};
        bool leaked = false;
        for (int i = 0; i < 2; i++) {
            cubuf_buffer_t *w = NULL;
            T_STATUS(cubuf_buffer_wrap(ptrs[i], sizes[i], res, CU_STREAM_LEGACY, &w), CUBUF_ERROR_INVALID_ARGUMENT);
            T_CHECK(strstr(cubuf_last_error(), "imported") != NULL);
            T_CHECK(w == NULL);
            leaked |= w != NULL; /* closing it would undo the import: left alone */
        }
        T_OK(cubuf_resource_stats(res, &after));
        T_CHECK(after.current_bytes == before.current_bytes && after.current_count == before.current_count &&
                after.total_allocations == before.total_allocations);
        T_CHECK(!cubuf_buffer_is_closed(b));
        size_t bad = 0;
        T_OK(peer_verify(b, seed, 0, &bad));
        if (bad != SIZE_MAX) fprintf(stderr, "  %s: the import differs at byte %zu\n", what, bad);
        T_CHECK(bad == SIZE_MAX);
        if (!leaked) {
            T_OK(cubuf_buffer_close(b));
            cubuf_buffer_release(b);
        }
    }
    cubuf__drv.cuCtxSynchronize();
    H_OK(h, .op = OP_CLEAR, .slot = 1);
    T_CHECK(fds_back(what, &my_fds, -1));
}

/* The end of a test program, after the helper stopped and the context was
 * destroyed: the driver keeps the files it opened for the process (device
 * nodes, its uvm file) until the process exits. Those are listed; more
 * than a handful means something per import stayed open. */
static inline void suite_end_fds(const char *name, const fd_snap_t *start)
{
    static fd_snap_t now;
    fds_take(&now, 0, -1);
    int res[PW_MAX], nres = pw_residue_fds(res, PW_MAX);
    int dropped = fds_drop_residue(start, &now, res, nres);
    char diff[2048];
    fds_diff(start, &now, diff, sizeof diff);
    printf("  %s: fds %d at the start, %d at the end besides %d held by the %d pinned pool import(s) kept:%s\n",
           name, start->n, now.n, dropped, g_pw.n, diff);
    T_CHECK(now.ok && now.n <= start->n + 8);
    /* exactly the pinned pool imports the scenarios counted, each granted */
    if (g_pw.n != (int)g_kept_expected || pw_ungranted() != 0) {
        fprintf(stderr, "  %s: %d pool imports alive (%d never granted); expected %u, all granted\n", name,
                g_pw.n, pw_ungranted(), g_kept_expected);
        t_failures++;
    }
}

/* Skips (exit 77) when the device cannot share memory by mechanism m. */
static inline void suite_require(peer_mech_t m)
{
    cubuf_resource_t *res = NULL;
    cubuf_status_t st = peer_resource(m, &res);
    if (st == CUBUF_ERROR_NOT_SUPPORTED) {
        printf("SKIP: %s IPC is not supported here: %s\n", peer_mech_name(m), cubuf_last_error());
        exit(T_SKIP);
    }
    T_REQUIRE(st);
    cubuf_resource_release(res);
}

#endif
