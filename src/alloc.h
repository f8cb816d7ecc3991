/* Host allocations: every malloc, calloc and realloc in src/ goes through
 * these, the test seam for allocation faults (fault.h). Disarmed, the cost is
 * one relaxed load. Private. */
#ifndef CUBUF_ALLOC_H
#define CUBUF_ALLOC_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

/* ---- allocation fault seam (see fault.h for the test interface) ---- */
#ifdef CUBUF_NO_FAULT_SEAM
/* A program built from single sources without src/fault.c (the fuzzer). */
static inline bool cubuf__alloc_fails(void) { return false; }
#else
extern atomic_bool cubuf__alloc_fault_armed;
/* Counts this host allocation and decides whether it fails. */
bool cubuf__alloc_fault_hit(void);

static inline bool cubuf__alloc_fails(void)
{
    return atomic_load_explicit(&cubuf__alloc_fault_armed, memory_order_relaxed) &&
           cubuf__alloc_fault_hit();
}
#endif

static inline void *cubuf__malloc(size_t n) { return cubuf__alloc_fails() ? NULL : malloc(n); }

static inline void *cubuf__calloc(size_t count, size_t size)
{
    return cubuf__alloc_fails() ? NULL : calloc(count, size);
}

/* n bytes (rounded up to a multiple of `align`) aligned to `align`, a power
 * of two: memory laid out in cache lines. Freed with free(). */
static inline void *cubuf__aligned_alloc(size_t align, size_t n)
{
    if (n > SIZE_MAX - (align - 1)) return NULL;
    return cubuf__alloc_fails() ? NULL : aligned_alloc(align, (n + align - 1) & ~(align - 1));
}

/* A failed (or injected) realloc leaves `p` allocated and unchanged. */
static inline void *cubuf__realloc(void *p, size_t n)
{
    return cubuf__alloc_fails() ? NULL : realloc(p, n);
}

static inline void cubuf__free(void *p) { free(p); }

#endif
