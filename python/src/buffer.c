/* cubuf.Buffer and cubuf.VirtualMemoryBuffer (cuda.core's Buffer page). */
#include "cubufpy.h"

#include "inspect.h"
#include "internal.h" /* the capture query: which exception a refused copy gets */

void cbp_owner_release(void *owner)
{
    /* The C buffer may drop its owner on any thread (a DLPack consumer's
     * deleter); nothing can be released once the interpreter is gone. */
    if (!owner || !Py_IsInitialized()) return;
    PyGILState_STATE g = PyGILState_Ensure();
    Py_DECREF((PyObject *)owner);
    PyGILState_Release(g);
}

void cbp_export_release(void *export)
{
    if (!export || !Py_IsInitialized()) return; /* as cbp_owner_release */
    PyGILState_STATE g = PyGILState_Ensure();
    PyBuffer_Release(export);
    PyMem_Free(export);
    PyGILState_Release(g);
}

/* Objects of the two exact buffer types, kept at their dealloc for the
 * next buffer (under the GIL; a free-threaded build keeps none): an
 * allocate + close then makes no Python allocation and no collector
 * bookkeeping besides tracking. Subclasses' objects are never kept. */
#ifndef Py_GIL_DISABLED
#define SPARE_MAX 32
static BufferObject *spares[SPARE_MAX];
static int n_spares;
#endif

static bool exact_buffer_type(PyTypeObject *type)
{
    return type == &cbp_Buffer_Type || type == &cbp_VirtualMemoryBuffer_Type;
}

void cbp_buffer_drop_spares(void)
{
#ifndef Py_GIL_DISABLED
    while (n_spares) PyObject_GC_Del(spares[--n_spares]);
#endif
}

/* A new reference to a Python stream object; NULL for none, None or an int
 * (a handle cubuf cannot keep alive). */
static PyObject *stream_object_ref(PyObject *o)
{
    return o && o != Py_None && !PyLong_Check(o) ? Py_NewRef(o) : NULL;
}

PyObject *cbp_buffer_new(PyTypeObject *type, cubuf_buffer_t *buf, PyObject *mr, PyObject *owner,
                         CUstream work_stream, PyObject *stream)
{
    BufferObject *b;
    const bool exact = exact_buffer_type(type);
#ifndef Py_GIL_DISABLED
    if (n_spares && exact)
        b = (BufferObject *)PyObject_Init((PyObject *)spares[--n_spares], type);
    else
#endif
    /* A subclass's object comes zeroed (its slots and dict) and tracked. */
    b = exact ? PyObject_GC_New(BufferObject, type) : (BufferObject *)type->tp_alloc(type, 0);
    if (!b) {
        cubuf_buffer_release(buf);
        return NULL;
    }
    b->buf = buf;
    b->mr = Py_XNewRef(mr);
    b->owner = Py_XNewRef(owner);
    b->ipc = NULL;
    b->stream_ref = stream_object_ref(stream);
    b->work_stream = work_stream;
    b->work_ref = stream_object_ref(stream);
    atomic_store_explicit(&b->closing, false, memory_order_relaxed);
    b->read_only = false;
    b->weakreflist = NULL;
    if (exact) PyObject_GC_Track(b);
    return (PyObject *)b;
}

PyObject *cbp_buffer_set_work(PyObject *buffer, CUstream s, PyObject *sobj)
{
    if (!buffer) return NULL;
    BufferObject *b = (BufferObject *)buffer;
    b->work_stream = s;
    Py_XSETREF(b->work_ref, stream_object_ref(sobj));
    return buffer;
}

PyObject *cbp_buffer_keep_stream(PyObject *buffer, PyObject *o)
{
    if (buffer && o) Py_XSETREF(((BufferObject *)buffer)->stream_ref, stream_object_ref(o));
    return buffer;
}

static PyObject *Buffer_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyErr_SetString(PyExc_RuntimeError,
                    "Buffer objects cannot be instantiated directly: use a memory resource's allocate(), "
                    "Buffer.from_handle() or a Context");
    return NULL;
}

/* Whether the C buffer's own reference to the owner (taken for
 * cbp_owner_release) is this object's alone: the buffer is open, held by
 * this object only (no slice, no DLPack tensor) and holds self->owner. The
 * GC then sees that reference through this object too, so that a cycle
 * through the owner (an owner that holds its Buffer) is collected. Read
 * under the GIL: the C references only other holders add are not there,
 * and one a consumer drops meanwhile at worst leaves the cycle for the
 * next collection. */
static bool owner_ref_is_ours(const BufferObject *self)
{
    if (!self->owner || !self->buf || cubuf__inspect_buffer_refs(self->buf) != 1) return false;
    cubuf_owner_release_fn release;
    void *held = cubuf__inspect_buffer_owner(self->buf, &release);
    /* an export (buffer_from_object of host memory) holds the exporter through its obj */
    if (release == cbp_export_release) return ((Py_buffer *)held)->obj == self->owner;
    return held == self->owner && release == cbp_owner_release;
}

static int Buffer_traverse(BufferObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->mr);
    Py_VISIT(self->owner);
    if (owner_ref_is_ours(self)) Py_VISIT(self->owner);
    Py_VISIT(self->ipc);
    Py_VISIT(self->work_ref);
    Py_VISIT(self->stream_ref); /* not cleared by Buffer_clear (the dealloc needs it), but a cycle
                                   through it is broken by clearing the stream object */
    return 0;
}

static int Buffer_clear(BufferObject *self)
{
    /* The close releases the C buffer's reference to the owner (a view's
     * close frees nothing else); the object stays a closed Buffer. */
    if (owner_ref_is_ours(self)) (void)cubuf_buffer_close(self->buf);
    Py_CLEAR(self->mr);
    Py_CLEAR(self->ipc);
    Py_CLEAR(self->owner);
    Py_CLEAR(self->work_ref); /* a garbage buffer's work stream is asked for no more */
    return 0;
}

int cbp_buffer_stream_device(const BufferObject *self)
{
    int dev = cubuf_buffer_device_id(self->buf);
    if (dev < 0) /* pinned host memory: its resource's device (the first without one) */
        dev = self->mr && cbp_Resource_Check(self->mr) ? ((ResourceObject *)self->mr)->device : 0;
    return dev < 0 ? 0 : dev;
}

/* The buffer outlives this object (a DLPack consumer holds it: its close
 * was refused as busy), and its deallocation stream is a Python stream
 * object about to be dropped (and destroyed): the free moves to the
 * legacy default stream of the buffer's context, made to wait for the
 * work queued on that stream so far. */
static void free_later_on_legacy(BufferObject *self)
{
    PyObject *exc_type, *exc, *tb;
    PyErr_Fetch(&exc_type, &exc, &tb); /* a dealloc leaves the error state as it found it */
    CUstream s = NULL;
    int rc = cbp_stream(self->stream_ref, &s);
    if (rc == 0) rc = cbp_free_on_legacy(cbp_buffer_stream_device(self), s, self->buf);
    if (rc == 0) {
        PyErr_Restore(exc_type, exc, tb);
        return;
    }
    PyErr_Clear();
    if (PyErr_WarnFormat(PyExc_RuntimeWarning, 1,
                         "a buffer exported through DLPack outlives its Python object and its stream; "
                         "its memory is freed on a stream that may be gone (%s)",
                         rc > 0 ? "the stream captures" : cubuf_last_error()) < 0)
        PyErr_WriteUnraisable(NULL); /* warnings as errors: a dealloc cannot raise */
    PyErr_Restore(exc_type, exc, tb);
}

static void Buffer_dealloc(BufferObject *self)
{
    PyObject_GC_UnTrack(self);
    if (self->weakreflist) PyObject_ClearWeakRefs((PyObject *)self);
    /* A close that may wait lets the GIL go, as Buffer.close does (work it
     * waits for may need it: a Python host function on the stream); nothing
     * else can reach this object meanwhile. */
    bool wait = self->buf && cubuf__inspect_close_may_wait(self->buf);
    PyThreadState *ts;
    if (self->stream_ref && !cubuf_buffer_is_closed(self->buf)) {
        ts = wait ? PyEval_SaveThread() : NULL;
        const cubuf_status_t st = cubuf_buffer_close(self->buf);
        if (wait) PyEval_RestoreThread(ts);
        if (st == CUBUF_ERROR_BUSY) free_later_on_legacy(self);
        wait = cubuf__inspect_close_may_wait(self->buf); /* false once closed */
    }
    ts = wait ? PyEval_SaveThread() : NULL;
    cubuf_buffer_release(self->buf); /* closes an open buffer on its deallocation stream */
    if (wait) PyEval_RestoreThread(ts);
    self->buf = NULL;                /* gone (maybe freed): Buffer_clear must not inspect it */
    Buffer_clear(self);
    Py_CLEAR(self->stream_ref); /* only now: the release above may have used the stream */
#ifndef Py_GIL_DISABLED
    if (n_spares < SPARE_MAX && exact_buffer_type(Py_TYPE(self))) {
        spares[n_spares++] = self; /* untracked, its references dropped */
        return;
    }
#endif
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* ---- methods ------------------------------------------------------------ */

static PyObject *Buffer_close(BufferObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *sobj = NULL;
    CUstream s = NULL;
    if (nargs || kwnames) {
        static const char *const names[] = {"stream"};
        PyObject *a[1];
        if (cbp_parse("close", args, nargs, kwnames, names, 1, 1, 0, a) < 0) return NULL;
        sobj = a[0] && a[0] != Py_None ? a[0] : NULL;
        if (sobj && cbp_stream(sobj, &s) < 0) return NULL;
    }
    /* A close may block: synchronous resources and virtual memory synchronize
     * streams before they free. Such a close runs without the GIL, so that
     * other threads (the one whose work it waits for, perhaps) go on
     * meanwhile; a stream-ordered pool's (cuMemFreeAsync) keeps it, which
     * saves ~40 ns per close. The C close runs no Python code without taking
     * the GIL itself (owner releases and warnings take it). Two closes of one
     * buffer must not run at once, which the GIL no longer prevents: a close
     * that lets it go claims the buffer (an atomic flag), and a second close
     * meanwhile is refused. On a free-threaded build every close claims. */
    const bool wait = cubuf__inspect_close_may_wait(self->buf);
#ifdef Py_GIL_DISABLED
    const bool claim = true; /* no GIL keeps two closes apart: each claims the buffer */
#else
    const bool claim = wait;
#endif
    bool idle = false;
    if (claim ? !atomic_compare_exchange_strong_explicit(&self->closing, &idle, true, memory_order_acquire,
                                                          memory_order_relaxed)
              : atomic_load_explicit(&self->closing, memory_order_relaxed))
        return PyErr_Format(PyExc_RuntimeError, "Buffer.close: the buffer is being closed on another thread");
    PyThreadState *ts = wait ? PyEval_SaveThread() : NULL;
    cubuf_status_t st = sobj ? cubuf_buffer_close_on(self->buf, s) : cubuf_buffer_close(self->buf);
    if (wait) PyEval_RestoreThread(ts);
    if (claim) atomic_store_explicit(&self->closing, false, memory_order_release);
    if (st != CUBUF_SUCCESS) return cbp_fail(st, "Buffer.close");
    if (sobj) cbp_buffer_keep_stream((PyObject *)self, sobj);
    Py_RETURN_NONE;
}

/* The exception for a refused copy: options with the legacy stream or a
 * capturing stream are a TypeError on the page; the rest by status. */
static PyObject *copy_failed(cubuf_status_t st, CUstream s, bool with_options, const char *what)
{
    PyObject *exc = NULL;
    if (st == CUBUF_ERROR_INVALID_ARGUMENT && with_options) {
        CUstreamCaptureStatus cs = CU_STREAM_CAPTURE_STATUS_NONE;
        if (cbp_is_legacy(s) ||
            (cubuf__driver_load() == CUBUF_SUCCESS && cubuf__stream_capture_status(s, NULL, &cs) == CUBUF_SUCCESS &&
             cs != CU_STREAM_CAPTURE_STATUS_NONE))
            exc = PyExc_TypeError;
    }
    return cbp_fail_as(exc, st, what);
}

static int copy_args(const char *fname, const char *other_name, PyObject *const *args, Py_ssize_t nargs,
                     PyObject *kwnames, bool need_other, PyObject **other, CUstream *s, const cubuf_copy_options_t **opts,
                     PyObject **stream_obj)
{
    const char *const names[] = {other_name, "stream", "options"};
    PyObject *a[3];
    if (cbp_parse(fname, args, nargs, kwnames, names, 3, 1, need_other ? 3u : 2u, a) < 0) return -1;
    *other = a[0] && a[0] != Py_None ? a[0] : NULL;
    if (*other && !cbp_Buffer_Check(*other)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a cubuf.Buffer, not %.200s", fname, Py_TYPE(*other)->tp_name);
        return -1;
    }
    if (need_other && !*other) {
        PyErr_Format(PyExc_TypeError, "%s: the source must be a cubuf.Buffer, not None", fname);
        return -1;
    }
    if (cbp_stream(a[1], s) < 0) return -1;
    *stream_obj = a[1];
    return cbp_copy_options(a[2], opts);
}

static PyObject *Buffer_copy_to(BufferObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *dst, *sobj;
    CUstream s;
    const cubuf_copy_options_t *opts;
    if (copy_args("copy_to", "dst", args, nargs, kwnames, false, &dst, &s, &opts, &sobj) < 0) return NULL;
    cubuf_status_t st;
    if (cbp_buffer_usable(self, "Buffer.copy_to") < 0 ||
        (dst && cbp_buffer_usable((BufferObject *)dst, "Buffer.copy_to") < 0))
        return NULL;
    if (dst) {
        st = cubuf_buffer_copy_to(self->buf, ((BufferObject *)dst)->buf, s, opts);
        if (st != CUBUF_SUCCESS) return copy_failed(st, s, opts, "Buffer.copy_to");
        cbp_buffer_set_work((PyObject *)self, s, sobj);
        cbp_buffer_set_work(dst, s, sobj);
        return Py_NewRef(dst);
    }
    cubuf_buffer_t *out;
    if (cbp_buffer_copy_to_new(self, s, opts, &out, &st, "Buffer.copy_to") < 0) return NULL;
    if (st != CUBUF_SUCCESS) return copy_failed(st, s, opts, "Buffer.copy_to");
    cbp_buffer_set_work((PyObject *)self, s, sobj);
    return cbp_buffer_new(Py_TYPE(self), out, self->mr, NULL, s, sobj);
}

static PyObject *Buffer_copy_from(BufferObject *self, PyObject *const *args, Py_ssize_t nargs,
                                  PyObject *kwnames)
{
    PyObject *src, *sobj;
    CUstream s;
    const cubuf_copy_options_t *opts;
    if (copy_args("copy_from", "src", args, nargs, kwnames, true, &src, &s, &opts, &sobj) < 0) return NULL;
    if (cbp_buffer_usable(self, "Buffer.copy_from") < 0 || cbp_buffer_usable((BufferObject *)src, "Buffer.copy_from") < 0)
        return NULL;
    cubuf_status_t st = cubuf_buffer_copy_from(self->buf, ((BufferObject *)src)->buf, s, opts);
    if (st != CUBUF_SUCCESS) return copy_failed(st, s, opts, "Buffer.copy_from");
    cbp_buffer_set_work((PyObject *)self, s, sobj);
    cbp_buffer_set_work(src, s, sobj);
    Py_RETURN_NONE;
}

static PyObject *Buffer_fill(BufferObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"value", "stream"};
    PyObject *a[2];
    if (cbp_parse("fill", args, nargs, kwnames, names, 2, 1, 3u, a) < 0) return NULL;
    if (cbp_buffer_usable(self, "Buffer.fill") < 0) return NULL;
    CUstream s;
    cubuf_status_t st;
    if (PyLong_Check(a[0])) {
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(a[0], &overflow);
        if (v == -1 && PyErr_Occurred()) return NULL;
        if (overflow || v < 0 || v > 255)
            return PyErr_Format(PyExc_OverflowError, "fill value %R is outside [0, 256)", a[0]);
        if (cbp_stream(a[1], &s) < 0) return NULL;
        st = cubuf_buffer_fill_byte(self->buf, v, s);
    } else if (PyObject_CheckBuffer(a[0])) {
        Py_buffer view;
        if (PyObject_GetBuffer(a[0], &view, PyBUF_SIMPLE) < 0) return NULL;
        if (view.len != 1 && view.len != 2 && view.len != 4) {
            PyErr_Format(PyExc_ValueError, "fill value must be 1, 2 or 4 bytes long, not %zd", view.len);
            PyBuffer_Release(&view);
            return NULL;
        }
        if (cbp_stream(a[1], &s) < 0) {
            PyBuffer_Release(&view);
            return NULL;
        }
        st = cubuf_buffer_fill(self->buf, view.buf, (size_t)view.len, s);
        PyBuffer_Release(&view);
    } else {
        return PyErr_Format(PyExc_TypeError, "fill value must be an int or support the buffer protocol, not %.200s",
                            Py_TYPE(a[0])->tp_name);
    }
    if (st != CUBUF_SUCCESS) return cbp_fail(st, "Buffer.fill");
    cbp_buffer_set_work((PyObject *)self, s, a[1]);
    Py_RETURN_NONE;
}

static PyObject *Buffer_set_deallocation_stream(BufferObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *arg;
    if (cbp_one_arg("set_deallocation_stream", "stream", args, nargs, kwnames, &arg) < 0 ||
        cbp_buffer_usable(self, "Buffer.set_deallocation_stream") < 0)
        return NULL;
    CUstream s;
    if (cbp_stream(arg, &s) < 0) return NULL;
    cubuf_status_t st = cubuf_buffer_set_deallocation_stream(self->buf, s);
    if (st == CUBUF_ERROR_INVALID_ARGUMENT) return cbp_fail_as(PyExc_RuntimeError, st, "Buffer.set_deallocation_stream");
    if (st != CUBUF_SUCCESS) return cbp_fail(st, "Buffer.set_deallocation_stream");
    cbp_buffer_keep_stream((PyObject *)self, arg);
    Py_RETURN_NONE;
}

static PyObject *Buffer_from_handle(PyObject *unused, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"ptr", "size", "mr", "owner", "stream"};
    PyObject *a[5];
    if (cbp_parse("from_handle", args, nargs, kwnames, names, 5, 4, 3u, a) < 0) return NULL;
    unsigned long long ptr;
    size_t size;
    if (cbp_handle(a[0], "ptr", &ptr) < 0 || cbp_size(a[1], "size", &size) < 0) return NULL;
    PyObject *mr = a[2] && a[2] != Py_None ? a[2] : NULL;
    PyObject *owner = a[3] && a[3] != Py_None ? a[3] : NULL;
    if (mr && owner) return PyErr_Format(PyExc_ValueError, "from_handle: owner and mr cannot be given together");
    if (mr && !cbp_Resource_Check(mr))
        return PyErr_Format(PyExc_TypeError, "from_handle: mr must be a cubuf memory resource, not %.200s",
                            Py_TYPE(mr)->tp_name);
    CUstream s = CU_STREAM_LEGACY;
    if (a[4] && a[4] != Py_None && cbp_stream(a[4], &s) < 0) return NULL;
    cubuf_buffer_t *buf;
    cubuf_status_t st;
    if (mr) {
        st = cubuf_buffer_wrap((CUdeviceptr)ptr, size, ((ResourceObject *)mr)->res, s, &buf);
    } else if (owner) {
        Py_INCREF(owner); /* the C buffer's reference, dropped by cbp_owner_release */
        st = cubuf_buffer_wrap_external((CUdeviceptr)ptr, size, owner, cbp_owner_release, &buf);
        if (st != CUBUF_SUCCESS) Py_DECREF(owner);
    } else {
        st = cubuf_buffer_view((CUdeviceptr)ptr, size, &buf);
    }
    if (st != CUBUF_SUCCESS) return cbp_fail(st, "Buffer.from_handle");
    return cbp_buffer_new(&cbp_Buffer_Type, buf, mr, owner, s, a[4]);
}

static PyObject *Buffer_from_ipc_descriptor(PyObject *cls, PyObject *const *args, Py_ssize_t nargs,
                                            PyObject *kwnames)
{
    static const char *const names[] = {"mr", "ipc_descriptor", "stream"};
    PyObject *a[3];
    if (cbp_parse("from_ipc_descriptor", args, nargs, kwnames, names, 3, 2, 7u, a) < 0) return NULL;
    if (!cbp_Resource_Check(a[0]))
        return PyErr_Format(PyExc_TypeError, "from_ipc_descriptor: mr must be a cubuf memory resource, not %.200s",
                            Py_TYPE(a[0])->tp_name);
    if (!PyObject_TypeCheck(a[1], &cbp_Descriptor_Type))
        return PyErr_Format(PyExc_TypeError, "from_ipc_descriptor: expected a cubuf.IPCBufferDescriptor, not %.200s",
                            Py_TYPE(a[1])->tp_name);
    CUstream s;
    if (cbp_stream(a[2], &s) < 0) return NULL;
    cubuf_ipc_import_options_t o = CUBUF_IPC_IMPORT_OPTIONS_INIT;
    o.device = ((ResourceObject *)a[0])->device;
    cubuf_buffer_t *buf;
    cubuf_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = cubuf_buffer_from_ipc_descriptor(NULL, &o, ((DescriptorObject *)a[1])->desc, s, &buf);
    Py_END_ALLOW_THREADS
    if (st != CUBUF_SUCCESS) return cbp_fail(st, "Buffer.from_ipc_descriptor");
    PyTypeObject *type = PyType_Check(cls) && PyType_IsSubtype((PyTypeObject *)cls, &cbp_Buffer_Type)
                             ? (PyTypeObject *)cls
                             : &cbp_Buffer_Type;
    return cbp_buffer_new(type, buf, a[0], NULL, s, a[2]);
}

cubuf_buffer_t *cbp_buffer_hold(BufferObject *self, const char *what)
{
    cubuf_buffer_t *hold = NULL;
    if (atomic_load_explicit(&self->closing, memory_order_acquire))
        return PyErr_Format(PyExc_RuntimeError, "%s: the buffer is being closed", what), NULL;
    cubuf_status_t st = cubuf_buffer_slice(self->buf, 0, cubuf_buffer_size(self->buf), &hold);
    if (st != CUBUF_SUCCESS) return cbp_fail(st, what), NULL;
    return hold;
}

int cbp_buffer_copy_to_new(BufferObject *self, CUstream s, const cubuf_copy_options_t *o,
                           cubuf_buffer_t **out, cubuf_status_t *st, const char *what)
{
    /* The new memory comes from the source's resource (its root's): a
     * caching resource's allocation may wait too. */
    const cubuf_buffer_t *root = cubuf_buffer_parent(self->buf);
    cubuf_resource_t *from = cubuf_buffer_resource(root ? root : self->buf);
    if (!cubuf__inspect_close_may_wait(self->buf) && !(from && cubuf__inspect_allocate_may_wait(from))) {
        *st = cubuf_buffer_copy_to_new(self->buf, s, o, out);
        return 0;
    }
    cubuf_buffer_t *hold = cbp_buffer_hold(self, what);
    if (!hold) return -1;
    PyObject *keep = Py_XNewRef(self->work_ref); /* s may be the work stream another thread replaces */
    Py_BEGIN_ALLOW_THREADS
    *st = cubuf_buffer_copy_to_new(hold, s, o, out);
    cubuf_buffer_release(hold); /* the root's last reference, if closed meanwhile: may wait too */
    Py_END_ALLOW_THREADS
    Py_XDECREF(keep);
    return 0;
}

static PyObject *Buffer_copy_to_host(BufferObject *self, PyObject *const *args, Py_ssize_t nargs,
                                     PyObject *kwnames)
{
    static const char *const names[] = {"position", "nbytes", "stream"};
    PyObject *a[3];
    if (cbp_parse("copy_to_host", args, nargs, kwnames, names, 3, 2, 0, a) < 0) return NULL;
    int64_t pos = 0, n = -1;
    CUstream s = CU_STREAM_LEGACY;
    if ((a[0] && cbp_int64(a[0], "position", &pos) < 0) || (a[1] && cbp_int64(a[1], "nbytes", &n) < 0) ||
        (a[2] && a[2] != Py_None && cbp_stream(a[2], &s) < 0))
        return NULL;
    int64_t size = (int64_t)cubuf_buffer_size(self->buf);
    /* never more than the buffer holds past pos: a larger nbytes is cubuf's
     * OUT_OF_RANGE, not a MemoryError for the bytes object */
    int64_t rest = pos >= 0 && pos <= size ? size - pos : 0;
    int64_t cap = n >= 0 && n < rest ? n : rest;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)cap);
    if (!out) return NULL;
    cubuf_buffer_t *hold = cbp_buffer_hold(self, "Buffer.copy_to_host");
    if (!hold) {
        Py_DECREF(out);
        return NULL;
    }
    size_t copied = 0;
    cubuf_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = cubuf_buffer_copy_to_host(hold, pos, n, PyBytes_AS_STRING(out), (size_t)cap, s, &copied);
    cubuf_buffer_release(hold);
    Py_END_ALLOW_THREADS
    if (st != CUBUF_SUCCESS) {
        Py_DECREF(out);
        return cbp_fail(st, "Buffer.copy_to_host");
    }
    if ((int64_t)copied != cap && _PyBytes_Resize(&out, (Py_ssize_t)copied) < 0) return NULL;
    return out;
}

static PyObject *Buffer_copy_from_host(BufferObject *self, PyObject *const *args, Py_ssize_t nargs,
                                       PyObject *kwnames)
{
    static const char *const names[] = {"data", "position", "nbytes", "stream"};
    PyObject *a[4];
    if (cbp_parse("copy_from_host", args, nargs, kwnames, names, 4, 3, 1u, a) < 0) return NULL;
    int64_t pos = 0, n = -1;
    CUstream s = CU_STREAM_LEGACY;
    if ((a[1] && cbp_int64(a[1], "position", &pos) < 0) || (a[2] && cbp_int64(a[2], "nbytes", &n) < 0) ||
        (a[3] && a[3] != Py_None && cbp_stream(a[3], &s) < 0))
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(a[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    cubuf_buffer_t *hold = cbp_buffer_hold(self, "Buffer.copy_from_host");
    if (!hold) {
        PyBuffer_Release(&view);
        return NULL;
    }
    size_t copied = 0;
    cubuf_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = cubuf_buffer_copy_from_host(hold, view.buf, (size_t)view.len, pos, n, s, &copied);
    cubuf_buffer_release(hold);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (st != CUBUF_SUCCESS) return cbp_fail(st, "Buffer.copy_from_host");
    return PyLong_FromSize_t(copied);
}

static PyObject *Buffer_repr(BufferObject *self)
{
    if (cubuf_buffer_is_closed(self->buf)) return PyUnicode_FromFormat("<%s closed>", Py_TYPE(self)->tp_name);
    return PyUnicode_FromFormat("<%s ptr=%p size=%zu device_id=%d>", Py_TYPE(self)->tp_name,
                                (void *)(uintptr_t)cubuf_buffer_ptr(self->buf), cubuf_buffer_size(self->buf),
                                cubuf_buffer_device_id(self->buf));
}

/* ---- attributes ------------------------------------------------------------- */

static PyObject *Buffer_size(BufferObject *self, void *c) { return PyLong_FromSize_t(cubuf_buffer_size(self->buf)); }
static PyObject *Buffer_handle(BufferObject *self, void *c)
{
    return PyLong_FromUnsignedLongLong((unsigned long long)cubuf_buffer_ptr(self->buf));
}
static PyObject *Buffer_device_id(BufferObject *self, void *c) { return PyLong_FromLong(cubuf_buffer_device_id(self->buf)); }
static PyObject *Buffer_is_closed(BufferObject *self, void *c) { return PyBool_FromLong(cubuf_buffer_is_closed(self->buf)); }
static PyObject *Buffer_is_device_accessible(BufferObject *self, void *c)
{
    return PyBool_FromLong(cubuf_buffer_is_device_accessible(self->buf));
}
static PyObject *Buffer_is_host_accessible(BufferObject *self, void *c)
{
    return PyBool_FromLong(cubuf_buffer_is_host_accessible(self->buf));
}
static PyObject *Buffer_is_managed(BufferObject *self, void *c) { return PyBool_FromLong(cubuf_buffer_is_managed(self->buf)); }
static PyObject *Buffer_is_mapped(BufferObject *self, void *c) { return PyBool_FromLong(cubuf_buffer_is_mapped(self->buf)); }
static PyObject *Buffer_owner(BufferObject *self, void *c) { return Py_NewRef(self->owner ? self->owner : Py_None); }

static PyObject *Buffer_memory_resource(BufferObject *self, void *c)
{
    if (!self->mr) {
        cubuf_resource_t *res = cubuf_buffer_resource(self->buf);
        if (!res) Py_RETURN_NONE;
        if (!(self->mr = cbp_resource_wrap(res))) return NULL;
    }
    return Py_NewRef(self->mr);
}

static PyObject *Buffer_ipc_descriptor(BufferObject *self, void *c)
{
    /* A closed buffer has nothing to share: the cached descriptor names
     * freed memory (the pool may have handed it out again), and the C call
     * below refuses it as closed. */
    if (self->ipc && cubuf_buffer_is_closed(self->buf)) Py_CLEAR(self->ipc);
    if (!self->ipc) {
        if (cbp_buffer_usable(self, "Buffer.ipc_descriptor") < 0) return NULL;
        cubuf_ipc_descriptor_t *d;
        cubuf_status_t st = cubuf_buffer_ipc_descriptor(self->buf, &d);
        if (st != CUBUF_SUCCESS) return cbp_fail(st, "Buffer.ipc_descriptor");
        if (!(self->ipc = cbp_descriptor_new(d))) return NULL;
    }
    return Py_NewRef(self->ipc);
}

static PyMethodDef Buffer_methods[] = {
    {"close", (PyCFunction)(void (*)(void))Buffer_close, METH_FASTCALL | METH_KEYWORDS,
     "close(stream=None): releases the memory, ordered on `stream` (replacing the recorded deallocation\n"
     "stream) or on the recorded one. RuntimeError while exported views (DLPack tensors) are alive."},
    {"copy_to", (PyCFunction)(void (*)(void))Buffer_copy_to, METH_FASTCALL | METH_KEYWORDS,
     "copy_to(dst=None, *, stream, options=None) -> Buffer"},
    {"copy_from", (PyCFunction)(void (*)(void))Buffer_copy_from, METH_FASTCALL | METH_KEYWORDS,
     "copy_from(src, *, stream, options=None)"},
    {"fill", (PyCFunction)(void (*)(void))Buffer_fill, METH_FASTCALL | METH_KEYWORDS,
     "fill(value, *, stream): value an int in [0, 256) or 1, 2 or 4 bytes of a buffer-protocol object."},
    {"set_deallocation_stream", (PyCFunction)(void (*)(void))Buffer_set_deallocation_stream, METH_FASTCALL | METH_KEYWORDS,
     "set_deallocation_stream(stream)"},
    {"from_handle", (PyCFunction)(void (*)(void))Buffer_from_handle, METH_FASTCALL | METH_KEYWORDS | METH_STATIC,
     "from_handle(ptr, size, mr=None, owner=None, *, stream=None) -> Buffer"},
    {"from_ipc_descriptor", (PyCFunction)(void (*)(void))Buffer_from_ipc_descriptor,
     METH_FASTCALL | METH_KEYWORDS | METH_CLASS, "from_ipc_descriptor(mr, ipc_descriptor, *, stream) -> Buffer"},
    {"copy_to_host", (PyCFunction)(void (*)(void))Buffer_copy_to_host, METH_FASTCALL | METH_KEYWORDS,
     "copy_to_host(position=0, nbytes=-1, *, stream=None) -> bytes (pyarrow's CudaBuffer); complete on return"},
    {"copy_from_host", (PyCFunction)(void (*)(void))Buffer_copy_from_host, METH_FASTCALL | METH_KEYWORDS,
     "copy_from_host(data, position=0, nbytes=-1, *, stream=None) -> bytes copied; complete on return"},
    {"__dlpack__", (PyCFunction)(void (*)(void))cbp_buffer_dlpack, METH_FASTCALL | METH_KEYWORDS,
     "__dlpack__(*, stream=None, max_version=None, dl_device=None, copy=None): a DLPack capsule of the\n"
     "buffer's bytes (1-D uint8), holding the buffer open until the consumer releases it."},
    {"__dlpack_device__", (PyCFunction)cbp_buffer_dlpack_device, METH_NOARGS, "(device_type, device_id)"},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef Buffer_getset[] = {
    {"device_id", (getter)Buffer_device_id, NULL, "Device ordinal, or -1 for memory bound to no device.", NULL},
    {"handle", (getter)Buffer_handle, NULL, "The device pointer as an int.", NULL},
    {"ipc_descriptor", (getter)Buffer_ipc_descriptor, NULL, "Descriptor for sharing this buffer with other processes.", NULL},
    {"is_closed", (getter)Buffer_is_closed, NULL, NULL, NULL},
    {"is_device_accessible", (getter)Buffer_is_device_accessible, NULL, NULL, NULL},
    {"is_host_accessible", (getter)Buffer_is_host_accessible, NULL, NULL, NULL},
    {"is_managed", (getter)Buffer_is_managed, NULL, NULL, NULL},
    {"is_mapped", (getter)Buffer_is_mapped, NULL, "Whether the buffer was imported through IPC.", NULL},
    {"memory_resource", (getter)Buffer_memory_resource, NULL, "The memory resource, or None for views.", NULL},
    {"owner", (getter)Buffer_owner, NULL, "The object holding the external allocation, or None.", NULL},
    {"size", (getter)Buffer_size, NULL, NULL, NULL},
    {"__cuda_array_interface__", (getter)cbp_buffer_cai, NULL, "CUDA Array Interface, version 3 (1-D uint8).", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

PyTypeObject cbp_Buffer_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "cubuf.Buffer",
    .tp_basicsize = sizeof(BufferObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A span of memory owned through a memory resource (cuda.core's Buffer).",
    .tp_new = Buffer_new,
    .tp_dealloc = (destructor)Buffer_dealloc,
    .tp_traverse = (traverseproc)Buffer_traverse,
    .tp_clear = (inquiry)Buffer_clear,
    .tp_methods = Buffer_methods,
    .tp_getset = Buffer_getset,
    .tp_repr = (reprfunc)Buffer_repr,
    .tp_weaklistoffset = offsetof(BufferObject, weakreflist),
};

PyTypeObject cbp_VirtualMemoryBuffer_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "cubuf.VirtualMemoryBuffer",
    .tp_basicsize = sizeof(BufferObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A Buffer returned by VirtualMemoryResource: it owns its reservations, physical allocations\n"
              "and mappings; a buffer from modify_allocation aliases the one it was grown from.",
    .tp_base = &cbp_Buffer_Type,
    .tp_new = Buffer_new,
    .tp_traverse = (traverseproc)Buffer_traverse,
    .tp_clear = (inquiry)Buffer_clear,
};
