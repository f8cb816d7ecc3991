/* Without a driver every call says CUBUF_ERROR_NO_DRIVER, with a detail. Runs everywhere. */
#include <stdint.h>
#include <stdlib.h>

#include "test.h"

static int fake_calls;

static cubuf_status_t fake_allocate(void *state, size_t size, CUstream stream, CUdeviceptr *ptr)
{
    (void)size, (void)stream;
    ++*(int *)state;
    *ptr = 0x1000;
    return CUBUF_SUCCESS;
}

static cubuf_status_t fake_deallocate(void *state, CUdeviceptr ptr, size_t size, CUstream stream)
{
    (void)ptr, (void)size, (void)stream;
    ++*(int *)state;
    return CUBUF_SUCCESS;
}

int main(void)
{
    setenv("CUBUF_LIBCUDA", "/nonexistent/libcuda-for-cubuf-test.so.1", 1);
    int v = -1, count = -1;
    T_STATUS(cubuf_driver_version(&v), CUBUF_ERROR_NO_DRIVER);
    T_CHECK(v == -1);
    T_CHECK(strstr(cubuf_last_error(), "/nonexistent/libcuda-for-cubuf-test.so.1") != NULL);
    T_STATUS(cubuf_device_count(&count), CUBUF_ERROR_NO_DRIVER);
    T_CHECK(count == -1);
    cubuf_context_t *ctx = NULL;
    T_STATUS(cubuf_context_create(0, &ctx), CUBUF_ERROR_NO_DRIVER);
    T_CHECK(ctx == NULL);
    cubuf_device_info_t info = CUBUF_DEVICE_INFO_INIT;
    T_STATUS(cubuf_device_get_info(0, &info), CUBUF_ERROR_NO_DRIVER);
    cubuf_buffer_t *buf = NULL;
    T_STATUS(cubuf_buffer_view(0x1000, 16, &buf), CUBUF_ERROR_NO_DRIVER);
    /* A 0/0 view needs no driver at all. */
    T_OK(cubuf_buffer_view(0, 0, &buf));
    T_CHECK(buf && cubuf_buffer_size(buf) == 0 && !cubuf_buffer_is_closed(buf));
    cubuf_buffer_release(buf);
    /* A view frees nothing: its deallocation stream is kept without asking
     * the driver (it once crashed here, then was refused). */
    T_OK(cubuf_buffer_view(0, 0, &buf));
    T_OK(cubuf_buffer_set_deallocation_stream(buf, NULL));
    T_OK(cubuf_buffer_close_on(buf, CU_STREAM_PER_THREAD));
    cubuf_buffer_release(buf);
    cubuf_resource_ops_t ops = {.version = CUBUF_RESOURCE_OPS_VERSION,
                                .allocate = fake_allocate,
                                .deallocate = fake_deallocate};
    cubuf_resource_t *res = NULL;
    T_OK(cubuf_resource_create(&ops, NULL, &fake_calls, &res));
    buf = NULL;
    T_STATUS(cubuf_resource_allocate(res, 16, NULL, &buf), CUBUF_ERROR_NO_DRIVER);
    T_STATUS(cubuf_resource_allocate(res, 16, CU_STREAM_PER_THREAD, &buf), CUBUF_ERROR_NO_DRIVER);
    T_STATUS(cubuf_buffer_wrap(0x1000, 16, res, CU_STREAM_LEGACY, &buf), CUBUF_ERROR_NO_DRIVER);
    T_CHECK(buf == NULL && fake_calls == 0);
    /* A user resource on a created stream needs no driver at all. */
    CUstream mine = (CUstream)(uintptr_t)0x5000;
    T_OK(cubuf_resource_allocate(res, 16, mine, &buf));
    T_CHECK(buf && cubuf_buffer_ptr(buf) == 0x1000 && fake_calls == 1);
    T_OK(cubuf_buffer_close(buf));
    T_CHECK(fake_calls == 2 && cubuf_buffer_is_closed(buf));
    cubuf_buffer_release(buf);
    cubuf_resource_release(res);
    /* Streams and events: arguments are checked before the driver is needed. */
    int dummy_ctx = 0, lo = 7, hi = 7;
    cubuf_context_t *fake_ctx = (cubuf_context_t *)(void *)&dummy_ctx; /* never dereferenced */
    CUstream s = (CUstream)(uintptr_t)0x77;
    CUevent e = (CUevent)(uintptr_t)0x77;
    bool done = false;
    T_STATUS(cubuf_stream_create(NULL, CU_STREAM_DEFAULT, 0, &s), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_stream_create(fake_ctx, CU_STREAM_DEFAULT, 0, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_stream_create(fake_ctx, 0x10, 0, &s), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(strstr(cubuf_last_error(), "0x10") != NULL);
    T_STATUS(cubuf_stream_create(fake_ctx, CU_STREAM_NON_BLOCKING, -1, &s), CUBUF_ERROR_NO_DRIVER);
    T_CHECK(s == (CUstream)(uintptr_t)0x77);
    T_STATUS(cubuf_stream_priority_range(NULL, &lo, &hi), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_stream_priority_range(fake_ctx, NULL, &hi), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_stream_priority_range(fake_ctx, &lo, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_stream_priority_range(fake_ctx, &lo, &hi), CUBUF_ERROR_NO_DRIVER);
    T_CHECK(lo == 7 && hi == 7);
    T_OK(cubuf_stream_destroy(NULL));
    T_STATUS(cubuf_stream_destroy(CU_STREAM_LEGACY), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_stream_destroy(CU_STREAM_PER_THREAD), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_stream_destroy(s), CUBUF_ERROR_NO_DRIVER);
    T_STATUS(cubuf_stream_synchronize(NULL), CUBUF_ERROR_NO_DRIVER);
    T_STATUS(cubuf_stream_query(s, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_stream_query(s, &done), CUBUF_ERROR_NO_DRIVER);
    T_STATUS(cubuf_stream_wait_event(s, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_stream_wait_event(s, e), CUBUF_ERROR_NO_DRIVER);
    T_STATUS(cubuf_event_create(NULL, 0, &e), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_event_create(fake_ctx, 0, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_event_create(fake_ctx, 0x80, &e), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_event_create(fake_ctx, CU_EVENT_INTERPROCESS, &e), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_event_create(fake_ctx, CU_EVENT_DISABLE_TIMING, &e), CUBUF_ERROR_NO_DRIVER);
    T_CHECK(e == (CUevent)(uintptr_t)0x77);
    T_OK(cubuf_event_destroy(NULL));
    T_STATUS(cubuf_event_destroy(e), CUBUF_ERROR_NO_DRIVER);
    T_STATUS(cubuf_event_record(NULL, s), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_event_record(e, s), CUBUF_ERROR_NO_DRIVER);
    T_STATUS(cubuf_event_synchronize(NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_event_synchronize(e), CUBUF_ERROR_NO_DRIVER);
    T_STATUS(cubuf_event_query(NULL, &done), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_event_query(e, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_event_query(e, &done), CUBUF_ERROR_NO_DRIVER);
    T_CHECK(!done);
    /* The floor needs no driver. */
    T_CHECK(cubuf_driver_min_version() >= 12000);
    /* The second call reports the same, quickly, from the cached load result. */
    T_STATUS(cubuf_driver_version(&v), CUBUF_ERROR_NO_DRIVER);
    return t_finish("test_nodriver");
}
