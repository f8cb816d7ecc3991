/* Zero-copy exchange: DLPack (__dlpack__, __dlpack_device__, from_dlpack)
 * with the array API's stream rules, and the CUDA Array Interface v3. */
#include "cubufpy.h"

#include "inspect.h" /* whether a tensor's deletion may wait */

/* ---- streams of the array API ------------------------------------------ */

/* The stream an array-API `stream` int names for CUDA memory: 1 legacy,
 * 2 per-thread, anything else a handle; -1 (no synchronization) gives
 * *none. The API disallows 0 as ambiguous; consumers that pass it anyway
 * mean CUDA's NULL stream, the legacy one, and get it. */
static int api_stream(PyObject *o, CUstream *out, bool *none)
{
    *none = false;
    *out = CU_STREAM_LEGACY;
    if (!o || o == Py_None) return 0;
    if (!PyLong_Check(o)) return cbp_stream(o, out);
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v == -1) return (*none = true), 0;
    if (v < 0) {
        PyErr_Format(PyExc_ValueError, "stream %lld is not a stream", v);
        return -1;
    }
    *out = (CUstream)(uintptr_t)v; /* 1 and 2 are CU_STREAM_LEGACY and CU_STREAM_PER_THREAD */
    return 0;
}

/* The array-API int for a stream (legacy 1, per-thread 2, else the handle). */
static PyObject *api_stream_int(CUstream s)
{
    if (cbp_is_legacy(s)) return PyLong_FromLong(1);
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)s);
}

static bool is_cuda_type(int32_t t) { return t == kDLCUDA || t == kDLCUDAManaged; }

/* ---- export ---------------------------------------------------------------- */

/* The deleters of the tensors __dlpack__ exports are cubuf's, wrapped: a
 * tensor's deletion releases its slice (manager_ctx), which may be the
 * buffer's last reference (its Buffer is gone) and so close it. A consumer
 * may delete the tensor holding the GIL (a capsule's destructor, a torch
 * tensor's), and a close that may wait must not hold it (the work it waits
 * for may need it: a Python host function): the wrapper lets it go then,
 * as the Buffer's destructor does. cubuf's own deleters, kept at the first
 * export, do the rest. */
static void (*_Atomic cubuf_delete_versioned)(DLManagedTensorVersioned *);
static void (*_Atomic cubuf_delete_unversioned)(DLManagedTensor *);

/* Releases a copy __dlpack__ made: a failure after the copy frees it here,
 * and a synchronous resource's free waits for the device, without the GIL. */
static void release_copy(cubuf_buffer_t *copy)
{
    if (!copy || !cubuf__inspect_close_may_wait(copy)) {
        cubuf_buffer_release(copy);
        return;
    }
    Py_BEGIN_ALLOW_THREADS
    cubuf_buffer_release(copy);
    Py_END_ALLOW_THREADS
}

static PyThreadState *release_gil_if_may_wait(void *slice)
{
    if (!cubuf__inspect_close_may_wait(slice) || !Py_IsInitialized() || !PyGILState_Check()) return NULL;
    return PyEval_SaveThread();
}

static void delete_versioned(DLManagedTensorVersioned *t)
{
    if (!t) return;
    PyThreadState *ts = release_gil_if_may_wait(t->manager_ctx);
    atomic_load_explicit(&cubuf_delete_versioned, memory_order_relaxed)(t);
    if (ts) PyEval_RestoreThread(ts);
}

static void delete_unversioned(DLManagedTensor *t)
{
    if (!t) return;
    PyThreadState *ts = release_gil_if_may_wait(t->manager_ctx);
    atomic_load_explicit(&cubuf_delete_unversioned, memory_order_relaxed)(t);
    if (ts) PyEval_RestoreThread(ts);
}

static void capsule_versioned_del(PyObject *cap)
{
    if (!PyCapsule_IsValid(cap, "dltensor_versioned")) return; /* consumed */
    DLManagedTensorVersioned *t = PyCapsule_GetPointer(cap, "dltensor_versioned");
    if (t && t->deleter) t->deleter(t);
}

static void capsule_unversioned_del(PyObject *cap)
{
    if (!PyCapsule_IsValid(cap, "dltensor")) return;
    DLManagedTensor *t = PyCapsule_GetPointer(cap, "dltensor");
    if (t && t->deleter) t->deleter(t);
}

/* __dlpack__(copy=True)'s copy of self on s into *out; 0, or -1 with a
 * BufferError (or the hold's error). A resource that rounds sizes up
 * (virtual memory) gives a larger copy: see export_part. */
static int export_copy(BufferObject *self, CUstream s, cubuf_buffer_t **out)
{
    static const char what[] = "__dlpack__(copy=True)";
    cubuf_status_t st;
    if (cbp_buffer_copy_to_new(self, s, NULL, out, &st, what) < 0) return -1;
    return st == CUBUF_SUCCESS ? 0 : (cbp_fail_as(PyExc_BufferError, st, what), -1);
}

/* The first n bytes of the copy *c, in place of it: the tensor is of the
 * buffer's bytes only. 0, or -1 with a BufferError (*c freed, NULL). */
static int export_part(cubuf_buffer_t **c, size_t n)
{
    if (cubuf_buffer_size(*c) == n) return 0;
    cubuf_buffer_t *part = NULL;
    const cubuf_status_t st = cubuf_buffer_slice(*c, 0, n, &part);
    release_copy(*c); /* the slice holds it now; on failure this frees it */
    *c = part;
    return st == CUBUF_SUCCESS ? 0 : (cbp_fail_as(PyExc_BufferError, st, "__dlpack__(copy=True)"), -1);
}

PyObject *cbp_buffer_dlpack(BufferObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"stream", "max_version", "dl_device", "copy"};
    PyObject *a[4];
    if (cbp_parse("__dlpack__", args, nargs, kwnames, names, 4, 0, 0, a) < 0 ||
        cbp_buffer_usable(self, "__dlpack__") < 0)
        return NULL;
    int32_t dt, did;
    cubuf_status_t st = cubuf_buffer_dlpack_device(self->buf, &dt, &did);
    if (st != CUBUF_SUCCESS) return cbp_fail_as(st == CUBUF_ERROR_CLOSED ? NULL : PyExc_BufferError, st, "__dlpack__");
    bool as_cpu = false; /* pinned memory asked for as the CPU's (numpy's dl_device) */
    if (a[2] && a[2] != Py_None) {
        int32_t want_t, want_id;
        if (!PyTuple_Check(a[2]))
            return PyErr_Format(PyExc_TypeError, "dl_device must be a (device_type, device_id) tuple, not %.200s",
                                Py_TYPE(a[2])->tp_name);
        if (!PyArg_ParseTuple(a[2], "ii:dl_device", &want_t, &want_id)) return NULL;
        as_cpu = dt == kDLCUDAHost && want_t == kDLCPU && want_id == 0;
        if (!as_cpu && (want_t != dt || want_id != did))
            return PyErr_Format(PyExc_BufferError, "__dlpack__: the buffer is on DLPack device (%d, %d), not (%d, %d)",
                                (int)dt, (int)did, (int)want_t, (int)want_id);
    }
    int copy = a[3] && a[3] != Py_None ? PyObject_IsTrue(a[3]) : 0;
    if (copy < 0) return NULL;
    bool versioned = false;
    if (a[1] && a[1] != Py_None) {
        if (!PyTuple_Check(a[1]) || PyTuple_GET_SIZE(a[1]) < 1)
            return PyErr_Format(PyExc_TypeError, "max_version must be a (major, minor) tuple");
        long major = PyLong_AsLong(PyTuple_GET_ITEM(a[1], 0));
        if (major == -1 && PyErr_Occurred()) return NULL;
        versioned = major >= 1;
    }
    /* The consumer's stream waits for the work queued through this buffer. */
    CUstream consumer = CU_STREAM_LEGACY;
    bool none = true;
    if (as_cpu && a[0] && a[0] != Py_None) { /* a CPU export takes no stream but -1 (the array API) */
        if (api_stream(a[0], &consumer, &none) < 0) return NULL;
        if (!none)
            return PyErr_Format(PyExc_BufferError, "__dlpack__: an export as the CPU's (dl_device=(1, 0)) "
                                                   "takes stream None or -1");
    }
    const bool host_consumer = dt == kDLCUDAHost && (!a[0] || a[0] == Py_None);
    if (!host_consumer && (is_cuda_type(dt) || dt == kDLCUDAHost)) { /* a CUDA consumer of pinned memory gives its stream */
        if (api_stream(a[0], &consumer, &none) < 0) return NULL;
        if (!none && cbp_stream_handoff(cbp_buffer_stream_device(self), self->work_stream, consumer) < 0)
            return NULL;
    }
    /* The work stream as it is now: the copy and a host consumer's wait use
     * it while another thread may replace it (the copy may run without the
     * GIL), its Python object kept alive until they are done. The size too:
     * another thread may close a based view meanwhile. */
    const int dev = cbp_buffer_stream_device(self);
    const CUstream ws = self->work_stream;
    PyObject *keep = Py_XNewRef(self->work_ref);
    const size_t n = cubuf_buffer_size(self->buf);
    cubuf_buffer_t *copied = NULL;
    int rc = copy ? export_copy(self, none ? ws : consumer, &copied) : 0;
    /* A host consumer of pinned memory (stream None: numpy, the CPU) reads it
     * as soon as it has the tensor and cannot wait on a stream: the work
     * queued through the buffer completes first. So does a copy for the CPU
     * (dl_device=(1, 0)), whose stream -1 cannot cover work of ours. */
    if (rc == 0 && (host_consumer || (copied && as_cpu)))
        rc = cbp_stream_sync(dev, ws, PyExc_BufferError, "__dlpack__");
    /* That wait let the GIL go: a close that waits may have claimed the
     * buffer meanwhile and be freeing it now (one that finished has closed
     * it, which the export below refuses). */
    if (rc == 0 && !copied && cbp_buffer_usable(self, "__dlpack__") < 0) rc = -1;
    /* A copy for a consumer without a stream (-1, the host) was made on ws,
     * and the tensor may outlive ws's Python object and so the stream: it
     * is freed on the legacy stream instead (made to wait for ws), unless
     * ws captures. Before slicing: the slice's free is its root's. */
    if (rc == 0 && copied && none) rc = cbp_free_on_legacy(dev, ws, copied) < 0 ? -1 : 0;
    if (rc == 0 && copied) rc = export_part(&copied, n);
    if (rc < 0) release_copy(copied);
    Py_XDECREF(keep); /* after the release: a copy not moved is freed on ws */
    if (rc < 0) return NULL;
    cubuf_buffer_t *src = copied ? copied : self->buf;
    PyObject *cap = NULL;
    /* A read-only import stays read-only (an unversioned tensor cannot say
     * so: cubuf refuses it, a BufferError). */
    cubuf_dlpack_options_t ro = CUBUF_DLPACK_OPTIONS_INIT;
    ro.read_only = true;
    const cubuf_dlpack_options_t *opts = !copy && cbp_buffer_read_only(self) ? &ro : NULL;
    if (versioned) {
        DLManagedTensorVersioned *t;
        st = cubuf_buffer_to_dlpack(src, opts, &t);
        if (st == CUBUF_SUCCESS) {
            if (copy) t->flags |= DLPACK_FLAG_BITMASK_IS_COPIED;
            if (as_cpu) t->dl_tensor.device = (DLDevice){kDLCPU, 0};
            atomic_store_explicit(&cubuf_delete_versioned, t->deleter, memory_order_relaxed);
            t->deleter = delete_versioned;
            if (!(cap = PyCapsule_New(t, "dltensor_versioned", capsule_versioned_del))) t->deleter(t);
        }
    } else {
        DLManagedTensor *t;
        st = cubuf_buffer_to_dlpack_unversioned(src, opts, &t);
        if (st == CUBUF_SUCCESS) {
            if (as_cpu) t->dl_tensor.device = (DLDevice){kDLCPU, 0};
            atomic_store_explicit(&cubuf_delete_unversioned, t->deleter, memory_order_relaxed);
            t->deleter = delete_unversioned;
            if (!(cap = PyCapsule_New(t, "dltensor", capsule_unversioned_del))) t->deleter(t);
        }
    }
    release_copy(copied); /* the tensor holds the copy now; on failure this frees it */
    if (st != CUBUF_SUCCESS) return cbp_fail_as(st == CUBUF_ERROR_CLOSED ? NULL : PyExc_BufferError, st, "__dlpack__");
    return cap;
}

PyObject *cbp_buffer_dlpack_device(BufferObject *self, PyObject *unused)
{
    int32_t dt, did;
    cubuf_status_t st = cubuf_buffer_dlpack_device(self->buf, &dt, &did);
    if (st != CUBUF_SUCCESS) return cbp_fail_as(st == CUBUF_ERROR_CLOSED ? NULL : PyExc_BufferError, st, "__dlpack_device__");
    return Py_BuildValue("(ii)", (int)dt, (int)did);
}

/* ---- import ---------------------------------------------------------------- */

PyObject *cbp_from_dlpack(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"x", "stream"};
    PyObject *a[2];
    if (cbp_parse("from_dlpack", args, nargs, kwnames, names, 2, 1, 1u, a) < 0) return NULL;
    if (kwnames && a[0] && PyTuple_GET_SIZE(kwnames) > 0 && nargs == 0)
        return PyErr_Format(PyExc_TypeError, "from_dlpack() takes x as a positional argument");
    CUstream consumer = CU_STREAM_LEGACY;
    if (a[1] && a[1] != Py_None && cbp_stream(a[1], &consumer) < 0) return NULL;
    PyObject *dev = PyObject_CallMethod(a[0], "__dlpack_device__", NULL);
    if (!dev) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "from_dlpack: %.200s is not a DLPack producer (no __dlpack_device__)",
                         Py_TYPE(a[0])->tp_name);
        }
        return NULL;
    }
    int dt = 0, did = 0;
    int ok = PyTuple_Check(dev) ? PyArg_ParseTuple(dev, "ii", &dt, &did)
                                : (PyErr_Format(PyExc_TypeError, "from_dlpack: __dlpack_device__ must return a "
                                                "(device_type, device_id) tuple, not %.200s", Py_TYPE(dev)->tp_name), 0);
    Py_DECREF(dev);
    if (!ok) return NULL;
    PyObject *stream_arg = is_cuda_type(dt) ? api_stream_int(consumer) : Py_NewRef(Py_None);
    if (!stream_arg) return NULL;
    PyObject *meth = PyObject_GetAttrString(a[0], "__dlpack__");
    if (!meth) {
        Py_DECREF(stream_arg);
        return NULL;
    }
    /* Ask for a versioned tensor; a producer older than DLPack 1.0 has no
     * max_version keyword and gets the call without it. */
    PyObject *max_version = Py_BuildValue("(ii)", DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION);
    PyObject *kw = Py_BuildValue("(ss)", "stream", "max_version");
    PyObject *cap = NULL;
    if (max_version && kw) {
        PyObject *callargs[2] = {stream_arg, max_version};
        cap = PyObject_Vectorcall(meth, callargs, 0, kw);
        if (!cap && PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyObject *kw1 = Py_BuildValue("(s)", "stream");
            if (kw1) cap = PyObject_Vectorcall(meth, callargs, 0, kw1);
            Py_XDECREF(kw1);
        }
    }
    Py_XDECREF(max_version);
    Py_XDECREF(kw);
    Py_DECREF(meth);
    Py_DECREF(stream_arg);
    if (!cap) return NULL;
    cubuf_buffer_t *buf = NULL;
    cubuf_status_t st;
    if (PyCapsule_IsValid(cap, "dltensor_versioned")) {
        st = cubuf_buffer_from_dlpack(PyCapsule_GetPointer(cap, "dltensor_versioned"), &buf);
        if (st == CUBUF_SUCCESS) PyCapsule_SetName(cap, "used_dltensor_versioned");
    } else if (PyCapsule_IsValid(cap, "dltensor")) {
        st = cubuf_buffer_from_dlpack_unversioned(PyCapsule_GetPointer(cap, "dltensor"), &buf);
        if (st == CUBUF_SUCCESS) PyCapsule_SetName(cap, "used_dltensor");
    } else {
        Py_DECREF(cap);
        return PyErr_Format(PyExc_TypeError, "from_dlpack: __dlpack__ did not return a DLPack capsule");
    }
    Py_DECREF(cap); /* a capsule that was not consumed deletes its tensor */
    if (st != CUBUF_SUCCESS) return cbp_fail_as(st == CUBUF_ERROR_NOT_SUPPORTED ? PyExc_BufferError : NULL, st, "from_dlpack");
    /* The imported buffer belongs to no context, so default streams would
     * need one current; Python code rarely has one. Hand out a view of it
     * that belongs to the device's primary context (host memory: device
     * 0's) and depends on it as a slice does: the tensor lives until the
     * view is closed or released. Managed memory: DLPack gives it device_id
     * 0 whichever device made it, so the device the driver reports for the
     * memory (the buffer's device_id) picks the context. */
    if (cubuf_buffer_size(buf) > 0) {
        int ordinal = dt == kDLCUDA ? did : 0;
        if (dt == kDLCUDAManaged) ordinal = cubuf_buffer_device_id(buf) >= 0 ? cubuf_buffer_device_id(buf) : did;
        cubuf_context_t *ctx = cbp_device_context(ordinal);
        cubuf_buffer_t *view = NULL;
        st = ctx ? cubuf_context_foreign_buffer(ctx, cubuf_buffer_ptr(buf), cubuf_buffer_size(buf), buf, NULL, NULL, &view)
                 : CUBUF_SUCCESS;
        cubuf_buffer_release(buf); /* the view holds it now; on failure this closes it (the tensor's deleter) */
        if (!ctx) return NULL;
        if (st != CUBUF_SUCCESS) return cbp_fail(st, "from_dlpack");
        buf = view;
    }
    return cbp_buffer_new(&cbp_Buffer_Type, buf, NULL, NULL, consumer, a[1]);
}

/* ---- CUDA Array Interface --------------------------------------------------- */

PyObject *cbp_buffer_cai(BufferObject *self, void *closure)
{
    if (cbp_buffer_usable(self, "__cuda_array_interface__") < 0) return NULL;
    if (cubuf_buffer_is_closed(self->buf)) {
        PyErr_SetString(PyExc_AttributeError, "__cuda_array_interface__: the buffer is closed");
        return NULL;
    }
    if (!cubuf_buffer_is_device_accessible(self->buf)) {
        PyErr_SetString(PyExc_AttributeError, "__cuda_array_interface__: the buffer is not device accessible");
        return NULL;
    }
    PyObject *stream = api_stream_int(self->work_stream);
    if (!stream) return NULL;
    PyObject *d = Py_BuildValue("{s(n)sss(KO)sisOsN}", "shape", (Py_ssize_t)cubuf_buffer_size(self->buf), "typestr",
                                "|u1", "data", (unsigned long long)cubuf_buffer_ptr(self->buf),
                                cbp_buffer_read_only(self) ? Py_True : Py_False, "version", 3, "strides",
                                Py_None, "stream", stream);
    return d;
}

static int cai_ints(PyObject *t, const char *what, int64_t *out, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(t, i));
        if (v == -1 && PyErr_Occurred()) return -1;
        out[i] = v;
    }
    return 0;
}

PyObject *cbp_buffer_from_cai(cubuf_context_t *ctx, PyObject *obj, bool *handled)
{
    *handled = false;
    PyObject *cai = PyObject_GetAttrString(obj, "__cuda_array_interface__");
    if (!cai) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) PyErr_Clear();
        else *handled = true;
        return NULL;
    }
    *handled = true;
    PyObject *r = NULL;
    int64_t shape[64], strides[64];
    if (!PyDict_Check(cai)) {
        PyErr_SetString(PyExc_TypeError, "__cuda_array_interface__ must be a dict");
        goto out;
    }
    /* Our own copy: the items below are borrowed, and the conversions run
     * Python code (__int__, __index__, __cuda_stream__) that could change
     * the producer's dict and free them. */
    Py_SETREF(cai, PyDict_Copy(cai));
    if (!cai) return NULL;
    PyObject *data = PyDict_GetItemString(cai, "data"), *sh = PyDict_GetItemString(cai, "shape");
    PyObject *ts = PyDict_GetItemString(cai, "typestr"), *st_ = PyDict_GetItemString(cai, "strides");
    PyObject *mask = PyDict_GetItemString(cai, "mask"), *stream = PyDict_GetItemString(cai, "stream");
    if (!data || !PyTuple_Check(data) || PyTuple_GET_SIZE(data) != 2 || !sh || !PyTuple_Check(sh) || !ts ||
        !PyUnicode_Check(ts)) {
        PyErr_SetString(PyExc_ValueError, "__cuda_array_interface__ lacks data, shape or typestr");
        goto out;
    }
    if (mask && mask != Py_None) {
        PyErr_SetString(PyExc_ValueError, "__cuda_array_interface__ with a mask is not supported");
        goto out;
    }
    Py_ssize_t ndim = PyTuple_GET_SIZE(sh);
    if (ndim > 64 || (st_ && st_ != Py_None && (!PyTuple_Check(st_) || PyTuple_GET_SIZE(st_) != ndim))) {
        PyErr_SetString(PyExc_ValueError, "__cuda_array_interface__: bad shape or strides");
        goto out;
    }
    const char *tss = PyUnicode_AsUTF8(ts);
    long itemsize = tss && strlen(tss) >= 3 ? strtol(tss + 2, NULL, 10) : 0;
    if (itemsize <= 0) {
        PyErr_Format(PyExc_ValueError, "__cuda_array_interface__: bad typestr %R", ts);
        goto out;
    }
    const int read_only = PyObject_IsTrue(PyTuple_GET_ITEM(data, 1));
    if (read_only < 0) goto out;
    unsigned long long ptr = 0;
    if (PyTuple_GET_ITEM(data, 0) != Py_None && cbp_handle(PyTuple_GET_ITEM(data, 0), "data pointer", &ptr) < 0)
        goto out;
    if (cai_ints(sh, "shape", shape, ndim) < 0) goto out;
    if (st_ && st_ != Py_None) {
        if (cai_ints(st_, "strides", strides, ndim) < 0) goto out;
    } else {
        int64_t s = itemsize;
        for (Py_ssize_t i = ndim - 1; i >= 0; i--) {
            strides[i] = s;
            if (__builtin_mul_overflow(s, shape[i] > 0 ? shape[i] : 1, &s)) {
                PyErr_SetString(PyExc_ValueError, "__cuda_array_interface__: the array's span overflows 64 bits");
                goto out;
            }
        }
    }
    /* v3: the producer's work on `stream` is made visible on the context's
     * legacy stream, which the view's work uses. */
    if (stream && stream != Py_None) {
        CUstream producer;
        bool none;
        if (api_stream(stream, &producer, &none) < 0) goto out;
        int dev = 0;
        cubuf_context_device(ctx, &dev);
        if (!none && cbp_stream_handoff(dev, producer, CU_STREAM_LEGACY) < 0) goto out;
    }
    cubuf_buffer_t *buf;
    Py_INCREF(obj);
    cubuf_status_t st = cubuf_context_buffer_from_strided(ctx, (CUdeviceptr)ptr, (int)ndim, shape, strides,
                                                          (size_t)itemsize, NULL, obj, cbp_owner_release, &buf);
    if (st != CUBUF_SUCCESS) {
        Py_DECREF(obj);
        cbp_fail(st, "Context.buffer_from_object");
        goto out;
    }
    r = cbp_buffer_new(&cbp_Buffer_Type, buf, NULL, obj, CU_STREAM_LEGACY, NULL);
    if (r) ((BufferObject *)r)->read_only = read_only;
out:
    Py_DECREF(cai);
    return r;
}
