/* Recorded streams and capture queries (stream.c). Private: never installed. */
#ifndef CUBUF_STREAM_TOKEN_H
#define CUBUF_STREAM_TOKEN_H

#include "common.h"

/* ---- streams (stream.c) ---------------------------------------------------- */

/* A recorded deallocation stream. A default stream is bound to a context. */
typedef struct cubuf_stream_token {
    CUstream stream;
    CUcontext ctx; /* for default streams: the context they were bound in; else NULL */
} cubuf_stream_token_t;

static inline bool cubuf__stream_is_default(CUstream s)
{
    return s == NULL || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD;
}
/* Records `s`. A default stream binds to `own`, the context the memory
 * belongs to (cubuf__buffer_exec_ctx), and only when there is none to the
 * caller's current context; the work a caller orders on "stream 0" runs in
 * that same context (cubuf.h, "Default streams"). Returns
 * CUBUF_ERROR_INVALID_ARGUMENT when neither exists, CUBUF_ERROR_NO_DRIVER. */
cubuf_status_t cubuf__stream_record(cubuf_stream_token_t *t, CUstream s, CUcontext own);
/* Capture status of a stream (default streams queried inside `ctx`). A
 * default stream whose query reports an implicit dependency on a capturing
 * stream reads as CU_STREAM_CAPTURE_STATUS_ACTIVE. */
cubuf_status_t cubuf__stream_capture_status(CUstream s, CUcontext ctx, CUstreamCaptureStatus *status);
/* CUBUF_ERROR_STREAM_CAPTURING if s is capturing (naming `what`), else success. */
cubuf_status_t cubuf__stream_refuse_capture(CUstream s, CUcontext ctx, const char *what);
/* Synchronizes a recorded stream in its context. */
cubuf_status_t cubuf__stream_sync(const cubuf_stream_token_t *t);
/* Gives back to their upstreams the blocks every live caching resource
 * keeps on `stream` (cubuf_caching_forget_stream on each), for
 * cubuf_stream_destroy (caching.c). The first failure; the blocks whose
 * give-back failed stay cached. */
cubuf_status_t cubuf__caching_forget_everywhere(CUstream stream);
/* Before a synchronous free: synchronizes the deallocation stream, after
 * refusing (CUBUF_ERROR_STREAM_CAPTURING, naming a `kind` buffer) a stream
 * that captures or that a capture depends on, since synchronizing it would
 * invalidate the capture. The buffer then stays open. */
cubuf_status_t cubuf__stream_sync_for_free(const cubuf_stream_token_t *t, const char *kind);

#endif
