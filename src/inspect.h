/* What tests, benchmarks and the Python package may read of cubuf's
 * private state, through functions rather than struct fields, so the
 * structs can change without them (inspect.c). Private: never installed. */
#ifndef CUBUF_INSPECT_H
#define CUBUF_INSPECT_H

#include "common.h"

/* The recorded deallocation stream of buf and the context a default stream
 * was bound to (NULL for other streams). */
void cubuf__inspect_dealloc(const cubuf_buffer_t *buf, CUstream *stream, CUcontext *ctx);
/* References to buf, and its open slices (views with it as base). */
int cubuf__inspect_buffer_refs(const cubuf_buffer_t *buf);
int cubuf__inspect_open_slices(const cubuf_buffer_t *buf);
/* The owner buf itself holds (not a parent's) and the function that will
 * release it, or NULL (and *release NULL) when it has none or has released
 * it. The Python package reads it to show its GC the reference. */
void *cubuf__inspect_buffer_owner(const cubuf_buffer_t *buf, cubuf_owner_release_fn *release);
/* Whether closing buf may wait (for the device, or for a user resource's
 * callback): false when it is closed, a view of no resource's memory, or
 * memory (its root's, for a slice or based view) of a stream-ordered pool,
 * directly or through adaptors and caching resources over one. The Python
 * package lets the GIL go around a close that may. */
bool cubuf__inspect_close_may_wait(const cubuf_buffer_t *buf);
/* Whether an allocation from res may wait for the device: when a caching
 * resource is in its chain (on out of memory it gives its blocks back and
 * synchronizes their streams, and a give-back over a synchronous upstream
 * holds the cache's lock across frees that wait). The Python package lets
 * the GIL go around such an allocation. */
bool cubuf__inspect_allocate_may_wait(const cubuf_resource_t *res);
/* Whether releasing root's owner may wait: root holds an imported DLPack
 * tensor whose deleter may free memory (dlpack.c): a cubuf tensor's when
 * the buffer it holds may wait to close, any other producer's always (its
 * deleter takes the GIL itself where it needs it, as DLPack's do). */
bool cubuf__dlpack_release_may_wait(const cubuf_buffer_t *root);
/* The upstream of a caching resource (caching.c), or NULL for another. */
cubuf_resource_t *cubuf__caching_upstream(const cubuf_resource_t *res);
/* References to res (callers and open buffers). */
size_t cubuf__inspect_resource_refs(cubuf_resource_t *res);
/* The device of a context, and its device pool or pinned host pool
 * resource (NULL until first used; not a new reference). */
CUdevice cubuf__inspect_context_device(const cubuf_context_t *ctx);
cubuf_resource_t *cubuf__inspect_context_pool(const cubuf_context_t *ctx, bool host);

#endif
