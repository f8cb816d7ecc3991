/* Buffers: the object, its recycling cache, slices and the context work runs in (buffer.c); staging (staging.c). Private: never installed. */
#ifndef CUBUF_BUFFER_H
#define CUBUF_BUFFER_H

#include "resource.h"

/* ---- buffers (buffer.c) ---------------------------------------------------- */

enum {
    CUBUF__DEVICE_ACCESSIBLE = 1u << 0,
    CUBUF__HOST_ACCESSIBLE = 1u << 1,
    CUBUF__MANAGED = 1u << 2,
    CUBUF__MAPPED = 1u << 3,
};

struct cubuf_buffer {
    atomic_int refs;
    bool closed;
    CUdeviceptr ptr;
    size_t size;
    int device_id;
    unsigned flags;
    cubuf_resource_t *resource; /* owning resource (retained) or NULL */
    cubuf_stream_token_t dealloc;
    void *owner;
    cubuf_owner_release_fn owner_release;
    cubuf_buffer_t *parent;     /* slices and views with a base: the retained root buffer */
    cubuf_context_t *view_ctx;  /* views made through a context: that context (retained) */
    atomic_int open_slices;     /* roots: open buffers whose parent this is (close refuses) */
    void *impl;                 /* resource-private (a VMM range, an IPC import) */
};

/* Buffer objects are recycled through a small per-thread cache (buffer.c
 * says why); its fast paths are inline, for the allocation hot path. */
#define CUBUF__BUFFER_CACHE_MAX 32
typedef struct cubuf__buffer_cache {
    cubuf_buffer_t *objs[CUBUF__BUFFER_CACHE_MAX];
    unsigned n;
} cubuf__buffer_cache_t;
/* This thread's cache pointer (NULL until thread_cache in buffer.c makes
 * one): a thread-local of the default model on purpose (initial-exec would
 * mark the shared library STATIC_TLS, and a late dlopen of its 1 KiB of
 * thread-local data could then fail for want of static TLS space), read
 * through this function only (CUBUF_TLS_ACCESSOR, common.h). */
cubuf__buffer_cache_t **cubuf__buffer_cache_slot(void);

cubuf_status_t cubuf__buffer_new_slow(cubuf_buffer_t **out);
void cubuf__buffer_discard_slow(cubuf_buffer_t *buf);

/* Fills a fresh buffer object: open, one reference, owning nothing. Field
 * by field: the compiler turns a memset or a struct assignment into
 * `rep stos`, whose start-up costs more than these stores. */
static inline void cubuf__buffer_init(cubuf_buffer_t *buf)
{
    atomic_init(&buf->refs, 1);
    buf->closed = false;
    buf->ptr = 0;
    buf->size = 0;
    buf->device_id = -1;
    buf->flags = 0;
    buf->resource = NULL;
    buf->dealloc.stream = NULL;
    buf->dealloc.ctx = NULL;
    buf->owner = NULL;
    buf->owner_release = NULL;
    buf->parent = NULL;
    buf->view_ctx = NULL;
    atomic_init(&buf->open_slices, 0);
    buf->impl = NULL;
}

/* A zeroed open buffer with one reference. */
static inline cubuf_status_t cubuf__buffer_new(cubuf_buffer_t **out)
{
    cubuf__buffer_cache_t *c = *cubuf__buffer_cache_slot();
    if (!c || !c->n) return cubuf__buffer_new_slow(out);
    cubuf_buffer_t *buf = c->objs[--c->n];
    cubuf__buffer_init(buf);
    *out = buf;
    return CUBUF_SUCCESS;
}

/* Frees the struct of a buffer that owns nothing (any more). */
static inline void cubuf__buffer_discard(cubuf_buffer_t *buf)
{
    cubuf__buffer_cache_t *c = *cubuf__buffer_cache_slot();
    if (c && c->n < CUBUF__BUFFER_CACHE_MAX) c->objs[c->n++] = buf;
    else cubuf__buffer_discard_slow(buf);
}
/* Sets device_id and flags from the resource's properties. */
static inline void cubuf__buffer_take_props(cubuf_buffer_t *buf, const cubuf_resource_t *res)
{
    buf->device_id = res->props.device_id;
    buf->flags = (res->props.device_accessible ? CUBUF__DEVICE_ACCESSIBLE : 0) |
                 (res->props.host_accessible ? CUBUF__HOST_ACCESSIBLE : 0) |
                 (res->props.managed ? CUBUF__MANAGED : 0);
}
/* Returns CUBUF_ERROR_CLOSED (naming `what`) if buf is closed. */
cubuf_status_t cubuf__buffer_check_open(const cubuf_buffer_t *buf, const char *what);

/* Records `t` as buf's deallocation stream (through the resource's
 * set_token where it has one). */
void cubuf__buffer_set_token(cubuf_buffer_t *buf, const cubuf_stream_token_t *t);
/* Makes `buf` a dependent of `root` (a slice, or a view with a base): buf
 * retains root and counts as one of its open slices until buf closes. */
void cubuf__buffer_attach(cubuf_buffer_t *buf, cubuf_buffer_t *root);

/* The context a buffer belongs to: its resource's (for a slice or a view
 * with a base: its root's), else the context a view was made through; NULL
 * for views of no context and user resources. Work on the buffer runs in
 * it and a default stream means that context's default stream (cubuf.h,
 * "Default streams"). Inline: every copy and fill asks. */
static inline CUcontext cubuf__buffer_exec_ctx(const cubuf_buffer_t *buf)
{
    const cubuf_buffer_t *root = buf->parent ? buf->parent : buf; /* parents are roots */
    if (root->resource && root->resource->ctx) return root->resource->ctx->handle;
    if (root->view_ctx) return root->view_ctx->handle;
    return buf->view_ctx ? buf->view_ctx->handle : NULL;
}

#endif
