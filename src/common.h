/* What every cubuf source needs: the public API, the struct-size rule, host allocation, the driver table, errors and the checking macros. Private: never installed. */
#ifndef CUBUF_COMMON_H
#define CUBUF_COMMON_H

#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cubuf.h"
#include "abi.h"
#include "alloc.h"
#include "driver.h"

/* ---- thread-locals ------------------------------------------------------- */

/* The mark of the one function per source file that names its thread-locals,
 * returning their address; the rest of the file reaches them through it.
 * The library is built with TLS descriptors (-mtls-dialect=gnu2,
 * CMakeLists.txt): a thread-local read is a call the compiler takes to keep
 * every register but its result, vector registers included. glibc before
 * 2.40 breaks that promise on the descriptor's dynamic path (BZ#31372),
 * which a library loaded by dlopen (as the Python module loads cubuf) takes
 * on a thread's first read: a vector register the caller kept across the
 * read could come back changed (GCC did keep one, the zero a struct was
 * cleared with, across a read in the caching resource). Called as an
 * ordinary function instead, never inlined and with its register use hidden
 * from its callers (GCC's noipa; clang does no interprocedural register
 * allocation by default), the read is a call that keeps nothing: the caller
 * saves what it needs. tests/check_tls.sh checks the built library: every
 * descriptor call is in a function that does nothing else, and no caller of
 * one keeps a vector register across the call. */
#if defined(__clang__)
#define CUBUF_TLS_ACCESSOR __attribute__((noinline))
#elif defined(__GNUC__) && __GNUC__ >= 8
#define CUBUF_TLS_ACCESSOR __attribute__((noinline, noipa))
#else
#error "cubuf needs GCC 8 or later, or clang"
#endif

/* ---- errors (error.c) ---------------------------------------------------- */

/* Records a formatted detail as this thread's last error and returns st. */
cubuf_status_t cubuf__fail(cubuf_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* Appends " (...)" to the last error: the sizes or objects involved. */
void cubuf__detail_append(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Empties the thread's detail (cubuf_last_error), so that what a callee says can be told apart. */
void cubuf__detail_clear(void);
/* Sends a message to the warning handler. */
void cubuf__warn(cubuf_status_t st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Remembers the CUresult of a failed driver call for cubuf_last_cuda_result. */
void cubuf__set_last_cu(CUresult r);
/* The thread's detail and CUresult, kept across work whose own failure is
 * reported another way (a warning) inside a call that reports something
 * else: the log's write within an allocation, say. */
#define CUBUF__DETAIL_MAX 1024
typedef struct cubuf_error_saved {
    char detail[CUBUF__DETAIL_MAX];
    CUresult cu;
} cubuf_error_saved_t;
void cubuf__error_save(cubuf_error_saved_t *s);
void cubuf__error_restore(const cubuf_error_saved_t *s);

/* The checking macro: run a status-returning expression, unwind on failure.
 * Functions using it declare `cubuf_status_t st` and a `fail:` label. */
#define CHECK(expr)                                                                 \
    do {                                                                            \
        st = (expr);                                                                \
        if (st != CUBUF_SUCCESS) goto fail;                                         \
    } while (0)

#define CHECK_ARG(cond, ...)                                                        \
    do {                                                                            \
        if (!(cond)) return cubuf__fail(CUBUF_ERROR_INVALID_ARGUMENT, __VA_ARGS__); \
    } while (0)

#include "lock.h" /* the spin lock of the hot paths */

#endif
