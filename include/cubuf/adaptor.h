/*
 * Resource adaptors: resources layered over another resource (the
 * "upstream"), each adding one policy. Included by <cubuf.h>; the general
 * rules at the top of that header apply.
 *
 * An adaptor is a cubuf_resource_t like any other: buffers come from it with
 * cubuf_resource_allocate, raw pointers with cubuf_resource_allocate_raw,
 * and adaptors stack (a statistics adaptor over a limiting adaptor over a
 * device pool). Every adaptor:
 *  - allocates and frees through its upstream's raw-pointer interface, in
 *    the caller's thread, on the caller's stream, and passes the upstream's
 *    statuses on unchanged (adding to the detail only what it adds);
 *  - holds a reference to its upstream until its own last reference goes
 *    (buffers hold their resource, so the upstream outlives them all);
 *  - has the upstream's properties (cubuf_resource_props) and context: a
 *    default stream means what it means for the upstream;
 *  - statistics and limiting adaptors count what goes through them in their
 *    own statistics (cubuf_resource_stats, cubuf_statistics_get), apart from
 *    the upstream's, which count every user of the upstream; logging,
 *    tracking and failure-callback adaptors keep none of their own: reading
 *    (or resetting the peaks of) theirs reads (resets) their upstream's;
 *  - is thread-safe: any thread may allocate and free through it. The
 *    counts of a whole stack (its adaptors and the resource at its bottom)
 *    share one lock, taken once per allocate and once per free however many
 *    layers count, so a counting layer adds no atomic operation of its own
 *    (a limiting adaptor adds one per allocate: its admission), and threads
 *    using different adaptors over one upstream meet at that lock.
 * Memory an adaptor did not allocate cannot be handed to it:
 * cubuf_buffer_wrap refuses every adaptor (CUBUF_ERROR_INVALID_ARGUMENT).
 * Every create returns CUBUF_ERROR_INVALID_ARGUMENT (NULL upstream or out,
 * bad options) and CUBUF_ERROR_OUT_OF_MEMORY (host memory), plus what its
 * entry lists; release the adaptor with cubuf_resource_release.
 */
#ifndef CUBUF_ADAPTOR_H
#define CUBUF_ADAPTOR_H
#include <stdio.h>

#include <cubuf.h>
#ifdef __cplusplus
extern "C" {
#endif

/* ---- statistics ---------------------------------------------------------- */

/**
 * What went through a resource, read by cubuf_statistics_get. Initialize
 * with CUBUF_STATISTICS_INIT. "Allocated" bytes are what the resource took
 * from below (a virtual memory resource rounds to its granularity and counts
 * physical allocations); "requested" bytes are what its callers asked for
 * (for a virtual memory resource itself: its buffers' rounded sizes, the
 * sizes they keep; an adaptor over it counts what was asked of the adaptor).
 * Within a scope (cubuf_statistics_push) the figures count from the push:
 * frees of older allocations make current figures negative.
 * A free is counted once the upstream has freed: while one thread's free is
 * under way, memory it has already given back may be allocated by another
 * thread, and the peaks then count that memory twice (never less than what
 * was live; RMM's statistics do the same). A virtual memory upstream counts
 * its own allocations: one that an adaptor above it gives back at once
 * (a tracking adaptor with no memory for its record) stays in the
 * upstream's totals and peaks, as the upstream did make it.
 */
typedef struct cubuf_statistics {
    size_t struct_size;
    int64_t current_bytes;       /**< allocated bytes live now */
    int64_t peak_bytes;          /**< high-water mark of current_bytes */
    int64_t current_count;       /**< allocations live now */
    int64_t peak_count;
    int64_t current_requested;   /**< requested bytes live now */
    int64_t peak_requested;
    uint64_t total_bytes;        /**< allocated bytes, every allocation ever */
    uint64_t total_count;
    uint64_t total_requested;
} cubuf_statistics_t;

#define CUBUF_STATISTICS_INIT {sizeof(cubuf_statistics_t), 0, 0, 0, 0, 0, 0, 0, 0, 0}
/** Size of the first released layout (up to total_requested). */
#define CUBUF_STATISTICS_SIZE_V1 (offsetof(cubuf_statistics_t, total_requested) + sizeof(uint64_t))

/**
 * A statistics adaptor over `upstream`: counts the allocations made through
 * it (cubuf_statistics_get) and keeps nested scopes (cubuf_statistics_push
 * and _pop, as RMM's statistics adaptor's counters). Adds no driver call.
 */
CUBUF_API cubuf_status_t cubuf_statistics_adaptor_create(cubuf_resource_t *upstream,
                                                         cubuf_resource_t **out);

/**
 * The figures of `res` (any resource; for a statistics adaptor with pushed
 * scopes, those of the innermost scope), up to stats->struct_size. One
 * consistent snapshot, no driver call. Returns CUBUF_ERROR_INVALID_ARGUMENT
 * (NULL, struct_size below CUBUF_STATISTICS_SIZE_V1).
 */
CUBUF_API cubuf_status_t cubuf_statistics_get(const cubuf_resource_t *res, cubuf_statistics_t *stats);

/**
 * Sets the peaks of `res` (of its innermost scope where it has one) to the
 * current figures, so the next read shows the high-water mark since now.
 * Returns CUBUF_ERROR_INVALID_ARGUMENT (NULL).
 */
CUBUF_API cubuf_status_t cubuf_statistics_reset_peaks(cubuf_resource_t *res);

/**
 * Opens a scope on a statistics adaptor: from now on cubuf_statistics_get
 * shows what happened since this push. Scopes nest. Returns
 * CUBUF_ERROR_INVALID_ARGUMENT (NULL, not a statistics adaptor),
 * CUBUF_ERROR_OUT_OF_MEMORY.
 */
CUBUF_API cubuf_status_t cubuf_statistics_push(cubuf_resource_t *res);

/**
 * Closes the innermost scope, writes its figures to *popped (may be NULL)
 * and folds them into the scope around it (its totals and current figures
 * add up; its peaks rise to what this scope reached on top of the outer's
 * figures at the push). Returns CUBUF_ERROR_INVALID_ARGUMENT (NULL, not a
 * statistics adaptor, popped->struct_size too small), CUBUF_ERROR_OUT_OF_RANGE
 * (no scope is open).
 */
CUBUF_API cubuf_status_t cubuf_statistics_pop(cubuf_resource_t *res, cubuf_statistics_t *popped);

/* ---- limiting -------------------------------------------------------------- */

/**
 * A limiting adaptor over `upstream`: at most `cap` bytes allocated through
 * it at any moment. A request that would pass the cap fails with
 * CUBUF_ERROR_OUT_OF_MEMORY before the upstream is asked, with a detail
 * naming the request, the cap and the bytes allocated through it now.
 * A request's bytes are held against the cap from the moment it is
 * admitted, so concurrent requests never pass the cap together; they are
 * counted in the statistics once the allocation is made. The cap applies
 * to the bytes requested (over an upstream that rounds them up, virtual
 * memory, the allocated figure is larger). Adds no driver call.
 */
CUBUF_API cubuf_status_t cubuf_limit_adaptor_create(cubuf_resource_t *upstream, size_t cap,
                                                    cubuf_resource_t **out);

/* ---- logging ------------------------------------------------------------------ */

/** Receives one log line (no newline) at a write: on the adaptor's writer
 *  thread, or on the thread whose flush (cubuf_log_adaptor_flush, the last
 *  release, an event whose thread's ring is full while nobody writes, or
 *  one that finds no memory for a ring) writes it, one call at a time. It
 *  must not allocate from or free to the same logging adaptor, release a
 *  reference to it, nor wait for anything a thread allocating through it
 *  may hold (a full ring makes that thread wait for the writes). A flush of
 *  the same adaptor from it returns CUBUF_ERROR_BUSY and writes nothing; it
 *  may flush another logging adaptor only if that one's callback never
 *  flushes this one back (two callbacks flushing each other's adaptors wait
 *  for each other's writes). */
typedef void (*cubuf_log_line_fn)(void *user, const char *line);

/** Options of a logging adaptor. Initialize with CUBUF_LOG_OPTIONS_INIT. */
typedef struct cubuf_log_options {
    size_t struct_size;
    const char *path;            /**< file to write (created or truncated), or NULL */
    cubuf_log_line_fn callback;  /**< or a function to receive the lines, or NULL */
    void *user;                  /**< passed to callback */
    bool precise_time;           /**< read the clock at every event (see below) */
    size_t ring_events;          /**< entries a thread's ring holds: 0 (16384) or a power of
                                      two, 128 to 2^24 (see below) */
} cubuf_log_options_t;

#define CUBUF_LOG_OPTIONS_INIT {sizeof(cubuf_log_options_t), NULL, NULL, NULL, false, 0}
#define CUBUF_LOG_OPTIONS_SIZE_V1 (offsetof(cubuf_log_options_t, user) + sizeof(void *))

/**
 * A logging adaptor over `upstream`: one line per allocate and deallocate,
 *
 *     order,time_ns,thread,stream,operation,pointer,size,status
 *
 * after one header line starting with '#'. `order` places the event among
 * all the adaptor's events: sort the lines by it (ties keep their order in
 * the log) to read them in the order the upstream saw them. An allocation
 * is placed when it returns, a free before it is asked for, so a pointer
 * freed and handed out again, on any thread, sorts freed first; each
 * thread's events come out in its own order. `time_ns` is CLOCK_MONOTONIC
 * in ns, as the adaptor's writer thread last read it (it reads it at least
 * every millisecond while events come), so it may lag the event by about a
 * millisecond and more on a busy machine; it never goes back within a
 * thread. With options->precise_time every event reads the clock itself
 * (20-50 ns each). Then the thread's kernel id, the stream as given,
 * "allocate" or "free", the pointer in hex, the size in bytes, and the
 * status name (a failed allocation logs pointer 0x0). Exactly one of
 * options->path and options->callback is set.
 *
 * Each thread keeps its events in a ring of its own, reused after the
 * thread exits: options->ring_events entries of 32 bytes, by default 16384
 * (512 KiB, allocated when the thread first logs through the adaptor and
 * kept until the adaptor's release). An event takes one entry, one more
 * where the time has moved since the thread's last event (about once a
 * millisecond while events come; at every event with precise_time), and
 * one more where it failed; a thread taking over a ring adds one. A
 * smaller ring saves memory and wakes the writer thread more often; each
 * wake costs the thread a system call. The writer thread writes what
 * the rings hold at least every millisecond and when a ring is half full;
 * a thread whose ring is full waits for space (and writes the log itself
 * when nobody has for 2 ms), so the log's memory stays bounded and a
 * program that allocates faster than its log can be written slows down to
 * the writer's pace. Lines of different threads may therefore interleave
 * out of order (`cubuf replay LOG` sorts, README). A file is flushed at
 * cubuf_log_adaptor_flush and at the last release; what the rings hold
 * when the process exits without either is lost. The writer thread wakes
 * 1000 times a second while events come, 10 times after 100 ms without.
 * A write that fails drops its events with a warning
 * (cubuf_set_warning_handler); an allocation or free through the adaptor
 * reports only its own outcome, cubuf_last_error included. An adaptor
 * made before fork() cannot be used in the child (it has no writer thread
 * there).
 *
 * Returns CUBUF_ERROR_INVALID_ARGUMENT (also: both or neither of path and
 * callback, ring_events not 0 nor a power of two from 128 to 2^24),
 * CUBUF_ERROR_SYSTEM (the file cannot be opened or the writer thread cannot
 * start).
 */
CUBUF_API cubuf_status_t cubuf_log_adaptor_create(cubuf_resource_t *upstream,
                                                  const cubuf_log_options_t *options,
                                                  cubuf_resource_t **out);

/**
 * Writes the events kept so far and flushes the file.
 * Returns CUBUF_ERROR_INVALID_ARGUMENT (NULL, not a logging adaptor),
 * CUBUF_ERROR_BUSY (called from the adaptor's own line callback),
 * CUBUF_ERROR_SYSTEM (a write failed; the events are dropped).
 */
CUBUF_API cubuf_status_t cubuf_log_adaptor_flush(cubuf_resource_t *res);

/* ---- tracking ------------------------------------------------------------------ */

/**
 * A tracking adaptor over `upstream`: remembers every outstanding
 * allocation made through it (pointer, size, stream, thread and, with
 * `backtraces`, the call stack of the allocation). A free of a pointer (or
 * size) it does not hold is CUBUF_ERROR_INVALID_ARGUMENT, and the upstream
 * is not called. At its last release it reports what is still outstanding
 * to the warning handler (cubuf_set_warning_handler): a warning with the
 * totals, then one per allocation (the report's line and, where kept, its
 * backtrace a frame a line, cut at the warning's 1023 characters). Memory
 * it did not allocate cannot be wrapped onto it.
 */
CUBUF_API cubuf_status_t cubuf_tracking_adaptor_create(cubuf_resource_t *upstream, bool backtraces,
                                                       cubuf_resource_t **out);

/**
 * How many allocations are outstanding and their bytes (either may be NULL).
 * Returns CUBUF_ERROR_INVALID_ARGUMENT (res NULL or not a tracking adaptor).
 */
CUBUF_API cubuf_status_t cubuf_tracking_outstanding(const cubuf_resource_t *res, size_t *count,
                                                    size_t *bytes);

/**
 * Writes one line per outstanding allocation to `out` (pointer, size,
 * stream, thread), each followed by its backtrace where one was kept,
 * after a line with the totals. Returns CUBUF_ERROR_INVALID_ARGUMENT
 * (NULL, not a tracking adaptor), CUBUF_ERROR_SYSTEM (a write failed).
 */
CUBUF_API cubuf_status_t cubuf_tracking_report(const cubuf_resource_t *res, FILE *out);

/* ---- failure callback ------------------------------------------------------------ */

/**
 * Called when the upstream reports CUBUF_ERROR_OUT_OF_MEMORY for `size`
 * bytes; `attempt` counts the calls for this request (1, 2, ...). It may
 * free memory (close buffers, trim pools, empty a cache) and return true to
 * have the allocation tried again, or false to let it fail. Runs in the
 * allocating thread with no cubuf lock held; it may allocate from and free
 * to any resource, this adaptor included.
 */
typedef bool (*cubuf_oom_callback_fn)(void *user, size_t size, unsigned attempt);

/**
 * A failure-callback adaptor over `upstream` (RMM's failure_callback
 * adaptor, PyTorch's free-and-retry): on out of memory it calls `callback`
 * and retries while the callback says so. Adds nothing to an allocation
 * that succeeds. Returns CUBUF_ERROR_INVALID_ARGUMENT (callback NULL).
 */
CUBUF_API cubuf_status_t cubuf_failure_adaptor_create(cubuf_resource_t *upstream,
                                                      cubuf_oom_callback_fn callback, void *user,
                                                      cubuf_resource_t **out);

#ifdef __cplusplus
}
#endif
#endif
