/* IPC descriptor seeds: valid and malformed wire-format byte strings, each
 * with the fds to pass and the rule it breaks. Written from the format as
 * <cubuf/ipc.h> documents it, not from the library's encoder, so the seeds
 * check the documentation too. Shared by the seed corpus generator
 * (fuzz/gen_seeds.c), the fuzz target and tests/test_ipc_wire.c.
 * Header-only; needs _GNU_SOURCE (O_PATH). */
#ifndef CUBUF_IPC_SEEDS_H
#define CUBUF_IPC_SEEDS_H

#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "cubuf.h"

/* What fd a seed passes at its bad_fd index (every other fd is /dev/null). */
typedef enum seed_fd_kind {
    SEED_FD_DEVNULL = 0,   /* a character device: passes the kind checks */
    SEED_FD_FILE,          /* a regular file in the temporary directory */
    SEED_FD_DIR,           /* a directory */
    SEED_FD_PIPE,          /* a FIFO */
    SEED_FD_SOCKET,        /* a socket */
    SEED_FD_OPATH,         /* an O_PATH descriptor */
    SEED_FD_CLOSED,        /* a number that is not open */
    SEED_FD_NEGATIVE,      /* -1 */
    SEED_FD_REPEAT_FIRST,  /* the same number as fd 0 */
} seed_fd_kind_t;

typedef struct ipc_seed {
    char name[48];
    uint8_t *bytes;
    size_t len;
    size_t nfds;             /* fds passed along */
    int bad_fd;              /* index of the odd fd, or -1 */
    seed_fd_kind_t bad_kind;
    const char *expect;      /* NULL: valid; else a piece of the error detail */
} ipc_seed_t;

/* ---- writing the format ---- */

static inline void seed_put16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }
static inline void seed_put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline void seed_put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static inline void seed_header(uint8_t *p, uint16_t mechanism, uint32_t len, uint32_t nfds,
                               uint32_t flags, uint64_t size, uint64_t offset, uint64_t extent)
{
    memcpy(p, "CUBUFIPC", 8);
    seed_put16(p + 8, 1);
    seed_put16(p + 10, mechanism);
    seed_put32(p + 12, len);
    seed_put32(p + 16, nfds);
    seed_put32(p + 20, flags);
    seed_put64(p + 24, size);
    seed_put64(p + 32, offset);
    seed_put64(p + 40, extent);
}

#define SEED_MIB ((uint64_t)1 << 20)

/* A valid pool descriptor: 4 MiB allocation, a 1 MiB slice at 1 MiB. */
static inline void seed_pool(uint8_t *p, uint32_t flags)
{
    memset(p, 0, CUBUF_IPC_POOL_BYTES);
    seed_header(p, 1, CUBUF_IPC_POOL_BYTES, 1, flags, SEED_MIB, SEED_MIB, 4 * SEED_MIB);
    for (int i = 0; i < 16; i++) p[48 + i] = (uint8_t)(0xa0 + i); /* identity */
    seed_put32(p + 64, 1);                                         /* POSIX fd */
    for (int i = 0; i < 64; i++) p[72 + i] = (uint8_t)(i * 7 + 1); /* export data */
}

/* A valid legacy descriptor: 2 MiB allocation, 1000 bytes at offset 24. */
static inline void seed_legacy(uint8_t *p)
{
    memset(p, 0, CUBUF_IPC_LEGACY_BYTES);
    seed_header(p, 3, CUBUF_IPC_LEGACY_BYTES, 0, 0, 1000, 24, 2 * SEED_MIB);
    for (int i = 0; i < 64; i++) p[48 + i] = (uint8_t)(i * 3 + 5);
}

/* A valid VMM descriptor of `count` chunks of 2 MiB granularity; chunk i is
 * (i % 3 + 1) * 2 MiB; the buffer starts 2 MiB in and ends 2 MiB early
 * (whole buffer for one chunk). Returns the length. */
static inline size_t seed_vmm(uint8_t *p, uint32_t count)
{
    size_t len = CUBUF_IPC_VMM_BYTES(count);
    uint64_t g = 2 * SEED_MIB, extent = 0;
    memset(p, 0, len);
    for (uint32_t i = 0; i < count; i++) {
        uint64_t c = (i % 3 + 1) * g;
        seed_put64(p + 64 + 8 * (size_t)i, c);
        extent += c;
    }
    uint64_t off = count > 1 ? g : 0, size = count > 1 ? extent - 2 * g : extent;
    seed_header(p, 2, (uint32_t)len, count, 0, size, off, extent);
    seed_put32(p + 48, 1);
    seed_put32(p + 52, count);
    seed_put64(p + 56, g);
    return len;
}

/* ---- the seed list ---- */

typedef struct ipc_seed_list {
    ipc_seed_t *v;
    size_t n, cap;
} ipc_seed_list_t;

static inline ipc_seed_t *seed_add(ipc_seed_list_t *l, const char *name, const uint8_t *bytes,
                                   size_t len, size_t nfds, const char *expect)
{
    if (l->n == l->cap) {
        l->cap = l->cap ? 2 * l->cap : 64;
        l->v = (ipc_seed_t *)realloc(l->v, l->cap * sizeof *l->v);
        if (!l->v) abort();
    }
    ipc_seed_t *s = &l->v[l->n++];
    memset(s, 0, sizeof *s);
    snprintf(s->name, sizeof s->name, "%s", name);
    s->bytes = (uint8_t *)malloc(len ? len : 1);
    if (!s->bytes) abort();
    if (len) memcpy(s->bytes, bytes, len);
    s->len = len;
    s->nfds = nfds;
    s->bad_fd = -1;
    s->expect = expect;
    return s;
}

static inline void seed_add_fd(ipc_seed_list_t *l, const char *name, const uint8_t *bytes, size_t len,
                               size_t nfds, int bad_fd, seed_fd_kind_t kind, const char *expect)
{
    ipc_seed_t *s = seed_add(l, name, bytes, len, nfds, expect);
    s->bad_fd = bad_fd;
    s->bad_kind = kind;
}

/* Every valid seed and one malformed seed per rule of the wire format. */
static inline ipc_seed_list_t ipc_seeds_build(void)
{
    ipc_seed_list_t l = {0};
    static uint8_t b[CUBUF_IPC_MAX_BYTES + 16];
    size_t n;

    /* valid */
    seed_pool(b, 0);
    seed_add(&l, "valid_pool", b, CUBUF_IPC_POOL_BYTES, 1, NULL);
    seed_pool(b, 1);
    seed_add(&l, "valid_pool_pinned", b, CUBUF_IPC_POOL_BYTES, 1, NULL);
    seed_legacy(b);
    seed_add(&l, "valid_legacy", b, CUBUF_IPC_LEGACY_BYTES, 0, NULL);
    n = seed_vmm(b, 1);
    seed_add(&l, "valid_vmm_1", b, n, 1, NULL);
    n = seed_vmm(b, 3);
    seed_add(&l, "valid_vmm_3", b, n, 3, NULL);
    n = seed_vmm(b, 300);
    seed_add(&l, "valid_vmm_300", b, n, 300, NULL);

    /* framing */
    seed_add(&l, "empty", b, 0, 0, "truncated");
    seed_pool(b, 0);
    seed_add(&l, "truncated_header", b, 47, 1, "truncated");
    seed_add(&l, "truncated_body", b, CUBUF_IPC_POOL_BYTES - 1, 1, "truncated");
    memset(b + CUBUF_IPC_POOL_BYTES, 0, 8);
    seed_add(&l, "trailing_bytes", b, CUBUF_IPC_POOL_BYTES + 8, 1, "trailing");
    memset(b, 0, CUBUF_IPC_MAX_BYTES + 1);
    seed_header(b, 2, CUBUF_IPC_MAX_BYTES + 1, 0, 0, 1, 0, 1);
    seed_add(&l, "oversized", b, CUBUF_IPC_MAX_BYTES + 1, 0, "oversized");
    seed_pool(b, 0);
    b[3] ^= 0x20;
    seed_add(&l, "wrong_magic", b, CUBUF_IPC_POOL_BYTES, 1, "magic");
    seed_pool(b, 0);
    seed_put16(b + 8, 2);
    seed_add(&l, "version_2", b, CUBUF_IPC_POOL_BYTES, 1, "version");
    seed_put16(b + 8, 0);
    seed_add(&l, "version_0", b, CUBUF_IPC_POOL_BYTES, 1, "version");
    seed_pool(b, 0);
    seed_put16(b + 10, 0);
    seed_add(&l, "mechanism_0", b, CUBUF_IPC_POOL_BYTES, 1, "unknown mechanism");
    seed_put16(b + 10, 4);
    seed_add(&l, "mechanism_4", b, CUBUF_IPC_POOL_BYTES, 1, "unknown mechanism");
    seed_pool(b, 0);
    seed_put32(b + 12, CUBUF_IPC_POOL_BYTES + 100);
    seed_add(&l, "length_field_long", b, CUBUF_IPC_POOL_BYTES, 1, "truncated");
    seed_pool(b, 0);
    seed_add(&l, "fd_count_mismatch", b, CUBUF_IPC_POOL_BYTES, 0, "announces 1 fds");
    seed_legacy(b);
    seed_put16(b + 10, 1);
    seed_add(&l, "pool_with_legacy_length", b, CUBUF_IPC_LEGACY_BYTES, 0, "is 136 bytes");

    /* header fields */
    seed_pool(b, 0);
    seed_put32(b + 20, 2);
    seed_add(&l, "unknown_flag", b, CUBUF_IPC_POOL_BYTES, 1, "unknown flags");
    n = seed_vmm(b, 1);
    seed_put32(b + 20, 1);
    seed_add(&l, "host_flag_on_vmm", b, n, 1, "host-accessible flag");
    seed_pool(b, 0);
    seed_put64(b + 24, 0);
    seed_add(&l, "size_0", b, CUBUF_IPC_POOL_BYTES, 1, "size is 0");
    seed_pool(b, 0);
    seed_put64(b + 40, 0);
    seed_add(&l, "extent_0", b, CUBUF_IPC_POOL_BYTES, 1, "extent");
    seed_pool(b, 0);
    seed_put64(b + 24, 8 * SEED_MIB);
    seed_add(&l, "size_past_extent", b, CUBUF_IPC_POOL_BYTES, 1, "larger than the mapped extent");
    seed_pool(b, 0);
    seed_put64(b + 32, 3 * SEED_MIB + 1);
    seed_add(&l, "offset_past_extent", b, CUBUF_IPC_POOL_BYTES, 1, "past the extent");
    seed_put64(b + 32, UINT64_MAX);
    seed_add(&l, "offset_wraps", b, CUBUF_IPC_POOL_BYTES, 1, "past the extent");
    seed_pool(b, 0);
    seed_put64(b + 24, CUBUF_IPC_MAX_EXTENT + 1);
    seed_put64(b + 40, CUBUF_IPC_MAX_EXTENT + 1);
    seed_add(&l, "size_over_bound", b, CUBUF_IPC_POOL_BYTES, 1, "over the bound");

    /* pool body */
    seed_pool(b, 0);
    seed_put32(b + 64, 2);
    seed_add(&l, "pool_handle_type", b, CUBUF_IPC_POOL_BYTES, 1, "handle type");
    seed_pool(b, 0);
    seed_put32(b + 68, 1);
    seed_add(&l, "pool_reserved", b, CUBUF_IPC_POOL_BYTES, 1, "reserved");
    seed_pool(b, 0);
    memset(b + 48, 0, 16);
    seed_add(&l, "pool_zero_identity", b, CUBUF_IPC_POOL_BYTES, 1, "identity");
    seed_pool(b, 0);
    seed_put32(b + 16, 2);
    seed_add(&l, "pool_two_fds", b, CUBUF_IPC_POOL_BYTES, 2, "carry 1 fd");

    /* legacy body */
    seed_legacy(b);
    seed_put32(b + 16, 1);
    seed_add(&l, "legacy_with_fd", b, CUBUF_IPC_LEGACY_BYTES, 1, "no fd");
    seed_legacy(b);
    memset(b + 48, 0, 64);
    seed_add(&l, "legacy_zero_handle", b, CUBUF_IPC_LEGACY_BYTES, 0, "all zero");

    /* VMM body */
    n = seed_vmm(b, 3);
    seed_put32(b + 48, 2);
    seed_add(&l, "vmm_handle_type", b, n, 3, "handle type");
    n = seed_vmm(b, 3);
    seed_put32(b + 52, 0);
    seed_add(&l, "vmm_count_0", b, n, 3, "chunk count");
    seed_put32(b + 52, CUBUF_IPC_MAX_CHUNKS + 1);
    seed_add(&l, "vmm_count_over_bound", b, n, 3, "chunk count");
    seed_put32(b + 52, 4);
    seed_add(&l, "vmm_count_vs_length", b, n, 3, "of that chunk count");
    n = seed_vmm(b, 3);
    seed_put32(b + 16, 2);
    seed_add(&l, "vmm_fds_vs_chunks", b, n, 2, "one fd per chunk");
    n = seed_vmm(b, 3);
    seed_put64(b + 56, 0);
    seed_add(&l, "vmm_granularity_0", b, n, 3, "granularity");
    seed_put64(b + 56, 3 * SEED_MIB);
    seed_add(&l, "vmm_granularity_not_pow2", b, n, 3, "granularity");
    seed_put64(b + 56, 2048);
    seed_add(&l, "vmm_granularity_small", b, n, 3, "granularity");
    seed_put64(b + 56, (uint64_t)1 << 31);
    seed_add(&l, "vmm_granularity_large", b, n, 3, "granularity");
    n = seed_vmm(b, 3);
    seed_put64(b + 64 + 8, 0);
    seed_add(&l, "vmm_chunk_0", b, n, 3, "chunk 2 of 3 has size 0");
    n = seed_vmm(b, 3);
    seed_put64(b + 64 + 8, 4 * SEED_MIB + 4096);
    seed_add(&l, "vmm_chunk_not_multiple", b, n, 3, "not a multiple of the granularity");
    n = seed_vmm(b, 3);
    seed_put64(b + 64 + 16, 64 * SEED_MIB);
    seed_add(&l, "vmm_chunk_past_extent", b, n, 3, "larger than the mapped extent");
    n = seed_vmm(b, 3);
    seed_put64(b + 64, 4 * SEED_MIB);
    seed_add(&l, "vmm_chunks_sum_long", b, n, 3, "add up");
    n = seed_vmm(b, 3);
    seed_put64(b + 64 + 16, 2 * SEED_MIB);
    seed_add(&l, "vmm_chunks_sum_short", b, n, 3, "add up");
    {
        /* chunks whose sum would overflow 64 bits if nothing bounded them */
        uint32_t c = CUBUF_IPC_MAX_CHUNKS;
        n = CUBUF_IPC_VMM_BYTES(c);
        memset(b, 0, n);
        seed_header(b, 2, (uint32_t)n, c, 0, 1, 0, CUBUF_IPC_MAX_EXTENT);
        seed_put32(b + 48, 1);
        seed_put32(b + 52, c);
        seed_put64(b + 56, 2 * SEED_MIB);
        for (uint32_t i = 0; i < c; i++) seed_put64(b + 64 + 8 * (size_t)i, (uint64_t)1 << 62);
        seed_add(&l, "vmm_chunks_huge", b, n, c, "larger than the mapped extent");
    }

    /* fds */
    n = seed_vmm(b, 3);
    seed_add_fd(&l, "fd_negative", b, n, 3, 1, SEED_FD_NEGATIVE, "chunk 2 of 3 is negative");
    seed_add_fd(&l, "fd_repeated", b, n, 3, 2, SEED_FD_REPEAT_FIRST, "distinct");
    seed_add_fd(&l, "fd_closed", b, n, 3, 2, SEED_FD_CLOSED, "chunk 3 of 3");
    seed_add_fd(&l, "fd_regular_file", b, n, 3, 1, SEED_FD_FILE, "not a CUDA handle");
    seed_add_fd(&l, "fd_directory", b, n, 3, 0, SEED_FD_DIR, "a directory");
    seed_add_fd(&l, "fd_pipe", b, n, 3, 1, SEED_FD_PIPE, "a FIFO");
    seed_add_fd(&l, "fd_socket", b, n, 3, 1, SEED_FD_SOCKET, "a socket");
    seed_add_fd(&l, "fd_opath", b, n, 3, 2, SEED_FD_OPATH, "O_PATH");
    seed_pool(b, 0);
    seed_add_fd(&l, "pool_fd_file", b, CUBUF_IPC_POOL_BYTES, 1, 0, SEED_FD_FILE, "pool fd");
    return l;
}

static inline void ipc_seeds_free(ipc_seed_list_t *l)
{
    for (size_t i = 0; i < l->n; i++) free(l->v[i].bytes);
    free(l->v);
    l->v = NULL;
    l->n = l->cap = 0;
}

/* ---- fds for a seed ---- */

/* Opens one fd of `kind` (the odd ones); -1 for SEED_FD_NEGATIVE. */
static inline int seed_open_kind(seed_fd_kind_t kind, int first)
{
    switch (kind) {
    case SEED_FD_DEVNULL: return open("/dev/null", O_RDWR | O_CLOEXEC);
    case SEED_FD_FILE: {
        char path[] = "/tmp/cubuf-seed-XXXXXX";
        int fd = mkstemp(path);
        if (fd >= 0) unlink(path);
        return fd;
    }
    case SEED_FD_DIR: return open("/tmp", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    case SEED_FD_PIPE: {
        int p[2];
        if (pipe(p) != 0) return -1;
        close(p[1]);
        return p[0];
    }
    case SEED_FD_SOCKET: {
        int sv[2];
        if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) return -1;
        close(sv[1]);
        return sv[0];
    }
    case SEED_FD_OPATH: return open("/dev/null", O_PATH | O_CLOEXEC);
    case SEED_FD_CLOSED: {
        int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
        if (fd >= 0) close(fd);
        return fd; /* closed again: not open while the seed is checked */
    }
    case SEED_FD_NEGATIVE: return -1;
    case SEED_FD_REPEAT_FIRST: return first;
    }
    return -1;
}

/* Fills fds[0..nfds) for seed s. owned[i] tells which entries the caller
 * must close (the closed, negative and repeated ones are not owned). */
static inline int seed_open_fds(const ipc_seed_t *s, int *fds, unsigned char *owned)
{
    for (size_t i = 0; i < s->nfds; i++) {
        seed_fd_kind_t k = (int)i == s->bad_fd ? s->bad_kind : SEED_FD_DEVNULL;
        int first = i ? fds[0] : -1;
        fds[i] = seed_open_kind(k, first);
        owned[i] = k != SEED_FD_CLOSED && k != SEED_FD_NEGATIVE && k != SEED_FD_REPEAT_FIRST;
        if (owned[i] && fds[i] < 0) return -1;
    }
    return 0;
}

static inline void seed_close_fds(const int *fds, const unsigned char *owned, size_t nfds)
{
    for (size_t i = 0; i < nfds; i++)
        if (owned[i] && fds[i] >= 0) close(fds[i]);
}

#endif
