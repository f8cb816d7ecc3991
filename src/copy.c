/* Copies and fills of buffers (Buffer.copy_to / copy_from / fill) and
 * batches of raw copies.
 *
 * The calls without options are hot paths: they cost the raw cuMemcpyAsync
 * or cuMemsetD*Async plus, when the buffer belongs to a context, one
 * cuCtxGetCurrent (cubuf__ctx_push skips the push when that context is
 * already current). Everything else on them is plain C on the buffer
 * structs: no capture query, no allocation, no other driver call. */
#include <stdlib.h>
#include <string.h>

#include "abi.h"
#include "internal.h"
#include "staging.h"

/* Runs in dst's context, else src's, else the caller's current one. */
static CUcontext copy_ctx(const cubuf_buffer_t *dst, const cubuf_buffer_t *src)
{
    CUcontext c = cubuf__buffer_exec_ctx(dst);
    return c ? c : cubuf__buffer_exec_ctx(src);
}

/* ---- copy options ---------------------------------------------------------- */

static bool is_legacy_stream(CUstream s) { return s == NULL || s == CU_STREAM_LEGACY; }

static cubuf_status_t check_location(cubuf_location_hint_t kind, int id, const char *which,
                                     const char *what)
{
    switch (kind) {
    case CUBUF_LOCATION_NONE:
    case CUBUF_LOCATION_HOST: return CUBUF_SUCCESS;
    case CUBUF_LOCATION_DEVICE:
    case CUBUF_LOCATION_HOST_NUMA:
        if (id >= 0) return CUBUF_SUCCESS;
        return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT, "%s: options %s location id %d is negative",
                           what, which, id);
    }
    return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT, "%s: options %s location %d is not a "
                       "cubuf_location_hint_t", what, which, (int)kind);
}

/* The checks that need no driver: the struct (copied into *o, newer fields
 * defaulted: the ABI rule of src/abi.h), its enums, the stream kind. */
static cubuf_status_t check_options(const cubuf_copy_options_t *options, CUstream stream,
                                    const char *what, cubuf_copy_options_t *o)
{
    *o = (cubuf_copy_options_t)CUBUF_COPY_OPTIONS_INIT;
    cubuf_status_t st = cubuf__struct_in(what, "cubuf_copy_options_t", o, sizeof *o, options,
                                         CUBUF_COPY_OPTIONS_SIZE_V1);
    if (st != CUBUF_SUCCESS) return st;
    if (o->src_access_order != CUBUF_SRC_ACCESS_STREAM &&
        o->src_access_order != CUBUF_SRC_ACCESS_DURING_API_CALL &&
        o->src_access_order != CUBUF_SRC_ACCESS_ANY)
        return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,
                           "%s: options->src_access_order %d is not a cubuf_src_access_order_t",
                           what, (int)o->src_access_order);
    st = check_location(o->src_location, o->src_location_id, "source", what);
    if (st == CUBUF_SUCCESS)
        st = check_location(o->dst_location, o->dst_location_id, "destination", what);
    if (st != CUBUF_SUCCESS) return st;
    /* cuMemcpyBatchAsync rejects the legacy stream outright; the per-thread
     * default stream is accepted, so point the caller there. */
    if (is_legacy_stream(stream))
        return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,
                           "%s: copy options are not accepted with the legacy default stream; "
                           "use CU_STREAM_PER_THREAD or a created stream", what);
    return CUBUF_SUCCESS;
}

/* A graph cannot hold the attributes, so options and capture do not mix.
 * A default stream is ctx's (NULL: the current context's). */
static cubuf_status_t refuse_capture_with_options(CUstream stream, CUcontext ctx, const char *what)
{
    CUstreamCaptureStatus cs = CU_STREAM_CAPTURE_STATUS_NONE;
    cubuf_status_t st = cubuf__stream_capture_status(stream, ctx, &cs);
    if (st != CUBUF_SUCCESS) return st;
    if (cs != CU_STREAM_CAPTURE_STATUS_NONE)
        return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,
                           "%s: copy options are not accepted on a capturing stream (a graph "
                           "cannot represent them); pass NULL options there", what);
    return CUBUF_SUCCESS;
}

static CUmemLocation to_location(cubuf_location_hint_t kind, int id)
{
    CUmemLocation loc = {CU_MEM_LOCATION_TYPE_INVALID, 0};
    switch (kind) {
    case CUBUF_LOCATION_NONE: break;
    case CUBUF_LOCATION_DEVICE:
        loc.type = CU_MEM_LOCATION_TYPE_DEVICE;
        loc.id = id;
        break;
    case CUBUF_LOCATION_HOST: loc.type = CU_MEM_LOCATION_TYPE_HOST; break;
    case CUBUF_LOCATION_HOST_NUMA:
        loc.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
        loc.id = id;
        break;
    }
    return loc;
}

static CUmemcpyAttributes to_attributes(const cubuf_copy_options_t *o)
{
    CUmemcpyAttributes a;
    memset(&a, 0, sizeof a);
    switch (o->src_access_order) {
    case CUBUF_SRC_ACCESS_STREAM: a.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM; break;
    case CUBUF_SRC_ACCESS_DURING_API_CALL:
        a.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_DURING_API_CALL;
        break;
    case CUBUF_SRC_ACCESS_ANY: a.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_ANY; break;
    }
    a.srcLocHint = to_location(o->src_location, o->src_location_id);
    a.dstLocHint = to_location(o->dst_location, o->dst_location_id);
    a.flags = o->prefer_overlap_with_compute ? CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
                                             : CU_MEMCPY_FLAG_DEFAULT;
    return a;
}

/* ---- DURING_API_CALL, honoured by cubuf ----------------------------------
 *
 * The driver does not keep this promise by itself (seen on the H200, driver
 * 580: from 1 MiB of pageable memory onto a busy stream the call returns at
 * once and the device gets bytes written after it; from pinned and device
 * memory it waits for the stream), and a driver without the attributed copy
 * has no way to ask for it. So cubuf reads the sources itself before the
 * call returns, into one block of pinned staging memory (staging.c): by the
 * host for pageable memory, by the driver on a private non-blocking stream,
 * synchronized, for pinned, device and managed memory.
 * The copies then go from that block in stream order, with the options'
 * other hints, and the block is freed on the stream after them. For a device
 * destination nothing waits for the stream (the driver makes a copy to host
 * memory synchronous). */

/* Reads [src, src+size) into the pinned block at dst now: pageable memory
 * by the host, the rest enqueued on `side` (synchronized by the caller). */
static cubuf_status_t read_now(CUdeviceptr dst, CUdeviceptr src, size_t size, CUstream side)
{
    unsigned int type = 0;
    uint64_t managed = 0; /* the driver writes a bool; a wide zeroed slot reads the same */
    CUpointer_attribute attrs[] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_IS_MANAGED};
    void *data[] = {&type, &managed};
    CUresult r = CU_CALL(cuPointerGetAttributes, 2, attrs, data, src);
    if (r == CUDA_ERROR_INVALID_VALUE) type = 0; /* memory the driver does not know: pageable */
    else if (r != CUDA_SUCCESS) return cubuf__cu_status(r, "cuPointerGetAttributes");
    if (type == 0 && !managed) {
        memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, size);
        return CUBUF_SUCCESS;
    }
    /* Device, managed and pinned memory (whose device alias need not be a
     * host address) are read by the driver, on the idle private stream. */
    return CU(cuMemcpyAsync, dst, src, size, side);
}

/* Frees the staging block on `s` (after what `s` does with it); where that
 * cannot be enqueued, synchronizes `s` and frees it on `side`. */
static void free_block(CUdeviceptr block, CUstream s, CUstream side, const char *what)
{
    if (s && CU_CALL(cuMemFreeAsync, block, s) == CUDA_SUCCESS) return;
    if ((!s || CU_CALL(cuStreamSynchronize, s) == CUDA_SUCCESS) &&
        CU_CALL(cuMemFreeAsync, block, side) == CUDA_SUCCESS &&
        CU_CALL(cuStreamSynchronize, side) == CUDA_SUCCESS)
        return;
    cubuf__warn(CUBUF_ERROR_DRIVER, "%s: a block of staging memory could not be freed and leaks",
                what);
}

static cubuf_status_t enqueue(const cubuf_copy_t *copies, size_t count, size_t nonempty,
                              CUstream stream, const cubuf_copy_options_t *options, size_t *failed);

/* The sources read into a block of the given size, then the copies from it
 * enqueued on `stream`. `staged` has room for the non-empty copies. */
static cubuf_status_t stage_and_copy(const cubuf_copy_t *copies, size_t count, size_t nonempty,
                                     size_t total, CUstream stream, const cubuf_copy_options_t *options,
                                     CUstream side, cubuf_copy_t *staged, const char *what,
                                     size_t *failed)
{
    CUmemoryPool pool = NULL;
    CUdeviceptr block = 0;
    cubuf_status_t st = cubuf__staging_pool(&pool);
    if (st == CUBUF_SUCCESS) st = CU(cuMemAllocFromPoolAsync, &block, total, pool, side);
    if (st != CUBUF_SUCCESS) return st;
    if ((st = CU(cuStreamSynchronize, side)) != CUBUF_SUCCESS) goto fail; /* the block is ours now */
    CUdeviceptr at = block;
    for (size_t i = 0, k = 0; i < count; i++) {
        if (!copies[i].size) continue;
        if ((st = read_now(at, copies[i].src, copies[i].size, side)) != CUBUF_SUCCESS) {
            if (failed) *failed = i; /* this copy's source could not be read */
            goto fail;
        }
        staged[k++] = (cubuf_copy_t){copies[i].dst, at, copies[i].size};
        at += copies[i].size;
    }
    if ((st = CU(cuStreamSynchronize, side)) != CUBUF_SUCCESS) goto fail;
    cubuf_copy_options_t o = *options;
    o.src_access_order = CUBUF_SRC_ACCESS_STREAM;
    o.src_location = CUBUF_LOCATION_HOST;
    size_t staged_failed = nonempty;
    if ((st = enqueue(staged, nonempty, nonempty, stream, &o, &staged_failed)) != CUBUF_SUCCESS) {
        if (failed && staged_failed < nonempty) /* the caller's index of that copy */
            for (size_t i = 0, k = 0; i < count; i++)
                if (copies[i].size && k++ == staged_failed) *failed = i;
        /* Copies enqueued before the failure may still read the block. */
        free_block(block, stream, side, what);
        return st;
    }
    free_block(block, stream, side, what);
    return CUBUF_SUCCESS;
fail:
    free_block(block, NULL, side, what);
    return st;
}

/* The copies with DURING_API_CALL, in the current context. */
static cubuf_status_t copy_during_call(const cubuf_copy_t *copies, size_t count, size_t nonempty,
                                       CUstream stream, const cubuf_copy_options_t *options,
                                       const char *what, size_t *failed)
{
    size_t total = 0;
    for (size_t i = 0; i < count; i++)
        if (__builtin_add_overflow(total, copies[i].size, &total))
            return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT, "%s: the copies' sizes overflow", what);
    cubuf_copy_t *staged = cubuf__malloc(nonempty * sizeof *staged);
    if (!staged)
        return cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "%s: cannot allocate %zu copy records", what,
                           nonempty);
    CUstream side = NULL;
    cubuf_status_t st = CU(cuStreamCreate, &side, CU_STREAM_NON_BLOCKING);
    if (st == CUBUF_SUCCESS) {
        st = stage_and_copy(copies, count, nonempty, total, stream, options, side, staged, what,
                            failed);
        CUresult r = CU_CALL(cuStreamDestroy, side);
        if (r != CUDA_SUCCESS) cubuf__warn(cubuf__cu_map(r), "%s: cuStreamDestroy failed", what);
    }
    if (st != CUBUF_SUCCESS) cubuf__detail_append("%s: reading the source during the call", what);
    free(staged);
    return st;
}

/* ---- batches and enqueueing ------------------------------------------------- */

/* The non-empty copies of a batch in the three arrays cuMemcpyBatchAsync takes. */
typedef struct batch_arrays {
    CUdeviceptr *dsts, *srcs;
    size_t *sizes;
    size_t n;
    CUdeviceptr small_dsts[8], small_srcs[8];
    size_t small_sizes[8];
} batch_arrays_t;

static cubuf_status_t batch_arrays_fill(batch_arrays_t *b, const cubuf_copy_t *copies, size_t count,
                                        size_t nonempty)
{
    b->n = 0;
    if (nonempty <= sizeof b->small_sizes / sizeof b->small_sizes[0]) {
        b->dsts = b->small_dsts;
        b->srcs = b->small_srcs;
        b->sizes = b->small_sizes;
    } else {
        b->dsts = cubuf__malloc(nonempty * sizeof *b->dsts);
        b->srcs = cubuf__malloc(nonempty * sizeof *b->srcs);
        b->sizes = cubuf__malloc(nonempty * sizeof *b->sizes);
        if (!b->dsts || !b->srcs || !b->sizes) {
            free(b->dsts);
            free(b->srcs);
            free(b->sizes);
            return cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY,
                               "cubuf_copy_batch: cannot allocate the arrays for %zu copies",
                               nonempty);
        }
    }
    for (size_t i = 0; i < count; i++) {
        if (!copies[i].size) continue;
        b->dsts[b->n] = copies[i].dst;
        b->srcs[b->n] = copies[i].src;
        b->sizes[b->n] = copies[i].size;
        b->n++;
    }
    return CUBUF_SUCCESS;
}

static void batch_arrays_free(batch_arrays_t *b)
{
    if (b->sizes == b->small_sizes) return;
    free(b->dsts);
    free(b->srcs);
    free(b->sizes);
}

/* One cuMemcpyAsync per copy; on failure *failed is the copy's index. */
static cubuf_status_t batch_plain(const cubuf_copy_t *copies, size_t count, CUstream stream,
                                  size_t *failed)
{
    for (size_t i = 0; i < count; i++) {
        if (!copies[i].size) continue;
        cubuf_status_t st = CU(cuMemcpyAsync, copies[i].dst, copies[i].src, copies[i].size, stream);
        if (st != CUBUF_SUCCESS) {
            cubuf__detail_append("cubuf_copy_batch: copy %zu of %zu bytes", i, copies[i].size);
            if (failed) *failed = i;
            return st;
        }
    }
    return CUBUF_SUCCESS;
}

static cubuf_status_t batch_driver(const cubuf_copy_t *copies, size_t count, size_t nonempty,
                                   CUstream stream, const cubuf_copy_options_t *options)
{
    static const cubuf_copy_options_t defaults = CUBUF_COPY_OPTIONS_INIT;
    batch_arrays_t b;
    cubuf_status_t st = batch_arrays_fill(&b, copies, count, nonempty);
    if (st != CUBUF_SUCCESS) return st;
    CUmemcpyAttributes attr = to_attributes(options ? options : &defaults);
    size_t first = 0;
    st = CU(cuMemcpyBatchAsync, b.dsts, b.srcs, b.sizes, b.n, &attr, &first, 1, stream);
    if (st != CUBUF_SUCCESS) cubuf__detail_append("cubuf_copy_batch of %zu copies", b.n);
    batch_arrays_free(&b);
    return st;
}

/* Whether a batch without options can go to cuMemcpyBatchAsync: not on the
 * legacy stream (refused by the driver), and not while capturing (13.0
 * drivers cannot capture it; plain copies can be captured). */
static cubuf_status_t batch_can_use_driver(CUstream stream, bool *use)
{
    *use = false;
    if (!cubuf__drv.cuMemcpyBatchAsync || is_legacy_stream(stream)) return CUBUF_SUCCESS;
    CUstreamCaptureStatus cs = CU_STREAM_CAPTURE_STATUS_NONE;
    cubuf_status_t st = cubuf__stream_capture_status(stream, NULL, &cs);
    if (st == CUBUF_SUCCESS) *use = cs == CU_STREAM_CAPTURE_STATUS_NONE;
    return st;
}

/* Enqueues the non-empty copies on `stream`, in the current context. With
 * options: through cuMemcpyBatchAsync (or, where the driver lacks it,
 * STREAM and ANY as plain copies: ANY only relaxes the order). Without: a
 * batch where it gains something and is allowed, else plain copies. On
 * failure *failed is the index of a failed plain copy, else left alone. */
static cubuf_status_t enqueue(const cubuf_copy_t *copies, size_t count, size_t nonempty,
                              CUstream stream, const cubuf_copy_options_t *options, size_t *failed)
{
    bool use_driver = options && cubuf__drv.cuMemcpyBatchAsync;
    cubuf_status_t st;
    /* A lone copy gains nothing from the batch entry point. */
    if (!options && nonempty > 1 && (st = batch_can_use_driver(stream, &use_driver)) != CUBUF_SUCCESS)
        return st;
    return use_driver ? batch_driver(copies, count, nonempty, stream, options)
                      : batch_plain(copies, count, stream, failed);
}

/* Copies with options, the copy's context current: refused on a capturing
 * stream, DURING_API_CALL honoured by cubuf, the rest enqueued as is. */
static cubuf_status_t copy_with_options(const cubuf_copy_t *copies, size_t count, size_t nonempty,
                                        CUstream stream, const cubuf_copy_options_t *o,
                                        const char *what, size_t *failed)
{
    cubuf_status_t st = refuse_capture_with_options(stream, NULL, what);
    if (st != CUBUF_SUCCESS) return st;
    if (o->src_access_order == CUBUF_SRC_ACCESS_DURING_API_CALL)
        return copy_during_call(copies, count, nonempty, stream, o, what, failed);
    return enqueue(copies, count, nonempty, stream, o, failed);
}

cubuf_status_t cubuf_copy_batch(const cubuf_copy_t *copies, size_t count, CUstream stream,
                                const cubuf_copy_options_t *options, size_t *failed_index)
{
    static const char what[] = "cubuf_copy_batch";
    size_t failed = count;
    cubuf_status_t st = CUBUF_SUCCESS;
    size_t nonempty = 0;
    if (count == 0) goto done;
    if (!copies) {
        st = cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT, "%s: copies is NULL", what);
        goto done;
    }
    cubuf_copy_options_t o;
    if (options && (st = check_options(options, stream, what, &o)) != CUBUF_SUCCESS) goto done;
    for (size_t i = 0; i < count; i++) {
        if (!copies[i].size) continue;
        if (!copies[i].dst || !copies[i].src) {
            failed = i;
            st = cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT, "%s: copy %zu has a %s address 0 with "
                             "size %zu", what, i, copies[i].dst ? "source" : "destination",
                             copies[i].size);
            goto done;
        }
        nonempty++;
    }
    if (nonempty == 0) goto done;
    if ((st = cubuf__driver_load()) != CUBUF_SUCCESS) goto done;
    st = options ? copy_with_options(copies, count, nonempty, stream, &o, what, &failed)
                 : enqueue(copies, count, nonempty, stream, NULL, &failed);
done:
    if (st != CUBUF_SUCCESS && failed_index) *failed_index = failed;
    return st;
}

/* ---- buffer copies --------------------------------------------------------- */

/* Device memory of two different devices, each with its context. Such a
 * copy goes through cuMemcpyPeerAsync: with cuMemcpyAsync the driver (580)
 * refuses pool memory that the other device was not granted
 * (CUDA_ERROR_INVALID_VALUE), which is what context pools hold. */
static bool between_devices(const cubuf_buffer_t *dst, const cubuf_buffer_t *src)
{
    const unsigned host = CUBUF__HOST_ACCESSIBLE | CUBUF__MANAGED;
    const unsigned dev = CUBUF__DEVICE_ACCESSIBLE;
    return dst->device_id >= 0 && src->device_id >= 0 && dst->device_id != src->device_id &&
           (dst->flags & (host | dev)) == dev && (src->flags & (host | dev)) == dev &&
           cubuf__buffer_exec_ctx(dst) && cubuf__buffer_exec_ctx(src);
}

cubuf_status_t cubuf_buffer_copy_from(cubuf_buffer_t *dst, const cubuf_buffer_t *src,
                                      CUstream stream, const cubuf_copy_options_t *options)
{
    static const char what[] = "cubuf_buffer_copy_from";
    CHECK_ARG(dst && src, "%s: NULL buffer", what);
    if (dst->closed || src->closed)
        return cubuf__fail(CUBUF_ERROR_CLOSED, "%s: the %s buffer is closed", what,
                           dst->closed ? "destination" : "source");
    if (dst->size != src->size)
        return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,
                           "%s: sizes differ (destination %zu bytes, source %zu bytes)", what,
                           dst->size, src->size);
    cubuf_status_t st;
    cubuf_copy_options_t o;
    if (options && (st = check_options(options, stream, what, &o)) != CUBUF_SUCCESS) return st;
    size_t size = src->size;
    if (size == 0) return CUBUF_SUCCESS;
    if ((st = cubuf__driver_load()) != CUBUF_SUCCESS) return st;
    cubuf_ctx_guard_t g;
    if ((st = cubuf__ctx_push(copy_ctx(dst, src), &g)) != CUBUF_SUCCESS) return st;
    if (!options && between_devices(dst, src)) {
        st = CU(cuMemcpyPeerAsync, dst->ptr, cubuf__buffer_exec_ctx(dst), src->ptr,
                cubuf__buffer_exec_ctx(src), size, stream);
        if (st != CUBUF_SUCCESS)
            cubuf__detail_append("%s of %zu bytes from device %d to device %d", what, size,
                                 src->device_id, dst->device_id);
    } else if (!options) {
        st = CU(cuMemcpyAsync, dst->ptr, src->ptr, size, stream);
        if (st != CUBUF_SUCCESS) cubuf__detail_append("%s of %zu bytes", what, size);
    } else {
        const cubuf_copy_t one = {dst->ptr, src->ptr, size};
        st = copy_with_options(&one, 1, 1, stream, &o, what, NULL);
        if (st != CUBUF_SUCCESS) cubuf__detail_append("%s of %zu bytes", what, size);
    }
    cubuf__ctx_pop(&g);
    return st;
}

cubuf_status_t cubuf_buffer_copy_to(const cubuf_buffer_t *src, cubuf_buffer_t *dst,
                                    CUstream stream, const cubuf_copy_options_t *options)
{
    CHECK_ARG(src && dst, "cubuf_buffer_copy_to: NULL buffer");
    return cubuf_buffer_copy_from(dst, src, stream, options);
}

cubuf_status_t cubuf_buffer_copy_to_new(const cubuf_buffer_t *src, CUstream stream,
                                        const cubuf_copy_options_t *options, cubuf_buffer_t **out)
{
    static const char what[] = "cubuf_buffer_copy_to_new";
    CHECK_ARG(src && out, "%s: NULL argument", what);
    cubuf_status_t st = cubuf__buffer_check_open(src, what);
    if (st != CUBUF_SUCCESS) return st;
    /* A slice's or a based view's memory is its root's: allocate from there. */
    const cubuf_buffer_t *root = src->parent ? src->parent : src; /* parents are roots */
    if (!root->resource)
        return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,
                           "%s: the source is a view that no memory resource owns; there is "
                           "nothing to allocate the copy from (use cubuf_buffer_copy_to with a "
                           "destination)", what);
    /* Refuse bad options before allocating anything, a capturing stream
     * too: an allocation there would reach the caller's capture. The copy
     * runs in src's context (the new buffer's is its root's). */
    if (options) {
        cubuf_copy_options_t o;
        if ((st = check_options(options, stream, what, &o)) != CUBUF_SUCCESS ||
            (st = cubuf__driver_load()) != CUBUF_SUCCESS ||
            (st = refuse_capture_with_options(stream, cubuf__buffer_exec_ctx(src), what)) !=
                CUBUF_SUCCESS)
            return st;
    }
    cubuf_buffer_t *buf = NULL;
    if ((st = cubuf_resource_allocate(root->resource, src->size, stream, &buf)) != CUBUF_SUCCESS)
        return st;
    /* A resource may round the size up (virtual memory, to its granularity,
     * for a slice of a root): the copy fills the first src->size bytes. */
    cubuf_buffer_t *dst = buf;
    if (buf->size != src->size && (st = cubuf_buffer_slice(buf, 0, src->size, &dst)) != CUBUF_SUCCESS) {
        cubuf_buffer_release(buf);
        return st;
    }
    st = cubuf_buffer_copy_from(dst, src, stream, options);
    if (dst != buf) cubuf_buffer_release(dst);
    if (st != CUBUF_SUCCESS) {
        /* Freed on `stream`, after whatever part of the copy was enqueued. */
        cubuf_buffer_release(buf);
        return st;
    }
    *out = buf;
    return CUBUF_SUCCESS;
}

/* ---- fills ----------------------------------------------------------------- */

cubuf_status_t cubuf_buffer_fill(cubuf_buffer_t *buf, const void *pattern, size_t pattern_size,
                                 CUstream stream)
{
    static const char what[] = "cubuf_buffer_fill";
    CHECK_ARG(buf && pattern, "%s: NULL argument", what);
    CHECK_ARG(pattern_size == 1 || pattern_size == 2 || pattern_size == 4,
              "%s: the pattern is %zu bytes; it must be 1, 2 or 4", what, pattern_size);
    cubuf_status_t st = cubuf__buffer_check_open(buf, what);
    if (st != CUBUF_SUCCESS) return st;
    size_t size = buf->size;
    CHECK_ARG(size % pattern_size == 0,
              "%s: the buffer size %zu is not a multiple of the %zu-byte pattern", what, size,
              pattern_size);
    if (size == 0) return CUBUF_SUCCESS;
    /* cuMemsetD16/D32 need an aligned address (a slice may not have one). */
    CHECK_ARG(buf->ptr % pattern_size == 0,
              "%s: address 0x%llx is not aligned to the %zu-byte pattern", what,
              (unsigned long long)buf->ptr, pattern_size);
    if ((st = cubuf__driver_load()) != CUBUF_SUCCESS) return st;
    cubuf_ctx_guard_t g;
    if ((st = cubuf__ctx_push(cubuf__buffer_exec_ctx(buf), &g)) != CUBUF_SUCCESS) return st;
    /* The pattern's bytes are copied as they lie in memory, so the device
     * (little-endian, like every host CUDA runs on) repeats them in order. */
    if (pattern_size == 1) {
        unsigned char v;
        memcpy(&v, pattern, 1);
        st = CU(cuMemsetD8Async, buf->ptr, v, size, stream);
    } else if (pattern_size == 2) {
        unsigned short v;
        memcpy(&v, pattern, 2);
        st = CU(cuMemsetD16Async, buf->ptr, v, size / 2, stream);
    } else {
        unsigned int v;
        memcpy(&v, pattern, 4);
        st = CU(cuMemsetD32Async, buf->ptr, v, size / 4, stream);
    }
    if (st != CUBUF_SUCCESS) cubuf__detail_append("%s of %zu bytes", what, size);
    cubuf__ctx_pop(&g);
    return st;
}

cubuf_status_t cubuf_buffer_fill_byte(cubuf_buffer_t *buf, long long value, CUstream stream)
{
    CHECK_ARG(buf, "cubuf_buffer_fill_byte: buf is NULL");
    if (value < 0 || value > 255)
        return cubuf__fail(CUBUF_ERROR_OUT_OF_RANGE,
                           "cubuf_buffer_fill_byte: value %lld is outside [0, 256)", value);
    unsigned char v = (unsigned char)value;
    return cubuf_buffer_fill(buf, &v, 1, stream);
}
