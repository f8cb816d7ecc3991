/* Sharing memory with other processes: the named memfds that pool and VMM
 * memory live in, and legacy IPC handles for cuMemAlloc memory.
 *
 * A legacy handle carries what another process needs to map the same
 * memfd: the exporter's pid and fd number (opened through
 * /proc/<pid>/fd/<n>), the file's identity (so that a reused fd number is
 * refused), the offset and the size. Opening a handle twice in one process
 * returns the same pointer and counts the opens, as the real driver does. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fake.h"

#define SHARE_PREFIX "/memfd:cubuf-td-"

int td_share_memfd(const char *name, size_t size)
{
    char full[96];
    snprintf(full, sizeof full, "cubuf-td-%s", name);
    int fd = memfd_create(full, MFD_CLOEXEC);
    if (fd < 0) return -1;
    if (ftruncate(fd, (off_t)size) != 0) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    return fd;
}

bool td_share_name(int fd, char *name, size_t cap)
{
    char link[64], target[256];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, target, sizeof target - 1);
    if (n <= 0) return false;
    target[n] = '\0';
    size_t pre = strlen(SHARE_PREFIX);
    if (strncmp(target, SHARE_PREFIX, pre) != 0) return false;
    char *end = strstr(target + pre, " (deleted)");
    if (end) *end = '\0';
    snprintf(name, cap, "%s", target + pre);
    return true;
}

/* ---- legacy IPC handles ---- */

#define LEGACY_MAGIC 0x4c544243u /* "CBTL" */

typedef struct legacy_handle {
    uint32_t magic;
    uint32_t pid;
    int32_t fd;
    uint32_t pad;
    uint64_t fd_offset;
    uint64_t size;
    uint64_t ino;
    uint64_t dev;
    uint64_t id;
    uint64_t check;
} legacy_handle_t;

_Static_assert(sizeof(legacy_handle_t) == sizeof(CUipcMemHandle), "a legacy handle is 64 bytes");

static uint64_t handle_check(const legacy_handle_t *h)
{
    const unsigned char *p = (const unsigned char *)h;
    uint64_t x = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < offsetof(legacy_handle_t, check); i++) x = (x ^ p[i]) * 0x100000001b3ull;
    return x;
}

/* Handles this process opened: one mapping per (exporter, allocation). */
typedef struct opened {
    struct opened *next;
    uint32_t pid;
    uint64_t id;
    uintptr_t map;   /* the mmap (page aligned) */
    size_t map_size;
    uintptr_t base;  /* what cuIpcOpenMemHandle returned */
    unsigned refs;
} opened_t;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static opened_t *opens;

CUresult td_cuIpcGetMemHandle(CUipcMemHandle_v1 *pHandle, CUdeviceptr_v2 dptr)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!pHandle) return CUDA_ERROR_INVALID_VALUE;
    td_range_t rg;
    /* only cuMemAlloc memory has legacy handles, named by its base */
    if (!td_range_find((uintptr_t)dptr, &rg) || rg.kind != TD_KIND_DEVICE || rg.fd < 0 ||
        rg.base != (uintptr_t)dptr)
        return CUDA_ERROR_INVALID_VALUE;
    struct stat s;
    if (fstat(rg.fd, &s) != 0) return CUDA_ERROR_INVALID_VALUE;
    legacy_handle_t h;
    memset(&h, 0, sizeof h);
    h.magic = LEGACY_MAGIC;
    h.pid = (uint32_t)getpid();
    h.fd = rg.fd;
    h.fd_offset = rg.fd_offset;
    h.size = rg.size;
    h.ino = (uint64_t)s.st_ino;
    h.dev = (uint64_t)s.st_dev;
    h.id = rg.id;
    h.check = handle_check(&h);
    memcpy(pHandle->reserved, &h, sizeof h);
    return CUDA_SUCCESS;
}

/* Maps the exporter's memfd; CUDA_ERROR_INVALID_VALUE when it is gone or
 * is not the file the handle names. */
static CUresult map_exported(const legacy_handle_t *h, uintptr_t *map, size_t *map_size,
                             uintptr_t *base)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%u/fd/%d", (unsigned)h->pid, (int)h->fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) return CUDA_ERROR_INVALID_VALUE;
    struct stat s;
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    if (fstat(fd, &s) == 0 && (uint64_t)s.st_ino == h->ino && (uint64_t)s.st_dev == h->dev &&
        h->fd_offset + h->size <= (uint64_t)s.st_size) {
        size_t page = (size_t)sysconf(_SC_PAGESIZE);
        size_t lead = (size_t)h->fd_offset % page;
        size_t n = lead + (size_t)h->size;
        void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)(h->fd_offset - lead));
        if (p == MAP_FAILED) {
            r = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            *map = (uintptr_t)p;
            *map_size = n;
            *base = (uintptr_t)p + lead;
            r = CUDA_SUCCESS;
        }
    }
    close(fd);
    return r;
}

CUresult td_cuIpcOpenMemHandle(CUdeviceptr_v2 *pdptr, CUipcMemHandle_v1 handle, unsigned int Flags)
{
    CUcontext ctx = NULL;
    CUresult r = td_ctx_require(&ctx);
    if (r != CUDA_SUCCESS) return r;
    if (!pdptr || (Flags & ~(unsigned)CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)) return CUDA_ERROR_INVALID_VALUE;
    legacy_handle_t h;
    memcpy(&h, handle.reserved, sizeof h);
    if (h.magic != LEGACY_MAGIC || h.check != handle_check(&h) || h.size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (h.pid == (uint32_t)getpid()) return CUDA_ERROR_INVALID_CONTEXT; /* not across a process */
    pthread_mutex_lock(&lock);
    for (opened_t *o = opens; o; o = o->next)
        if (o->pid == h.pid && o->id == h.id) {
            o->refs++;
            *pdptr = (CUdeviceptr)o->base;
            pthread_mutex_unlock(&lock);
            return CUDA_SUCCESS;
        }
    opened_t *o = calloc(1, sizeof *o);
    if (!o) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    r = map_exported(&h, &o->map, &o->map_size, &o->base);
    if (r == CUDA_SUCCESS) {
        td_range_t rg = {.base = o->base, .size = (size_t)h.size, .kind = TD_KIND_IPC,
                         .device = td_ctx_device(ctx), .ctx = ctx, .fd = -1};
        r = td_range_add(&rg);
        if (r != CUDA_SUCCESS) munmap((void *)o->map, o->map_size);
    }
    if (r != CUDA_SUCCESS) {
        free(o);
        pthread_mutex_unlock(&lock);
        return r;
    }
    o->pid = h.pid;
    o->id = h.id;
    o->refs = 1;
    o->next = opens;
    opens = o;
    *pdptr = (CUdeviceptr)o->base;
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

CUresult td_cuIpcCloseMemHandle(CUdeviceptr_v2 dptr)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    pthread_mutex_lock(&lock);
    for (opened_t **q = &opens; *q; q = &(*q)->next) {
        opened_t *o = *q;
        if (o->base != (uintptr_t)dptr) continue;
        if (--o->refs == 0) {
            *q = o->next;
            td_range_remove(o->base, TD_KIND_IPC, NULL);
            munmap((void *)o->map, o->map_size);
            free(o);
        }
        pthread_mutex_unlock(&lock);
        return CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&lock);
    return CUDA_ERROR_INVALID_VALUE;
}
