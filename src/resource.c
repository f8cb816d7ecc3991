/* The resource interface: references, properties, statistics, allocation,
 * and user-defined resources. */
#include <sched.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* References and statistics change with every allocation and free, from
 * any thread. They share one spin lock rather than being separate atomics:
 * an allocate + free then pays two atomic read-modify-writes (one per lock)
 * where separate counters cost seven (reference, bytes, count, total, peaks,
 * and back), and readers get a consistent snapshot. A critical section is a
 * few additions; a waiter spins briefly, then yields, in case the holder was
 * preempted. */
#if defined(__x86_64__) || defined(__i386__)
#define cpu_relax() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield")
#else
#define cpu_relax() ((void)0)
#endif

void cubuf__resource_lock_wait(cubuf_resource_t *res)
{
    unsigned spins = 0;
    do {
        while (atomic_load_explicit(&res->lock, memory_order_relaxed)) {
            if (++spins < 256) cpu_relax();
            else sched_yield();
        }
    } while (atomic_exchange_explicit(&res->lock, true, memory_order_acquire));
}

cubuf_status_t cubuf__resource_new(const cubuf_resource_vtbl_t *vt, cubuf_resource_kind_t kind,
                                   cubuf_context_t *ctx, cubuf_resource_t **out)
{
    cubuf_resource_t *res = calloc(1, sizeof *res);
    if (!res) return cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "cannot allocate a resource");
    atomic_init(&res->lock, false);
    res->refs = 1;
    res->vt = vt;
    res->kind = kind;
    res->ctx = ctx;
    res->props = (cubuf_resource_props_t)CUBUF_RESOURCE_PROPS_INIT;
    if (ctx) res->props.device_id = ctx->ordinal;
    *out = res;
    return CUBUF_SUCCESS;
}

void cubuf__resource_destroy(cubuf_resource_t *res)
{
    if (res->vt->destroy) res->vt->destroy(res);
    cubuf__context_release(res->ctx);
    free(res);
}

cubuf_resource_t *cubuf_resource_retain(cubuf_resource_t *res)
{
    if (!res) return NULL;
    cubuf__resource_lock(res);
    res->refs++;
    cubuf__resource_unlock(res);
    return res;
}

void cubuf_resource_release(cubuf_resource_t *res) { cubuf__resource_drop(res, 0); }

void cubuf__stats_add(cubuf_resource_t *res, size_t bytes)
{
    cubuf__resource_lock(res);
    cubuf__stats_add_locked(res, bytes);
    cubuf__resource_unlock(res);
}

void cubuf__stats_sub(cubuf_resource_t *res, size_t bytes)
{
    cubuf__resource_lock(res);
    cubuf__stats_sub_locked(res, bytes);
    cubuf__resource_unlock(res);
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

cubuf_status_t cubuf_resource_stats(const cubuf_resource_t *res, cubuf_resource_stats_t *stats)
{
    CHECK_ARG(res && stats, "cubuf_resource_stats: NULL argument");
    cubuf_resource_t *r = (cubuf_resource_t *)res; /* the lock is not part of the value */
    cubuf__resource_lock(r);
    stats->current_bytes = r->cur_bytes;
    stats->peak_bytes = r->peak_bytes;
    stats->current_count = r->cur_count;
    stats->peak_count = r->peak_count;
    stats->total_allocations = r->total;
    cubuf__resource_unlock(r);
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf__resource_allocate(cubuf_resource_t *res, size_t size, CUstream stream,
                                        CUcontext current, cubuf_buffer_t **out)
{
    /* The hot path, where the resource has one and no context must be looked up. */
    if (res->vt->allocate_buffer && size && (current || !cubuf__stream_is_default(stream)))
        return res->vt->allocate_buffer(res, size, stream,
                                        cubuf__stream_is_default(stream) ? current : NULL, out);
    cubuf_buffer_t *buf = NULL;
    cubuf_status_t st = cubuf__buffer_new(&buf);
    if (st != CUBUF_SUCCESS) return st;
    buf->size = size;
    cubuf__buffer_take_props(buf, res);
    bool in_ctx = true;
    if (!res->props.device_accessible || !cubuf__stream_is_default(stream)) {
        buf->dealloc.stream = stream; /* bound to no context */
    } else if (current) {
        buf->dealloc = (cubuf_stream_token_t){stream, current};
    } else {
        CUcontext fallback = res->ctx ? res->ctx->handle : NULL;
        CHECK(cubuf__stream_record(&buf->dealloc, stream, fallback, &in_ctx));
    }
    if (size) CHECK(res->vt->allocate(res, buf, stream, in_ctx));
    cubuf__resource_hold(res, size && !res->vt->manages_stats ? size : 0);
    buf->resource = res;
    *out = buf;
    return CUBUF_SUCCESS;
fail:
    cubuf__buffer_discard(buf);
    return st;
}

cubuf_status_t cubuf_resource_allocate(cubuf_resource_t *res, size_t size, CUstream stream,
                                       cubuf_buffer_t **out)
{
    CHECK_ARG(res && out, "cubuf_resource_allocate: NULL argument");
    return cubuf__resource_allocate(res, size, stream, NULL, out);
}

/* ---- user-defined resources ---- */

static cubuf_status_t user_allocate(cubuf_resource_t *res, cubuf_buffer_t *buf, CUstream stream,
                                    bool in_ctx)
{
    (void)in_ctx; /* user allocations run in the caller's context, as called */
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
    if ((st = cubuf__ctx_push(token->ctx, &g)) != CUBUF_SUCCESS) return st;
    st = res->user_ops.deallocate(res->user_state, buf->ptr, buf->size, token->stream);
    cubuf__ctx_pop(&g);
    return st;
}

static void user_destroy(cubuf_resource_t *res)
{
    if (res->user_ops.destroy) res->user_ops.destroy(res->user_state);
}

static const cubuf_resource_vtbl_t user_vtbl = {
    .allocate = user_allocate,
    .deallocate = user_deallocate,
    .destroy = user_destroy,
};

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
