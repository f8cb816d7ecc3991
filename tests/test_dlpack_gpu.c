/* DLPack on a device: exports of pool device memory, managed, pinned and
 * legacy pinned memory and pageable host views with their device types and
 * ids; round trips export -> import with the bytes written through one side
 * read back through the other; imports of foreign memory whose producer's
 * deleter frees it (exactly once, after the last buffer is gone; never after
 * a failed import); and nothing held afterwards (t_held, resource stats). */
#include <stdint.h>

#include "cubuf/dlpack.h"
#include "test.h"

static CUstream g_s;

static void check_empty(const cubuf_resource_t *r, const char *what)
{
    cubuf_resource_stats_t s = CUBUF_RESOURCE_STATS_INIT;
    T_OK(cubuf_resource_stats(r, &s));
    if (s.current_bytes != 0 || s.current_count != 0) {
        fprintf(stderr, "%s: %zu bytes in %zu buffers still allocated\n", what, s.current_bytes,
                s.current_count);
        t_failures++;
    }
}

static void expect_device(const cubuf_buffer_t *b, int32_t type, int32_t id)
{
    int32_t t = -1, i = -1;
    T_OK(cubuf_buffer_dlpack_device(b, &t, &i));
    if (t != type || i != id) {
        fprintf(stderr, "dlpack device (%d, %d), expected (%d, %d)\n", (int)t, (int)i, (int)type,
                (int)id);
        t_failures++;
    }
}

/* Whether `n` bytes at host address p are all `v`. */
static bool all_bytes(const void *p, size_t n, unsigned char v)
{
    const unsigned char *c = p;
    for (size_t i = 0; i < n; i++)
        if (c[i] != v) return false;
    return true;
}

/* Whether device memory [p, p+n) is all `v`, read with cuMemcpyDtoH. */
static bool device_bytes(CUdeviceptr p, size_t n, unsigned char v)
{
    unsigned char *h = malloc(n);
    if (!h) exit(1);
    T_CU(cuMemcpyDtoH, h, p, n);
    bool same = all_bytes(h, n, v);
    free(h);
    return same;
}

/* Stream-ordered device memory: kDLCUDA on device 0, both directions. */
static void test_device_pool(void)
{
    const size_t n = 1 << 20;
    cubuf_resource_t *r = NULL;
    T_REQUIRE(cubuf_device_resource_create(0, NULL, &r));
    cubuf_buffer_t *b = NULL;
    T_REQUIRE(cubuf_resource_allocate(r, n, g_s, &b));
    T_OK(cubuf_buffer_fill_byte(b, 0x5a, g_s));
    T_CU(cuStreamSynchronize, g_s);
    expect_device(b, kDLCUDA, 0);

    /* As 512x512 float32 in column-major order: the whole buffer. */
    int64_t shape[2] = {512, 512}, strides[2] = {1, 512};
    cubuf_dlpack_options_t o = CUBUF_DLPACK_OPTIONS_INIT;
    o.dtype = (DLDataType){kDLFloat, 32, 1};
    o.ndim = 2;
    o.shape = shape;
    o.strides = strides;
    DLManagedTensorVersioned *t = NULL;
    T_REQUIRE(cubuf_buffer_to_dlpack(b, &o, &t));
    T_CHECK(t->dl_tensor.device.device_type == kDLCUDA && t->dl_tensor.device.device_id == 0);
    T_CHECK(t->dl_tensor.data == (void *)(uintptr_t)cubuf_buffer_ptr(b));
    T_CHECK(t->dl_tensor.strides[0] == 1 && t->dl_tensor.strides[1] == 512);

    /* The consumer's view of it, as another library would import it. */
    cubuf_buffer_t *imp = NULL;
    T_REQUIRE(cubuf_buffer_from_dlpack(t, &imp));
    T_CHECK(cubuf_buffer_ptr(imp) == cubuf_buffer_ptr(b) && cubuf_buffer_size(imp) == n);
    T_CHECK(cubuf_buffer_is_device_accessible(imp) && !cubuf_buffer_is_host_accessible(imp));
    T_CHECK(cubuf_buffer_device_id(imp) == 0 && cubuf_buffer_owner(imp) == t);
    T_CHECK(!cubuf_dlpack_is_read_only(imp));
    expect_device(imp, kDLCUDA, 0);
    T_CHECK(device_bytes(cubuf_buffer_ptr(imp), n, 0x5a));
    /* Written through the import, read through the original. */
    T_OK(cubuf_buffer_fill_byte(imp, 0xc3, g_s));
    T_CU(cuStreamSynchronize, g_s);
    T_CHECK(device_bytes(cubuf_buffer_ptr(b), n, 0xc3));

    /* The original cannot close while the tensor lives; the import keeps it. */
    T_STATUS(cubuf_buffer_close(b), CUBUF_ERROR_BUSY);
    cubuf_buffer_release(b);
    cubuf_resource_stats_t s = CUBUF_RESOURCE_STATS_INIT;
    T_OK(cubuf_resource_stats(r, &s));
    T_CHECK(s.current_bytes == n);
    T_CHECK(device_bytes(cubuf_buffer_ptr(imp), n, 0xc3));
    cubuf_buffer_release(imp); /* runs t's deleter: the slice, then the memory, go */
    T_CU(cuStreamSynchronize, g_s);
    check_empty(r, "device pool");

    /* A slice exported with an offset, unversioned. */
    T_REQUIRE(cubuf_resource_allocate(r, 4096, g_s, &b));
    cubuf_buffer_t *part = NULL;
    T_REQUIRE(cubuf_buffer_slice(b, 1024, 2048, &part));
    DLManagedTensor *u = NULL;
    T_REQUIRE(cubuf_buffer_to_dlpack_unversioned(part, NULL, &u));
    T_CHECK(u->dl_tensor.data == (void *)(uintptr_t)(cubuf_buffer_ptr(b) + 1024));
    T_CHECK(u->dl_tensor.shape[0] == 2048 && u->dl_tensor.device.device_type == kDLCUDA);
    T_REQUIRE(cubuf_buffer_from_dlpack_unversioned(u, &imp));
    T_CHECK(cubuf_buffer_ptr(imp) == cubuf_buffer_ptr(b) + 1024 && cubuf_buffer_size(imp) == 2048);
    cubuf_buffer_release(part);
    cubuf_buffer_release(b);
    cubuf_buffer_release(imp);
    T_CU(cuStreamSynchronize, g_s);
    check_empty(r, "device pool slice");
    cubuf_resource_release(r);
}

/* A host-accessible kind: `want` device type; bytes copied from device
 * memory into the import are read on the host through the export. */
static void round_trip_host_kind(cubuf_resource_t *r, int32_t want, int32_t want_id, const char *what)
{
    const size_t n = 64 << 10;
    cubuf_resource_t *dev = NULL;
    T_REQUIRE(cubuf_device_resource_create(0, NULL, &dev));
    cubuf_buffer_t *b = NULL, *src = NULL, *imp = NULL;
    T_REQUIRE(cubuf_resource_allocate(r, n, g_s, &b));
    T_REQUIRE(cubuf_resource_allocate(dev, n, g_s, &src));
    T_OK(cubuf_buffer_fill_byte(src, 0x6b, g_s));
    T_CU(cuStreamSynchronize, g_s);
    expect_device(b, want, want_id);
    DLManagedTensorVersioned *t = NULL;
    T_REQUIRE(cubuf_buffer_to_dlpack(b, NULL, &t));
    T_CHECK((int32_t)t->dl_tensor.device.device_type == want && t->dl_tensor.device.device_id == want_id);
    memset(t->dl_tensor.data, 0x11, n); /* host accessible: the consumer writes it */
    T_REQUIRE(cubuf_buffer_from_dlpack(t, &imp));
    T_CHECK(cubuf_buffer_ptr(imp) == cubuf_buffer_ptr(b) && cubuf_buffer_size(imp) == n);
    T_CHECK(cubuf_buffer_is_host_accessible(imp) && cubuf_buffer_is_device_accessible(imp));
    expect_device(imp, want, want_id);
    T_CHECK(all_bytes((void *)(uintptr_t)cubuf_buffer_ptr(b), n, 0x11));
    T_OK(cubuf_buffer_copy_from(imp, src, g_s, NULL));
    T_CU(cuStreamSynchronize, g_s);
    if (!all_bytes((void *)(uintptr_t)cubuf_buffer_ptr(b), n, 0x6b)) {
        fprintf(stderr, "%s: the bytes copied into the import are not seen through the export\n",
                what);
        t_failures++;
    }
    T_STATUS(cubuf_buffer_close(b), CUBUF_ERROR_BUSY);
    cubuf_buffer_release(b);
    cubuf_buffer_release(imp);
    cubuf_buffer_release(src);
    T_CU(cuStreamSynchronize, g_s);
    check_empty(r, what);
    check_empty(dev, what);
    cubuf_resource_release(dev);
}

static void test_host_kinds(void)
{
    cubuf_resource_t *r = NULL;
    T_REQUIRE(cubuf_managed_resource_create(0, -2, &r));
    round_trip_host_kind(r, kDLCUDAManaged, 0, "managed");
    cubuf_resource_release(r);
    T_REQUIRE(cubuf_pinned_resource_create(0, false, &r));
    round_trip_host_kind(r, kDLCUDAHost, 0, "pinned");
    cubuf_resource_release(r);
    T_REQUIRE(cubuf_legacy_pinned_resource_create(0, &r));
    round_trip_host_kind(r, kDLCUDAHost, 0, "legacy pinned");
    cubuf_resource_release(r);
}

/* ---- foreign tensors ---- */

typedef struct foreign {
    DLManagedTensorVersioned t;
    int64_t shape[2], strides[2];
    int deleted;
    bool device; /* cuMemAlloc'd, freed by the deleter; else malloc'd */
    void *block;
} foreign_t;

static void foreign_delete(DLManagedTensorVersioned *self)
{
    foreign_t *f = self->manager_ctx;
    T_CHECK(self == &f->t);
    f->deleted++;
    if (f->device) T_CU(cuMemFree, (CUdeviceptr)(uintptr_t)f->block);
    else free(f->block);
    f->block = NULL;
}

static void foreign_init(foreign_t *f, void *block, bool device, DLDeviceType type)
{
    memset(f, 0, sizeof *f);
    f->block = block;
    f->device = device;
    f->t.version.major = 1;
    f->t.version.minor = 0;
    f->t.manager_ctx = f;
    f->t.deleter = foreign_delete;
    DLTensor dl = {block, {type, 0}, 2, {kDLInt, 32, 1}, f->shape, f->strides, 0};
    f->t.dl_tensor = dl;
}

static void test_foreign_device(void)
{
    /* A producer's 100x10 int32 array of cuMemAlloc memory, rows of 16 elements. */
    const size_t bytes = 100 * 16 * 4;
    CUdeviceptr d = 0;
    T_CU(cuMemAlloc, &d, bytes);
    T_CU(cuMemsetD8, d, 0x7e, bytes);
    foreign_t f;
    foreign_init(&f, (void *)(uintptr_t)d, true, kDLCUDA);
    f.shape[0] = 100;
    f.shape[1] = 10;
    f.strides[0] = 16;
    f.strides[1] = 1;
    f.t.flags = DLPACK_FLAG_BITMASK_READ_ONLY;
    cubuf_buffer_t *b = NULL;
    /* A failed description leaves the tensor to the caller. */
    T_CHECK(cubuf_fault_fail_nth("cuPointerGetAttributes", 1, CUDA_ERROR_UNKNOWN));
    b = (cubuf_buffer_t *)(uintptr_t)1;
    T_STATUS(cubuf_buffer_from_dlpack(&f.t, &b), CUBUF_ERROR_DRIVER);
    T_CHECK(cubuf_fault_fired());
    cubuf_fault_reset();
    T_CHECK(f.deleted == 0 && b == (cubuf_buffer_t *)(uintptr_t)1);

    T_REQUIRE(cubuf_buffer_from_dlpack(&f.t, &b));
    /* The last row ends after 99*16 + 10 elements: 6376 bytes. */
    T_CHECK(cubuf_buffer_ptr(b) == d && cubuf_buffer_size(b) == (99 * 16 + 10) * 4);
    T_CHECK(cubuf_buffer_device_id(b) == 0 && cubuf_dlpack_is_read_only(b));
    T_CHECK(device_bytes(cubuf_buffer_ptr(b), cubuf_buffer_size(b), 0x7e));
    expect_device(b, kDLCUDA, 0);
    /* Handed on: the tensor holds the import, the import the producer's memory. */
    DLManagedTensorVersioned *t = NULL;
    T_REQUIRE(cubuf_buffer_to_dlpack(b, NULL, &t));
    T_CHECK(t->dl_tensor.shape[0] == (99 * 16 + 10) * 4 && t->flags == 0);
    cubuf_buffer_release(b);
    T_CHECK(f.deleted == 0);
    T_CHECK(device_bytes((CUdeviceptr)(uintptr_t)t->dl_tensor.data, 64, 0x7e));
    t->deleter(t);
    T_CHECK(f.deleted == 1);

    /* A byte_offset into the allocation and a negative row stride. */
    T_CU(cuMemAlloc, &d, 4096);
    foreign_init(&f, (void *)(uintptr_t)d, true, kDLCUDA);
    f.t.dl_tensor.byte_offset = 4096 - 4 * 4; /* element 0 starts the last row of 4 */
    f.shape[0] = 8;
    f.shape[1] = 4;
    f.strides[0] = -4;
    f.strides[1] = 1;
    T_REQUIRE(cubuf_buffer_from_dlpack(&f.t, &b));
    T_CHECK(cubuf_buffer_ptr(b) == d + 4096 - 8 * 16 && cubuf_buffer_size(b) == 8 * 16);
    T_OK(cubuf_buffer_close(b));
    T_CHECK(f.deleted == 1);
    cubuf_buffer_release(b);
    T_CHECK(f.deleted == 1);

    /* Empty, with data: size 0 at the address, described by the driver. */
    T_CU(cuMemAlloc, &d, 256);
    foreign_init(&f, (void *)(uintptr_t)d, true, kDLCUDA);
    f.shape[0] = 0;
    f.shape[1] = 3;
    f.t.dl_tensor.strides = NULL;
    T_REQUIRE(cubuf_buffer_from_dlpack(&f.t, &b));
    T_CHECK(cubuf_buffer_ptr(b) == d && cubuf_buffer_size(b) == 0 && cubuf_buffer_device_id(b) == 0);
    cubuf_buffer_release(b);
    T_CHECK(f.deleted == 1);
}

/* Pageable host memory: kDLCPU both ways. */
static void test_pageable(void)
{
    const size_t n = 4096;
    unsigned char *h = malloc(n);
    if (!h) exit(1);
    memset(h, 0x2d, n);
    cubuf_buffer_t *v = NULL;
    T_REQUIRE(cubuf_buffer_view((CUdeviceptr)(uintptr_t)h, n, &v));
    expect_device(v, kDLCPU, 0);
    DLManagedTensorVersioned *t = NULL;
    T_REQUIRE(cubuf_buffer_to_dlpack(v, NULL, &t));
    T_CHECK(t->dl_tensor.device.device_type == kDLCPU && t->dl_tensor.data == h);
    cubuf_buffer_release(v);
    t->deleter(t);

    foreign_t f;
    foreign_init(&f, h, false, kDLCPU);
    f.t.dl_tensor.ndim = 1;
    f.shape[0] = n / 4;
    f.t.dl_tensor.strides = NULL; /* a pre-1.2 producer's C-contiguous array */
    T_REQUIRE(cubuf_buffer_from_dlpack(&f.t, &v));
    T_CHECK(cubuf_buffer_ptr(v) == (CUdeviceptr)(uintptr_t)h && cubuf_buffer_size(v) == n);
    T_CHECK(cubuf_buffer_is_host_accessible(v) && !cubuf_buffer_is_device_accessible(v));
    expect_device(v, kDLCPU, 0);
    cubuf_buffer_release(v);
    T_CHECK(f.deleted == 1 && f.block == NULL); /* freed by the deleter */

    /* A 0-d tensor is one element: 4 bytes of int32. */
    h = malloc(64);
    if (!h) exit(1);
    foreign_init(&f, h + 8, false, kDLCPU);
    f.block = h;
    f.t.dl_tensor.ndim = 0;
    f.t.dl_tensor.shape = NULL;
    f.t.dl_tensor.strides = NULL;
    T_REQUIRE(cubuf_buffer_from_dlpack(&f.t, &v));
    T_CHECK(cubuf_buffer_ptr(v) == (CUdeviceptr)(uintptr_t)(h + 8) && cubuf_buffer_size(v) == 4);
    cubuf_buffer_release(v);
    T_CHECK(f.deleted == 1);
}

/* Device memory of no device cannot be named in DLPack. */
static cubuf_status_t nd_alloc(void *state, size_t size, CUstream stream, CUdeviceptr *ptr)
{
    return CU_CALL(cuMemAlloc, ptr, size) == CUDA_SUCCESS ? CUBUF_SUCCESS : CUBUF_ERROR_OUT_OF_MEMORY;
}

static cubuf_status_t nd_free(void *state, CUdeviceptr ptr, size_t size, CUstream stream)
{
    return CU_CALL(cuMemFree, ptr) == CUDA_SUCCESS ? CUBUF_SUCCESS : CUBUF_ERROR_DRIVER;
}

static void test_no_device_id(void)
{
    cubuf_resource_ops_t ops = {CUBUF_RESOURCE_OPS_VERSION, nd_alloc, nd_free, NULL};
    cubuf_resource_props_t props = CUBUF_RESOURCE_PROPS_INIT;
    props.device_id = -1;
    props.device_accessible = true;
    cubuf_resource_t *r = NULL;
    T_REQUIRE(cubuf_resource_create(&ops, &props, NULL, &r));
    cubuf_buffer_t *b = NULL;
    T_REQUIRE(cubuf_resource_allocate(r, 256, g_s, &b));
    int32_t type = 5, id = 5;
    T_STATUS(cubuf_buffer_dlpack_device(b, &type, &id), CUBUF_ERROR_NOT_SUPPORTED);
    T_CHECK(type == 5 && id == 5 && strstr(cubuf_last_error(), "device_id -1") != NULL);
    DLManagedTensorVersioned *t = NULL;
    T_STATUS(cubuf_buffer_to_dlpack(b, NULL, &t), CUBUF_ERROR_NOT_SUPPORTED);
    T_CHECK(t == NULL);
    T_OK(cubuf_buffer_close(b)); /* no slice left behind */
    cubuf_buffer_release(b);
    check_empty(r, "no-device resource");
    cubuf_resource_release(r);
}

int main(void)
{
    t_require_gpu();
    t_held_count();
    t_held_t held0 = t_held();
    cubuf_context_t *ctx = NULL;
    T_REQUIRE(cubuf_context_create(0, &ctx));
    CUcontext cu = NULL;
    T_REQUIRE(cubuf_context_handle(ctx, &cu));
    T_CU(cuCtxSetCurrent, cu);
    T_CU(cuStreamCreate, &g_s, CU_STREAM_NON_BLOCKING);

    test_device_pool();
    test_host_kinds();
    test_foreign_device();
    test_pageable();
    test_no_device_id();

    T_CU(cuStreamSynchronize, g_s);
    T_CU(cuStreamDestroy, g_s);
    T_CU(cuCtxSetCurrent, NULL);
    cubuf_context_destroy(ctx);
    T_HELD_BACK(held0, "test_dlpack_gpu"); /* every allocation and pool went back */
    return t_finish("test_dlpack_gpu");
}
