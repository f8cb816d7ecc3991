/* Option and result structs across library versions (NCCL's config rule).
 * Private.
 *
 * Every option struct begins with `size_t struct_size`. A caller built
 * against an older header passes a smaller struct, one built against a newer
 * header a larger one. Each type has a first released layout, whose size
 * (CUBUF_<TYPE>_SIZE_V1, next to the type in the public header) is the
 * least this library accepts, so that adding a field never refuses a
 * program built before it:
 *  - inputs: the caller's first min(struct_size, sizeof) bytes are read over
 *    the defaults; bytes past what this library knows are ignored;
 *  - outputs: only the first min(struct_size, sizeof) bytes are written.
 * Growing a struct: a new field of an input struct starts at or after the
 * previous layout's sizeof, never in its tail padding (add explicit padding
 * members first). A caller built today sends struct_size = sizeof, and
 * compilers leave garbage in the padding of an _INIT-initialized struct
 * (gcc -O2 sends 0xff there in cubuf_copy_options_t): a field placed there
 * would be read from that garbage. Eight structs end in padding today
 * (copy, VMM, IPC receive, DLPack, dma-buf and caching options as inputs;
 * IPC descriptor info and physical allocation info as outputs, which are
 * unaffected). */
#ifndef CUBUF_ABI_H
#define CUBUF_ABI_H

#include <stddef.h>

#include "cubuf.h"

/* CUBUF_ERROR_INVALID_ARGUMENT, naming `fn`, `type` and the sizes, unless
 * struct_size covers the first released layout (`first` bytes) of `type`
 * (this library's layout is `size` bytes). */
cubuf_status_t cubuf__struct_check(const char *fn, const char *type, size_t struct_size,
                                   size_t first, size_t size);

/* Reads an input struct: `local` (`size` bytes, already holding the
 * defaults, e.g. from the _INIT macro) receives the first
 * min(in->struct_size, size) bytes of `in`, and its struct_size becomes
 * `size`. Refuses as cubuf__struct_check; `local` is unchanged then. */
cubuf_status_t cubuf__struct_in(const char *fn, const char *type, void *local, size_t size,
                                const void *in, size_t first);

/* Writes an output struct: `out` receives `full` (`size` bytes) up to its
 * struct_size, which it keeps. Call cubuf__struct_check on it first. */
void cubuf__struct_out(void *out, const void *full, size_t size);

/* The struct_size a caller set (every option struct begins with it). */
static inline size_t cubuf__struct_size_of(const void *s)
{
    return *(const size_t *)s;
}

#endif
