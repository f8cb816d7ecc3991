/* The cubuf Python extension (cubuf._cubuf): what its files share. Private.
 *
 * The extension is a thin layer over the C library: every operation is one
 * cubuf_* call; this layer parses arguments (METH_FASTCALL, no tuples or
 * dicts on the hot path), maps statuses to the exceptions the reference
 * pages name, and keeps the Python objects a buffer depends on alive. */
#ifndef CUBUFPY_H
#define CUBUFPY_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include <cubuf.h>
#include <cubuf/dlpack.h>

/* ---- objects ------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    cubuf_buffer_t *buf;    /* one reference, released at dealloc */
    PyObject *mr;           /* the MemoryResource object, NULL until asked for (then cached) */
    PyObject *owner;        /* from_handle's owner (also held by the C buffer's release), or NULL */
    PyObject *ipc;          /* the cached ipc_descriptor, or NULL */
    PyObject *stream_ref;   /* the Python stream object last recorded as deallocation stream (kept
                               alive so that the buffer's close never meets a destroyed stream) */
    CUstream work_stream;   /* the stream of the last work issued through this object:
                               the producer's stream for DLPack and the CUDA Array Interface */
    PyObject *work_ref;     /* the Python stream object work_stream came from (kept alive), or NULL */
    _Atomic bool closing;   /* a close is running without the GIL (or, on a free-threaded
                               build, any close is running) on some thread */
    bool read_only;         /* buffer_from_object of read-only memory (a CUDA Array Interface
                               with data[1] true, a read-only host buffer, a read-only Buffer) */
    PyObject *weakreflist;
} BufferObject;

typedef struct {
    PyObject_HEAD
    cubuf_resource_t *res;  /* one reference */
    int device;             /* the ordinal the resource was made for (0 for a wrapped one) */
    PyObject *options;      /* the options object given, or NULL */
    PyObject *weakreflist;
} ResourceObject;

typedef struct {
    PyObject_HEAD
    cubuf_context_t *ctx;
    PyObject *weakreflist;
} ContextObject;

typedef struct {
    PyObject_HEAD
    CUstream handle;
    bool owned;             /* made by cubuf.Stream(): destroyed by close() or dealloc */
    PyObject *keep;         /* what keeps the stream's CUDA context alive (a Context), or NULL */
} StreamObject;

typedef struct {
    PyObject_HEAD
    cubuf_ipc_descriptor_t *desc;
} DescriptorObject;

typedef struct {
    PyObject_HEAD
    cubuf_copy_options_t opts;
    PyObject *src_access_order, *src_location_hint, *dst_location_hint, *overlap_mode;
} CopyOptionsObject;

extern PyTypeObject cbp_Buffer_Type, cbp_VirtualMemoryBuffer_Type;
extern PyTypeObject cbp_MemoryResource_Type, cbp_VirtualMemoryResource_Type;
extern PyTypeObject cbp_Context_Type, cbp_Stream_Type, cbp_Descriptor_Type, cbp_CopyOptions_Type;

/* Resource types other than the base and VMM, defined in resource.c. */
int cbp_resource_types_ready(PyObject *module);

#define cbp_Buffer_Check(o) PyObject_TypeCheck((o), &cbp_Buffer_Type)

/* Whether the producer of b's memory said it must not be written: what
 * exports pass on (DLPack's read-only flag, the CUDA Array Interface's
 * data[1]). Like the C library, cubuf does not enforce it. */
static inline bool cbp_buffer_read_only(const BufferObject *b)
{
    return b->read_only || cubuf_dlpack_is_read_only(b->buf);
}
#define cbp_Resource_Check(o) PyObject_TypeCheck((o), &cbp_MemoryResource_Type)

/* ---- errors (module.c) --------------------------------------------------- */

/* The exception for a failed cubuf call: cubuf.CUDAError (with .result, the
 * CUresult name, .code and .status) for driver failures, otherwise the
 * built-in exception the pages name for the status. The message is
 * "<what>: <STATUS>: <cubuf's detail>". Returns NULL. */
PyObject *cbp_fail(cubuf_status_t st, const char *what);
/* The same with the Python exception chosen by the caller (exc NULL: by status). */
PyObject *cbp_fail_as(PyObject *exc, cubuf_status_t st, const char *what);
extern PyObject *cbp_CUDAError, *cbp_CUDAWarning;
/* cubuf.get_num_devices and Context.get_num_devices (METH_NOARGS). */
PyObject *cbp_get_num_devices(PyObject *unused, PyObject *noargs);

/* ---- arguments (module.c) ------------------------------------------------ */

/* Sorts fastcall arguments into out[0..n): positional ones into the first
 * `npos` slots, keywords by `names`; slots past npos are keyword-only.
 * `required` has bit i set for each slot that must be given. Unset slots
 * are NULL. Returns 0, or -1 with TypeError set. */
int cbp_parse(const char *fname, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
              const char *const *names, int n, int npos, unsigned required, PyObject **out);

/* The one argument `name` of a method taking exactly one (positional or keyword). */
int cbp_one_arg(const char *fname, const char *name, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                PyObject **out);

/* Handles and pointers: anything int() converts (ints, __index__, and
 * objects with __int__ such as cuda.bindings handles); floats and strings
 * are refused. -1 with TypeError / OverflowError set. */
int cbp_handle(PyObject *o, const char *what, unsigned long long *out);
/* A size_t (an int >= 0). -1 with TypeError / OverflowError set. */
int cbp_size(PyObject *o, const char *what, size_t *out);
/* An int64 (pyarrow's offsets and sizes, -1 meaning "the rest"). */
int cbp_int64(PyObject *o, const char *what, int64_t *out);
/* A device: an int ordinal or an object with an int `device_id` (cuda.core's Device). */
int cbp_device(PyObject *o, int *out);

/* A stream: cubuf.Stream, an int handle (0/1 legacy, 2 per-thread), an
 * object with __cuda_stream__ (cuda.core), cuda_stream (torch) or, for
 * types named *Stream, ptr (CuPy), or any handle int() converts. None is
 * refused (TypeError) here; callers that allow it check first. Only an
 * AttributeError skips a protocol: other errors its attribute raises propagate. */
int cbp_stream(PyObject *o, CUstream *out);
/* o.name into *out (a new reference): 1; 0 with no error set when o has no
 * such attribute (an AttributeError, cleared); -1 for any other error,
 * which stays set (a property that raises, a KeyboardInterrupt). */
int cbp_optional_attr(PyObject *o, const char *name, PyObject **out);

/* A per-device cubuf context, kept for the module's life (streams, events). */
cubuf_context_t *cbp_device_context(int device);

/* Makes `consumer` wait for the work queued on `producer` so far (an
 * event recorded on producer, waited on by consumer); nothing when they are
 * the same stream or the producer's work is done. A producer that captures
 * joins the consumer to its capture; the legacy stream while a capture
 * depends on it is refused (CUBUF_ERROR_STREAM_CAPTURING). device: the
 * context both belong to. 0 or -1 with an exception. */
int cbp_stream_handoff(int device, CUstream producer, CUstream consumer);

/* Moves buf's deallocation to the legacy default stream of the device's
 * primary context, made to wait for the work queued on `from` so far: for
 * memory that may outlive `from` (a DLPack consumer holds it, and the
 * stream's Python object may go). Nothing when `from` is the legacy
 * stream. A `from` that captures is left as it is (the legacy stream
 * cannot join a capture): 1. 0 when moved, -1 with an exception. */
int cbp_free_on_legacy(int device, CUstream from, cubuf_buffer_t *buf);

/* Waits for the work queued on `stream` of device's context so far, without
 * the GIL (the work may be a Python host function). A stream that captures
 * (or the legacy stream while a capture depends on it) is refused with
 * CUBUF_ERROR_STREAM_CAPTURING: a synchronization would invalidate the
 * capture. exc: the exception to raise (NULL: cbp_fail's choice); what:
 * names the caller. 0 or -1 with an exception. */
int cbp_stream_sync(int device, CUstream stream, PyObject *exc, const char *what);

/* ---- buffers (buffer.c) -------------------------------------------------- */

/* A new Buffer (or `type`) owning `buf` (stolen: released on failure).
 * mr and owner may be NULL (new references are taken). `work_stream` is
 * where its work was issued; `stream`, the Python object that stream came
 * from (or NULL, None, an int), is kept alive as its work stream's and its
 * deallocation stream's object (cbp_buffer_set_work, cbp_buffer_keep_stream). */
PyObject *cbp_buffer_new(PyTypeObject *type, cubuf_buffer_t *buf, PyObject *mr, PyObject *owner,
                         CUstream work_stream, PyObject *stream);
/* The device whose context the buffer's streams belong to: its memory's,
 * or for host memory its resource's (0 without one). */
int cbp_buffer_stream_device(const BufferObject *self);
/* Frees the buffer objects kept for reuse (at the module's release). */
void cbp_buffer_drop_spares(void);
/* Records `o` as the stream the buffer's deallocation is on: a Python
 * stream object is kept alive as long as the buffer; an int or None (a
 * handle cubuf cannot keep alive) lets the one kept before go, so that the
 * destructor never orders the free after a stream that is no longer the
 * deallocation stream. NULL changes nothing. Returns buffer. */
PyObject *cbp_buffer_keep_stream(PyObject *buffer, PyObject *o);
/* The release function for C buffers that keep a Python object alive. */
void cbp_owner_release(void *owner);
/* A slice of the whole of self's buffer, for work that reads or writes it
 * without the GIL: a close on another thread meanwhile is then refused
 * (BUSY) instead of freeing the memory under the work. Release it after.
 * NULL with an exception set when the buffer is closed or closing. */
cubuf_buffer_t *cbp_buffer_hold(BufferObject *self, const char *what);
/* cubuf_buffer_copy_to_new of self's buffer into *out, its status in *st.
 * A copy that fails after allocating frees what it allocated, and where
 * the buffer's resource frees synchronously that free waits for the device,
 * whose pending work may be a Python host function that needs the GIL:
 * there the copy runs without the GIL, through a hold on the source. -1
 * with a Python error set when no hold can be had; else 0. */
int cbp_buffer_copy_to_new(BufferObject *self, CUstream s, const cubuf_copy_options_t *o,
                           cubuf_buffer_t **out, cubuf_status_t *st, const char *what);
/* 0, or -1 with RuntimeError while a close of self runs without the GIL on
 * another thread: nothing may use or take a reference to the buffer then. */
static inline int cbp_buffer_usable(BufferObject *self, const char *what)
{
    if (!atomic_load_explicit(&self->closing, memory_order_acquire)) return 0;
    PyErr_Format(PyExc_RuntimeError, "%s: the buffer is being closed", what);
    return -1;
}
/* Records s (from the stream argument sobj) as the buffer's work stream,
 * keeping sobj alive when it is an object (not an int or None). Returns buffer. */
PyObject *cbp_buffer_set_work(PyObject *buffer, CUstream s, PyObject *sobj);
/* The release function for C buffers that hold a buffer-protocol export: a
 * Py_buffer on the heap (PyMem_Malloc), released and freed. */
void cbp_export_release(void *export);

/* ---- resources (resource.c) ---------------------------------------------- */

/* A MemoryResource object for a resource made in C (retained). */
PyObject *cbp_resource_wrap(cubuf_resource_t *res);
/* Reads a CopyOptions (or None) into *out / *use. -1 with TypeError. */
int cbp_copy_options(PyObject *o, const cubuf_copy_options_t **out);

/* ---- ipc (ipc.c) ---------------------------------------------------------- */

PyObject *cbp_descriptor_new(cubuf_ipc_descriptor_t *desc); /* steals desc */

/* ---- interop (interop.c) ----------------------------------------------------- */

PyObject *cbp_buffer_dlpack(BufferObject *self, PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames);
PyObject *cbp_buffer_dlpack_device(BufferObject *self, PyObject *unused);
PyObject *cbp_buffer_cai(BufferObject *self, void *closure);
PyObject *cbp_from_dlpack(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                          PyObject *kwnames);
/* Context.buffer_from_object for an object with __cuda_array_interface__:
 * a view of the span it covers, keeping obj alive. NULL with an exception;
 * *handled false (no exception) when obj has no such interface. */
PyObject *cbp_buffer_from_cai(cubuf_context_t *ctx, PyObject *obj, bool *handled);

/* ---- benchmark hooks (bench.c) ------------------------------------------------ */

PyObject *cbp_bench_c_alloc_close(PyObject *m, PyObject *args);
PyObject *cbp_bench_raw(PyObject *m, PyObject *args);

/* ---- the CUDA stream values -------------------------------------------------- */

static inline bool cbp_is_legacy(CUstream s) { return s == NULL || s == CU_STREAM_LEGACY; }
static inline bool cbp_same_stream(CUstream a, CUstream b)
{
    return a == b || (cbp_is_legacy(a) && cbp_is_legacy(b));
}

#endif
