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
