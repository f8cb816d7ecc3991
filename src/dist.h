/* What the distributed-engine sources share (include/cubuf/dist.h): the
 * span of memory a buffer lies in, as dma-buf export and the registration
 * queries see it. Private. */
#ifndef CUBUF_DIST_PRIVATE_H
#define CUBUF_DIST_PRIVATE_H

#include "cubuf/dist.h"
#include "internal.h"
#include "vmm.h"

typedef struct cubuf_span {
    CUdeviceptr base;             /* first byte of the span */
    size_t extent;                /* bytes of the span */
    size_t offset;                /* the buffer's pointer - base */
    unsigned long long buffer_id; /* CU_POINTER_ATTRIBUTE_BUFFER_ID at the buffer's pointer */
    /* Virtual memory made by a VMM resource: the physical allocations, in
     * address order, offsets from base (owned; cubuf__span_free). */
    cubuf_vmm_chunk_t *chunks;
    size_t nchunks;
    /* Other memory: the driver's attributes of the allocation. */
    unsigned handle_types;
    bool rdma;
    bool managed;     /* CU_POINTER_ATTRIBUTE_IS_MANAGED */
    bool from_pool;   /* CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE set */
} cubuf_span_t;

/* Checks buf (NULL, closed, size 0: the statuses of include/cubuf/dist.h,
 * messages naming `what`) and makes the context the buffer belongs to
 * current (guard: pop with cubuf__ctx_pop). */
cubuf_status_t cubuf__span_enter(const cubuf_buffer_t *buf, const char *what, cubuf_ctx_guard_t *guard);

/* The span of an entered buffer. Host-only memory (the driver does not know
 * the pointer) gives CUBUF_ERROR_INVALID_ARGUMENT; memory outside the one
 * allocation the driver reports, CUBUF_ERROR_NOT_SUPPORTED. */
cubuf_status_t cubuf__span_get(const cubuf_buffer_t *buf, const char *what, cubuf_span_t *span);
void cubuf__span_free(cubuf_span_t *span);

#endif
