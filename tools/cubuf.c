/* cubuf: the command-line tool.
 *
 *   cubuf info [--json]   the driver and, per device, what cubuf can use
 *   cubuf demo            a short tour: context, buffers, fill, copy, read back
 *   cubuf version         the library version
 *   cubuf replay LOG      replays a logging adaptor's log (tools/replay.c)
 *
 * Exit status: 0 success, 1 a cubuf call failed, 2 usage error,
 * 3 no usable CUDA driver, 4 a driver but no CUDA device.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cubuf.h"
#include "replay.h"

enum { EXIT_FAILED = 1, EXIT_USAGE = 2, EXIT_NO_DRIVER = 3, EXIT_NO_DEVICE = 4 };

static int exit_for(cubuf_status_t st)
{
    if (st == CUBUF_ERROR_NO_DRIVER) return EXIT_NO_DRIVER;
    if (st == CUBUF_ERROR_NO_DEVICE) return EXIT_NO_DEVICE;
    return EXIT_FAILED;
}

static int report(cubuf_status_t st, const char *what)
{
    int floor = cubuf_driver_min_version();
    if (st == CUBUF_ERROR_NO_DRIVER && strstr(cubuf_last_error(), "cubuf needs"))
        fprintf(stderr, "cubuf: no usable CUDA driver on this machine (%s).\n", cubuf_last_error());
    else if (st == CUBUF_ERROR_NO_DRIVER)
        fprintf(stderr, "cubuf: no usable CUDA driver on this machine (%s); cubuf needs CUDA %d.%d or newer.\n",
                cubuf_last_error(), floor / 1000, floor % 1000 / 10);
    else if (st == CUBUF_ERROR_NO_DEVICE)
        fprintf(stderr, "cubuf: the CUDA driver found no device (%s).\n", cubuf_last_error());
    else
        fprintf(stderr, "cubuf: %s failed: %s: %s\n", what, cubuf_status_name(st), cubuf_last_error());
    return exit_for(st);
}

static const char *yes(bool b) { return b ? "yes" : "no"; }
static const char *jbool(bool b) { return b ? "true" : "false"; }

static void pool_handle_names(unsigned bits, char *out, size_t n)
{
    out[0] = '\0';
    struct { unsigned bit; const char *name; } names[] = {
        {CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, "posix-fd"},
        {CU_MEM_HANDLE_TYPE_WIN32, "win32"},
        {CU_MEM_HANDLE_TYPE_WIN32_KMT, "win32-kmt"},
        {CU_MEM_HANDLE_TYPE_FABRIC, "fabric"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        if (!(bits & names[i].bit)) continue;
        if (out[0]) strncat(out, ",", n - strlen(out) - 1);
        strncat(out, names[i].name, n - strlen(out) - 1);
    }
    if (!out[0]) snprintf(out, n, "none");
}

static int cmd_info(bool json)
{
    int version = 0, count = 0;
    const int floor = cubuf_driver_min_version();
    cubuf_status_t st = cubuf_driver_version(&version);
    if (st != CUBUF_SUCCESS) {
        if (json)
            printf("{\"driver\": null, \"driver_min_version\": %d, \"error\": \"%s\"}\n", floor,
                   cubuf_status_name(st));
        return report(st, "cubuf_driver_version");
    }
    if ((st = cubuf_device_count(&count)) != CUBUF_SUCCESS) return report(st, "cubuf_device_count");
    if (json)
        printf("{\"cubuf\": \"%s\", \"driver_version\": %d, \"driver_min_version\": %d, "
               "\"device_count\": %d, \"devices\": [",
               cubuf_version_string(), version, floor, count);
    else
        printf("cubuf %s\nCUDA driver %d.%d (cubuf needs %d.%d or newer), %d device(s)\n",
               cubuf_version_string(), version / 1000, version % 1000 / 10, floor / 1000,
               floor % 1000 / 10, count);
    for (int i = 0; i < count; i++) {
        cubuf_device_info_t d = CUBUF_DEVICE_INFO_INIT;
        if ((st = cubuf_device_get_info(i, &d)) != CUBUF_SUCCESS) {
            if (json) printf("]}\n");
            return report(st, "cubuf_device_get_info");
        }
        char handles[64];
        pool_handle_names(d.pool_handle_types, handles, sizeof handles);
        if (json) {
            printf("%s{\"ordinal\": %d, \"name\": \"%s\", \"total_memory\": %zu, "
                   "\"compute_capability\": \"%d.%d\", \"pci\": \"%04x:%02x:%02x\", "
                   "\"vmm\": %s, \"granularity_minimum\": %zu, \"granularity_recommended\": %zu, "
                   "\"posix_fd_handles\": %s, \"fabric_handles\": %s, \"gpu_direct_rdma_vmm\": %s, "
                   "\"memory_pools\": %s, \"pool_handle_types\": \"%s\", "
                   "\"unified_addressing\": %s, \"managed_memory\": %s, "
                   "\"concurrent_managed_access\": %s, \"peers\": [",
                   i ? ", " : "", d.ordinal, d.name, d.total_memory, d.cc_major, d.cc_minor,
                   d.pci_domain_id, d.pci_bus_id, d.pci_device_id, jbool(d.vmm_supported),
                   d.granularity_minimum, d.granularity_recommended, jbool(d.posix_fd_handles),
                   jbool(d.fabric_handles), jbool(d.gpu_direct_rdma_vmm), jbool(d.memory_pools),
                   handles, jbool(d.unified_addressing), jbool(d.managed_memory),
                   jbool(d.concurrent_managed_access));
        } else {
            printf("\ndevice %d: %s\n", d.ordinal, d.name);
            printf("  memory                     %.1f GiB\n", d.total_memory / 1073741824.0);
            printf("  compute capability         %d.%d\n", d.cc_major, d.cc_minor);
            printf("  PCI                        %04x:%02x:%02x\n", d.pci_domain_id, d.pci_bus_id,
                   d.pci_device_id);
            printf("  virtual memory (VMM)       %s\n", yes(d.vmm_supported));
            printf("  granularity min / rec.     %zu / %zu bytes\n", d.granularity_minimum,
                   d.granularity_recommended);
            printf("  POSIX fd handles           %s\n", yes(d.posix_fd_handles));
            printf("  fabric handles             %s\n", yes(d.fabric_handles));
            printf("  GPUDirect RDMA with VMM    %s\n", yes(d.gpu_direct_rdma_vmm));
            printf("  memory pools               %s (IPC handle types: %s)\n", yes(d.memory_pools),
                   handles);
            printf("  unified addressing         %s\n", yes(d.unified_addressing));
            printf("  managed memory             %s (concurrent access: %s)\n",
                   yes(d.managed_memory), yes(d.concurrent_managed_access));
        }
        for (int p = 0, first = 1; p < count; p++) {
            if (p == i) continue;
            bool can = false;
            if ((st = cubuf_device_can_access_peer(i, p, &can)) != CUBUF_SUCCESS)
                return report(st, "cubuf_device_can_access_peer");
            if (json) {
                printf("%s{\"peer\": %d, \"access\": %s}", first ? "" : ", ", p, jbool(can));
            } else {
                printf("  peer access to device %d   %s\n", p, yes(can));
            }
            first = 0;
        }
        if (json) printf("]}");
    }
    if (json) printf("]}\n");
    return 0;
}

#define TRY(expr, what)                                   \
    do {                                                  \
        cubuf_status_t st_ = (expr);                      \
        if (st_ != CUBUF_SUCCESS) {                       \
            rc = report(st_, what);                       \
            goto done;                                    \
        }                                                 \
    } while (0)

static int cmd_demo(void)
{
    int rc = 0;
    cubuf_context_t *ctx = NULL;
    cubuf_buffer_t *src = NULL, *dst = NULL, *host = NULL;
    const char msg[] = "hello from cubuf";
    size_t allocated = 0;

    TRY(cubuf_context_create(0, &ctx), "cubuf_context_create");
    printf("context on device 0\n");
    TRY(cubuf_context_buffer_from_data(ctx, msg, sizeof msg, 0, CUBUF_SIZE_REST, &src),
        "cubuf_context_buffer_from_data");
    TRY(cubuf_context_bytes_allocated(ctx, &allocated), "cubuf_context_bytes_allocated");
    printf("buffer_from_data: %zu bytes on the device at 0x%llx (bytes_allocated %zu)\n",
           cubuf_buffer_size(src), (unsigned long long)cubuf_buffer_ptr(src), allocated);
    TRY(cubuf_buffer_copy_to_new(src, CU_STREAM_PER_THREAD, NULL, &dst), "cubuf_buffer_copy_to_new");
    TRY(cubuf_context_new_host_buffer(ctx, sizeof msg, &host), "cubuf_context_new_host_buffer");
    TRY(cubuf_buffer_copy_from(host, dst, CU_STREAM_PER_THREAD, NULL), "cubuf_buffer_copy_from");
    TRY(cubuf_context_synchronize(ctx), "cubuf_context_synchronize");
    printf("device -> device -> pinned host: \"%s\"\n",
           (const char *)(uintptr_t)cubuf_buffer_ptr(host));
    if (memcmp((const void *)(uintptr_t)cubuf_buffer_ptr(host), msg, sizeof msg) != 0) {
        fprintf(stderr, "cubuf demo: data did not survive the round trip\n");
        rc = EXIT_FAILED;
        goto done;
    }
    TRY(cubuf_buffer_fill_byte(dst, 'x', CU_STREAM_PER_THREAD), "cubuf_buffer_fill_byte");
    TRY(cubuf_buffer_copy_from(host, dst, CU_STREAM_PER_THREAD, NULL), "cubuf_buffer_copy_from");
    TRY(cubuf_context_synchronize(ctx), "cubuf_context_synchronize");
    printf("after fill('x'): \"%.*s\"\n", (int)sizeof msg - 1,
           (const char *)(uintptr_t)cubuf_buffer_ptr(host));
    cubuf_buffer_release(src);
    cubuf_buffer_release(dst);
    cubuf_buffer_release(host);
    src = dst = host = NULL;
    TRY(cubuf_context_bytes_allocated(ctx, &allocated), "cubuf_context_bytes_allocated");
    printf("all buffers released: bytes_allocated %zu\n", allocated);
    printf("demo ok\n");
done:
    cubuf_buffer_release(src);
    cubuf_buffer_release(dst);
    cubuf_buffer_release(host);
    cubuf_context_destroy(ctx);
    return rc;
}

static int usage(FILE *f)
{
    fprintf(f, "usage: cubuf info [--json] | cubuf demo | cubuf version\n"
               "       cubuf replay LOG [--resource device|private|managed|sync|vmm|caching] [--rounds N]\n"
               "exit status: 0 ok, 1 failure, 2 usage, 3 no CUDA driver, 4 no CUDA device\n");
    return f == stderr ? EXIT_USAGE : 0;
}

int main(int argc, char **argv)
{
    if (argc < 2) return usage(stderr);
    if (strcmp(argv[1], "info") == 0) {
        if (argc == 2) return cmd_info(false);
        if (argc == 3 && strcmp(argv[2], "--json") == 0) return cmd_info(true);
        return usage(stderr);
    }
    if (strcmp(argv[1], "demo") == 0 && argc == 2) return cmd_demo();
    if (strcmp(argv[1], "replay") == 0) return cubuf__replay(argc - 2, argv + 2);
    if (strcmp(argv[1], "version") == 0 && argc == 2) {
        printf("%s\n", cubuf_version_string());
        return 0;
    }
    if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) return usage(stdout);
    return usage(stderr);
}
