/* The resource interface: references, properties, statistics, allocation,
 * and user-defined resources. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

cubuf_status_t cubuf__resource_new(const cubuf_resource_vtbl_t *vt, cubuf_resource_kind_t kind,
                                   cubuf_context_t *ctx, cubuf_resource_t **out)
{
    cubuf_resource_t *res = calloc(1, sizeof *res);
    if (!res) return cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "cannot allocate a resource");
    atomic_init(&res->refs, 1);
    res->vt = vt;
    res->kind = kind;
    res->ctx = ctx;
    res->props = (cubuf_resource_props_t)CUBUF_RESOURCE_PROPS_INIT;
    if (ctx) res->props.device_id = ctx->ordinal;
    *out = res;
    return CUBUF_SUCCESS;
}

cubuf_resource_t *cubuf_resource_retain(cubuf_resource_t *res)
{
    if (res) atomic_fetch_add_explicit(&res->refs, 1, memory_order_relaxed);
    return res;
}

void cubuf_resource_release(cubuf_resource_t *res)
{
    if (!res || atomic_fetch_sub_explicit(&res->refs, 1, memory_order_acq_rel) != 1) return;
    if (res->vt->destroy) res->vt->destroy(res);
    cubuf__context_release(res->ctx);
    free(res);
}

cubuf_status_t cubuf_resource_props(const cubuf_resource_t *res, cubuf_resource_props_t *props)
{
    CHECK_ARG(res && props, "cubuf_resource_props: NULL argument");
    CHECK_ARG(props->struct_size >= sizeof *props,
              "cubuf_resource_props: props->struct_size is %zu; use CUBUF_RESOURCE_PROPS_INIT",
              props->struct_size);
    *props = res->props;
    return CUBUF_SUCCESS;
}

static void raise_peak(atomic_size_t *peak, size_t value)
{
    size_t old = atomic_load_explicit(peak, memory_order_relaxed);
    while (value > old &&
           !atomic_compare_exchange_weak_explicit(peak, &old, value, memory_order_relaxed,
                                                  memory_order_relaxed)) {
    }
}

void cubuf__stats_add(cubuf_resource_t *res, size_t bytes)
{
    size_t b = atomic_fetch_add_explicit(&res->cur_bytes, bytes, memory_order_relaxed) + bytes;
    size_t c = atomic_fetch_add_explicit(&res->cur_count, 1, memory_order_relaxed) + 1;
    atomic_fetch_add_explicit(&res->total, 1, memory_order_relaxed);
    raise_peak(&res->peak_bytes, b);
    raise_peak(&res->peak_count, c);
}

void cubuf__stats_sub(cubuf_resource_t *res, size_t bytes)
{
    atomic_fetch_sub_explicit(&res->cur_bytes, bytes, memory_order_relaxed);
    atomic_fetch_sub_explicit(&res->cur_count, 1, memory_order_relaxed);
}

cubuf_status_t cubuf_resource_stats(const cubuf_resource_t *res, cubuf_resource_stats_t *stats)
{
    CHECK_ARG(res && stats, "cubuf_resource_stats: NULL argument");
    stats->current_bytes = atomic_load_explicit(&res->cur_bytes, memory_order_relaxed);
    stats->peak_bytes = atomic_load_explicit(&res->peak_bytes, memory_order_relaxed);
    stats->current_count = atomic_load_explicit(&res->cur_count, memory_order_relaxed);
    stats->peak_count = atomic_load_explicit(&res->peak_count, memory_order_relaxed);
    stats->total_allocations = atomic_load_explicit(&res->total, memory_order_relaxed);
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf_resource_allocate(cubuf_resource_t *res, size_t size, CUstream stream,
                                       cubuf_buffer_t **out)
{
    CHECK_ARG(res && out, "cubuf_resource_allocate: NULL argument");
    cubuf_buffer_t *buf = NULL;
    cubuf_status_t st = cubuf__buffer_new(&buf);
    if (st != CUBUF_SUCCESS) return st;
    buf->size = size;
    cubuf__buffer_take_props(buf, res);
    if (res->props.device_accessible) {
        CUcontext fallback = res->ctx ? res->ctx->handle : NULL;
        CHECK(cubuf__stream_record(&buf->dealloc, stream, fallback));
    } else {
        buf->dealloc.stream = stream;
    }
    if (size) {
        CHECK(res->vt->allocate(res, buf, stream));
        if (!res->vt->manages_stats) cubuf__stats_add(res, size);
    }
    buf->resource = cubuf_resource_retain(res);
    *out = buf;
    return CUBUF_SUCCESS;
fail:
    cubuf__buffer_discard(buf);
    return st;
}

/* ---- user-defined resources ---- */

static cubuf_status_t user_allocate(cubuf_resource_t *res, cubuf_buffer_t *buf, CUstream stream)
{
    CUdeviceptr p = 0;
    cubuf_status_t st = res->user_ops.allocate(res->user_state, buf->size, stream, &p);
    if (st != CUBUF_SUCCESS)
        return cubuf__fail(st, "user resource: allocate of %zu bytes returned %s", buf->size,
                           cubuf_status_name(st));
    if (!p) return cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "user resource returned pointer 0");
    buf->ptr = p;
    return CUBUF_SUCCESS;
}

static cubuf_status_t user_deallocate(cubuf_resource_t *res, cubuf_buffer_t *buf,
                                      const cubuf_stream_token_t *token)
{
    /* A default stream means something only in the context it was bound in. */
    cubuf_ctx_guard_t g = {false};
    cubuf_status_t st;
    if (token->ctx && (st = cubuf__ctx_push(token->ctx, &g)) != CUBUF_SUCCESS) return st;
    st = res->user_ops.deallocate(res->user_state, buf->ptr, buf->size, token->stream);
    cubuf__ctx_pop(&g);
    return st;
}

static void user_destroy(cubuf_resource_t *res)
{
    if (res->user_ops.destroy) res->user_ops.destroy(res->user_state);
}

static const cubuf_resource_vtbl_t user_vtbl = {user_allocate, user_deallocate, user_destroy, false};

cubuf_status_t cubuf_resource_create(const cubuf_resource_ops_t *ops,
                                     const cubuf_resource_props_t *props, void *state,
                                     cubuf_resource_t **out)
{
    CHECK_ARG(ops && out, "cubuf_resource_create: NULL argument");
    if (ops->version < 1 || ops->version > CUBUF_RESOURCE_OPS_VERSION)
        return cubuf__fail(CUBUF_ERROR_NOT_SUPPORTED,
                           "cubuf_resource_create: ops version %u is not supported (this cubuf "
                           "knows versions 1 to %d)",
                           ops->version, CUBUF_RESOURCE_OPS_VERSION);
    CHECK_ARG(ops->allocate && ops->deallocate,
              "cubuf_resource_create: allocate and deallocate are required");
    CHECK_ARG(!props || props->struct_size >= sizeof *props,
              "cubuf_resource_create: props->struct_size is wrong; use CUBUF_RESOURCE_PROPS_INIT");
    cubuf_resource_t *res = NULL;
    cubuf_status_t st = cubuf__resource_new(&user_vtbl, CUBUF_RES_USER, NULL, &res);
    if (st != CUBUF_SUCCESS) return st;
    res->user_ops = *ops;
    res->user_state = state;
    if (props) {
        res->props = *props;
        res->props.struct_size = sizeof res->props;
    } else {
        res->props.device_accessible = true;
        res->props.device_id = -1;
    }
    *out = res;
    return CUBUF_SUCCESS;
}
