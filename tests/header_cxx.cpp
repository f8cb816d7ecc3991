// The public header from C++ (built as C++11 and as C++17 with -Wall -Wextra
// -Werror), linked against the shared library: every _INIT macro compiles
// without a warning and sets struct_size.
#include <cubuf.h>
#include <cubuf/dlpack.h>
#include <cubuf/dist.h>
#include <cubuf/caching.h>
#include <cstdio>

template <typename T> static bool sized(const T &x)
{
    if (x.struct_size == sizeof(T)) return true;
    std::printf("struct_size %zu, not %zu\n", x.struct_size, sizeof(T));
    return false;
}

int main()
{
    cubuf_device_info_t info = CUBUF_DEVICE_INFO_INIT;
    cubuf_copy_options_t copy = CUBUF_COPY_OPTIONS_INIT;
    cubuf_resource_props_t props = CUBUF_RESOURCE_PROPS_INIT;
    cubuf_resource_stats_t stats = CUBUF_RESOURCE_STATS_INIT;
    cubuf_device_resource_options_t pool = CUBUF_DEVICE_RESOURCE_OPTIONS_INIT;
    cubuf_vmm_options_t vmm = CUBUF_VMM_OPTIONS_INIT;
    cubuf_ipc_descriptor_info_t desc = CUBUF_IPC_DESCRIPTOR_INFO_INIT;
    cubuf_ipc_import_options_t import = CUBUF_IPC_IMPORT_OPTIONS_INIT;
    cubuf_ipc_recv_options_t recv = CUBUF_IPC_RECV_OPTIONS_INIT;
    cubuf_dist_caps_t caps = CUBUF_DIST_CAPS_INIT;
    cubuf_dmabuf_options_t dmabuf_options = CUBUF_DMABUF_OPTIONS_INIT;
    cubuf_dmabuf_t dmabuf = CUBUF_DMABUF_INIT;
    cubuf_memory_info_t meminfo = CUBUF_MEMORY_INFO_INIT;
    cubuf_physical_info_t phys = CUBUF_PHYSICAL_INFO_INIT;
    cubuf_dlpack_options_t dlpack = CUBUF_DLPACK_OPTIONS_INIT;
    cubuf_statistics_t statistics = CUBUF_STATISTICS_INIT;
    cubuf_log_options_t log = CUBUF_LOG_OPTIONS_INIT;
    cubuf_caching_options_t caching = CUBUF_CACHING_OPTIONS_INIT;
    static_assert(sizeof(DLDeviceType) == 4 && sizeof(DLManagedTensorVersioned) == 80, "dlpack");
    static_assert(CUBUF_VMM_OPTIONS_SIZE_V1 <= sizeof(cubuf_vmm_options_t), "vmm v1");
    static_assert(CUBUF_DEVICE_INFO_SIZE_V1 <= sizeof(cubuf_device_info_t), "info v1");
    if (!(sized(statistics) && sized(log) && sized(caching))) return 1;
    if (!(sized(caps) && sized(dmabuf_options) && sized(dmabuf) && sized(meminfo) && sized(phys)))
        return 1;
    if (!(sized(info) && sized(copy) && sized(props) && sized(stats) && sized(pool) &&
          sized(vmm) && sized(desc) && sized(import) && sized(recv) && sized(dlpack)))
        return 1;
    if (cubuf_version() != CUBUF_VERSION) return 1;
    std::printf("C++ %ld: %s\n", (long)__cplusplus, cubuf_status_name(CUBUF_ERROR_CLOSED));
    return 0;
}
