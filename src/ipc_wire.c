/* IPC descriptors as bytes and fds: the wire format, its validation, and
 * passing descriptors over Unix-domain sockets. No driver call is made here,
 * so the fuzzer and the wire test run on any machine. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ipc.h"

static const uint8_t wire_magic[8] = {'C', 'U', 'B', 'U', 'F', 'I', 'P', 'C'};

/* Field offsets of the wire format (see <cubuf/ipc.h>). */
enum {
    W_MAGIC = 0, W_VERSION = 8, W_MECHANISM = 10, W_LENGTH = 12, W_NFDS = 16, W_FLAGS = 20,
    W_SIZE = 24, W_OFFSET = 32, W_EXTENT = 40,
    W_POOL_ID = 48, W_POOL_HANDLE_TYPE = 64, W_POOL_RESERVED = 68, W_POOL_EXPORT = 72,
    W_VMM_HANDLE_TYPE = 48, W_VMM_COUNT = 52, W_VMM_GRANULARITY = 56, W_VMM_CHUNKS = 64,
    W_LEGACY_HANDLE = 48,
};

/* ---- little-endian fields ---- */

static void put16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}
static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint16_t get16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static uint32_t get32(const uint8_t *p)
{
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}
static uint64_t get64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

static bool all_zero(const uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (p[i]) return false;
    return true;
}

/* ---- descriptors ---- */

cubuf_status_t cubuf__ipc_desc_new(cubuf_ipc_mechanism_t mechanism, size_t nfds,
                                   cubuf_ipc_descriptor_t **out)
{
    cubuf_ipc_descriptor_t *d = cubuf__calloc(1, sizeof *d);
    if (!d) goto oom;
    d->mechanism = mechanism;
    d->handle_type = mechanism == CUBUF_IPC_MECHANISM_LEGACY ? 0 : CUBUF__IPC_HANDLE_POSIX_FD;
    if (nfds) {
        d->fds = cubuf__malloc(nfds * sizeof *d->fds);
        if (!d->fds) goto oom;
        for (size_t i = 0; i < nfds; i++) d->fds[i] = -1;
        d->nfds = nfds;
    }
    if (mechanism == CUBUF_IPC_MECHANISM_VMM && nfds) {
        d->chunk_sizes = cubuf__calloc(nfds, sizeof *d->chunk_sizes);
        if (!d->chunk_sizes) goto oom;
        d->nchunks = nfds;
    }
    *out = d;
    return CUBUF_SUCCESS;
oom:
    if (d) {
        free(d->fds);
        free(d);
    }
    return cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "cannot allocate an IPC descriptor of %zu fds", nfds);
}

cubuf_status_t cubuf__ipc_desc_new_fabric(size_t nchunks, cubuf_ipc_descriptor_t **out)
{
    cubuf_ipc_descriptor_t *d = NULL;
    cubuf_status_t st = cubuf__ipc_desc_new(CUBUF_IPC_MECHANISM_VMM, 0, &d);
    if (st != CUBUF_SUCCESS) return st;
    d->handle_type = CUBUF__IPC_HANDLE_FABRIC;
    if (nchunks) {
        d->chunk_sizes = cubuf__calloc(nchunks, sizeof *d->chunk_sizes);
        d->fabric_handles = cubuf__calloc(nchunks, CUBUF__IPC_FABRIC_HANDLE_BYTES);
        if (!d->chunk_sizes || !d->fabric_handles) {
            cubuf_ipc_descriptor_destroy(d);
            return cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY,
                               "cannot allocate an IPC descriptor of %zu fabric handles", nchunks);
        }
        d->nchunks = nchunks;
    }
    *out = d;
    return CUBUF_SUCCESS;
}

void cubuf_ipc_descriptor_destroy(cubuf_ipc_descriptor_t *desc)
{
    if (!desc) return;
    for (size_t i = 0; i < desc->nfds; i++)
        if (desc->fds[i] >= 0) close(desc->fds[i]);
    free(desc->fds);
    free(desc->chunk_sizes);
    free(desc->fabric_handles);
    free(desc);
}

cubuf_status_t cubuf_ipc_descriptor_info(const cubuf_ipc_descriptor_t *desc,
                                         cubuf_ipc_descriptor_info_t *info)
{
    CHECK_ARG(desc && info, "cubuf_ipc_descriptor_info: NULL argument");
    cubuf_status_t st = cubuf__struct_check("cubuf_ipc_descriptor_info",
                                            "cubuf_ipc_descriptor_info_t", info->struct_size,
                                            CUBUF_IPC_DESCRIPTOR_INFO_SIZE_V1, sizeof *info);
    if (st != CUBUF_SUCCESS) return st;
    cubuf_ipc_descriptor_info_t d = CUBUF_IPC_DESCRIPTOR_INFO_INIT;
    d.mechanism = desc->mechanism;
    d.size = desc->size;
    d.offset = desc->offset;
    d.extent = desc->extent;
    d.fd_count = desc->nfds;
    d.chunk_count = desc->nchunks;
    d.host_accessible = (desc->flags & CUBUF__IPC_FLAG_HOST_ACCESSIBLE) != 0;
    cubuf__struct_out(info, &d, sizeof d);
    return CUBUF_SUCCESS;
}

/* ---- validation ---- */

static cubuf_status_t bad(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static cubuf_status_t bad(const char *fmt, ...)
{
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return cubuf__fail(CUBUF_ERROR_INVALID_DESCRIPTOR, "IPC descriptor: %s", msg);
}

static const char *mechanism_name(cubuf_ipc_mechanism_t m)
{
    switch (m) {
    case CUBUF_IPC_MECHANISM_POOL: return "pool";
    case CUBUF_IPC_MECHANISM_VMM: return "vmm";
    case CUBUF_IPC_MECHANISM_LEGACY: return "legacy";
    }
    return "unknown";
}

static cubuf_status_t check_vmm_fields(const cubuf_ipc_descriptor_t *d)
{
    bool fabric = d->handle_type == CUBUF__IPC_HANDLE_FABRIC;
    if (d->handle_type != CUBUF__IPC_HANDLE_POSIX_FD && !fabric)
        return bad("handle type %u is neither 1 (POSIX file descriptor) nor 8 (fabric)",
                   d->handle_type);
    if (d->nchunks == 0 || d->nchunks > CUBUF_IPC_MAX_CHUNKS)
        return bad("chunk count %zu is outside 1..%d", d->nchunks, CUBUF_IPC_MAX_CHUNKS);
    if (fabric && d->nfds != 0)
        return bad("%zu fds with fabric handles: a fabric-handle descriptor carries none", d->nfds);
    if (!fabric && d->nfds != d->nchunks)
        return bad("%zu fds for %zu chunks: one fd per chunk is needed", d->nfds, d->nchunks);
    for (size_t i = 0; fabric && i < d->nchunks; i++)
        if (!d->fabric_handles ||
            all_zero(d->fabric_handles + CUBUF__IPC_FABRIC_HANDLE_BYTES * i, CUBUF__IPC_FABRIC_HANDLE_BYTES))
            return bad("the fabric handle of chunk %zu of %zu is all zero", i + 1, d->nchunks);
    uint64_t g = d->granularity;
    if (g < CUBUF_IPC_MIN_GRANULARITY || g > CUBUF_IPC_MAX_GRANULARITY || (g & (g - 1)))
        return bad("granularity %llu is not a power of two in %llu..%llu", (unsigned long long)g,
                   (unsigned long long)CUBUF_IPC_MIN_GRANULARITY,
                   (unsigned long long)CUBUF_IPC_MAX_GRANULARITY);
    uint64_t sum = 0; /* at most 1024 chunks of at most 2^44 bytes: no overflow */
    for (size_t i = 0; i < d->nchunks; i++) {
        uint64_t c = d->chunk_sizes[i];
        if (c == 0) return bad("chunk %zu of %zu has size 0", i + 1, d->nchunks);
        if (c % g)
            return bad("chunk %zu of %zu: size %llu is not a multiple of the granularity %llu", i + 1,
                       d->nchunks, (unsigned long long)c, (unsigned long long)g);
        if (c > d->extent)
            return bad("chunk %zu of %zu: size %llu is larger than the mapped extent %llu", i + 1,
                       d->nchunks, (unsigned long long)c, (unsigned long long)d->extent);
        sum += c;
    }
    if (sum != d->extent)
        return bad("the chunks add up to %llu bytes, not the extent %llu", (unsigned long long)sum,
                   (unsigned long long)d->extent);
    return CUBUF_SUCCESS;
}

/* The rules on fields (not fds). */
static cubuf_status_t check_fields(const cubuf_ipc_descriptor_t *d)
{
    if (d->mechanism < CUBUF_IPC_MECHANISM_POOL || d->mechanism > CUBUF_IPC_MECHANISM_LEGACY)
        return bad("unknown mechanism %d", (int)d->mechanism);
    if (d->flags & ~(uint32_t)CUBUF__IPC_KNOWN_FLAGS) return bad("unknown flags 0x%x", d->flags);
    if ((d->flags & CUBUF__IPC_FLAG_HOST_ACCESSIBLE) && d->mechanism != CUBUF_IPC_MECHANISM_POOL)
        return bad("the host-accessible flag is only valid for pool memory");
    if (d->size == 0) return bad("size is 0");
    if (d->size > CUBUF_IPC_MAX_EXTENT || d->extent > CUBUF_IPC_MAX_EXTENT)
        return bad("size %llu or extent %llu is over the bound %llu", (unsigned long long)d->size,
                   (unsigned long long)d->extent, (unsigned long long)CUBUF_IPC_MAX_EXTENT);
    if (d->extent == 0) return bad("extent is 0");
    if (d->size > d->extent)
        return bad("size %llu is larger than the mapped extent %llu", (unsigned long long)d->size,
                   (unsigned long long)d->extent);
    if (d->offset > d->extent - d->size)
        return bad("offset %llu + size %llu is past the extent %llu", (unsigned long long)d->offset,
                   (unsigned long long)d->size, (unsigned long long)d->extent);
    switch (d->mechanism) {
    case CUBUF_IPC_MECHANISM_POOL:
        if (d->handle_type != CUBUF__IPC_HANDLE_POSIX_FD)
            return bad("handle type %u is not 1 (POSIX file descriptor)", d->handle_type);
        if (d->nfds != 1) return bad("pool descriptors carry 1 fd, not %zu", d->nfds);
        if (all_zero(d->pool_id, sizeof d->pool_id)) return bad("the pool identity is all zero");
        return CUBUF_SUCCESS;
    case CUBUF_IPC_MECHANISM_LEGACY:
        if (d->nfds != 0) return bad("legacy descriptors carry no fd, not %zu", d->nfds);
        if (all_zero(d->ipc_handle, sizeof d->ipc_handle)) return bad("the IPC handle is all zero");
        return CUBUF_SUCCESS;
    case CUBUF_IPC_MECHANISM_VMM: return check_vmm_fields(d);
    }
    return bad("unknown mechanism %d", (int)d->mechanism);
}

/* Names fd i for messages: "fd of chunk 2 of 3" or "pool fd". */
static void fd_name(char *out, size_t n, cubuf_ipc_mechanism_t m, size_t i, size_t count)
{
    if (m == CUBUF_IPC_MECHANISM_VMM)
        snprintf(out, n, "fd of chunk %zu of %zu", i + 1, count);
    else
        snprintf(out, n, "pool fd");
}

static bool has_prefix(const char *s, const char *prefix) { return strncmp(s, prefix, strlen(prefix)) == 0; }

/* A CUDA handle is a character device, an anonymous inode or a similar
 * kernel object. Refuse what it can never be; the driver judges the rest. */
static cubuf_status_t check_fd_kind(int fd, const char *name)
{
    int fl = fcntl(fd, F_GETFL);
    if (fl == -1) return bad("%s (%d) is not an open file descriptor", name, fd);
    if (fl & O_PATH) return bad("%s (%d) is an O_PATH descriptor, not a CUDA handle", name, fd);
    struct stat s;
    if (fstat(fd, &s) != 0) return bad("%s (%d) cannot be examined: %s", name, fd, strerror(errno));
    const char *kind = S_ISDIR(s.st_mode)    ? "a directory"
                       : S_ISFIFO(s.st_mode) ? "a FIFO"
                       : S_ISSOCK(s.st_mode) ? "a socket"
                       : S_ISBLK(s.st_mode)  ? "a block device"
                       : S_ISLNK(s.st_mode)  ? "a symbolic link"
                                             : NULL;
    if (kind) return bad("%s (%d) is %s, not a CUDA handle", name, fd, kind);
    if (!S_ISREG(s.st_mode)) return CUBUF_SUCCESS;
    /* Anonymous kernel files may read as regular files; a file with a path
     * on a filesystem cannot be a CUDA handle. */
    char link[64], target[256];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, target, sizeof target - 1);
    if (n <= 0) return CUBUF_SUCCESS; /* cannot tell */
    target[n] = '\0';
    if (target[0] == '/' && !has_prefix(target, "/dev/") && !has_prefix(target, "/memfd:") &&
        !has_prefix(target, "/dmabuf:"))
        return bad("%s (%d) is the file %s, not a CUDA handle", name, fd, target);
    return CUBUF_SUCCESS;
}

static cubuf_status_t check_fds(cubuf_ipc_mechanism_t m, const int *fds, size_t nfds)
{
    char name[64];
    for (size_t i = 0; i < nfds; i++) {
        fd_name(name, sizeof name, m, i, nfds);
        if (fds[i] < 0) return bad("%s is negative (%d)", name, fds[i]);
        for (size_t j = 0; j < i; j++)
            if (fds[j] == fds[i])
                return bad("%s (%d) is also the fd of chunk %zu: every fd must be distinct", name,
                           fds[i], j + 1);
        cubuf_status_t st = check_fd_kind(fds[i], name);
        if (st != CUBUF_SUCCESS) return st;
    }
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf__ipc_desc_validate(const cubuf_ipc_descriptor_t *desc)
{
    cubuf_status_t st = check_fields(desc);
    if (st == CUBUF_SUCCESS) st = check_fds(desc->mechanism, desc->fds, desc->nfds);
    return st;
}

/* ---- bytes ---- */

static size_t wire_length(const cubuf_ipc_descriptor_t *d)
{
    switch (d->mechanism) {
    case CUBUF_IPC_MECHANISM_POOL: return CUBUF_IPC_POOL_BYTES;
    case CUBUF_IPC_MECHANISM_VMM:
        return d->handle_type == CUBUF__IPC_HANDLE_FABRIC ? CUBUF_IPC_VMM_FABRIC_BYTES(d->nchunks)
                                                          : CUBUF_IPC_VMM_BYTES(d->nchunks);
    case CUBUF_IPC_MECHANISM_LEGACY: return CUBUF_IPC_LEGACY_BYTES;
    }
    return 0;
}

static void encode(const cubuf_ipc_descriptor_t *d, uint8_t *p, size_t len)
{
    memset(p, 0, len);
    memcpy(p + W_MAGIC, wire_magic, sizeof wire_magic);
    put16(p + W_VERSION, CUBUF_IPC_WIRE_VERSION);
    put16(p + W_MECHANISM, (uint16_t)d->mechanism);
    put32(p + W_LENGTH, (uint32_t)len);
    put32(p + W_NFDS, (uint32_t)d->nfds);
    put32(p + W_FLAGS, d->flags);
    put64(p + W_SIZE, d->size);
    put64(p + W_OFFSET, d->offset);
    put64(p + W_EXTENT, d->extent);
    switch (d->mechanism) {
    case CUBUF_IPC_MECHANISM_POOL:
        memcpy(p + W_POOL_ID, d->pool_id, sizeof d->pool_id);
        put32(p + W_POOL_HANDLE_TYPE, d->handle_type);
        memcpy(p + W_POOL_EXPORT, d->export_data, sizeof d->export_data);
        break;
    case CUBUF_IPC_MECHANISM_VMM:
        put32(p + W_VMM_HANDLE_TYPE, d->handle_type);
        put32(p + W_VMM_COUNT, (uint32_t)d->nchunks);
        put64(p + W_VMM_GRANULARITY, d->granularity);
        for (size_t i = 0; i < d->nchunks; i++) put64(p + W_VMM_CHUNKS + 8 * i, d->chunk_sizes[i]);
        if (d->handle_type == CUBUF__IPC_HANDLE_FABRIC)
            memcpy(p + W_VMM_CHUNKS + 8 * d->nchunks, d->fabric_handles,
                   CUBUF__IPC_FABRIC_HANDLE_BYTES * d->nchunks);
        break;
    case CUBUF_IPC_MECHANISM_LEGACY:
        memcpy(p + W_LEGACY_HANDLE, d->ipc_handle, sizeof d->ipc_handle);
        break;
    }
}

cubuf_status_t cubuf_ipc_descriptor_serialize(const cubuf_ipc_descriptor_t *desc, void *bytes,
                                              size_t *len, int *fds, size_t *nfds)
{
    CHECK_ARG(desc && len && nfds, "cubuf_ipc_descriptor_serialize: NULL argument");
    size_t need = wire_length(desc);
    if (!bytes && !fds) {
        *len = need;
        *nfds = desc->nfds;
        return CUBUF_SUCCESS;
    }
    CHECK_ARG(bytes, "cubuf_ipc_descriptor_serialize: bytes is NULL (pass both NULL to query)");
    if (*len < need || *nfds < desc->nfds || (desc->nfds && !fds))
        return cubuf__fail(CUBUF_ERROR_OUT_OF_RANGE,
                           "cubuf_ipc_descriptor_serialize: needs %zu bytes and %zu fds, got room "
                           "for %zu bytes and %zu fds",
                           need, desc->nfds, *len, fds ? *nfds : 0);
    encode(desc, bytes, need);
    if (desc->nfds) memcpy(fds, desc->fds, desc->nfds * sizeof *fds);
    *len = need;
    *nfds = desc->nfds;
    return CUBUF_SUCCESS;
}

/* Reads the header's fixed fields; every length and count is checked
 * against the real input before anything is read past the header. */
static cubuf_status_t decode_header(const uint8_t *p, size_t len, size_t nfds,
                                    cubuf_ipc_descriptor_t *d, size_t *count)
{
    if (len < CUBUF_IPC_HEADER_BYTES)
        return bad("truncated: %zu bytes, the header alone is %d", len, CUBUF_IPC_HEADER_BYTES);
    if (len > CUBUF_IPC_MAX_BYTES)
        return bad("oversized: %zu bytes, at most %zu", len, (size_t)CUBUF_IPC_MAX_BYTES);
    if (memcmp(p + W_MAGIC, wire_magic, sizeof wire_magic) != 0) return bad("wrong magic");
    unsigned version = get16(p + W_VERSION);
    if (version != CUBUF_IPC_WIRE_VERSION)
        return bad("version %u is not supported (this cubuf reads version %d)", version,
                   CUBUF_IPC_WIRE_VERSION);
    unsigned m = get16(p + W_MECHANISM);
    if (m < CUBUF_IPC_MECHANISM_POOL || m > CUBUF_IPC_MECHANISM_LEGACY)
        return bad("unknown mechanism %u", m);
    d->mechanism = (cubuf_ipc_mechanism_t)m;
    uint32_t announced = get32(p + W_LENGTH);
    if (announced > len) return bad("truncated: the header announces %u bytes, got %zu", announced, len);
    if (announced < len) return bad("%zu trailing bytes after the %u announced", len - announced, announced);
    uint32_t announced_fds = get32(p + W_NFDS);
    if (announced_fds != nfds) return bad("the header announces %u fds, got %zu", announced_fds, nfds);
    d->flags = get32(p + W_FLAGS);
    d->size = get64(p + W_SIZE);
    d->offset = get64(p + W_OFFSET);
    d->extent = get64(p + W_EXTENT);
    size_t expected = 0;
    *count = 0;
    switch (d->mechanism) {
    case CUBUF_IPC_MECHANISM_POOL: expected = CUBUF_IPC_POOL_BYTES; break;
    case CUBUF_IPC_MECHANISM_LEGACY: expected = CUBUF_IPC_LEGACY_BYTES; break;
    case CUBUF_IPC_MECHANISM_VMM:
        if (len < W_VMM_CHUNKS) return bad("truncated: %zu bytes, a vmm header is %d", len, W_VMM_CHUNKS);
        *count = get32(p + W_VMM_COUNT);
        if (*count == 0 || *count > CUBUF_IPC_MAX_CHUNKS)
            return bad("chunk count %zu is outside 1..%d", *count, CUBUF_IPC_MAX_CHUNKS);
        expected = get32(p + W_VMM_HANDLE_TYPE) == CUBUF__IPC_HANDLE_FABRIC
                       ? CUBUF_IPC_VMM_FABRIC_BYTES(*count)
                       : CUBUF_IPC_VMM_BYTES(*count);
        break;
    }
    if (len != expected)
        return bad("a %s descriptor%s is %zu bytes, got %zu", mechanism_name(d->mechanism),
                   d->mechanism == CUBUF_IPC_MECHANISM_VMM ? " of that chunk count" : "", expected,
                   len);
    return CUBUF_SUCCESS;
}

static cubuf_status_t decode_body(const uint8_t *p, cubuf_ipc_descriptor_t *d)
{
    switch (d->mechanism) {
    case CUBUF_IPC_MECHANISM_POOL:
        if (get32(p + W_POOL_RESERVED) != 0)
            return bad("the reserved field at byte %d is 0x%x, not 0", W_POOL_RESERVED,
                       get32(p + W_POOL_RESERVED));
        memcpy(d->pool_id, p + W_POOL_ID, sizeof d->pool_id);
        d->handle_type = get32(p + W_POOL_HANDLE_TYPE);
        memcpy(d->export_data, p + W_POOL_EXPORT, sizeof d->export_data);
        break;
    case CUBUF_IPC_MECHANISM_VMM:
        d->handle_type = get32(p + W_VMM_HANDLE_TYPE);
        d->granularity = get64(p + W_VMM_GRANULARITY);
        for (size_t i = 0; i < d->nchunks; i++) d->chunk_sizes[i] = get64(p + W_VMM_CHUNKS + 8 * i);
        if (d->fabric_handles)
            memcpy(d->fabric_handles, p + W_VMM_CHUNKS + 8 * d->nchunks,
                   CUBUF__IPC_FABRIC_HANDLE_BYTES * d->nchunks);
        break;
    case CUBUF_IPC_MECHANISM_LEGACY:
        memcpy(d->ipc_handle, p + W_LEGACY_HANDLE, sizeof d->ipc_handle);
        break;
    }
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf_ipc_descriptor_deserialize(const void *bytes, size_t len, const int *fds,
                                                size_t nfds, cubuf_ipc_descriptor_t **out)
{
    CHECK_ARG(out, "cubuf_ipc_descriptor_deserialize: out is NULL");
    CHECK_ARG(bytes || len == 0, "cubuf_ipc_descriptor_deserialize: bytes is NULL with length %zu", len);
    CHECK_ARG(fds || nfds == 0, "cubuf_ipc_descriptor_deserialize: fds is NULL with count %zu", nfds);
    const uint8_t *p = bytes;
    cubuf_ipc_descriptor_t head = {0};
    size_t count = 0;
    cubuf_status_t st = decode_header(p, len, nfds, &head, &count);
    if (st != CUBUF_SUCCESS) return st;
    if (nfds > CUBUF_IPC_MAX_FDS) return bad("%zu fds, at most %d", nfds, CUBUF_IPC_MAX_FDS);
    bool fabric = head.mechanism == CUBUF_IPC_MECHANISM_VMM &&
                  get32(p + W_VMM_HANDLE_TYPE) == CUBUF__IPC_HANDLE_FABRIC;
    if (fabric && nfds != 0)
        return bad("%zu fds with fabric handles: a fabric-handle descriptor carries none", nfds);
    if (head.mechanism == CUBUF_IPC_MECHANISM_VMM && !fabric && nfds != count)
        return bad("%zu fds for %zu chunks: one fd per chunk is needed", nfds, count);
    /* Room for the chunk table; the fds are copied in only once all is valid. */
    cubuf_ipc_descriptor_t *d = NULL;
    st = fabric ? cubuf__ipc_desc_new_fabric(count, &d) : cubuf__ipc_desc_new(head.mechanism, nfds, &d);
    if (st != CUBUF_SUCCESS) return st;
    d->flags = head.flags;
    d->size = head.size;
    d->offset = head.offset;
    d->extent = head.extent;
    st = decode_body(p, d);
    if (st == CUBUF_SUCCESS) st = check_fields(d);
    if (st == CUBUF_SUCCESS) st = check_fds(d->mechanism, fds, nfds);
    if (st != CUBUF_SUCCESS) {
        cubuf_ipc_descriptor_destroy(d); /* its fd slots are still -1: the caller's fds stay open */
        return st;
    }
    if (nfds) memcpy(d->fds, fds, nfds * sizeof *fds);
    *out = d;
    return CUBUF_SUCCESS;
}

/* ---- sockets ---- */

/* The kernel's limit per SCM_RIGHTS message is 253 (SCM_MAX_FD). */
#define CMSG_FDS_MAX 253

/* Room for the most fds a message carries and for the credentials
 * (SCM_CREDENTIALS) a receiving socket with SO_PASSCRED gets besides them. */
typedef union {
    struct cmsghdr align;
    char buf[CMSG_SPACE(sizeof(int) * CMSG_FDS_MAX) + CMSG_SPACE(sizeof(struct ucred))];
} fd_cmsg_t;

static cubuf_status_t send_piece(int sock, const uint8_t *p, size_t len, const int *fds, size_t nfds)
{
    fd_cmsg_t cm;
    size_t sent = 0;
    while (sent < len) {
        struct iovec iov = {(void *)(p + sent), len - sent};
        struct msghdr m = {0};
        m.msg_iov = &iov;
        m.msg_iovlen = 1;
        if (nfds && sent == 0) { /* fds ride on the first byte of the piece */
            memset(&cm, 0, sizeof cm);
            m.msg_control = cm.buf;
            m.msg_controllen = CMSG_SPACE(nfds * sizeof(int));
            struct cmsghdr *c = CMSG_FIRSTHDR(&m);
            c->cmsg_level = SOL_SOCKET;
            c->cmsg_type = SCM_RIGHTS;
            c->cmsg_len = CMSG_LEN(nfds * sizeof(int));
            memcpy(CMSG_DATA(c), fds, nfds * sizeof(int));
        }
        ssize_t r = sendmsg(sock, &m, MSG_NOSIGNAL);
        if (r < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                struct pollfd pfd = {sock, POLLOUT, 0};
                (void)poll(&pfd, 1, -1);
                continue;
            }
            int e = errno;
            return cubuf__fail(CUBUF_ERROR_SYSTEM, "cubuf_ipc_send: sendmsg failed: %s (errno %d)",
                               strerror(e), e);
        }
        sent += (size_t)r;
    }
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf_ipc_send(int socket, const cubuf_ipc_descriptor_t *desc)
{
    CHECK_ARG(desc, "cubuf_ipc_send: desc is NULL");
    CHECK_ARG(socket >= 0, "cubuf_ipc_send: socket %d is not a file descriptor", socket);
    size_t len = wire_length(desc);
    uint8_t *bytes = cubuf__malloc(len);
    if (!bytes) return cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "cubuf_ipc_send: no memory for %zu bytes", len);
    encode(desc, bytes, len);
    /* More fds than one message carries: the header travels with the first
     * group, one byte with each middle group, the rest of the bytes with the
     * last. The receiver just reads bytes and gathers every fd. */
    size_t per = CUBUF_IPC_FDS_PER_MESSAGE;
    size_t groups = desc->nfds > per ? (desc->nfds + per - 1) / per : 1;
    size_t pos = 0;
    cubuf_status_t st = CUBUF_SUCCESS;
    for (size_t g = 0; g < groups && st == CUBUF_SUCCESS; g++) {
        size_t piece = groups == 1 ? len
                       : g == 0    ? CUBUF_IPC_HEADER_BYTES
                       : g + 1 < groups ? 1
                                        : len - pos;
        size_t first = g * per;
        size_t nf = desc->nfds > first ? desc->nfds - first : 0;
        if (nf > per) nf = per;
        st = send_piece(socket, bytes + pos, piece, nf ? desc->fds + first : NULL, nf);
        pos += piece;
    }
    free(bytes);
    return st;
}

typedef struct fd_list {
    int *v;
    size_t n, cap;
    bool overflow; /* more fds than any descriptor may carry */
    bool truncated; /* the kernel dropped fds (MSG_CTRUNC) */
} fd_list_t;

static void fd_list_close(fd_list_t *l)
{
    for (size_t i = 0; i < l->n; i++) close(l->v[i]);
    l->n = 0;
}

static void gather_fds(struct msghdr *m, fd_list_t *l)
{
    for (struct cmsghdr *c = CMSG_FIRSTHDR(m); c; c = CMSG_NXTHDR(m, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        const unsigned char *data = CMSG_DATA(c);
        for (size_t i = 0; i < n; i++) {
            int fd;
            memcpy(&fd, data + i * sizeof(int), sizeof fd);
            if (l->n < l->cap) {
                l->v[l->n++] = fd;
            } else {
                close(fd);
                l->overflow = true;
            }
        }
    }
    if (m->msg_flags & MSG_CTRUNC) l->truncated = true;
}

static long ms_until(const struct timespec *deadline)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (long)(deadline->tv_sec - now.tv_sec) * 1000 + (deadline->tv_nsec - now.tv_nsec) / 1000000;
}

/* One recvmsg of at most `want` bytes, after waiting for data (until the
 * deadline, if any). *got = 0 means the peer closed the connection. Data
 * already queued is read whatever time is left: a timeout of 0 polls. */
static cubuf_status_t recv_piece(int sock, uint8_t *p, size_t want, const struct timespec *deadline,
                                 int timeout_ms, fd_list_t *fds, size_t *got, int *msg_flags)
{
    fd_cmsg_t cm;
    for (;;) {
        int wait_ms = -1;
        if (deadline) {
            long left = ms_until(deadline);
            wait_ms = left <= 0 ? 0 : left > 0x7fffffff ? 0x7fffffff : (int)left;
        }
        struct pollfd pfd = {sock, POLLIN, 0};
        int pr = poll(&pfd, 1, wait_ms);
        if (pr < 0 && errno == EINTR) continue;
        if (pr < 0) {
            int e = errno;
            return cubuf__fail(CUBUF_ERROR_SYSTEM, "cubuf_ipc_recv: poll failed: %s", strerror(e));
        }
        if (pr == 0) {
            if (deadline && wait_ms == 0)
                return cubuf__fail(CUBUF_ERROR_SYSTEM, "cubuf_ipc_recv: timed out after %d ms",
                                   timeout_ms);
            continue; /* woken early: wait for what is left */
        }
        struct iovec iov = {p, want};
        struct msghdr m = {0};
        m.msg_iov = &iov;
        m.msg_iovlen = 1;
        m.msg_control = cm.buf;
        m.msg_controllen = sizeof cm.buf;
        ssize_t r = recvmsg(sock, &m, MSG_CMSG_CLOEXEC);
        if (r < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
            int e = errno;
            return cubuf__fail(CUBUF_ERROR_SYSTEM, "cubuf_ipc_recv: recvmsg failed: %s (errno %d)",
                               strerror(e), e);
        }
        gather_fds(&m, fds);
        *got = (size_t)r;
        *msg_flags = m.msg_flags;
        return CUBUF_SUCCESS;
    }
}

static cubuf_status_t check_peer(int sock, const cubuf_ipc_recv_options_t *o)
{
    if (!o->check_uid && !o->check_pid) return CUBUF_SUCCESS;
    struct ucred cred;
    socklen_t n = sizeof cred;
    if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &n) != 0) {
        int e = errno;
        return cubuf__fail(CUBUF_ERROR_SYSTEM, "cubuf_ipc_recv: SO_PEERCRED failed: %s", strerror(e));
    }
    if (o->check_uid && cred.uid != o->uid)
        return bad("the peer runs as uid %u, not the expected %u (nothing was read)",
                   (unsigned)cred.uid, (unsigned)o->uid);
    if (o->check_pid && cred.pid != o->pid)
        return bad("the peer is pid %d, not the expected %d (nothing was read)", (int)cred.pid,
                   (int)o->pid);
    return CUBUF_SUCCESS;
}

/* Reads one descriptor's bytes and fds. Stream sockets are read exactly
 * (header, then the announced rest) so the next descriptor stays queued;
 * record sockets one record at a time. */
static cubuf_status_t recv_bytes(int sock, bool stream, const cubuf_ipc_recv_options_t *o,
                                 uint8_t *buf, size_t *len, fd_list_t *fds)
{
    struct timespec deadline, *dl = NULL;
    if (o->timeout_ms >= 0) {
        clock_gettime(CLOCK_MONOTONIC, &deadline);
        deadline.tv_sec += o->timeout_ms / 1000;
        deadline.tv_nsec += (long)(o->timeout_ms % 1000) * 1000000;
        if (deadline.tv_nsec >= 1000000000) {
            deadline.tv_sec++;
            deadline.tv_nsec -= 1000000000;
        }
        dl = &deadline;
    }
    size_t got = 0, total = 0;
    for (;;) {
        size_t want = stream ? (total ? total : CUBUF_IPC_HEADER_BYTES) - got
                             : CUBUF_IPC_MAX_BYTES + 1 - got;
        size_t n = 0;
        int flags = 0;
        cubuf_status_t st = recv_piece(sock, buf + got, want, dl, o->timeout_ms, fds, &n, &flags);
        if (st != CUBUF_SUCCESS) return st;
        if (n == 0 && got == 0)
            return cubuf__fail(CUBUF_ERROR_SYSTEM, "cubuf_ipc_recv: the peer closed the connection");
        if (n == 0)
            return bad("truncated: the peer closed the connection after %zu of %zu bytes", got,
                       total ? total : (size_t)CUBUF_IPC_HEADER_BYTES);
        if (flags & MSG_TRUNC) return bad("oversized: a record longer than %zu bytes", (size_t)CUBUF_IPC_MAX_BYTES);
        got += n;
        if (fds->truncated) return bad("more fds in one message than a socket message may carry");
        if (fds->overflow) return bad("more than %d fds", CUBUF_IPC_MAX_FDS);
        if (!total && got >= CUBUF_IPC_HEADER_BYTES) {
            if (memcmp(buf, wire_magic, sizeof wire_magic) != 0) return bad("wrong magic");
            total = get32(buf + W_LENGTH);
            if (total < CUBUF_IPC_HEADER_BYTES || total > CUBUF_IPC_MAX_BYTES)
                return bad("the header announces %zu bytes, outside %d..%zu", total,
                           CUBUF_IPC_HEADER_BYTES, (size_t)CUBUF_IPC_MAX_BYTES);
        }
        if (total && got >= total) break;
    }
    *len = got;
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf_ipc_recv(int socket, const cubuf_ipc_recv_options_t *options,
                              cubuf_ipc_descriptor_t **out)
{
    CHECK_ARG(out, "cubuf_ipc_recv: out is NULL");
    CHECK_ARG(socket >= 0, "cubuf_ipc_recv: socket %d is not a file descriptor", socket);
    cubuf_ipc_recv_options_t o = CUBUF_IPC_RECV_OPTIONS_INIT;
    cubuf_status_t ost;
    if (options && (ost = cubuf__struct_in("cubuf_ipc_recv", "cubuf_ipc_recv_options_t", &o,
                                           sizeof o, options, CUBUF_IPC_RECV_OPTIONS_SIZE_V1)) !=
                       CUBUF_SUCCESS)
        return ost;
    int type = 0;
    socklen_t tl = sizeof type;
    if (getsockopt(socket, SOL_SOCKET, SO_TYPE, &type, &tl) != 0) {
        int e = errno;
        return cubuf__fail(CUBUF_ERROR_SYSTEM, "cubuf_ipc_recv: not a socket: %s", strerror(e));
    }
    cubuf_status_t st = check_peer(socket, &o);
    if (st != CUBUF_SUCCESS) return st;
    uint8_t *buf = cubuf__malloc(CUBUF_IPC_MAX_BYTES + 1);
    fd_list_t fds = {0};
    fds.cap = CUBUF_IPC_MAX_FDS + CMSG_FDS_MAX;
    fds.v = cubuf__malloc(fds.cap * sizeof *fds.v);
    if (!buf || !fds.v) {
        free(buf);
        free(fds.v);
        return cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "cubuf_ipc_recv: no memory");
    }
    size_t len = 0;
    st = recv_bytes(socket, type == SOCK_STREAM, &o, buf, &len, &fds);
    if (st == CUBUF_SUCCESS) st = cubuf_ipc_descriptor_deserialize(buf, len, fds.v, fds.n, out);
    if (st != CUBUF_SUCCESS) fd_list_close(&fds);
    free(buf);
    free(fds.v);
    return st;
}
