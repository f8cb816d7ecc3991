/* Virtual memory growth, in one run, against the raw driver:
 *  1. growing 2 MiB -> 64 GiB by doubling: each step of cubuf_vmm_modify_allocation
 *     against the floor (cuMemCreate + cuMemMap + cuMemSetAccess of the new
 *     part alone, into a range reserved beforehand) and against copy-based
 *     reallocation (cuMemAlloc of the new size + a device-to-device copy of
 *     the old contents + cuMemFree);
 *  2. a thousand grows of 2 MiB each, the same three ways;
 *  3. allocate + close against the raw sequence (reserve, create, map, set
 *     access; unmap, release, free).
 * Every time is wall clock (CLOCK_MONOTONIC) around synchronous driver work
 * (the copy is followed by cuCtxSynchronize); each figure is the median of
 * repeated runs. Target: every grow step within 1.10x the floor, i.e. the
 * cost of a grow follows its new part, not the total.
 * Memory: at most 64 GiB at a time for cubuf and the floor, 96 GiB for the
 * last copy step (skipped when the device lacks room). About 1-3 minutes. */
#include "bench_common.h"
#include "vmm.h"

#ifndef REPEATS
#define REPEATS 5
#endif
#ifndef STEPS_2MIB
#define STEPS_2MIB 1000
#endif
#define TIME_BUDGET_S 160.0

static bench_env_t env;
static cubuf_resource_t *g_res;
static size_t g_gran;
static CUmemAllocationProp g_prop;
static CUmemAccessDesc g_acc;
static double g_t0;

static bool over_budget(void) { return bench_now() - g_t0 > TIME_BUDGET_S; }

static double median_of(const double *v, int n)
{
    double tmp[64];
    for (int i = 0; i < n; i++) tmp[i] = v[i];
    return bench_median(tmp, n);
}

static size_t free_memory(void)
{
    size_t f = 0, t = 0;
    B_CU(cuMemGetInfo, &f, &t);
    return f;
}

/* ---- one chain of grows, three ways ---------------------------------------------------- */

/* cubuf: allocate `first`, then grow to sizes[k]; t[k] is grow k. The old
 * buffer is closed after each grow (not timed: it frees nothing). */
static int chain_cubuf(const size_t *sizes, int n, size_t first, double *t)
{
    cubuf_buffer_t *b = NULL;
    int moves = 0;
    B_OK(cubuf_resource_allocate(g_res, first, 0, &b));
    for (int k = 0; k < n; k++) {
        cubuf_buffer_t *nb = NULL;
        double t0 = bench_now();
        B_OK(cubuf_vmm_modify_allocation(g_res, b, sizes[k], NULL, &nb));
        t[k] = bench_now() - t0;
        moves += cubuf_buffer_ptr(nb) != cubuf_buffer_ptr(b);
        B_OK(cubuf_buffer_close(b));
        cubuf_buffer_release(b);
        b = nb;
    }
    B_OK(cubuf_buffer_close(b));
    cubuf_buffer_release(b);
    cubuf_resource_stats_t s;
    B_OK(cubuf_resource_stats(g_res, &s));
    if (s.current_bytes || s.current_count)
        bench_error(&env, "cubuf chain left %zu bytes in %zu allocations", s.current_bytes,
                    s.current_count);
    return moves;
}

/* The floor: the new part alone, created, mapped and granted access in a
 * range reserved before the chain (reservation not timed). */
static void chain_floor(const size_t *sizes, int n, size_t first, double *t)
{
    size_t top = sizes[n - 1];
    CUdeviceptr va = 0;
    B_CU(cuMemAddressReserve, &va, top, g_gran, 0, 0);
    CUmemGenericAllocationHandle *h = malloc((size_t)(n + 1) * sizeof *h);
    size_t *at = malloc((size_t)(n + 1) * sizeof *at), *len = malloc((size_t)(n + 1) * sizeof *len);
    if (!h || !at || !len) {
        fprintf(stderr, "error: out of host memory\n");
        exit(1);
    }
    B_CU(cuMemCreate, &h[0], first, &g_prop, 0);
    B_CU(cuMemMap, va, first, 0, h[0], 0);
    B_CU(cuMemSetAccess, va, first, &g_acc, 1);
    at[0] = 0;
    len[0] = first;
    size_t cur = first;
    for (int k = 0; k < n; k++) {
        size_t part = sizes[k] - cur;
        double t0 = bench_now();
        B_CU(cuMemCreate, &h[k + 1], part, &g_prop, 0);
        B_CU(cuMemMap, va + cur, part, 0, h[k + 1], 0);
        B_CU(cuMemSetAccess, va + cur, part, &g_acc, 1);
        t[k] = bench_now() - t0;
        at[k + 1] = cur;
        len[k + 1] = part;
        cur = sizes[k];
    }
    for (int k = n; k >= 0; k--) {
        B_CU(cuMemUnmap, va + at[k], len[k]);
        B_CU(cuMemRelease, h[k]);
    }
    B_CU(cuMemAddressFree, va, top);
    free(h);
    free(at);
    free(len);
}

/* Copy-based reallocation. A step the device has no room for (old + new at
 * once) is not run: t[k] = -1. */
static void chain_copy(const size_t *sizes, int n, size_t first, double *t)
{
    CUdeviceptr d = 0;
    B_CU(cuMemAlloc, &d, first);
    B_CU(cuMemsetD8, d, 1, first);
    size_t cur = first;
    for (int k = 0; k < n; k++) {
        if (sizes[k] + (2 * BENCH_GIB) > free_memory()) {
            for (; k < n; k++) t[k] = -1;
            break;
        }
        CUdeviceptr nd = 0;
        double t0 = bench_now();
        B_CU(cuMemAlloc, &nd, sizes[k]);
        B_CU(cuMemcpy, nd, d, cur); /* device to device (unified addressing) */
        B_CU(cuCtxSynchronize);
        B_CU(cuMemFree, d);
        t[k] = bench_now() - t0;
        d = nd;
        cur = sizes[k];
    }
    B_CU(cuMemFree, d);
}

/* ---- 1. doubling ------------------------------------------------------------------------ */

#define MAX_STEPS 40

static void bench_doubling(void)
{
    size_t first = 2 * BENCH_MIB > g_gran ? 2 * BENCH_MIB : g_gran;
    size_t top = 64 * BENCH_GIB;
    while (top > first * 2 && top + 4 * BENCH_GIB > free_memory()) top /= 2;
    if (top < 64 * BENCH_GIB)
        bench_note("the device has room for doubling up to %zu MiB only", top / BENCH_MIB);
    size_t sizes[MAX_STEPS];
    int n = 0;
    for (size_t s = first * 2; s <= top && n < MAX_STEPS; s *= 2) sizes[n++] = s;

    double lib[MAX_STEPS][REPEATS], raw[MAX_STEPS][REPEATS], cpy[MAX_STEPS][REPEATS];
    int moves = 0, reps = 0;
    for (int r = 0; r < REPEATS; r++) {
        double tl[MAX_STEPS], tr[MAX_STEPS], tc[MAX_STEPS];
        if (r % 2 == 0) {
            chain_floor(sizes, n, first, tr);
            moves += chain_cubuf(sizes, n, first, tl);
        } else {
            moves += chain_cubuf(sizes, n, first, tl);
            chain_floor(sizes, n, first, tr);
        }
        chain_copy(sizes, n, first, tc);
        for (int k = 0; k < n; k++) {
            lib[k][r] = tl[k];
            raw[k][r] = tr[k];
            cpy[k][r] = tc[k];
        }
        reps++;
        if (over_budget() && r >= 2) {
            bench_note("time budget reached after %d runs of the doubling chain", reps);
            break;
        }
    }

    printf("\n== grow by doubling: %zu MiB -> %zu MiB, median of %d runs (%d grows moved the range)\n",
           first / BENCH_MIB, top / BENCH_MIB, reps, moves);
    printf("%-22s %9s | %12s %12s %7s | %13s %9s | %s\n", "step", "new part", "floor", "cubuf",
           "ratio", "copy realloc", "copy/cub", "target");
    double worst = 0, ratios[MAX_STEPS];
    int worst_k = 0;
    for (int k = 0; k < n; k++) {
        double ml = median_of(lib[k], reps), mr = median_of(raw[k], reps);
        int nc = 0;
        double cv[REPEATS];
        for (int r = 0; r < reps; r++)
            if (cpy[k][r] >= 0) cv[nc++] = cpy[k][r];
        double mc = nc ? median_of(cv, nc) : -1;
        double ratio = ml / mr;
        ratios[k] = ratio;
        if (ratio > worst) {
            worst = ratio;
            worst_k = k;
        }
        char from[32], to[32], part[32], step[80], copy[32], copy_ratio[16], name[96];
        size_t prev = k ? sizes[k - 1] : first;
        bench_size_str(prev, false, from, sizeof from);
        bench_size_str(sizes[k], false, to, sizeof to);
        bench_size_str(sizes[k] - prev, false, part, sizeof part);
        snprintf(step, sizeof step, "%s -> %s", from, to);
        if (mc >= 0) {
            snprintf(copy, sizeof copy, "%10.1f us", mc * 1e6);
            snprintf(copy_ratio, sizeof copy_ratio, "%8.1fx", mc / ml);
        } else {
            snprintf(copy, sizeof copy, "%13s", "no room");
            snprintf(copy_ratio, sizeof copy_ratio, "%9s", "-");
        }
        printf("%-22s %9s | %9.1f us %9.1f us %7.3f | %13s %9s | <= 1.10 %s\n", step, part,
               mr * 1e6, ml * 1e6, ratio, copy, copy_ratio, ratio <= 1.10 ? "PASS" : "MISS");
        bench_size_str(sizes[k], true, to, sizeof to);
        snprintf(name, sizeof name, "vmm/grow_doubling/to_%s", to);
        bench_add_target(name, ratio, BENCH_TARGET_LE, 1.10);
    }
    double med = bench_median(ratios, n);
    char to[32];
    bench_size_str(sizes[worst_k], false, to, sizeof to);
    printf("RESULT grow_doubling: cubuf/floor worst %.3f (step to %s), median %.3f over %d steps\n",
           worst, to, med, n);
    double mc_last = -1;
    {
        int nc = 0;
        double cv[REPEATS];
        for (int r = 0; r < reps; r++)
            if (cpy[n - 1][r] >= 0) cv[nc++] = cpy[n - 1][r];
        if (nc) mc_last = median_of(cv, nc);
    }
    bench_size_str(sizes[n - 1], false, to, sizeof to);
    if (mc_last >= 0)
        printf("RESULT grow_doubling_copy: the last step (to %s) copy-based %.1f ms vs cubuf %.3f ms\n",
               to, mc_last * 1e3, median_of(lib[n - 1], reps) * 1e3);
}

/* ---- 2. steps of 2 MiB ---------------------------------------------------------------------- */

static void bench_steps(void)
{
    size_t step = 2 * BENCH_MIB > g_gran ? 2 * BENCH_MIB : g_gran;
    int n = STEPS_2MIB;
    size_t *sizes = malloc((size_t)n * sizeof *sizes);
    double *lib = malloc((size_t)n * REPEATS * sizeof *lib);
    double *raw = malloc((size_t)n * REPEATS * sizeof *raw);
    double *cpy = malloc((size_t)n * 3 * sizeof *cpy);
    double *tl = malloc((size_t)n * sizeof *tl), *tr = malloc((size_t)n * sizeof *tr);
    double *ratio = malloc((size_t)n * sizeof *ratio), *ml = malloc((size_t)n * sizeof *ml),
           *mr = malloc((size_t)n * sizeof *mr);
    if (!sizes || !lib || !raw || !cpy || !tl || !tr || !ratio || !ml || !mr) {
        fprintf(stderr, "error: out of host memory\n");
        exit(1);
    }
    for (int k = 0; k < n; k++) sizes[k] = (size_t)(k + 2) * step;
    int reps = 0, moves = 0;
    for (int r = 0; r < REPEATS; r++) {
        if (r % 2 == 0) {
            chain_floor(sizes, n, step, tr);
            moves += chain_cubuf(sizes, n, step, tl);
        } else {
            moves += chain_cubuf(sizes, n, step, tl);
            chain_floor(sizes, n, step, tr);
        }
        for (int k = 0; k < n; k++) {
            lib[k * REPEATS + r] = tl[k];
            raw[k * REPEATS + r] = tr[k];
        }
        reps++;
        if (over_budget() && r >= 2) break;
    }
    int creps = 0;
    for (int r = 0; r < 3 && !(over_budget() && r >= 1); r++) {
        chain_copy(sizes, n, step, tl);
        for (int k = 0; k < n; k++) cpy[k * 3 + r] = tl[k];
        creps++;
    }
    for (int k = 0; k < n; k++) {
        ml[k] = median_of(&lib[k * REPEATS], reps);
        mr[k] = median_of(&raw[k * REPEATS], reps);
        ratio[k] = ml[k] / mr[k];
    }
    printf("\n== %d grows of %zu MiB each (to %zu MiB), median of %d runs per step (%d grows moved "
           "the range)\n",
           n, step / BENCH_MIB, sizes[n - 1] / BENCH_MIB, reps, moves);
    printf("%-8s %10s | %12s %12s %7s | %13s\n", "step", "size", "floor", "cubuf", "ratio",
           "copy realloc");
    int worst = 0;
    for (int k = 0; k < n; k++)
        if (ratio[k] > ratio[worst]) worst = k;
    for (int k = 0; k < n; k++) {
        bool show = k == 0 || k == 1 || (k + 1) % 100 == 0 || k == worst;
        if (!show) continue;
        double cv[3];
        int nc = 0;
        for (int r = 0; r < creps; r++)
            if (cpy[k * 3 + r] >= 0) cv[nc++] = cpy[k * 3 + r];
        char size[32];
        bench_size_str(sizes[k], false, size, sizeof size);
        printf("%-8d %10s | %9.1f us %9.1f us %7.3f | %10.1f us%s\n", k + 1, size, mr[k] * 1e6,
               ml[k] * 1e6, ratio[k], nc ? median_of(cv, nc) * 1e6 : -1.0,
               k == worst ? "   <- worst ratio" : "");
    }
    double *sorted = malloc((size_t)n * sizeof *sorted);
    for (int k = 0; k < n; k++) sorted[k] = ratio[k];
    double med = bench_median(sorted, n); /* sorts */
    double p90 = sorted[(n * 9) / 10], p99 = sorted[(n * 99) / 100];
    int over = 0;
    for (int k = 0; k < n; k++) over += ratio[k] > 1.10;
    printf("RESULT grow_2mib_steps: cubuf/floor median %.3f, p90 %.3f, p99 %.3f, worst %.3f (step "
           "%d); %d of %d steps above 1.10\n",
           med, p90, p99, ratio[worst], worst + 1, over, n);
    double cl = -1;
    {
        double cv[3];
        int nc = 0;
        for (int r = 0; r < creps; r++)
            if (cpy[(n - 1) * 3 + r] >= 0) cv[nc++] = cpy[(n - 1) * 3 + r];
        if (nc) cl = median_of(cv, nc);
    }
    printf("RESULT grow_2mib_steps_copy: the last step copy-based %.1f us vs cubuf %.1f us\n", cl * 1e6,
           ml[n - 1] * 1e6);
    bench_add_target("vmm/grow_2MiB_steps/median", med, BENCH_TARGET_LE, 1.10);
    bench_add_target("vmm/grow_2MiB_steps/p90", p90, BENCH_TARGET_LE, 1.10);
    free(sorted);
    free(sizes);
    free(lib);
    free(raw);
    free(cpy);
    free(tl);
    free(tr);
    free(ratio);
    free(ml);
    free(mr);
}

/* ---- 3. allocate + close ------------------------------------------------------------------------- */

static void bench_alloc_close(void)
{
    static const size_t sizes[] = {2 * BENCH_MIB, 64 * BENCH_MIB, BENCH_GIB, 16 * BENCH_GIB};
    printf("\n== allocate + close vs the raw sequence (reserve, create, map, set access; unmap, "
           "release, free)\n");
    printf("%10s %6s | %12s %12s %7s | %12s %12s\n", "size", "runs", "raw", "cubuf", "ratio",
           "cubuf alloc", "cubuf close");
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        size_t size = sizes[i];
        if (size + 4 * BENCH_GIB > free_memory()) {
            bench_note("%zu MiB: no room on the device", size / BENCH_MIB);
            continue;
        }
        int runs = size <= 64 * BENCH_MIB ? 41 : size <= BENCH_GIB ? 11 : 5;
        double traw[64], tlib[64], ta[64], tc[64];
        for (int r = 0; r < runs + 1; r++) { /* run 0 warms up, unrecorded */
            double t0 = bench_now();
            CUdeviceptr va = 0;
            CUmemGenericAllocationHandle h;
            B_CU(cuMemAddressReserve, &va, size, g_gran, 0, 0);
            B_CU(cuMemCreate, &h, size, &g_prop, 0);
            B_CU(cuMemMap, va, size, 0, h, 0);
            B_CU(cuMemSetAccess, va, size, &g_acc, 1);
            B_CU(cuMemUnmap, va, size);
            B_CU(cuMemRelease, h);
            B_CU(cuMemAddressFree, va, size);
            double t1 = bench_now();
            cubuf_buffer_t *b = NULL;
            B_OK(cubuf_resource_allocate(g_res, size, 0, &b));
            double t2 = bench_now();
            B_OK(cubuf_buffer_close(b));
            double t3 = bench_now();
            cubuf_buffer_release(b);
            if (r == 0) continue;
            traw[r - 1] = t1 - t0;
            tlib[r - 1] = t3 - t1;
            ta[r - 1] = t2 - t1;
            tc[r - 1] = t3 - t2;
        }
        double mraw = median_of(traw, runs), mlib = median_of(tlib, runs);
        char s[32];
        bench_size_str(size, false, s, sizeof s);
        printf("%10s %6d | %9.1f us %9.1f us %7.3f | %9.1f us %9.1f us\n", s, runs, mraw * 1e6,
               mlib * 1e6, mlib / mraw, median_of(ta, runs) * 1e6, median_of(tc, runs) * 1e6);
        printf("RESULT alloc_close/%s: cubuf/raw %.3f (%.1f us vs %.1f us)\n", s, mlib / mraw,
               mlib * 1e6, mraw * 1e6);
    }
}

int main(void)
{
    bench_init(&env, "bench_vmm");
    g_t0 = bench_now();
    cubuf_status_t st = cubuf_vmm_resource_create(0, NULL, &g_res);
    if (st == CUBUF_ERROR_NOT_SUPPORTED) {
        printf("bench_vmm: %s\n", cubuf_last_error());
        return BENCH_SKIP;
    }
    B_OK(st);
    B_OK(cubuf_vmm_granularity(g_res, &g_gran));
    memset(&g_prop, 0, sizeof g_prop);
    g_prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    g_prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    g_prop.location.id = 0;
    memset(&g_acc, 0, sizeof g_acc);
    g_acc.location = g_prop.location;
    g_acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    printf("granularity %zu KiB; the resource's defaults match the raw calls (pinned device "
           "memory, no export handle, read-write for device 0)\n",
           g_gran >> 10);
    cubuf_vmm_live_t live0;
    cubuf__vmm_live(&live0);

    /* Warm-up: the first VMM calls of a process set things up lazily. */
    {
        size_t s[8];
        double t[8];
        for (int i = 0; i < 8; i++) s[i] = (size_t)(i + 2) * g_gran;
        chain_floor(s, 8, g_gran, t);
        chain_cubuf(s, 8, g_gran, t);
    }

    bench_doubling();
    bench_steps();
    bench_alloc_close();

    cubuf_vmm_live_t live1;
    cubuf__vmm_live(&live1);
    if (live1.reservations != live0.reservations || live1.mappings != live0.mappings ||
        live1.allocations != live0.allocations)
        bench_error(&env, "cubuf left reservations/mappings/allocations behind: %ld/%ld/%ld",
                    live1.reservations - live0.reservations, live1.mappings - live0.mappings,
                    live1.allocations - live0.allocations);
    cubuf_resource_release(g_res);
    printf("\ntotal time %.1f s\n", bench_now() - g_t0);
    int rc = bench_summary(&env, "bench_vmm");
    bench_fini(&env);
    return rc;
}
