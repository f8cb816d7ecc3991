/* DLPack: buffers exported as managed tensors, tensors imported as buffers
 * (include/cubuf/dlpack.h). */
#include <string.h>

#include "cubuf/dlpack.h"
#include "inspect.h"
#include "internal.h"
#include "strided.h"

/* ---- layouts ---------------------------------------------------------------- */

/* Checks an element type; *itemsize receives its bytes. */
static cubuf_status_t check_dtype(const char *what, DLDataType dt, size_t *itemsize)
{
    if (dt.bits == 0 || dt.lanes == 0 || dt.bits % 8 != 0)
        return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,
                           "%s: dtype {code %u, bits %u, lanes %u}: bits must be a positive "
                           "multiple of 8 and lanes positive (sub-byte types are not supported)",
                           what, (unsigned)dt.code, (unsigned)dt.bits, (unsigned)dt.lanes);
    *itemsize = (size_t)(dt.bits / 8) * dt.lanes;
    return CUBUF_SUCCESS;
}

/* Checks ndim and the extents; *empty says whether an extent is 0. */
static cubuf_status_t check_shape(const char *what, int32_t ndim, const int64_t *shape, bool *empty)
{
    CHECK_ARG(ndim >= 0, "%s: ndim is negative (%d)", what, (int)ndim);
    CHECK_ARG(ndim == 0 || shape, "%s: shape is NULL with ndim %d", what, (int)ndim);
    *empty = false;
    for (int32_t k = 0; k < ndim; k++) {
        CHECK_ARG(shape[k] >= 0, "%s: shape[%d] is negative (%lld)", what, (int)k,
                  (long long)shape[k]);
        if (shape[k] == 0) *empty = true;
    }
    return CUBUF_SUCCESS;
}

/* Where an array's elements reach, relative to element 0: the lowest byte
 * at `low` (<= 0) bytes, `bytes` bytes up to the end of the highest (0
 * when the array has no element). */
typedef struct span {
    int64_t low;
    uint64_t bytes;
} span_t;

/* The span of an array whose shape check_shape accepted, strides in
 * elements (NULL: C-contiguous); the strides used go to `used` (ndim
 * entries) when it is not NULL. */
static cubuf_status_t array_span(const char *what, int32_t ndim, const int64_t *shape,
                                 const int64_t *strides, size_t itemsize, int64_t *used, span_t *out)
{
    return cubuf__strided_span(what, ndim, shape, strides, itemsize, itemsize, used, &out->low, &out->bytes);
}

/* ---- devices ---------------------------------------------------------------- */

static cubuf_status_t device_of(const cubuf_buffer_t *buf, const char *what, DLDevice *dev)
{
    cubuf_status_t st = cubuf__buffer_check_open(buf, what);
    if (st != CUBUF_SUCCESS) return st;
    bool device = cubuf_buffer_is_device_accessible(buf);
    DLDevice d = {kDLCPU, 0};
    if (cubuf_buffer_is_managed(buf)) {
        d.device_type = kDLCUDAManaged;
    } else if (device && cubuf_buffer_is_host_accessible(buf)) {
        d.device_type = kDLCUDAHost;
    } else if (device) {
        d.device_type = kDLCUDA;
        d.device_id = cubuf_buffer_device_id(buf);
        if (d.device_id < 0)
            return cubuf__fail(CUBUF_ERROR_NOT_SUPPORTED,
                               "%s: the buffer is device memory bound to no device (device_id "
                               "-1), which DLPack cannot name", what);
    }
    *dev = d;
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf_buffer_dlpack_device(const cubuf_buffer_t *buf, int32_t *device_type,
                                          int32_t *device_id)
{
    static const char what[] = "cubuf_buffer_dlpack_device";
    CHECK_ARG(buf && device_type && device_id, "%s: NULL argument", what);
    DLDevice d = {kDLCPU, 0}; /* set by device_of; initialized for gcc -O3 */
    cubuf_status_t st = device_of(buf, what, &d);
    if (st != CUBUF_SUCCESS) return st;
    *device_type = (int32_t)d.device_type;
    *device_id = d.device_id;
    return CUBUF_SUCCESS;
}

/* ---- export ----------------------------------------------------------------- */

static void delete_versioned(DLManagedTensorVersioned *self)
{
    if (!self) return;
    cubuf_buffer_release(self->manager_ctx);
    cubuf__free(self);
}

static void delete_unversioned(DLManagedTensor *self)
{
    if (!self) return;
    cubuf_buffer_release(self->manager_ctx);
    cubuf__free(self);
}

/* Makes a managed tensor (versioned or not) of `buf`: one allocation
 * holding the struct, then its shape and strides; manager_ctx is the slice
 * that keeps the memory alive. */
static cubuf_status_t export_tensor(cubuf_buffer_t *buf, const cubuf_dlpack_options_t *opts,
                                    bool versioned, const char *what, void **out)
{
    CHECK_ARG(buf && out, "%s: NULL argument", what);
    cubuf_dlpack_options_t o = CUBUF_DLPACK_OPTIONS_INIT;
    cubuf_status_t st;
    if (opts && (st = cubuf__struct_in(what, "cubuf_dlpack_options_t", &o, sizeof o, opts,
                                       CUBUF_DLPACK_OPTIONS_SIZE_V1)) != CUBUF_SUCCESS)
        return st;
    DLDevice dev;
    if ((st = device_of(buf, what, &dev)) != CUBUF_SUCCESS) return st;
    if (!versioned && o.read_only)
        return cubuf__fail(CUBUF_ERROR_NOT_SUPPORTED,
                           "%s: an unversioned DLManagedTensor has no flags to say it is "
                           "read-only; export a versioned one", what);
    size_t itemsize = 0, size = cubuf_buffer_size(buf);
    if ((st = check_dtype(what, o.dtype, &itemsize)) != CUBUF_SUCCESS) return st;
    int64_t whole;
    if (o.ndim == 0) { /* the buffer as a 1-D array */
        CHECK_ARG(size % itemsize == 0,
                  "%s: a buffer of %zu bytes is not a whole number of %zu-byte elements", what,
                  size, itemsize);
        if (size / itemsize > (size_t)INT64_MAX)
            return cubuf__fail(CUBUF_ERROR_OUT_OF_RANGE,
                               "%s: a buffer of %zu bytes holds more %zu-byte elements than an "
                               "int64 extent counts", what, size, itemsize);
        whole = (int64_t)(size / itemsize);
        o.ndim = 1;
        o.shape = &whole;
        o.strides = NULL;
    }
    bool empty = false;
    if ((st = check_shape(what, o.ndim, o.shape, &empty)) != CUBUF_SUCCESS) return st;

    size_t head = versioned ? sizeof(DLManagedTensorVersioned) : sizeof(DLManagedTensor);
    char *mem = cubuf__malloc(head + 2 * (size_t)o.ndim * sizeof(int64_t));
    if (!mem)
        return cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY,
                           "%s: cannot allocate a tensor of %d dimensions", what, (int)o.ndim);
    int64_t *shape = (int64_t *)(void *)(mem + head), *strides = shape + o.ndim;
    span_t sp;
    cubuf_buffer_t *slice = NULL;
    st = array_span(what, o.ndim, o.shape, o.strides, itemsize, strides, &sp);
    if (st == CUBUF_SUCCESS && sp.bytes > size)
        st = cubuf__fail(CUBUF_ERROR_OUT_OF_RANGE,
                         "%s: the tensor's elements reach %llu bytes (itemsize %zu), more than "
                         "the buffer's %zu", what, (unsigned long long)sp.bytes, itemsize, size);
    if (st == CUBUF_SUCCESS) st = cubuf_buffer_slice(buf, 0, size, &slice);
    if (st != CUBUF_SUCCESS) {
        cubuf__free(mem);
        return st;
    }
    memcpy(shape, o.shape, (size_t)o.ndim * sizeof(int64_t));
    DLTensor *t;
    if (versioned) {
        DLManagedTensorVersioned *m = (DLManagedTensorVersioned *)(void *)mem;
        m->version.major = DLPACK_MAJOR_VERSION;
        m->version.minor = DLPACK_MINOR_VERSION;
        m->manager_ctx = slice;
        m->deleter = delete_versioned;
        m->flags = o.read_only ? DLPACK_FLAG_BITMASK_READ_ONLY : 0;
        t = &m->dl_tensor;
    } else {
        DLManagedTensor *m = (DLManagedTensor *)(void *)mem;
        m->manager_ctx = slice;
        m->deleter = delete_unversioned;
        t = &m->dl_tensor;
    }
    /* The lowest element sits at the buffer's first byte. */
    t->data = empty ? NULL : (void *)(uintptr_t)(cubuf_buffer_ptr(slice) - (uint64_t)sp.low);
    t->device = dev;
    t->ndim = o.ndim;
    t->dtype = o.dtype;
    t->shape = shape;
    t->strides = strides;
    t->byte_offset = 0;
    *out = mem;
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf_buffer_to_dlpack(cubuf_buffer_t *buf, const cubuf_dlpack_options_t *opts,
                                      DLManagedTensorVersioned **out)
{
    void *t = NULL;
    cubuf_status_t st = export_tensor(buf, opts, true, "cubuf_buffer_to_dlpack", out ? &t : NULL);
    if (st == CUBUF_SUCCESS) *out = t;
    return st;
}

cubuf_status_t cubuf_buffer_to_dlpack_unversioned(cubuf_buffer_t *buf,
                                                  const cubuf_dlpack_options_t *opts,
                                                  DLManagedTensor **out)
{
    void *t = NULL;
    cubuf_status_t st = export_tensor(buf, opts, false, "cubuf_buffer_to_dlpack_unversioned",
                                      out ? &t : NULL);
    if (st == CUBUF_SUCCESS) *out = t;
    return st;
}

/* ---- import ----------------------------------------------------------------- */

/* The owners' release functions: the producer's deleter, once. */
static void release_versioned(void *owner)
{
    DLManagedTensorVersioned *t = owner;
    if (t->deleter) t->deleter(t);
}

static void release_unversioned(void *owner)
{
    DLManagedTensor *t = owner;
    if (t->deleter) t->deleter(t);
}

/* A buffer over the enclosing byte range of `dl`, owning `owner`. */
static cubuf_status_t import_tensor(const DLTensor *dl, void *owner, cubuf_owner_release_fn release,
                                    const char *what, cubuf_buffer_t **out)
{
    DLDeviceType type = dl->device.device_type;
    if (type != kDLCUDA && type != kDLCUDAManaged && type != kDLCUDAHost && type != kDLCPU)
        return cubuf__fail(CUBUF_ERROR_NOT_SUPPORTED,
                           "%s: device type %d is not one cubuf takes (kDLCPU 1, kDLCUDA 2, "
                           "kDLCUDAHost 3, kDLCUDAManaged 13)", what, (int)type);
    size_t itemsize = 0;
    bool empty = false;
    span_t sp;
    cubuf_status_t st = check_dtype(what, dl->dtype, &itemsize);
    if (st == CUBUF_SUCCESS) st = check_shape(what, dl->ndim, dl->shape, &empty);
    if (st == CUBUF_SUCCESS)
        st = array_span(what, dl->ndim, dl->shape, dl->strides, itemsize, NULL, &sp);
    if (st != CUBUF_SUCCESS) return st;
    CUdeviceptr first = (CUdeviceptr)(uintptr_t)dl->data; /* element 0 */
    if (first && __builtin_add_overflow(first, dl->byte_offset, &first))
        return cubuf__fail(CUBUF_ERROR_OUT_OF_RANGE,
                           "%s: data %p + byte_offset %llu passes the end of the address space",
                           what, dl->data, (unsigned long long)dl->byte_offset);
    if (empty) return cubuf_buffer_wrap_external(first, 0, owner, release, out);
    CHECK_ARG(dl->data, "%s: data is NULL in a tensor with elements", what);
    uint64_t below = 0 - (uint64_t)sp.low; /* how far the range reaches below element 0 */
    if (below >= first)
        return cubuf__fail(CUBUF_ERROR_OUT_OF_RANGE,
                           "%s: the tensor's range starts %llu bytes below its element 0 at "
                           "0x%llx, at or below address 0", what, (unsigned long long)below,
                           (unsigned long long)first);
    CUdeviceptr start = first - below;
    if (sp.bytes > UINT64_MAX - start)
        return cubuf__fail(CUBUF_ERROR_OUT_OF_RANGE,
                           "%s: the tensor's range of %llu bytes from 0x%llx passes the end of "
                           "the address space", what, (unsigned long long)sp.bytes,
                           (unsigned long long)start);
    return cubuf_buffer_wrap_external(start, (size_t)sp.bytes, owner, release, out);
}

cubuf_status_t cubuf_buffer_from_dlpack(DLManagedTensorVersioned *t, cubuf_buffer_t **out)
{
    static const char what[] = "cubuf_buffer_from_dlpack";
    CHECK_ARG(t && out, "%s: NULL argument", what);
    if (t->version.major != DLPACK_MAJOR_VERSION)
        return cubuf__fail(CUBUF_ERROR_NOT_SUPPORTED,
                           "%s: the tensor is DLPack %u.%u; cubuf reads major version %d only",
                           what, (unsigned)t->version.major, (unsigned)t->version.minor,
                           DLPACK_MAJOR_VERSION);
    return import_tensor(&t->dl_tensor, t, release_versioned, what, out);
}

cubuf_status_t cubuf_buffer_from_dlpack_unversioned(DLManagedTensor *t, cubuf_buffer_t **out)
{
    static const char what[] = "cubuf_buffer_from_dlpack_unversioned";
    CHECK_ARG(t && out, "%s: NULL argument", what);
    return import_tensor(&t->dl_tensor, t, release_unversioned, what, out);
}

bool cubuf__dlpack_release_may_wait(const cubuf_buffer_t *root)
{
    if (root->owner_release == release_versioned) {
        const DLManagedTensorVersioned *t = root->owner;
        return t->deleter != delete_versioned || cubuf__inspect_close_may_wait(t->manager_ctx);
    }
    if (root->owner_release == release_unversioned) {
        const DLManagedTensor *t = root->owner;
        return t->deleter != delete_unversioned || cubuf__inspect_close_may_wait(t->manager_ctx);
    }
    return false;
}

bool cubuf_dlpack_is_read_only(const cubuf_buffer_t *buf)
{
    if (!buf || buf->closed) return false;
    const cubuf_buffer_t *root = buf->parent ? buf->parent : buf; /* parents are roots */
    if (root->owner_release != release_versioned) return false;
    const DLManagedTensorVersioned *t = root->owner;
    return (t->flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0;
}
