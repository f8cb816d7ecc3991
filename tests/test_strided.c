/* Strided views (buffer_from_object): the span from the lowest to the
 * highest byte any element touches, for C and Fortran order, slices with
 * gaps, reversed and mixed strides, broadcasts, zero-length dimensions,
 * scalars; overflow; unreachable memory; owners. On device memory and on
 * pinned host memory. */
#include <stdint.h>

#include "internal.h"
#include "test.h"

static cubuf_context_t *cctx;

static int releases;
static void count_release(void *owner)
{
    T_CHECK(owner == &releases);
    releases++;
}

/* Expects the view of (address, shape, strides, itemsize) to start at
 * address + start_offset and hold `size` bytes. */
static void expect_span(CUdeviceptr address, int ndim, const int64_t *shape,
                        const int64_t *strides, size_t itemsize, int64_t start_offset,
                        size_t size, int line)
{
    cubuf_buffer_t *b = NULL;
    cubuf_status_t st = cubuf_context_buffer_from_strided(cctx, address, ndim, shape, strides,
                                                          itemsize, NULL, NULL, NULL, &b);
    if (st != CUBUF_SUCCESS) {
        fprintf(stderr, "line %d: failed: %s\n", line, cubuf_last_error());
        t_failures++;
        return;
    }
    CUdeviceptr want = address + (CUdeviceptr)start_offset;
    if (cubuf_buffer_ptr(b) != want || cubuf_buffer_size(b) != size) {
        fprintf(stderr, "line %d: span [0x%llx, +%zu), expected [0x%llx, +%zu)\n", line,
                (unsigned long long)cubuf_buffer_ptr(b), cubuf_buffer_size(b),
                (unsigned long long)want, size);
        t_failures++;
    }
    if (size) T_CHECK(cubuf_buffer_is_device_accessible(b));
    cubuf_buffer_release(b);
}

static void expect_status(CUdeviceptr address, int ndim, const int64_t *shape,
                          const int64_t *strides, size_t itemsize, cubuf_status_t want, int line)
{
    cubuf_buffer_t *b = NULL;
    releases = 0;
    cubuf_status_t st = cubuf_context_buffer_from_strided(cctx, address, ndim, shape, strides,
                                                          itemsize, NULL, &releases, count_release, &b);
    if (st != want) {
        fprintf(stderr, "line %d: %s, expected %s (%s)\n", line, cubuf_status_name(st),
                cubuf_status_name(want), cubuf_last_error());
        t_failures++;
    }
    if (st != CUBUF_SUCCESS) T_CHECK(b == NULL && releases == 0); /* the owner stays with the caller */
    cubuf_buffer_release(b);
}

#define SPAN(addr, nd, sh, st, item, off, size) expect_span(addr, nd, sh, st, item, off, size, __LINE__)
#define STATUS(addr, nd, sh, st, item, want) expect_status(addr, nd, sh, st, item, want, __LINE__)

/* The same spans over any device-accessible memory with 64 KiB either side of `a`. */
static void spans(CUdeviceptr a)
{
    /* C-contiguous 3x4 float32: 48 bytes. */
    SPAN(a, 2, ((int64_t[]){3, 4}), ((int64_t[]){16, 4}), 4, 0, 48);
    /* Fortran order 3x4: 48 bytes. */
    SPAN(a, 2, ((int64_t[]){3, 4}), ((int64_t[]){4, 12}), 4, 0, 48);
    /* Every other column of a 4x8 float32 array: gaps inside, none after
     * the last element: 3*32 + 3*8 + 4 = 124. */
    SPAN(a, 2, ((int64_t[]){4, 4}), ((int64_t[]){32, 8}), 4, 0, 124);
    /* A 2x3 window of a 10x10 float64 array: 1*80 + 2*8 + 8 = 104. */
    SPAN(a, 2, ((int64_t[]){2, 3}), ((int64_t[]){80, 8}), 8, 0, 104);
    /* Reversed 1-D (a[::-1]): element 0 is the last in memory: [a-36, a+4). */
    SPAN(a, 1, ((int64_t[]){10}), ((int64_t[]){-4}), 4, -36, 40);
    /* Reversed rows of C order 3x4: [a-32, a+16). */
    SPAN(a, 2, ((int64_t[]){3, 4}), ((int64_t[]){-16, 4}), 4, -32, 48);
    /* Both axes reversed, with gaps: lo = -(2*64 + 3*8) = -152, width 152 + 4. */
    SPAN(a, 2, ((int64_t[]){3, 4}), ((int64_t[]){-64, -8}), 4, -152, 156);
    /* 3-D mixed signs: hi = 1*1000 + 4*2 = 1008, lo = -(2*100) = -200. */
    SPAN(a, 3, ((int64_t[]){2, 3, 5}), ((int64_t[]){1000, -100, 2}), 2, -200, 1210);
    /* Broadcast (stride 0) and length-1 dimensions with any stride. */
    SPAN(a, 1, ((int64_t[]){5}), ((int64_t[]){0}), 4, 0, 4);
    SPAN(a, 2, ((int64_t[]){1, 6}), ((int64_t[]){-123456, 2}), 2, 0, 12);
    /* Overlapping elements (stride smaller than the item). */
    SPAN(a, 1, ((int64_t[]){4}), ((int64_t[]){1}), 8, 0, 11);
    /* A scalar (ndim 0) is one item; shape and strides may be NULL. */
    SPAN(a, 0, NULL, NULL, 16, 0, 16);
    /* A zero-length dimension: an empty view at the address, whatever the strides. */
    SPAN(a, 3, ((int64_t[]){3, 0, 4}), ((int64_t[]){-1000, 8, INT64_MAX}), 4, 0, 0);
    SPAN(a, 1, ((int64_t[]){0}), ((int64_t[]){4}), 4, 0, 0);
    /* 64 dimensions of length 1. */
    int64_t ones[64], strides[64];
    for (int k = 0; k < 64; k++) ones[k] = 1, strides[k] = (k % 2 ? -1 : 1) * (int64_t)k * 1000;
    SPAN(a, 64, ones, strides, 4, 0, 4);
    strides[63] = -4; /* one dimension of 2 going down */
    ones[63] = 2;
    SPAN(a, 64, ones, strides, 4, -4, 8);
}

static void errors(CUdeviceptr a)
{
    const int64_t shape1[] = {3}, stride1[] = {4};
    /* Invalid arguments. */
    STATUS(a, -1, shape1, stride1, 4, CUBUF_ERROR_INVALID_ARGUMENT);
    int64_t sh65[65], st65[65];
    for (int k = 0; k < 65; k++) sh65[k] = 1, st65[k] = 0;
    STATUS(a, 65, sh65, st65, 4, CUBUF_ERROR_INVALID_ARGUMENT);
    STATUS(a, 1, shape1, stride1, 0, CUBUF_ERROR_INVALID_ARGUMENT);
    STATUS(a, 1, NULL, stride1, 4, CUBUF_ERROR_INVALID_ARGUMENT);
    STATUS(a, 1, shape1, NULL, 4, CUBUF_ERROR_INVALID_ARGUMENT);
    STATUS(a, 2, ((int64_t[]){2, -1}), ((int64_t[]){8, 4}), 4, CUBUF_ERROR_INVALID_ARGUMENT);
    STATUS(0, 1, shape1, stride1, 4, CUBUF_ERROR_INVALID_ARGUMENT);
    STATUS(0, 0, NULL, NULL, 4, CUBUF_ERROR_INVALID_ARGUMENT);
    /* ...but an empty array at address 0 is an empty view. */
    STATUS(0, 1, ((int64_t[]){0}), stride1, 4, CUBUF_SUCCESS);
    cubuf_buffer_t *b = NULL;
    T_STATUS(cubuf_context_buffer_from_strided(NULL, a, 1, shape1, stride1, 4, NULL, NULL, NULL, &b),
             CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_context_buffer_from_strided(cctx, a, 1, shape1, stride1, 4, NULL, NULL, NULL, NULL),
             CUBUF_ERROR_INVALID_ARGUMENT);

    /* Overflow of the span's arithmetic. */
    STATUS(a, 1, ((int64_t[]){INT64_MAX}), ((int64_t[]){2}), 1, CUBUF_ERROR_OUT_OF_RANGE);
    STATUS(a, 1, ((int64_t[]){3}), ((int64_t[]){INT64_MIN}), 1, CUBUF_ERROR_OUT_OF_RANGE);
    STATUS(a, 2, ((int64_t[]){2, 2}), ((int64_t[]){INT64_MAX, INT64_MAX}), 1,
           CUBUF_ERROR_OUT_OF_RANGE);
    STATUS(a, 2, ((int64_t[]){2, 2}), ((int64_t[]){INT64_MIN + 1, -2}), 1, CUBUF_ERROR_OUT_OF_RANGE);
    STATUS(a, 1, ((int64_t[]){INT64_MAX}), ((int64_t[]){-1}), 1, CUBUF_ERROR_OUT_OF_RANGE);
    /* An item too large for the rest of the address space. */
    STATUS(a, 0, NULL, NULL, SIZE_MAX, CUBUF_ERROR_OUT_OF_RANGE);
    STATUS(a, 1, ((int64_t[]){2}), ((int64_t[]){INT64_MAX}), SIZE_MAX / 2, CUBUF_ERROR_OUT_OF_RANGE);
    /* A span reaching below address 0. */
    STATUS(a, 1, ((int64_t[]){2}), ((int64_t[]){INT64_MIN}), 1, CUBUF_ERROR_OUT_OF_RANGE);
    STATUS(16, 1, ((int64_t[]){10}), ((int64_t[]){-4}), 4, CUBUF_ERROR_OUT_OF_RANGE);
    STATUS(36, 1, ((int64_t[]){10}), ((int64_t[]){-4}), 4, CUBUF_ERROR_OUT_OF_RANGE);
}

int main(void)
{
    t_require_gpu();
    T_REQUIRE(cubuf_context_create(0, &cctx));
    CUcontext ctx = NULL;
    T_OK(cubuf_context_handle(cctx, &ctx));
    T_CU(cuCtxSetCurrent, ctx);
    const size_t half = 64 * 1024;

    /* Device memory. */
    CUdeviceptr dev = 0;
    T_CU(cuMemAlloc, &dev, 2 * half);
    spans(dev + half);
    errors(dev + half);

    /* Pinned host memory (cuMemHostAlloc): the same spans, host and device accessible. */
    void *pinned = NULL;
    T_CU(cuMemHostAlloc, &pinned, 2 * half, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE);
    CUdeviceptr hp = (CUdeviceptr)(uintptr_t)pinned + half;
    spans(hp);
    cubuf_buffer_t *b = NULL;
    T_REQUIRE(cubuf_context_buffer_from_strided(cctx, hp, 1, ((int64_t[]){10}), ((int64_t[]){-4}),
                                                4, NULL, NULL, NULL, &b));
    T_CHECK(cubuf_buffer_is_host_accessible(b) && cubuf_buffer_is_device_accessible(b));
    T_CHECK(cubuf_buffer_device_id(b) == -1);
    /* The view covers exactly the bytes it spans: device-side fill, host-side check. */
    memset(pinned, 0, 2 * half);
    T_OK(cubuf_buffer_fill_byte(b, 0xab, CU_STREAM_LEGACY));
    T_CU(cuCtxSynchronize);
    const unsigned char *h = pinned;
    T_CHECK(h[half - 37] == 0 && h[half + 4] == 0);
    T_CHECK(h[half - 36] == 0xab && h[half] == 0xab && h[half + 3] == 0xab);
    cubuf_buffer_release(b);

    /* A strided view of device memory, with its owner, read back. */
    releases = 0;
    T_REQUIRE(cubuf_context_buffer_from_strided(cctx, dev + half, 2, ((int64_t[]){4, 4}),
                                                ((int64_t[]){32, 8}), 4, NULL, &releases,
                                                count_release, &b));
    T_CHECK(cubuf_buffer_owner(b) == &releases && cubuf_buffer_device_id(b) == 0);
    T_CU(cuMemsetD8, dev, 0, 2 * half);
    T_OK(cubuf_buffer_fill_byte(b, 0x5c, CU_STREAM_LEGACY));
    unsigned char back[128];
    T_CU(cuCtxSynchronize);
    T_CU(cuMemcpyDtoH, back, dev + half - 2, sizeof back);
    T_CHECK(back[0] == 0 && back[1] == 0 && back[2] == 0x5c && back[2 + 123] == 0x5c);
    T_CHECK(back[2 + 124] == 0);
    T_OK(cubuf_buffer_close(b));
    T_CHECK(releases == 1);
    cubuf_buffer_release(b);
    T_CHECK(releases == 1);

    /* Pageable memory the device cannot reach: refused, owner kept. */
    char *pageable = malloc(4096);
    STATUS((CUdeviceptr)(uintptr_t)pageable + 2048, 1, ((int64_t[]){4}), ((int64_t[]){-4}), 4,
           CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(strstr(cubuf_last_error(), "pageable") != NULL);
    /* An empty array over it is still an empty view. */
    STATUS((CUdeviceptr)(uintptr_t)pageable, 1, ((int64_t[]){0}), ((int64_t[]){4}), 4, CUBUF_SUCCESS);
    free(pageable);

    /* Views count nowhere. */
    size_t bytes = 1;
    T_OK(cubuf_context_bytes_allocated(cctx, &bytes));
    T_CHECK(bytes == 0);
    T_CU(cuMemFreeHost, pinned);
    T_CU(cuMemFree, dev);
    T_CU(cuCtxSetCurrent, NULL);
    cubuf_context_destroy(cctx);
    return t_finish("test_strided");
}
