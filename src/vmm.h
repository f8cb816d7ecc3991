/* Virtual memory (VirtualMemoryResource, VirtualMemoryBuffer) internals:
 * shared with other sources (IPC) and the tests, then among the vmm_*.c
 * sources. Private: never installed. */
#ifndef CUBUF_VMM_PRIVATE_H
#define CUBUF_VMM_PRIVATE_H

#include <pthread.h>

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

/* The same for [ptr, ptr+size), which must lie inside buf's memory
 * (else CUBUF_ERROR_INVALID_ARGUMENT): what a buffer whose memory is buf's
 * (an adaptor's, over buf's resource) lies on. */
cubuf_status_t cubuf__vmm_chunks_at(const cubuf_buffer_t *buf, CUdeviceptr ptr, size_t size,
                                    cubuf_vmm_chunk_t **chunks, size_t *count, size_t *first_offset);

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
    long waiters; /* the streams and events ranges hold for closes (vmm_close.c) */
} cubuf_vmm_live_t;
void cubuf__vmm_live(cubuf_vmm_live_t *live);

/* Takes (lock true) or drops the lock of the range buf belongs to, as a
 * close of an alias would hold it. CUBUF_ERROR_INVALID_ARGUMENT when buf is
 * not an open VMM buffer with memory. */
cubuf_status_t cubuf__vmm_test_lock_range(cubuf_buffer_t *buf, bool lock);

/* While on, a grow treats the reservation it asks for right at the end of
 * its space as placed elsewhere (what the driver does when those addresses
 * are taken), so a grow past the reserved headroom moves. Process-wide; for
 * tests that must reach the moving path. */
void cubuf__vmm_test_refuse_extension(bool on);

/* ---- inside the virtual memory sources (vmm_*.c) --------------------------------
 *
 * Model. Buffers that alias one another (an allocation and everything
 * modify_allocation made from it) share one range (vmm_range_t, reached from
 * each buffer's membership, buf->impl). The range owns:
 *  - physical allocations (vmm_phys_t, one per cuMemCreate), each counting
 *    the live mappings of it: it is released with its last mapping;
 *  - spaces (vmm_space_t): one contiguous stretch of address space made of
 *    one or more reservations, with its mappings in address order. A grow in
 *    place extends a space; a grow that moves makes a new space that maps
 *    the same physical allocations again;
 *  - members (vmm_member_t): one per open buffer, naming its space and how
 *    many of the space's mappings it covers. A buffer always covers a prefix
 *    of its space (allocations, grows and aliases all start at the base).
 * A mapping is needed while an open buffer's prefix covers it. Each mapping
 * counts the buffers whose prefix ends there (`ends`), so a close finds what
 * to unmap by walking down from its own end, and a grow in place appends:
 * neither touches the rest of the range.
 *
 * Waiting. Only a close that unmaps waits on the host: for its own stream,
 * the open buffers' streams and the range's waits stream. A close that
 * unmaps nothing leaves its stream's work to the waits stream instead (an
 * event recorded on its stream, which waits then waits for), since the
 * stream itself may be destroyed once the buffer is closed. The tokens of
 * open members are written (cubuf__vmm_set_token) and read under the range
 * lock.
 *
 * Every driver call runs with the resource's context pushed and the calling
 * thread's capture mode relaxed (vmm_guard_t).
 *
 * Failure: allocate and grow create everything first and publish nothing
 * until the last driver call succeeded; on failure they undo what they made,
 * in reverse. Close unmaps first (undone by mapping again, since the
 * physical allocations are still held) and only then releases allocations
 * and reservations, which can no longer fail the close.
 *
 * The sources, one concern each:
 *  - vmm_driver.c: the driver calls, counted in cubuf__vmm_live, their quiet
 *    undo variants, and the guard every call runs under;
 *  - vmm_resource.c: options, support checks, the resource and its getters;
 *  - vmm_range.c: ranges, spaces and members, allocation, the IPC queries;
 *  - vmm_grow.c: cubuf_vmm_modify_allocation;
 *  - vmm_close.c: deallocation and the waiting it needs. */

/* A host-memory CPU entry, the owner and the peers. */
#define VMM_MAX_DESCS (2 + CUBUF_VMM_MAX_PEERS)

typedef struct vmm_access {
    CUmemAccessDesc desc[VMM_MAX_DESCS];
    unsigned count;
} vmm_access_t;

typedef struct vmm_res {
    cubuf_vmm_options_t opts; /* validated; location_id resolved; alignment >= gran */
    CUdevice device;
    int ordinal;
    size_t gran;
    bool rdma_supported;
    vmm_access_t access; /* what the resource's own options grant */
    bool fabric_fallback; /* fabric handles asked for, refused: opts.handle_type is POSIX_FD */
} vmm_res_t;

typedef struct vmm_phys {
    CUmemGenericAllocationHandle handle;
    size_t size;
    unsigned maps;   /* live mappings of it, over all spaces */
    unsigned access; /* index into the range's access profiles */
    bool lost;       /* a forgotten space maps it: it stays counted when released */
} vmm_phys_t;

typedef struct vmm_mapping {
    size_t offset; /* from the space's base */
    vmm_phys_t *phys;
    size_t ends; /* open buffers whose prefix ends with this mapping */
} vmm_mapping_t;

typedef struct vmm_resv {
    size_t offset; /* from the space's base */
    size_t size;
} vmm_resv_t;

typedef struct vmm_space {
    CUdeviceptr base;
    vmm_mapping_t *maps; /* in address order, contiguous from base */
    size_t nmaps, cap_maps;
    size_t mapped; /* bytes the mappings cover */
    vmm_resv_t *resv; /* in address order, contiguous from base */
    size_t nresv, cap_resv;
    size_t reserved; /* bytes the reservations cover */
    size_t buffers;  /* open buffers in this space */
} vmm_space_t;

typedef struct vmm_range vmm_range_t;

typedef struct vmm_member {
    vmm_range_t *range;
    vmm_space_t *space;
    size_t count; /* the buffer covers space->maps[0, count) */
    cubuf_buffer_t *buf;
    struct vmm_member *prev, *next;
} vmm_member_t;

struct vmm_range {
    pthread_mutex_t lock;
    vmm_member_t *members; /* open buffers: their deallocation streams */
    size_t nmembers;
    vmm_access_t *access; /* distinct access profiles of the allocations */
    unsigned naccess, cap_access;
    /* The work queued before closes that unmapped nothing (vmm_close.c):
     * `waits`, a stream of the resource's context, waits for it (events
     * recorded on those closes' streams); `pending` says it was given waits
     * since an unmapping close last synchronized it. `event` is recorded
     * again at each such close on a stream of the resource's context. Made
     * on first use, destroyed with the range. */
    CUstream waits;
    CUevent event;
    bool pending;
    /* Default streams such closes could not record (a capture in their
     * context): checked, and synchronized unless a capture is still in the
     * way, by the closes that unmap, until one synchronizes them. A VMM
     * buffer's default streams are bound to the resource's context: three
     * at most. */
    cubuf_stream_token_t held[3];
    unsigned nheld;
};

/* The resource's context pushed and the thread's capture mode relaxed: the
 * mapping calls are synchronous, and in the default (global) capture mode a
 * capture anywhere in the process would make them fail and invalidate it. */
typedef struct vmm_guard {
    cubuf_ctx_guard_t ctx;
    CUstreamCaptureMode mode;
    bool relaxed;
} vmm_guard_t;

/* ---- vmm_driver.c ---------------------------------------------------------
 * What these make or remove is counted in cubuf__vmm_live. A failure is
 * recorded as the thread's last error, with the sizes. */
cubuf_status_t cubuf__vmm_va_reserve(CUdeviceptr *va, size_t size, size_t align, CUdeviceptr hint);
cubuf_status_t cubuf__vmm_phys_create(CUmemGenericAllocationHandle *h, size_t size,
                                      const CUmemAllocationProp *prop);
cubuf_status_t cubuf__vmm_map_phys(CUdeviceptr va, const vmm_phys_t *p);
/* No call when `a` grants nothing: mappings start without access. */
cubuf_status_t cubuf__vmm_set_access(CUdeviceptr va, size_t size, const vmm_access_t *a);
cubuf_status_t cubuf__vmm_unmap(CUdeviceptr va, size_t size);

/* Undoing and releasing, which no caller can be told about: they leave the
 * thread's last error alone, try a failed call once more, then warn. */
void cubuf__vmm_va_free_quiet(CUdeviceptr va, size_t size);
void cubuf__vmm_unmap_quiet(CUdeviceptr va, size_t size);
void cubuf__vmm_release_quiet(CUmemGenericAllocationHandle h, size_t size);
/* The range's waits stream and events (counted as waiters). create runs in
 * the current context; destroy is quiet (tried twice, then a warning). */
cubuf_status_t cubuf__vmm_stream_create(CUstream *s);
cubuf_status_t cubuf__vmm_event_create(CUevent *e);
void cubuf__vmm_stream_destroy_quiet(CUstream s);
void cubuf__vmm_event_destroy_quiet(CUevent e);
/* Maps a physical allocation again where a failed close had unmapped it. */
void cubuf__vmm_remap_quiet(CUdeviceptr va, const vmm_phys_t *p, const vmm_access_t *a);

/* Makes, reserves, maps and grants `a` to one granule of `g` bytes, then
 * undoes it all. Returns the first failing CUresult (recording nothing) and
 * in *call the name of the call that failed. */
CUresult cubuf__vmm_try_granule(const CUmemAllocationProp *prop, size_t g, const vmm_access_t *a,
                                const char **call);

cubuf_status_t cubuf__vmm_guard_enter(const cubuf_resource_t *res, vmm_guard_t *g);
void cubuf__vmm_guard_exit(vmm_guard_t *g);

/* ---- vmm_resource.c ------------------------------------------------------- */

/* The VMM state of res, or NULL when res is not a VMM resource. */
const vmm_res_t *cubuf__vmm_of(const cubuf_resource_t *res);
/* The access entries for memory made with `o`: the CPU for host memory, the
 * owning device, then the peers. Zeroed first, so profiles compare with memcmp. */
void cubuf__vmm_build_access(const vmm_res_t *vr, const cubuf_vmm_options_t *o, vmm_access_t *a);
/* The properties of a new physical allocation. */
void cubuf__vmm_fill_prop(const vmm_res_t *vr, bool rdma, CUmemAllocationProp *prop);
/* Validates the options of a grow against the resource: what must stay the
 * resource's, and the rest as at creation. */
cubuf_status_t cubuf__vmm_grow_options(const vmm_res_t *vr, const cubuf_vmm_options_t *given,
                                       cubuf_vmm_options_t *o, const char *what);

/* ---- vmm_range.c ---------------------------------------------------------- */

/* size rounded up to gran in *out; false when that overflows size_t. */
bool cubuf__vmm_round_up(size_t size, size_t gran, size_t *out);
/* How much to reserve for a space that maps `total` bytes. */
size_t cubuf__vmm_reserve_target(size_t total, size_t gran);
/* round_up to the resource's granularity; CUBUF_ERROR_OUT_OF_RANGE (naming
 * `what`) when the result does not fit in size_t. */
cubuf_status_t cubuf__vmm_round_size(const vmm_res_t *vr, size_t size, size_t *out, const char *what);

void cubuf__vmm_range_free(vmm_range_t *r);
/* The index of an access profile in the range, added if new. */
cubuf_status_t cubuf__vmm_range_access_index(vmm_range_t *r, const vmm_access_t *a,
                                             unsigned *index);
void cubuf__vmm_range_link(vmm_range_t *r, vmm_member_t *m);
void cubuf__vmm_range_unlink(vmm_range_t *r, vmm_member_t *m);
/* A space with room for `maps` mappings and `resv` reservations. */
vmm_space_t *cubuf__vmm_space_new(size_t maps, size_t resv);
void cubuf__vmm_space_free(vmm_space_t *s);
/* Makes room for `maps` more mappings and `resv` more reservations. */
bool cubuf__vmm_space_make_room(vmm_space_t *s, size_t maps, size_t resv);

/* A new range of `size` bytes (rounded up) whose first member is buf. */
cubuf_status_t cubuf__vmm_range_create(cubuf_resource_t *res, const cubuf_vmm_options_t *o,
                                       size_t size, cubuf_buffer_t *buf, const char *what);
/* The resource's allocate (vmm_range.c) and deallocate (vmm_close.c). */
cubuf_status_t cubuf__vmm_allocate(cubuf_resource_t *res, cubuf_buffer_t *buf, CUstream stream,
                                   bool in_ctx, cubuf_charge_t *charge);
/* *charge: the physical allocations the close released (none while an
 * alias still maps them). */
cubuf_status_t cubuf__vmm_deallocate(cubuf_resource_t *res, cubuf_buffer_t *buf,
                                     const cubuf_stream_token_t *token, cubuf_charge_t *charge);
/* The resource's set_token (vmm_close.c): the store under the range lock,
 * where closes of aliases read it. */
void cubuf__vmm_set_token(cubuf_resource_t *res, cubuf_buffer_t *buf,
                          const cubuf_stream_token_t *token);

#endif
