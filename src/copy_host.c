/* Host copies of pyarrow's CudaBuffer: copy_to_host and copy_from_host, with
 * their position and size rules, complete when they return. */
#include "internal.h"

/* pyarrow's rules for the device side: position in [0, size]; nbytes -1 for
 * "as much as fits" (the rest of the buffer, at most the host side), else at
 * most both the rest of the buffer and the host side. */
static cubuf_status_t host_range(const cubuf_buffer_t *buf, int64_t position, int64_t nbytes,
                                 size_t host_size, const char *host_what, const char *what,
                                 size_t *n)
{
    if (position < 0 || (uint64_t)position > buf->size)
        return cubuf__fail(CUBUF_ERROR_OUT_OF_RANGE,
                           "%s: position %lld is outside the buffer's [0, %zu]", what,
                           (long long)position, buf->size);
    size_t rest = buf->size - (size_t)position;
    if (nbytes == -1) {
        *n = rest < host_size ? rest : host_size;
        return CUBUF_SUCCESS;
    }
    if (nbytes < 0)
        return cubuf__fail(CUBUF_ERROR_OUT_OF_RANGE,
                           "%s: nbytes %lld is negative (only -1, as much as fits, is allowed)",
                           what, (long long)nbytes);
    if ((uint64_t)nbytes > rest)
        return cubuf__fail(CUBUF_ERROR_OUT_OF_RANGE,
                           "%s: %lld bytes from position %lld pass the end of the %zu-byte buffer",
                           what, (long long)nbytes, (long long)position, buf->size);
    if ((uint64_t)nbytes > host_size)
        return cubuf__fail(CUBUF_ERROR_OUT_OF_RANGE, "%s: %lld bytes do not fit the %zu-byte %s",
                           what, (long long)nbytes, host_size, host_what);
    *n = (size_t)nbytes;
    return CUBUF_SUCCESS;
}

/* Both directions: the checks, then one copy on `stream` in buf's context
 * and the stream synchronized. A capturing stream is refused first:
 * synchronizing it would break the capture. */
static cubuf_status_t host_copy(const cubuf_buffer_t *buf, int64_t position, int64_t nbytes,
                                const void *host, size_t host_size, bool to_host, CUstream stream,
                                size_t *copied, const char *what)
{
    CHECK_ARG(buf, "%s: buf is NULL", what);
    CHECK_ARG(host || host_size == 0, "%s: the host side is NULL with %zu bytes", what, host_size);
    cubuf_status_t st = cubuf__buffer_check_open(buf, what);
    size_t n = 0;
    if (st == CUBUF_SUCCESS)
        st = host_range(buf, position, nbytes, host_size, to_host ? "host buffer" : "host data",
                        what, &n);
    if (st != CUBUF_SUCCESS) return st;
    if (n) {
        const CUdeviceptr dev = buf->ptr + (CUdeviceptr)position, h = (CUdeviceptr)(uintptr_t)host;
        if ((st = cubuf__driver_load()) != CUBUF_SUCCESS) return st;
        cubuf_ctx_guard_t g;
        if ((st = cubuf__ctx_push(cubuf__buffer_exec_ctx(buf), &g)) != CUBUF_SUCCESS) return st;
        st = cubuf__stream_refuse_capture(stream, NULL, what);
        if (st == CUBUF_SUCCESS &&
            (st = CU(cuMemcpyAsync, to_host ? h : dev, to_host ? dev : h, n, stream)) == CUBUF_SUCCESS)
            st = CU(cuStreamSynchronize, stream);
        if (st != CUBUF_SUCCESS) cubuf__detail_append("%s of %zu bytes", what, n);
        cubuf__ctx_pop(&g);
        if (st != CUBUF_SUCCESS) return st;
    }
    if (copied) *copied = n;
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf_buffer_copy_to_host(const cubuf_buffer_t *buf, int64_t position,
                                         int64_t nbytes, void *host, size_t host_size,
                                         CUstream stream, size_t *copied)
{
    return host_copy(buf, position, nbytes, host, host_size, true, stream, copied,
                     "cubuf_buffer_copy_to_host");
}

cubuf_status_t cubuf_buffer_copy_from_host(cubuf_buffer_t *buf, const void *data, size_t data_size,
                                           int64_t position, int64_t nbytes, CUstream stream,
                                           size_t *copied)
{
    return host_copy(buf, position, nbytes, data, data_size, false, stream, copied,
                     "cubuf_buffer_copy_from_host");
}
