/* The caching resource (cubuf/caching.h): size classes, per-stream free
 * lists, cross-stream reuse through an event, release-and-retry on
 * out-of-memory. Built on the public resource API only: it is a user
 * resource (cubuf_resource_create) whose state asks its upstream for raw
 * pointers.
 *
 * Locking: each stream state has a spin lock, taken by the callers of that
 * stream for a hit or a free (a push or a pop and a few counters); the
 * resource's mutex guards the list of stream states and the slow paths
 * (stealing across streams with the one event, giving blocks back, the
 * statistics). The order is always mutex, then stream locks; no stream
 * lock is held while taking the mutex, and none across an upstream call.
 * Each thread remembers the stream states it used (caching_tls_t), keyed by the
 * resource's id, which is never reused, so a stale entry never matches. */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "common.h"
#include "inspect.h"
#include "stream_token.h"
#include "cubuf/caching.h"

#define CACHING_MAGIC 0x63756275662d6361ULL
#define NCLASS 152 /* classes up to CUBUF_CACHING_MAX_CLASS_SIZE (2^30) */
#define TLS_SLOTS 16
/* Another stream's block is taken only from a stream caching at least this
 * many of its class (or when the upstream is out of memory): two streams
 * that each reuse one block keep their own instead of trading it back and
 * forth through events. */
#define STEAL_SURPLUS 2

typedef struct slot {
    CUdeviceptr *ptrs;
    uint32_t n, cap;
} slot_t;

typedef struct cstream {
    cubuf_lock_t lock;
    CUstream stream;     /* 0 for the legacy stream */
    uint64_t thread_key; /* CU_STREAM_PER_THREAD: its thread's key; else 0 */
    struct cstream *next;
    /* under lock; live figures wrap per stream (a block may be freed on
     * another stream than it was allocated on) and are exact as a sum */
    uint64_t hits, cross, misses;
    uint64_t live_bytes, requested, live_count;
    size_t cached_bytes, cached_count;
    slot_t bins[NCLASS];
} cstream_t;

typedef struct caching {
    uint64_t magic;
    uint64_t id;
    cubuf_resource_t *upstream;
    bool device; /* the upstream's memory is device accessible: reuse needs ordering */
    bool cross_stream;
    size_t max_cached;
    _Atomic size_t threshold;
    atomic_size_t cached_total; /* kept only while threshold != SIZE_MAX */
    pthread_mutex_t mutex;
    cstream_t *streams;
    CUevent event; /* the cross-stream ordering; used under mutex */
    atomic_size_t held, peak_held, large_live, large_count;
    atomic_uint_least64_t up_allocs, up_deallocs, oom_retries;
    atomic_uint_least64_t large_misses; /* requests above max_cached: misses of no stream */
    /* The process's live caching resources, in the order made, and the
     * give-backs under way in this one from cubuf_stream_destroy (under
     * live_lock). */
    struct caching *live_prev, *live_next;
    uint64_t live_seq;
    unsigned pins;
} caching_t;

typedef struct tls_slot {
    uint64_t id;
    CUstream stream;
    cstream_t *cs;
} tls_slot_t;

/* What a thread keeps: the stream states it used, and its key. */
typedef struct caching_tls {
    tls_slot_t slots[TLS_SLOTS];
    unsigned next;
    uint64_t thread_key;
} caching_tls_t;

static _Thread_local caching_tls_t tls;
static CUBUF_TLS_ACCESSOR caching_tls_t *mine(void) { return &tls; }
static atomic_uint_least64_t next_id = 1, next_thread_key = 1;

/* Every live caching resource, for cubuf_stream_destroy: a stream's cached
 * blocks go back to their upstream before the stream goes. */
static pthread_mutex_t live_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t live_unpinned = PTHREAD_COND_INITIALIZER;
static caching_t *live_first, *live_last;
static uint64_t live_seq;

/* ---- size classes ---- */

static unsigned class_index(size_t n)
{
    size_t s = (n + 511) & ~(size_t)511;
    if (s <= 4096) return (unsigned)(s / 512 - 1);
    unsigned k = 63u - (unsigned)__builtin_clzll((unsigned long long)(s - 1)); /* 2^k < s <= 2^(k+1) */
    size_t step = (size_t)1 << (k - 3);
    size_t j = (s - ((size_t)1 << k) + step - 1) / step; /* 1..8 */
    return 8u + (k - 12u) * 8u + (unsigned)j - 1u;
}

static size_t class_bytes(unsigned i)
{
    if (i < 8) return (size_t)(i + 1) * 512;
    unsigned k = 12 + (i - 8) / 8, j = (i - 8) % 8 + 1;
    return ((size_t)1 << k) + (size_t)j * ((size_t)1 << (k - 3));
}

size_t cubuf_caching_class_size(size_t size)
{
    if (size == 0 || size > CUBUF_CACHING_MAX_CLASS_SIZE) return 0;
    return class_bytes(class_index(size));
}

/* ---- locks ---- */

static inline void cs_lock(cstream_t *cs) { cubuf__lock(&cs->lock); }

static inline void cs_unlock(cstream_t *cs) { cubuf__unlock(&cs->lock); }

/* ---- stream states ---- */

static uint64_t thread_key(void)
{
    caching_tls_t *t = mine();
    if (!t->thread_key) t->thread_key = atomic_fetch_add(&next_thread_key, 1);
    return t->thread_key;
}

static inline CUstream stream_key(CUstream s) { return s == CU_STREAM_LEGACY ? NULL : s; }

/* The state of `s` (already a key) in the list, or NULL. Under mutex. */
static cstream_t *find_locked(caching_t *c, CUstream s, uint64_t tk)
{
    for (cstream_t *t = c->streams; t; t = t->next)
        if (t->stream == s && t->thread_key == tk) return t;
    return NULL;
}

static cstream_t *stream_state_slow(caching_t *c, CUstream s)
{
    uint64_t tk = s == CU_STREAM_PER_THREAD ? thread_key() : 0;
    pthread_mutex_lock(&c->mutex);
    cstream_t *cs = find_locked(c, s, tk);
    if (!cs && (cs = cubuf__calloc(1, sizeof *cs)) != NULL) {
        cs->stream = s;
        cs->thread_key = tk;
        cs->next = c->streams;
        c->streams = cs;
    }
    pthread_mutex_unlock(&c->mutex);
    if (!cs) {
        cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "caching resource: cannot allocate a stream's state");
        return NULL;
    }
    caching_tls_t *t = mine();
    t->slots[t->next++ % TLS_SLOTS] = (tls_slot_t){c->id, s, cs};
    return cs;
}

static inline cstream_t *stream_state(caching_t *c, CUstream s)
{
    s = stream_key(s);
    const tls_slot_t *slots = mine()->slots;
    for (unsigned i = 0; i < TLS_SLOTS; i++)
        if (slots[i].id == c->id && slots[i].stream == s) return slots[i].cs;
    return stream_state_slow(c, s);
}

/* ---- accounting (under the stream's lock) ---- */

static inline bool threshold_on(const caching_t *c)
{
    return atomic_load_explicit(&c->threshold, memory_order_relaxed) != SIZE_MAX;
}

static inline void uncache_locked(caching_t *c, cstream_t *t, size_t csize)
{
    t->cached_bytes -= csize;
    t->cached_count--;
    if (threshold_on(c)) atomic_fetch_sub_explicit(&c->cached_total, csize, memory_order_relaxed);
}

static inline void cache_locked(caching_t *c, cstream_t *t, size_t csize)
{
    t->cached_bytes += csize;
    t->cached_count++;
    if (threshold_on(c)) atomic_fetch_add_explicit(&c->cached_total, csize, memory_order_relaxed);
}

static inline void live_add_locked(cstream_t *cs, size_t csize, size_t size)
{
    cs->live_bytes += csize;
    cs->requested += size;
    cs->live_count++;
}

static inline void live_sub_locked(cstream_t *cs, size_t csize, size_t size)
{
    cs->live_bytes -= csize;
    cs->requested -= size;
    cs->live_count--;
}

static bool slot_push(slot_t *sl, CUdeviceptr p)
{
    if (sl->n == sl->cap) {
        uint32_t cap = sl->cap ? sl->cap * 2 : 8;
        CUdeviceptr *q = cubuf__realloc(sl->ptrs, cap * sizeof *q);
        if (!q) return false;
        sl->ptrs = q;
        sl->cap = cap;
    }
    sl->ptrs[sl->n++] = p;
    return true;
}

/* ---- the upstream ---- */

static cubuf_status_t up_alloc(caching_t *c, size_t bytes, CUstream stream, CUdeviceptr *p)
{
    cubuf_status_t st = cubuf_resource_allocate_raw(c->upstream, bytes, stream, p);
    if (st != CUBUF_SUCCESS) return st;
    size_t held = atomic_fetch_add(&c->held, bytes) + bytes;
    size_t peak = atomic_load(&c->peak_held);
    while (held > peak && !atomic_compare_exchange_weak(&c->peak_held, &peak, held)) {
    }
    atomic_fetch_add(&c->up_allocs, 1);
    return CUBUF_SUCCESS;
}

static cubuf_status_t up_free(caching_t *c, CUdeviceptr p, size_t bytes, CUstream stream)
{
    cubuf_status_t st = cubuf_resource_deallocate_raw(c->upstream, p, bytes, stream);
    if (st != CUBUF_SUCCESS) return st;
    atomic_fetch_sub(&c->held, bytes);
    atomic_fetch_add(&c->up_deallocs, 1);
    return CUBUF_SUCCESS;
}

/* Whether a miss on `stream` must leave other streams' blocks and the
 * upstream's memory alone: a capture on it or, for the legacy stream, one
 * that depends on it (cubuf__stream_capture_status); a failed query counts
 * as capturing. */
static bool capturing(const caching_t *c, CUstream stream)
{
    if (!c->device) return false;
    CUstreamCaptureStatus cst = CU_STREAM_CAPTURE_STATUS_NONE;
    return cubuf__stream_capture_status(stream, NULL, &cst) != CUBUF_SUCCESS ||
           cst != CU_STREAM_CAPTURE_STATUS_NONE;
}

typedef struct snapshot {
    size_t live, requested, cached, largest, live_count, cached_count;
    uint64_t hits, cross, misses;
} snapshot_t;

/* Sums the stream states. Under mutex. */
static void snapshot_locked(caching_t *c, snapshot_t *s)
{
    uint64_t live = 0, req = 0, lc = 0;
    memset(s, 0, sizeof *s);
    for (cstream_t *t = c->streams; t; t = t->next) {
        cs_lock(t);
        live += t->live_bytes;
        req += t->requested;
        lc += t->live_count;
        s->cached += t->cached_bytes;
        s->cached_count += t->cached_count;
        s->hits += t->hits;
        s->cross += t->cross;
        s->misses += t->misses;
        for (unsigned k = NCLASS; k-- > 0;)
            if (t->bins[k].n) {
                if (class_bytes(k) > s->largest) s->largest = class_bytes(k);
                break;
            }
        cs_unlock(t);
    }
    size_t large = atomic_load(&c->large_live);
    s->live = (size_t)live + large;
    s->requested = (size_t)req + large;
    s->live_count = (size_t)lc + atomic_load(&c->large_count);
    s->misses += atomic_load(&c->large_misses);
}

/* Caches again on t a block of class k popped from it that could not go
 * where it was going. Another free may have filled the slot while it was
 * unlocked, so this pushes (and may grow the slot); without the host memory
 * for that the block is lost, and said so. */
static void keep_block(caching_t *c, cstream_t *t, unsigned k, CUdeviceptr p, const char *after)
{
    const size_t csize = class_bytes(k);
    cs_lock(t);
    const bool kept = slot_push(&t->bins[k], p);
    if (kept) cache_locked(c, t, csize);
    cs_unlock(t);
    if (!kept)
        cubuf__warn(CUBUF_ERROR_OUT_OF_MEMORY,
                    "caching resource: a cached block of %zu bytes at 0x%llx could not be cached "
                    "again after %s (out of host memory): it is lost to the cache and stays held",
                    csize, (unsigned long long)p, after);
}

/* The failure a give-back reports, with its own detail: the first one,
 * except that a failure to give back outranks blocks kept for a capture
 * (which a later call gives back by itself), so the status does not depend
 * on the order the streams are visited in. */
typedef struct failure {
    cubuf_status_t st;
    CUresult cu;
    char detail[1024];
} failure_t;

static void failure_note(failure_t *f, cubuf_status_t st)
{
    if (st == CUBUF_SUCCESS || (f->st != CUBUF_SUCCESS && (f->st != CUBUF_ERROR_STREAM_CAPTURING ||
                                                           st == CUBUF_ERROR_STREAM_CAPTURING)))
        return;
    f->st = st;
    f->cu = cubuf_last_cuda_result();
    snprintf(f->detail, sizeof f->detail, "%s", cubuf_last_error());
}

static cubuf_status_t failure_report(const failure_t *f)
{
    if (f->st == CUBUF_SUCCESS) return CUBUF_SUCCESS;
    (void)cubuf__fail(f->st, "%s", f->detail);
    cubuf__set_last_cu(f->cu);
    return f->st;
}

/* Gives cached blocks back to the upstream until at most `keep` cached
 * bytes remain, only those of `only` when it is not NULL, each ordered on
 * its stream (another thread's per-thread stream's on the legacy stream,
 * which waits for it); `sync` then synchronizes each stream
 * that gave blocks back, the legacy stream for those.
 * Returns the failure failure_note picks; what could not go stays cached. */
static cubuf_status_t give_back(caching_t *c, size_t keep, bool sync, cstream_t *only)
{
    failure_t f = {CUBUF_SUCCESS, CUDA_SUCCESS, ""};
    const uint64_t me = thread_key();
    pthread_mutex_lock(&c->mutex);
    size_t cached = 0;
    for (cstream_t *t = c->streams; t; t = t->next) {
        cs_lock(t);
        cached += t->cached_bytes;
        cs_unlock(t);
    }
    for (cstream_t *t = c->streams; t && cached > keep; t = t->next) {
        if (only && t != only) continue;
        cs_lock(t);
        const bool holds = t->cached_bytes > 0;
        cs_unlock(t);
        if (!holds) continue;
        CUstream on = t->stream;
        const bool foreign = t->thread_key && t->thread_key != me;
        /* No thread but its own can name that stream. The legacy stream
         * waits for every blocking stream of the context, per-thread
         * default streams included, so frees ordered there come after its
         * work; a cuCtxSynchronize would invalidate any capture in the
         * context, on streams the cache never saw too. */
        if (foreign && c->device) on = CU_STREAM_LEGACY;
        CUstreamCaptureStatus cst = CU_STREAM_CAPTURE_STATUS_NONE;
        if (c->device && cubuf__stream_capture_status(on, NULL, &cst) == CUBUF_SUCCESS &&
            cst != CU_STREAM_CAPTURE_STATUS_NONE) {
            /* Its frees would be nodes of the capture, freeing nothing now
             * (and a synchronization would end the capture): kept. A query
             * that fails (no context current for a default stream) leaves
             * the free to report what it meets, as before. */
            failure_note(&f, cubuf__fail(CUBUF_ERROR_STREAM_CAPTURING,
                                         "caching resource: the blocks cached on stream %p stay "
                                         "cached while it captures",
                                         (void *)on));
            continue;
        }
        bool gave = false;
        for (unsigned k = NCLASS; k-- > 0 && cached > keep;) {
            const size_t csize = class_bytes(k);
            for (;;) {
                cs_lock(t);
                if (!t->bins[k].n || cached <= keep) {
                    cs_unlock(t);
                    break;
                }
                CUdeviceptr p = t->bins[k].ptrs[--t->bins[k].n];
                uncache_locked(c, t, csize);
                cs_unlock(t);
                cubuf_status_t st = up_free(c, p, csize, on);
                if (st != CUBUF_SUCCESS) {
                    failure_note(&f, st);
                    keep_block(c, t, k, p, "a failed give-back");
                    goto next_stream;
                }
                gave = true;
                cached -= csize;
            }
        }
    next_stream:
        if (sync && gave && c->device) failure_note(&f, CU(cuStreamSynchronize, on));
    }
    pthread_mutex_unlock(&c->mutex);
    return failure_report(&f);
}

/* After the upstream said out of memory: release the cache, retry once,
 * then report. */
static cubuf_status_t release_and_retry(caching_t *c, size_t size, size_t bytes, CUstream stream,
                                        CUdeviceptr *p)
{
    snapshot_t s;
    pthread_mutex_lock(&c->mutex);
    snapshot_locked(c, &s);
    pthread_mutex_unlock(&c->mutex);
    atomic_fetch_add(&c->oom_retries, 1);
    cubuf_status_t rst = give_back(c, 0, true, NULL);
    cubuf_status_t st = up_alloc(c, bytes, stream, p);
    if (st != CUBUF_ERROR_OUT_OF_MEMORY) return st;
    char up[256];
    snprintf(up, sizeof up, "%s", cubuf_last_error());
    return cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY,
                       "caching resource: out of memory: %zu bytes requested (block of %zu "
                       "bytes); live %zu bytes, cached %zu bytes, largest free block %zu bytes "
                       "before the cache was released%s; the upstream said: %s",
                       size, bytes, s.live, s.cached, s.largest,
                       rst == CUBUF_SUCCESS ? "" : " (not all of it could be given back)", up);
}

/* Takes a cached block of class k from another stream than cs that caches
 * at least `min` of them, ordering that stream's work before `stream`'s. */
static bool steal(caching_t *c, cstream_t *cs, unsigned k, CUstream stream, uint32_t min,
                  CUdeviceptr *out)
{
    const uint64_t me = thread_key();
    const size_t csize = class_bytes(k);
    bool got = false;
    pthread_mutex_lock(&c->mutex);
    for (cstream_t *t = c->streams; t && !got; t = t->next) {
        if (t == cs || (t->thread_key && t->thread_key != me)) continue;
        cs_lock(t);
        bool has = t->bins[k].n >= min;
        cs_unlock(t);
        /* an event recorded on a capturing stream is a node of its capture:
         * waiting on it would make `stream` join that capture */
        if (!has || capturing(c, t->stream)) continue;
        cs_lock(t);
        if (t->bins[k].n >= min) {
            *out = t->bins[k].ptrs[--t->bins[k].n];
            uncache_locked(c, t, csize);
            got = true;
        }
        cs_unlock(t);
        if (!got || !c->device) continue;
        cubuf_status_t st = CUBUF_SUCCESS;
        if (!c->event) st = CU(cuEventCreate, &c->event, CU_EVENT_DISABLE_TIMING);
        if (st == CUBUF_SUCCESS) st = CU(cuEventRecord, c->event, t->stream);
        if (st == CUBUF_SUCCESS) st = CU(cuStreamWaitEvent, stream, c->event, 0);
        if (st != CUBUF_SUCCESS) { /* unordered: the block stays where it was */
            keep_block(c, t, k, *out, "a failed ordering across streams");
            got = false;
        }
    }
    pthread_mutex_unlock(&c->mutex);
    return got;
}

/* ---- allocate and deallocate ---- */

static cubuf_status_t large_alloc(caching_t *c, size_t size, CUstream stream, CUdeviceptr *ptr)
{
    atomic_fetch_add(&c->large_misses, 1); /* served or refused by the upstream */
    cubuf_status_t st = up_alloc(c, size, stream, ptr);
    if (st == CUBUF_ERROR_OUT_OF_MEMORY && !capturing(c, stream))
        st = release_and_retry(c, size, size, stream, ptr);
    if (st != CUBUF_SUCCESS) return st;
    atomic_fetch_add(&c->large_live, size);
    atomic_fetch_add(&c->large_count, 1);
    return CUBUF_SUCCESS;
}

static cubuf_status_t cache_alloc(caching_t *c, size_t size, CUstream stream, CUdeviceptr *ptr)
{
    if (size > c->max_cached) return large_alloc(c, size, stream, ptr);
    const unsigned k = class_index(size);
    const size_t csize = class_bytes(k);
    cstream_t *cs = stream_state(c, stream);
    if (!cs) return CUBUF_ERROR_OUT_OF_MEMORY;
    cs_lock(cs);
    slot_t *sl = &cs->bins[k];
    if (sl->n) {
        *ptr = sl->ptrs[--sl->n];
        uncache_locked(c, cs, csize);
        live_add_locked(cs, csize, size);
        cs->hits++;
        cs_unlock(cs);
        return CUBUF_SUCCESS;
    }
    cs_unlock(cs);
    /* the slow path */
    CUdeviceptr p = 0;
    const bool capture = capturing(c, stream), cross = c->cross_stream && !capture;
    bool stolen = cross && steal(c, cs, k, stream, STEAL_SURPLUS, &p);
    cubuf_status_t st = stolen ? CUBUF_SUCCESS : up_alloc(c, csize, stream, &p);
    if (st == CUBUF_ERROR_OUT_OF_MEMORY && !capture) {
        /* any other stream's block of the class first: no synchronization */
        if (cross && (stolen = steal(c, cs, k, stream, 1, &p))) st = CUBUF_SUCCESS;
        else st = release_and_retry(c, size, csize, stream, &p);
    }
    cs_lock(cs);
    if (stolen) cs->cross++;
    else cs->misses++;
    if (st == CUBUF_SUCCESS) live_add_locked(cs, csize, size);
    cs_unlock(cs);
    if (st == CUBUF_SUCCESS) *ptr = p;
    return st;
}

static cubuf_status_t cache_free(caching_t *c, CUdeviceptr p, size_t size, CUstream stream)
{
    cubuf_status_t st;
    if (size > c->max_cached) {
        if ((st = up_free(c, p, size, stream)) != CUBUF_SUCCESS) return st;
        atomic_fetch_sub(&c->large_live, size);
        atomic_fetch_sub(&c->large_count, 1);
        return CUBUF_SUCCESS;
    }
    const unsigned k = class_index(size);
    const size_t csize = class_bytes(k);
    cstream_t *cs = stream_state(c, stream);
    if (!cs) {
        /* no state for the stream (host memory): the block goes upstream; the
         * live figures are exact as a sum, so any stream's state counts it
         * (the allocation's stream has one) */
        if ((st = up_free(c, p, csize, stream)) != CUBUF_SUCCESS) return st;
        pthread_mutex_lock(&c->mutex);
        cstream_t *any = c->streams;
        if (any) {
            cs_lock(any);
            live_sub_locked(any, csize, size);
            cs_unlock(any);
        }
        pthread_mutex_unlock(&c->mutex);
        return CUBUF_SUCCESS;
    }
    /* Past the threshold the block goes upstream, unless the stream
     * captures: the upstream's free would be a node of the capture (a device
     * pool refuses it), so the block is cached past the threshold instead,
     * until a trim gives it back (or a hit takes it). */
    const size_t thr = atomic_load_explicit(&c->threshold, memory_order_relaxed);
    const bool over = thr != SIZE_MAX &&
                      atomic_load_explicit(&c->cached_total, memory_order_relaxed) + csize > thr &&
                      !capturing(c, stream);
    cs_lock(cs);
    if (!over && slot_push(&cs->bins[k], p)) {
        cache_locked(c, cs, csize);
        live_sub_locked(cs, csize, size);
        cs_unlock(cs);
        return CUBUF_SUCCESS;
    }
    cs_unlock(cs);
    if ((st = up_free(c, p, csize, stream)) != CUBUF_SUCCESS) return st;
    cs_lock(cs);
    live_sub_locked(cs, csize, size);
    cs_unlock(cs);
    return CUBUF_SUCCESS;
}

/* ---- the resource ---- */

static cubuf_status_t ops_allocate(void *state, size_t size, CUstream stream, CUdeviceptr *ptr)
{
    return cache_alloc(state, size, stream, ptr);
}

static cubuf_status_t ops_deallocate(void *state, CUdeviceptr ptr, size_t size, CUstream stream)
{
    return cache_free(state, ptr, size, stream);
}

static void caching_free(caching_t *c)
{
    for (cstream_t *t = c->streams, *n; t; t = n) {
        n = t->next;
        for (unsigned k = 0; k < NCLASS; k++) cubuf__free(t->bins[k].ptrs);
        cubuf__free(t);
    }
    if (c->event) (void)CU_CALL(cuEventDestroy, c->event);
    pthread_mutex_destroy(&c->mutex);
    c->magic = 0;
    cubuf__free(c);
}

static void ops_destroy(void *state)
{
    caching_t *c = state;
    /* Still listed while its blocks go back: a stream destroyed meanwhile
     * waits for the mutex, and finds nothing left on it. */
    cubuf_status_t st = give_back(c, 0, false, NULL);
    if (st != CUBUF_SUCCESS)
        cubuf__warn(st, "caching resource: cached blocks could not all be given back to the "
                        "upstream at the end: %s", cubuf_last_error());
    pthread_mutex_lock(&live_lock);
    *(c->live_prev ? &c->live_prev->live_next : &live_first) = c->live_next;
    *(c->live_next ? &c->live_next->live_prev : &live_last) = c->live_prev;
    while (c->pins) pthread_cond_wait(&live_unpinned, &live_lock); /* a stream's give-back in c */
    pthread_mutex_unlock(&live_lock);
    cubuf_resource_release(c->upstream);
    caching_free(c);
}

cubuf_status_t cubuf_caching_resource_create(cubuf_resource_t *upstream,
                                             const cubuf_caching_options_t *options,
                                             cubuf_resource_t **out)
{
    static const char fn[] = "cubuf_caching_resource_create";
    CHECK_ARG(upstream && out, "%s: NULL argument", fn);
    cubuf_caching_options_t o = CUBUF_CACHING_OPTIONS_INIT;
    cubuf_status_t st;
    if (options && (st = cubuf__struct_in(fn, "cubuf_caching_options_t", &o, sizeof o, options,
                                          CUBUF_CACHING_OPTIONS_SIZE_V1)) != CUBUF_SUCCESS)
        return st;
    CHECK_ARG(o.max_cached_size <= CUBUF_CACHING_MAX_CLASS_SIZE,
              "%s: max_cached_size %zu is above %zu", fn, o.max_cached_size,
              CUBUF_CACHING_MAX_CLASS_SIZE);
    cubuf_resource_props_t props = CUBUF_RESOURCE_PROPS_INIT;
    if ((st = cubuf_resource_props(upstream, &props)) != CUBUF_SUCCESS) return st;
    if (props.device_accessible && (st = cubuf__driver_load()) != CUBUF_SUCCESS) return st;
    caching_t *c = cubuf__calloc(1, sizeof *c);
    if (!c) return cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "%s: cannot allocate the cache", fn);
    c->magic = CACHING_MAGIC;
    c->id = atomic_fetch_add(&next_id, 1);
    c->device = props.device_accessible;
    c->cross_stream = o.cross_stream;
    c->max_cached = o.max_cached_size ? o.max_cached_size : CUBUF_CACHING_DEFAULT_MAX_CACHED;
    atomic_init(&c->threshold, o.release_threshold);
    pthread_mutex_init(&c->mutex, NULL);
    const cubuf_resource_ops_t ops = {CUBUF_RESOURCE_OPS_VERSION, ops_allocate, ops_deallocate,
                                      ops_destroy};
    cubuf_resource_t *res = NULL;
    if ((st = cubuf_resource_create(&ops, &props, c, &res)) != CUBUF_SUCCESS) {
        caching_free(c);
        return st;
    }
    c->upstream = cubuf_resource_retain(upstream);
    pthread_mutex_lock(&live_lock);
    c->live_seq = ++live_seq;
    c->live_prev = live_last;
    *(live_last ? &live_last->live_next : &live_first) = c;
    live_last = c;
    pthread_mutex_unlock(&live_lock);
    *out = res;
    return CUBUF_SUCCESS;
}

static caching_t *caching_of(const cubuf_resource_t *res)
{
    caching_t *c = cubuf_resource_user_state(res);
    return c && c->magic == CACHING_MAGIC ? c : NULL;
}

bool cubuf_is_caching_resource(const cubuf_resource_t *res) { return caching_of(res) != NULL; }

cubuf_resource_t *cubuf__caching_upstream(const cubuf_resource_t *res)
{
    caching_t *c = caching_of(res);
    return c ? c->upstream : NULL;
}

#define GET_CACHE(c, res, fn)                                                                \
    caching_t *c = caching_of(res);                                                          \
    CHECK_ARG(c, "%s: %s", fn, res ? "not a caching resource" : "NULL resource")

cubuf_status_t cubuf_caching_allocate(cubuf_resource_t *res, size_t size, CUstream stream,
                                      CUdeviceptr *ptr)
{
    GET_CACHE(c, res, "cubuf_caching_allocate");
    CHECK_ARG(ptr && size, "cubuf_caching_allocate: %s", ptr ? "size 0" : "NULL argument");
    return cache_alloc(c, size, stream, ptr);
}

cubuf_status_t cubuf_caching_deallocate(cubuf_resource_t *res, CUdeviceptr ptr, size_t size,
                                        CUstream stream)
{
    GET_CACHE(c, res, "cubuf_caching_deallocate");
    CHECK_ARG(ptr && size, "cubuf_caching_deallocate: %s", ptr ? "size 0" : "pointer 0");
    return cache_free(c, ptr, size, stream);
}

cubuf_status_t cubuf_caching_trim(cubuf_resource_t *res, size_t bytes_to_keep)
{
    GET_CACHE(c, res, "cubuf_caching_trim");
    return give_back(c, bytes_to_keep, false, NULL);
}

static cubuf_status_t forget(caching_t *c, CUstream stream)
{
    CUstream s = stream_key(stream);
    uint64_t tk = s == CU_STREAM_PER_THREAD ? thread_key() : 0;
    pthread_mutex_lock(&c->mutex);
    cstream_t *cs = find_locked(c, s, tk);
    pthread_mutex_unlock(&c->mutex);
    return cs ? give_back(c, 0, false, cs) : CUBUF_SUCCESS;
}

cubuf_status_t cubuf_caching_forget_stream(cubuf_resource_t *res, CUstream stream)
{
    GET_CACHE(c, res, "cubuf_caching_forget_stream");
    return forget(c, stream);
}

/* One resource at a time, each pinned while its blocks go back (its end
 * waits), with no lock held (an upstream may take locks of its own), the
 * newest first: a caching resource over another is made after it, and its
 * blocks on the stream go back into the one below (cached on the stream
 * there) before that one is visited. The next is the newest made before
 * the last visited that is still live. */
cubuf_status_t cubuf__caching_forget_everywhere(CUstream stream)
{
    cubuf_status_t first = CUBUF_SUCCESS;
    for (uint64_t before = UINT64_MAX;;) {
        pthread_mutex_lock(&live_lock);
        caching_t *c = live_last;
        while (c && c->live_seq >= before) c = c->live_prev;
        if (c) {
            before = c->live_seq;
            c->pins++;
        }
        pthread_mutex_unlock(&live_lock);
        if (!c) return first;
        const cubuf_status_t st = forget(c, stream);
        if (first == CUBUF_SUCCESS) first = st;
        pthread_mutex_lock(&live_lock);
        if (--c->pins == 0) pthread_cond_broadcast(&live_unpinned);
        pthread_mutex_unlock(&live_lock);
    }
}

cubuf_status_t cubuf_caching_set_release_threshold(cubuf_resource_t *res, size_t bytes)
{
    GET_CACHE(c, res, "cubuf_caching_set_release_threshold");
    /* With every stream locked, each free sees either the old threshold and
     * its bytes are in the sum, or the new one and it counts them itself. */
    pthread_mutex_lock(&c->mutex);
    size_t sum = 0;
    for (cstream_t *t = c->streams; t; t = t->next) {
        cs_lock(t);
        sum += t->cached_bytes;
    }
    atomic_store(&c->cached_total, sum);
    atomic_store(&c->threshold, bytes);
    for (cstream_t *t = c->streams; t; t = t->next) cs_unlock(t);
    pthread_mutex_unlock(&c->mutex);
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf_caching_stats(const cubuf_resource_t *res, cubuf_caching_stats_t *stats)
{
    static const char fn[] = "cubuf_caching_stats";
    GET_CACHE(c, res, fn);
    CHECK_ARG(stats, "%s: NULL argument", fn);
    cubuf_status_t st = cubuf__struct_check(fn, "cubuf_caching_stats_t", stats->struct_size,
                                            CUBUF_CACHING_STATS_SIZE_V1, sizeof *stats);
    if (st != CUBUF_SUCCESS) return st;
    snapshot_t s;
    pthread_mutex_lock(&c->mutex);
    snapshot_locked(c, &s);
    pthread_mutex_unlock(&c->mutex);
    cubuf_caching_stats_t o = CUBUF_CACHING_STATS_INIT;
    o.live_bytes = s.live;
    o.requested_bytes = s.requested;
    o.internal_waste_bytes = s.live - s.requested;
    o.cached_bytes = s.cached;
    o.held_bytes = atomic_load(&c->held);
    o.peak_held_bytes = atomic_load(&c->peak_held);
    o.largest_free_bytes = s.largest;
    o.fragmentation = s.cached ? 1.0 - (double)s.largest / (double)s.cached : 0.0;
    o.live_count = s.live_count;
    o.cached_count = s.cached_count;
    o.hits = s.hits;
    o.cross_stream_reuses = s.cross;
    o.misses = s.misses;
    o.upstream_allocations = atomic_load(&c->up_allocs);
    o.upstream_deallocations = atomic_load(&c->up_deallocs);
    o.oom_retries = atomic_load(&c->oom_retries);
    cubuf__struct_out(stats, &o, sizeof o);
    return CUBUF_SUCCESS;
}
