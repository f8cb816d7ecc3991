/* dma-buf export of the memory behind a buffer (include/cubuf/dist.h): the
 * page-aligned span, the capability checks, the fd handed to the caller. */
#include <errno.h>
#include <string.h>
#include <unistd.h>

#include "dist.h"
#include "ipc.h"

/* Refuses what the driver documents no dma-buf for, before asking it. */
static cubuf_status_t check_kind(const cubuf_buffer_t *buf, const cubuf_span_t *s, const char *what)
{
    if (s->managed || cubuf_buffer_is_managed(buf))
        return cubuf__fail(CUBUF_ERROR_NOT_SUPPORTED,
                           "%s: managed memory cannot be exported as a dma-buf (the driver takes "
                           "cuMemAlloc, pool and virtual memory of a device, and cuMemHostAlloc "
                           "memory)",
                           what);
    if (cubuf_buffer_is_host_accessible(buf) && (s->from_pool || s->chunks))
        return cubuf__fail(CUBUF_ERROR_NOT_SUPPORTED,
                           "%s: pinned host memory from a %s cannot be exported as a dma-buf (of "
                           "host memory the driver documents cuMemHostAlloc memory only)",
                           what, s->from_pool ? "memory pool" : "virtual memory resource");
    return CUBUF_SUCCESS;
}

/* The device whose capability decides, and the capability. */
static cubuf_status_t check_device(const cubuf_buffer_t *buf, const char *what)
{
    int ordinal = cubuf_buffer_device_id(buf);
    cubuf_status_t st;
    if (ordinal < 0) {
        CUdevice dev = 0;
        if ((st = CU(cuCtxGetDevice, &dev)) != CUBUF_SUCCESS) return st;
        ordinal = (int)dev;
    }
    cubuf_dist_caps_t caps = CUBUF_DIST_CAPS_INIT;
    if ((st = cubuf_device_dist_caps(ordinal, &caps)) != CUBUF_SUCCESS) return st;
    bool host = cubuf_buffer_is_host_accessible(buf);
    if (host ? caps.dmabuf_host_alloc : caps.dmabuf) return CUBUF_SUCCESS;
    return cubuf__fail(CUBUF_ERROR_NOT_SUPPORTED,
                       "%s: device %d does not support dma-buf export of %s memory (%s is 0)", what,
                       ordinal, host ? "pinned host" : "device",
                       host ? "CU_DEVICE_ATTRIBUTE_HOST_ALLOC_DMA_BUF_SUPPORTED"
                            : "CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED");
}

cubuf_status_t cubuf_buffer_export_dmabuf(const cubuf_buffer_t *buf, const cubuf_dmabuf_options_t *options,
                                          cubuf_dmabuf_t *out)
{
    static const char what[] = "cubuf_buffer_export_dmabuf";
    CHECK_ARG(out, "%s: out is NULL", what);
    cubuf_status_t st = cubuf__struct_check(what, "cubuf_dmabuf_t", out->struct_size,
                                            CUBUF_DMABUF_SIZE_V1, sizeof *out);
    if (st != CUBUF_SUCCESS) return st;
    cubuf_dmabuf_options_t o = CUBUF_DMABUF_OPTIONS_INIT;
    if (options && (st = cubuf__struct_in(what, "cubuf_dmabuf_options_t", &o, sizeof o, options,
                                          CUBUF_DMABUF_OPTIONS_SIZE_V1)) != CUBUF_SUCCESS)
        return st;
    cubuf_ctx_guard_t g;
    if ((st = cubuf__span_enter(buf, what, &g)) != CUBUF_SUCCESS) return st;
    cubuf_span_t s = {0};
    if (!cubuf_buffer_is_device_accessible(buf)) {
        st = cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,
                         "%s: no device can reach the buffer's memory (host-only memory, or "
                         "virtual memory without access for its device)",
                         what);
        goto out;
    }
    if ((st = cubuf__span_get(buf, what, &s)) != CUBUF_SUCCESS ||
        (st = check_kind(buf, &s, what)) != CUBUF_SUCCESS ||
        (st = check_device(buf, what)) != CUBUF_SUCCESS)
        goto out;
    /* The driver takes page-aligned ranges only. */
    long page = sysconf(_SC_PAGESIZE);
    CUdeviceptr mask = (CUdeviceptr)(page > 0 ? page : 4096) - 1;
    CUdeviceptr lo = s.base & ~mask, hi = (s.base + s.extent + mask) & ~mask;
    unsigned long long flags = o.pcie_mapping ? CU_MEM_RANGE_FLAG_DMA_BUF_MAPPING_TYPE_PCIE : 0;
    int fd = -1;
    if ((st = CU(cuMemGetHandleForAddressRange, &fd, lo, (size_t)(hi - lo),
                 CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, flags)) != CUBUF_SUCCESS) {
        cubuf__detail_append("%s: [0x%llx, +%llu) over %zu physical allocation(s)%s", what,
                             (unsigned long long)lo, (unsigned long long)(hi - lo),
                             s.chunks ? s.nchunks : (size_t)1,
                             o.pcie_mapping ? ", PCIe mapping asked for" : "");
        goto out;
    }
    if (!cubuf__set_cloexec(fd)) {
        int e = errno;
        close(fd);
        st = cubuf__fail(CUBUF_ERROR_SYSTEM, "%s: fcntl(FD_CLOEXEC) on the dma-buf: %s", what,
                         strerror(e));
        goto out;
    }
    cubuf_dmabuf_t d = CUBUF_DMABUF_INIT;
    d.fd = fd;
    d.offset = cubuf_buffer_ptr(buf) - lo;
    d.size = hi - lo;
    d.base = lo;
    cubuf__struct_out(out, &d, sizeof d);
out:
    cubuf__span_free(&s);
    cubuf__ctx_pop(&g);
    return st;
}
