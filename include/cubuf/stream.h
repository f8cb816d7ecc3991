/*
 * cubuf streams and events: what a program needs to order its work without
 * linking libcuda. Included by <cubuf.h>; see the general rules at the top
 * of that header.
 *
 * Streams and events are the driver's own CUstream and CUevent: a stream
 * made here can be passed to any cubuf function or driver call that takes a
 * stream, and one made elsewhere can be passed here. Each one belongs to the
 * CUDA context it was created in (a cubuf context's CUcontext): destroy it
 * while that context lives. A cubuf context made by cubuf_context_create is
 * the device's primary context, which lives at least until the last
 * cubuf_context_destroy of it (and its last buffer) is gone.
 *
 * Default streams (0 or CU_STREAM_LEGACY, CU_STREAM_PER_THREAD) are those
 * of the calling thread's current context; with no context current the
 * driver refuses them (CUBUF_ERROR_DRIVER). Created streams and events need
 * no current context.
 *
 * Every function checks its arguments before it loads the driver, so bad
 * arguments give CUBUF_ERROR_INVALID_ARGUMENT even without one. A driver
 * failure is CUBUF_ERROR_DRIVER, with the CUresult in
 * cubuf_last_cuda_result() and the call named in cubuf_last_error(); as
 * everywhere in cubuf, CUDA_ERROR_OUT_OF_MEMORY gives
 * CUBUF_ERROR_OUT_OF_MEMORY and the capture errors (synchronizing a
 * capturing stream) CUBUF_ERROR_STREAM_CAPTURING. Without a driver:
 * CUBUF_ERROR_NO_DRIVER.
 * Thread-safety: as the driver's (any stream or event from any thread);
 * destroying one while another thread uses it is the caller's race.
 */
#ifndef CUBUF_STREAM_H
#define CUBUF_STREAM_H
#include <cubuf.h>
#ifdef __cplusplus
extern "C" {
#endif

/**
 * The priorities streams of `ctx` may have (cuCtxGetStreamPriorityRange):
 * *greatest is the highest priority and is numerically the lowest (-5 on
 * recent GPUs), *least the lowest (0, the default priority).
 * Returns CUBUF_ERROR_INVALID_ARGUMENT (a NULL argument),
 * CUBUF_ERROR_NO_DRIVER, CUBUF_ERROR_DRIVER.
 */
CUBUF_API cubuf_status_t cubuf_stream_priority_range(cubuf_context_t *ctx, int *least,
                                                     int *greatest);

/**
 * Creates a stream in `ctx` (cuStreamCreateWithPriority). `flags`:
 * CU_STREAM_DEFAULT (the stream waits for the legacy default stream and it
 * for the stream) or CU_STREAM_NON_BLOCKING (no implicit ordering with the
 * legacy default stream). `priority`: 0 is the default; lower numbers are
 * higher priorities; a value outside cubuf_stream_priority_range is clamped
 * to it by the driver. The caller owns *out and destroys it with
 * cubuf_stream_destroy while `ctx`'s CUDA context lives.
 * Returns CUBUF_ERROR_INVALID_ARGUMENT (a NULL argument, flags other than
 * those two), CUBUF_ERROR_NO_DRIVER, CUBUF_ERROR_OUT_OF_MEMORY,
 * CUBUF_ERROR_DRIVER.
 */
CUBUF_API cubuf_status_t cubuf_stream_create(cubuf_context_t *ctx, unsigned flags, int priority,
                                             CUstream *out);

/**
 * Destroys a stream made by cubuf_stream_create (or cuStreamCreate*)
 * (cuStreamDestroy): work already queued on it still runs, and its
 * resources are freed once it has. First, the blocks any live caching
 * resource keeps on the stream go back to its upstream, ordered on the
 * stream (cubuf_caching_forget_stream on each, cubuf/caching.h); when one
 * of those give-backs fails, its blocks stay cached, the stream is not
 * destroyed, and the failure is returned (destroy it again later). NULL
 * (the legacy default stream's handle) is a no-op returning CUBUF_SUCCESS.
 * Returns CUBUF_ERROR_INVALID_ARGUMENT for CU_STREAM_LEGACY or
 * CU_STREAM_PER_THREAD (a default stream cannot be destroyed),
 * CUBUF_ERROR_NO_DRIVER, CUBUF_ERROR_DRIVER, or a give-back's status.
 */
CUBUF_API cubuf_status_t cubuf_stream_destroy(CUstream stream);

/**
 * Blocks until all work queued on `stream` has completed
 * (cuStreamSynchronize). Returns CUBUF_ERROR_DRIVER with the error of the
 * failed work, CUBUF_ERROR_NO_DRIVER.
 */
CUBUF_API cubuf_status_t cubuf_stream_synchronize(CUstream stream);

/**
 * Whether all work queued on `stream` has completed (cuStreamQuery), without
 * waiting: *complete is true when the stream is idle, false while work is
 * pending (CUDA_ERROR_NOT_READY, which is not a failure: CUBUF_SUCCESS).
 * Returns CUBUF_ERROR_INVALID_ARGUMENT (complete NULL), CUBUF_ERROR_DRIVER
 * (failed work), CUBUF_ERROR_NO_DRIVER.
 */
CUBUF_API cubuf_status_t cubuf_stream_query(CUstream stream, bool *complete);

/**
 * Makes future work on `stream` wait until `event` has completed
 * (cuStreamWaitEvent), without blocking the host. The event may belong to
 * another context or device. An event never recorded is complete.
 * Returns CUBUF_ERROR_INVALID_ARGUMENT (event NULL), CUBUF_ERROR_NO_DRIVER,
 * CUBUF_ERROR_DRIVER.
 */
CUBUF_API cubuf_status_t cubuf_stream_wait_event(CUstream stream, CUevent event);

/**
 * Creates an event in `ctx` (cuEventCreate). `flags` is a combination of
 * CU_EVENT_DEFAULT (0), CU_EVENT_BLOCKING_SYNC (synchronize sleeps rather
 * than spins), CU_EVENT_DISABLE_TIMING (cheaper; required with
 * CU_EVENT_INTERPROCESS) and CU_EVENT_INTERPROCESS. The caller owns *out and
 * destroys it with cubuf_event_destroy while `ctx`'s CUDA context lives.
 * Returns CUBUF_ERROR_INVALID_ARGUMENT (a NULL argument, other flag bits,
 * CU_EVENT_INTERPROCESS without CU_EVENT_DISABLE_TIMING),
 * CUBUF_ERROR_NO_DRIVER, CUBUF_ERROR_OUT_OF_MEMORY, CUBUF_ERROR_DRIVER.
 */
CUBUF_API cubuf_status_t cubuf_event_create(cubuf_context_t *ctx, unsigned flags, CUevent *out);

/**
 * Destroys an event (cuEventDestroy); if it is recorded and not yet
 * complete, its resources are freed once it is. NULL is a no-op returning
 * CUBUF_SUCCESS. Returns CUBUF_ERROR_NO_DRIVER, CUBUF_ERROR_DRIVER.
 */
CUBUF_API cubuf_status_t cubuf_event_destroy(CUevent event);

/**
 * Records `event` on `stream` (cuEventRecord): the event completes when all
 * work queued on the stream before this call has. Recording again replaces
 * the earlier record. Event and stream must belong to the same context (a
 * default stream: the current context).
 * Returns CUBUF_ERROR_INVALID_ARGUMENT (event NULL), CUBUF_ERROR_NO_DRIVER,
 * CUBUF_ERROR_DRIVER (another context's stream, among others).
 */
CUBUF_API cubuf_status_t cubuf_event_record(CUevent event, CUstream stream);

/**
 * Blocks until the work the event waits for has completed
 * (cuEventSynchronize); an event never recorded is complete at once.
 * Returns CUBUF_ERROR_INVALID_ARGUMENT (event NULL), CUBUF_ERROR_DRIVER,
 * CUBUF_ERROR_NO_DRIVER.
 */
CUBUF_API cubuf_status_t cubuf_event_synchronize(CUevent event);

/**
 * Whether the event has completed (cuEventQuery), without waiting:
 * *complete true when it has (or was never recorded), false while the work
 * it waits for is pending (CUBUF_SUCCESS both).
 * Returns CUBUF_ERROR_INVALID_ARGUMENT (a NULL argument), CUBUF_ERROR_DRIVER,
 * CUBUF_ERROR_NO_DRIVER.
 */
CUBUF_API cubuf_status_t cubuf_event_query(CUevent event, bool *complete);

#ifdef __cplusplus
}
#endif
#endif
