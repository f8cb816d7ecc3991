/* Contexts (context.c) and the context guard. Private: never installed. */
#ifndef CUBUF_CONTEXT_H
#define CUBUF_CONTEXT_H

#include "common.h"

/* ---- contexts (context.c) -------------------------------------------------- */

struct cubuf_context {
    atomic_int refs;  /* every holder: the users together count once, each resource once */
    atomic_int users; /* public references (create, wrap); the last one drops the pools */
    CUcontext handle;
    CUdevice device;
    int ordinal;
    bool primary;                 /* retained primary context: release at the end */
    /* The context's pools, made on first use. Each holds the context, so
     * buffers from them keep it alive; bytes_allocated is their live bytes. */
    atomic_uintptr_t device_pool; /* cubuf_resource_t*, made on first new_buffer */
    atomic_uintptr_t host_pool;   /* cubuf_resource_t*, made on first new_host_buffer */
};

/* Internal references, taken by buffers and resources. */
cubuf_context_t *cubuf__context_retain(cubuf_context_t *ctx);
void cubuf__context_release(cubuf_context_t *ctx);
/* A retained context for device `ordinal` (its primary context). Validates
 * the ordinal with a message naming the valid range. */
cubuf_status_t cubuf__context_for_device(int ordinal, cubuf_context_t **out);

/* Validates a device ordinal (the message names the valid range). */
cubuf_status_t cubuf__device_get(int ordinal, CUdevice *dev);
/* One device attribute; *value is 0 when the query fails. */
cubuf_status_t cubuf__device_attr(CUdevice dev, CUdevice_attribute attr, int *value);

/* Makes `ctx` current for a while; restores the caller's context on pop.
 * Skips the push when ctx is already current (the common, fast case), and
 * does nothing at all for a NULL ctx (a user stream's token, a view). */
typedef struct cubuf_ctx_guard {
    bool pushed;
} cubuf_ctx_guard_t;
cubuf_status_t cubuf__ctx_push_nonnull(CUcontext ctx, cubuf_ctx_guard_t *guard);
static inline cubuf_status_t cubuf__ctx_push(CUcontext ctx, cubuf_ctx_guard_t *guard)
{
    guard->pushed = false;
    return ctx ? cubuf__ctx_push_nonnull(ctx, guard) : CUBUF_SUCCESS;
}
void cubuf__ctx_pop_pushed(cubuf_ctx_guard_t *guard);
static inline void cubuf__ctx_pop(cubuf_ctx_guard_t *guard)
{
    if (guard->pushed) cubuf__ctx_pop_pushed(guard);
}

#endif
