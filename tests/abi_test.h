/* What test_abi and test_abi_gpu share: callers' structs of a chosen
 * struct_size, inputs ending at an inaccessible page (reading past what the
 * caller gave faults), outputs followed by guard bytes. */
#ifndef CUBUF_ABI_TEST_H
#define CUBUF_ABI_TEST_H

#include <sys/mman.h>
#include <unistd.h>

#include "test.h"

#define MORE 64 /* bytes a newer header's struct has beyond ours */

/* ---- inputs: the struct ends where an inaccessible page begins ---------- */

__attribute__((unused)) static unsigned char *guard_page; /* PROT_NONE, right after a readable page */

__attribute__((unused)) static void guard_init(void)
{
    long page = sysconf(_SC_PAGESIZE);
    unsigned char *m = mmap(NULL, 2 * (size_t)page, PROT_READ | PROT_WRITE,
                            MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED || mprotect(m + page, (size_t)page, PROT_NONE) != 0) {
        perror("mmap");
        exit(1);
    }
    guard_page = m + page;
}

/* A caller's struct of `size` bytes built from `init` (this library's `full`
 * bytes with their values), struct_size `size`, bytes past `full` garbage.
 * It ends at the guard page, rounded up to 8 bytes for alignment. */
__attribute__((unused)) static const void *input(const void *init, size_t full, size_t size)
{
    size_t room = (size + 7) & ~(size_t)7;
    unsigned char *p = guard_page - room;
    memset(p, 0xa5, room);
    memcpy(p, init, size < full ? size : full);
    memcpy(p, &size, sizeof size);
    return p;
}

__attribute__((unused)) static bool detail_names(const char *type, size_t given, size_t first)
{
    char sizes[64];
    snprintf(sizes, sizeof sizes, "is %zu, below %zu", given, first);
    if (strstr(cubuf_last_error(), type) && strstr(cubuf_last_error(), sizes)) return true;
    fprintf(stderr, "  detail \"%s\" should name %s and \"%s\"\n", cubuf_last_error(), type, sizes);
    return false;
}

/* The three cases for an input type; `accepted` is the status of a call
 * whose struct was accepted. */
#define INPUTS(type, init, v1, call, accepted)                                           \
    do {                                                                                 \
        const type init_ = init;                                                         \
        const type *o_ = input(&init_, sizeof init_, (v1));                              \
        T_STATUS(call, accepted);                                                        \
        o_ = input(&init_, sizeof init_, (v1) - 1);                                      \
        T_STATUS(call, CUBUF_ERROR_INVALID_ARGUMENT);                                    \
        T_CHECK(detail_names(#type, (v1) - 1, (v1)));                                    \
        o_ = input(&init_, sizeof init_, sizeof init_ + MORE);                           \
        T_STATUS(call, accepted);                                                        \
    } while (0)

/* ---- outputs: guard bytes after the caller's struct ---------------------- */

static _Alignas(16) unsigned char out_buf[2048];

__attribute__((unused)) static void *output(size_t size)
{
    memset(out_buf, 0x5a, sizeof out_buf);
    memcpy(out_buf, &size, sizeof size);
    return out_buf;
}

__attribute__((unused)) static bool untouched_from(size_t from)
{
    for (size_t i = from; i < sizeof out_buf; i++)
        if (out_buf[i] != 0x5a) {
            fprintf(stderr, "  byte %zu was written (struct of %zu bytes)\n", i, from);
            return false;
        }
    return true;
}

/* `call` fills *o_; `same(o_, &full)` compares its fields (all of them are
 * version 1's) with a full-size result. */
#define OUTPUTS(type, v1, call, same, full)                                              \
    do {                                                                                 \
        type *o_ = output(v1);                                                           \
        T_OK(call);                                                                      \
        T_CHECK(untouched_from(v1));                                                     \
        T_CHECK(same(o_, &(full)));                                                      \
        o_ = output((v1) - 1);                                                           \
        T_STATUS(call, CUBUF_ERROR_INVALID_ARGUMENT);                                    \
        T_CHECK(detail_names(#type, (v1) - 1, (v1)));                                    \
        T_CHECK(untouched_from(sizeof(size_t)));                                         \
        o_ = output(sizeof(type) + MORE);                                                \
        T_OK(call);                                                                      \
        T_CHECK(untouched_from(sizeof(type)));                                           \
        T_CHECK(same(o_, &(full)));                                                      \
        T_CHECK(o_->struct_size == sizeof(type) + MORE);                                 \
    } while (0)

#endif
