/* The pointer map (ptrmap.h). */
#include <stdlib.h>

#include "ptrmap.h"

static size_t home_of(CUdeviceptr p, size_t cap)
{
    uint64_t h = (uint64_t)p * 0x9E3779B97F4A7C15ull; /* Fibonacci hashing: allocations share low bits */
    return (size_t)(h >> 20) & (cap - 1);
}

/* Field by field, not as a struct assignment: the compiler moves a struct
 * 16 bytes at a time, and a 16-byte load of two 8-byte stores made just
 * before (an entry built by the caller, a slot filled by the last insert)
 * cannot be forwarded by the CPU: a stall of a dozen cycles per copy, seen
 * with perf on the tracking adaptor. The library is built without the SLP
 * vectorizer (CMakeLists.txt), which would merge these again. */
static inline void entry_copy(cubuf_ptr_entry_t *d, const cubuf_ptr_entry_t *s)
{
    d->ptr = s->ptr;
    d->size = s->size;
    d->a = s->a;
    d->b = s->b;
    d->c = s->c;
}

static void put(cubuf_ptrmap_t *m, const cubuf_ptr_entry_t *e)
{
    size_t i = home_of(e->ptr, m->cap);
    while (m->slots[i].ptr) i = (i + 1) & (m->cap - 1);
    entry_copy(&m->slots[i], e);
    m->used++;
}

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
        if (old[i].ptr) put(m, &old[i]);
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

cubuf_status_t cubuf__ptrmap_insert(cubuf_ptrmap_t *m, const cubuf_ptr_entry_t *e)
{
    cubuf_status_t st = cubuf__ptrmap_reserve(m, 1);
    if (st == CUBUF_SUCCESS) put(m, e);
    return st;
}

bool cubuf__ptrmap_put_back(cubuf_ptrmap_t *m, const cubuf_ptr_entry_t *e)
{
    if (2 * (m->used + 1) > m->cap && !grow(m) && m->used + 1 >= m->cap) return false;
    put(m, e);
    return true;
}

cubuf_ptr_entry_t *cubuf__ptrmap_find(cubuf_ptrmap_t *m, CUdeviceptr ptr)
{
    if (!m->cap || !ptr) return NULL;
    size_t i = home_of(ptr, m->cap);
    while (m->slots[i].ptr && m->slots[i].ptr != ptr) i = (i + 1) & (m->cap - 1);
    return m->slots[i].ptr ? &m->slots[i] : NULL;
}

/* Backward-shift deletion: entries after the hole that may move into it
 * do, so lookups never need tombstones. */
bool cubuf__ptrmap_remove(cubuf_ptrmap_t *m, CUdeviceptr ptr, cubuf_ptr_entry_t *e)
{
    if (!m->cap || !ptr) return false;
    const size_t mask = m->cap - 1;
    size_t i = home_of(ptr, m->cap);
    while (m->slots[i].ptr && m->slots[i].ptr != ptr) i = (i + 1) & mask;
    if (!m->slots[i].ptr) return false;
    entry_copy(e, &m->slots[i]);
    for (size_t j = i;;) {
        m->slots[i].ptr = 0;
        for (;;) {
            j = (j + 1) & mask;
            if (!m->slots[j].ptr) {
                m->used--;
                return true;
            }
            size_t h = home_of(m->slots[j].ptr, m->cap);
            /* the entry at j stays when its home lies cyclically in (i, j] */
            bool stays = i <= j ? (h > i && h <= j) : (h > i || h <= j);
            if (!stays) break;
        }
        entry_copy(&m->slots[i], &m->slots[j]);
        i = j;
    }
}

void cubuf__ptrmap_free(cubuf_ptrmap_t *m)
{
    free(m->slots);
    m->slots = NULL;
    m->cap = m->used = 0;
}
