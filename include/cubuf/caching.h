/*
 * cubuf/caching.h — a stream-ordered caching resource over any resource, and
 * the entry points that make it the allocator of PyTorch and CuPy.
 *
 * Include <cubuf/caching.h> (it includes <cubuf.h>). The general rules of
 * cubuf.h hold here too.
 *
 * The rules of the cache (docs/DESIGN.md, "The caching resource", says why):
 *  - Size classes. A request of n bytes (0 < n <= max_cached_size) is served
 *    by a block of its class: n rounded up to 512 bytes, then, above 4 KiB,
 *    up to the next of eight steps per power of two (n in (2^k, 2^(k+1)]
 *    rounds up to a multiple of 2^k / 8). The internal waste of a block is
 *    below 512 bytes + 12.5% of the request (cubuf_caching_class_size gives
 *    the class; the statistics report the waste of the live blocks).
 *    Blocks are never split or merged: a request above max_cached_size
 *    passes to the upstream at its own size and goes back to the upstream
 *    when deallocated (counted in the statistics, never cached).
 *  - Per-stream free lists. A block deallocated on stream S is cached on S;
 *    the next allocation of its class on S takes it back without a driver
 *    call, a lock other callers of other streams take, or a host
 *    allocation. Streams are told apart by their CUstream handle; the
 *    legacy default stream (0 and CU_STREAM_LEGACY) is one stream for the
 *    resource (the memory is one device's: use the device's primary
 *    context, as the frameworks do, or one context throughout), and
 *    CU_STREAM_PER_THREAD is one stream per calling thread.
 *  - Across streams. An allocation on S that finds nothing of its class on
 *    S takes a cached block of that class from another stream T that caches
 *    at least two of them (so that streams which each reuse their own block
 *    keep it rather than trading it back and forth), or from any stream T
 *    caching one when the upstream is out of memory: an event recorded on T
 *    at that moment, waited on by S (cuEventRecord, cuStreamWaitEvent),
 *    orders everything T had queued, the deallocation included, before S's
 *    use. The block taken is the one T cached last. Blocks of another thread's
 *    per-thread default stream are not taken (no thread can name that
 *    stream). If the ordering fails the block stays on T. For an upstream
 *    whose memory is not device accessible no device work can use a block,
 *    and it is taken as is.
 *  - Otherwise the upstream allocates the class size on S
 *    (cubuf_resource_allocate_raw). When it returns
 *    CUBUF_ERROR_OUT_OF_MEMORY and no stream caches a block of the class,
 *    the cache gives every cached block back to
 *    the upstream (each ordered on the stream it is cached on, which is then
 *    synchronized so that its memory is free for any stream) and retries
 *    once; a second failure returns CUBUF_ERROR_OUT_OF_MEMORY whose detail
 *    (cubuf_last_error) reports the requested bytes, the class, and the
 *    live, cached and largest free (cached) bytes before the release.
 *  - Capture. A hit makes no driver call and no stream operation, so it
 *    never breaks a capture. A miss on a capturing stream takes nothing
 *    from other streams and does not release-and-retry (both would put
 *    work from outside the capture into it); it asks the upstream, which
 *    may refuse (a device pool returns CUBUF_ERROR_STREAM_CAPTURING with the
 *    capture intact). The cache knows nothing of graphs: memory a graph
 *    uses must not be deallocated before the graph's last launch is done.
 *  - Streams must outlive their cached blocks: a trim, a release-and-retry
 *    and the resource's end give each block back ordered on the stream it
 *    is cached on. cubuf_stream_destroy gives a stream's blocks back
 *    first, in every caching resource; before destroying one otherwise
 *    (cuStreamDestroy), call cubuf_caching_forget_stream (the driver may
 *    give a new stream the same handle). Blocks on another thread's per-thread
 *    default stream are given back ordered on the legacy stream of the
 *    caller's current context (which waits for every per-thread default
 *    stream of the context; no synchronization, so a capture on a
 *    non-blocking stream is not broken. While a blocking stream captures,
 *    the driver refuses work on the legacy stream: those blocks stay
 *    cached and the call reports the driver's failure).
 *  - Thread safety: every function is thread-safe. Each stream has its own
 *    small lock, and each thread remembers the streams it used, so callers
 *    on different streams share no lock on a hit or a free; misses, trims
 *    and statistics take the resource's lock. A trim, a release-and-retry
 *    and the resource's end call the upstream's deallocate while holding
 *    that lock (so that no steal sees a block half given back): an
 *    upstream must not call back into the caching resource above it (nor
 *    destroy a stream with cubuf_stream_destroy, which gives back too).
 *
 * The caching resource is a resource like any other: cubuf_resource_allocate,
 * cubuf_resource_allocate_raw, buffers, cubuf_resource_release. Its
 * properties are its upstream's. cubuf_caching_allocate and
 * cubuf_caching_deallocate are the same operations without the generic
 * buffer layer in front.
 */
#ifndef CUBUF_CACHING_H
#define CUBUF_CACHING_H

#include <cubuf.h>

#ifdef __cplusplus
extern "C" {
#endif

/** Largest max_cached_size accepted (1 GiB). */
#define CUBUF_CACHING_MAX_CLASS_SIZE ((size_t)1 << 30)
/** The default max_cached_size (64 MiB). */
#define CUBUF_CACHING_DEFAULT_MAX_CACHED ((size_t)64 << 20)

/** Options of cubuf_caching_resource_create. Initialize with CUBUF_CACHING_OPTIONS_INIT. */
typedef struct cubuf_caching_options {
    size_t struct_size;
    /** Largest request served from size classes; larger ones pass to the
     *  upstream. 0: CUBUF_CACHING_DEFAULT_MAX_CACHED; at most
     *  CUBUF_CACHING_MAX_CLASS_SIZE. */
    size_t max_cached_size;
    /** Cached bytes kept: a deallocation that would cache more gives its
     *  block back to the upstream instead (ordered on its stream), unless
     *  its stream captures (the free would be a node of the capture): then
     *  the block is cached past the threshold until a trim. SIZE_MAX
     *  (the default): keep everything. Any other value costs one shared
     *  atomic counter per allocate and deallocate. */
    size_t release_threshold;
    /** Take cached blocks across streams with an event (true, the default),
     *  or never (false: a miss asks the upstream). */
    bool cross_stream;
} cubuf_caching_options_t;

#define CUBUF_CACHING_OPTIONS_INIT {sizeof(cubuf_caching_options_t), 0, SIZE_MAX, true}

/** Size of the first released layout (up to cross_stream). */
#define CUBUF_CACHING_OPTIONS_SIZE_V1 (offsetof(cubuf_caching_options_t, cross_stream) + sizeof(bool))

/**
 * Creates a caching resource over `upstream` (retained until the caching
 * resource goes; its properties are copied). options NULL: the defaults.
 * The new resource's last release gives every cached block back to the
 * upstream (see the rules above: the streams must still exist), then drops
 * the upstream. Allocations still live then are the caller's leak, as with
 * any raw allocation.
 * Returns CUBUF_ERROR_INVALID_ARGUMENT (NULL upstream or out,
 * options->struct_size below CUBUF_CACHING_OPTIONS_SIZE_V1, max_cached_size
 * above CUBUF_CACHING_MAX_CLASS_SIZE), CUBUF_ERROR_OUT_OF_MEMORY (host).
 */
CUBUF_API cubuf_status_t cubuf_caching_resource_create(cubuf_resource_t *upstream,
                                                       const cubuf_caching_options_t *options,
                                                       cubuf_resource_t **out);

/** Whether `res` is a caching resource (false for NULL). */
CUBUF_API bool cubuf_is_caching_resource(const cubuf_resource_t *res);

/**
 * The class size that serves a request of `size` bytes (the rule above);
 * 0 for size 0 or above CUBUF_CACHING_MAX_CLASS_SIZE. Pure; no resource.
 */
CUBUF_API size_t cubuf_caching_class_size(size_t size);

/**
 * Allocates `size` > 0 bytes ordered on `stream` into *ptr: exactly
 * cubuf_resource_allocate_raw on a caching resource, without the generic
 * layer. A hit makes no driver call. Returns CUBUF_ERROR_INVALID_ARGUMENT
 * (NULL, size 0, `res` not a caching resource), CUBUF_ERROR_OUT_OF_MEMORY
 * (the OOM report above; host memory for a stream's first use), and what
 * the upstream returns; *ptr is untouched on failure.
 */
CUBUF_API cubuf_status_t cubuf_caching_allocate(cubuf_resource_t *res, size_t size, CUstream stream,
                                                CUdeviceptr *ptr);

/**
 * Deallocates what cubuf_caching_allocate (or cubuf_resource_allocate_raw
 * on `res`) returned, with the same size, ordered on `stream`: the block is
 * cached on `stream`, or given back to the upstream (above max_cached_size,
 * beyond the release threshold on a stream that does not capture, or when
 * the stream's list cannot grow).
 * A size of another class than the allocation's is the caller's error the
 * cache cannot see. Returns CUBUF_ERROR_INVALID_ARGUMENT (NULL, pointer 0,
 * size 0, not a caching resource), and what the upstream's deallocation
 * returns when the block goes there (the allocation then stays allocated).
 */
CUBUF_API cubuf_status_t cubuf_caching_deallocate(cubuf_resource_t *res, CUdeviceptr ptr,
                                                  size_t size, CUstream stream);

/**
 * Gives cached blocks back to the upstream until at most `bytes_to_keep`
 * cached bytes remain (0: all), each ordered on the stream it is cached on
 * (the legacy stream for blocks of other threads' per-thread default
 * streams; no host synchronization). The upstream may keep the memory
 * in turn (a pool's own cache: cubuf_resource_trim of the upstream gives it
 * to the system). Blocks cached on a stream that is capturing stay cached
 * (their frees would be nodes of the capture), as they do where the
 * upstream refuses a free. Returns CUBUF_ERROR_INVALID_ARGUMENT (NULL, not
 * a caching resource), the first failure of the upstream's deallocation or
 * of the synchronization (the blocks not given back stay cached), else
 * CUBUF_ERROR_STREAM_CAPTURING (such a stream), whatever the order of the
 * streams; cubuf_last_error() is the detail of the failure returned.
 */
CUBUF_API cubuf_status_t cubuf_caching_trim(cubuf_resource_t *res, size_t bytes_to_keep);

/**
 * Sets the release threshold (the option of that name) from now on;
 * blocks already cached beyond it stay until a trim. Thread-safe.
 * Returns CUBUF_ERROR_INVALID_ARGUMENT (NULL, not a caching resource).
 */
CUBUF_API cubuf_status_t cubuf_caching_set_release_threshold(cubuf_resource_t *res, size_t bytes);

/**
 * Gives the blocks cached on `stream` back to the upstream, ordered on
 * `stream`, so that the stream may be destroyed after this call. A default
 * stream means the legacy stream (0, CU_STREAM_LEGACY) or the calling
 * thread's per-thread stream. Returns as cubuf_caching_trim.
 */
CUBUF_API cubuf_status_t cubuf_caching_forget_stream(cubuf_resource_t *res, CUstream stream);

/** Usage of a caching resource. Initialize with CUBUF_CACHING_STATS_INIT. */
typedef struct cubuf_caching_stats {
    size_t struct_size;
    size_t live_bytes;            /**< blocks allocated and not deallocated (class sizes; larger requests at their size) */
    size_t requested_bytes;       /**< what the callers asked for of those */
    size_t internal_waste_bytes;  /**< live_bytes - requested_bytes */
    size_t cached_bytes;          /**< blocks in the free lists */
    size_t held_bytes;            /**< live + cached: what the upstream gave and has not got back */
    size_t peak_held_bytes;       /**< high-water mark of held_bytes */
    size_t largest_free_bytes;    /**< the largest cached block */
    double fragmentation;         /**< 1 - largest_free / cached_bytes; 0 when nothing is cached */
    size_t live_count;
    size_t cached_count;
    uint64_t hits;                /**< allocations served from the allocating stream's list */
    uint64_t cross_stream_reuses; /**< allocations served from another stream's list */
    uint64_t misses;              /**< allocations the upstream served (or refused) */
    uint64_t upstream_allocations;   /**< upstream allocate calls that succeeded */
    uint64_t upstream_deallocations; /**< upstream deallocate calls that succeeded */
    uint64_t oom_retries;         /**< release-and-retry rounds after an upstream out-of-memory */
} cubuf_caching_stats_t;

#define CUBUF_CACHING_STATS_INIT \
    {sizeof(cubuf_caching_stats_t), 0, 0, 0, 0, 0, 0, 0, 0.0, 0, 0, 0, 0, 0, 0, 0, 0}

/** Size of the first released layout (up to oom_retries). */
#define CUBUF_CACHING_STATS_SIZE_V1 (offsetof(cubuf_caching_stats_t, oom_retries) + sizeof(uint64_t))

/**
 * Reads the usage into *stats, up to stats->struct_size. Takes each
 * stream's lock in turn: exact when no other thread allocates or
 * deallocates meanwhile, a close estimate otherwise. No driver call.
 * Returns CUBUF_ERROR_INVALID_ARGUMENT (NULL, not a caching resource,
 * struct_size below CUBUF_CACHING_STATS_SIZE_V1).
 */
CUBUF_API cubuf_status_t cubuf_caching_stats(const cubuf_resource_t *res, cubuf_caching_stats_t *stats);

/* ------------------------------------------------------------------------ */
/* cubuf as a framework's allocator                                          */
/* ------------------------------------------------------------------------ */

/*
 * Each device gets one caching resource (default options) over a device
 * resource on the device's default pool (cubuf_device_resource_create with
 * NULL options), made at the device's first allocation and kept for the
 * life of the process, unless cubuf_framework_set_resource chose another
 * resource first. These functions are what a framework calls; they
 * report failure as the framework expects (a NULL pointer), with the
 * reason in cubuf_last_error() on the calling thread. Thread-safe. A
 * request of 0 bytes is served as 1 byte (a distinct, freeable pointer).
 * Devices 0 to 63.
 */

/** PyTorch's CUDAPluggableAllocator alloc: `size` bytes on `device`, ordered on `stream`; NULL on failure. */
CUBUF_API void *cubuf_torch_alloc(size_t size, int device, CUstream stream);

/** PyTorch's CUDAPluggableAllocator free: what cubuf_torch_alloc returned, with its size, ordered on `stream`. */
CUBUF_API void cubuf_torch_free(void *ptr, size_t size, int device, CUstream stream);

/**
 * CuPy's CFunctionAllocator malloc (`void *(*)(void *param, size_t, int)`;
 * `param` is unused): `size` bytes on `device`, ordered on the legacy
 * default stream (CuPy passes no stream; CuPy's default stream is the
 * legacy one, and CuPy streams created with non_blocking=False are ordered
 * with it). NULL on failure. CuPy's free passes no size, so each live
 * pointer is remembered in a table (sharded; one small lock per shard).
 */
CUBUF_API void *cubuf_cupy_malloc(void *param, size_t size, int device);

/** CuPy's CFunctionAllocator free (`void (*)(void *param, void *ptr, int)`). */
CUBUF_API void cubuf_cupy_free(void *param, void *ptr, int device);

/**
 * The caching resource serving `device` for the functions above, made now
 * if it is not yet (not a new reference: it lives for the process), for
 * statistics and trims. Returns CUBUF_ERROR_INVALID_ARGUMENT (out NULL),
 * CUBUF_ERROR_OUT_OF_RANGE (device outside 0-63), and what
 * cubuf_device_resource_create and cubuf_caching_resource_create return.
 */
CUBUF_API cubuf_status_t cubuf_framework_resource(int device, cubuf_resource_t **out);

/**
 * Makes `res` (retained for the life of the process) the resource the
 * functions above serve for `device`, before the device's first use: a
 * caching resource takes its fast path (cubuf_caching_allocate), any other
 * resource its raw-pointer interface (a logging adaptor, cubuf/adaptor.h,
 * records what the framework asks for). Returns
 * CUBUF_ERROR_INVALID_ARGUMENT (res NULL, or the device already has its
 * resource: set once, before its first allocation or
 * cubuf_framework_resource), CUBUF_ERROR_OUT_OF_RANGE (device outside 0-63).
 */
CUBUF_API cubuf_status_t cubuf_framework_set_resource(int device, cubuf_resource_t *res);

#ifdef __cplusplus
}
#endif

#endif
