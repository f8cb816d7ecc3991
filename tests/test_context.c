/* Devices and contexts: primary retained and released, bad ordinals, wrapped
 * contexts, and the caller's current context restored on every path. */
#include "internal.h"
#include "test.h"

static int primary_active(CUdevice dev)
{
    unsigned flags = 0;
    int active = -1;
    T_CU(cuDevicePrimaryCtxGetState, dev, &flags, &active);
    return active;
}

static CUcontext current(void)
{
    CUcontext c = NULL;
    T_CU(cuCtxGetCurrent, &c);
    return c;
}

int main(void)
{
    t_require_gpu();
    int count = 0, version = 0;
    T_OK(cubuf_device_count(&count));
    T_CHECK(count >= 1);
    T_OK(cubuf_driver_version(&version));
    T_CHECK(version >= 13000);

    /* Bad ordinals name the valid range. */
    cubuf_context_t *ctx = NULL;
    T_STATUS(cubuf_context_create(-1, &ctx), CUBUF_ERROR_OUT_OF_RANGE);
    T_CHECK(strstr(cubuf_last_error(), "valid ordinals are 0 to") != NULL);
    T_STATUS(cubuf_context_create(count, &ctx), CUBUF_ERROR_OUT_OF_RANGE);
    T_CHECK(ctx == NULL);
    T_STATUS(cubuf_context_create(0, NULL), CUBUF_ERROR_INVALID_ARGUMENT);

    /* The primary context is retained by create and released by destroy. */
    CUdevice dev;
    T_CU(cuDeviceGet, &dev, 0);
    T_CHECK(primary_active(dev) == 0);
    T_CHECK(current() == NULL);
    T_REQUIRE(cubuf_context_create(0, &ctx));
    T_CHECK(primary_active(dev) == 1);
    T_CHECK(current() == NULL); /* creating made nothing current */
    int ordinal = -1;
    CUcontext handle = NULL;
    T_OK(cubuf_context_device(ctx, &ordinal));
    T_OK(cubuf_context_handle(ctx, &handle));
    T_CHECK(ordinal == 0 && handle != NULL);
    size_t bytes = 1;
    T_OK(cubuf_context_bytes_allocated(ctx, &bytes));
    T_CHECK(bytes == 0);

    /* synchronize with nothing current leaves nothing current. */
    T_OK(cubuf_context_synchronize(ctx));
    T_CHECK(current() == NULL);

    /* With another context current, it stays current, on success and failure. */
    CUcontext mine = NULL;
    T_CU(cuCtxCreate, &mine, NULL, 0, dev);
    T_CHECK(current() == mine);
    T_OK(cubuf_context_synchronize(ctx));
    T_CHECK(current() == mine);
    T_CHECK(cubuf_fault_fail_nth("cuCtxSynchronize", 1, CUDA_ERROR_LAUNCH_FAILED));
    T_STATUS(cubuf_context_synchronize(ctx), CUBUF_ERROR_DRIVER);
    T_CHECK(cubuf_last_cuda_result() == CUDA_ERROR_LAUNCH_FAILED);
    T_CHECK(strstr(cubuf_last_error(), "cuCtxSynchronize failed: CUDA_ERROR_LAUNCH_FAILED") != NULL);
    T_CHECK(current() == mine);
    /* A failed push also leaves the caller's context. */
    T_CHECK(cubuf_fault_fail_nth("cuCtxPushCurrent", 1, CUDA_ERROR_INVALID_CONTEXT));
    T_STATUS(cubuf_context_synchronize(ctx), CUBUF_ERROR_DRIVER);
    T_CHECK(current() == mine);
    cubuf_fault_reset();

    /* A wrapped context is used, never released or destroyed. */
    cubuf_context_t *wrapped = NULL;
    T_STATUS(cubuf_context_wrap(NULL, &wrapped), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CU(cuCtxSetCurrent, NULL);
    T_REQUIRE(cubuf_context_wrap(mine, &wrapped));
    T_CHECK(current() == NULL);
    T_OK(cubuf_context_device(wrapped, &ordinal));
    T_OK(cubuf_context_handle(wrapped, &handle));
    T_CHECK(ordinal == 0 && handle == mine);
    T_OK(cubuf_context_synchronize(wrapped));
    cubuf_context_destroy(wrapped);
    T_CHECK(current() == NULL);
    /* The device's ordinal cannot be found: refused, not a context of
     * device -1 (a failed cuDeviceGet was skipped, and the wrap succeeded). */
    wrapped = NULL;
    T_CHECK(cubuf_fault_fail_nth("cuDeviceGet", 1, CUDA_ERROR_UNKNOWN));
    T_STATUS(cubuf_context_wrap(mine, &wrapped), CUBUF_ERROR_DRIVER);
    T_CHECK(cubuf_fault_fired() && wrapped == NULL && current() == NULL);
    cubuf_fault_reset();
    /* Still alive: it can be made current and synchronized. */
    T_CU(cuCtxPushCurrent, mine);
    T_CU(cuCtxSynchronize);
    CUcontext popped;
    T_CU(cuCtxPopCurrent, &popped);
    T_CHECK(popped == mine);
    T_CU(cuCtxDestroy, mine);

    /* Two cubuf contexts on one device share the primary context; the last destroy releases it. */
    cubuf_context_t *second = NULL;
    T_REQUIRE(cubuf_context_create(0, &second));
    CUcontext h2 = NULL;
    T_OK(cubuf_context_handle(second, &h2));
    T_CHECK(h2 == handle || h2 != NULL);
    cubuf_context_destroy(ctx);
    T_CHECK(primary_active(dev) == 1);
    cubuf_context_destroy(second);
    T_CHECK(primary_active(dev) == 0);

    /* Buffers keep their context (and its primary context) alive past
     * destroy; the last of them releases it. An allocation made directly
     * from the context's pool counts in its bytes_allocated. */
    T_REQUIRE(cubuf_context_create(0, &ctx));
    cubuf_buffer_t *b = NULL, *direct = NULL;
    T_REQUIRE(cubuf_context_new_buffer(ctx, 1000, &b));
    T_REQUIRE(cubuf_resource_allocate(cubuf_buffer_resource(b), 24, CU_STREAM_LEGACY, &direct));
    T_OK(cubuf_context_bytes_allocated(ctx, &bytes));
    T_CHECK(bytes == 1024);
    cubuf_buffer_release(direct);
    T_OK(cubuf_context_bytes_allocated(ctx, &bytes));
    T_CHECK(bytes == 1000);
    CUcontext hb = NULL;
    T_OK(cubuf_context_handle(ctx, &hb));
    cubuf_context_destroy(ctx);
    T_CHECK(primary_active(dev) == 1);
    T_OK(cubuf_buffer_fill_byte(b, 7, CU_STREAM_LEGACY));
    unsigned char last = 0;
    T_CU(cuCtxSetCurrent, hb);
    T_CU(cuMemcpyDtoH, &last, cubuf_buffer_ptr(b) + 999, 1);
    T_CU(cuCtxSetCurrent, NULL);
    T_CHECK(last == 7);
    cubuf_buffer_release(b);
    T_CHECK(primary_active(dev) == 0);

    /* Device info. */
    cubuf_device_info_t info = CUBUF_DEVICE_INFO_INIT;
    T_OK(cubuf_device_get_info(0, &info));
    T_CHECK(info.name[0] != '\0' && info.total_memory > 0 && info.cc_major >= 3);
    T_CHECK(!info.vmm_supported || (info.granularity_minimum > 0 &&
                                    info.granularity_recommended >= info.granularity_minimum));
    cubuf_device_info_t bad = {0};
    T_STATUS(cubuf_device_get_info(0, &bad), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_device_get_info(count, &info), CUBUF_ERROR_OUT_OF_RANGE);
    bool can = false;
    T_OK(cubuf_device_can_access_peer(0, 0, &can));
    T_CHECK(can);
    T_CHECK(primary_active(dev) == 0);
    return t_finish("test_context");
}
