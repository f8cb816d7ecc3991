/* Pool peer access on one GPU: argument errors, and revoking and granting a
 * device's access to a pinned pool, read back through the driver. */
#include "internal.h"
#include "resource_pool.h"
#include "test.h"

int main(void)
{
    t_require_gpu();
    int count = 0;
    T_REQUIRE(cubuf_device_count(&count));
    cubuf_context_t *ctx = NULL;
    T_REQUIRE(cubuf_context_create(0, &ctx));
    T_CU(cuCtxSetCurrent, t_cu(ctx));

    cubuf_resource_t *dev_pool = NULL, *pinned = NULL, *sync = NULL;
    cubuf_device_resource_options_t o = CUBUF_DEVICE_RESOURCE_OPTIONS_INIT;
    o.private_pool = true;
    T_REQUIRE(cubuf_device_resource_create(0, &o, &dev_pool));
    T_REQUIRE(cubuf_pinned_resource_create(0, false, &pinned));
    T_REQUIRE(cubuf_sync_device_resource_create(0, &sync));

    bool granted = false;
    /* Errors. */
    T_STATUS(cubuf_resource_set_peer_access(NULL, 0, true), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_resource_set_peer_access(sync, 0, true), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(strstr(cubuf_last_error(), "not a pool resource") != NULL);
    T_STATUS(cubuf_resource_set_peer_access(dev_pool, 0, false), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(strstr(cubuf_last_error(), "owns the pool") != NULL);
    T_STATUS(cubuf_resource_set_peer_access(dev_pool, count, true), CUBUF_ERROR_OUT_OF_RANGE);
    T_CHECK(strstr(cubuf_last_error(), "valid ordinals are 0 to") != NULL);
    T_STATUS(cubuf_resource_set_peer_access(dev_pool, -1, true), CUBUF_ERROR_OUT_OF_RANGE);
    T_STATUS(cubuf_resource_peer_access(dev_pool, 0, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_resource_peer_access(sync, 0, &granted), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_resource_peer_access(dev_pool, count, &granted), CUBUF_ERROR_OUT_OF_RANGE);

    /* The owner of a device pool always has access. */
    T_OK(cubuf_resource_peer_access(dev_pool, 0, &granted));
    T_CHECK(granted);

    /* A pinned pool: device 0 was granted at creation; revoke, check with the
     * driver, grant again, and use the memory from the device. */
    T_OK(cubuf_resource_peer_access(pinned, 0, &granted));
    T_CHECK(granted);
    T_OK(cubuf_resource_set_peer_access(pinned, 0, false));
    T_OK(cubuf_resource_peer_access(pinned, 0, &granted));
    T_CHECK(!granted);
    CUmemLocation loc = {CU_MEM_LOCATION_TYPE_DEVICE, 0};
    CUmemAccess_flags flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    T_CU(cuMemPoolGetAccess, &flags, cubuf__pool_handle(pinned), &loc);
    T_CHECK(flags == CU_MEM_ACCESS_FLAGS_PROT_NONE);
    T_OK(cubuf_resource_set_peer_access(pinned, 0, true));
    T_OK(cubuf_resource_peer_access(pinned, 0, &granted));
    T_CHECK(granted);

    CUstream s;
    T_CU(cuStreamCreate, &s, CU_STREAM_NON_BLOCKING);
    cubuf_buffer_t *h = NULL, *d = NULL;
    T_REQUIRE(cubuf_resource_allocate(pinned, 4096, s, &h));
    T_REQUIRE(cubuf_resource_allocate(dev_pool, 4096, s, &d));
    memset((void *)(uintptr_t)cubuf_buffer_ptr(h), 0x6b, 4096);
    T_OK(cubuf_buffer_copy_from(d, h, s, NULL));
    T_CU(cuStreamSynchronize, s);
    unsigned char back[4096];
    T_CU(cuMemcpyDtoH, back, cubuf_buffer_ptr(d), sizeof back);
    size_t bad = 0;
    for (size_t i = 0; i < sizeof back; i++) bad += back[i] != 0x6b;
    T_CHECK(bad == 0);
    cubuf_buffer_release(h);
    cubuf_buffer_release(d);
    T_CU(cuStreamSynchronize, s);
    T_CU(cuStreamDestroy, s);

    cubuf_resource_release(dev_pool);
    cubuf_resource_release(pinned);
    cubuf_resource_release(sync);
    T_CU(cuCtxSetCurrent, NULL);
    cubuf_context_destroy(ctx);
    return t_finish("test_peer_access");
}
