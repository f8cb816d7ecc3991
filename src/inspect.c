/* Accessors of private state for tests and benchmarks (inspect.h). */
#include "inspect.h"
#include "internal.h"

void cubuf__inspect_dealloc(const cubuf_buffer_t *buf, CUstream *stream, CUcontext *ctx)
{
    *stream = buf->dealloc.stream;
    *ctx = buf->dealloc.ctx;
}

int cubuf__inspect_buffer_refs(const cubuf_buffer_t *buf) { return atomic_load(&buf->refs); }

void *cubuf__inspect_buffer_owner(const cubuf_buffer_t *buf, cubuf_owner_release_fn *release)
{
    *release = buf->owner_release;
    return buf->owner_release ? buf->owner : NULL;
}

bool cubuf__inspect_close_may_wait(const cubuf_buffer_t *buf)
{
    if (buf->closed) return false;
    /* A slice's or based view's close may drop the root's last reference,
     * and so free the root's memory: the root's resource decides. */
    const cubuf_buffer_t *root = buf->parent ? buf->parent : buf;
    if (cubuf__dlpack_release_may_wait(root)) return true; /* from_dlpack's views */
    for (const cubuf_resource_t *r = root->resource; r;) {
        if (r->vt->pool) return false; /* cuMemFreeAsync */
        const cubuf_resource_t *up = cubuf__caching_upstream(r);
        if (!up) up = r->upstream; /* set for adaptors only */
        if (!up) return true;
        r = up;
    }
    return false; /* a plain view: its owner's release (a Python object's) takes the GIL itself */
}

bool cubuf__inspect_allocate_may_wait(const cubuf_resource_t *res)
{
    for (const cubuf_resource_t *r = res; r; r = r->upstream) /* set for adaptors only */
        if (cubuf__caching_upstream(r)) return true;
    return false;
}

int cubuf__inspect_open_slices(const cubuf_buffer_t *buf) { return atomic_load(&buf->open_slices); }

size_t cubuf__inspect_resource_refs(cubuf_resource_t *res)
{
    cubuf__resource_lock(res);
    size_t n = res->refs;
    cubuf__resource_unlock(res);
    return n;
}

CUdevice cubuf__inspect_context_device(const cubuf_context_t *ctx) { return ctx->device; }

cubuf_resource_t *cubuf__inspect_context_pool(const cubuf_context_t *ctx, bool host)
{
    return (cubuf_resource_t *)atomic_load(host ? &ctx->host_pool : &ctx->device_pool);
}
