/* Buffers: creation in the three from_handle modes, slices, close, attributes. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* Buffer objects are recycled through a small per-thread cache: allocate +
 * free of a pool buffer costs about 0.6 us in the driver, and malloc/free of
 * the object would add a visible share of that on the hot path. Objects
 * freed on one thread may be reused by it; a thread's cache is freed when
 * the thread exits. */
static _Thread_local cubuf__buffer_cache_t *tls_cache;
CUBUF_TLS_ACCESSOR cubuf__buffer_cache_t **cubuf__buffer_cache_slot(void) { return &tls_cache; }
static pthread_key_t cache_key;
static pthread_once_t cache_once = PTHREAD_ONCE_INIT;
static bool cache_key_ok;

static void cache_destroy(void *p)
{
    cubuf__buffer_cache_t *c = p;
    for (unsigned i = 0; i < c->n; i++) free(c->objs[i]);
    free(c);
    *cubuf__buffer_cache_slot() = NULL; /* runs on the exiting thread itself */
}

static void cache_key_make(void) { cache_key_ok = pthread_key_create(&cache_key, cache_destroy) == 0; }

/* This thread's cache, made on first use; NULL if it cannot be made. */
static cubuf__buffer_cache_t *thread_cache(void)
{
    cubuf__buffer_cache_t **slot = cubuf__buffer_cache_slot();
    if (*slot) return *slot;
    pthread_once(&cache_once, cache_key_make);
    if (!cache_key_ok) return NULL;
    cubuf__buffer_cache_t *c = cubuf__calloc(1, sizeof *c);
    if (!c) return NULL;
    if (pthread_setspecific(cache_key, c) != 0) {
        free(c);
        return NULL;
    }
    return *slot = c;
}

cubuf_status_t cubuf__buffer_new_slow(cubuf_buffer_t **out)
{
    cubuf_buffer_t *buf = cubuf__malloc(sizeof *buf);
    if (!buf) return cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "cannot allocate a buffer object");
    cubuf__buffer_init(buf);
    *out = buf;
    return CUBUF_SUCCESS;
}

void cubuf__buffer_discard_slow(cubuf_buffer_t *buf)
{
    cubuf__buffer_cache_t *c = thread_cache();
    if (c && c->n < CUBUF__BUFFER_CACHE_MAX) c->objs[c->n++] = buf;
    else free(buf);
}

cubuf_status_t cubuf__buffer_check_open(const cubuf_buffer_t *buf, const char *what)
{
    if (buf->closed) return cubuf__fail(CUBUF_ERROR_CLOSED, "%s: the buffer is closed", what);
    return CUBUF_SUCCESS;
}

/* Reads what the driver knows of ptr: device, accessibility, managed. */
static cubuf_status_t describe_pointer(cubuf_buffer_t *buf)
{
    if (buf->ptr == 0) return CUBUF_SUCCESS;
    cubuf_status_t st = cubuf__driver_load();
    if (st != CUBUF_SUCCESS) return st;
    unsigned int type = 0;
    int ordinal = -2;
    uint64_t managed = 0; /* the driver writes a bool; a wide zeroed slot reads the same */
    CUpointer_attribute attrs[] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                   CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                   CU_POINTER_ATTRIBUTE_IS_MANAGED};
    void *data[] = {&type, &ordinal, &managed};
    CUresult r = CU_CALL(cuPointerGetAttributes, 3, attrs, data, buf->ptr);
    if (r == CUDA_ERROR_INVALID_VALUE || r == CUDA_ERROR_INVALID_CONTEXT) type = 0; /* unknown memory */
    else if (r != CUDA_SUCCESS) return cubuf__cu_status(r, "cuPointerGetAttributes");
    buf->flags = 0;
    buf->device_id = -1;
    if (managed) {
        buf->flags = CUBUF__MANAGED | CUBUF__HOST_ACCESSIBLE | CUBUF__DEVICE_ACCESSIBLE;
        buf->device_id = ordinal >= 0 ? ordinal : -1;
    } else if (type == CU_MEMORYTYPE_DEVICE) {
        buf->flags = CUBUF__DEVICE_ACCESSIBLE;
        buf->device_id = ordinal >= 0 ? ordinal : -1;
    } else if (type == CU_MEMORYTYPE_HOST) {
        buf->flags = CUBUF__HOST_ACCESSIBLE | CUBUF__DEVICE_ACCESSIBLE;
    } else {
        buf->flags = CUBUF__HOST_ACCESSIBLE; /* pageable memory the driver does not know */
    }
    return CUBUF_SUCCESS;
}

static cubuf_status_t new_view(CUdeviceptr ptr, size_t size, const char *what, cubuf_buffer_t **out)
{
    CHECK_ARG(out, "%s: out is NULL", what);
    CHECK_ARG(ptr != 0 || size == 0, "%s: pointer 0 with size %zu", what, size);
    CHECK_ARG(ptr + size >= ptr, "%s: range wraps around the address space", what);
    cubuf_buffer_t *buf = NULL;
    cubuf_status_t st = cubuf__buffer_new(&buf);
    if (st != CUBUF_SUCCESS) return st;
    buf->ptr = ptr;
    buf->size = size;
    if ((st = describe_pointer(buf)) != CUBUF_SUCCESS) {
        cubuf__buffer_discard(buf);
        return st;
    }
    *out = buf;
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf_buffer_view(CUdeviceptr ptr, size_t size, cubuf_buffer_t **out)
{
    return new_view(ptr, size, "cubuf_buffer_view", out);
}

cubuf_status_t cubuf_buffer_wrap_external(CUdeviceptr ptr, size_t size, void *owner,
                                          cubuf_owner_release_fn release, cubuf_buffer_t **out)
{
    cubuf_status_t st = new_view(ptr, size, "cubuf_buffer_wrap_external", out);
    if (st == CUBUF_SUCCESS) {
        (*out)->owner = owner;
        (*out)->owner_release = release;
    }
    return st;
}

cubuf_status_t cubuf_buffer_wrap(CUdeviceptr ptr, size_t size, cubuf_resource_t *resource,
                                 CUstream stream, cubuf_buffer_t **out)
{
    CHECK_ARG(out && resource, "cubuf_buffer_wrap: NULL argument");
    CHECK_ARG(ptr != 0 || size == 0, "cubuf_buffer_wrap: pointer 0 with size %zu", size);
    CHECK_ARG(ptr + size >= ptr, "cubuf_buffer_wrap: range wraps around the address space");
    if (resource->vt->no_adopt)
        return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,
                           "cubuf_buffer_wrap: this resource cannot take over memory it did not "
                           "allocate: %s", resource->vt->no_adopt);
    cubuf_buffer_t *buf = NULL;
    cubuf_status_t st = cubuf__buffer_new(&buf);
    if (st != CUBUF_SUCCESS) return st;
    buf->ptr = ptr;
    buf->size = size;
    cubuf__buffer_take_props(buf, resource);
    buf->resource = resource;
    /* Host-only resources order nothing on a device and need no context. */
    if (resource->props.device_accessible) {
        st = cubuf__stream_record(&buf->dealloc, stream, cubuf__buffer_exec_ctx(buf));
    } else {
        buf->dealloc.stream = stream;
    }
    if (st != CUBUF_SUCCESS) {
        cubuf__buffer_discard(buf);
        return st;
    }
    cubuf__resource_adopt(resource, buf);
    *out = buf;
    return CUBUF_SUCCESS;
}

void cubuf__buffer_attach(cubuf_buffer_t *buf, cubuf_buffer_t *root)
{
    while (root->parent) root = root->parent; /* the memory's owner: a middle slice owns nothing */
    buf->parent = cubuf_buffer_retain(root);
    atomic_fetch_add_explicit(&root->open_slices, 1, memory_order_relaxed);
}

cubuf_status_t cubuf_buffer_slice(cubuf_buffer_t *parent, size_t offset, size_t size,
                                  cubuf_buffer_t **out)
{
    CHECK_ARG(parent && out, "cubuf_buffer_slice: NULL argument");
    cubuf_status_t st = cubuf__buffer_check_open(parent, "cubuf_buffer_slice");
    if (st != CUBUF_SUCCESS) return st;
    if (offset > parent->size || size > parent->size - offset)
        return cubuf__fail(CUBUF_ERROR_OUT_OF_RANGE,
                           "cubuf_buffer_slice: [%zu, %zu+%zu) does not fit a buffer of %zu bytes",
                           offset, offset, size, parent->size);
    cubuf_buffer_t *buf = NULL;
    if ((st = cubuf__buffer_new(&buf)) != CUBUF_SUCCESS) return st;
    buf->ptr = parent->ptr + offset;
    buf->size = size;
    buf->device_id = parent->device_id;
    buf->flags = parent->flags;
    /* A slice of a view made through a context runs its work there too,
     * even where it hangs on a root that names no context of its own. */
    if (parent->view_ctx) buf->view_ctx = cubuf__context_retain(parent->view_ctx);
    cubuf__buffer_attach(buf, parent);
    *out = buf;
    return CUBUF_SUCCESS;
}

cubuf_buffer_t *cubuf_buffer_retain(cubuf_buffer_t *buf)
{
    if (buf) atomic_fetch_add_explicit(&buf->refs, 1, memory_order_relaxed);
    return buf;
}

/* What a buffer holds besides its memory: the owner, the root it depends
 * on, the context it was made through. Dropped once, on close. */
static void drop_holds(cubuf_buffer_t *buf)
{
    if (buf->owner_release) buf->owner_release(buf->owner);
    buf->owner_release = NULL;
    buf->owner = NULL;
    if (buf->parent) {
        atomic_fetch_sub_explicit(&buf->parent->open_slices, 1, memory_order_release);
        cubuf_buffer_release(buf->parent);
        buf->parent = NULL;
    }
    if (buf->view_ctx) {
        cubuf__context_release(buf->view_ctx);
        buf->view_ctx = NULL;
    }
}

static cubuf_status_t refuse_busy(const cubuf_buffer_t *buf, const char *what)
{
    int n = atomic_load_explicit(&buf->open_slices, memory_order_acquire);
    if (n == 0) return CUBUF_SUCCESS;
    return cubuf__fail(CUBUF_ERROR_BUSY,
                       "%s: %d slice%s or view%s of this buffer %s open and would reach freed "
                       "memory; close or release them first (the buffer stays open)",
                       what, n, n == 1 ? "" : "s", n == 1 ? "" : "s", n == 1 ? "is" : "are");
}

static cubuf_status_t close_buffer(cubuf_buffer_t *buf, const char *what)
{
    if (buf->closed) return CUBUF_SUCCESS;
    cubuf_status_t st = refuse_busy(buf, what);
    if (st != CUBUF_SUCCESS) return st;
    cubuf_resource_t *res = buf->resource;
    if (res && (st = cubuf__resource_free_buffer(res, buf)) != CUBUF_SUCCESS)
        return st; /* refused or failed: the buffer stays open */
    buf->resource = NULL;
    drop_holds(buf);
    buf->closed = true;
    buf->ptr = 0;
    buf->size = 0;
    buf->impl = NULL;
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf_buffer_close(cubuf_buffer_t *buf)
{
    CHECK_ARG(buf, "cubuf_buffer_close: buf is NULL");
    return close_buffer(buf, "cubuf_buffer_close");
}

cubuf_status_t cubuf_buffer_close_on(cubuf_buffer_t *buf, CUstream stream)
{
    static const char what[] = "cubuf_buffer_close_on";
    CHECK_ARG(buf, "%s: buf is NULL", what);
    if (buf->closed) return CUBUF_SUCCESS;
    cubuf_status_t st = refuse_busy(buf, what);
    if (st != CUBUF_SUCCESS) return st;
    cubuf_stream_token_t saved = buf->dealloc;
    if ((st = cubuf_buffer_set_deallocation_stream(buf, stream)) != CUBUF_SUCCESS) return st;
    st = close_buffer(buf, what);
    if (st != CUBUF_SUCCESS) cubuf__buffer_set_token(buf, &saved); /* a refused close changes nothing */
    return st;
}

/* The last release. A caller holding the only reference needs no atomic
 * read-modify-write to know it: nobody else can retain the buffer. Open
 * slices hold a reference, so a buffer released here has none. */
void cubuf_buffer_release(cubuf_buffer_t *buf)
{
    if (!buf) return;
    if (atomic_load_explicit(&buf->refs, memory_order_acquire) == 1)
        atomic_store_explicit(&buf->refs, 0, memory_order_relaxed);
    else if (atomic_fetch_sub_explicit(&buf->refs, 1, memory_order_acq_rel) != 1)
        return;
    cubuf_status_t st = buf->closed ? CUBUF_SUCCESS : close_buffer(buf, "cubuf_buffer_release");
    if (st != CUBUF_SUCCESS) {
        cubuf__warn(st, "the last release of a buffer could not close it; its memory is lost: %s",
                    cubuf_last_error());
        drop_holds(buf);
        cubuf_resource_release(buf->resource);
    }
    cubuf__buffer_discard(buf);
}

void cubuf__buffer_set_token(cubuf_buffer_t *buf, const cubuf_stream_token_t *t)
{
    cubuf_resource_t *res = buf->resource;
    if (res && res->vt->set_token) res->vt->set_token(res, buf, t);
    else buf->dealloc = *t;
}

cubuf_status_t cubuf_buffer_set_deallocation_stream(cubuf_buffer_t *buf, CUstream stream)
{
    CHECK_ARG(buf, "cubuf_buffer_set_deallocation_stream: buf is NULL");
    cubuf_status_t st = cubuf__buffer_check_open(buf, "cubuf_buffer_set_deallocation_stream");
    if (st != CUBUF_SUCCESS) return st;
    /* Host-only resources order nothing on a device and need no context;
     * a buffer that owns no memory (a slice, a view) frees nothing, so its
     * stream is kept as given, bound to its context if it has one. */
    cubuf_stream_token_t t = {stream, NULL};
    if (!buf->resource)
        t.ctx = cubuf__stream_is_default(stream) ? cubuf__buffer_exec_ctx(buf) : NULL;
    else if (buf->resource->props.device_accessible)
        st = cubuf__stream_record(&t, stream, cubuf__buffer_exec_ctx(buf));
    if (st == CUBUF_SUCCESS) cubuf__buffer_set_token(buf, &t);
    return st;
}

CUdeviceptr cubuf_buffer_ptr(const cubuf_buffer_t *buf) { return buf ? buf->ptr : 0; }
size_t cubuf_buffer_size(const cubuf_buffer_t *buf) { return buf ? buf->size : 0; }
int cubuf_buffer_device_id(const cubuf_buffer_t *buf) { return buf ? buf->device_id : -1; }
bool cubuf_buffer_is_closed(const cubuf_buffer_t *buf) { return !buf || buf->closed; }

static bool has_flag(const cubuf_buffer_t *buf, unsigned flag)
{
    return buf && !buf->closed && (buf->flags & flag);
}

bool cubuf_buffer_is_device_accessible(const cubuf_buffer_t *buf)
{
    return has_flag(buf, CUBUF__DEVICE_ACCESSIBLE);
}
bool cubuf_buffer_is_host_accessible(const cubuf_buffer_t *buf)
{
    return has_flag(buf, CUBUF__HOST_ACCESSIBLE);
}
bool cubuf_buffer_is_managed(const cubuf_buffer_t *buf) { return has_flag(buf, CUBUF__MANAGED); }
bool cubuf_buffer_is_mapped(const cubuf_buffer_t *buf) { return has_flag(buf, CUBUF__MAPPED); }

cubuf_resource_t *cubuf_buffer_resource(const cubuf_buffer_t *buf)
{
    return buf ? buf->resource : NULL;
}

void *cubuf_buffer_owner(const cubuf_buffer_t *buf)
{
    if (!buf) return NULL;
    if (!buf->owner && buf->parent) return cubuf_buffer_owner(buf->parent);
    return buf->owner;
}

cubuf_buffer_t *cubuf_buffer_parent(const cubuf_buffer_t *buf) { return buf ? buf->parent : NULL; }
