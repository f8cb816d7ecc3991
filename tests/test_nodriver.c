/* Without a driver every call says CUBUF_ERROR_NO_DRIVER, with a detail. Runs everywhere. */
#include <stdlib.h>

#include "test.h"

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
    /* The second call reports the same, quickly, from the cached load result. */
    T_STATUS(cubuf_driver_version(&v), CUBUF_ERROR_NO_DRIVER);
    return t_finish("test_nodriver");
}
