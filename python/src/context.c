/* cubuf.Context (pyarrow.cuda's Context page). */
#include "cubufpy.h"

static PyObject *context_make(PyTypeObject *type, cubuf_context_t *ctx)
{
    ContextObject *c = (ContextObject *)type->tp_alloc(type, 0);
    if (!c) {
        cubuf_context_destroy(ctx);
        return NULL;
    }
    c->ctx = ctx;
    return (PyObject *)c;
}

static PyObject *Context_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"device_number", "handle", NULL};
    PyObject *dev = NULL, *handle = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|OO:Context", kw, &dev, &handle)) return NULL;
    cubuf_context_t *ctx;
    cubuf_status_t st;
    if (handle && handle != Py_None) {
        unsigned long long h;
        if (cbp_handle(handle, "handle", &h) < 0) return NULL;
        if (h == 0) return PyErr_Format(PyExc_ValueError, "Context: handle must not be 0");
        st = cubuf_context_wrap((CUcontext)(uintptr_t)h, &ctx);
        if (st == CUBUF_SUCCESS && dev && dev != Py_None) {
            int want, got = -1;
            if (cbp_device(dev, &want) < 0) {
                cubuf_context_destroy(ctx);
                return NULL;
            }
            cubuf_context_device(ctx, &got);
            if (got != want) {
                cubuf_context_destroy(ctx);
                return PyErr_Format(PyExc_ValueError, "Context: handle belongs to device %d, not %d", got, want);
            }
        }
    } else {
        int d = 0;
        if (dev && dev != Py_None && cbp_device(dev, &d) < 0) return NULL;
        st = cubuf_context_create(d, &ctx);
    }
    if (st != CUBUF_SUCCESS) return cbp_fail(st, "Context");
    return context_make(type, ctx);
}

static void Context_dealloc(ContextObject *self)
{
    if (self->weakreflist) PyObject_ClearWeakRefs((PyObject *)self);
    cubuf_context_destroy(self->ctx);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* r (a new Buffer, or NULL) marked read-only when its memory is. */
static PyObject *read_only_if(PyObject *r, bool read_only)
{
    if (r) ((BufferObject *)r)->read_only = read_only;
    return r;
}

static PyObject *buffer_of(cubuf_status_t st, cubuf_buffer_t *buf, PyObject *owner, const char *what)
{
    if (st != CUBUF_SUCCESS) return cbp_fail(st, what);
    return cbp_buffer_new(&cbp_Buffer_Type, buf, NULL, owner, CU_STREAM_LEGACY, NULL);
}

static PyObject *Context_new_buffer(ContextObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *arg;
    if (cbp_one_arg("new_buffer", "nbytes", args, nargs, kwnames, &arg) < 0) return NULL;
    size_t n;
    if (cbp_size(arg, "nbytes", &n) < 0) return NULL;
    cubuf_buffer_t *buf;
    cubuf_status_t st = cubuf_context_new_buffer(self->ctx, n, &buf);
    return buffer_of(st, buf, NULL, "Context.new_buffer");
}

static PyObject *Context_buffer_from_data(ContextObject *self, PyObject *const *args, Py_ssize_t nargs,
                                          PyObject *kwnames)
{
    static const char *const names[] = {"data", "offset", "size"};
    PyObject *a[3];
    if (cbp_parse("buffer_from_data", args, nargs, kwnames, names, 3, 3, 1u, a) < 0) return NULL;
    int64_t off = 0, size = CUBUF_SIZE_REST;
    if ((a[1] && cbp_int64(a[1], "offset", &off) < 0) || (a[2] && cbp_int64(a[2], "size", &size) < 0)) return NULL;
    cubuf_buffer_t *buf;
    cubuf_status_t st;
    if (cbp_Buffer_Check(a[0])) {
        if (cubuf_buffer_is_closed(((BufferObject *)a[0])->buf))
            return PyErr_Format(PyExc_RuntimeError, "buffer_from_data: the buffer is closed");
        /* The copy runs without the GIL: the hold keeps the source's memory. */
        cubuf_buffer_t *hold = cbp_buffer_hold((BufferObject *)a[0], "Context.buffer_from_data");
        if (!hold) return NULL;
        Py_BEGIN_ALLOW_THREADS
        st = cubuf_context_buffer_from_data(self->ctx, (const void *)(uintptr_t)cubuf_buffer_ptr(hold),
                                            cubuf_buffer_size(hold), off, size, &buf);
        Py_END_ALLOW_THREADS
        cubuf_buffer_release(hold);
    } else {
        Py_buffer view;
        if (PyObject_GetBuffer(a[0], &view, PyBUF_ANY_CONTIGUOUS) < 0) return NULL;
        Py_BEGIN_ALLOW_THREADS
        st = cubuf_context_buffer_from_data(self->ctx, view.buf, (size_t)view.len, off, size, &buf);
        Py_END_ALLOW_THREADS
        PyBuffer_Release(&view);
    }
    return buffer_of(st, buf, NULL, "Context.buffer_from_data");
}

/* A view over [address, address+size) owned by `base`: a cubuf Buffer is
 * depended on as a slice's root is; any other object is kept alive. */
static PyObject *foreign(ContextObject *self, unsigned long long address, size_t size, PyObject *base,
                         const char *what)
{
    cubuf_buffer_t *buf;
    cubuf_status_t st;
    if (base && cbp_Buffer_Check(base)) {
        if (cbp_buffer_usable((BufferObject *)base, what) < 0) return NULL;
        st = cubuf_context_foreign_buffer(self->ctx, (CUdeviceptr)address, size, ((BufferObject *)base)->buf, NULL,
                                          NULL, &buf);
    } else if (base) {
        Py_INCREF(base);
        st = cubuf_context_foreign_buffer(self->ctx, (CUdeviceptr)address, size, NULL, base, cbp_owner_release, &buf);
        if (st != CUBUF_SUCCESS) Py_DECREF(base);
    } else {
        st = cubuf_context_foreign_buffer(self->ctx, (CUdeviceptr)address, size, NULL, NULL, NULL, &buf);
    }
    return buffer_of(st, buf, base, what);
}

static PyObject *Context_foreign_buffer(ContextObject *self, PyObject *const *args, Py_ssize_t nargs,
                                        PyObject *kwnames)
{
    static const char *const names[] = {"address", "size", "base"};
    PyObject *a[3];
    if (cbp_parse("foreign_buffer", args, nargs, kwnames, names, 3, 3, 3u, a) < 0) return NULL;
    unsigned long long addr;
    size_t size;
    if (cbp_handle(a[0], "address", &addr) < 0 || cbp_size(a[1], "size", &size) < 0) return NULL;
    return foreign(self, addr, size, a[2] && a[2] != Py_None ? a[2] : NULL, "Context.foreign_buffer");
}

static PyObject *Context_get_device_address(ContextObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *arg;
    if (cbp_one_arg("get_device_address", "address", args, nargs, kwnames, &arg) < 0) return NULL;
    unsigned long long addr;
    if (cbp_handle(arg, "address", &addr) < 0) return NULL;
    CUdeviceptr d;
    cubuf_status_t st = cubuf_context_device_address(self->ctx, (const void *)(uintptr_t)addr, &d);
    if (st != CUBUF_SUCCESS) return cbp_fail(st, "Context.get_device_address");
    return PyLong_FromUnsignedLongLong((unsigned long long)d);
}

static PyObject *Context_buffer_from_object(ContextObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *obj;
    if (cbp_one_arg("buffer_from_object", "obj", args, nargs, kwnames, &obj) < 0) return NULL;
    if (cbp_Buffer_Check(obj)) {
        cubuf_buffer_t *b = ((BufferObject *)obj)->buf;
        PyObject *r = foreign(self, cubuf_buffer_ptr(b), cubuf_buffer_size(b), obj, "Context.buffer_from_object");
        return read_only_if(r, cbp_buffer_read_only((BufferObject *)obj));
    }
    bool handled = false;
    PyObject *r = cbp_buffer_from_cai(self->ctx, obj, &handled);
    if (handled || r) return r;
    if (PyObject_CheckBuffer(obj)) {
        /* Host memory: device accessible once pinned or registered; the view
         * is of its device address (pageable memory is refused there). The
         * view holds the export until it closes: while it is held the
         * exporter can neither move nor free that memory (a registered
         * bytearray refuses to resize). */
        Py_buffer *view = PyMem_Malloc(sizeof *view);
        if (!view) return PyErr_NoMemory();
        if (PyObject_GetBuffer(obj, view, PyBUF_ANY_CONTIGUOUS) < 0) {
            PyMem_Free(view);
            return NULL;
        }
        const bool read_only = view->readonly;
        CUdeviceptr d = 0;
        cubuf_buffer_t *buf = NULL;
        cubuf_status_t st = view->len ? cubuf_context_device_address(self->ctx, view->buf, &d) : CUBUF_SUCCESS;
        if (st == CUBUF_SUCCESS)
            st = cubuf_context_foreign_buffer(self->ctx, d, (size_t)view->len, NULL, view, cbp_export_release, &buf);
        if (st != CUBUF_SUCCESS) {
            PyBuffer_Release(view);
            PyMem_Free(view);
        }
        return read_only_if(buffer_of(st, buf, obj, "Context.buffer_from_object"), read_only);
    }
    return PyErr_Format(PyExc_TypeError,
                        "buffer_from_object: %.200s is not a cubuf.Buffer, has no __cuda_array_interface__ and "
                        "does not support the buffer protocol",
                        Py_TYPE(obj)->tp_name);
}

static PyObject *Context_open_ipc_buffer(ContextObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *arg;
    if (cbp_one_arg("open_ipc_buffer", "ipc_handle", args, nargs, kwnames, &arg) < 0) return NULL;
    if (!PyObject_TypeCheck(arg, &cbp_Descriptor_Type))
        return PyErr_Format(PyExc_TypeError, "open_ipc_buffer: expected a cubuf.IPCBufferDescriptor, not %.200s",
                            Py_TYPE(arg)->tp_name);
    cubuf_buffer_t *buf;
    cubuf_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = cubuf_context_open_ipc_buffer(self->ctx, ((DescriptorObject *)arg)->desc, &buf);
    Py_END_ALLOW_THREADS
    return buffer_of(st, buf, NULL, "Context.open_ipc_buffer");
}

static PyObject *Context_synchronize(ContextObject *self, PyObject *unused)
{
    cubuf_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = cubuf_context_synchronize(self->ctx);
    Py_END_ALLOW_THREADS
    if (st != CUBUF_SUCCESS) return cbp_fail(st, "Context.synchronize");
    Py_RETURN_NONE;
}

static PyObject *Context_bytes_allocated(ContextObject *self, void *c)
{
    size_t n = 0;
    cubuf_status_t st = cubuf_context_bytes_allocated(self->ctx, &n);
    if (st != CUBUF_SUCCESS) return cbp_fail(st, "Context.bytes_allocated");
    return PyLong_FromSize_t(n);
}

static PyObject *Context_device_number(ContextObject *self, void *c)
{
    int d = -1;
    cubuf_context_device(self->ctx, &d);
    return PyLong_FromLong(d);
}

static PyObject *Context_handle(ContextObject *self, void *c)
{
    CUcontext h = NULL;
    cubuf_context_handle(self->ctx, &h);
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)h);
}

/* from_numba / to_numba: numba's objects are read in cubuf/_numba.py. */
static PyObject *call_numba_helper(const char *name, PyObject *arg)
{
    PyObject *mod = PyImport_ImportModule("cubuf._numba");
    if (!mod) return NULL;
    PyObject *r = PyObject_CallMethod(mod, name, "(O)", arg); /* "O" would spread a tuple into arguments */
    Py_DECREF(mod);
    return r;
}

static PyObject *Context_from_numba(PyObject *unused, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"context"};
    PyObject *a[1];
    if (cbp_parse("from_numba", args, nargs, kwnames, names, 1, 1, 0, a) < 0) return NULL;
    PyObject *h = call_numba_helper("context_handle", a[0] ? a[0] : Py_None);
    if (!h) return NULL;
    unsigned long long v;
    int rc = cbp_handle(h, "numba context handle", &v);
    Py_DECREF(h);
    if (rc < 0) return NULL;
    cubuf_context_t *ctx;
    cubuf_status_t st = cubuf_context_wrap((CUcontext)(uintptr_t)v, &ctx);
    if (st != CUBUF_SUCCESS) return cbp_fail(st, "Context.from_numba");
    return context_make(&cbp_Context_Type, ctx);
}

static PyObject *Context_to_numba(ContextObject *self, PyObject *unused)
{
    PyObject *dev = Context_device_number(self, NULL), *h = Context_handle(self, NULL);
    PyObject *t = dev && h ? PyTuple_Pack(2, dev, h) : NULL;
    Py_XDECREF(dev);
    Py_XDECREF(h);
    if (!t) return NULL;
    PyObject *r = call_numba_helper("to_numba", t);
    Py_DECREF(t);
    return r;
}

static PyMethodDef Context_methods[] = {
    {"get_num_devices", (PyCFunction)cbp_get_num_devices, METH_NOARGS | METH_STATIC, "Number of GPU devices."},
    {"new_buffer", (PyCFunction)(void (*)(void))Context_new_buffer, METH_FASTCALL | METH_KEYWORDS, "new_buffer(nbytes) -> Buffer of device memory."},
    {"buffer_from_data", (PyCFunction)(void (*)(void))Context_buffer_from_data, METH_FASTCALL | METH_KEYWORDS,
     "buffer_from_data(data, offset=0, size=-1) -> a new device Buffer holding a copy of data (a\n"
     "buffer-protocol object or a cubuf Buffer)."},
    {"buffer_from_object", (PyCFunction)(void (*)(void))Context_buffer_from_object, METH_FASTCALL | METH_KEYWORDS,
     "buffer_from_object(obj) -> a view of device-accessible memory: a cubuf Buffer, an object with\n"
     "__cuda_array_interface__ (the contiguous span holding every element), or pinned host memory.\n"
     "Read-only memory (data[1] true, a read-only host buffer or Buffer) stays read-only in the\n"
     "view's exports (DLPack's flag, the interface's data[1]); writes into it are not refused."},
    {"foreign_buffer", (PyCFunction)(void (*)(void))Context_foreign_buffer, METH_FASTCALL | METH_KEYWORDS,
     "foreign_buffer(address, size, base=None) -> a view; base is kept alive by it."},
    {"get_device_address", (PyCFunction)(void (*)(void))Context_get_device_address, METH_FASTCALL | METH_KEYWORDS,
     "get_device_address(address) -> the address kernels in this context use."},
    {"open_ipc_buffer", (PyCFunction)(void (*)(void))Context_open_ipc_buffer, METH_FASTCALL | METH_KEYWORDS,
     "open_ipc_buffer(ipc_handle) -> Buffer imported from an IPCBufferDescriptor."},
    {"synchronize", (PyCFunction)Context_synchronize, METH_NOARGS, "Blocks until the device is idle."},
    {"from_numba", (PyCFunction)(void (*)(void))Context_from_numba, METH_FASTCALL | METH_KEYWORDS | METH_STATIC,
     "from_numba(context=None) -> Context wrapping a Numba CUDA context (None: Numba's current one)."},
    {"to_numba", (PyCFunction)Context_to_numba, METH_NOARGS, "to_numba() -> the Numba CUDA context."},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef Context_getset[] = {
    {"bytes_allocated", (getter)Context_bytes_allocated, NULL, "Live bytes of the buffers made here.", NULL},
    {"device_number", (getter)Context_device_number, NULL, NULL, NULL},
    {"handle", (getter)Context_handle, NULL, "The CUcontext as an int.", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

PyTypeObject cbp_Context_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "cubuf.Context",
    .tp_basicsize = sizeof(ContextObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Context(device_number=0, handle=None): a CUDA driver context (pyarrow.cuda's Context): the\n"
              "device's primary context, or the context `handle` (anything int() converts) made elsewhere.",
    .tp_new = Context_new,
    .tp_dealloc = (destructor)Context_dealloc,
    .tp_methods = Context_methods,
    .tp_getset = Context_getset,
    .tp_weaklistoffset = offsetof(ContextObject, weakreflist),
};
