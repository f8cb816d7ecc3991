/* The span of a strided array (strided.h). */
#include "strided.h"

cubuf_status_t cubuf__strided_span(const char *what, int ndim, const int64_t *shape,
                                   const int64_t *strides, size_t unit, size_t itemsize,
                                   int64_t *used, int64_t *lo, uint64_t *len)
{
    *lo = 0;
    *len = 0;
    bool empty = false; /* then only the strides matter, whatever they are */
    for (int k = 0; k < ndim; k++)
        if (shape[k] == 0) empty = true;
    /* The extremes are reached at the corners, where each index is 0 or
     * shape[k]-1 depending on the sign of the stride. */
    int64_t low = 0, high = 0, contiguous = 1; /* in units */
    for (int k = ndim - 1; k >= 0; k--) {
        int64_t stride = strides ? strides[k] : contiguous;
        if (used) used[k] = stride;
        /* The product is the next dimension's stride: needed for k > 0 only,
         * and not at all for an empty array whose strides nobody asked for. */
        if (!strides && k > 0 && (used || !empty) &&
            __builtin_mul_overflow(contiguous, shape[k], &contiguous))
            goto overflow;
        if (empty) continue;
        int64_t reach;
        if (__builtin_mul_overflow(shape[k] - 1, stride, &reach)) goto overflow;
        if (reach < 0 ? __builtin_add_overflow(low, reach, &low) : __builtin_add_overflow(high, reach, &high))
            goto overflow;
    }
    if (empty) return CUBUF_SUCCESS;
    /* high - low <= 2^64 - 2 fits in uint64; the bytes and the item may not. */
    uint64_t width = (uint64_t)high + (0 - (uint64_t)low), bytes;
    int64_t below;
    if (__builtin_mul_overflow(width, (uint64_t)unit, &bytes) ||
        __builtin_add_overflow(bytes, (uint64_t)itemsize, &bytes) ||
        __builtin_mul_overflow(low, (int64_t)unit, &below))
        goto overflow;
    *lo = below;
    *len = bytes;
    return CUBUF_SUCCESS;
overflow:
    return cubuf__fail(CUBUF_ERROR_OUT_OF_RANGE, "%s: the span of the %d-dimensional array overflows 64 bits",
                       what, ndim);
}
