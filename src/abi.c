/* Option and result structs across library versions (abi.h says the rule). */
#include <string.h>

#include "abi.h"
#include "internal.h"

cubuf_status_t cubuf__struct_check(const char *fn, const char *type, size_t struct_size,
                                   size_t first, size_t size)
{
    if (struct_size >= first) return CUBUF_SUCCESS;
    return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT,
                       "%s: struct_size of the %s is %zu, below %zu, the size of its first "
                       "layout (this library's is %zu); initialize it with its _INIT macro",
                       fn, type, struct_size, first, size);
}

cubuf_status_t cubuf__struct_in(const char *fn, const char *type, void *local, size_t size,
                                const void *in, size_t first)
{
    size_t given = cubuf__struct_size_of(in);
    cubuf_status_t st = cubuf__struct_check(fn, type, given, first, size);
    if (st != CUBUF_SUCCESS) return st;
    memcpy(local, in, given < size ? given : size);
    memcpy(local, &size, sizeof size);
    return CUBUF_SUCCESS;
}

void cubuf__struct_out(void *out, const void *full, size_t size)
{
    size_t given = cubuf__struct_size_of(out);
    size_t n = given < size ? given : size;
    if (n > sizeof(size_t))
        memcpy((char *)out + sizeof(size_t), (const char *)full + sizeof(size_t),
               n - sizeof(size_t));
}
