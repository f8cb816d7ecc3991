/* What the host-allocation fault passes of the GPU tests share. */
#ifndef CUBUF_ALLOC_FAULT_TEST_H
#define CUBUF_ALLOC_FAULT_TEST_H

#include "internal.h"
#include "test.h"

/* Arms the nth host allocation from now to fail (fault.h) with this thread's
 * buffer-object cache emptied first, so that the path allocates its buffer
 * objects and those allocations fail in turn too. */
static inline void t_fail_alloc_nth(unsigned nth)
{
    cubuf__buffer_cache_t *c = *cubuf__buffer_cache_slot();
    while (c && c->n) free(c->objs[--c->n]);
    cubuf_fault_fail_alloc_nth(nth);
}

#endif
