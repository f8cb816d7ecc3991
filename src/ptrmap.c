/* The pointer map (ptrmap.h). */
#include <stdlib.h>

#include "ptrmap.h"

/* Doubles the slots (64 at first); false, the map unchanged, without memory. */
static bool grow(cubuf_ptrmap_t *m)
{
    size_t ncap = m->cap ? 2 * m->cap : 64;
    cubuf_ptr_entry_t *ns = cubuf__calloc(ncap, sizeof *ns);
    if (!ns) return false;
    cubuf_ptr_entry_t *old = m->slots;
    size_t ocap = m->cap;
    m->slots = ns;
    m->cap = ncap;
    m->used = 0;
    for (size_t i = 0; i < ocap; i++)
        if (old[i].ptr) cubuf__ptrmap_put(m, &old[i]);
    free(old);
    return true;
}

cubuf_status_t cubuf__ptrmap_reserve(cubuf_ptrmap_t *m, size_t n)
{
    while (2 * (m->used + n) > m->cap)
        if (!grow(m))
            return cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "cannot grow a pointer map to %zu slots",
                               m->cap ? 2 * m->cap : 64);
    return CUBUF_SUCCESS;
}

bool cubuf__ptrmap_put_back(cubuf_ptrmap_t *m, const cubuf_ptr_entry_t *e)
{
    if (2 * (m->used + 1) > m->cap && !grow(m) && m->used + 1 >= m->cap) return false;
    cubuf__ptrmap_put(m, e);
    return true;
}

void cubuf__ptrmap_free(cubuf_ptrmap_t *m)
{
    free(m->slots);
    m->slots = NULL;
    m->cap = m->used = 0;
}
