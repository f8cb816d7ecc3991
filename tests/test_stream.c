/* Stream tokens: default streams bind to a context; capture queries. */
#include "internal.h"
#include "test.h"

int main(void)
{
    t_require_gpu();
    cubuf_context_t *ctx = NULL;
    T_REQUIRE(cubuf_context_create(0, &ctx));
    CUcontext h = t_cu(ctx);

    cubuf_stream_token_t t;
    /* No current context and no own context: a default stream cannot be bound. */
    T_CU(cuCtxSetCurrent, NULL);
    T_STATUS(cubuf__stream_record(&t, CU_STREAM_LEGACY, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    /* The memory's own context is used when nothing is current. */
    T_OK(cubuf__stream_record(&t, NULL, h));
    T_CHECK(t.ctx == h && t.stream == NULL);
    T_OK(cubuf__stream_sync(&t));
    CUcontext cur = (CUcontext)1;
    T_CU(cuCtxGetCurrent, &cur);
    T_CHECK(cur == NULL); /* sync restored "nothing current" */

    /* The memory's own context wins over the current one ("Default streams"). */
    CUcontext other = NULL;
    T_CU(cuCtxCreate, &other, NULL, 0, cubuf__inspect_context_device(ctx)); /* current now */
    T_OK(cubuf__stream_record(&t, CU_STREAM_PER_THREAD, h));
    T_CHECK(t.ctx == h && t.stream == CU_STREAM_PER_THREAD);
    /* Memory of no context binds to the current one. */
    T_OK(cubuf__stream_record(&t, CU_STREAM_LEGACY, NULL));
    T_CHECK(t.ctx == other);
    T_CU(cuCtxDestroy, other);
    T_CU(cuCtxSetCurrent, h);
    /* A user stream is recorded as is, with no context. */
    CUstream s;
    T_CU(cuStreamCreate, &s, CU_STREAM_DEFAULT);
    T_OK(cubuf__stream_record(&t, s, h));
    T_CHECK(t.stream == s && t.ctx == NULL);

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
