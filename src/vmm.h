/* Virtual memory internals shared with other sources (IPC) and the tests.
 * Private: never installed. */
#ifndef CUBUF_VMM_PRIVATE_H
#define CUBUF_VMM_PRIVATE_H

#include "internal.h"

typedef struct cubuf_vmm_chunk {
    CUmemGenericAllocationHandle handle;
    size_t offset;
    size_t size;
} cubuf_vmm_chunk_t;

/* The physical allocations behind buf's mapping in address order; offsets
 * relative to the start of buf's mapping (its first chunk); *first_offset =
 * buf->ptr minus the start of the first chunk. Caller frees *chunks.
 *
 * buf may be a VMM buffer or a slice of one (then the chunks are those that
 * overlap the slice). The handles stay owned by the range: valid while buf
 * is open; the caller must not release them. An empty buffer gives
 * *chunks NULL, *count 0 and *first_offset 0.
 * Returns CUBUF_ERROR_INVALID_ARGUMENT (NULL argument, not a VMM buffer),
 * CUBUF_ERROR_CLOSED (buf or the buffer it slices is closed),
 * CUBUF_ERROR_OUT_OF_MEMORY. Thread-safe with grows and closes of aliases. */
cubuf_status_t cubuf__vmm_chunks(const cubuf_buffer_t *buf, cubuf_vmm_chunk_t **chunks, size_t *count,
                                 size_t *first_offset);

/* The handle type the resource's physical allocations are created with
 * (CU_MEM_HANDLE_TYPE_NONE for a resource that is not a VMM resource). */
CUmemAllocationHandleType cubuf__vmm_handle_type(const cubuf_resource_t *res);

/* The resource's granularity (0 for a resource that is not a VMM resource). */
size_t cubuf__vmm_granularity(const cubuf_resource_t *res);

/* ---- for tests ----------------------------------------------------------- */

/* Where a grow of buf in place would continue: *end is the address right
 * after the range's reservations that follow buf's mapping, *headroom the
 * bytes already reserved (and unmapped) right after buf. *extendable is false
 * when another alias maps the addresses right after buf, so a grow of buf
 * must move. Returns CUBUF_ERROR_INVALID_ARGUMENT / CUBUF_ERROR_CLOSED as
 * cubuf__vmm_chunks does. */
cubuf_status_t cubuf__vmm_tail(const cubuf_buffer_t *buf, CUdeviceptr *end, size_t *headroom,
                               bool *extendable);

/* Process-wide counts of what cubuf's VMM code holds now: reservations,
 * mappings and physical allocation handles. Leak checks compare them with a
 * baseline. */
typedef struct cubuf_vmm_live {
    long reservations;
    long mappings;
    long allocations;
} cubuf_vmm_live_t;
void cubuf__vmm_live(cubuf_vmm_live_t *live);

#endif
