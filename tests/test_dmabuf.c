/* dma-buf export (cubuf_buffer_export_dmabuf) of every memory kind: each fd
 * a dma-buf of the size reported, the buffer inside it at the offset
 * reported, page-aligned, owned (and closed) by the caller, no fd leaked;
 * the kinds the driver documents no dma-buf for and the errors. On a device
 * without dma-buf support (the test driver) every export of memory that
 * could be exported is CUBUF_ERROR_NOT_SUPPORTED. */
#include "dist_test.h"

static cubuf_dist_caps_t caps = CUBUF_DIST_CAPS_INIT;
static size_t page;

/* Exports [ptr of buf, +size of buf) and checks the result: where
 * `supported`, an fd that is a dma-buf covering the buffer, with the span
 * [want_base, want_base + want_size) when want_size > 0; else
 * CUBUF_ERROR_NOT_SUPPORTED and no fd. */
static void check_export(const char *what, const cubuf_buffer_t *buf, bool supported,
                         CUdeviceptr want_base, uint64_t want_size)
{
    int fds = dist_open_fds();
    cubuf_dmabuf_t d = CUBUF_DMABUF_INIT;
    cubuf_status_t st = cubuf_buffer_export_dmabuf(buf, NULL, &d);
    if (!supported) {
        if (st != CUBUF_ERROR_NOT_SUPPORTED) {
            fprintf(stderr, "%s: export gave %s, expected CUBUF_ERROR_NOT_SUPPORTED (%s)\n", what,
                    cubuf_status_name(st), cubuf_last_error());
            t_failures++;
        }
        T_CHECK(d.fd == -1);
        T_CHECK(dist_open_fds() == fds);
        return;
    }
    if (st != CUBUF_SUCCESS) {
        fprintf(stderr, "%s: export gave %s (%s)\n", what, cubuf_status_name(st), cubuf_last_error());
        t_failures++;
        return;
    }
    printf("%s: fd %d, base 0x%llx, size %llu, offset %llu\n", what, d.fd,
           (unsigned long long)d.base, (unsigned long long)d.size, (unsigned long long)d.offset);
    T_CHECK(d.fd >= 0);
    T_CHECK(dist_open_fds() == fds + 1);
    T_CHECK(d.base % page == 0 && d.size % page == 0 && d.size > 0);
    T_CHECK(d.base + d.offset == cubuf_buffer_ptr(buf));
    T_CHECK(d.offset + cubuf_buffer_size(buf) <= d.size);
    if (want_size) {
        T_CHECK(d.base == want_base);
        T_CHECK(d.size == want_size);
    }
    T_CHECK(dist_is_dmabuf(d.fd, d.size));
    close(d.fd);
    T_CHECK(dist_open_fds() == fds);
}

/* The driver may open files of its own at a process's first dma-buf
 * export: one export of each kind first, so the counts below see cubuf's. */
static void warm_up(void)
{
    if (!caps.dmabuf) return;
    cubuf_resource_t *res = NULL;
    cubuf_buffer_t *buf = NULL;
    for (int vmm = 0; vmm < 2; vmm++) {
        if (vmm) T_REQUIRE(cubuf_vmm_resource_create(0, NULL, &res));
        else T_REQUIRE(cubuf_sync_device_resource_create(0, &res));
        T_REQUIRE(cubuf_resource_allocate(res, (size_t)2 << 20, CU_STREAM_LEGACY, &buf));
        cubuf_dmabuf_t d = CUBUF_DMABUF_INIT;
        T_OK(cubuf_buffer_export_dmabuf(buf, NULL, &d));
        if (d.fd >= 0) close(d.fd);
        cubuf_buffer_release(buf);
        cubuf_resource_release(res);
    }
}

static void allocation_kinds(void)
{
    cubuf_resource_t *res = NULL;
    cubuf_buffer_t *buf = NULL, *slice = NULL;
    const size_t mib = (size_t)1 << 20;

    /* cuMemAlloc memory, and a slice of it at an odd offset. */
    T_REQUIRE(cubuf_sync_device_resource_create(0, &res));
    T_REQUIRE(cubuf_resource_allocate(res, mib, CU_STREAM_LEGACY, &buf));
    check_export("sync device", buf, caps.dmabuf, cubuf_buffer_ptr(buf), mib);
    T_REQUIRE(cubuf_buffer_slice(buf, page + 16, 1000, &slice));
    check_export("sync device slice", slice, caps.dmabuf, cubuf_buffer_ptr(buf), mib);
    cubuf_buffer_release(slice);
    cubuf_buffer_release(buf);
    cubuf_resource_release(res);

    /* A private stream-ordered pool. */
    cubuf_device_resource_options_t po = CUBUF_DEVICE_RESOURCE_OPTIONS_INIT;
    po.private_pool = true;
    T_REQUIRE(cubuf_device_resource_create(0, &po, &res));
    T_REQUIRE(cubuf_resource_allocate(res, mib, CU_STREAM_LEGACY, &buf));
    T_OK(cubuf_buffer_fill_byte(buf, 7, CU_STREAM_LEGACY));
    check_export("device pool", buf, caps.dmabuf, 0, 0);
    T_OK(cubuf_buffer_close(buf));
    cubuf_buffer_release(buf);
    cubuf_resource_release(res);

    /* A context buffer (the context's exportable pool). */
    cubuf_context_t *ctx = NULL;
    T_REQUIRE(cubuf_context_create(0, &ctx));
    T_REQUIRE(cubuf_context_new_buffer(ctx, 2 * mib, &buf));
    check_export("context buffer", buf, caps.dmabuf, 0, 0);
    cubuf_buffer_release(buf);
    T_OK(cubuf_context_synchronize(ctx));
    cubuf_context_destroy(ctx);

    /* Managed memory: no dma-buf, whatever the device. */
    T_REQUIRE(cubuf_managed_resource_create(0, 0, &res));
    T_REQUIRE(cubuf_resource_allocate(res, mib, CU_STREAM_LEGACY, &buf));
    check_export("managed", buf, false, 0, 0);
    cubuf_buffer_release(buf);
    cubuf_resource_release(res);

    /* cuMemHostAlloc memory: where the device says it can. */
    T_REQUIRE(cubuf_legacy_pinned_resource_create(0, &res));
    T_REQUIRE(cubuf_resource_allocate(res, mib, CU_STREAM_LEGACY, &buf));
    check_export("legacy pinned", buf, caps.dmabuf_host_alloc, 0, 0);
    cubuf_buffer_release(buf);
    cubuf_resource_release(res);

    /* Pinned memory of a host pool: not a documented kind. */
    T_REQUIRE(cubuf_pinned_resource_create(0, false, &res));
    T_REQUIRE(cubuf_resource_allocate(res, mib, CU_STREAM_LEGACY, &buf));
    check_export("pinned pool", buf, false, 0, 0);
    T_OK(cubuf_buffer_close(buf));
    cubuf_buffer_release(buf);
    cubuf_resource_release(res);
}

static void virtual_memory(void)
{
    cubuf_resource_t *res = NULL;
    cubuf_buffer_t *one = NULL, *grown = NULL, *slice = NULL;
    size_t gran = 0;
    T_REQUIRE(cubuf_vmm_resource_create(0, NULL, &res)); /* every GPU this suite runs on has VMM */
    T_REQUIRE(cubuf_vmm_granularity(res, &gran));
    T_REQUIRE(cubuf_resource_allocate(res, gran, CU_STREAM_LEGACY, &one));
    CUdeviceptr p = cubuf_buffer_ptr(one);
    check_export("vmm, one allocation", one, caps.dmabuf, p, gran);
    /* A grow adds a second physical allocation of 2 granules after the first. */
    T_REQUIRE(cubuf_vmm_modify_allocation(res, one, 3 * gran, NULL, &grown));
    CUdeviceptr g = cubuf_buffer_ptr(grown);
    check_export("vmm, two allocations", grown, caps.dmabuf, g, 3 * gran);
    /* The old buffer still maps its one allocation only. */
    check_export("vmm, the buffer grown from", one, caps.dmabuf, p, gran);
    /* A slice across the boundary: both allocations; inside the second: that one. */
    T_REQUIRE(cubuf_buffer_slice(grown, gran - page, 2 * page, &slice));
    check_export("vmm slice across allocations", slice, caps.dmabuf, g, 3 * gran);
    cubuf_buffer_release(slice);
    T_REQUIRE(cubuf_buffer_slice(grown, gran + page, page, &slice));
    check_export("vmm slice of the second allocation", slice, caps.dmabuf, g + gran, 2 * gran);
    cubuf_buffer_release(slice);
    cubuf_buffer_release(grown);
    cubuf_buffer_release(one);
    cubuf_resource_release(res);

    /* Pinned host memory of virtual memory: not a documented kind, also
     * through an adaptor (refused as virtual memory, before any driver or
     * device capability is asked). */
    cubuf_vmm_options_t ho = CUBUF_VMM_OPTIONS_INIT;
    ho.location = CUBUF_VMM_LOCATION_HOST;
    cubuf_resource_t *stats = NULL;
    T_REQUIRE(cubuf_vmm_resource_create(0, &ho, &res));
    T_REQUIRE(cubuf_statistics_adaptor_create(res, &stats));
    cubuf_resource_t *from[2] = {res, stats};
    for (int k = 0; k < 2; k++) {
        T_REQUIRE(cubuf_resource_allocate(from[k], gran, CU_STREAM_LEGACY, &one));
        check_export(k ? "host vmm through an adaptor" : "host vmm", one, false, 0, 0);
        T_CHECK(strstr(cubuf_last_error(), "virtual memory resource") != NULL);
        cubuf_buffer_release(one);
    }
    cubuf_resource_release(stats);
    cubuf_resource_release(res);
}

static void pcie_mapping(void)
{
    cubuf_resource_t *res = NULL;
    cubuf_buffer_t *buf = NULL;
    T_REQUIRE(cubuf_sync_device_resource_create(0, &res));
    T_REQUIRE(cubuf_resource_allocate(res, (size_t)1 << 20, CU_STREAM_LEGACY, &buf));
    int fds = dist_open_fds();
    cubuf_dmabuf_options_t o = CUBUF_DMABUF_OPTIONS_INIT;
    o.pcie_mapping = true;
    cubuf_dmabuf_t d = CUBUF_DMABUF_INIT;
    cubuf_status_t st = cubuf_buffer_export_dmabuf(buf, &o, &d);
    /* Platform-dependent: a PCIe BAR1 mapping, or a clear refusal (the H200). */
    printf("PCIe mapping: %s %s\n", cubuf_status_name(st), st ? cubuf_last_error() : "");
    if (st == CUBUF_SUCCESS) {
        T_CHECK(dist_is_dmabuf(d.fd, d.size));
        close(d.fd);
    } else {
        T_STATUS(st, CUBUF_ERROR_NOT_SUPPORTED);
        T_CHECK(d.fd == -1);
        if (caps.dmabuf) T_CHECK(strstr(cubuf_last_error(), "PCIe") != NULL);
    }
    T_CHECK(dist_open_fds() == fds);
    /* Options with a struct_size below their first layout. */
    o.struct_size = sizeof(size_t);
    T_STATUS(cubuf_buffer_export_dmabuf(buf, &o, &d), CUBUF_ERROR_INVALID_ARGUMENT);
    cubuf_buffer_release(buf);
    cubuf_resource_release(res);
}

static void errors(void)
{
    cubuf_resource_t *res = NULL;
    cubuf_buffer_t *buf = NULL;
    cubuf_dmabuf_t d = CUBUF_DMABUF_INIT;
    T_REFUSED(cubuf_buffer_export_dmabuf(NULL, NULL, &d), CUBUF_ERROR_INVALID_ARGUMENT);
    T_REQUIRE(cubuf_sync_device_resource_create(0, &res));
    T_REQUIRE(cubuf_resource_allocate(res, 4096, CU_STREAM_LEGACY, &buf));
    T_REFUSED(cubuf_buffer_export_dmabuf(buf, NULL, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    cubuf_dmabuf_t small = CUBUF_DMABUF_INIT;
    small.struct_size = offsetof(cubuf_dmabuf_t, offset);
    T_REFUSED(cubuf_buffer_export_dmabuf(buf, NULL, &small), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(small.fd == -1);
    T_OK(cubuf_buffer_close(buf));
    T_REFUSED(cubuf_buffer_export_dmabuf(buf, NULL, &d), CUBUF_ERROR_CLOSED);
    cubuf_buffer_release(buf);
    /* Size 0: no memory to export. */
    T_REQUIRE(cubuf_resource_allocate(res, 0, CU_STREAM_LEGACY, &buf));
    T_REFUSED(cubuf_buffer_export_dmabuf(buf, NULL, &d), CUBUF_ERROR_INVALID_ARGUMENT);
    cubuf_buffer_release(buf);
    /* Host-only memory: pageable memory the driver does not know. */
    static unsigned char host[8192];
    T_REQUIRE(cubuf_buffer_view((CUdeviceptr)(uintptr_t)host, sizeof host, &buf));
    T_REFUSED(cubuf_buffer_export_dmabuf(buf, NULL, &d), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(strstr(cubuf_last_error(), "host-only") != NULL);
    cubuf_buffer_release(buf);
    T_CHECK(d.fd == -1);
    cubuf_resource_release(res);
}

/* Every driver call on the export path failing in turn: a failure or the
 * unfaulted result (a query whose failure reads as "not capable"), never a
 * leaked fd. */
static void fault_paths(void)
{
    cubuf_resource_t *res[2] = {NULL, NULL};
    T_REQUIRE(cubuf_sync_device_resource_create(0, &res[0]));
    T_REQUIRE(cubuf_vmm_resource_create(0, NULL, &res[1]));
    for (int k = 0; k < 2; k++) {
        cubuf_buffer_t *buf = NULL;
        T_REQUIRE(cubuf_resource_allocate(res[k], (size_t)2 << 20, CU_STREAM_LEGACY, &buf));
        cubuf_dmabuf_t d = CUBUF_DMABUF_INIT;
        cubuf_status_t base = cubuf_buffer_export_dmabuf(buf, NULL, &d);
        if (d.fd >= 0) close(d.fd);
        unsigned nth = 1;
        for (;; nth++) {
            int fds = dist_open_fds();
            d = (cubuf_dmabuf_t)CUBUF_DMABUF_INIT;
            cubuf_fault_fail_any_nth(nth, CUDA_ERROR_UNKNOWN);
            cubuf_status_t st = cubuf_buffer_export_dmabuf(buf, NULL, &d);
            bool fired = cubuf_fault_fired();
            cubuf_fault_reset();
            if (st == CUBUF_SUCCESS) {
                T_CHECK(d.fd >= 0 && dist_open_fds() == fds + 1);
                close(d.fd);
            } else {
                T_CHECK(d.fd == -1);
            }
            T_CHECK(dist_open_fds() == fds);
            if (!fired) {
                T_STATUS(st, base);
                break;
            }
            if (st != base && st != CUBUF_ERROR_DRIVER) {
                fprintf(stderr, "%s export, driver call %u failing: %s (%s)\n",
                        k ? "vmm" : "sync device", nth, cubuf_status_name(st), cubuf_last_error());
                t_failures++;
            }
            if (nth > 64) {
                fprintf(stderr, "driver faults never stop firing\n");
                t_failures++;
                break;
            }
        }
        T_CHECK(nth > 1);
        cubuf_buffer_release(buf);
    }
    cubuf_resource_release(res[1]);
    cubuf_resource_release(res[0]);
}

int main(void)
{
    t_require_gpu();
    long pg = sysconf(_SC_PAGESIZE);
    page = pg > 0 ? (size_t)pg : 4096;
    T_REQUIRE(cubuf_device_dist_caps(0, &caps));
    printf("device 0: dma-buf %d, host-alloc dma-buf %d, GPUDirect RDMA %d (VMM %d), fabric %d\n",
           caps.dmabuf, caps.dmabuf_host_alloc, caps.gpu_direct_rdma, caps.gpu_direct_rdma_vmm,
           caps.fabric_handles);
    cubuf_dist_caps_t small = CUBUF_DIST_CAPS_INIT;
    small.struct_size = 4;
    T_STATUS(cubuf_device_dist_caps(0, &small), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_device_dist_caps(1000, &caps), CUBUF_ERROR_OUT_OF_RANGE);
    T_STATUS(cubuf_device_dist_caps(0, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    warm_up();
    allocation_kinds();
    virtual_memory();
    pcie_mapping();
    errors();
    fault_paths();
    return t_finish("test_dmabuf");
}
