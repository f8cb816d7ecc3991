/* Streams and events for callers (include/cubuf/stream.h). */
#include "internal.h"

/* A context's CUcontext made current for a creation or a query. */
static cubuf_status_t in_ctx(cubuf_context_t *ctx, cubuf_ctx_guard_t *g)
{
    cubuf_status_t st = cubuf__driver_load();
    if (st != CUBUF_SUCCESS) return st;
    return cubuf__ctx_push(ctx->handle, g);
}

/* cuStreamQuery / cuEventQuery: CUDA_ERROR_NOT_READY is an answer, not a failure. */
static cubuf_status_t ready(CUresult r, const char *call, bool *complete)
{
    if (r == CUDA_SUCCESS || r == CUDA_ERROR_NOT_READY) {
        *complete = r == CUDA_SUCCESS;
        return CUBUF_SUCCESS;
    }
    return cubuf__cu_status(r, call);
}

cubuf_status_t cubuf_stream_priority_range(cubuf_context_t *ctx, int *least, int *greatest)
{
    CHECK_ARG(ctx && least && greatest, "cubuf_stream_priority_range: NULL argument");
    cubuf_ctx_guard_t g;
    cubuf_status_t st = in_ctx(ctx, &g);
    if (st != CUBUF_SUCCESS) return st;
    int lo = 0, hi = 0;
    st = CU(cuCtxGetStreamPriorityRange, &lo, &hi);
    cubuf__ctx_pop(&g);
    if (st != CUBUF_SUCCESS) return st;
    *least = lo;
    *greatest = hi;
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf_stream_create(cubuf_context_t *ctx, unsigned flags, int priority, CUstream *out)
{
    CHECK_ARG(ctx && out, "cubuf_stream_create: NULL argument");
    CHECK_ARG(flags == CU_STREAM_DEFAULT || flags == CU_STREAM_NON_BLOCKING,
              "cubuf_stream_create: flags 0x%x are neither CU_STREAM_DEFAULT nor "
              "CU_STREAM_NON_BLOCKING", flags);
    cubuf_ctx_guard_t g;
    cubuf_status_t st = in_ctx(ctx, &g);
    if (st != CUBUF_SUCCESS) return st;
    CUstream s = NULL;
    st = CU(cuStreamCreateWithPriority, &s, flags, priority);
    cubuf__ctx_pop(&g);
    if (st != CUBUF_SUCCESS) {
        cubuf__detail_append("device %d, flags 0x%x, priority %d", ctx->ordinal, flags, priority);
        return st;
    }
    *out = s;
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf_stream_destroy(CUstream stream)
{
    if (!stream) return CUBUF_SUCCESS;
    CHECK_ARG(!cubuf__stream_is_default(stream),
              "cubuf_stream_destroy: CU_STREAM_LEGACY and CU_STREAM_PER_THREAD are default "
              "streams, which cannot be destroyed");
    cubuf_status_t st = cubuf__driver_load();
    if (st == CUBUF_SUCCESS) st = cubuf__caching_forget_everywhere(stream);
    return st != CUBUF_SUCCESS ? st : CU(cuStreamDestroy, stream);
}

cubuf_status_t cubuf_stream_synchronize(CUstream stream)
{
    cubuf_status_t st = cubuf__driver_load();
    return st != CUBUF_SUCCESS ? st : CU(cuStreamSynchronize, stream);
}

cubuf_status_t cubuf_stream_query(CUstream stream, bool *complete)
{
    CHECK_ARG(complete, "cubuf_stream_query: complete is NULL");
    cubuf_status_t st = cubuf__driver_load();
    return st != CUBUF_SUCCESS ? st : ready(CU_CALL(cuStreamQuery, stream), "cuStreamQuery", complete);
}

cubuf_status_t cubuf_stream_wait_event(CUstream stream, CUevent event)
{
    CHECK_ARG(event, "cubuf_stream_wait_event: event is NULL");
    cubuf_status_t st = cubuf__driver_load();
    return st != CUBUF_SUCCESS ? st : CU(cuStreamWaitEvent, stream, event, 0);
}

cubuf_status_t cubuf_event_create(cubuf_context_t *ctx, unsigned flags, CUevent *out)
{
    CHECK_ARG(ctx && out, "cubuf_event_create: NULL argument");
    const unsigned known = CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS;
    CHECK_ARG(!(flags & ~known),
              "cubuf_event_create: flags 0x%x has bits other than CU_EVENT_BLOCKING_SYNC, "
              "CU_EVENT_DISABLE_TIMING and CU_EVENT_INTERPROCESS", flags);
    CHECK_ARG(!(flags & CU_EVENT_INTERPROCESS) || (flags & CU_EVENT_DISABLE_TIMING),
              "cubuf_event_create: CU_EVENT_INTERPROCESS needs CU_EVENT_DISABLE_TIMING");
    cubuf_ctx_guard_t g;
    cubuf_status_t st = in_ctx(ctx, &g);
    if (st != CUBUF_SUCCESS) return st;
    CUevent e = NULL;
    st = CU(cuEventCreate, &e, flags);
    cubuf__ctx_pop(&g);
    if (st != CUBUF_SUCCESS) {
        cubuf__detail_append("device %d, flags 0x%x", ctx->ordinal, flags);
        return st;
    }
    *out = e;
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf_event_destroy(CUevent event)
{
    if (!event) return CUBUF_SUCCESS;
    cubuf_status_t st = cubuf__driver_load();
    return st != CUBUF_SUCCESS ? st : CU(cuEventDestroy, event);
}

cubuf_status_t cubuf_event_record(CUevent event, CUstream stream)
{
    CHECK_ARG(event, "cubuf_event_record: event is NULL");
    cubuf_status_t st = cubuf__driver_load();
    return st != CUBUF_SUCCESS ? st : CU(cuEventRecord, event, stream);
}

cubuf_status_t cubuf_event_synchronize(CUevent event)
{
    CHECK_ARG(event, "cubuf_event_synchronize: event is NULL");
    cubuf_status_t st = cubuf__driver_load();
    return st != CUBUF_SUCCESS ? st : CU(cuEventSynchronize, event);
}

cubuf_status_t cubuf_event_query(CUevent event, bool *complete)
{
    CHECK_ARG(event && complete, "cubuf_event_query: NULL argument");
    cubuf_status_t st = cubuf__driver_load();
    return st != CUBUF_SUCCESS ? st : ready(CU_CALL(cuEventQuery, event), "cuEventQuery", complete);
}
