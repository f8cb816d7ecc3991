/* A tiny test harness: each test is a program; exit 0 pass, 1 fail, 77 skipped. */
#ifndef CUBUF_TEST_H
#define CUBUF_TEST_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cubuf.h"
#include "driver.h"
#include "fault.h"

#define T_SKIP 77

static int t_failures;

#define T_CHECK(cond)                                                                    \
    do {                                                                                 \
        if (!(cond)) {                                                                   \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);     \
            t_failures++;                                                                \
        }                                                                                \
    } while (0)

/* Expects a status; prints the detail when it differs. */
#define T_STATUS(expr, expected)                                                         \
    do {                                                                                 \
        cubuf_status_t t_st_ = (expr);                                                   \
        if (t_st_ != (expected)) {                                                       \
            fprintf(stderr, "%s:%d: %s returned %s, expected %s (%s)\n", __FILE__,         \
                    __LINE__, #expr, cubuf_status_name(t_st_), cubuf_status_name(expected), \
                    cubuf_last_error());                                                 \
            t_failures++;                                                                \
        }                                                                                \
    } while (0)

#define T_OK(expr) T_STATUS(expr, CUBUF_SUCCESS)

/* Aborts the test at once (later steps depend on this one). */
#define T_REQUIRE(expr)                                                                  \
    do {                                                                                 \
        cubuf_status_t t_st_ = (expr);                                                   \
        if (t_st_ != CUBUF_SUCCESS) {                                                    \
            fprintf(stderr, "%s:%d: %s returned %s (%s)\n", __FILE__, __LINE__, #expr,    \
                    cubuf_status_name(t_st_), cubuf_last_error());                       \
            exit(1);                                                                     \
        }                                                                                \
    } while (0)

/* Exits 77 unless a driver and at least `n` devices are present. */
static inline void t_require_gpus(int n)
{
    int count = 0;
    cubuf_status_t st = cubuf_device_count(&count);
    if (st != CUBUF_SUCCESS || count < n) {
        printf("SKIP: needs %d CUDA device(s): %s\n", n,
               st != CUBUF_SUCCESS ? cubuf_last_error() : "not enough devices");
        exit(T_SKIP);
    }
}
#define t_require_gpu() t_require_gpus(1)

/* Free device memory of the current context's device (leak checks). */
static inline size_t t_free_device_memory(void)
{
    size_t free_b = 0, total_b = 0;
    if (cubuf__drv.cuMemGetInfo(&free_b, &total_b) != CUDA_SUCCESS) return 0;
    return free_b;
}

/* Raw driver call that must succeed (test setup). */
#define T_CU(fn, ...)                                                                    \
    do {                                                                                 \
        CUresult t_r_ = cubuf__drv.fn(__VA_ARGS__);                                      \
        if (t_r_ != CUDA_SUCCESS) {                                                      \
            fprintf(stderr, "%s:%d: %s failed: %d\n", __FILE__, __LINE__, #fn, (int)t_r_); \
            exit(1);                                                                     \
        }                                                                                \
    } while (0)

static inline int t_finish(const char *name)
{
    cubuf_fault_reset();
    if (t_failures) {
        fprintf(stderr, "%s: %d check(s) failed\n", name, t_failures);
        return 1;
    }
    printf("%s: all checks passed\n", name);
    return 0;
}

#endif
