/* A map from device pointers to what is known of each (ptrmap.c): the raw
 * allocations a resource keeps buffers for, the tracking adaptor's
 * outstanding allocations. Open addressing with linear probing; no lock of
 * its own (its owners lock around it). Private: never installed. */
#ifndef CUBUF_PTRMAP_H
#define CUBUF_PTRMAP_H

#include "common.h"

typedef struct cubuf_ptr_entry {
    CUdeviceptr ptr; /* 0: an empty slot */
    size_t size;
    void *a, *b; /* the owner's */
    uint64_t c;
} cubuf_ptr_entry_t;

typedef struct cubuf_ptrmap {
    cubuf_ptr_entry_t *slots;
    size_t cap, used; /* cap 0 or a power of two; used <= cap / 2 but for put-backs */
} cubuf_ptrmap_t;

/* Makes room for `n` inserts beyond the `used` entries, so that they need
 * no memory: CUBUF_ERROR_OUT_OF_MEMORY when the map cannot grow to it. */
cubuf_status_t cubuf__ptrmap_reserve(cubuf_ptrmap_t *m, size_t n);
/* Adds back an entry taken out with remove, whatever was added since: no
 * new memory is needed while the map keeps a free slot (inserts keep it at
 * most half full, so only as many put-backs as threads at once can fill it
 * further). false (the map unchanged) only when it is full and cannot grow. */
bool cubuf__ptrmap_put_back(cubuf_ptrmap_t *m, const cubuf_ptr_entry_t *e);

/* The hot paths are inline: an adaptor's allocate and free each make one
 * insert or remove, and a call apiece shows in their cost. */

/* Fibonacci hashing (allocations share low bits): a map slot takes bits 20
 * and up of the product, so an owner that shards its maps may take the top
 * bits (cubuf__ptrmap_hash >> 59 for 32 shards) without skewing the slots. */
static inline uint64_t cubuf__ptrmap_hash(CUdeviceptr p) { return (uint64_t)p * 0x9E3779B97F4A7C15ull; }
static inline size_t cubuf__ptrmap_home_of(uint64_t hash, size_t cap) { return (size_t)(hash >> 20) & (cap - 1); }
static inline size_t cubuf__ptrmap_home(CUdeviceptr p, size_t cap)
{
    return cubuf__ptrmap_home_of(cubuf__ptrmap_hash(p), cap);
}

/* Field by field, not as a struct assignment: the compiler moves a struct
 * 16 bytes at a time, and a 16-byte load of two 8-byte stores made just
 * before (an entry built by the caller, a slot filled by the last insert)
 * cannot be forwarded by the CPU: a stall of a dozen cycles per copy, seen
 * with perf on the tracking adaptor. The library is built without the SLP
 * vectorizer (CMakeLists.txt), which would merge these again. */
static inline void cubuf__ptrmap_copy(cubuf_ptr_entry_t *d, const cubuf_ptr_entry_t *s)
{
    d->ptr = s->ptr;
    d->size = s->size;
    d->a = s->a;
    d->b = s->b;
    d->c = s->c;
}

/* Stores e (its pointer hashed to `hash`) in its slot; a free slot must exist. */
static inline void cubuf__ptrmap_put_hashed(cubuf_ptrmap_t *m, const cubuf_ptr_entry_t *e, uint64_t hash)
{
    size_t i = cubuf__ptrmap_home_of(hash, m->cap);
    while (m->slots[i].ptr) i = (i + 1) & (m->cap - 1);
    cubuf__ptrmap_copy(&m->slots[i], e);
    m->used++;
}
static inline void cubuf__ptrmap_put(cubuf_ptrmap_t *m, const cubuf_ptr_entry_t *e)
{
    cubuf__ptrmap_put_hashed(m, e, cubuf__ptrmap_hash(e->ptr));
}

/* Adds e (e->ptr != 0, not in the map; hashed to `hash`).
 * CUBUF_ERROR_OUT_OF_MEMORY when the map must grow and cannot; the map is
 * unchanged then. */
static inline cubuf_status_t cubuf__ptrmap_insert_hashed(cubuf_ptrmap_t *m, const cubuf_ptr_entry_t *e,
                                                         uint64_t hash)
{
    if (__builtin_expect(2 * (m->used + 1) > m->cap, 0)) {
        cubuf_status_t st = cubuf__ptrmap_reserve(m, 1);
        if (st != CUBUF_SUCCESS) return st;
    }
    cubuf__ptrmap_put_hashed(m, e, hash);
    return CUBUF_SUCCESS;
}
static inline cubuf_status_t cubuf__ptrmap_insert(cubuf_ptrmap_t *m, const cubuf_ptr_entry_t *e)
{
    return cubuf__ptrmap_insert_hashed(m, e, cubuf__ptrmap_hash(e->ptr));
}

/* The slot of ptr, or cap when absent (cap 0 included); `hash` is
 * cubuf__ptrmap_hash(ptr), which the owner may have made already. */
static inline size_t cubuf__ptrmap_slot(const cubuf_ptrmap_t *m, CUdeviceptr ptr, uint64_t hash)
{
    if (!m->cap || !ptr) return m->cap;
    size_t i = cubuf__ptrmap_home_of(hash, m->cap);
    while (m->slots[i].ptr && m->slots[i].ptr != ptr) i = (i + 1) & (m->cap - 1);
    return m->slots[i].ptr ? i : m->cap;
}

/* The entry of ptr, or NULL; valid until the map next changes. */
static inline cubuf_ptr_entry_t *cubuf__ptrmap_find(cubuf_ptrmap_t *m, CUdeviceptr ptr)
{
    const size_t i = cubuf__ptrmap_slot(m, ptr, cubuf__ptrmap_hash(ptr));
    return i < m->cap ? &m->slots[i] : NULL;
}

/* Takes the entry of ptr (hashed to `hash`) out into *e; false (and *e
 * untouched) when absent. Backward-shift deletion: entries after the hole
 * that may move into it do, so lookups never need tombstones. */
static inline bool cubuf__ptrmap_remove_hashed(cubuf_ptrmap_t *m, CUdeviceptr ptr, uint64_t hash,
                                               cubuf_ptr_entry_t *e)
{
    size_t i = cubuf__ptrmap_slot(m, ptr, hash);
    if (i == m->cap) return false;
    cubuf__ptrmap_copy(e, &m->slots[i]);
    const size_t mask = m->cap - 1;
    for (size_t j = i;;) {
        m->slots[i].ptr = 0;
        for (;;) {
            j = (j + 1) & mask;
            if (!m->slots[j].ptr) {
                m->used--;
                return true;
            }
            size_t h = cubuf__ptrmap_home(m->slots[j].ptr, m->cap);
            /* the entry at j stays when its home lies cyclically in (i, j] */
            bool stays = i <= j ? (h > i && h <= j) : (h > i || h <= j);
            if (!stays) break;
        }
        cubuf__ptrmap_copy(&m->slots[i], &m->slots[j]);
        i = j;
    }
}

static inline bool cubuf__ptrmap_remove(cubuf_ptrmap_t *m, CUdeviceptr ptr, cubuf_ptr_entry_t *e)
{
    return cubuf__ptrmap_remove_hashed(m, ptr, cubuf__ptrmap_hash(ptr), e);
}

/* Frees the slots (not what entries point to). */
void cubuf__ptrmap_free(cubuf_ptrmap_t *m);

#endif
