/* Stream-ordered pool resources: what other sources need to know of them. Private. */
#ifndef CUBUF_RESOURCE_POOL_H
#define CUBUF_RESOURCE_POOL_H

#include "internal.h"

/* The memory pool behind a device pool or pinned pool resource (the device's
 * default pool or a pool the resource created and owns); NULL for any other
 * resource, and for NULL. Not a new reference: the pool lives as long as the
 * resource. The IPC code exports pools through it. */
CUmemoryPool cubuf__pool_handle(const cubuf_resource_t *res);

#endif
