/* DLPack without a driver: the ABI's layout and constants, export of host
 * memory (a host-only user resource over malloc) with every layout rule and
 * error, the tensor keeping the memory and its root alive until the deleter
 * runs, and import: every refusal (the producer's deleter never called) and
 * the empty tensor, which needs no driver. Imports of memory, device kinds
 * and round trips are in test_dlpack_gpu.c. */
#include <limits.h>
#include <pthread.h>
#include <stdint.h>

#include "cubuf/dlpack.h"
#include "test.h"

/* ---- a host resource over malloc, counting ---- */

typedef struct host_state {
    int mallocs, frees;
} host_state_t;

static cubuf_status_t h_alloc(void *state, size_t size, CUstream stream, CUdeviceptr *ptr)
{
    void *p = malloc(size);
    if (!p) return CUBUF_ERROR_OUT_OF_MEMORY;
    ((host_state_t *)state)->mallocs++;
    *ptr = (CUdeviceptr)(uintptr_t)p;
    return CUBUF_SUCCESS;
}

static cubuf_status_t h_dealloc(void *state, CUdeviceptr ptr, size_t size, CUstream stream)
{
    free((void *)(uintptr_t)ptr);
    ((host_state_t *)state)->frees++;
    return CUBUF_SUCCESS;
}

static host_state_t g_host;
static cubuf_resource_t *g_res;
/* Streams are opaque to a host-only resource. */
#define HOST_STREAM ((CUstream)(uintptr_t)0x1000)

static cubuf_buffer_t *host_buffer(size_t size)
{
    cubuf_buffer_t *b = NULL;
    T_REQUIRE(cubuf_resource_allocate(g_res, size, HOST_STREAM, &b));
    return b;
}

static cubuf_status_t vast_alloc(void *state, size_t size, CUstream stream, CUdeviceptr *ptr)
{
    *ptr = 0x10000; /* nothing is read or written through it */
    return CUBUF_SUCCESS;
}

static cubuf_status_t vast_free(void *state, CUdeviceptr ptr, size_t size, CUstream stream)
{
    return CUBUF_SUCCESS;
}

static void *ptr_of(const cubuf_buffer_t *b) { return (void *)(uintptr_t)cubuf_buffer_ptr(b); }

/* A buffer with no tensor left on it closes (no slice was leaked). */
static void close_released(cubuf_buffer_t *b)
{
    T_OK(cubuf_buffer_close(b));
    cubuf_buffer_release(b);
}

/* ---- the ABI ---- */

static void test_abi(void)
{
    T_CHECK(sizeof(DLManagedTensorVersioned) == 80);
    T_CHECK(sizeof(DLManagedTensor) == 64);
    T_CHECK(sizeof(DLTensor) == 48 && sizeof(DLDevice) == 8 && sizeof(DLDataType) == 4);
    T_CHECK(sizeof(DLDeviceType) == 4 && sizeof(DLPackVersion) == 8);
    T_CHECK(offsetof(DLManagedTensorVersioned, manager_ctx) == 8);
    T_CHECK(offsetof(DLManagedTensorVersioned, deleter) == 16);
    T_CHECK(offsetof(DLManagedTensorVersioned, flags) == 24);
    T_CHECK(offsetof(DLManagedTensorVersioned, dl_tensor) == 32);
    T_CHECK(offsetof(DLManagedTensor, manager_ctx) == 48 && offsetof(DLManagedTensor, deleter) == 56);
    T_CHECK(offsetof(DLTensor, device) == 8 && offsetof(DLTensor, ndim) == 16);
    T_CHECK(offsetof(DLTensor, dtype) == 20 && offsetof(DLTensor, shape) == 24);
    T_CHECK(offsetof(DLTensor, strides) == 32 && offsetof(DLTensor, byte_offset) == 40);
    T_CHECK(DLPACK_MAJOR_VERSION == 1 && DLPACK_MINOR_VERSION == 2);
    T_CHECK(kDLCPU == 1 && kDLCUDA == 2 && kDLCUDAHost == 3 && kDLROCM == 10);
    T_CHECK(kDLCUDAManaged == 13 && kDLOneAPI == 14 && kDLTrn == 18);
    T_CHECK(kDLInt == 0 && kDLUInt == 1 && kDLFloat == 2 && kDLBfloat == 4 && kDLBool == 6);
    T_CHECK(kDLFloat8_e4m3fn == 10 && kDLFloat4_e2m1fn == 17);
    T_CHECK(DLPACK_FLAG_BITMASK_READ_ONLY == 1 && DLPACK_FLAG_BITMASK_IS_COPIED == 2);
    T_CHECK(DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED == 4);
    cubuf_dlpack_options_t o = CUBUF_DLPACK_OPTIONS_INIT;
    T_CHECK(o.struct_size == sizeof o && o.ndim == 0 && !o.shape && !o.strides && !o.read_only);
    T_CHECK(o.dtype.code == kDLUInt && o.dtype.bits == 8 && o.dtype.lanes == 1);
    T_CHECK(CUBUF_DLPACK_OPTIONS_SIZE_V1 > sizeof(size_t) && CUBUF_DLPACK_OPTIONS_SIZE_V1 <= sizeof o);
}

/* ---- export ---- */

static void test_export_default(void)
{
    cubuf_buffer_t *b = host_buffer(1000);
    int frees = g_host.frees;
    memset(ptr_of(b), 0x11, 1000);
    int32_t type = -1, id = -1;
    T_OK(cubuf_buffer_dlpack_device(b, &type, &id));
    T_CHECK(type == kDLCPU && id == 0);

    DLManagedTensorVersioned *t = NULL;
    T_REQUIRE(cubuf_buffer_to_dlpack(b, NULL, &t));
    T_CHECK(t->version.major == 1 && t->version.minor == DLPACK_MINOR_VERSION);
    T_CHECK(t->flags == 0 && t->deleter != NULL && t->manager_ctx != NULL);
    DLTensor *d = &t->dl_tensor;
    T_CHECK(d->data == ptr_of(b) && d->byte_offset == 0);
    T_CHECK(d->device.device_type == kDLCPU && d->device.device_id == 0);
    T_CHECK(d->ndim == 1 && d->shape && d->strides && d->shape[0] == 1000 && d->strides[0] == 1);
    T_CHECK(d->dtype.code == kDLUInt && d->dtype.bits == 8 && d->dtype.lanes == 1);
    /* shape and strides lie in the tensor's own block, after the struct. */
    T_CHECK((char *)d->shape == (char *)t + sizeof *t && d->strides == d->shape + 1);
    /* The same memory, no copy. */
    ((unsigned char *)d->data)[999] = 0x22;
    T_CHECK(((unsigned char *)ptr_of(b))[999] == 0x22 && ((unsigned char *)d->data)[0] == 0x11);

    /* The tensor keeps the buffer from closing, and its memory after the last handle. */
    T_STATUS(cubuf_buffer_close(b), CUBUF_ERROR_BUSY);
    T_CHECK(!cubuf_buffer_is_closed(b));
    cubuf_buffer_release(b);
    T_CHECK(g_host.frees == frees);
    ((unsigned char *)d->data)[0] = 0x33; /* still allocated */
    t->deleter(t);
    T_CHECK(g_host.frees == frees + 1);

    /* A size-0 buffer: an empty 1-D tensor with data NULL. */
    b = host_buffer(0);
    T_REQUIRE(cubuf_buffer_to_dlpack(b, NULL, &t));
    T_CHECK(t->dl_tensor.data == NULL && t->dl_tensor.ndim == 1 && t->dl_tensor.shape[0] == 0);
    T_CHECK(t->dl_tensor.strides[0] == 1);
    T_STATUS(cubuf_buffer_close(b), CUBUF_ERROR_BUSY);
    t->deleter(t);
    close_released(b);
}

/* Exports `b` with `o`, expecting success; the tensor's layout is checked by the caller. */
static DLManagedTensorVersioned *export_ok(cubuf_buffer_t *b, const cubuf_dlpack_options_t *o)
{
    DLManagedTensorVersioned *t = NULL;
    T_OK(cubuf_buffer_to_dlpack(b, o, &t));
    if (!t) exit(1);
    return t;
}

static void export_fails(cubuf_buffer_t *b, const cubuf_dlpack_options_t *o, cubuf_status_t want,
                         const char *detail)
{
    DLManagedTensorVersioned *t = (DLManagedTensorVersioned *)(uintptr_t)1;
    T_STATUS(cubuf_buffer_to_dlpack(b, o, &t), want);
    T_CHECK(t == (DLManagedTensorVersioned *)(uintptr_t)1); /* written on success only */
    if (detail && !strstr(cubuf_last_error(), detail)) {
        fprintf(stderr, "detail '%s' lacks '%s'\n", cubuf_last_error(), detail);
        t_failures++;
    }
}

static void test_export_layouts(void)
{
    cubuf_buffer_t *b = host_buffer(48);
    char *base = ptr_of(b);
    cubuf_dlpack_options_t o = CUBUF_DLPACK_OPTIONS_INIT;
    const DLDataType f32 = {kDLFloat, 32, 1};

    /* 3x4 float32, C-contiguous by default, exactly the buffer; shape copied. */
    int64_t shape[2] = {3, 4};
    o.dtype = f32;
    o.ndim = 2;
    o.shape = shape;
    DLManagedTensorVersioned *t = export_ok(b, &o);
    shape[0] = 99;
    T_CHECK(t->dl_tensor.ndim == 2 && t->dl_tensor.shape[0] == 3 && t->dl_tensor.shape[1] == 4);
    T_CHECK(t->dl_tensor.strides[0] == 4 && t->dl_tensor.strides[1] == 1);
    T_CHECK(t->dl_tensor.dtype.code == kDLFloat && t->dl_tensor.dtype.bits == 32);
    T_CHECK(t->dl_tensor.data == base);
    t->deleter(t);

    /* 3x5 float32 needs 60 bytes of 48. */
    shape[0] = 3;
    shape[1] = 5;
    export_fails(b, &o, CUBUF_ERROR_OUT_OF_RANGE, "60 bytes");
    T_CHECK(strstr(cubuf_last_error(), "48") != NULL);

    /* Column-major strides given: the same 48 bytes; strides copied. */
    int64_t fstrides[2] = {1, 3};
    shape[1] = 4;
    o.strides = fstrides;
    t = export_ok(b, &o);
    fstrides[0] = 7;
    T_CHECK(t->dl_tensor.strides[0] == 1 && t->dl_tensor.strides[1] == 3);
    T_CHECK(t->dl_tensor.data == base);
    t->deleter(t);
    fstrides[0] = 2; /* (2*2 + 3*3 + 1) * 4 = 56 > 48 */
    export_fails(b, &o, CUBUF_ERROR_OUT_OF_RANGE, "56 bytes");

    /* A negative stride: element 0 is the highest, the lowest sits at the buffer's start. */
    int64_t n4[1] = {4}, back[1] = {-1};
    o.dtype = (DLDataType){kDLInt, 32, 1};
    o.ndim = 1;
    o.shape = n4;
    o.strides = back;
    t = export_ok(b, &o);
    T_CHECK(t->dl_tensor.data == base + 12 && t->dl_tensor.strides[0] == -1);
    t->deleter(t);
    n4[0] = 13; /* 52 bytes */
    export_fails(b, &o, CUBUF_ERROR_OUT_OF_RANGE, "52 bytes");

    /* Stride 0 repeats one element: 1000 float64 views of 8 bytes. */
    int64_t many[1] = {1000}, zero[1] = {0};
    o.dtype = (DLDataType){kDLFloat, 64, 1};
    o.shape = many;
    o.strides = zero;
    t = export_ok(b, &o);
    T_CHECK(t->dl_tensor.shape[0] == 1000 && t->dl_tensor.strides[0] == 0);
    t->deleter(t);

    /* No element: data NULL, C-contiguous strides still set; any extents. */
    int64_t empty[3] = {5, 0, 7};
    o.dtype = f32;
    o.ndim = 3;
    o.shape = empty;
    o.strides = NULL;
    t = export_ok(b, &o);
    T_CHECK(t->dl_tensor.data == NULL && t->dl_tensor.ndim == 3);
    T_CHECK(t->dl_tensor.strides[0] == 0 && t->dl_tensor.strides[1] == 7 && t->dl_tensor.strides[2] == 1);
    t->deleter(t);

    /* ndim 0 with a vector type: float32x4 elements of 16 bytes. */
    o = (cubuf_dlpack_options_t)CUBUF_DLPACK_OPTIONS_INIT;
    o.dtype = (DLDataType){kDLFloat, 32, 4};
    o.shape = empty; /* ignored with ndim 0 */
    t = export_ok(b, &o);
    T_CHECK(t->dl_tensor.ndim == 1 && t->dl_tensor.shape[0] == 3 && t->dl_tensor.strides[0] == 1);
    T_CHECK(t->dl_tensor.dtype.lanes == 4);
    t->deleter(t);
    o.dtype = (DLDataType){kDLBool, 8, 1};
    t = export_ok(b, &o);
    T_CHECK(t->dl_tensor.shape[0] == 48);
    t->deleter(t);
    o.dtype = (DLDataType){kDLComplex, 128, 1}; /* 16 bytes: 48 = 3 of them */
    t = export_ok(b, &o);
    T_CHECK(t->dl_tensor.shape[0] == 3);
    t->deleter(t);
    o.dtype = (DLDataType){kDLFloat, 8, 5}; /* 5-byte elements do not divide 48 bytes */
    export_fails(b, &o, CUBUF_ERROR_INVALID_ARGUMENT, "48 bytes");

    /* Element types refused. */
    const DLDataType bad[] = {{kDLFloat, 0, 1}, {kDLFloat, 32, 0}, {kDLFloat4_e2m1fn, 4, 1},
                              {kDLFloat6_e2m3fn, 6, 1}, {kDLInt, 12, 1}, {kDLBool, 1, 1}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        o.dtype = bad[i];
        export_fails(b, &o, CUBUF_ERROR_INVALID_ARGUMENT, "dtype");
    }

    /* Shapes refused. */
    o = (cubuf_dlpack_options_t)CUBUF_DLPACK_OPTIONS_INIT;
    o.ndim = -1;
    export_fails(b, &o, CUBUF_ERROR_INVALID_ARGUMENT, "ndim");
    o.ndim = 2;
    export_fails(b, &o, CUBUF_ERROR_INVALID_ARGUMENT, "shape is NULL");
    int64_t neg[2] = {3, -1};
    o.shape = neg;
    export_fails(b, &o, CUBUF_ERROR_INVALID_ARGUMENT, "shape[1]");
    /* The layout's arithmetic overflows: strides given, and C-contiguous. */
    int64_t huge[2] = {INT64_MAX / 2, 3}, step[2] = {4, 1};
    o.shape = huge;
    o.strides = step;
    export_fails(b, &o, CUBUF_ERROR_OUT_OF_RANGE, "overflows");
    int64_t wide[3] = {1, INT64_MAX / 2, 4};
    o.ndim = 3;
    o.shape = wide;
    o.strides = NULL;
    export_fails(b, &o, CUBUF_ERROR_OUT_OF_RANGE, "overflows");
    int64_t big_items[1] = {INT64_MAX / 2};
    o.ndim = 1;
    o.shape = big_items;
    o.dtype = (DLDataType){kDLFloat, 64, 1}; /* elements fit in int64, bytes do not */
    export_fails(b, &o, CUBUF_ERROR_OUT_OF_RANGE, "overflows");

    /* ndim 0 over a buffer of more bytes than an int64 extent counts (a
     * resource that hands out address space without memory behind it). */
    {
        static const cubuf_resource_ops_t vast_ops = {CUBUF_RESOURCE_OPS_VERSION, vast_alloc,
                                                      vast_free, NULL};
        cubuf_resource_props_t props = CUBUF_RESOURCE_PROPS_INIT;
        props.host_accessible = true;
        cubuf_resource_t *vast = NULL;
        T_REQUIRE(cubuf_resource_create(&vast_ops, &props, NULL, &vast));
        cubuf_buffer_t *v = NULL;
        T_REQUIRE(cubuf_resource_allocate(vast, (size_t)INT64_MAX + 1, HOST_STREAM, &v));
        o = (cubuf_dlpack_options_t)CUBUF_DLPACK_OPTIONS_INIT;
        o.dtype = (DLDataType){kDLUInt, 8, 1};
        export_fails(v, &o, CUBUF_ERROR_OUT_OF_RANGE, "int64 extent");
        o.dtype = (DLDataType){kDLUInt, 16, 1}; /* 2^62 elements: exported */
        DLManagedTensorVersioned *vt = NULL;
        T_OK(cubuf_buffer_to_dlpack(v, &o, &vt));
        T_CHECK(vt && vt->dl_tensor.ndim == 1 && vt->dl_tensor.shape[0] == (int64_t)1 << 62);
        if (vt) vt->deleter(vt);
        close_released(v);
        cubuf_resource_release(vast);
    }

    /* Arguments and struct sizes. */
    o = (cubuf_dlpack_options_t)CUBUF_DLPACK_OPTIONS_INIT;
    DLManagedTensorVersioned *never = NULL;
    T_STATUS(cubuf_buffer_to_dlpack(NULL, &o, &never), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_buffer_to_dlpack(b, &o, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(never == NULL);
    o.struct_size = CUBUF_DLPACK_OPTIONS_SIZE_V1 - 1;
    export_fails(b, &o, CUBUF_ERROR_INVALID_ARGUMENT, "cubuf_dlpack_options_t");
    o.struct_size = 0;
    export_fails(b, &o, CUBUF_ERROR_INVALID_ARGUMENT, "cubuf_dlpack_options_t");
    /* The first layout, and a newer header's larger struct (its extra bytes ignored). */
    struct {
        cubuf_dlpack_options_t o;
        unsigned char future[16];
    } newer;
    memset(&newer, 0xee, sizeof newer);
    newer.o = (cubuf_dlpack_options_t)CUBUF_DLPACK_OPTIONS_INIT;
    newer.o.struct_size = sizeof newer;
    t = export_ok(b, &newer.o);
    T_CHECK(t->dl_tensor.shape[0] == 48);
    t->deleter(t);
    newer.o.struct_size = CUBUF_DLPACK_OPTIONS_SIZE_V1;
    newer.o.read_only = true;
    t = export_ok(b, &newer.o);
    T_CHECK(t->flags == DLPACK_FLAG_BITMASK_READ_ONLY);
    t->deleter(t);

    /* Not one refused export left a slice behind. */
    close_released(b);

    /* A closed buffer. */
    b = host_buffer(16);
    T_OK(cubuf_buffer_close(b));
    export_fails(b, NULL, CUBUF_ERROR_CLOSED, "closed");
    int32_t type = 7, id = 7;
    T_STATUS(cubuf_buffer_dlpack_device(b, &type, &id), CUBUF_ERROR_CLOSED);
    T_CHECK(type == 7 && id == 7);
    T_STATUS(cubuf_buffer_dlpack_device(NULL, &type, &id), CUBUF_ERROR_INVALID_ARGUMENT);
    cubuf_buffer_release(b);
    b = host_buffer(16);
    T_STATUS(cubuf_buffer_dlpack_device(b, NULL, &id), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_buffer_dlpack_device(b, &type, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    close_released(b);
}

static void test_read_only_and_unversioned(void)
{
    cubuf_buffer_t *b = host_buffer(64);
    cubuf_dlpack_options_t o = CUBUF_DLPACK_OPTIONS_INIT;
    o.read_only = true;
    DLManagedTensorVersioned *t = export_ok(b, &o);
    T_CHECK(t->flags == DLPACK_FLAG_BITMASK_READ_ONLY);
    T_CHECK(!cubuf_dlpack_is_read_only(b)); /* the flag describes the tensor, not the buffer */
    t->deleter(t);

    /* The legacy struct: no flags, so no read-only. */
    DLManagedTensor *u = (DLManagedTensor *)(uintptr_t)1;
    T_STATUS(cubuf_buffer_to_dlpack_unversioned(b, &o, &u), CUBUF_ERROR_NOT_SUPPORTED);
    T_CHECK(u == (DLManagedTensor *)(uintptr_t)1);
    T_CHECK(strstr(cubuf_last_error(), "read-only") != NULL);
    T_STATUS(cubuf_buffer_to_dlpack_unversioned(b, NULL, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_buffer_to_dlpack_unversioned(NULL, NULL, &u), CUBUF_ERROR_INVALID_ARGUMENT);
    int64_t shape[2] = {9, 4}; /* 9x4 int16: 72 bytes of 64 */
    o = (cubuf_dlpack_options_t)CUBUF_DLPACK_OPTIONS_INIT;
    o.dtype = (DLDataType){kDLInt, 16, 1};
    o.ndim = 2;
    o.shape = shape;
    T_STATUS(cubuf_buffer_to_dlpack_unversioned(b, &o, &u), CUBUF_ERROR_OUT_OF_RANGE);
    T_CHECK(u == (DLManagedTensor *)(uintptr_t)1);
    shape[0] = 8; /* 8x4 int16 = 64 bytes */
    u = NULL;
    T_OK(cubuf_buffer_to_dlpack_unversioned(b, &o, &u));
    if (!u) exit(1);
    T_CHECK(u->dl_tensor.data == ptr_of(b) && u->dl_tensor.ndim == 2);
    T_CHECK(u->dl_tensor.shape[0] == 8 && u->dl_tensor.strides[0] == 4 && u->dl_tensor.strides[1] == 1);
    T_CHECK(u->dl_tensor.device.device_type == kDLCPU && u->manager_ctx && u->deleter);
    T_CHECK((char *)u->dl_tensor.shape == (char *)u + sizeof *u);
    int frees = g_host.frees;
    T_STATUS(cubuf_buffer_close(b), CUBUF_ERROR_BUSY);
    cubuf_buffer_release(b);
    T_CHECK(g_host.frees == frees);
    u->deleter(u);
    T_CHECK(g_host.frees == frees + 1);
}

/* A tensor of a slice holds the slice's root; closing the slice itself is fine. */
static void test_slice_keeps_root(void)
{
    cubuf_buffer_t *root = host_buffer(4096), *view = NULL;
    int frees = g_host.frees;
    T_REQUIRE(cubuf_buffer_slice(root, 100, 200, &view));
    DLManagedTensorVersioned *t = NULL, *t2 = NULL;
    T_REQUIRE(cubuf_buffer_to_dlpack(view, NULL, &t));
    T_REQUIRE(cubuf_buffer_to_dlpack(view, NULL, &t2));
    T_CHECK(t->dl_tensor.data == (char *)ptr_of(root) + 100 && t->dl_tensor.shape[0] == 200);
    T_CHECK(cubuf_buffer_parent((cubuf_buffer_t *)t->manager_ctx) == root);
    T_OK(cubuf_buffer_close(view));
    cubuf_buffer_release(view);
    T_STATUS(cubuf_buffer_close(root), CUBUF_ERROR_BUSY);
    t->deleter(t);
    T_STATUS(cubuf_buffer_close(root), CUBUF_ERROR_BUSY); /* t2 still holds it */
    t2->deleter(t2);
    T_OK(cubuf_buffer_close(root));
    T_CHECK(g_host.frees == frees + 1);
    cubuf_buffer_release(root);
}

/* The deleter may run on another thread and frees the memory there. */
static void *run_deleter(void *arg)
{
    DLManagedTensorVersioned *t = arg;
    t->deleter(t);
    return NULL;
}

static void test_deleter_on_thread(void)
{
    cubuf_buffer_t *b = host_buffer(256);
    int frees = g_host.frees;
    DLManagedTensorVersioned *t[4];
    for (int i = 0; i < 4; i++) T_REQUIRE(cubuf_buffer_to_dlpack(b, NULL, &t[i]));
    cubuf_buffer_release(b); /* the tensors hold the memory now */
    pthread_t th[4];
    for (int i = 0; i < 4; i++) T_CHECK(pthread_create(&th[i], NULL, run_deleter, t[i]) == 0);
    for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
    T_CHECK(g_host.frees == frees + 1);
}

/* Every host allocation of an export failing in turn: OUT_OF_MEMORY, nothing held. */
static void test_export_faults(void)
{
    cubuf_buffer_t *b = host_buffer(64);
    int64_t shape[2] = {8, 8};
    cubuf_dlpack_options_t o = CUBUF_DLPACK_OPTIONS_INIT;
    o.ndim = 2;
    o.shape = shape;
    int failed = 0;
    for (unsigned nth = 1; nth < 16; nth++) {
        DLManagedTensorVersioned *t = NULL;
        cubuf_fault_fail_alloc_nth(nth);
        cubuf_status_t st = cubuf_buffer_to_dlpack(b, &o, &t);
        bool fired = cubuf_fault_fired_alloc();
        cubuf_fault_reset();
        if (!fired) {
            T_CHECK(st == CUBUF_SUCCESS && t != NULL);
            if (t) t->deleter(t);
            break;
        }
        failed++;
        T_STATUS(st, CUBUF_ERROR_OUT_OF_MEMORY);
        T_CHECK(t == NULL);
        T_OK(cubuf_buffer_close(b)); /* nothing holds it */
        cubuf_buffer_release(b);
        b = host_buffer(64);
    }
    T_CHECK(failed >= 1); /* at least the tensor's own block */
    close_released(b);
}

/* ---- import ---- */

typedef struct producer {
    DLManagedTensorVersioned v;
    DLManagedTensor u;
    int64_t shape[4], strides[4];
    int deleted_v, deleted_u;
} producer_t;

static producer_t g_prod;

static void prod_delete_v(DLManagedTensorVersioned *self)
{
    T_CHECK(self == &g_prod.v && self->manager_ctx == &g_prod);
    g_prod.deleted_v++;
}

static void prod_delete_u(DLManagedTensor *self)
{
    T_CHECK(self == &g_prod.u && self->manager_ctx == &g_prod);
    g_prod.deleted_u++;
}

/* A 1-D uint8 tensor of `n` bytes at `data`, as a producer would make it. */
static void prod_reset(void *data, int64_t n)
{
    memset(&g_prod, 0, sizeof g_prod);
    g_prod.shape[0] = n;
    g_prod.strides[0] = 1;
    DLTensor dl = {data, {kDLCPU, 0}, 1, {kDLUInt, 8, 1}, g_prod.shape, g_prod.strides, 0};
    g_prod.v.version.major = 1;
    g_prod.v.version.minor = 1;
    g_prod.v.manager_ctx = &g_prod;
    g_prod.v.deleter = prod_delete_v;
    g_prod.v.dl_tensor = dl;
    g_prod.u.manager_ctx = &g_prod;
    g_prod.u.deleter = prod_delete_u;
    g_prod.u.dl_tensor = dl;
}

/* Both imports of the producer's tensors fail with `want`; neither deleter runs. */
static void import_fails(cubuf_status_t want, const char *detail)
{
    g_prod.u.dl_tensor = g_prod.v.dl_tensor;
    cubuf_buffer_t *b = (cubuf_buffer_t *)(uintptr_t)1;
    T_STATUS(cubuf_buffer_from_dlpack(&g_prod.v, &b), want);
    if (detail && !strstr(cubuf_last_error(), detail)) {
        fprintf(stderr, "detail '%s' lacks '%s'\n", cubuf_last_error(), detail);
        t_failures++;
    }
    T_STATUS(cubuf_buffer_from_dlpack_unversioned(&g_prod.u, &b), want);
    T_CHECK(b == (cubuf_buffer_t *)(uintptr_t)1);
    T_CHECK(g_prod.deleted_v == 0 && g_prod.deleted_u == 0);
}

static void test_import_refused(void)
{
    static unsigned char block[256];
    DLTensor *dl = &g_prod.v.dl_tensor;
    cubuf_buffer_t *b = NULL;

    prod_reset(block, 256);
    T_STATUS(cubuf_buffer_from_dlpack(NULL, &b), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_buffer_from_dlpack(&g_prod.v, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_buffer_from_dlpack_unversioned(NULL, &b), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_buffer_from_dlpack_unversioned(&g_prod.u, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(b == NULL && g_prod.deleted_v == 0 && g_prod.deleted_u == 0);

    /* Another major version: nothing else is read (the tensor below is garbage). */
    for (uint32_t major = 0; major < 4; major += 2) {
        prod_reset(NULL, -5);
        g_prod.v.version.major = major;
        g_prod.v.dl_tensor.ndim = -3;
        b = (cubuf_buffer_t *)(uintptr_t)1;
        T_STATUS(cubuf_buffer_from_dlpack(&g_prod.v, &b), CUBUF_ERROR_NOT_SUPPORTED);
        T_CHECK(strstr(cubuf_last_error(), major ? "DLPack 2.1" : "DLPack 0.1") != NULL);
        T_CHECK(b == (cubuf_buffer_t *)(uintptr_t)1 && g_prod.deleted_v == 0);
    }

    /* Device types other than the four. */
    const DLDeviceType others[] = {kDLOpenCL, kDLVulkan, kDLROCM, kDLROCMHost, kDLOneAPI, kDLTrn,
                                   (DLDeviceType)0, (DLDeviceType)99};
    for (size_t i = 0; i < sizeof others / sizeof others[0]; i++) {
        prod_reset(block, 256);
        dl->device.device_type = others[i];
        char name[32];
        snprintf(name, sizeof name, "device type %d", (int)others[i]);
        import_fails(CUBUF_ERROR_NOT_SUPPORTED, name);
    }

    /* Layouts refused. */
    prod_reset(block, 256);
    dl->ndim = -1;
    import_fails(CUBUF_ERROR_INVALID_ARGUMENT, "ndim");
    prod_reset(block, 256);
    dl->shape = NULL;
    import_fails(CUBUF_ERROR_INVALID_ARGUMENT, "shape is NULL");
    prod_reset(block, 256);
    g_prod.shape[0] = -2;
    import_fails(CUBUF_ERROR_INVALID_ARGUMENT, "shape[0]");
    const DLDataType bad[] = {{kDLFloat, 0, 1}, {kDLFloat, 32, 0}, {kDLFloat4_e2m1fn, 4, 1}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        prod_reset(block, 256);
        dl->dtype = bad[i];
        import_fails(CUBUF_ERROR_INVALID_ARGUMENT, "dtype");
    }
    prod_reset(NULL, 16);
    import_fails(CUBUF_ERROR_INVALID_ARGUMENT, "data is NULL");

    /* Ranges that do not fit the address space or 64 bits. */
    prod_reset(block, INT64_MAX);
    g_prod.strides[0] = 2;
    import_fails(CUBUF_ERROR_OUT_OF_RANGE, "overflows");
    prod_reset(block, INT64_MAX / 2);
    dl->dtype = (DLDataType){kDLFloat, 64, 1};
    import_fails(CUBUF_ERROR_OUT_OF_RANGE, "overflows");
    prod_reset((void *)(uintptr_t)64, 100);
    g_prod.strides[0] = -1; /* reaches 99 bytes below address 64 */
    import_fails(CUBUF_ERROR_OUT_OF_RANGE, "below");
    prod_reset((void *)(uintptr_t)(UINTPTR_MAX - 63), 100);
    import_fails(CUBUF_ERROR_OUT_OF_RANGE, "end of the address space");
    prod_reset(block, 16);
    dl->byte_offset = UINT64_MAX - 8;
    import_fails(CUBUF_ERROR_OUT_OF_RANGE, "byte_offset");
}

/* An empty tensor with data NULL imports without a driver: size 0 at 0. */
static void test_import_empty(void)
{
    prod_reset(NULL, 0);
    g_prod.v.flags = DLPACK_FLAG_BITMASK_READ_ONLY;
    cubuf_buffer_t *b = NULL;
    T_REQUIRE(cubuf_buffer_from_dlpack(&g_prod.v, &b));
    T_CHECK(cubuf_buffer_size(b) == 0 && cubuf_buffer_ptr(b) == 0 && !cubuf_buffer_is_closed(b));
    T_CHECK(cubuf_buffer_owner(b) == &g_prod.v);
    T_CHECK(cubuf_dlpack_is_read_only(b));
    int32_t type = -1, id = -1;
    T_OK(cubuf_buffer_dlpack_device(b, &type, &id));
    T_CHECK(type == kDLCPU && id == 0);
    /* Exported again: the new tensor holds the import, whose deleter waits for it. */
    DLManagedTensorVersioned *t = NULL;
    T_REQUIRE(cubuf_buffer_to_dlpack(b, NULL, &t));
    T_CHECK(t->dl_tensor.data == NULL && t->dl_tensor.shape[0] == 0 && t->flags == 0);
    cubuf_buffer_t *slice = NULL;
    T_REQUIRE(cubuf_buffer_slice(b, 0, 0, &slice));
    T_CHECK(cubuf_dlpack_is_read_only(slice)); /* slices share the root's memory */
    cubuf_buffer_release(slice);
    cubuf_buffer_release(b);
    T_CHECK(g_prod.deleted_v == 0);
    t->deleter(t);
    T_CHECK(g_prod.deleted_v == 1); /* exactly once */

    /* Closing calls the deleter; the handle stays until released. */
    prod_reset(NULL, 0);
    T_REQUIRE(cubuf_buffer_from_dlpack(&g_prod.v, &b));
    T_CHECK(!cubuf_dlpack_is_read_only(b));
    T_OK(cubuf_buffer_close(b));
    T_CHECK(g_prod.deleted_v == 1 && !cubuf_dlpack_is_read_only(b));
    T_OK(cubuf_buffer_close(b));
    cubuf_buffer_release(b);
    T_CHECK(g_prod.deleted_v == 1);

    /* Unversioned: never read-only; 0-d and several empty dimensions; a NULL deleter. */
    prod_reset(NULL, 0);
    g_prod.u.dl_tensor.ndim = 2;
    g_prod.shape[1] = 3;
    g_prod.u.dl_tensor.strides = NULL;
    T_REQUIRE(cubuf_buffer_from_dlpack_unversioned(&g_prod.u, &b));
    T_CHECK(cubuf_buffer_size(b) == 0 && !cubuf_dlpack_is_read_only(b));
    T_CHECK(cubuf_buffer_owner(b) == &g_prod.u);
    cubuf_buffer_release(b);
    T_CHECK(g_prod.deleted_u == 1 && g_prod.deleted_v == 0);
    /* Empty with implied (NULL) strides whose C-contiguous product would
     * overflow: there is no element and no stride to compute, so it is
     * still the empty buffer. */
    prod_reset(NULL, 0);
    g_prod.v.dl_tensor.ndim = 3;
    g_prod.shape[1] = g_prod.shape[2] = (int64_t)1 << 40;
    g_prod.v.dl_tensor.strides = NULL;
    b = NULL;
    T_OK(cubuf_buffer_from_dlpack(&g_prod.v, &b));
    T_CHECK(b && cubuf_buffer_size(b) == 0 && cubuf_buffer_ptr(b) == 0);
    cubuf_buffer_release(b);
    T_CHECK(g_prod.deleted_v == 1);
    prod_reset(NULL, 0);
    g_prod.v.deleter = NULL;
    T_REQUIRE(cubuf_buffer_from_dlpack(&g_prod.v, &b));
    cubuf_buffer_release(b); /* nothing to call */
    T_CHECK(!cubuf_dlpack_is_read_only(NULL));
}

int main(void)
{
    cubuf_resource_ops_t ops = {CUBUF_RESOURCE_OPS_VERSION, h_alloc, h_dealloc, NULL};
    cubuf_resource_props_t props = CUBUF_RESOURCE_PROPS_INIT;
    props.host_accessible = true; /* host only: no driver involved */
    T_REQUIRE(cubuf_resource_create(&ops, &props, &g_host, &g_res));

    test_abi();
    test_export_default();
    test_export_layouts();
    test_read_only_and_unversioned();
    test_slice_keeps_root();
    test_deleter_on_thread();
    test_export_faults();
    test_import_refused();
    test_import_empty();

    T_CHECK(g_host.mallocs == g_host.frees); /* every buffer's memory went back */
    cubuf_resource_release(g_res);
    return t_finish("test_dlpack");
}
