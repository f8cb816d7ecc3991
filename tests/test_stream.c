/* Stream tokens: default streams bind to a context; capture queries. */
#include "internal.h"
#include "test.h"

int main(void)
{
    t_require_gpu();
    cubuf_context_t *ctx = NULL;
    T_REQUIRE(cubuf_context_create(0, &ctx));
    CUcontext h = ctx->handle;

    cubuf_stream_token_t t;
    /* No current context and no fallback: a default stream cannot be bound. */
    T_CU(cuCtxSetCurrent, NULL);
    T_STATUS(cubuf__stream_record(&t, CU_STREAM_LEGACY, NULL, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    /* The fallback is used when nothing is current (and is not current). */
    bool current = true;
    T_OK(cubuf__stream_record(&t, NULL, h, &current));
    T_CHECK(t.ctx == h && t.stream == NULL && !current);
    T_OK(cubuf__stream_sync(&t));
    CUcontext cur = (CUcontext)1;
    T_CU(cuCtxGetCurrent, &cur);
    T_CHECK(cur == NULL); /* sync restored "nothing current" */

    /* The current context wins over the fallback. */
    T_CU(cuCtxSetCurrent, h);
    T_OK(cubuf__stream_record(&t, CU_STREAM_PER_THREAD, NULL, &current));
    T_CHECK(t.ctx == h && current);
    /* A user stream is recorded as is, with no context. */
    CUstream s;
    T_CU(cuStreamCreate, &s, CU_STREAM_DEFAULT);
    current = false;
    T_OK(cubuf__stream_record(&t, s, h, &current));
    T_CHECK(t.stream == s && t.ctx == NULL && current);

    /* Capture status: not capturing, then capturing, then the legacy stream
     * reports the implicit dependency as active. */
    CUstreamCaptureStatus cs;
    T_OK(cubuf__stream_capture_status(s, NULL, &cs));
    T_CHECK(cs == CU_STREAM_CAPTURE_STATUS_NONE);
    T_OK(cubuf__stream_refuse_capture(s, NULL, "test"));
    T_CU(cuStreamBeginCapture, s, CU_STREAM_CAPTURE_MODE_RELAXED);
    T_OK(cubuf__stream_capture_status(s, NULL, &cs));
    T_CHECK(cs == CU_STREAM_CAPTURE_STATUS_ACTIVE);
    T_STATUS(cubuf__stream_refuse_capture(s, NULL, "test"), CUBUF_ERROR_STREAM_CAPTURING);
    T_OK(cubuf__stream_capture_status(CU_STREAM_LEGACY, h, &cs));
    T_CHECK(cs == CU_STREAM_CAPTURE_STATUS_ACTIVE);
    /* The queries did not invalidate the capture. */
    CUgraph g = NULL;
    T_CU(cuStreamEndCapture, s, &g);
    T_CHECK(g != NULL);
    T_CU(cuGraphDestroy, g);
    T_OK(cubuf__stream_capture_status(CU_STREAM_LEGACY, h, &cs));
    T_CHECK(cs == CU_STREAM_CAPTURE_STATUS_NONE);
    T_CU(cuStreamDestroy, s);
    T_CU(cuCtxSetCurrent, NULL);
    cubuf_context_destroy(ctx);
    return t_finish("test_stream");
}
