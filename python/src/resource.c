/* Memory resources (cuda.core's MemoryResource family, VirtualMemoryResource) and CopyOptions. */
#include "cubufpy.h"

#include <limits.h>
#include <string.h>

#if PY_VERSION_HEX < 0x030C0000
#include <structmember.h>
#define Py_T_OBJECT_EX T_OBJECT_EX
#define Py_READONLY READONLY
#endif

#include <cubuf/caching.h>

#include "inspect.h" /* whether an allocation may wait */

/* ---- the base type -------------------------------------------------------- */

static PyObject *resource_make(PyTypeObject *type, cubuf_resource_t *res, int device, PyObject *options)
{
    ResourceObject *r = (ResourceObject *)type->tp_alloc(type, 0);
    if (!r) {
        cubuf_resource_release(res);
        return NULL;
    }
    r->res = res;
    r->device = device;
    r->options = Py_XNewRef(options);
    return (PyObject *)r;
}

/* A constructor's end: the create's status, then the object (or the error). */
static PyObject *resource_of(cubuf_status_t st, const char *what, PyTypeObject *type, cubuf_resource_t *res,
                             int device, PyObject *options)
{
    if (st != CUBUF_SUCCESS) return cbp_fail(st, what);
    return resource_make(type, res, device, options);
}

PyObject *cbp_resource_wrap(cubuf_resource_t *res)
{
    cubuf_resource_props_t p = CUBUF_RESOURCE_PROPS_INIT;
    cubuf_resource_props(res, &p);
    return resource_make(&cbp_MemoryResource_Type, cubuf_resource_retain(res), p.device_id < 0 ? 0 : p.device_id,
                         NULL);
}

static void Resource_dealloc(ResourceObject *self)
{
    if (self->weakreflist) PyObject_ClearWeakRefs((PyObject *)self);
    /* Without the GIL: a last release may give memory back through a
     * synchronous upstream, which waits for the device (a caching
     * resource's end), or wait for a stream's give-back in it. */
    Py_BEGIN_ALLOW_THREADS
    cubuf_resource_release(self->res);
    Py_END_ALLOW_THREADS
    Py_XDECREF(self->options);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Resource_new_base(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyErr_SetString(PyExc_TypeError, "MemoryResource is the base class: create one of its subclasses");
    return NULL;
}

static PyObject *Resource_allocate(ResourceObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *a[2];
    if (nargs <= 2 && nargs > 0 && !kwnames) { /* allocate(size) and allocate(size, stream) */
        a[0] = args[0];
        a[1] = nargs == 2 ? args[1] : NULL;
    } else {
        static const char *const names[] = {"size", "stream"};
        if (cbp_parse("allocate", args, nargs, kwnames, names, 2, 2, 1u, a) < 0) return NULL;
    }
    size_t size;
    if (cbp_size(a[0], "size", &size) < 0) return NULL;
    CUstream s = CU_STREAM_LEGACY;
    if (a[1] && a[1] != Py_None && cbp_stream(a[1], &s) < 0) return NULL;
    cubuf_buffer_t *buf;
    cubuf_status_t st;
    /* A caching resource's allocation may wait for the device (its release
     * and retry on out of memory; another thread's give-back holding the
     * cache's lock across a synchronous free), whose work may need the GIL
     * (a Python host function). The others keep it, saving ~40 ns. */
    if (cubuf__inspect_allocate_may_wait(self->res)) {
        Py_BEGIN_ALLOW_THREADS
        st = cubuf_resource_allocate(self->res, size, s, &buf);
        Py_END_ALLOW_THREADS
    } else {
        st = cubuf_resource_allocate(self->res, size, s, &buf);
    }
    if (st != CUBUF_SUCCESS) return cbp_fail(st, "allocate");
    PyTypeObject *bt = Py_IS_TYPE(self, &cbp_VirtualMemoryResource_Type) ? &cbp_VirtualMemoryBuffer_Type
                                                                          : &cbp_Buffer_Type;
    return cbp_buffer_new(bt, buf, (PyObject *)self, NULL, s, a[1]);
}

static PyObject *Resource_deallocate(ResourceObject *self, PyObject *const *args, Py_ssize_t nargs,
                                     PyObject *kwnames)
{
    static const char *const names[] = {"ptr", "size", "stream"};
    PyObject *a[3];
    if (cbp_parse("deallocate", args, nargs, kwnames, names, 3, 3, 3u, a) < 0) return NULL;
    unsigned long long ptr;
    size_t size;
    CUstream s = CU_STREAM_LEGACY;
    if (cbp_handle(a[0], "ptr", &ptr) < 0 || cbp_size(a[1], "size", &size) < 0 ||
        (a[2] && a[2] != Py_None && cbp_stream(a[2], &s) < 0))
        return NULL;
    /* A synchronous resource's free waits for the device (cuMemFree), and
     * work it waits for may need the GIL (a Python host function). */
    cubuf_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = cubuf_resource_deallocate_raw(self->res, (CUdeviceptr)ptr, size, s);
    Py_END_ALLOW_THREADS
    if (st != CUBUF_SUCCESS) return cbp_fail(st, "deallocate");
    Py_RETURN_NONE;
}

static PyObject *Resource_props(ResourceObject *self, void *which)
{
    cubuf_resource_props_t p = CUBUF_RESOURCE_PROPS_INIT;
    cubuf_resource_props(self->res, &p);
    switch ((intptr_t)which) {
    case 0: return PyLong_FromLong(p.device_id);
    case 1: return PyBool_FromLong(p.device_accessible);
    case 2: return PyBool_FromLong(p.host_accessible);
    case 3: return PyBool_FromLong(p.managed);
    default: return PyBool_FromLong(p.ipc_enabled);
    }
}

static PyObject *Resource_stats(ResourceObject *self, void *c)
{
    cubuf_resource_stats_t s = CUBUF_RESOURCE_STATS_INIT;
    cubuf_status_t st = cubuf_resource_stats(self->res, &s);
    if (st != CUBUF_SUCCESS) return cbp_fail(st, "stats");
    return Py_BuildValue("{snsnsnsnsKsKsKsKsK}", "current_bytes", (Py_ssize_t)s.current_bytes, "peak_bytes",
                         (Py_ssize_t)s.peak_bytes, "current_count", (Py_ssize_t)s.current_count, "peak_count",
                         (Py_ssize_t)s.peak_count, "total_allocations", (unsigned long long)s.total_allocations,
                         "pool_reserved_current", (unsigned long long)s.pool_reserved_current,
                         "pool_reserved_high", (unsigned long long)s.pool_reserved_high, "pool_used_current",
                         (unsigned long long)s.pool_used_current, "pool_used_high",
                         (unsigned long long)s.pool_used_high);
}

static PyObject *Resource_options(ResourceObject *self, void *c)
{
    return Py_NewRef(self->options ? self->options : Py_None);
}

static PyObject *Resource_repr(ResourceObject *self)
{
    return PyUnicode_FromFormat("<%s device=%d>", Py_TYPE(self)->tp_name, self->device);
}

static PyMethodDef Resource_methods[] = {
    {"allocate", (PyCFunction)(void (*)(void))Resource_allocate, METH_FASTCALL | METH_KEYWORDS,
     "allocate(size, stream=None) -> Buffer, ordered on `stream` (None: the legacy default stream), which\n"
     "becomes the buffer's deallocation stream."},
    {"deallocate", (PyCFunction)(void (*)(void))Resource_deallocate, METH_FASTCALL | METH_KEYWORDS,
     "deallocate(ptr, size, stream=None): frees a raw allocation of this resource (what a Buffer made by\n"
     "Buffer.from_handle(ptr, size, mr) does when it closes)."},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef Resource_getset[] = {
    {"device_id", (getter)Resource_props, NULL, "Device of the memory, -1 for none.", (void *)0},
    {"is_device_accessible", (getter)Resource_props, NULL, NULL, (void *)1},
    {"is_host_accessible", (getter)Resource_props, NULL, NULL, (void *)2},
    {"is_managed", (getter)Resource_props, NULL, NULL, (void *)3},
    {"is_ipc_enabled", (getter)Resource_props, NULL, NULL, (void *)4},
    {"stats", (getter)Resource_stats, NULL, "Usage counters (dict; cubuf_resource_stats).", NULL},
    {"options", (getter)Resource_options, NULL, "The options the resource was made with, or None.", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

PyTypeObject cbp_MemoryResource_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "cubuf.MemoryResource",
    .tp_basicsize = sizeof(ResourceObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "A memory resource: allocates Buffers and frees them when they close.",
    .tp_new = Resource_new_base,
    .tp_dealloc = (destructor)Resource_dealloc,
    .tp_methods = Resource_methods,
    .tp_getset = Resource_getset,
    .tp_repr = (reprfunc)Resource_repr,
    .tp_weaklistoffset = offsetof(ResourceObject, weakreflist),
};

/* ---- options objects (plain Python objects read by attribute) ------------- */

/* The attribute `name` of `o`, or a new reference to `dflt` when o is None
 * or lacks it. */
static PyObject *opt(PyObject *o, const char *name, PyObject *dflt)
{
    if (o && o != Py_None) {
        PyObject *v = PyObject_GetAttrString(o, name);
        if (v) return v;
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return NULL;
        PyErr_Clear();
    }
    return Py_NewRef(dflt);
}

/* A truth-valued option; absent gives dflt. */
static int opt_bool(PyObject *o, const char *name, bool dflt, bool *out)
{
    PyObject *v = opt(o, name, dflt ? Py_True : Py_False);
    if (!v) return -1;
    int t = PyObject_IsTrue(v);
    Py_DECREF(v);
    if (t < 0) return -1;
    *out = t;
    return 0;
}

static int opt_size(PyObject *o, const char *name, size_t dflt, size_t *out)
{
    PyObject *v = opt(o, name, Py_None);
    if (!v) return -1;
    int rc = 0;
    if (v == Py_None) *out = dflt;
    else rc = cbp_size(v, name, out);
    Py_DECREF(v);
    return rc;
}

/* The index of str v among `choices` (NULL-terminated). */
static int choice_of(PyObject *v, const char *name, const char *const *choices, int *out)
{
    if (!PyUnicode_Check(v)) {
        PyErr_Format(PyExc_TypeError, "%s must be a str, not %.200s", name, Py_TYPE(v)->tp_name);
        return -1;
    }
    for (int i = 0; choices[i]; i++)
        if (PyUnicode_CompareWithASCIIString(v, choices[i]) == 0) return (*out = i), 0;
    PyErr_Format(PyExc_ValueError, "%s %R is not one of the accepted values", name, v);
    return -1;
}

/* A string option among `choices`; None gives dflt. */
static int opt_choice(PyObject *o, const char *name, const char *const *choices, int dflt, int *out)
{
    PyObject *v = opt(o, name, Py_None);
    if (!v) return -1;
    int rc = 0;
    if (v == Py_None) *out = dflt;
    else rc = choice_of(v, name, choices, out);
    Py_DECREF(v);
    return rc;
}

static int resource_device_arg(PyObject *args, PyObject *kwds, const char *fname, bool device_first,
                               int *device, PyObject **options)
{
    static char *kw_dev_first[] = {"device", "options", NULL};
    static char *kw_opt_first[] = {"options", "device", NULL};
    PyObject *dev = NULL, *o = NULL;
    char fmt[64];
    snprintf(fmt, sizeof fmt, "%s|O:%s", device_first ? "O" : "", fname);
    int ok = device_first ? PyArg_ParseTupleAndKeywords(args, kwds, fmt, kw_dev_first, &dev, &o)
                          : PyArg_ParseTupleAndKeywords(args, kwds, "|OO", kw_opt_first, &o, &dev);
    if (!ok) return -1;
    *device = 0;
    if (dev && dev != Py_None && cbp_device(dev, device) < 0) return -1;
    *options = o && o != Py_None ? o : NULL;
    return 0;
}

/* ---- the built-in resources ------------------------------------------------- */

static PyObject *DeviceResource_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    int d;
    PyObject *o;
    if (resource_device_arg(args, kwds, "DeviceMemoryResource", true, &d, &o) < 0) return NULL;
    cubuf_device_resource_options_t opts = CUBUF_DEVICE_RESOURCE_OPTIONS_INIT;
    if (o) {
        opts.private_pool = true;
        if (opt_bool(o, "ipc_enabled", false, &opts.ipc_enabled) < 0 || opt_size(o, "max_size", 0, &opts.max_size) < 0 ||
            opt_size(o, "release_threshold", CUBUF_RELEASE_THRESHOLD_DEFAULT, &opts.release_threshold) < 0)
            return NULL;
    }
    cubuf_resource_t *res;
    cubuf_status_t st = cubuf_device_resource_create(d, &opts, &res);
    return resource_of(st, "DeviceMemoryResource", type, res, d, o);
}

static PyObject *PinnedResource_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    int d;
    PyObject *o;
    if (resource_device_arg(args, kwds, "PinnedMemoryResource", false, &d, &o) < 0) return NULL;
    bool ipc = false;
    if (opt_bool(o, "ipc_enabled", false, &ipc) < 0) return NULL;
    cubuf_resource_t *res;
    cubuf_status_t st = cubuf_pinned_resource_create(d, ipc, &res);
    return resource_of(st, "PinnedMemoryResource", type, res, d, o);
}

static PyObject *ManagedResource_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    int d;
    PyObject *o;
    if (resource_device_arg(args, kwds, "ManagedMemoryResource", false, &d, &o) < 0) return NULL;
    PyObject *v = opt(o, "preferred_location", Py_None);
    if (!v) return NULL;
    long loc = -2;
    if (v != Py_None) {
        loc = PyLong_Check(v) ? PyLong_AsLong(v) : (PyErr_SetString(PyExc_TypeError, "preferred_location must be an int or None"), -1);
        if (!PyErr_Occurred() && (loc < INT_MIN || loc > INT_MAX))
            PyErr_Format(PyExc_ValueError, "preferred_location %ld is not a device", loc);
    }
    Py_DECREF(v);
    if (PyErr_Occurred()) return NULL;
    cubuf_resource_t *res;
    cubuf_status_t st = cubuf_managed_resource_create(d, (int)loc, &res);
    return resource_of(st, "ManagedMemoryResource", type, res, d, o);
}

static PyObject *CachingResource_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"upstream", "options", NULL};
    PyObject *up, *o = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!|O:CachingMemoryResource", kw, &cbp_MemoryResource_Type, &up, &o))
        return NULL;
    o = o && o != Py_None ? o : NULL;
    cubuf_caching_options_t opts = CUBUF_CACHING_OPTIONS_INIT;
    if (opt_bool(o, "cross_stream", true, &opts.cross_stream) < 0 ||
        opt_size(o, "max_cached_size", 0, &opts.max_cached_size) < 0 ||
        opt_size(o, "release_threshold", SIZE_MAX, &opts.release_threshold) < 0)
        return NULL;
    cubuf_resource_t *res;
    cubuf_status_t st = cubuf_caching_resource_create(((ResourceObject *)up)->res, &opts, &res);
    return resource_of(st, "CachingMemoryResource", type, res, ((ResourceObject *)up)->device, o);
}

/* None, or the failure raised. */
static PyObject *caching_done(cubuf_status_t st, const char *what)
{
    if (st != CUBUF_SUCCESS) return cbp_fail(st, what);
    Py_RETURN_NONE;
}

/* trim and forget_stream run without the GIL: a give-back calls the
 * upstream's deallocate, which may wait for the device (a synchronous
 * resource, where a Python host function may wait for the GIL). */
static PyObject *Caching_trim(ResourceObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"bytes_to_keep"};
    PyObject *a[1];
    size_t keep = 0;
    if (cbp_parse("trim", args, nargs, kwnames, names, 1, 1, 0, a) < 0 ||
        (a[0] && cbp_size(a[0], "bytes_to_keep", &keep) < 0))
        return NULL;
    cubuf_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = cubuf_caching_trim(self->res, keep);
    Py_END_ALLOW_THREADS
    return caching_done(st, "CachingMemoryResource.trim");
}

static PyObject *Caching_forget_stream(ResourceObject *self, PyObject *const *args, Py_ssize_t nargs,
                                       PyObject *kwnames)
{
    PyObject *o;
    CUstream s;
    if (cbp_one_arg("forget_stream", "stream", args, nargs, kwnames, &o) < 0 || cbp_stream(o, &s) < 0) return NULL;
    cubuf_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = cubuf_caching_forget_stream(self->res, s);
    Py_END_ALLOW_THREADS
    return caching_done(st, "CachingMemoryResource.forget_stream");
}

static PyObject *Caching_cache_stats(ResourceObject *self, void *c)
{
    cubuf_caching_stats_t s = CUBUF_CACHING_STATS_INIT;
    cubuf_status_t st;
    Py_BEGIN_ALLOW_THREADS /* the cache's lock, which a give-back holds across the upstream's free */
    st = cubuf_caching_stats(self->res, &s);
    Py_END_ALLOW_THREADS
    if (st != CUBUF_SUCCESS) return cbp_fail(st, "cache_stats");
    return Py_BuildValue("{snsnsnsnsKsK}", "cached_bytes", (Py_ssize_t)s.cached_bytes, "cached_count",
                         (Py_ssize_t)s.cached_count, "held_bytes", (Py_ssize_t)s.held_bytes, "live_bytes",
                         (Py_ssize_t)s.live_bytes, "hits", (unsigned long long)s.hits, "misses",
                         (unsigned long long)s.misses);
}

static PyMethodDef Caching_methods[] = {
    {"trim", (PyCFunction)(void (*)(void))Caching_trim, METH_FASTCALL | METH_KEYWORDS,
     "trim(bytes_to_keep=0): gives cached blocks back to the upstream until at most bytes_to_keep\n"
     "stay cached, each ordered on the stream it is cached on."},
    {"forget_stream", (PyCFunction)(void (*)(void))Caching_forget_stream, METH_FASTCALL | METH_KEYWORDS,
     "forget_stream(stream): gives the blocks cached on `stream` back to the upstream, ordered on it,\n"
     "so that it may be destroyed. A cubuf.Stream does this itself when closed or dropped; call it\n"
     "before destroying any other stream that freed into the resource (torch's, CuPy's, a handle)."},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef Caching_getset[] = {
    {"cache_stats", (getter)Caching_cache_stats, NULL,
     "The cache's counters (dict; cubuf_caching_stats): cached_bytes, cached_count, held_bytes,\n"
     "live_bytes, hits, misses.", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject Caching_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "cubuf.CachingMemoryResource",
    .tp_basicsize = sizeof(ResourceObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "CachingMemoryResource(upstream, options=None): a stream-ordered cache of size classes over\n"
              "another resource (CachingMemoryResourceOptions: max_cached_size, release_threshold,\n"
              "cross_stream). Cached blocks go back to the upstream on the streams they were freed on (trim,\n"
              "forget_stream, closing or dropping a cubuf.Stream, the resource's end): another stream that\n"
              "freed into it must not be destroyed before forget_stream(stream).",
    .tp_base = &cbp_MemoryResource_Type,
    .tp_new = CachingResource_new,
    .tp_methods = Caching_methods,
    .tp_getset = Caching_getset,
};

typedef cubuf_status_t (*simple_create_fn)(int, cubuf_resource_t **);

static PyObject *simple_new(PyTypeObject *type, PyObject *args, PyObject *kwds, const char *name,
                            simple_create_fn create)
{
    static char *kw[] = {"device", NULL};
    PyObject *dev = NULL;
    char fmt[64];
    snprintf(fmt, sizeof fmt, "|O:%s", name);
    if (!PyArg_ParseTupleAndKeywords(args, kwds, fmt, kw, &dev)) return NULL;
    int d = 0;
    if (dev && dev != Py_None && cbp_device(dev, &d) < 0) return NULL;
    cubuf_resource_t *res;
    cubuf_status_t st = create(d, &res);
    return resource_of(st, name, type, res, d, NULL);
}

static PyObject *LegacyPinned_new(PyTypeObject *t, PyObject *a, PyObject *k)
{
    return simple_new(t, a, k, "LegacyPinnedMemoryResource", cubuf_legacy_pinned_resource_create);
}
static PyObject *SyncDevice_new(PyTypeObject *t, PyObject *a, PyObject *k)
{
    return simple_new(t, a, k, "SyncDeviceMemoryResource", cubuf_sync_device_resource_create);
}
static PyObject *Graph_new(PyTypeObject *t, PyObject *a, PyObject *k)
{
    return simple_new(t, a, k, "GraphMemoryResource", cubuf_graph_resource_create);
}

#define CBP_RESOURCE_TYPE(var, name, newfn, doc)                                                 \
    static PyTypeObject var = {                                                                  \
        PyVarObject_HEAD_INIT(NULL, 0).tp_name = "cubuf." name,                                  \
        .tp_basicsize = sizeof(ResourceObject),                                                  \
        .tp_flags = Py_TPFLAGS_DEFAULT,                                                          \
        .tp_doc = doc,                                                                           \
        .tp_base = &cbp_MemoryResource_Type,                                                     \
        .tp_new = newfn,                                                                         \
    };

CBP_RESOURCE_TYPE(DeviceResource_Type, "DeviceMemoryResource", DeviceResource_new,
                  "DeviceMemoryResource(device, options=None): stream-ordered device memory. Without options\n"
                  "the device's default pool; with DeviceMemoryResourceOptions a private pool (ipc_enabled,\n"
                  "max_size, release_threshold).")
CBP_RESOURCE_TYPE(PinnedResource_Type, "PinnedMemoryResource", PinnedResource_new,
                  "PinnedMemoryResource(options=None, device=0): pinned host memory from a stream-ordered pool\n"
                  "with access granted to `device` (options.ipc_enabled to share it).")
CBP_RESOURCE_TYPE(ManagedResource_Type, "ManagedMemoryResource", ManagedResource_new,
                  "ManagedMemoryResource(options=None, device=0): managed memory (options.preferred_location:\n"
                  "a device, -1 for the host, None for no preference).")
CBP_RESOURCE_TYPE(LegacyPinned_Type, "LegacyPinnedMemoryResource", LegacyPinned_new,
                  "LegacyPinnedMemoryResource(device=0): cuMemHostAlloc pinned memory.")
CBP_RESOURCE_TYPE(SyncDevice_Type, "SyncDeviceMemoryResource", SyncDevice_new,
                  "SyncDeviceMemoryResource(device=0): cuMemAlloc memory (shared through legacy IPC handles).")
CBP_RESOURCE_TYPE(Graph_Type, "GraphMemoryResource", Graph_new,
                  "GraphMemoryResource(device): allocations inside stream capture (graph memory nodes).")

/* ---- VirtualMemoryResource ------------------------------------------------------ */

static const char *const vmm_alloc_types[] = {"pinned", "managed", NULL};
static const char *const vmm_locations[] = {"device", "host", "host_numa", "host_numa_current", NULL};
static const char *const vmm_handles[] = {"none", "posix_fd", "fabric", NULL};
static const char *const vmm_granularities[] = {"recommended", "minimum", NULL};
static const char *const vmm_access[] = {"rw", "r", "none", NULL};

/* VirtualMemoryResourceOptions (cubuf/__init__.py) into the C options. */
static int vmm_options(PyObject *o, cubuf_vmm_options_t *out)
{
    cubuf_vmm_options_t v = CUBUF_VMM_OPTIONS_INIT;
    int e[6];
    size_t hint = 0;
    if (opt_choice(o, "allocation_type", vmm_alloc_types, 0, &e[0]) < 0 ||
        opt_choice(o, "location_type", vmm_locations, 0, &e[1]) < 0 ||
        opt_choice(o, "handle_type", vmm_handles, 0, &e[2]) < 0 ||
        opt_choice(o, "granularity", vmm_granularities, 0, &e[3]) < 0 ||
        opt_choice(o, "self_access", vmm_access, 0, &e[4]) < 0 || opt_choice(o, "peer_access", vmm_access, 0, &e[5]) < 0 ||
        opt_bool(o, "gpu_direct_rdma", false, &v.gpu_direct_rdma) < 0 || opt_size(o, "addr_hint", 0, &hint) < 0 ||
        opt_size(o, "addr_align", 0, &v.address_alignment) < 0)
        return -1;
    v.address_hint = (CUdeviceptr)hint;
    v.allocation_type = (cubuf_vmm_allocation_type_t)e[0];
    v.location = (cubuf_vmm_location_t)e[1];
    v.handle_type = (cubuf_vmm_handle_type_t)e[2];
    v.granularity = (cubuf_vmm_granularity_kind_t)e[3];
    v.owner_access = (cubuf_vmm_access_t)e[4];
    v.peer_access = (cubuf_vmm_access_t)e[5];
    PyObject *lid = opt(o, "location_id", Py_None);
    if (!lid) return -1;
    if (lid != Py_None) {
        long x = PyLong_Check(lid) ? PyLong_AsLong(lid) : (PyErr_SetString(PyExc_TypeError, "location_id must be an int or None"), -1);
        if (!PyErr_Occurred() && (x < INT_MIN || x > INT_MAX))
            PyErr_Format(PyExc_ValueError, "location_id %ld is out of range", x);
        if (PyErr_Occurred()) {
            Py_DECREF(lid);
            return -1;
        }
        v.location_id = (int)x;
    }
    Py_DECREF(lid);
    PyObject *peers = opt(o, "peers", Py_None);
    if (!peers) return -1;
    if (peers != Py_None) {
        PyObject *seq = PySequence_Fast(peers, "peers must be an iterable of devices");
        Py_DECREF(peers);
        /* a tuple: reading a device (device_id) runs Python code that could change a list */
        if (seq && !PyTuple_Check(seq)) Py_SETREF(seq, PySequence_Tuple(seq));
        if (!seq) return -1;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        if (n > CUBUF_VMM_MAX_PEERS) {
            Py_DECREF(seq);
            PyErr_Format(PyExc_ValueError, "peers: at most %d devices", CUBUF_VMM_MAX_PEERS);
            return -1;
        }
        for (Py_ssize_t i = 0; i < n; i++)
            if (cbp_device(PySequence_Fast_GET_ITEM(seq, i), &v.peers[i]) < 0) {
                Py_DECREF(seq);
                return -1;
            }
        v.peer_count = (unsigned)n;
        Py_DECREF(seq);
    } else {
        Py_DECREF(peers);
    }
    *out = v;
    return 0;
}

static PyObject *Vmm_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"device", "config", NULL};
    PyObject *dev, *cfg = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|O:VirtualMemoryResource", kw, &dev, &cfg)) return NULL;
    int d;
    if (cbp_device(dev, &d) < 0) return NULL;
    cfg = cfg && cfg != Py_None ? cfg : NULL;
    cubuf_vmm_options_t o;
    if (vmm_options(cfg, &o) < 0) return NULL;
    cubuf_resource_t *res;
    cubuf_status_t st = cubuf_vmm_resource_create(d, &o, &res);
    return resource_of(st, "VirtualMemoryResource", type, res, d, cfg);
}

static PyObject *Vmm_modify_allocation(ResourceObject *self, PyObject *const *args, Py_ssize_t nargs,
                                       PyObject *kwnames)
{
    static const char *const names[] = {"buf", "new_size", "config"};
    PyObject *a[3];
    if (cbp_parse("modify_allocation", args, nargs, kwnames, names, 3, 3, 3u, a) < 0) return NULL;
    if (!cbp_Buffer_Check(a[0]))
        return PyErr_Format(PyExc_TypeError, "modify_allocation: expected a cubuf.Buffer, not %.200s",
                            Py_TYPE(a[0])->tp_name);
    size_t n;
    if (cbp_size(a[1], "new_size", &n) < 0) return NULL;
    cubuf_vmm_options_t o, *po = NULL;
    if (a[2] && a[2] != Py_None) {
        if (vmm_options(a[2], &o) < 0) return NULL;
        po = &o;
    }
    BufferObject *b = (BufferObject *)a[0];
    if (cbp_buffer_usable(b, "modify_allocation") < 0) return NULL;
    cubuf_buffer_t *out;
    cubuf_status_t st = cubuf_vmm_modify_allocation(self->res, b->buf, n, po, &out);
    if (st != CUBUF_SUCCESS) return cbp_fail(st, "modify_allocation");
    /* the new buffer works where b did and is freed on b's deallocation stream */
    PyObject *nb = cbp_buffer_new(&cbp_VirtualMemoryBuffer_Type, out, (PyObject *)self, NULL, b->work_stream,
                                  b->work_ref);
    return cbp_buffer_keep_stream(nb, b->stream_ref ? b->stream_ref : Py_None);
}

static PyObject *Vmm_granularity(ResourceObject *self, void *c)
{
    size_t g = 0;
    cubuf_status_t st = cubuf_vmm_granularity(self->res, &g);
    if (st != CUBUF_SUCCESS) return cbp_fail(st, "granularity");
    return PyLong_FromSize_t(g);
}

static PyMethodDef Vmm_methods[] = {
    {"modify_allocation", (PyCFunction)(void (*)(void))Vmm_modify_allocation, METH_FASTCALL | METH_KEYWORDS,
     "modify_allocation(buf, new_size, config=None) -> VirtualMemoryBuffer aliasing `buf` (which stays open)."},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef Vmm_getset[] = {
    {"granularity", (getter)Vmm_granularity, NULL, "Bytes sizes and addresses are rounded to.", NULL},
    {"config", (getter)Resource_options, NULL, "The VirtualMemoryResourceOptions given, or None.", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

PyTypeObject cbp_VirtualMemoryResource_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "cubuf.VirtualMemoryResource",
    .tp_basicsize = sizeof(ResourceObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "VirtualMemoryResource(device, config=None): virtual memory buffers that grow by remapping.",
    .tp_base = &cbp_MemoryResource_Type,
    .tp_new = Vmm_new,
    .tp_methods = Vmm_methods,
    .tp_getset = Vmm_getset,
};

int cbp_resource_types_ready(PyObject *m)
{
    struct {
        PyTypeObject *t;
        const char *name;
    } types[] = {{&DeviceResource_Type, "DeviceMemoryResource"},   {&PinnedResource_Type, "PinnedMemoryResource"},
                 {&ManagedResource_Type, "ManagedMemoryResource"}, {&LegacyPinned_Type, "LegacyPinnedMemoryResource"},
                 {&SyncDevice_Type, "SyncDeviceMemoryResource"},   {&Graph_Type, "GraphMemoryResource"},
                 {&Caching_Type, "CachingMemoryResource"}};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
        if (PyType_Ready(types[i].t) < 0 || PyModule_AddObjectRef(m, types[i].name, (PyObject *)types[i].t) < 0)
            return -1;
    return 0;
}

/* ---- CopyOptions ------------------------------------------------------------------ */

static const char *const access_orders[] = {"stream", "during_api_call", "any", NULL};
static const char *const overlap_modes[] = {"default", "prefer_overlap_with_compute", NULL};

/* A location hint: None, a device (int or .device_id), "host", or an object
 * with numa_id (cubuf.Host: None for the host, an int for a NUMA node). */
static int location_hint(PyObject *v, const char *name, cubuf_location_hint_t *kind, int *id)
{
    *kind = CUBUF_LOCATION_NONE;
    *id = 0;
    if (v == Py_None) return 0;
    if (PyUnicode_Check(v)) {
        if (PyUnicode_CompareWithASCIIString(v, "host") == 0) return (*kind = CUBUF_LOCATION_HOST), 0;
        PyErr_Format(PyExc_ValueError, "%s %R: use a device, cubuf.Host() or None", name, v);
        return -1;
    }
    PyObject *numa;
    int has = cbp_optional_attr(v, "numa_id", &numa);
    if (has < 0) return -1; /* numa_id raised: its error stands */
    if (has) {
        int rc = 0;
        if (numa == Py_None) {
            *kind = CUBUF_LOCATION_HOST;
        } else {
            long n = PyLong_AsLong(numa);
            if (n == -1 && PyErr_Occurred()) rc = -1;
            else if (n < 0) rc = (PyErr_Format(PyExc_ValueError, "%s: negative NUMA id", name), -1);
            else if (n > INT_MAX) rc = (PyErr_Format(PyExc_ValueError, "%s: NUMA id %ld is out of range", name, n), -1);
            else *kind = CUBUF_LOCATION_HOST_NUMA, *id = (int)n;
        }
        Py_DECREF(numa);
        return rc;
    }
    if (cbp_device(v, id) < 0) return -1;
    *kind = CUBUF_LOCATION_DEVICE;
    return 0;
}

static PyObject *CopyOptions_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"src_access_order", "src_location_hint", "dst_location_hint", "overlap_mode", NULL};
    PyObject *order = NULL, *src = Py_None, *dst = Py_None, *overlap = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|OOOO:CopyOptions", kw, &order, &src, &dst, &overlap)) return NULL;
    cubuf_copy_options_t o = CUBUF_COPY_OPTIONS_INIT;
    int e = 0;
    if (order && choice_of(order, "src_access_order", access_orders, &e) < 0) return NULL;
    o.src_access_order = (cubuf_src_access_order_t)e;
    e = 0;
    if (overlap && choice_of(overlap, "overlap_mode", overlap_modes, &e) < 0) return NULL;
    o.prefer_overlap_with_compute = e == 1;
    if (location_hint(src, "src_location_hint", &o.src_location, &o.src_location_id) < 0 ||
        location_hint(dst, "dst_location_hint", &o.dst_location, &o.dst_location_id) < 0)
        return NULL;
    CopyOptionsObject *self = (CopyOptionsObject *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->opts = o;
    self->src_access_order = order ? Py_NewRef(order) : PyUnicode_FromString("stream");
    self->overlap_mode = overlap ? Py_NewRef(overlap) : PyUnicode_FromString("default");
    self->src_location_hint = Py_NewRef(src);
    self->dst_location_hint = Py_NewRef(dst);
    if (!self->src_access_order || !self->overlap_mode) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static void CopyOptions_dealloc(CopyOptionsObject *self)
{
    Py_XDECREF(self->src_access_order);
    Py_XDECREF(self->src_location_hint);
    Py_XDECREF(self->dst_location_hint);
    Py_XDECREF(self->overlap_mode);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

int cbp_copy_options(PyObject *o, const cubuf_copy_options_t **out)
{
    *out = NULL;
    if (!o || o == Py_None) return 0;
    if (!PyObject_TypeCheck(o, &cbp_CopyOptions_Type)) {
        PyErr_Format(PyExc_TypeError, "options must be a cubuf.CopyOptions, not %.200s", Py_TYPE(o)->tp_name);
        return -1;
    }
    *out = &((CopyOptionsObject *)o)->opts;
    return 0;
}

static PyMemberDef CopyOptions_members[] = {
    {"src_access_order", Py_T_OBJECT_EX, offsetof(CopyOptionsObject, src_access_order), Py_READONLY, NULL},
    {"src_location_hint", Py_T_OBJECT_EX, offsetof(CopyOptionsObject, src_location_hint), Py_READONLY, NULL},
    {"dst_location_hint", Py_T_OBJECT_EX, offsetof(CopyOptionsObject, dst_location_hint), Py_READONLY, NULL},
    {"overlap_mode", Py_T_OBJECT_EX, offsetof(CopyOptionsObject, overlap_mode), Py_READONLY, NULL},
    {NULL, 0, 0, 0, NULL}};

PyTypeObject cbp_CopyOptions_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "cubuf.CopyOptions",
    .tp_basicsize = sizeof(CopyOptionsObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "CopyOptions(src_access_order='stream', src_location_hint=None, dst_location_hint=None,\n"
              "overlap_mode='default'): transfer hints for copy_to / copy_from. src_access_order: 'stream',\n"
              "'during_api_call' or 'any'; hints: a device, cubuf.Host() or None; overlap_mode: 'default' or\n"
              "'prefer_overlap_with_compute'.",
    .tp_new = CopyOptions_new,
    .tp_dealloc = (destructor)CopyOptions_dealloc,
    .tp_members = CopyOptions_members,
};
