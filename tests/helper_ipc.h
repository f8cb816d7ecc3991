/* The multi-process IPC tests: what the test programs (tests/test_ipc_*.c)
 * and the peer they start with fork+exec (tests/helper_ipc.c) share: a
 * position-dependent data pattern, buffers of each mechanism, the peer's
 * operations, and the little command protocol over their socketpair
 * (commands and replies as fixed structs, descriptors with cubuf_ipc_send).
 * Everything is static inline so each program uses what it needs. */
#ifndef CUBUF_TEST_HELPER_IPC_H
#define CUBUF_TEST_HELPER_IPC_H

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cubuf.h"
#include "driver.h"
#include "fault.h"
#include "test.h"

#define PEER_MIB ((size_t)1 << 20)
#define PEER_GIB ((size_t)1 << 30)
#define PEER_SLOTS 8
#define PEER_REPLY_TIMEOUT_MS 300000 /* a 1 GiB pattern takes seconds, not minutes */

typedef enum peer_mech {
    PEER_POOL_DEVICE = 1, /* private device pool, IPC-enabled */
    PEER_POOL_PINNED = 2, /* pinned host pool, IPC-enabled */
    PEER_VMM = 3,         /* VMM resource with POSIX fd handles */
    PEER_LEGACY = 4,      /* sync device resource (cuMemAlloc), legacy handles */
    PEER_CONTEXT = 5,     /* the context's device pool (cubuf_context_new_buffer) */
} peer_mech_t;

static inline const char *peer_mech_name(peer_mech_t m)
{
    switch (m) {
    case PEER_POOL_DEVICE: return "device pool";
    case PEER_POOL_PINNED: return "pinned pool";
    case PEER_VMM: return "vmm";
    case PEER_LEGACY: return "legacy";
    case PEER_CONTEXT: return "context";
    }
    return "?";
}

/* ---- the data pattern: byte p of pattern `seed` ---- */

static inline uint64_t pat_word(uint64_t seed, uint64_t i)
{
    uint64_t z = seed * 0xD1B54A32D192ED03ull + i * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static inline uint8_t pat_byte(uint64_t seed, uint64_t p)
{
    return (uint8_t)(pat_word(seed, p >> 3) >> (8 * (p & 7)));
}

/* dst[k] = pattern byte pos + k. */
static inline void pat_fill(uint8_t *dst, uint64_t seed, uint64_t pos, size_t len)
{
    size_t k = 0;
    for (; k < len && ((pos + k) & 7); k++) dst[k] = pat_byte(seed, pos + k);
    for (; k + 8 <= len; k += 8) {
        uint64_t w = pat_word(seed, (pos + k) >> 3);
        for (int j = 0; j < 8; j++) dst[k + j] = (uint8_t)(w >> (8 * j));
    }
    for (; k < len; k++) dst[k] = pat_byte(seed, pos + k);
}

/* ---- device memory through raw driver calls (the context is current) ---- */

#define PEER_IO_CHUNK (64 * PEER_MIB)

/* Writes pattern bytes [pos, pos+size) into buf. */
static inline cubuf_status_t peer_write(cubuf_buffer_t *buf, uint64_t seed, uint64_t pos)
{
    size_t size = cubuf_buffer_size(buf);
    uint8_t *host = malloc(size < PEER_IO_CHUNK ? size : PEER_IO_CHUNK);
    if (!host) return CUBUF_ERROR_OUT_OF_MEMORY;
    CUresult r = CUDA_SUCCESS;
    for (size_t off = 0; off < size && r == CUDA_SUCCESS; off += PEER_IO_CHUNK) {
        size_t n = size - off < PEER_IO_CHUNK ? size - off : PEER_IO_CHUNK;
        pat_fill(host, seed, pos + off, n);
        r = cubuf__drv.cuMemcpy(cubuf_buffer_ptr(buf) + off, (CUdeviceptr)(uintptr_t)host, n);
    }
    if (r == CUDA_SUCCESS) r = cubuf__drv.cuCtxSynchronize();
    free(host);
    return r == CUDA_SUCCESS ? CUBUF_SUCCESS : CUBUF_ERROR_DRIVER;
}

/* Reads buf back and compares it with pattern bytes [pos, pos+size). On a
 * mismatch, *bad is its offset (else SIZE_MAX). */
static inline cubuf_status_t peer_verify(const cubuf_buffer_t *buf, uint64_t seed, uint64_t pos,
                                         size_t *bad)
{
    size_t size = cubuf_buffer_size(buf);
    size_t chunk = size < PEER_IO_CHUNK ? size : PEER_IO_CHUNK;
    uint8_t *host = malloc(chunk ? chunk : 1), *want = malloc(chunk ? chunk : 1);
    *bad = SIZE_MAX;
    if (!host || !want) {
        free(host);
        free(want);
        return CUBUF_ERROR_OUT_OF_MEMORY;
    }
    CUresult r = CUDA_SUCCESS;
    for (size_t off = 0; off < size && r == CUDA_SUCCESS && *bad == SIZE_MAX; off += PEER_IO_CHUNK) {
        size_t n = size - off < PEER_IO_CHUNK ? size - off : PEER_IO_CHUNK;
        r = cubuf__drv.cuMemcpy((CUdeviceptr)(uintptr_t)host, cubuf_buffer_ptr(buf) + off, n);
        if (r != CUDA_SUCCESS) break;
        pat_fill(want, seed, pos + off, n);
        if (memcmp(host, want, n) != 0)
            for (size_t k = 0; k < n; k++)
                if (host[k] != want[k]) {
                    *bad = off + k;
                    break;
                }
    }
    free(host);
    free(want);
    return r == CUDA_SUCCESS ? CUBUF_SUCCESS : CUBUF_ERROR_DRIVER;
}

/* ---- pool imports the library keeps (both processes) ---- */

/* An imported pinned pool stays imported until the process exits (see
 * <cubuf/ipc.h>): its driver object and the fds the driver opened for it are
 * expected residue, nothing else is. Wrappers in front of the driver table
 * record each live pool import, whether a device was granted access to it
 * (the library's rule for keeping it), and the fds that appeared in this
 * process during the driver calls made on it (import, grant, pointer
 * import), so that fd checks can tell that residue from a leak precisely. */
#define PW_MAX 256
#define PW_FDS 8

typedef struct pw_fd {
    int fd;
    char target[72];
} pw_fd_t;

typedef struct pw_pool {
    CUmemoryPool pool;
    bool granted;
    int nfd;
    pw_fd_t fd[PW_FDS];
} pw_pool_t;

static struct {
    bool installed;
    cubuf_driver_t real;
    int n;            /* live pool imports */
    unsigned grants;  /* successful cuMemPoolSetAccess on imports, ever */
    unsigned imports; /* successful cuMemPoolImportFromShareableHandle, ever */
    pw_pool_t live[PW_MAX];
} g_pw;

#define PW_OPEN_MAX 4096
typedef struct pw_open {
    unsigned char bit[PW_OPEN_MAX / 8];
} pw_open_t;

static inline void pw_open_fds(pw_open_t *o)
{
    memset(o, 0, sizeof *o);
    DIR *d = opendir("/proc/self/fd");
    if (!d) return;
    struct dirent *ent;
    while ((ent = readdir(d))) {
        if (ent->d_name[0] < '0' || ent->d_name[0] > '9') continue;
        int fd = atoi(ent->d_name);
        if (fd != dirfd(d) && fd < PW_OPEN_MAX) o->bit[fd / 8] |= (unsigned char)(1u << (fd % 8));
    }
    closedir(d);
}

static inline bool pw_fd_target(int fd, char *out, size_t cap)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    ssize_t k = readlink(path, out, cap - 1);
    out[k > 0 ? k : 0] = '\0';
    return k > 0;
}

static inline pw_pool_t *pw_find(CUmemoryPool pool)
{
    for (int i = 0; i < g_pw.n; i++)
        if (g_pw.live[i].pool == pool) return &g_pw.live[i];
    return NULL;
}

/* Attributes to `rec` the fds open now that were not open in `before`. */
static inline void pw_attribute(pw_pool_t *rec, const pw_open_t *before)
{
    if (!rec) return;
    pw_open_t after;
    pw_open_fds(&after);
    for (int fd = 0; fd < PW_OPEN_MAX; fd++) {
        bool was = before->bit[fd / 8] >> (fd % 8) & 1, is = after.bit[fd / 8] >> (fd % 8) & 1;
        if (!is || was || rec->nfd == PW_FDS) continue;
        pw_fd_t *f = &rec->fd[rec->nfd];
        if (pw_fd_target(fd, f->target, sizeof f->target)) {
            f->fd = fd;
            rec->nfd++;
        }
    }
}

static CUresult CUDAAPI pw_cuMemPoolImportFromShareableHandle(CUmemoryPool *out, void *handle,
                                                              CUmemAllocationHandleType type,
                                                              unsigned long long flags)
{
    pw_open_t before;
    pw_open_fds(&before);
    CUresult r = g_pw.real.cuMemPoolImportFromShareableHandle(out, handle, type, flags);
    if (r != CUDA_SUCCESS) return r;
    g_pw.imports++;
    if (g_pw.n < PW_MAX) {
        pw_pool_t *rec = &g_pw.live[g_pw.n++];
        memset(rec, 0, sizeof *rec);
        rec->pool = *out;
        pw_attribute(rec, &before);
    }
    return r;
}
static CUresult CUDAAPI pw_cuMemPoolSetAccess(CUmemoryPool pool, const CUmemAccessDesc *map, size_t count)
{
    pw_open_t before;
    pw_open_fds(&before);
    CUresult r = g_pw.real.cuMemPoolSetAccess(pool, map, count);
    pw_pool_t *rec = pw_find(pool); /* NULL: a pool of this process, not an import */
    if (r == CUDA_SUCCESS && rec) {
        if (!rec->granted) g_pw.grants++;
        rec->granted = true;
    }
    pw_attribute(rec, &before);
    return r;
}
static CUresult CUDAAPI pw_cuMemPoolImportPointer(CUdeviceptr *out, CUmemoryPool pool, CUmemPoolPtrExportData *data)
{
    pw_open_t before;
    pw_open_fds(&before);
    CUresult r = g_pw.real.cuMemPoolImportPointer(out, pool, data);
    pw_attribute(pw_find(pool), &before);
    return r;
}
static CUresult CUDAAPI pw_cuMemPoolDestroy(CUmemoryPool pool)
{
    CUresult r = g_pw.real.cuMemPoolDestroy(pool);
    pw_pool_t *rec = pw_find(pool);
    if (r == CUDA_SUCCESS && rec) *rec = g_pw.live[--g_pw.n];
    return r;
}

/* Puts the wrappers into the table (once; the driver is loaded). */
static inline void pw_install(void)
{
    if (g_pw.installed) return;
    g_pw.installed = true;
    g_pw.real = cubuf__drv;
    cubuf__drv.cuMemPoolImportFromShareableHandle = pw_cuMemPoolImportFromShareableHandle;
    cubuf__drv.cuMemPoolSetAccess = pw_cuMemPoolSetAccess;
    cubuf__drv.cuMemPoolImportPointer = pw_cuMemPoolImportPointer;
    cubuf__drv.cuMemPoolDestroy = pw_cuMemPoolDestroy;
}

/* The live pool imports that were never granted access: the library must
 * have destroyed every one of them at its last close. */
static inline int pw_ungranted(void)
{
    int k = 0;
    for (int i = 0; i < g_pw.n; i++) k += !g_pw.live[i].granted;
    return k;
}

/* Writes into fds (at most cap) the fds held by live pool imports that are
 * still open with the target recorded; returns how many. */
static inline int pw_residue_fds(int *fds, int cap)
{
    int k = 0;
    for (int i = 0; i < g_pw.n; i++)
        for (int j = 0; j < g_pw.live[i].nfd && k < cap; j++) {
            char now[72];
            if (pw_fd_target(g_pw.live[i].fd[j].fd, now, sizeof now) &&
                strcmp(now, g_pw.live[i].fd[j].target) == 0)
                fds[k++] = g_pw.live[i].fd[j].fd;
        }
    return k;
}

/* ---- buffers of each mechanism ---- */

typedef struct peer_slot {
    cubuf_resource_t *res;
    cubuf_buffer_t *root;     /* the allocation (exporter) */
    cubuf_buffer_t *buf;      /* what was exported (root or a slice) or imported */
    cubuf_buffer_t *dup;      /* a second import of the same descriptor */
    cubuf_buffer_t *extra[3]; /* VMM: the buffers a grown one aliases */
    uint64_t pos;             /* buf's first byte in the pattern */
} peer_slot_t;

typedef struct peer {
    cubuf_context_t *ctx;
    int sock;
    peer_slot_t slot[PEER_SLOTS];
    char detail[256]; /* why the last operation failed */
} peer_t;

static inline cubuf_status_t peer_failed(peer_t *p, cubuf_status_t st, const char *what)
{
    snprintf(p->detail, sizeof p->detail, "%s: %s: %s", what, cubuf_status_name(st), cubuf_last_error());
    return st;
}

/* This process's context (peer_init), whose pool PEER_CONTEXT shares. */
static cubuf_context_t *g_peer_ctx;

static inline cubuf_status_t peer_init(peer_t *p, int sock)
{
    memset(p, 0, sizeof *p);
    p->sock = sock;
    cubuf_status_t st = cubuf_context_create(0, &p->ctx);
    if (st != CUBUF_SUCCESS) return peer_failed(p, st, "cubuf_context_create");
    g_peer_ctx = p->ctx;
    CUcontext h = NULL;
    cubuf_context_handle(p->ctx, &h);
    if (cubuf__drv.cuCtxSetCurrent(h) != CUDA_SUCCESS) return CUBUF_ERROR_DRIVER;
    pw_install();
    t_held_count(); /* this process's driver objects: its leak checks (OP_HELD) */
    return CUBUF_SUCCESS;
}

static inline cubuf_status_t peer_resource(peer_mech_t m, cubuf_resource_t **res)
{
    switch (m) {
    case PEER_POOL_DEVICE: {
        cubuf_device_resource_options_t o = CUBUF_DEVICE_RESOURCE_OPTIONS_INIT;
        o.private_pool = true;
        o.ipc_enabled = true;
        return cubuf_device_resource_create(0, &o, res);
    }
    case PEER_POOL_PINNED: return cubuf_pinned_resource_create(0, true, res);
    case PEER_VMM: {
        cubuf_vmm_options_t o = CUBUF_VMM_OPTIONS_INIT;
        o.handle_type = CUBUF_VMM_HANDLE_POSIX_FD;
        return cubuf_vmm_resource_create(0, &o, res);
    }
    case PEER_LEGACY: return cubuf_sync_device_resource_create(0, res);
    case PEER_CONTEXT: {
        /* The pool cubuf_context_new_buffer allocates from; not shareable
         * where the context had to fall back to the default pool. */
        cubuf_buffer_t *b = NULL;
        cubuf_status_t st = cubuf_context_new_buffer(g_peer_ctx, 0, &b);
        if (st != CUBUF_SUCCESS) return st;
        *res = cubuf_resource_retain(cubuf_buffer_resource(b));
        cubuf_buffer_release(b);
        cubuf_resource_props_t props = CUBUF_RESOURCE_PROPS_INIT;
        if ((st = cubuf_resource_props(*res, &props)) != CUBUF_SUCCESS || !props.ipc_enabled) {
            cubuf_resource_release(*res);
            *res = NULL;
            return st != CUBUF_SUCCESS ? st : CUBUF_ERROR_NOT_SUPPORTED;
        }
        return CUBUF_SUCCESS;
    }
    }
    return CUBUF_ERROR_INVALID_ARGUMENT;
}

/* A VMM buffer of `size` bytes backed by three physical allocations, made
 * by a moving grow: A, then B1 and B2 grown in place from it, then C grown
 * from B1, which must move because B2 maps the addresses after B1.
 * *moved tells whether C really moved. */
static inline cubuf_status_t peer_alloc_grown(peer_slot_t *s, size_t size, bool *moved)
{
    size_t g = 0;
    cubuf_status_t st = cubuf_vmm_granularity(s->res, &g);
    if (st != CUBUF_SUCCESS) return st;
    size = (size + g - 1) / g * g;
    if (size < 4 * g) size = 4 * g;
    cubuf_buffer_t *a = NULL, *b1 = NULL, *b2 = NULL, *c = NULL;
    if ((st = cubuf_resource_allocate(s->res, size - 3 * g, CU_STREAM_LEGACY, &a)) != CUBUF_SUCCESS) return st;
    s->extra[0] = a;
    if ((st = cubuf_vmm_modify_allocation(s->res, a, size - 2 * g, NULL, &b1)) != CUBUF_SUCCESS) return st;
    s->extra[1] = b1;
    if ((st = cubuf_vmm_modify_allocation(s->res, b1, size - g, NULL, &b2)) != CUBUF_SUCCESS) return st;
    s->extra[2] = b2;
    if ((st = cubuf_vmm_modify_allocation(s->res, b1, size, NULL, &c)) != CUBUF_SUCCESS) return st;
    *moved = cubuf_buffer_ptr(c) != cubuf_buffer_ptr(b1);
    s->root = c;
    return CUBUF_SUCCESS;
}

/* Releases everything in a slot (closing what is open). */
static inline void peer_slot_clear(peer_slot_t *s)
{
    cubuf_buffer_release(s->dup);
    cubuf_buffer_release(s->buf);
    if (s->root != s->buf) cubuf_buffer_release(s->root);
    for (int i = 2; i >= 0; i--) cubuf_buffer_release(s->extra[i]);
    cubuf_resource_release(s->res);
    cubuf__drv.cuCtxSynchronize();
    memset(s, 0, sizeof *s);
}

/* ---- commands ---- */

enum peer_op {
    OP_EXPORT = 1, /* allocate, fill with the pattern, (slice,) export, reply, send the descriptor */
    OP_IMPORT,     /* receive a descriptor, import it, reply (value: is_mapped) */
    OP_VERIFY,     /* compare a slot's buffer with the pattern (value: bad offset + 1, 0 = all good) */
    OP_WRITE,      /* write the pattern into a slot's buffer */
    OP_CLOSE,      /* close a slot's buffer (flags: PEER_DUP closes the duplicate), synchronize */
    OP_CLEAR,      /* release a slot entirely (resource included) */
    OP_HELD,       /* held: the driver objects the peer holds (t_held) */
    OP_EXIT,       /* reply, then exit at once without closing anything */
    OP_POOLS,      /* value: live pool imports, granted ones in the high 32 bits;
                      detail: the fds they hold ("12 13 "), see pw_residue_fds */
};

enum peer_flags {
    PEER_GROWN = 1u << 0,       /* OP_EXPORT, VMM: several chunks after a moving grow */
    PEER_DIE_MID_SEND = 1u << 1, /* OP_EXPORT: send part of the descriptor, then SIGKILL itself */
    PEER_DUP = 1u << 2,         /* OP_IMPORT: import the descriptor twice; OP_CLOSE: the duplicate */
    PEER_READ_ONLY = 1u << 3,   /* OP_IMPORT: CUBUF_IPC_ACCESS_READ */
    PEER_OPEN_IN_CTX = 1u << 4, /* OP_IMPORT: cubuf_context_open_ipc_buffer */
};

typedef struct peer_cmd {
    uint32_t op;
    uint32_t mech;
    uint64_t size;   /* OP_EXPORT: allocation size */
    uint64_t offset; /* OP_EXPORT: slice offset; OP_VERIFY/OP_WRITE: pattern position */
    uint64_t length; /* OP_EXPORT: slice length (0: the whole buffer) */
    uint64_t seed;
    uint32_t slot;
    uint32_t flags;
} peer_cmd_t;

typedef struct peer_reply {
    int32_t status; /* a cubuf_status_t */
    uint32_t pad;
    uint64_t value;
    t_held_t held; /* OP_HELD */
    char detail[256];
} peer_reply_t;

/* Reads exactly n bytes, waiting at most timeout_ms in all. */
static inline bool peer_read_exact(int fd, void *p, size_t n, int timeout_ms)
{
    uint8_t *b = p;
    size_t got = 0;
    while (got < n) {
        struct pollfd pfd = {fd, POLLIN, 0};
        int r = poll(&pfd, 1, timeout_ms);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return false;
        ssize_t k = read(fd, b + got, n - got);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return false;
        got += (size_t)k;
    }
    return true;
}

static inline bool peer_write_exact(int fd, const void *p, size_t n)
{
    const uint8_t *b = p;
    while (n) {
        ssize_t k = send(fd, b, n, MSG_NOSIGNAL);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return false;
        b += k;
        n -= (size_t)k;
    }
    return true;
}

/* ---- the peer's operations (run by the helper, and by tests locally) ---- */

static inline cubuf_status_t peer_export(peer_t *p, const peer_cmd_t *c, cubuf_ipc_descriptor_t **desc,
                                         uint64_t *value)
{
    peer_slot_t *s = &p->slot[c->slot];
    cubuf_status_t st = peer_resource((peer_mech_t)c->mech, &s->res);
    if (st != CUBUF_SUCCESS) return peer_failed(p, st, "creating the resource");
    bool moved = false;
    if (c->flags & PEER_GROWN)
        st = peer_alloc_grown(s, c->size, &moved);
    else
        st = cubuf_resource_allocate(s->res, c->size, CU_STREAM_LEGACY, &s->root);
    if (st != CUBUF_SUCCESS) return peer_failed(p, st, "allocating");
    /* The importer must not touch the memory before its allocation completed. */
    if ((st = peer_write(s->root, c->seed, 0)) != CUBUF_SUCCESS) return peer_failed(p, st, "writing");
    s->buf = s->root;
    s->pos = 0;
    if (c->length) {
        if ((st = cubuf_buffer_slice(s->root, c->offset, c->length, &s->buf)) != CUBUF_SUCCESS)
            return peer_failed(p, st, "slicing");
        s->pos = c->offset;
    }
    if ((st = cubuf_buffer_ipc_descriptor(s->buf, desc)) != CUBUF_SUCCESS)
        return peer_failed(p, st, "cubuf_buffer_ipc_descriptor");
    cubuf_ipc_descriptor_info_t info = CUBUF_IPC_DESCRIPTOR_INFO_INIT;
    cubuf_ipc_descriptor_info(*desc, &info);
    *value = (uint64_t)info.chunk_count | (moved ? (uint64_t)1 << 32 : 0);
    return CUBUF_SUCCESS;
}

static inline cubuf_status_t peer_import(peer_t *p, const peer_cmd_t *c,
                                         const cubuf_ipc_descriptor_t *desc, uint64_t *value)
{
    peer_slot_t *s = &p->slot[c->slot];
    cubuf_ipc_import_options_t o = CUBUF_IPC_IMPORT_OPTIONS_INIT;
    if (c->flags & PEER_READ_ONLY) o.access = CUBUF_IPC_ACCESS_READ;
    for (int k = 0; k < ((c->flags & PEER_DUP) ? 2 : 1); k++) {
        cubuf_buffer_t **dst = k ? &s->dup : &s->buf;
        cubuf_status_t st = (c->flags & PEER_OPEN_IN_CTX)
                                ? cubuf_context_open_ipc_buffer(p->ctx, desc, dst)
                                : cubuf_buffer_from_ipc_descriptor(NULL, &o, desc, CU_STREAM_LEGACY, dst);
        if (st != CUBUF_SUCCESS) return peer_failed(p, st, "importing");
    }
    s->pos = c->offset;
    *value = cubuf_buffer_is_mapped(s->buf) && cubuf_buffer_is_device_accessible(s->buf) &&
             (!s->dup || cubuf_buffer_is_mapped(s->dup));
    return CUBUF_SUCCESS;
}

static inline cubuf_status_t peer_close(peer_t *p, const peer_cmd_t *c)
{
    peer_slot_t *s = &p->slot[c->slot];
    cubuf_buffer_t *b = (c->flags & PEER_DUP) ? s->dup : s->buf;
    cubuf_status_t st = cubuf_buffer_close(b);
    /* An importer's free must complete before the exporter frees. */
    if (cubuf__drv.cuCtxSynchronize() != CUDA_SUCCESS && st == CUBUF_SUCCESS) st = CUBUF_ERROR_DRIVER;
    if (st != CUBUF_SUCCESS) return peer_failed(p, st, "closing");
    return CUBUF_SUCCESS;
}

/* Serves commands until EOF or OP_EXIT (the helper's main loop). */
static inline int peer_serve(peer_t *p)
{
    cubuf_ipc_recv_options_t ro = CUBUF_IPC_RECV_OPTIONS_INIT;
    ro.timeout_ms = 60000;
    ro.check_uid = true;
    ro.uid = getuid();
    ro.check_pid = true; /* the test made the socketpair: SO_PEERCRED names it */
    ro.pid = getppid();
    for (;;) {
        peer_cmd_t c;
        if (!peer_read_exact(p->sock, &c, sizeof c, -1)) return 0; /* the test is gone */
        peer_reply_t r;
        memset(&r, 0, sizeof r);
        p->detail[0] = '\0';
        cubuf_ipc_descriptor_t *d = NULL;
        cubuf_status_t st = CUBUF_SUCCESS;
        if (c.slot >= PEER_SLOTS) c.slot = 0;
        peer_slot_t *s = &p->slot[c.slot];
        switch (c.op) {
        case OP_EXPORT:
            st = peer_export(p, &c, &d, &r.value);
            if (st == CUBUF_SUCCESS && (c.flags & PEER_DIE_MID_SEND)) {
                size_t len = 0, n = 0;
                uint8_t bytes[CUBUF_IPC_MAX_BYTES];
                int fds[CUBUF_IPC_MAX_FDS];
                cubuf_ipc_descriptor_serialize(d, NULL, &len, NULL, &n);
                cubuf_ipc_descriptor_serialize(d, bytes, &len, fds, &n);
                struct iovec iov = {bytes, len / 2};
                union {
                    struct cmsghdr a;
                    char b[CMSG_SPACE(sizeof(int))];
                } cm;
                struct msghdr m = {0};
                m.msg_iov = &iov;
                m.msg_iovlen = 1;
                if (n) {
                    memset(&cm, 0, sizeof cm);
                    m.msg_control = cm.b;
                    m.msg_controllen = sizeof cm.b;
                    struct cmsghdr *h = CMSG_FIRSTHDR(&m);
                    h->cmsg_level = SOL_SOCKET;
                    h->cmsg_type = SCM_RIGHTS;
                    h->cmsg_len = CMSG_LEN(sizeof(int));
                    memcpy(CMSG_DATA(h), &fds[0], sizeof(int));
                }
                peer_write_exact(p->sock, &r, sizeof r);
                (void)!sendmsg(p->sock, &m, MSG_NOSIGNAL);
                raise(SIGKILL);
            }
            break;
        case OP_IMPORT:
            st = cubuf_ipc_recv(p->sock, &ro, &d);
            if (st != CUBUF_SUCCESS)
                peer_failed(p, st, "cubuf_ipc_recv");
            else
                st = peer_import(p, &c, d, &r.value);
            cubuf_ipc_descriptor_destroy(d);
            d = NULL;
            break;
        case OP_VERIFY: {
            size_t bad = SIZE_MAX;
            st = peer_verify((c.flags & PEER_DUP) ? s->dup : s->buf, c.seed, c.offset, &bad);
            if (st != CUBUF_SUCCESS) peer_failed(p, st, "reading back");
            r.value = bad == SIZE_MAX ? 0 : bad + 1;
            break;
        }
        case OP_WRITE:
            st = peer_write(s->buf, c.seed, c.offset);
            if (st != CUBUF_SUCCESS) peer_failed(p, st, "writing");
            break;
        case OP_CLOSE: st = peer_close(p, &c); break;
        case OP_CLEAR: peer_slot_clear(s); break;
        case OP_HELD: r.held = t_held(); break;
        case OP_POOLS: {
            int fds[64], n = pw_residue_fds(fds, 64);
            size_t used = 0;
            p->detail[0] = '\0';
            for (int i = 0; i < n && used < sizeof p->detail; i++) {
                int w = snprintf(p->detail + used, sizeof p->detail - used, "%d ", fds[i]);
                if (w > 0) used += (size_t)w;
            }
            r.value = (uint64_t)g_pw.n | (uint64_t)(g_pw.n - pw_ungranted()) << 32;
            break;
        }
        case OP_EXIT:
            peer_write_exact(p->sock, &r, sizeof r);
            _exit((int)c.seed);
        default: st = CUBUF_ERROR_INVALID_ARGUMENT; break;
        }
        r.status = st;
        snprintf(r.detail, sizeof r.detail, "%s", p->detail);
        if (!peer_write_exact(p->sock, &r, sizeof r)) return 1;
        if (d) {
            cubuf_ipc_send(p->sock, d);
            cubuf_ipc_descriptor_destroy(d);
        }
    }
}

#endif
