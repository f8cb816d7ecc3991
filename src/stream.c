/* Deallocation-stream tokens and capture checks. */
#include "internal.h"

cubuf_status_t cubuf__stream_record(cubuf_stream_token_t *t, CUstream s, CUcontext own)
{
    t->stream = s;
    t->ctx = NULL;
    if (!cubuf__stream_is_default(s)) return CUBUF_SUCCESS;
    if (own) {
        t->ctx = own;
        return CUBUF_SUCCESS;
    }
    /* A user resource or an empty view may be the first thing to ask. */
    cubuf_status_t st = cubuf__driver_load();
    if (st != CUBUF_SUCCESS) return st;
    CUcontext cur = NULL;
    if ((st = CU(cuCtxGetCurrent, &cur)) != CUBUF_SUCCESS) return st;
    if (!cur)
        return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,
                           "cannot record a default stream: the memory belongs to no context and "
                           "no CUDA context is current");
    t->ctx = cur;
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf__stream_capture_status(CUstream s, CUcontext ctx, CUstreamCaptureStatus *status)
{
    cubuf_ctx_guard_t g = {false};
    cubuf_status_t st = CUBUF_SUCCESS;
    if (cubuf__stream_is_default(s) && (st = cubuf__ctx_push(ctx, &g)) != CUBUF_SUCCESS)
        return st;
    CUstreamCaptureStatus cs = CU_STREAM_CAPTURE_STATUS_NONE;
    CUresult r = CU_CALL(cuStreamIsCapturing, s, &cs);
    cubuf__ctx_pop(&g);
    if (r == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) {
        /* The legacy stream would wait on a capturing blocking stream:
         * synchronizing it would invalidate that capture. */
        *status = CU_STREAM_CAPTURE_STATUS_ACTIVE;
        return CUBUF_SUCCESS;
    }
    if (r != CUDA_SUCCESS) return cubuf__cu_status(r, "cuStreamIsCapturing");
    *status = cs;
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf__stream_refuse_capture(CUstream s, CUcontext ctx, const char *what)
{
    CUstreamCaptureStatus cs = CU_STREAM_CAPTURE_STATUS_NONE;
    cubuf_status_t st = cubuf__stream_capture_status(s, ctx, &cs);
    if (st != CUBUF_SUCCESS) return st;
    if (cs != CU_STREAM_CAPTURE_STATUS_NONE)
        return cubuf__fail(CUBUF_ERROR_STREAM_CAPTURING, "%s: the stream is capturing", what);
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf__stream_sync(const cubuf_stream_token_t *t)
{
    cubuf_ctx_guard_t g = {false};
    cubuf_status_t st;
    if ((st = cubuf__ctx_push(t->ctx, &g)) != CUBUF_SUCCESS) return st;
    st = CU(cuStreamSynchronize, t->stream);
    cubuf__ctx_pop(&g);
    return st;
}

cubuf_status_t cubuf__stream_sync_for_free(const cubuf_stream_token_t *t, const char *kind)
{
    CUstreamCaptureStatus cs = CU_STREAM_CAPTURE_STATUS_NONE;
    cubuf_status_t st = cubuf__stream_capture_status(t->stream, t->ctx, &cs);
    if (st != CUBUF_SUCCESS) return st;
    if (cs != CU_STREAM_CAPTURE_STATUS_NONE)
        return cubuf__fail(CUBUF_ERROR_STREAM_CAPTURING,
                           "closing a %s buffer synchronizes its deallocation stream, which is "
                           "capturing (or a capture depends on it); the buffer stays open (close "
                           "it on a stream that is not capturing)",
                           kind);
    return cubuf__stream_sync(t);
}
