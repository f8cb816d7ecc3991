/* cubuf.IPCBufferDescriptor: bytes plus owned fds; pickled through
 * multiprocessing (cubuf/__init__.py registers the reduction that lets
 * multiprocessing duplicate the fds) or, without fds, through plain pickle. */
#include "cubufpy.h"

#include <limits.h>
#include <unistd.h>

PyObject *cbp_descriptor_new(cubuf_ipc_descriptor_t *desc)
{
    DescriptorObject *d = PyObject_New(DescriptorObject, &cbp_Descriptor_Type);
    if (!d) {
        cubuf_ipc_descriptor_destroy(desc);
        return NULL;
    }
    d->desc = desc;
    return (PyObject *)d;
}

static void Descriptor_dealloc(DescriptorObject *self)
{
    cubuf_ipc_descriptor_destroy(self->desc);
    PyObject_Free(self);
}

static PyObject *Descriptor_new(PyTypeObject *t, PyObject *a, PyObject *k)
{
    PyErr_SetString(PyExc_TypeError, "IPCBufferDescriptor objects come from Buffer.ipc_descriptor");
    return NULL;
}

/* _serialize() -> (bytes, (fd, ...)): the fds stay the descriptor's. */
static PyObject *Descriptor_serialize(DescriptorObject *self, PyObject *unused)
{
    size_t len = 0, nfds = 0;
    cubuf_status_t st = cubuf_ipc_descriptor_serialize(self->desc, NULL, &len, NULL, &nfds);
    if (st != CUBUF_SUCCESS) return cbp_fail(st, "IPCBufferDescriptor");
    PyObject *bytes = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)len);
    int *fds = PyMem_Malloc((nfds ? nfds : 1) * sizeof(int));
    if (!bytes || !fds) {
        Py_XDECREF(bytes);
        PyMem_Free(fds);
        return PyErr_NoMemory();
    }
    st = cubuf_ipc_descriptor_serialize(self->desc, PyBytes_AS_STRING(bytes), &len, fds, &nfds);
    PyObject *tuple = st == CUBUF_SUCCESS ? PyTuple_New((Py_ssize_t)nfds) : NULL;
    for (size_t i = 0; tuple && i < nfds; i++) {
        PyObject *fd = PyLong_FromLong(fds[i]);
        if (!fd) Py_CLEAR(tuple);
        else PyTuple_SET_ITEM(tuple, (Py_ssize_t)i, fd);
    }
    PyMem_Free(fds);
    if (!tuple) {
        Py_DECREF(bytes);
        return st == CUBUF_SUCCESS ? NULL : cbp_fail(st, "IPCBufferDescriptor");
    }
    PyObject *r = PyTuple_Pack(2, bytes, tuple);
    Py_DECREF(bytes);
    Py_DECREF(tuple);
    return r;
}

/* Closes each distinct fd of fds[0..n) once (the list may repeat one). */
static void close_fds_once(const int *fds, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        if (fds[i] < 0) continue;
        bool seen = false;
        for (Py_ssize_t j = 0; j < i && !seen; j++) seen = fds[j] == fds[i];
        if (!seen) close(fds[i]);
    }
}

/* _from_wire(bytes, fds) -> descriptor. On success the descriptor owns the
 * fds; once the items are read, a failure closes each of them here, once
 * (they were the caller's to give): every item is read before anything is
 * closed, so an item that is not an fd leaves none of the others open. (A
 * failure to read the sequence or to allocate closes none: the items are
 * not known then.) */
static PyObject *Descriptor_from_wire(PyObject *unused, PyObject *args)
{
    Py_buffer bytes;
    PyObject *fdseq;
    if (!PyArg_ParseTuple(args, "y*O:_from_wire", &bytes, &fdseq)) return NULL;
    PyObject *seq = PySequence_Fast(fdseq, "fds must be a sequence of ints");
    /* a tuple: an item's __index__ runs Python code that could change a list */
    if (seq && !PyTuple_Check(seq)) Py_SETREF(seq, PySequence_Tuple(seq));
    if (!seq) {
        PyBuffer_Release(&bytes);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int *fds = PyMem_Malloc((n ? (size_t)n : 1) * sizeof(int));
    PyObject *r = NULL;
    if (!fds) {
        PyErr_NoMemory();
        goto out;
    }
    PyObject *bad_type = NULL, *bad_value = NULL, *bad_tb = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        fds[i] = -1;
        long fd = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
        if (!(fd == -1 && PyErr_Occurred()) && (fd < 0 || fd > INT_MAX))
            PyErr_Format(PyExc_ValueError, "fds: %ld is not a file descriptor", fd);
        if (PyErr_Occurred()) {
            if (!bad_type) PyErr_Fetch(&bad_type, &bad_value, &bad_tb); /* the first is raised */
            else PyErr_Clear();
            continue;
        }
        fds[i] = (int)fd;
    }
    if (bad_type) {
        close_fds_once(fds, n);
        PyErr_Restore(bad_type, bad_value, bad_tb);
        goto out;
    }
    cubuf_ipc_descriptor_t *desc;
    cubuf_status_t st = cubuf_ipc_descriptor_deserialize(bytes.buf, (size_t)bytes.len, fds, (size_t)n, &desc);
    if (st != CUBUF_SUCCESS) {
        close_fds_once(fds, n);
        cbp_fail(st, "IPCBufferDescriptor");
        goto out;
    }
    r = cbp_descriptor_new(desc);
out:
    PyMem_Free(fds);
    Py_DECREF(seq);
    PyBuffer_Release(&bytes);
    return r;
}

static PyObject *info(DescriptorObject *self, void *which)
{
    cubuf_ipc_descriptor_info_t i = CUBUF_IPC_DESCRIPTOR_INFO_INIT;
    cubuf_status_t st = cubuf_ipc_descriptor_info(self->desc, &i);
    if (st != CUBUF_SUCCESS) return cbp_fail(st, "IPCBufferDescriptor");
    switch ((intptr_t)which) {
    case 0:
        return PyUnicode_FromString(i.mechanism == CUBUF_IPC_MECHANISM_POOL  ? "pool"
                                    : i.mechanism == CUBUF_IPC_MECHANISM_VMM ? "vmm"
                                                                             : "legacy");
    case 1: return PyLong_FromSize_t(i.size);
    case 2: return PyLong_FromSize_t(i.offset);
    case 3: return PyLong_FromSize_t(i.extent);
    case 4: return PyLong_FromSize_t(i.fd_count);
    default: return PyBool_FromLong(i.host_accessible);
    }
}

/* Plain pickle: a descriptor without fds (legacy handles) travels as its
 * bytes; one with fds only through multiprocessing, which duplicates them. */
static PyObject *Descriptor_reduce(DescriptorObject *self, PyObject *unused)
{
    PyObject *ser = Descriptor_serialize(self, NULL);
    if (!ser) return NULL;
    PyObject *fds = PyTuple_GET_ITEM(ser, 1);
    if (PyTuple_GET_SIZE(fds) != 0) {
        PyErr_Format(PyExc_TypeError,
                     "this IPCBufferDescriptor holds %zd file descriptor(s): pickle cannot carry them; send it "
                     "through multiprocessing (a Queue, a Pipe, or a Process argument), which duplicates them",
                     PyTuple_GET_SIZE(fds));
        Py_DECREF(ser);
        return NULL;
    }
    PyObject *from_wire = PyObject_GetAttrString((PyObject *)&cbp_Descriptor_Type, "_from_wire");
    PyObject *r = from_wire ? Py_BuildValue("(O(OO))", from_wire, PyTuple_GET_ITEM(ser, 0), fds) : NULL;
    Py_XDECREF(from_wire);
    Py_DECREF(ser);
    return r;
}

static PyMethodDef Descriptor_methods[] = {
    {"_serialize", (PyCFunction)Descriptor_serialize, METH_NOARGS, "(bytes, fds): the wire format; fds stay owned."},
    {"_from_wire", (PyCFunction)Descriptor_from_wire, METH_VARARGS | METH_STATIC,
     "_from_wire(bytes, fds): validates and takes the fds (closed on failure)."},
    {"__reduce__", (PyCFunction)Descriptor_reduce, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef Descriptor_getset[] = {
    {"mechanism", (getter)info, NULL, "'pool', 'vmm' or 'legacy'.", (void *)0},
    {"size", (getter)info, NULL, NULL, (void *)1},
    {"offset", (getter)info, NULL, NULL, (void *)2},
    {"extent", (getter)info, NULL, NULL, (void *)3},
    {"fd_count", (getter)info, NULL, NULL, (void *)4},
    {"is_host_accessible", (getter)info, NULL, NULL, (void *)5},
    {NULL, NULL, NULL, NULL, NULL}};

PyTypeObject cbp_Descriptor_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "cubuf.IPCBufferDescriptor",
    .tp_basicsize = sizeof(DescriptorObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "What another process needs to map a buffer (Buffer.ipc_descriptor).",
    .tp_new = Descriptor_new,
    .tp_dealloc = (destructor)Descriptor_dealloc,
    .tp_methods = Descriptor_methods,
    .tp_getset = Descriptor_getset,
};
