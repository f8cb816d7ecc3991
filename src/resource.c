/* The resource interface: references, properties, statistics, allocation,
 * and user-defined resources. */
#include <sched.h>
#include <stdlib.h>
#include <string.h>

#include "abi.h"
#include "internal.h"
#include "resource_pool.h"

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
    cubuf_resource_t *res = cubuf__calloc(1, sizeof *res);
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
    cubuf_status_t st = cubuf__struct_check("cubuf_resource_props", "cubuf_resource_props_t",
                                            props->struct_size, CUBUF_RESOURCE_PROPS_SIZE_V1,
                                            sizeof *props);
    if (st != CUBUF_SUCCESS) return st;
    cubuf__struct_out(props, &res->props, sizeof *props);
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf_resource_stats(const cubuf_resource_t *res, cubuf_resource_stats_t *stats)
{
    static const char fn[] = "cubuf_resource_stats";
    CHECK_ARG(res && stats, "cubuf_resource_stats: NULL argument");
    cubuf_status_t st = cubuf__struct_check(fn, "cubuf_resource_stats_t", stats->struct_size,
                                            CUBUF_RESOURCE_STATS_SIZE_V1, sizeof *stats);
    if (st != CUBUF_SUCCESS) return st;
    cubuf_resource_stats_t s = CUBUF_RESOURCE_STATS_INIT;
    /* The pool figures are driver queries: made only for a caller with room for them. */
    if (stats->struct_size > CUBUF_RESOURCE_STATS_SIZE_V1 &&
        (st = cubuf__pool_usage(res, &s)) != CUBUF_SUCCESS)
        return st;
    cubuf_resource_t *r = (cubuf_resource_t *)res; /* the lock is not part of the value */
    cubuf__resource_lock(r);
    s.current_bytes = r->cur_bytes;
    s.peak_bytes = r->peak_bytes;
    s.current_count = r->cur_count;
    s.peak_count = r->peak_count;
    s.total_allocations = r->total;
    cubuf__resource_unlock(r);
    cubuf__struct_out(stats, &s, sizeof s);
    return CUBUF_SUCCESS;
}

/* A default stream is the default stream of the resource's context (of the
 * caller's current context for a user resource, which has none): the
 * allocation, the work the caller orders on "stream 0" (copies and fills
 * run in the resource's context too) and the free share one stream, whatever
 * the caller has current. When that context is current, the allocation
 * takes the hot path; otherwise the resource pushes it (in_ctx false). */
cubuf_status_t cubuf__resource_allocate(cubuf_resource_t *res, size_t size, CUstream stream,
                                        CUcontext current, cubuf_buffer_t **out)
{
    cubuf_status_t st;
    CUcontext bound = NULL;
    const bool dflt = res->props.device_accessible && cubuf__stream_is_default(stream);
    if (dflt) {
        if (!current) {
            if ((st = cubuf__driver_load()) != CUBUF_SUCCESS) return st;
            if ((st = CU(cuCtxGetCurrent, &current)) != CUBUF_SUCCESS) return st;
        }
        bound = res->ctx ? res->ctx->handle : current;
        if (!bound)
            return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,
                               "cubuf_resource_allocate: a default stream needs a context: the "
                               "resource belongs to no device and no CUDA context is current");
    }
    const bool in_ctx = !dflt || bound == current;
    /* The hot path, where the resource has one. */
    if (res->vt->allocate_buffer && size && in_ctx)
        return res->vt->allocate_buffer(res, size, stream, bound, out);
    cubuf_buffer_t *buf = NULL;
    if ((st = cubuf__buffer_new(&buf)) != CUBUF_SUCCESS) return st;
    buf->size = size;
    cubuf__buffer_take_props(buf, res);
    buf->dealloc = (cubuf_stream_token_t){stream, bound};
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
    cubuf_resource_props_t p = CUBUF_RESOURCE_PROPS_INIT;
    if (props) {
        cubuf_status_t pst = cubuf__struct_in("cubuf_resource_create", "cubuf_resource_props_t",
                                              &p, sizeof p, props, CUBUF_RESOURCE_PROPS_SIZE_V1);
        if (pst != CUBUF_SUCCESS) return pst;
    }
    /* The bytes of each ops version: a caller's struct is read no further. */
    static const size_t ops_size[CUBUF_RESOURCE_OPS_VERSION + 1] = {0, CUBUF_RESOURCE_OPS_SIZE_V1};
    cubuf_resource_t *res = NULL;
    cubuf_status_t st = cubuf__resource_new(&user_vtbl, CUBUF_RES_USER, NULL, &res);
    if (st != CUBUF_SUCCESS) return st;
    memcpy(&res->user_ops, ops, ops_size[ops->version]);
    res->user_state = state;
    if (props) {
        res->props = p;
    } else {
        res->props.device_accessible = true;
        res->props.device_id = -1;
    }
    *out = res;
    return CUBUF_SUCCESS;
}
