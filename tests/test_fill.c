/* Fills: byte values and their range, 2- and 4-byte patterns read back,
 * pattern sizes, size multiples, alignment, closed and empty buffers, the
 * cost of the hot path, and a failing driver call. */
#include "internal.h"
#include "test.h"

static CUstream s;
static cubuf_context_t *cctx;

static unsigned char *read_back(const cubuf_buffer_t *b)
{
    size_t n = cubuf_buffer_size(b);
    unsigned char *h = malloc(n ? n : 1);
    T_CU(cuStreamSynchronize, s);
    if (n) T_CU(cuMemcpyDtoH, h, cubuf_buffer_ptr(b), n);
    return h;
}

static bool all_bytes(const cubuf_buffer_t *b, unsigned char v)
{
    unsigned char *h = read_back(b);
    bool ok = true;
    for (size_t i = 0; i < cubuf_buffer_size(b) && ok; i++) ok = h[i] == v;
    free(h);
    return ok;
}

/* The pattern's bytes repeat in memory in the order given. */
static bool repeats(const cubuf_buffer_t *b, const unsigned char *pattern, size_t k)
{
    unsigned char *h = read_back(b);
    bool ok = true;
    for (size_t i = 0; i < cubuf_buffer_size(b) && ok; i++) ok = h[i] == pattern[i % k];
    free(h);
    return ok;
}

static cubuf_buffer_t *new_buffer(size_t n)
{
    cubuf_buffer_t *b = NULL;
    T_REQUIRE(cubuf_context_new_buffer(cctx, n, &b));
    T_CU(cuStreamSynchronize, CU_STREAM_LEGACY);
    return b;
}

int main(void)
{
    t_require_gpu();
    T_REQUIRE(cubuf_context_create(0, &cctx));
    CUcontext ctx = NULL;
    T_OK(cubuf_context_handle(cctx, &ctx));
    T_CU(cuCtxSetCurrent, ctx);
    T_CU(cuStreamCreate, &s, CU_STREAM_NON_BLOCKING);

    cubuf_buffer_t *b = new_buffer(1000);

    /* Byte values: the ends of the range, and past them. */
    T_OK(cubuf_buffer_fill_byte(b, 255, s));
    T_CHECK(all_bytes(b, 255));
    T_OK(cubuf_buffer_fill_byte(b, 0, s));
    T_CHECK(all_bytes(b, 0));
    T_OK(cubuf_buffer_fill_byte(b, 0x5a, s));
    T_STATUS(cubuf_buffer_fill_byte(b, 256, s), CUBUF_ERROR_OUT_OF_RANGE);
    T_STATUS(cubuf_buffer_fill_byte(b, -1, s), CUBUF_ERROR_OUT_OF_RANGE);
    T_STATUS(cubuf_buffer_fill_byte(b, 1LL << 40, s), CUBUF_ERROR_OUT_OF_RANGE);
    T_CHECK(strstr(cubuf_last_error(), "[0, 256)") != NULL);
    T_CHECK(all_bytes(b, 0x5a)); /* the refused fills wrote nothing */

    /* 1-, 2- and 4-byte patterns from bytes. */
    const unsigned char p1[1] = {0xc7};
    const unsigned char p2[2] = {0x12, 0xfe};
    const unsigned char p4[4] = {0x01, 0x80, 0x7f, 0xff};
    T_OK(cubuf_buffer_fill(b, p1, 1, s));
    T_CHECK(repeats(b, p1, 1));
    T_OK(cubuf_buffer_fill(b, p2, 2, s));
    T_CHECK(repeats(b, p2, 2));
    T_OK(cubuf_buffer_fill(b, p4, 4, s));
    T_CHECK(repeats(b, p4, 4));

    /* Pattern sizes other than 1, 2, 4; sizes not a multiple of the pattern. */
    const unsigned char p8[8] = {0};
    T_STATUS(cubuf_buffer_fill(b, p8, 3, s), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_buffer_fill(b, p8, 8, s), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_buffer_fill(b, p8, 0, s), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_buffer_fill(b, NULL, 1, s), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_buffer_fill(NULL, p1, 1, s), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_buffer_fill_byte(NULL, 1, s), CUBUF_ERROR_INVALID_ARGUMENT);
    cubuf_buffer_t *odd = new_buffer(1002); /* a multiple of 2, not of 4 */
    T_OK(cubuf_buffer_fill(odd, p2, 2, s));
    T_CHECK(repeats(odd, p2, 2));
    T_STATUS(cubuf_buffer_fill(odd, p4, 4, s), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(strstr(cubuf_last_error(), "multiple") != NULL);
    cubuf_buffer_t *three = new_buffer(3);
    T_STATUS(cubuf_buffer_fill(three, p2, 2, s), CUBUF_ERROR_INVALID_ARGUMENT);
    T_OK(cubuf_buffer_fill(three, p1, 1, s));
    T_CHECK(repeats(three, p1, 1));
    T_CHECK(repeats(odd, p2, 2)); /* the refused fill wrote nothing */

    /* A slice at an odd address: byte fills work, wider ones are refused. */
    cubuf_buffer_t *slice = NULL;
    T_REQUIRE(cubuf_buffer_slice(b, 1, 996, &slice));
    T_OK(cubuf_buffer_fill_byte(b, 0, s));
    T_OK(cubuf_buffer_fill_byte(slice, 9, s));
    T_STATUS(cubuf_buffer_fill(slice, p2, 2, s), CUBUF_ERROR_INVALID_ARGUMENT);
    unsigned char *h = read_back(b);
    T_CHECK(h[0] == 0 && h[1] == 9 && h[996] == 9 && h[997] == 0 && h[999] == 0);
    free(h);
    /* A 4-aligned slice takes a 4-byte pattern and writes only its range. */
    cubuf_buffer_t *aligned = NULL;
    T_REQUIRE(cubuf_buffer_slice(b, 8, 16, &aligned));
    T_OK(cubuf_buffer_fill(aligned, p4, 4, s));
    h = read_back(b);
    T_CHECK(h[7] == 9 && memcmp(h + 8, p4, 4) == 0 && memcmp(h + 20, p4, 4) == 0 && h[24] == 9);
    free(h);

    /* The hot path: the memset plus at most one cuCtxGetCurrent. */
    cubuf_fault_count_calls(true);
    T_OK(cubuf_buffer_fill(b, p4, 4, s));
    T_CHECK(cubuf_fault_calls("cuMemsetD32Async") == 1);
    T_CHECK(cubuf_fault_calls("cuCtxGetCurrent") <= 1);
    T_CHECK(cubuf_fault_calls("cuCtxPushCurrent") == 0);
    T_CHECK(cubuf_fault_calls("cuStreamIsCapturing") == 0);
    cubuf_fault_count_calls(false);

    /* A failing driver call is reported with its CUresult. */
    T_CHECK(cubuf_fault_fail_nth("cuMemsetD16Async", 1, CUDA_ERROR_ILLEGAL_ADDRESS));
    T_STATUS(cubuf_buffer_fill(b, p2, 2, s), CUBUF_ERROR_DRIVER);
    T_CHECK(cubuf_last_cuda_result() == CUDA_ERROR_ILLEGAL_ADDRESS);
    cubuf_fault_reset();
    T_CHECK(repeats(b, p4, 4));

    /* Fill with nothing current runs in the buffer's context and leaves nothing current. */
    T_CU(cuStreamSynchronize, s);
    T_CU(cuCtxSetCurrent, NULL);
    T_OK(cubuf_buffer_fill_byte(b, 0x33, CU_STREAM_PER_THREAD));
    CUcontext cur = (CUcontext)(uintptr_t)1;
    T_CU(cuCtxGetCurrent, &cur);
    T_CHECK(cur == NULL);
    T_CU(cuCtxSetCurrent, ctx);
    T_CU(cuStreamSynchronize, CU_STREAM_PER_THREAD);
    T_CHECK(all_bytes(b, 0x33));

    /* Closed buffers; a buffer of size 0 (every pattern size divides it). */
    cubuf_buffer_t *closed = new_buffer(16);
    T_OK(cubuf_buffer_close(closed));
    T_STATUS(cubuf_buffer_fill(closed, p4, 4, s), CUBUF_ERROR_CLOSED);
    T_STATUS(cubuf_buffer_fill_byte(closed, 1, s), CUBUF_ERROR_CLOSED);
    T_STATUS(cubuf_buffer_fill_byte(closed, 256, s), CUBUF_ERROR_OUT_OF_RANGE); /* the value first */
    /* One byte: a byte fill writes it, a 2-byte pattern does not fit. */
    cubuf_buffer_t *one = new_buffer(1);
    T_OK(cubuf_buffer_fill_byte(one, 0xa5, s));
    T_CHECK(all_bytes(one, 0xa5));
    T_STATUS(cubuf_buffer_fill(one, p2, 2, s), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(all_bytes(one, 0xa5));
    cubuf_buffer_release(one);
    cubuf_buffer_t *empty = new_buffer(0);
    cubuf_fault_count_calls(true);
    T_OK(cubuf_buffer_fill_byte(empty, 1, s));
    T_OK(cubuf_buffer_fill(empty, p2, 2, s));
    T_OK(cubuf_buffer_fill(empty, p4, 4, s));
    T_CHECK(cubuf_fault_calls("cuMemsetD8Async") == 0 && cubuf_fault_calls("cuCtxGetCurrent") == 0);
    cubuf_fault_count_calls(false);

    /* Pinned host memory through a view. */
    void *host = NULL;
    T_CU(cuMemHostAlloc, &host, 64, 0);
    cubuf_buffer_t *hv = NULL;
    T_REQUIRE(cubuf_buffer_view((CUdeviceptr)(uintptr_t)host, 64, &hv));
    T_OK(cubuf_buffer_fill(hv, p4, 4, s));
    T_CU(cuStreamSynchronize, s);
    for (size_t i = 0; i < 64; i++) T_CHECK(((unsigned char *)host)[i] == p4[i % 4]);

    cubuf_buffer_release(hv);
    T_CU(cuMemFreeHost, host);
    cubuf_buffer_release(aligned);
    cubuf_buffer_release(slice);
    cubuf_buffer_release(closed);
    cubuf_buffer_release(empty);
    cubuf_buffer_release(three);
    cubuf_buffer_release(odd);
    cubuf_buffer_release(b);
    T_CU(cuStreamSynchronize, s);
    T_CU(cuStreamDestroy, s);
    size_t bytes = 1;
    T_OK(cubuf_context_bytes_allocated(cctx, &bytes));
    T_CHECK(bytes == 0);
    T_CU(cuCtxSetCurrent, NULL);
    cubuf_context_destroy(cctx);
    return t_finish("test_fill");
}
