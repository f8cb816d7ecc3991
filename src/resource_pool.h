/* Stream-ordered pool resources: what other sources need to know of them. Private. */
#ifndef CUBUF_RESOURCE_POOL_H
#define CUBUF_RESOURCE_POOL_H

#include "internal.h"

/* The memory pool behind a device pool or pinned pool resource (the device's
 * default pool or a pool the resource created and owns); NULL for any other
 * resource, and for NULL. Not a new reference: the pool lives as long as the
 * resource. The IPC code exports pools through it. */
CUmemoryPool cubuf__pool_handle(const cubuf_resource_t *res);

/* cubuf_device_resource_create and cubuf_pinned_resource_create in a given
 * context (a cubuf context's own pools live in it, and hold it). Take over
 * one reference to ctx, released on failure; options already validated. */
cubuf_status_t cubuf__device_pool_make(cubuf_context_t *ctx,
                                       const cubuf_device_resource_options_t *o,
                                       cubuf_resource_t **out);
cubuf_status_t cubuf__pinned_pool_make(cubuf_context_t *ctx, bool ipc_enabled, cubuf_resource_t **out);

/* Fills the pool figures of *stats (reserved and used bytes, current and
 * high: four cuMemPoolGetAttribute calls) for a device or pinned pool
 * resource, zeros for any other; writes nothing on failure. */
cubuf_status_t cubuf__pool_usage(const cubuf_resource_t *res, cubuf_resource_stats_t *stats);

#endif
