/* The public headers alone (<cubuf.h>, and <cubuf/dlpack.h>, which it does
 * not include), as strict C11 (-Wall -Wextra -Wpedantic -Werror);
 * linked against the shared library. Every _INIT macro compiles without a
 * warning (all fields given) and sets struct_size; every first-layout size
 * lies within its struct. */
#include <cubuf.h>
#include <cubuf/dlpack.h>
#include <cubuf/dist.h>
#include <cubuf/caching.h>
#include <stdio.h>

#define CHECK_INIT(type, init, v1)                                                  \
    do {                                                                           \
        type x_ = init;                                                            \
        _Static_assert((v1) > sizeof(size_t) && (v1) <= sizeof(type), #v1);        \
        if (x_.struct_size != sizeof(type)) {                                      \
            printf("%s sets struct_size %zu, not %zu\n", #init, x_.struct_size,    \
                   sizeof(type));                                                  \
            return 1;                                                              \
        }                                                                          \
    } while (0)

int main(void)
{
    CHECK_INIT(cubuf_device_info_t, CUBUF_DEVICE_INFO_INIT, CUBUF_DEVICE_INFO_SIZE_V1);
    CHECK_INIT(cubuf_copy_options_t, CUBUF_COPY_OPTIONS_INIT, CUBUF_COPY_OPTIONS_SIZE_V1);
    CHECK_INIT(cubuf_resource_props_t, CUBUF_RESOURCE_PROPS_INIT, CUBUF_RESOURCE_PROPS_SIZE_V1);
    CHECK_INIT(cubuf_device_resource_options_t, CUBUF_DEVICE_RESOURCE_OPTIONS_INIT,
               CUBUF_DEVICE_RESOURCE_OPTIONS_SIZE_V1);
    CHECK_INIT(cubuf_vmm_options_t, CUBUF_VMM_OPTIONS_INIT, CUBUF_VMM_OPTIONS_SIZE_V1);
    CHECK_INIT(cubuf_ipc_descriptor_info_t, CUBUF_IPC_DESCRIPTOR_INFO_INIT,
               CUBUF_IPC_DESCRIPTOR_INFO_SIZE_V1);
    CHECK_INIT(cubuf_ipc_import_options_t, CUBUF_IPC_IMPORT_OPTIONS_INIT,
               CUBUF_IPC_IMPORT_OPTIONS_SIZE_V1);
    CHECK_INIT(cubuf_ipc_recv_options_t, CUBUF_IPC_RECV_OPTIONS_INIT,
               CUBUF_IPC_RECV_OPTIONS_SIZE_V1);
    CHECK_INIT(cubuf_dlpack_options_t, CUBUF_DLPACK_OPTIONS_INIT, CUBUF_DLPACK_OPTIONS_SIZE_V1);
    CHECK_INIT(cubuf_dist_caps_t, CUBUF_DIST_CAPS_INIT, CUBUF_DIST_CAPS_SIZE_V1);
    CHECK_INIT(cubuf_dmabuf_options_t, CUBUF_DMABUF_OPTIONS_INIT, CUBUF_DMABUF_OPTIONS_SIZE_V1);
    CHECK_INIT(cubuf_dmabuf_t, CUBUF_DMABUF_INIT, CUBUF_DMABUF_SIZE_V1);
    CHECK_INIT(cubuf_memory_info_t, CUBUF_MEMORY_INFO_INIT, CUBUF_MEMORY_INFO_SIZE_V1);
    CHECK_INIT(cubuf_physical_info_t, CUBUF_PHYSICAL_INFO_INIT, CUBUF_PHYSICAL_INFO_SIZE_V1);
    CHECK_INIT(cubuf_statistics_t, CUBUF_STATISTICS_INIT, CUBUF_STATISTICS_SIZE_V1);
    CHECK_INIT(cubuf_log_options_t, CUBUF_LOG_OPTIONS_INIT, CUBUF_LOG_OPTIONS_SIZE_V1);
    CHECK_INIT(cubuf_caching_options_t, CUBUF_CACHING_OPTIONS_INIT, CUBUF_CACHING_OPTIONS_SIZE_V1);
    cubuf_resource_stats_t stats = CUBUF_RESOURCE_STATS_INIT;
    _Static_assert(CUBUF_RESOURCE_OPS_SIZE_V1 <= sizeof(cubuf_resource_ops_t), "ops v1");
    if (stats.struct_size != sizeof stats) return 1;
    if (cubuf_version() != CUBUF_VERSION) return 1;
    if (cubuf_driver_min_version() < 12000) return 1;
    printf("cubuf %s, driver %d or newer\n", cubuf_version_string(), cubuf_driver_min_version());
    return 0;
}
