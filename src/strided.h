/* The byte span of a strided array (strided.c): what pyarrow's
 * buffer_from_object and DLPack's tensors share. Private: never installed. */
#ifndef CUBUF_STRIDED_H
#define CUBUF_STRIDED_H

#include "common.h"

/*
 * Where the elements of an array reach, relative to its element 0: from
 * *lo (<= 0) bytes, *len bytes up to the end of the highest element; *len
 * is 0 when a dimension has length 0. `strides` are in units of `unit`
 * bytes (1: bytes, as pyarrow; itemsize: elements, as DLPack); NULL means
 * C-contiguous. `used` (may be NULL) receives the strides in those units.
 * Shapes must be known non-negative. Every step is overflow-checked:
 * CUBUF_ERROR_OUT_OF_RANGE (naming `what`) when the span does not fit in
 * 64 bits.
 */
cubuf_status_t cubuf__strided_span(const char *what, int ndim, const int64_t *shape,
                                   const int64_t *strides, size_t unit, size_t itemsize,
                                   int64_t *used, int64_t *lo, uint64_t *len);

#endif
