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

/* Adds e (e->ptr != 0, not in the map). CUBUF_ERROR_OUT_OF_MEMORY when the
 * map must grow and cannot; the map is unchanged then. */
cubuf_status_t cubuf__ptrmap_insert(cubuf_ptrmap_t *m, const cubuf_ptr_entry_t *e);
/* Makes room for `n` inserts beyond the `used` entries, so that they need
 * no memory: CUBUF_ERROR_OUT_OF_MEMORY when the map cannot grow to it. */
cubuf_status_t cubuf__ptrmap_reserve(cubuf_ptrmap_t *m, size_t n);
/* Adds back an entry taken out with remove, whatever was added since: no
 * new memory is needed while the map keeps a free slot (inserts keep it at
 * most half full, so only as many put-backs as threads at once can fill it
 * further). false (the map unchanged) only when it is full and cannot grow. */
bool cubuf__ptrmap_put_back(cubuf_ptrmap_t *m, const cubuf_ptr_entry_t *e);
/* The entry of ptr, or NULL; valid until the map next changes. */
cubuf_ptr_entry_t *cubuf__ptrmap_find(cubuf_ptrmap_t *m, CUdeviceptr ptr);
/* Takes the entry of ptr out into *e; false (and *e untouched) when absent. */
bool cubuf__ptrmap_remove(cubuf_ptrmap_t *m, CUdeviceptr ptr, cubuf_ptr_entry_t *e);
/* Frees the slots (not what entries point to). */
void cubuf__ptrmap_free(cubuf_ptrmap_t *m);

#endif
