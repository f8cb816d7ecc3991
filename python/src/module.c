/* cubuf._cubuf: module, exceptions, argument parsing, streams. */
#include "cubufpy.h"

#include <string.h>

#include "internal.h" /* CUresult names for CUDAError.result; the context guard */

PyObject *cbp_CUDAError, *cbp_CUDAWarning;

/* cubuf's warnings (failures no call can return: the last release of a
 * buffer whose close failed, a default stream skipped during a capture)
 * become Python warnings of category cubuf.CUDAWarning. */
static void warning_handler(cubuf_status_t st, const char *message, void *user)
{
    if (!Py_IsInitialized()) {
        fprintf(stderr, "cubuf warning: %s: %s\n", cubuf_status_name(st), message);
        return;
    }
    PyGILState_STATE g = PyGILState_Ensure();
    /* keep an exception being raised */
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *pending = PyErr_GetRaisedException();
#else
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
#endif
    if (PyErr_WarnFormat(cbp_CUDAWarning, 1, "%s: %s", cubuf_status_name(st), message) < 0)
        PyErr_WriteUnraisable(NULL); /* warnings turned into errors: nothing can raise here */
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(pending);
#else
    PyErr_Restore(type, value, tb);
#endif
    PyGILState_Release(g);
}

/* ---- errors ------------------------------------------------------------- */

static PyObject *exception_for(cubuf_status_t st)
{
    switch (st) {
    case CUBUF_ERROR_INVALID_ARGUMENT:
    case CUBUF_ERROR_OUT_OF_RANGE:
    case CUBUF_ERROR_INVALID_DESCRIPTOR: return PyExc_ValueError;
    case CUBUF_ERROR_OUT_OF_MEMORY: return PyExc_MemoryError;
    case CUBUF_ERROR_SYSTEM: return PyExc_OSError;
    case CUBUF_ERROR_DRIVER:
    case CUBUF_ERROR_NO_DRIVER:
    case CUBUF_ERROR_NO_DEVICE: return cbp_CUDAError;
    default: return PyExc_RuntimeError; /* CLOSED, NOT_SUPPORTED, STREAM_CAPTURING, BUSY */
    }
}

PyObject *cbp_fail_as(PyObject *exc, cubuf_status_t st, const char *what)
{
    CUresult r = cubuf_last_cuda_result();
    const char *rname = r != CUDA_SUCCESS ? cubuf__cu_name(r) : NULL;
    /* A driver failure is a CUDAError whatever the status it maps to (an
     * out-of-memory of the device, a capture error), unless the caller
     * asked for a specific exception. */
    if (!exc) exc = r != CUDA_SUCCESS ? cbp_CUDAError : exception_for(st);
    /* args and str() are the message; CUDAError also carries the CUresult. */
    PyObject *msg = PyUnicode_FromFormat("%s: %s: %s", what, cubuf_status_name(st), cubuf_last_error());
    if (!msg) return NULL;
    PyObject *err = PyObject_CallOneArg(exc, msg);
    Py_DECREF(msg);
    if (!err) return NULL;
    if (PyObject_TypeCheck(err, (PyTypeObject *)cbp_CUDAError)) {
        PyObject *name = rname ? PyUnicode_FromString(rname) : (Py_INCREF(Py_None), Py_None);
        PyObject *code = PyLong_FromLong((long)r);
        PyObject *status = PyUnicode_FromString(cubuf_status_name(st));
        int bad = !name || !code || !status || PyObject_SetAttrString(err, "result", name) < 0 ||
                  PyObject_SetAttrString(err, "code", code) < 0 ||
                  PyObject_SetAttrString(err, "status", status) < 0;
        Py_XDECREF(name);
        Py_XDECREF(code);
        Py_XDECREF(status);
        if (bad) goto out;
    }
    PyErr_SetObject((PyObject *)Py_TYPE(err), err);
out:
    Py_DECREF(err);
    return NULL;
}

PyObject *cbp_fail(cubuf_status_t st, const char *what) { return cbp_fail_as(NULL, st, what); }

/* ---- arguments ---------------------------------------------------------- */

int cbp_parse(const char *fname, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
              const char *const *names, int n, int npos, unsigned required, PyObject **out)
{
    for (int i = 0; i < n; i++) out[i] = NULL;
    if (nargs > npos) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %d positional argument%s (%zd given)", fname,
                     npos, npos == 1 ? "" : "s", nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) out[i] = args[i];
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, k);
        int i = 0;
        while (i < n && PyUnicode_CompareWithASCIIString(key, names[i]) != 0) i++;
        if (i == n) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'", fname, key);
            return -1;
        }
        if (out[i]) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", fname, names[i]);
            return -1;
        }
        out[i] = args[nargs + k];
    }
    for (int i = 0; i < n; i++)
        if ((required & (1u << i)) && !out[i]) {
            PyErr_Format(PyExc_TypeError, "%s() missing required %sargument '%s'", fname,
                         i >= npos ? "keyword-only " : "", names[i]);
            return -1;
        }
    return 0;
}

int cbp_one_arg(const char *fname, const char *name, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                PyObject **out)
{
    if (nargs == 1 && !kwnames) return (*out = args[0]), 0;
    const char *const names[] = {name};
    return cbp_parse(fname, args, nargs, kwnames, names, 1, 1, 1u, out);
}

int cbp_handle(PyObject *o, const char *what, unsigned long long *out)
{
    PyObject *v;
    if (PyLong_Check(o)) {
        v = Py_NewRef(o);
    } else if (PyFloat_Check(o) || PyUnicode_Check(o) || PyBytes_Check(o) || o == Py_None ||
               !Py_TYPE(o)->tp_as_number ||
               (!Py_TYPE(o)->tp_as_number->nb_index && !Py_TYPE(o)->tp_as_number->nb_int)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int or a handle int() converts, not %.200s", what,
                     Py_TYPE(o)->tp_name);
        return -1;
    } else if (!(v = PyNumber_Long(o))) {
        return -1;
    }
    int overflow = 0;
    long long s = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow > 0) {
        *out = PyLong_AsUnsignedLongLong(v);
        Py_DECREF(v);
        return PyErr_Occurred() ? -1 : 0;
    }
    Py_DECREF(v);
    if (s == -1 && PyErr_Occurred()) return -1;
    if (overflow < 0 || s < 0) {
        PyErr_Format(PyExc_OverflowError, "%s must not be negative", what);
        return -1;
    }
    *out = (unsigned long long)s;
    return 0;
}

int cbp_size(PyObject *o, const char *what, size_t *out)
{
    if (PyLong_CheckExact(o)) { /* the common case: no __index__ to call */
        const size_t s = PyLong_AsSize_t(o);
        if (__builtin_expect(s != (size_t)-1 || !PyErr_Occurred(), 1)) return (*out = s), 0;
        PyErr_Format(PyExc_OverflowError, "%s must be an int in [0, 2**64)", what);
        return -1;
    }
    if (!PyLong_Check(o) && !PyIndex_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, not %.200s", what, Py_TYPE(o)->tp_name);
        return -1;
    }
    PyObject *v = PyNumber_Index(o);
    if (!v) return -1;
    size_t s = PyLong_AsSize_t(v);
    Py_DECREF(v);
    if (s == (size_t)-1 && PyErr_Occurred()) {
        PyErr_Format(PyExc_OverflowError, "%s must be an int in [0, 2**64)", what);
        return -1;
    }
    *out = s;
    return 0;
}

int cbp_int64(PyObject *o, const char *what, int64_t *out)
{
    if (!PyLong_Check(o) && !PyIndex_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, not %.200s", what, Py_TYPE(o)->tp_name);
        return -1;
    }
    PyObject *v = PyNumber_Index(o);
    if (!v) return -1;
    long long s = PyLong_AsLongLong(v);
    Py_DECREF(v);
    if (s == -1 && PyErr_Occurred()) return -1;
    *out = (int64_t)s;
    return 0;
}

/* (cubufpy.h) Only an AttributeError means "no such attribute". */
int cbp_optional_attr(PyObject *o, const char *name, PyObject **out)
{
    if ((*out = PyObject_GetAttrString(o, name))) return 1;
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
    PyErr_Clear();
    return 0;
}

int cbp_device(PyObject *o, int *out)
{
    PyObject *v = NULL;
    if (!PyLong_Check(o)) {
        int has = cbp_optional_attr(o, "device_id", &v);
        if (has < 0) return -1; /* device_id raised: its error stands */
        if (!has) {
            PyErr_Format(PyExc_TypeError, "device must be an int or have device_id, not %.200s",
                         Py_TYPE(o)->tp_name);
            return -1;
        }
        o = v;
    }
    int ok = PyLong_Check(o);
    long d = ok ? PyLong_AsLong(o) : 0;
    Py_XDECREF(v);
    if (!ok) {
        PyErr_SetString(PyExc_TypeError, "device_id must be an int");
        return -1;
    }
    if (d == -1 && PyErr_Occurred()) return -1;
    if (d < 0 || d > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "device %ld is not a device ordinal", d);
        return -1;
    }
    *out = (int)d;
    return 0;
}

/* ---- streams ------------------------------------------------------------ */

static int stream_from_int_object(PyObject *v, CUstream *out)
{
    unsigned long long h;
    if (cbp_handle(v, "stream handle", &h) < 0) return -1;
    *out = (CUstream)(uintptr_t)h;
    return 0;
}

int cbp_stream(PyObject *o, CUstream *out)
{
    if (Py_IS_TYPE(o, &cbp_Stream_Type) || PyObject_TypeCheck(o, &cbp_Stream_Type)) {
        if (!((StreamObject *)o)->handle) { /* Stream.close() destroyed it (NULL would be the legacy stream) */
            PyErr_SetString(PyExc_RuntimeError, "the stream is closed");
            return -1;
        }
        *out = ((StreamObject *)o)->handle;
        return 0;
    }
    if (PyLong_Check(o)) return stream_from_int_object(o, out);
    if (o == Py_None) {
        PyErr_SetString(PyExc_TypeError, "stream must not be None: pass a stream (cubuf.default_stream() for the default)");
        return -1;
    }
    PyObject *attr;
    int has = cbp_optional_attr(o, "__cuda_stream__", &attr);
    if (has < 0) return -1;
    if (has) {
        PyObject *t = PyCallable_Check(attr) ? PyObject_CallNoArgs(attr) : Py_NewRef(attr);
        Py_DECREF(attr);
        if (!t) return -1;
        int rc = -1;
        if (PyTuple_Check(t) && PyTuple_GET_SIZE(t) == 2)
            rc = stream_from_int_object(PyTuple_GET_ITEM(t, 1), out);
        else
            PyErr_Format(PyExc_TypeError, "%.200s.__cuda_stream__ must give (version, handle)",
                         Py_TYPE(o)->tp_name);
        Py_DECREF(t);
        return rc;
    }
    if ((has = cbp_optional_attr(o, "cuda_stream", &attr)) < 0) return -1; /* torch.cuda.Stream */
    if (!has) {
        const char *tn = Py_TYPE(o)->tp_name;
        size_t len = strlen(tn);
        if (len >= 6 && strcmp(tn + len - 6, "Stream") == 0 && /* cupy.cuda.Stream, ExternalStream */
            (has = cbp_optional_attr(o, "ptr", &attr)) < 0)
            return -1;
    }
    if (has) {
        int rc = stream_from_int_object(attr, out);
        Py_DECREF(attr);
        return rc;
    }
    if (Py_TYPE(o)->tp_as_number && Py_TYPE(o)->tp_as_number->nb_int && !PyFloat_Check(o))
        return stream_from_int_object(o, out); /* cuda.bindings CUstream */
    PyErr_Format(PyExc_TypeError,
                 "%.200s is not a stream: pass a cubuf.Stream, an int handle, or an object with "
                 "__cuda_stream__ or a CUDA stream attribute",
                 Py_TYPE(o)->tp_name);
    return -1;
}

#define CBP_MAX_DEVICES 64
static cubuf_context_t *device_contexts[CBP_MAX_DEVICES];
static CUevent handoff_events[CBP_MAX_DEVICES];

cubuf_context_t *cbp_device_context(int device)
{
    if (device < 0 || device >= CBP_MAX_DEVICES) {
        PyErr_Format(PyExc_ValueError, "device %d is out of range", device);
        return NULL;
    }
    if (!device_contexts[device]) {
        cubuf_status_t st = cubuf_context_create(device, &device_contexts[device]);
        if (st != CUBUF_SUCCESS) return (cbp_fail(st, "cubuf_context_create"), NULL);
    }
    return device_contexts[device];
}

/* cbp_stream_handoff's work, in the device's primary context (current).
 * *capturing: set when the producer captures; the consumer joins that
 * capture when `join` says so, else nothing is done. */
static cubuf_status_t handoff_in_ctx(int device, CUstream producer, CUstream consumer, bool join,
                                     bool *capturing)
{
    /* Nothing to wait for when the producer's work has all completed (one
     * query, cheaper than a record and a wait). A producer that captures
     * has queued its work into a graph, and a query would invalidate the
     * capture: the record and the wait join the consumer to it instead. */
    CUstreamCaptureStatus cs = CU_STREAM_CAPTURE_STATUS_NONE;
    const CUresult r = CU_CALL(cuStreamIsCapturing, producer, &cs);
    *capturing = r == CUDA_SUCCESS && cs != CU_STREAM_CAPTURE_STATUS_NONE;
    if (r == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)
        return cubuf__fail(CUBUF_ERROR_STREAM_CAPTURING, "the legacy default stream waits for a stream "
                                                         "that captures: work on it would invalidate "
                                                         "that capture");
    if (r != CUDA_SUCCESS) return cubuf__cu_status(r, "cuStreamIsCapturing");
    if (*capturing && !join) return CUBUF_SUCCESS;
    bool idle = false;
    cubuf_status_t st = CUBUF_SUCCESS;
    if (!*capturing) st = cubuf_stream_query(producer, &idle);
    if (st != CUBUF_SUCCESS || idle) return st;
    /* One event per device, reused: a wait captures the event's state when
     * it is enqueued, so recording it again later changes no earlier wait.
     * The GIL serializes record and wait. */
    if (!handoff_events[device])
        st = cubuf_event_create(device_contexts[device], CU_EVENT_DISABLE_TIMING, &handoff_events[device]);
    if (st == CUBUF_SUCCESS) st = cubuf_event_record(handoff_events[device], producer);
    if (st == CUBUF_SUCCESS) st = cubuf_stream_wait_event(consumer, handoff_events[device]);
    return st;
}

/* Makes the device's primary context current (a default stream is the
 * current context's), restoring the caller's at pop. */
static int push_device(int device, cubuf_ctx_guard_t *g, const char *what)
{
    cubuf_context_t *ctx = cbp_device_context(device);
    if (!ctx) return -1;
    CUcontext h = NULL;
    cubuf_context_handle(ctx, &h);
    cubuf_status_t st = cubuf__ctx_push(h, g);
    return st == CUBUF_SUCCESS ? 0 : (cbp_fail(st, what), -1);
}

int cbp_stream_handoff(int device, CUstream producer, CUstream consumer)
{
    if (cbp_same_stream(producer, consumer)) return 0;
    cubuf_ctx_guard_t g;
    if (push_device(device, &g, "stream handoff") < 0) return -1;
    bool capturing;
    const cubuf_status_t st = handoff_in_ctx(device, producer, consumer, true, &capturing);
    cubuf__ctx_pop(&g);
    return st == CUBUF_SUCCESS ? 0 : (cbp_fail(st, "stream handoff"), -1);
}

int cbp_free_on_legacy(int device, CUstream from, cubuf_buffer_t *buf)
{
    if (cbp_is_legacy(from)) return 0; /* freed there already */
    cubuf_ctx_guard_t g;
    if (push_device(device, &g, "free on the legacy stream") < 0) return -1;
    /* A capturing stream: the legacy stream cannot join its capture; the
     * free stays on `from`. */
    bool capturing = false;
    cubuf_status_t st = handoff_in_ctx(device, from, CU_STREAM_LEGACY, false, &capturing);
    if (st == CUBUF_SUCCESS && !capturing) st = cubuf_buffer_set_deallocation_stream(buf, CU_STREAM_LEGACY);
    cubuf__ctx_pop(&g);
    if (st != CUBUF_SUCCESS) return cbp_fail(st, "free on the legacy stream"), -1;
    return capturing;
}

int cbp_stream_sync(int device, CUstream stream, PyObject *exc, const char *what)
{
    cubuf_context_t *ctx = cbp_device_context(device);
    if (!ctx) return -1;
    CUcontext h = NULL;
    cubuf_context_handle(ctx, &h);
    const cubuf_stream_token_t t = {stream, h}; /* a default stream is the context's */
    cubuf_status_t st;
    Py_BEGIN_ALLOW_THREADS
    if ((st = cubuf__stream_refuse_capture(stream, h, what)) == CUBUF_SUCCESS) st = cubuf__stream_sync(&t);
    Py_END_ALLOW_THREADS
    return st == CUBUF_SUCCESS ? 0 : (cbp_fail_as(exc, st, what), -1);
}

/* ---- cubuf.Stream --------------------------------------------------------- */

static PyObject *stream_make(CUstream h, bool owned, PyObject *keep)
{
    StreamObject *s = PyObject_New(StreamObject, &cbp_Stream_Type);
    if (!s) return NULL;
    s->handle = h;
    s->owned = owned;
    s->keep = Py_XNewRef(keep);
    return (PyObject *)s;
}

static PyObject *Stream_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"device", "non_blocking", "priority", "context", NULL};
    PyObject *device = NULL, *context = NULL;
    int non_blocking = 1, priority = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O$piO:Stream", kw, &device, &non_blocking,
                                     &priority, &context))
        return NULL;
    cubuf_context_t *ctx;
    if (context && context != Py_None) {
        if (!PyObject_TypeCheck(context, &cbp_Context_Type))
            return PyErr_Format(PyExc_TypeError, "context must be a cubuf.Context");
        ctx = ((ContextObject *)context)->ctx;
    } else {
        int d = 0;
        if (device && device != Py_None && cbp_device(device, &d) < 0) return NULL;
        if (!(ctx = cbp_device_context(d))) return NULL;
        context = NULL;
    }
    CUstream h;
    cubuf_status_t st =
        cubuf_stream_create(ctx, non_blocking ? CU_STREAM_NON_BLOCKING : CU_STREAM_DEFAULT, priority, &h);
    if (st != CUBUF_SUCCESS) return cbp_fail(st, "Stream");
    PyObject *s = stream_make(h, true, context);
    if (!s) cubuf_stream_destroy(h);
    return s;
}

/* Destroys a stream without the GIL: cubuf_stream_destroy first gives back
 * the blocks caching resources keep on it, and a synchronous upstream's
 * free waits for the device (where a Python host function may wait for
 * the GIL). */
static cubuf_status_t destroy_without_gil(CUstream h)
{
    cubuf_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = cubuf_stream_destroy(h);
    Py_END_ALLOW_THREADS
    return st;
}

static PyObject *Stream_close(StreamObject *self, PyObject *unused)
{
    if (self->owned && self->handle) {
        CUstream h = self->handle;
        self->handle = NULL; /* closed for other threads meanwhile */
        self->owned = false;
        cubuf_status_t st = destroy_without_gil(h);
        if (st != CUBUF_SUCCESS) { /* not destroyed: still this object's */
            self->handle = h;
            self->owned = true;
            return cbp_fail(st, "Stream.close");
        }
    }
    Py_RETURN_NONE;
}

static void Stream_dealloc(StreamObject *self)
{
    /* A stream that cannot be destroyed (a caching resource could not give
     * its blocks back) is kept: its blocks stay usable, given back later. */
    if (self->owned && self->handle && destroy_without_gil(self->handle) != CUBUF_SUCCESS) {
        PyObject *exc_type, *exc, *tb;
        PyErr_Fetch(&exc_type, &exc, &tb);
        if (PyErr_WarnFormat(cbp_CUDAWarning, 1, "a dropped cubuf.Stream was not destroyed: %s",
                             cubuf_last_error()) < 0)
            PyErr_WriteUnraisable(NULL);
        PyErr_Restore(exc_type, exc, tb);
    }
    Py_XDECREF(self->keep);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Stream_sync(StreamObject *self, PyObject *unused)
{
    if (!self->handle) return PyErr_Format(PyExc_RuntimeError, "Stream.sync: the stream is closed");
    /* A default stream belongs to whatever context is current, and Python
     * code rarely has one: synchronize device 0's primary context instead,
     * which waits for its default streams' work and more. */
    cubuf_context_t *ctx = NULL;
    if (cbp_is_legacy(self->handle) || self->handle == CU_STREAM_PER_THREAD) {
        if (!(ctx = cbp_device_context(0))) return NULL;
    }
    cubuf_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = ctx ? cubuf_context_synchronize(ctx) : cubuf_stream_synchronize(self->handle);
    Py_END_ALLOW_THREADS
    if (st != CUBUF_SUCCESS) return cbp_fail(st, "Stream.sync");
    Py_RETURN_NONE;
}

static PyObject *Stream_is_done(StreamObject *self, void *c)
{
    bool done = false;
    if (!self->handle) return PyErr_Format(PyExc_RuntimeError, "Stream.is_done: the stream is closed");
    cubuf_status_t st;
    if (cbp_is_legacy(self->handle) || self->handle == CU_STREAM_PER_THREAD) {
        /* a default stream is the current context's, as in sync(): device 0's primary one */
        cubuf_context_t *ctx = cbp_device_context(0);
        if (!ctx) return NULL;
        CUcontext h = NULL;
        cubuf_context_handle(ctx, &h);
        cubuf_ctx_guard_t g;
        if ((st = cubuf__ctx_push(h, &g)) == CUBUF_SUCCESS) {
            st = cubuf_stream_query(self->handle, &done);
            cubuf__ctx_pop(&g);
        }
    } else {
        st = cubuf_stream_query(self->handle, &done);
    }
    if (st != CUBUF_SUCCESS) return cbp_fail(st, "Stream.is_done");
    return PyBool_FromLong(done);
}

static PyObject *Stream_handle(StreamObject *self, void *c)
{
    return PyLong_FromUnsignedLongLong((uintptr_t)self->handle);
}

static PyObject *Stream_cuda_stream(StreamObject *self, PyObject *unused)
{
    return Py_BuildValue("(iK)", 0, (unsigned long long)(uintptr_t)self->handle);
}

static PyObject *Stream_repr(StreamObject *self)
{
    return PyUnicode_FromFormat("<cubuf.Stream handle=%p>", (void *)self->handle);
}

static PyObject *Stream_richcompare(PyObject *a, PyObject *b, int op)
{
    if (!PyObject_TypeCheck(b, &cbp_Stream_Type) || (op != Py_EQ && op != Py_NE)) Py_RETURN_NOTIMPLEMENTED;
    bool eq = ((StreamObject *)a)->handle == ((StreamObject *)b)->handle;
    return PyBool_FromLong(op == Py_EQ ? eq : !eq);
}

static Py_hash_t Stream_hash(StreamObject *self)
{
    Py_hash_t h = (Py_hash_t)(uintptr_t)self->handle;
    return h == -1 ? -2 : h;
}

static PyMethodDef Stream_methods[] = {
    {"close", (PyCFunction)Stream_close, METH_NOARGS, "Destroys a stream made by cubuf.Stream()."},
    {"sync", (PyCFunction)Stream_sync, METH_NOARGS, "Blocks until the stream's work has completed."},
    {"__cuda_stream__", (PyCFunction)Stream_cuda_stream, METH_NOARGS, "(0, handle)"},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef Stream_getset[] = {
    {"handle", (getter)Stream_handle, NULL, "The CUstream as an int.", NULL},
    {"is_done", (getter)Stream_is_done, NULL, "Whether the queued work has completed.", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

PyTypeObject cbp_Stream_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "cubuf.Stream",
    .tp_basicsize = sizeof(StreamObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Stream(device=0, *, non_blocking=True, priority=0, context=None): a CUDA stream.",
    .tp_new = Stream_new,
    .tp_dealloc = (destructor)Stream_dealloc,
    .tp_methods = Stream_methods,
    .tp_getset = Stream_getset,
    .tp_repr = (reprfunc)Stream_repr,
    .tp_richcompare = Stream_richcompare,
    .tp_hash = (hashfunc)Stream_hash,
};

/* ---- module functions ----------------------------------------------------- */

static PyObject *legacy_default_stream, *per_thread_default_stream;

static PyObject *mod_default_stream(PyObject *m, PyObject *unused)
{
    return Py_NewRef(legacy_default_stream);
}

PyObject *cbp_get_num_devices(PyObject *unused, PyObject *noargs)
{
    int n = 0;
    cubuf_status_t st = cubuf_device_count(&n);
    if (st != CUBUF_SUCCESS) return cbp_fail(st, "get_num_devices");
    return PyLong_FromLong(n);
}

static PyObject *mod_driver_version(PyObject *m, PyObject *unused)
{
    int v = 0;
    cubuf_status_t st = cubuf_driver_version(&v);
    if (st != CUBUF_SUCCESS) return cbp_fail(st, "driver_version");
    return PyLong_FromLong(v);
}

static PyObject *mod_stream_handle(PyObject *m, PyObject *arg)
{
    CUstream s;
    if (cbp_stream(arg, &s) < 0) return NULL;
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)s);
}

static PyMethodDef module_methods[] = {
    {"_stream_handle", mod_stream_handle, METH_O, "The CUstream a stream argument names, as an int."},
    {"_bench_c_alloc_close", cbp_bench_c_alloc_close, METH_VARARGS, "bench/bench_python.py: the C pair's ns."},
    {"_bench_raw", cbp_bench_raw, METH_VARARGS, "bench/bench_python.py: the raw driver's ns."},
    {"default_stream", mod_default_stream, METH_NOARGS, "The legacy default stream (cubuf.LEGACY_DEFAULT_STREAM)."},
    {"get_num_devices", cbp_get_num_devices, METH_NOARGS, "Number of CUDA devices."},
    {"driver_version", mod_driver_version, METH_NOARGS, "The CUDA driver's version (13000 for 13.0)."},
    {"from_dlpack", (PyCFunction)(void (*)(void))cbp_from_dlpack, METH_FASTCALL | METH_KEYWORDS,
     "from_dlpack(x, /, *, stream=None): a Buffer over the memory of a DLPack producer, without a copy.\n"
     "stream: the stream the buffer will be used on (the producer makes its work visible there;\n"
     "default: the legacy default stream). The buffer keeps the producer's tensor alive."},
    {NULL, NULL, 0, NULL}};

static void module_free(void *m)
{
    cubuf_set_warning_handler(NULL, NULL);
    cbp_buffer_drop_spares();
    for (int i = 0; i < CBP_MAX_DEVICES; i++) {
        if (handoff_events[i]) cubuf_event_destroy(handoff_events[i]);
        handoff_events[i] = NULL;
        /* The contexts stay: buffers still alive at exit may belong to them. */
    }
}

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "cubuf._cubuf", "cubuf: CUDA memory (the C extension; import cubuf).", -1,
    module_methods, NULL, NULL, NULL, module_free,
};

static int add_type(PyObject *m, PyTypeObject *t, const char *name)
{
    if (PyType_Ready(t) < 0) return -1;
    return PyModule_AddObjectRef(m, name, (PyObject *)t);
}

PyMODINIT_FUNC PyInit__cubuf(void);
PyMODINIT_FUNC PyInit__cubuf(void)
{
    PyObject *m = PyModule_Create(&module_def);
    if (!m) return NULL;
    cbp_CUDAError = PyErr_NewExceptionWithDoc(
        "cubuf.CUDAError",
        "A CUDA driver call failed. result: the CUresult name (\"CUDA_ERROR_OUT_OF_MEMORY\"), or None\n"
        "when no driver call failed (no driver); code: the CUresult; status: cubuf's status name.",
        PyExc_RuntimeError, NULL);
    if (!cbp_CUDAError || PyModule_AddObjectRef(m, "CUDAError", cbp_CUDAError) < 0) goto fail;
    cbp_CUDAWarning = PyErr_NewExceptionWithDoc(
        "cubuf.CUDAWarning",
        "A failure no call could return (cuda.core's CUDAWarning): the last release of a buffer whose close\n"
        "failed, or a default stream that was not synchronized because that would disturb a capture.",
        PyExc_RuntimeWarning, NULL);
    if (!cbp_CUDAWarning || PyModule_AddObjectRef(m, "CUDAWarning", cbp_CUDAWarning) < 0) goto fail;
    cubuf_set_warning_handler(warning_handler, NULL);
    if (add_type(m, &cbp_Stream_Type, "Stream") < 0 || add_type(m, &cbp_Buffer_Type, "Buffer") < 0 ||
        add_type(m, &cbp_VirtualMemoryBuffer_Type, "VirtualMemoryBuffer") < 0 ||
        add_type(m, &cbp_MemoryResource_Type, "MemoryResource") < 0 ||
        add_type(m, &cbp_VirtualMemoryResource_Type, "VirtualMemoryResource") < 0 ||
        cbp_resource_types_ready(m) < 0 || add_type(m, &cbp_Context_Type, "Context") < 0 ||
        add_type(m, &cbp_Descriptor_Type, "IPCBufferDescriptor") < 0 ||
        add_type(m, &cbp_CopyOptions_Type, "CopyOptions") < 0)
        goto fail;
    legacy_default_stream = stream_make(CU_STREAM_LEGACY, false, NULL);
    per_thread_default_stream = stream_make(CU_STREAM_PER_THREAD, false, NULL);
    if (!legacy_default_stream || !per_thread_default_stream ||
        PyModule_AddObjectRef(m, "LEGACY_DEFAULT_STREAM", legacy_default_stream) < 0 ||
        PyModule_AddObjectRef(m, "PER_THREAD_DEFAULT_STREAM", per_thread_default_stream) < 0 ||
        PyModule_AddStringConstant(m, "__version__", cubuf_version_string()) < 0)
        goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
