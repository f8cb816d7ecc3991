/* Shared by the benchmark programs: setup, timing, statistics, the
 * raw-versus-cubuf comparison loop, the table and the TARGET summary.
 *
 * Every comparison measures the raw driver (through the same table,
 * cubuf__drv, that the library calls) and cubuf doing the same work on the
 * same memory and stream, in the same run:
 *  - a sample times a batch of n operations and divides by n, so that small
 *    operations are not lost in the clock's resolution and the final
 *    synchronization is shared by many of them;
 *  - latency samples read CLOCK_MONOTONIC around the batch with the stream
 *    synchronized before both readings; bandwidth samples record CUDA events
 *    around the batch;
 *  - both sides run once unmeasured (and, for the process's first
 *    comparison, for two seconds), n is calibrated on the raw side, then
 *    both sides run once more unmeasured;
 *  - samples alternate raw, cubuf, cubuf, raw, ... so that drift (clocks,
 *    temperature, other tenants) hits both sides alike;
 *  - the table gives the median and the best (minimum) of each side; the
 *    ratio is cubuf/raw of the medians (for bandwidth: cubuf/raw of GB/s).
 *
 * Each bench_*.c is one program and includes this header once; hence the
 * static state below. */
#ifndef CUBUF_BENCH_COMMON_H
#define CUBUF_BENCH_COMMON_H

#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cubuf.h"
#include "driver.h"

#define BENCH_SKIP 77
#define BENCH_KIB ((size_t)1 << 10)
#define BENCH_MIB ((size_t)1 << 20)
#define BENCH_GIB ((size_t)1 << 30)

static inline void bench_die_cu(const char *call, CUresult r, const char *file, int line)
{
    const char *name = NULL;
    if (!cubuf__drv.cuGetErrorName || cubuf__drv.cuGetErrorName(r, &name) != CUDA_SUCCESS) name = "?";
    fprintf(stderr, "%s:%d: error: %s failed: %s (%d)\n", file, line, call, name, (int)r);
    exit(1);
}

static inline void bench_die_st(const char *call, cubuf_status_t st, const char *file, int line)
{
    fprintf(stderr, "%s:%d: error: %s returned %s: %s\n", file, line, call, cubuf_status_name(st),
            cubuf_last_error());
    exit(1);
}

/* A raw driver call that must succeed (setup and the raw side of a
 * comparison). Through the table, like the library's own calls. */
#define B_CU(fn, ...)                                                          \
    do {                                                                       \
        CUresult b_r_ = cubuf__drv.fn(__VA_ARGS__);                            \
        if (b_r_ != CUDA_SUCCESS) bench_die_cu(#fn, b_r_, __FILE__, __LINE__); \
    } while (0)

/* A cubuf call that must succeed. */
#define B_OK(expr)                                                               \
    do {                                                                         \
        cubuf_status_t b_st_ = (expr);                                           \
        if (b_st_ != CUBUF_SUCCESS) bench_die_st(#expr, b_st_, __FILE__, __LINE__); \
    } while (0)

static inline double bench_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* "4 KiB", "256 MiB", "1 GiB"; `compact` drops the space (for TARGET names). */
static inline const char *bench_size_str(size_t size, bool compact, char *buf, size_t cap)
{
    static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int u = 0;
    size_t v = size;
    while (u < 4 && v >= 1024 && v % 1024 == 0) {
        v /= 1024;
        u++;
    }
    snprintf(buf, cap, compact ? "%zu%s" : "%zu %s", v, units[u]);
    return buf;
}

/* ---- setup ---------------------------------------------------------------- */

typedef struct bench_env {
    cubuf_context_t *ctx; /* device 0, its primary context made current */
    CUcontext cu_ctx;
    CUdevice dev;
    CUstream stream;      /* a created non-blocking stream both sides use */
    CUevent ev_start, ev_stop;
    int errors;           /* leaks or wrong results seen: exit 1 at the end */
} bench_env_t;

/* Exits 77 with a sentence when there is no driver or no GPU; exits 1 on
 * any other failure. Makes device 0's primary context current, as a program
 * using the raw driver would have it: the raw calls need it, and cubuf then
 * finds its context current and skips the push. */
static inline void bench_init(bench_env_t *env, const char *program)
{
    memset(env, 0, sizeof *env);
    int count = 0;
    cubuf_status_t st = cubuf_device_count(&count);
    if (st != CUBUF_SUCCESS && st != CUBUF_ERROR_NO_DRIVER && st != CUBUF_ERROR_NO_DEVICE)
        bench_die_st("cubuf_device_count", st, __FILE__, __LINE__);
    if (st != CUBUF_SUCCESS || count == 0) {
        printf("%s: no CUDA GPU is available here (%s), so there is nothing to measure.\n", program,
               st != CUBUF_SUCCESS ? cubuf_last_error() : "the driver reports no device");
        exit(BENCH_SKIP);
    }
    B_OK(cubuf_context_create(0, &env->ctx));
    B_OK(cubuf_context_handle(env->ctx, &env->cu_ctx));
    B_CU(cuCtxSetCurrent, env->cu_ctx);
    B_CU(cuCtxGetDevice, &env->dev);
    B_CU(cuStreamCreate, &env->stream, CU_STREAM_NON_BLOCKING);
    B_CU(cuEventCreate, &env->ev_start, CU_EVENT_DEFAULT);
    B_CU(cuEventCreate, &env->ev_stop, CU_EVENT_DEFAULT);

    char name[256] = "?";
    B_CU(cuDeviceGetName, name, (int)sizeof name, env->dev);
    int version = 0;
    B_OK(cubuf_driver_version(&version));
    printf("%s: cubuf %s, CUDA driver %d.%d, device 0: %s\n", program, cubuf_version_string(),
           version / 1000, version % 1000 / 10, name);
    printf("Each row: raw driver vs cubuf on the same memory and stream; median and best (min) of\n"
           "interleaved samples (raw, cubuf, cubuf, raw, ...), each the mean over a batch of n operations.\n"
           "ratio = cubuf/raw of the medians (time for latency rows, GB/s for bandwidth rows);\n"
           "best = the same of the minimums.\n");
}

static inline void bench_fini(bench_env_t *env)
{
    B_CU(cuCtxSynchronize);
    B_CU(cuEventDestroy, env->ev_start);
    B_CU(cuEventDestroy, env->ev_stop);
    B_CU(cuStreamDestroy, env->stream);
    cubuf_context_destroy(env->ctx);
}

/* ---- statistics ----------------------------------------------------------- */

static inline int bench_cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Sorts v in place; returns the median. */
static inline double bench_median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, bench_cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* ---- the comparison ------------------------------------------------------- */

typedef enum bench_mode {
    BENCH_LATENCY,   /* wall clock around a synchronized batch; seconds per op */
    BENCH_BANDWIDTH, /* CUDA events around a batch; GB/s */
} bench_mode_t;

typedef enum bench_target_kind {
    BENCH_TARGET_NONE, /* informational row */
    BENCH_TARGET_LE,   /* ratio <= bound passes (times) */
    BENCH_TARGET_GE,   /* ratio >= bound passes (bandwidth) */
    BENCH_TARGET_NS_LE, /* cubuf median minus raw median <= bound ns passes (an added cost) */
} bench_target_kind_t;

/* One operation of one side; `arg` is the case's. */
typedef void (*bench_op_fn)(void *arg);

typedef struct bench_case {
    const char *group;      /* "alloc", "copy", ... */
    const char *name;       /* "device_pool", "D2D", ... */
    size_t size;            /* bytes per operation */
    bench_mode_t mode;
    CUstream stream;        /* the stream the operations run on */
    bench_op_fn raw, lib;   /* the raw driver and cubuf doing the same work */
    void *arg;
    double sample_s;        /* aim for samples at least this long */
    long max_batch;         /* at most this many operations per sample */
    double budget_s;        /* aim for the pairs of samples to take about this long */
    int min_pairs, max_pairs;
    bench_target_kind_t target;
    double bound;
    const char *target_name; /* NULL: "<group>/<name>/<size>" */
} bench_case_t;

typedef struct bench_result {
    double raw_med, raw_min, lib_med, lib_min; /* seconds per operation */
    double ratio, best_ratio;                  /* cubuf/raw, as the row prints them */
    long batch;
    int pairs;
} bench_result_t;

/* Seconds per operation over a batch of n. */
static inline double bench_batch(bench_env_t *env, const bench_case_t *c, bench_op_fn op, long n)
{
    B_CU(cuStreamSynchronize, c->stream);
    if (c->mode == BENCH_LATENCY) {
        double t0 = bench_now();
        for (long i = 0; i < n; i++) op(c->arg);
        B_CU(cuStreamSynchronize, c->stream);
        return (bench_now() - t0) / (double)n;
    }
    B_CU(cuEventRecord, env->ev_start, c->stream);
    for (long i = 0; i < n; i++) op(c->arg);
    B_CU(cuEventRecord, env->ev_stop, c->stream);
    B_CU(cuEventSynchronize, env->ev_stop);
    float ms = 0;
    B_CU(cuEventElapsedTime, &ms, env->ev_start, env->ev_stop);
    return (double)ms * 1e-3 / (double)n;
}

#define BENCH_MAX_TARGETS 256
static struct bench_target {
    char name[96];
    double ratio, bound;
    bench_target_kind_t kind;
} bench_targets[BENCH_MAX_TARGETS];
static int bench_ntargets;

static inline void bench_add_target(const char *name, double ratio, bench_target_kind_t kind,
                                    double bound)
{
    if (kind == BENCH_TARGET_NONE || bench_ntargets == BENCH_MAX_TARGETS) return;
    struct bench_target *t = &bench_targets[bench_ntargets++];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->ratio = ratio;
    t->bound = bound;
    t->kind = kind;
}

static inline bool bench_target_pass(bench_target_kind_t kind, double ratio, double bound)
{
    return kind == BENCH_TARGET_GE ? ratio >= bound : ratio <= bound;
}

/* Section heading and column titles. */
static inline void bench_section(const char *title)
{
    printf("\n== %s\n", title);
    printf("%-7s %-26s %8s %6s %5s | %12s %12s | %12s %12s | %6s %6s | %s\n", "group", "case", "size",
           "n", "pairs", "raw median", "raw best", "cubuf median", "cubuf best", "ratio", "best",
           "target");
}

static inline void bench_value_str(const bench_case_t *c, double sec_per_op, char *buf, size_t cap)
{
    if (c->mode == BENCH_LATENCY)
        snprintf(buf, cap, "%9.3f us", sec_per_op * 1e6);
    else
        snprintf(buf, cap, "%7.1f GB/s", (double)c->size / sec_per_op * 1e-9);
}

static inline void bench_print_row(const bench_case_t *c, const bench_result_t *r)
{
    char size[32], rm[32], rb[32], lm[32], lb[32], target[48] = "-";
    bench_size_str(c->size, false, size, sizeof size);
    bench_value_str(c, r->raw_med, rm, sizeof rm);
    bench_value_str(c, r->raw_min, rb, sizeof rb);
    bench_value_str(c, r->lib_med, lm, sizeof lm);
    bench_value_str(c, r->lib_min, lb, sizeof lb);
    if (c->target == BENCH_TARGET_NS_LE) {
        double added = (r->lib_med - r->raw_med) * 1e9;
        snprintf(target, sizeof target, "+%.1f ns <= %.0f %s", added, c->bound,
                 bench_target_pass(c->target, added, c->bound) ? "PASS" : "MISS");
    } else if (c->target != BENCH_TARGET_NONE) {
        snprintf(target, sizeof target, "%s %.2f %s", c->target == BENCH_TARGET_LE ? "<=" : ">=",
                 c->bound, bench_target_pass(c->target, r->ratio, c->bound) ? "PASS" : "MISS");
    }
    printf("%-7s %-26s %8s %6ld %5d | %12s %12s | %12s %12s | %6.3f %6.3f | %s\n", c->group, c->name,
           size, r->batch, r->pairs, rm, rb, lm, lb, r->ratio, r->best_ratio, target);
    fflush(stdout);
}

/* Runs one comparison, prints its row and records its target. */
static inline bench_result_t bench_compare(bench_env_t *env, const bench_case_t *c)
{
    bench_result_t r;
    memset(&r, 0, sizeof r);

    /* The first call of either side may set things up lazily (a pool's
     * first memory, a resource's structures): run both once unmeasured, so
     * that calibration does not mistake that for the cost of an operation.
     * The first comparison of a process also spins both sides for a while:
     * on the H200 host the first seconds after setup ran up to 1.5x slower. */
    static bool process_warm;
    bench_batch(env, c, c->raw, 1);
    bench_batch(env, c, c->lib, 1);
    for (double t0 = bench_now(); !process_warm && bench_now() - t0 < 2.0;) {
        bench_batch(env, c, c->raw, 16);
        bench_batch(env, c, c->lib, 16);
    }
    process_warm = true;

    /* Calibrate n on the raw side; this is also its warm-up. Growth is
     * bounded so that one slow call cannot inflate n. */
    long n = 1;
    double per = 0;
    for (;;) {
        per = bench_batch(env, c, c->raw, n);
        if (per * (double)n >= c->sample_s || n >= c->max_batch) break;
        long want = (long)(c->sample_s / (per > 0 ? per : 1e-9)) + 1;
        if (want > 8 * n) want = 8 * n;
        if (want <= n) want = n + 1;
        n = want < c->max_batch ? want : c->max_batch;
    }
    /* Warm up cubuf (its first call may create things lazily) and measure
     * the raw side once more after it, so both start from the same state. */
    bench_batch(env, c, c->lib, n);
    bench_batch(env, c, c->lib, n);
    per = bench_batch(env, c, c->raw, n);

    int pairs = (int)(c->budget_s / (2 * per * (double)n));
    if (pairs < c->min_pairs) pairs = c->min_pairs;
    if (pairs > c->max_pairs) pairs = c->max_pairs;
    double *raw = malloc((size_t)pairs * sizeof *raw);
    double *lib = malloc((size_t)pairs * sizeof *lib);
    if (!raw || !lib) {
        fprintf(stderr, "error: out of host memory\n");
        exit(1);
    }
    for (int i = 0; i < pairs; i++) {
        if (i % 2 == 0) {
            raw[i] = bench_batch(env, c, c->raw, n);
            lib[i] = bench_batch(env, c, c->lib, n);
        } else {
            lib[i] = bench_batch(env, c, c->lib, n);
            raw[i] = bench_batch(env, c, c->raw, n);
        }
    }
    r.raw_med = bench_median(raw, pairs);
    r.lib_med = bench_median(lib, pairs);
    r.raw_min = raw[0];
    r.lib_min = lib[0];
    free(raw);
    free(lib);
    r.batch = n;
    r.pairs = pairs;
    /* Times: cubuf/raw (lower is better). Bandwidth: cubuf/raw of GB/s,
     * which is raw/cubuf of the times (higher is better). */
    if (c->mode == BENCH_LATENCY) {
        r.ratio = r.lib_med / r.raw_med;
        r.best_ratio = r.lib_min / r.raw_min;
    } else {
        r.ratio = r.raw_med / r.lib_med;
        r.best_ratio = r.raw_min / r.lib_min;
    }
    bench_print_row(c, &r);

    char name[96], size[32];
    if (c->target_name) {
        snprintf(name, sizeof name, "%s", c->target_name);
    } else {
        bench_size_str(c->size, true, size, sizeof size);
        snprintf(name, sizeof name, "%s/%s/%s", c->group, c->name, size);
    }
    bench_add_target(name, c->target == BENCH_TARGET_NS_LE ? (r.lib_med - r.raw_med) * 1e9 : r.ratio,
                     c->target, c->bound);
    return r;
}

/* An informational line in the table (a skipped case, a note). */
static inline void bench_note(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static inline void bench_note(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    printf("   note: ");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    fflush(stdout);
}

/* Reports a wrong result or a leak; the program exits 1 at the end. */
static inline void bench_error(bench_env_t *env, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static inline void bench_error(bench_env_t *env, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "error: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    env->errors++;
}

/* The summary: one line per target. Returns the exit status: 0 (a MISS is
 * not an error: benchmarks are not tests), 1 if an error was reported. */
static inline int bench_summary(const bench_env_t *env, const char *program)
{
    int pass = 0;
    printf("\n== %s summary\n", program);
    for (int i = 0; i < bench_ntargets; i++) {
        const struct bench_target *t = &bench_targets[i];
        bool ok = bench_target_pass(t->kind, t->ratio, t->bound);
        pass += ok;
        if (t->kind == BENCH_TARGET_NS_LE)
            printf("TARGET %s: added %.1f ns (target <= %.0f ns) %s\n", t->name, t->ratio, t->bound,
                   ok ? "PASS" : "MISS");
        else
            printf("TARGET %s: ratio %.3f (target %s %.2f) %s\n", t->name, t->ratio,
                   t->kind == BENCH_TARGET_LE ? "<=" : ">=", t->bound, ok ? "PASS" : "MISS");
    }
    printf("%s: %d of %d targets met", program, pass, bench_ntargets);
    if (env->errors) printf("; %d ERROR(S) (see stderr)", env->errors);
    printf("\n");
    return env->errors ? 1 : 0;
}

#endif
