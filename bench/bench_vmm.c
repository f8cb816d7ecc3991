/* Virtual memory growth, in one run, against the raw driver:
 *  1. growing 2 MiB -> 64 GiB by doubling: each step of cubuf_vmm_modify_allocation
 *     against the floor (cuMemCreate + cuMemMap + cuMemSetAccess of the new
 *     part alone, into a range reserved beforehand) and against copy-based
 *     reallocation (cuMemAlloc of the new size + a device-to-device copy of
 *     the old contents + cuMemFree);
 *  2. a thousand grows of 2 MiB each, the same three ways;
 *  3. allocate + close against the raw sequence (reserve, create, map, set
 *     access; unmap, release, free), with diagnostic raw variants.
 * Every time is wall clock (CLOCK_MONOTONIC) around synchronous driver work
 * (the copy is followed by cuCtxSynchronize); each figure is the median of
 * repeated runs. Target: every grow step within 1.10x the floor, i.e. the
 * cost of a grow follows its new part, not the total.
 *
 * Fairness. The driver's cost for a call depends on what came just before
 * it (freed memory, page tables, drift), so neither side may always go
 * first:
 *  - grows: cubuf's chain and the floor's chain are alive at once, and step
 *    k of each is timed back to back, the floor first when k + run is even.
 *    Where both chains at a step's size do not fit in free memory (with
 *    PAIR_MARGIN to spare), that step and the rest run one chain after the
 *    other, as before this scheme: the second chain is closed, the first
 *    runs on alone to the top and closes, then the second is made again
 *    (untimed, the same steps) and runs on alone; the floor leads on even
 *    runs. The tables say which steps ran so. The floor's range is
 *    requested (a hint) right after the most that cubuf's range reserves in
 *    place, so that cubuf's growth cannot run into it and move, and so that
 *    both bases sit at the same offset past a 1 GiB boundary.
 *  - allocate + close: raw and cubuf alternate which goes first (even runs:
 *    raw); the diagnostic variants follow in a rotating order.
 * Diagnostics (informational, no target): each run's chain bases and where
 * they sit past a 1 GiB boundary (the span of one page directory with
 * Hopper's 2 MiB pages), the worst step's times per run with whether its new
 * part starts at or crosses such a boundary (or a 512 MiB one: which
 * directory level matters is not certain) and whether cubuf reserved
 * address space in it, and every sample (step x run) grouped by those
 * flags with its times and ratio; for allocate + close, raw with cubuf's
 * reservation size and raw with the stream synchronization cubuf's close
 * must do, and the medians of the runs each side went first / second.
 * Memory: at most 2 x 64 GiB at a time for cubuf and the floor together
 * (64 GiB when only one chain fits), 96 GiB for the last copy step
 * (skipped when the device lacks room). About 1-3 minutes. */
#include "bench_common.h"
#include "vmm.h"

#ifndef REPEATS
#define REPEATS 11
#endif
#ifndef STEPS_2MIB
#define STEPS_2MIB 1000
#endif
#define TIME_BUDGET_S 160.0

_Static_assert(REPEATS >= 1 && REPEATS <= 64, "median_of sorts at most 64 values");

/* Free memory both chains of a grow comparison must leave: the driver's
 * own bookkeeping (page tables) must not run out mid-chain. */
#define PAIR_MARGIN (2 * BENCH_GIB)
/* The span of one page directory with 2 MiB pages on Hopper: a new part
 * that starts at or crosses a multiple of it may have to wait for a new
 * page table, the suspect for single slow steps. PD_HALF: the same at half
 * that span, in case the directory level that matters covers 512 MiB. */
#define PD_SPAN BENCH_GIB
#define PD_HALF (PD_SPAN / 2)
/* The per-step ratio above which a step misses its target. */
#define STEP_BOUND 1.10

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

static void *xmalloc(size_t size)
{
    void *p = malloc(size);
    if (!p) {
        fprintf(stderr, "error: out of host memory\n");
        exit(1);
    }
    return p;
}

/* Whether [lo, lo + len) starts at or crosses a multiple of span. */
static bool touches_boundary(CUdeviceptr lo, size_t len, size_t span)
{
    return lo % span == 0 || lo / span != (lo + len - 1) / span;
}

/* What cubuf reserves for a buffer of `total` bytes (its own policy). */
static size_t cubuf_reserve_size(size_t total, size_t gran)
{
    return cubuf__vmm_reserve_target(total, gran);
}

/* ---- one chain of grows, cubuf's or the floor's ---------------------------------------- */

typedef enum side { SIDE_FLOOR = 0, SIDE_CUBUF = 1 } side_t;

static side_t other_side(side_t s) { return s == SIDE_FLOOR ? SIDE_CUBUF : SIDE_FLOOR; }

/* A buffer grown step by step: by cubuf, or by the floor, which maps each
 * new part alone into a range reserved when the chain opens (the
 * reservation is not timed). */
typedef struct chain {
    side_t side;
    bool open;
    size_t cur;                      /* bytes mapped */
    cubuf_buffer_t *buf;             /* cubuf: the newest buffer */
    CUdeviceptr va;                  /* floor: the range */
    size_t top;                      /* floor: its size */
    CUmemGenericAllocationHandle *h; /* floor: each mapping's allocation, */
    size_t *at, *len;                /* offset and size */
    int nmaps;
} chain_t;

/* What one step did. */
typedef struct step_out {
    double t;         /* seconds */
    CUdeviceptr part; /* where the new part was mapped */
    size_t len;       /* its size */
    bool reserved;    /* cubuf reserved address space (extended or moved the range) */
    bool moved;       /* cubuf moved the range */
} step_out_t;

/* Creates, maps and grants access to `part` bytes right after what the
 * floor maps. */
static void floor_map(chain_t *c, size_t part)
{
    CUmemGenericAllocationHandle *h = &c->h[c->nmaps];
    B_CU(cuMemCreate, h, part, &g_prop, 0);
    B_CU(cuMemMap, c->va + c->cur, part, 0, *h, 0);
    B_CU(cuMemSetAccess, c->va + c->cur, part, &g_acc, 1);
    c->at[c->nmaps] = c->cur;
    c->len[c->nmaps] = part;
    c->nmaps++;
    c->cur += part;
}

/* Opens a chain at `first` bytes; the floor's takes at most `max_steps`
 * steps up to `top` bytes, in a range reserved at `hint` if the driver can
 * (0: anywhere). */
static void chain_open(chain_t *c, side_t side, size_t first, size_t top, int max_steps,
                       CUdeviceptr hint)
{
    memset(c, 0, sizeof *c);
    c->side = side;
    c->open = true;
    if (side == SIDE_CUBUF) {
        B_OK(cubuf_resource_allocate(g_res, first, 0, &c->buf));
        c->cur = first;
        return;
    }
    size_t n = (size_t)max_steps + 1;
    c->h = xmalloc(n * sizeof *c->h);
    c->at = xmalloc(n * sizeof *c->at);
    c->len = xmalloc(n * sizeof *c->len);
    c->top = top;
    B_CU(cuMemAddressReserve, &c->va, top, g_gran, hint, 0);
    floor_map(c, first);
}

static CUdeviceptr chain_base(const chain_t *c)
{
    return c->side == SIDE_CUBUF ? cubuf_buffer_ptr(c->buf) : c->va;
}

/* Grows the chain to `size` bytes; times the grow alone. */
static step_out_t chain_step(chain_t *c, size_t size)
{
    step_out_t o;
    memset(&o, 0, sizeof o);
    o.len = size - c->cur;
    if (c->side == SIDE_FLOOR) {
        o.part = c->va + c->cur;
        double t0 = bench_now();
        floor_map(c, o.len);
        o.t = bench_now() - t0;
        return o;
    }
    cubuf_vmm_live_t before, after;
    cubuf_buffer_t *nb = NULL;
    cubuf__vmm_live(&before);
    double t0 = bench_now();
    B_OK(cubuf_vmm_modify_allocation(g_res, c->buf, size, NULL, &nb));
    o.t = bench_now() - t0;
    cubuf__vmm_live(&after);
    o.reserved = after.reservations > before.reservations;
    o.moved = cubuf_buffer_ptr(nb) != cubuf_buffer_ptr(c->buf);
    o.part = cubuf_buffer_ptr(nb) + c->cur;
    /* The old buffer aliases the new one, so closing it frees nothing:
     * not part of the grow, not timed. */
    B_OK(cubuf_buffer_close(c->buf));
    cubuf_buffer_release(c->buf);
    c->buf = nb;
    c->cur = size;
    return o;
}

static void chain_close(chain_t *c)
{
    if (!c->open) return;
    c->open = false;
    if (c->side == SIDE_CUBUF) {
        B_OK(cubuf_buffer_close(c->buf));
        cubuf_buffer_release(c->buf);
        cubuf_resource_stats_t s = CUBUF_RESOURCE_STATS_INIT;
        B_OK(cubuf_resource_stats(g_res, &s));
        if (s.current_bytes || s.current_count)
            bench_error(&env, "cubuf chain left %zu bytes in %zu allocations", s.current_bytes,
                        s.current_count);
        return;
    }
    for (int k = c->nmaps - 1; k >= 0; k--) {
        B_CU(cuMemUnmap, c->va + c->at[k], c->len[k]);
        B_CU(cuMemRelease, c->h[k]);
    }
    B_CU(cuMemAddressFree, c->va, c->top);
    free(c->h);
    free(c->at);
    free(c->len);
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

/* Busy with cuCtxSynchronize for `seconds`, untimed, before a timed step:
 * a thread that just slept runs its first driver calls slower (clocks and
 * caches), and the first grow right after a large reservation was slower
 * on either side; without this the first timed step of a repeat pays. */
static void quiesce(double seconds)
{
    for (double t0 = bench_now(); bench_now() - t0 < seconds;) B_CU(cuCtxSynchronize);
}

/* Lets the driver finish with the memory a repeat freed. On the H200 a
 * repeat that started right after 100+ GiB had been freed saw single
 * 16 GiB steps take 200 ms instead of 1 ms, on whichever side allocated
 * second (about the time needed to clear 16 GiB: freed memory is
 * evidently cleared in the background before it is handed out again).
 * That hits cubuf or the floor at random and says nothing about either, so
 * each repeat waits first about as long as clearing that much takes. */
static void settle_after(size_t freed)
{
    double s = (double)freed / 50e9; /* bytes per second, well under the clearing rate seen */
    if (s < 0.001) return;
    if (s > 3.0) s = 3.0;
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
    quiesce(0.05);
}

/* ---- a series: cubuf's and the floor's chains, step by step, over repeats -------------- */

/* Index of step k, repeat r in a series' arrays. */
#define AT(k, r) ((size_t)(k) * REPEATS + (size_t)(r))

typedef struct series {
    const size_t *sizes; /* sizes[k]: the size after step k */
    size_t first;        /* the size before step 0 */
    int n;               /* steps */
    int reps;            /* repeats run */
    int moves;           /* cubuf grows that moved the range, all repeats */
    int moves_r[REPEATS]; /* the same per repeat */
    double *t[2];        /* [side][AT(k, r)]: seconds */
    CUdeviceptr *part[2];   /* [side][AT(k, r)]: where the new part was mapped */
    unsigned char *resv;    /* [AT(k, r)]: cubuf reserved address space in the step */
    CUdeviceptr base[REPEATS][2]; /* each chain's base when the repeat began */
    CUdeviceptr rebase[REPEATS];  /* the chain made again for sequential steps, 0: none */
    int par[REPEATS];             /* steps 0..par-1 ran interleaved, the rest sequentially */
} series_t;

static void series_init(series_t *s, const size_t *sizes, int n, size_t first)
{
    memset(s, 0, sizeof *s);
    s->sizes = sizes;
    s->n = n;
    s->first = first;
    size_t cells = (size_t)n * REPEATS;
    for (int i = 0; i < 2; i++) {
        s->t[i] = xmalloc(cells * sizeof *s->t[i]);
        s->part[i] = xmalloc(cells * sizeof *s->part[i]);
    }
    s->resv = xmalloc(cells);
}

static void series_free(series_t *s)
{
    for (int i = 0; i < 2; i++) {
        free(s->t[i]);
        free(s->part[i]);
    }
    free(s->resv);
}

static size_t step_from(const series_t *s, int k) { return k ? s->sizes[k - 1] : s->first; }

static double step_median(const series_t *s, side_t side, int k)
{
    return median_of(&s->t[side][AT(k, 0)], s->reps);
}

/* A step's ratio: the median over repeats of cubuf/floor of the same repeat.
 * The two were timed back to back, so pairing cancels what drifts between
 * repeats (the ratio of the two medians would not). */
static double step_ratio(const series_t *s, int k)
{
    double r[REPEATS];
    for (int i = 0; i < s->reps; i++) r[i] = s->t[SIDE_CUBUF][AT(k, i)] / s->t[SIDE_FLOOR][AT(k, i)];
    return median_of(r, s->reps);
}

/* Runs step k of chain c and records it as repeat r. */
static void series_step(series_t *s, chain_t *c, int k, int r)
{
    step_out_t o = chain_step(c, s->sizes[k]);
    size_t i = AT(k, r);
    s->t[c->side][i] = o.t;
    s->part[c->side][i] = o.part;
    if (c->side == SIDE_CUBUF) {
        s->resv[i] = o.reserved;
        s->moves += o.moved;
        s->moves_r[r] += o.moved;
    }
}

/* The side that leads repeat r: it goes first at the interleaved steps
 * where k is even (the floor first when k + r is even), and runs first in
 * the sequential tail. */
static side_t lead_of(int r) { return r % 2 == 0 ? SIDE_FLOOR : SIDE_CUBUF; }

/* Which side's step k ran first in repeat r ("*": sequential). */
static const char *first_name(const series_t *s, int k, int r)
{
    side_t f = (k < s->par[r] && k % 2 != 0) ? other_side(lead_of(r)) : lead_of(r);
    if (k < s->par[r]) return f == SIDE_FLOOR ? "floor" : "cubuf";
    return f == SIDE_FLOOR ? "floor*" : "cubuf*";
}

/* Steps par..n-1, which do not fit twice in free memory: the leading chain
 * runs them alone, then the other chain is made again up to step par
 * (untimed) and runs them alone. */
static void run_tail(series_t *s, chain_t *c, int r, int par)
{
    side_t lead = lead_of(r), other = other_side(lead);
    size_t top = s->sizes[s->n - 1];
    chain_close(&c[other]);
    for (int k = par; k < s->n; k++) series_step(s, &c[lead], k, r);
    chain_close(&c[lead]);
    chain_open(&c[other], other, s->first, top, s->n, 0); /* alone: no need for a hint */
    for (int k = 0; k < par; k++) (void)chain_step(&c[other], s->sizes[k]);
    s->rebase[r] = chain_base(&c[other]);
    for (int k = par; k < s->n; k++) series_step(s, &c[other], k, r);
}

/* One repeat: both chains opened, each step k timed for both back to back. */
static void run_repeat(series_t *s, int r)
{
    int n = s->n, par = 0;
    size_t avail = free_memory(), top = s->sizes[n - 1];
    while (par < n && 2 * s->sizes[par] + PAIR_MARGIN <= avail) par++;
    s->par[r] = par;
    side_t lead = lead_of(r);
    chain_t c[2];
    /* The floor's range is asked for right after the most cubuf's range
     * reserves in place (cubuf_reserve_size(top) from its base): cubuf's
     * growth must not run into it and move, which it would not do alone;
     * and both bases then sit at the same offset past a 1 GiB boundary, so
     * both chains cross page directories at the same steps. A hint only:
     * the bases are printed. */
    chain_open(&c[SIDE_CUBUF], SIDE_CUBUF, s->first, top, n, 0);
    s->base[r][SIDE_CUBUF] = chain_base(&c[SIDE_CUBUF]);
    chain_open(&c[SIDE_FLOOR], SIDE_FLOOR, s->first, top, n,
               s->base[r][SIDE_CUBUF] + cubuf_reserve_size(top, g_gran));
    s->base[r][SIDE_FLOOR] = chain_base(&c[SIDE_FLOOR]);
    s->rebase[r] = 0;
    s->moves_r[r] = 0;
    quiesce(0.02);
    for (int k = 0; k < par; k++) {
        side_t f = k % 2 == 0 ? lead : other_side(lead); /* floor first when k + r is even */
        series_step(s, &c[f], k, r);
        series_step(s, &c[other_side(f)], k, r);
    }
    if (par < n) run_tail(s, c, r, par);
    chain_close(&c[SIDE_FLOOR]);
    chain_close(&c[SIDE_CUBUF]);
}

/* The first step that some repeat ran sequentially (n: none). */
static int series_min_par(const series_t *s)
{
    int par = s->n;
    for (int r = 0; r < s->reps; r++)
        if (s->par[r] < par) par = s->par[r];
    return par;
}

/* A note when some repeats ran their last steps one chain after the other. */
static void series_note_sequential(const series_t *s)
{
    int runs = 0, from = series_min_par(s);
    for (int r = 0; r < s->reps; r++) runs += s->par[r] < s->n;
    if (!runs) return;
    char to[32];
    bench_size_str(s->sizes[from], false, to, sizeof to);
    bench_note("from step %d (to %s) on, %d of %d runs timed the chains one after the other: "
               "both at once did not fit in free memory (steps marked * below)",
               from + 1, to, runs, s->reps);
}

/* ---- diagnostics of a series ------------------------------------------------------------ */

/* Whether the new part of step k, repeat r starts at or crosses a
 * multiple of span. */
static bool step_touches(const series_t *s, side_t side, int k, int r, size_t span)
{
    return touches_boundary(s->part[side][AT(k, r)], s->sizes[k] - step_from(s, k), span);
}

/* "1G", "512M" (only a half-span boundary) or "-". */
static const char *boundary_name(const series_t *s, side_t side, int k, int r)
{
    if (step_touches(s, side, k, r, PD_SPAN)) return "1G";
    return step_touches(s, side, k, r, PD_HALF) ? "512M" : "-";
}

static const char *past_pd(CUdeviceptr base, char *buf, size_t cap)
{
    return bench_size_str((size_t)(base % PD_SPAN), false, buf, cap);
}

/* One line per repeat: each chain's base and its offset past a 1 GiB boundary. */
static void print_bases(const series_t *s, int r)
{
    char lm[32], fm[32];
    CUdeviceptr lb = s->base[r][SIDE_CUBUF], fb = s->base[r][SIDE_FLOOR];
    printf("   run %d: cubuf base 0x%llx (+%s past 1 GiB), floor base 0x%llx (+%s); floor first "
           "at %s steps; cubuf moved %d times",
           r + 1, (unsigned long long)lb, past_pd(lb, lm, sizeof lm), (unsigned long long)fb,
           past_pd(fb, fm, sizeof fm), r % 2 == 0 ? "odd" : "even", s->moves_r[r]);
    if (s->par[r] < s->n) {
        side_t again = other_side(lead_of(r));
        printf("; from step %d sequential, the %s chain made again at 0x%llx (+%s)",
               s->par[r] + 1, again == SIDE_FLOOR ? "floor" : "cubuf",
               (unsigned long long)s->rebase[r], past_pd(s->rebase[r], lm, sizeof lm));
    }
    printf("\n");
}

/* The worst step, run by run: times, where each new part went, whether it
 * starts at or crosses a 1 GiB boundary, whether cubuf reserved. */
static void print_worst(const series_t *s, const double *ratio, int worst)
{
    size_t from = step_from(s, worst);
    char a[32], b[32];
    bench_size_str(from, false, a, sizeof a);
    bench_size_str(s->sizes[worst], false, b, sizeof b);
    printf("   worst step %d (%s -> %s, ratio %.3f): its new part is at offset %s (0x%zx) from "
           "the chain's base\n",
           worst + 1, a, b, ratio[worst], a, from);
    printf("   %5s %-6s | %10s %18s %4s %4s | %10s %18s %4s | %7s\n", "run", "first", "cubuf",
           "new part at", "bdry", "resv", "floor", "new part at", "bdry", "ratio");
    for (int r = 0; r < s->reps; r++) {
        size_t i = AT(worst, r);
        double tl = s->t[SIDE_CUBUF][i], tf = s->t[SIDE_FLOOR][i];
        printf("   %5d %-6s | %7.1f us %#18llx %4s %4s | %7.1f us %#18llx %4s | %7.3f\n", r + 1,
               first_name(s, worst, r), tl * 1e6, (unsigned long long)s->part[SIDE_CUBUF][i],
               boundary_name(s, SIDE_CUBUF, worst, r), s->resv[i] ? "yes" : "no",
               tf * 1e6, (unsigned long long)s->part[SIDE_FLOOR][i],
               boundary_name(s, SIDE_FLOOR, worst, r), tl / tf);
    }
}

/* A kind of sample (step k of repeat r) the cause summary singles out. */
typedef bool (*sample_pred_fn)(const series_t *s, int k, int r);

static bool lib_at_pd(const series_t *s, int k, int r)
{
    return step_touches(s, SIDE_CUBUF, k, r, PD_SPAN);
}
static bool floor_at_pd(const series_t *s, int k, int r)
{
    return step_touches(s, SIDE_FLOOR, k, r, PD_SPAN);
}
static bool lib_at_half(const series_t *s, int k, int r)
{
    return !lib_at_pd(s, k, r) && step_touches(s, SIDE_CUBUF, k, r, PD_HALF);
}
static bool floor_at_half(const series_t *s, int k, int r)
{
    return !floor_at_pd(s, k, r) && step_touches(s, SIDE_FLOOR, k, r, PD_HALF);
}
static bool lib_reserved(const series_t *s, int k, int r) { return s->resv[AT(k, r)]; }
static bool plain(const series_t *s, int k, int r)
{
    return !step_touches(s, SIDE_CUBUF, k, r, PD_HALF) &&
           !step_touches(s, SIDE_FLOOR, k, r, PD_HALF) && !lib_reserved(s, k, r);
}

typedef enum sample_value { VALUE_RATIO, VALUE_CUBUF, VALUE_FLOOR } sample_value_t;

/* The median of one value of the samples `pred` selects, gathered in buf
 * (left sorted); *m: their number. */
static double group_median(const series_t *s, sample_pred_fn pred, sample_value_t which,
                           double *buf, int *m)
{
    *m = 0;
    for (int k = 0; k < s->n; k++)
        for (int r = 0; r < s->reps; r++) {
            if (!pred(s, k, r)) continue;
            double tl = s->t[SIDE_CUBUF][AT(k, r)], tf = s->t[SIDE_FLOOR][AT(k, r)];
            buf[(*m)++] = which == VALUE_RATIO ? tl / tf : which == VALUE_CUBUF ? tl : tf;
        }
    return *m ? bench_median(buf, *m) : 0;
}

/* One line: the samples `pred` selects, their median times and their
 * cubuf/floor ratios (each sample's own, not the medians of the table):
 * both times high at a boundary means the driver's cost, not cubuf's. */
static void print_sample_group(const series_t *s, const char *what, sample_pred_fn pred, double *buf)
{
    int m = 0;
    double tl = group_median(s, pred, VALUE_CUBUF, buf, &m);
    double tf = group_median(s, pred, VALUE_FLOOR, buf, &m);
    double med = group_median(s, pred, VALUE_RATIO, buf, &m); /* last: buf keeps the sorted ratios */
    if (m == 0) {
        printf("     %-42s %5d\n", what, 0);
        return;
    }
    int over = 0;
    for (int i = 0; i < m; i++) over += buf[i] > STEP_BOUND;
    printf("     %-42s %5d: cubuf %7.1f us, floor %7.1f us; ratio median %.3f, p99 %.3f, max "
           "%.3f; %d above %.2f\n",
           what, m, tl * 1e6, tf * 1e6, med, buf[(m * 99) / 100], buf[m - 1], over, STEP_BOUND);
}

/* Whether the slow samples are those whose new part is at a 1 GiB boundary
 * or those where cubuf reserved address space. Per sample, because the
 * boundary falls at another step in each repeat when the bases differ. */
static void print_sample_causes(const series_t *s)
{
    double *buf = xmalloc((size_t)s->n * (size_t)s->reps * sizeof *buf);
    printf("   samples (steps x runs = %d), cubuf/floor of each:\n", s->n * s->reps);
    print_sample_group(s, "cubuf's new part at a 1 GiB boundary", lib_at_pd, buf);
    print_sample_group(s, "the floor's new part at a 1 GiB boundary", floor_at_pd, buf);
    print_sample_group(s, "cubuf's at a 512 MiB one (not 1 GiB)", lib_at_half, buf);
    print_sample_group(s, "the floor's at a 512 MiB one (not 1 GiB)", floor_at_half, buf);
    print_sample_group(s, "cubuf reserved address space", lib_reserved, buf);
    print_sample_group(s, "none of these", plain, buf);
    free(buf);
}

static void series_diagnose(const series_t *s, const double *ratio, int worst)
{
    printf("   diagnostics (informational): a new part that starts at or crosses a 1 GiB (or "
           "512 MiB) boundary may need a new page directory (2 MiB pages)\n");
    for (int r = 0; r < s->reps; r++) print_bases(s, r);
    print_worst(s, ratio, worst);
    print_sample_causes(s);
}

/* Runs a series' repeats within the time budget (at least 3 when over
 * it); after_repeat(arg, r), if given, runs after each. */

static void series_run(series_t *s, const char *what, void (*after_repeat)(void *arg, int r),
                       void *arg)
{
    for (int r = 0; r < REPEATS; r++) {
        /* Before each repeat: what the last one freed (both chains and the
         * copy-based one, each up to the top size), or what other programs
         * freed before this one started. */
        settle_after(3 * s->sizes[s->n - 1]);
        run_repeat(s, r);
        if (after_repeat) after_repeat(arg, r);
        s->reps++;
        if (over_budget() && r >= 2 && r + 1 < REPEATS) {
            bench_note("time budget reached after %d runs of %s", s->reps, what);
            break;
        }
    }
}

/* ---- 1. doubling ------------------------------------------------------------------------ */

#define MAX_STEPS 40

/* The copy-based chain of the doubling, run after each repeat. */
typedef struct copy_runs {
    const series_t *s;
    double t[MAX_STEPS][REPEATS];
} copy_runs_t;

static void doubling_copy(void *arg, int r)
{
    copy_runs_t *c = arg;
    double tc[MAX_STEPS];
    chain_copy(c->s->sizes, c->s->n, c->s->first, tc);
    for (int k = 0; k < c->s->n; k++) c->t[k][r] = tc[k];
}

/* Median of the copy chain's step k over the runs that had room; -1: none. */
static double doubling_copy_median(const copy_runs_t *c, int k, int reps)
{
    int nc = 0;
    double cv[REPEATS];
    for (int r = 0; r < reps; r++)
        if (c->t[k][r] >= 0) cv[nc++] = c->t[k][r];
    return nc ? median_of(cv, nc) : -1;
}

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

    series_t s;
    series_init(&s, sizes, n, first);
    copy_runs_t cpy = {.s = &s};
    series_run(&s, "the doubling chain", doubling_copy, &cpy);
    int reps = s.reps;

    printf("\n== grow by doubling: %zu MiB -> %zu MiB, median of %d runs (%d grows moved the range)\n",
           first / BENCH_MIB, top / BENCH_MIB, reps, s.moves);
    printf("   both chains alive; each step timed for cubuf and the floor back to back, the order "
           "alternating per step and run\n");
    series_note_sequential(&s);
    int seq_from = series_min_par(&s);
    printf("%-22s %9s | %12s %12s %7s | %13s %9s | %s\n", "step", "new part", "floor", "cubuf",
           "ratio", "copy realloc", "copy/cub", "target");
    double worst = 0, ratios[MAX_STEPS];
    int worst_k = 0;
    for (int k = 0; k < n; k++) {
        double ml = step_median(&s, SIDE_CUBUF, k), mr = step_median(&s, SIDE_FLOOR, k);
        double mc = doubling_copy_median(&cpy, k, reps);
        double ratio = step_ratio(&s, k);
        ratios[k] = ratio;
        if (ratio > worst) {
            worst = ratio;
            worst_k = k;
        }
        char from[32], to[32], part[32], step[80], copy[32], copy_ratio[16], name[96];
        size_t prev = step_from(&s, k);
        bench_size_str(prev, false, from, sizeof from);
        bench_size_str(sizes[k], false, to, sizeof to);
        bench_size_str(sizes[k] - prev, false, part, sizeof part);
        snprintf(step, sizeof step, "%s -> %s%s", from, to, k < seq_from ? "" : " *");
        if (mc >= 0) {
            snprintf(copy, sizeof copy, "%10.1f us", mc * 1e6);
            snprintf(copy_ratio, sizeof copy_ratio, "%8.1fx", mc / ml);
        } else {
            snprintf(copy, sizeof copy, "%13s", "no room");
            snprintf(copy_ratio, sizeof copy_ratio, "%9s", "-");
        }
        printf("%-22s %9s | %9.1f us %9.1f us %7.3f | %13s %9s | <= %.2f %s\n", step, part,
               mr * 1e6, ml * 1e6, ratio, copy, copy_ratio, STEP_BOUND,
               ratio <= STEP_BOUND ? "PASS" : "MISS");
        bench_size_str(sizes[k], true, to, sizeof to);
        snprintf(name, sizeof name, "vmm/grow_doubling/to_%s", to);
        bench_add_target(name, ratio, BENCH_TARGET_LE, STEP_BOUND);
    }
    series_diagnose(&s, ratios, worst_k);
    double med = bench_median(ratios, n); /* sorts ratios: last use */
    char to[32];
    bench_size_str(sizes[worst_k], false, to, sizeof to);
    printf("RESULT grow_doubling: cubuf/floor worst %.3f (step to %s), median %.3f over %d steps\n",
           worst, to, med, n);
    double mc_last = doubling_copy_median(&cpy, n - 1, reps);
    bench_size_str(sizes[n - 1], false, to, sizeof to);
    if (mc_last >= 0)
        printf("RESULT grow_doubling_copy: the last step (to %s) copy-based %.1f ms vs cubuf %.3f ms\n",
               to, mc_last * 1e3, step_median(&s, SIDE_CUBUF, n - 1) * 1e3);
    series_free(&s);
}

/* ---- 2. steps of 2 MiB ---------------------------------------------------------------------- */

/* The copy-based chain, up to 3 runs within the budget: cpy[k * 3 + r]. */
static int steps_copy(const size_t *sizes, int n, size_t step, double *cpy)
{
    double *tc = xmalloc((size_t)n * sizeof *tc);
    int creps = 0;
    for (int r = 0; r < 3 && !(over_budget() && r >= 1); r++) {
        chain_copy(sizes, n, step, tc);
        for (int k = 0; k < n; k++) cpy[k * 3 + r] = tc[k];
        creps++;
    }
    free(tc);
    return creps;
}

static double steps_copy_median(const double *cpy, int k, int creps)
{
    double cv[3];
    int nc = 0;
    for (int r = 0; r < creps; r++)
        if (cpy[k * 3 + r] >= 0) cv[nc++] = cpy[k * 3 + r];
    return nc ? median_of(cv, nc) : -1;
}

static void bench_steps(void)
{
    size_t step = 2 * BENCH_MIB > g_gran ? 2 * BENCH_MIB : g_gran;
    int n = STEPS_2MIB;
    size_t *sizes = xmalloc((size_t)n * sizeof *sizes);
    double *cpy = xmalloc((size_t)n * 3 * sizeof *cpy);
    double *ratio = xmalloc((size_t)n * sizeof *ratio), *ml = xmalloc((size_t)n * sizeof *ml),
           *mr = xmalloc((size_t)n * sizeof *mr), *sorted = xmalloc((size_t)n * sizeof *sorted);
    for (int k = 0; k < n; k++) sizes[k] = (size_t)(k + 2) * step;

    series_t s;
    series_init(&s, sizes, n, step);
    series_run(&s, "the 2 MiB steps", NULL, NULL);
    int creps = steps_copy(sizes, n, step, cpy);
    for (int k = 0; k < n; k++) {
        ml[k] = step_median(&s, SIDE_CUBUF, k);
        mr[k] = step_median(&s, SIDE_FLOOR, k);
        ratio[k] = step_ratio(&s, k);
    }
    printf("\n== %d grows of %zu MiB each (to %zu MiB), median of %d runs per step (%d grows moved "
           "the range)\n",
           n, step / BENCH_MIB, sizes[n - 1] / BENCH_MIB, s.reps, s.moves);
    printf("   both chains alive; each step timed for cubuf and the floor back to back, the order "
           "alternating per step and run\n");
    series_note_sequential(&s);
    int seq_from = series_min_par(&s);
    printf("%-8s %10s | %12s %12s %7s | %13s\n", "step", "size", "floor", "cubuf", "ratio",
           "copy realloc");
    int worst = 0;
    for (int k = 0; k < n; k++)
        if (ratio[k] > ratio[worst]) worst = k;
    for (int k = 0; k < n; k++) {
        bool show = k == 0 || k == 1 || (k + 1) % 100 == 0 || k == worst;
        if (!show) continue;
        char size[32];
        bench_size_str(sizes[k], false, size, sizeof size);
        printf("%-8d %10s | %9.1f us %9.1f us %7.3f | %10.1f us%s%s\n", k + 1, size, mr[k] * 1e6,
               ml[k] * 1e6, ratio[k], steps_copy_median(cpy, k, creps) * 1e6,
               k < seq_from ? "" : " *", k == worst ? "   <- worst ratio" : "");
    }
    series_diagnose(&s, ratio, worst);
    for (int k = 0; k < n; k++) sorted[k] = ratio[k];
    double med = bench_median(sorted, n); /* sorts */
    double p90 = sorted[(n * 9) / 10], p99 = sorted[(n * 99) / 100];
    int over = 0;
    for (int k = 0; k < n; k++) over += ratio[k] > STEP_BOUND;
    printf("RESULT grow_2mib_steps: cubuf/floor median %.3f, p90 %.3f, p99 %.3f, worst %.3f (step "
           "%d); %d of %d steps above %.2f\n",
           med, p90, p99, ratio[worst], worst + 1, over, n, STEP_BOUND);
    printf("RESULT grow_2mib_steps_copy: the last step copy-based %.1f us vs cubuf %.1f us\n",
           steps_copy_median(cpy, n - 1, creps) * 1e6, ml[n - 1] * 1e6);
    bench_add_target("vmm/grow_2MiB_steps/median", med, BENCH_TARGET_LE, STEP_BOUND);
    bench_add_target("vmm/grow_2MiB_steps/p90", p90, BENCH_TARGET_LE, STEP_BOUND);
    series_free(&s);
    free(sorted);
    free(sizes);
    free(cpy);
    free(ratio);
    free(ml);
    free(mr);
}

/* ---- 3. allocate + close ------------------------------------------------------------------------- */

/* A raw allocate + close. Only the plain one has a target; the others tell
 * what explains a gap between it and cubuf. */
typedef struct raw_variant {
    const char *name;
    bool cubuf_reserve; /* reserve what cubuf reserves for the size, not the size */
    bool sync;          /* cuStreamSynchronize(0) before the unmap, as cubuf's close must */
} raw_variant_t;

static const raw_variant_t variants[] = {
    {"raw", false, false},
    {"raw+resv", true, false},
    {"raw+sync", false, true},
    {"raw+resv+sync", true, true},
};
#define NVARIANTS ((int)(sizeof variants / sizeof variants[0]))
#define ROW_CUBUF NVARIANTS /* the row after the raw variants */
#define MAX_RUNS 64

typedef struct halves {
    double alloc, close;
} halves_t;

static halves_t raw_alloc_close(size_t size, const raw_variant_t *v)
{
    size_t resv = v->cubuf_reserve ? cubuf_reserve_size(size, g_gran) : size;
    CUdeviceptr va = 0;
    CUmemGenericAllocationHandle h;
    double t0 = bench_now();
    B_CU(cuMemAddressReserve, &va, resv, g_gran, 0, 0);
    B_CU(cuMemCreate, &h, size, &g_prop, 0);
    B_CU(cuMemMap, va, size, 0, h, 0);
    B_CU(cuMemSetAccess, va, size, &g_acc, 1);
    double t1 = bench_now();
    if (v->sync) B_CU(cuStreamSynchronize, (CUstream)0); /* the legacy default stream */
    B_CU(cuMemUnmap, va, size);
    B_CU(cuMemRelease, h);
    B_CU(cuMemAddressFree, va, resv);
    double t2 = bench_now();
    return (halves_t){t1 - t0, t2 - t1};
}

/* cubuf on the legacy default stream (0), whose close synchronizes it. */
static halves_t lib_alloc_close(size_t size)
{
    cubuf_buffer_t *b = NULL;
    double t0 = bench_now();
    B_OK(cubuf_resource_allocate(g_res, size, 0, &b));
    double t1 = bench_now();
    B_OK(cubuf_buffer_close(b));
    double t2 = bench_now();
    cubuf_buffer_release(b);
    return (halves_t){t1 - t0, t2 - t1};
}

/* Run r: plain raw and cubuf, raw first when r is even, then the other raw
 * variants in an order that rotates with r. h[v] for variant v, h[ROW_CUBUF]
 * for cubuf. */
static void alloc_close_run(size_t size, int r, halves_t *h)
{
    /* Each sequence frees what the next allocates: let it be cleared first
     * (settle_after; it matters from about 1 GiB on). */
    if (r % 2 == 0) {
        settle_after(size);
        h[0] = raw_alloc_close(size, &variants[0]);
        settle_after(size);
        h[ROW_CUBUF] = lib_alloc_close(size);
    } else {
        settle_after(size);
        h[ROW_CUBUF] = lib_alloc_close(size);
        settle_after(size);
        h[0] = raw_alloc_close(size, &variants[0]);
    }
    for (int i = 0; i < NVARIANTS - 1; i++) {
        int v = 1 + (r + i) % (NVARIANTS - 1);
        settle_after(size);
        h[v] = raw_alloc_close(size, &variants[v]);
    }
}

/* Samples of one row: seconds per recorded run. */
typedef struct ac_row {
    double total[MAX_RUNS], alloc[MAX_RUNS], close[MAX_RUNS];
} ac_row_t;

/* Median total of the runs where the row went first (first = true) or
 * second; for plain raw and cubuf, which alternate. Run i is run i + 1 of
 * alloc_close_run (run 0 warms up). */
static double order_median(const ac_row_t *row, int runs, bool raw, bool first)
{
    double v[MAX_RUNS];
    int n = 0;
    for (int i = 0; i < runs; i++) {
        bool raw_first = (i + 1) % 2 == 0;
        bool went_first = raw ? raw_first : !raw_first;
        if (went_first == first) v[n++] = row->total[i];
    }
    return n ? median_of(v, n) : -1;
}

static void print_ac_row(const char *size_s, int runs, const char *name, size_t reserved,
                         const ac_row_t *row, double lib_total, int which)
{
    char resv[32], first[16] = "-", second[16] = "-", ratio[16] = "-";
    bench_size_str(reserved, false, resv, sizeof resv);
    double total = median_of(row->total, runs);
    if (which == 0 || which == ROW_CUBUF) {
        bool raw = which == 0;
        snprintf(first, sizeof first, "%9.1f us", order_median(row, runs, raw, true) * 1e6);
        snprintf(second, sizeof second, "%9.1f us", order_median(row, runs, raw, false) * 1e6);
    }
    if (which != ROW_CUBUF) snprintf(ratio, sizeof ratio, "%.3f", lib_total / total);
    printf("%10s %5d %-14s %9s | %9.1f us %9.1f us %9.1f us | %12s %12s | %10s\n", size_s, runs,
           name, resv, total * 1e6, median_of(row->alloc, runs) * 1e6,
           median_of(row->close, runs) * 1e6, first, second, ratio);
}

static void alloc_close_size(size_t size, int runs, ac_row_t *rows)
{
    for (int r = 0; r <= runs; r++) { /* run 0 warms up, unrecorded */
        halves_t h[NVARIANTS + 1];
        alloc_close_run(size, r, h);
        if (r == 0) continue;
        for (int v = 0; v <= NVARIANTS; v++) {
            rows[v].alloc[r - 1] = h[v].alloc;
            rows[v].close[r - 1] = h[v].close;
            rows[v].total[r - 1] = h[v].alloc + h[v].close;
        }
    }
    char s[32];
    bench_size_str(size, false, s, sizeof s);
    double mlib = median_of(rows[ROW_CUBUF].total, runs), mraw = median_of(rows[0].total, runs);
    print_ac_row(s, runs, "cubuf", cubuf_reserve_size(size, g_gran), &rows[ROW_CUBUF], mlib,
                 ROW_CUBUF);
    for (int v = 0; v < NVARIANTS; v++)
        print_ac_row(s, runs, variants[v].name,
                     variants[v].cubuf_reserve ? cubuf_reserve_size(size, g_gran) : size, &rows[v],
                     mlib, v);
    printf("RESULT alloc_close/%s: cubuf/raw %.3f (%.1f us vs %.1f us)\n", s, mlib / mraw,
           mlib * 1e6, mraw * 1e6);
    fflush(stdout);
}

static void bench_alloc_close(void)
{
    static const size_t sizes[] = {2 * BENCH_MIB, 64 * BENCH_MIB, BENCH_GIB, 16 * BENCH_GIB};
    /* Even counts: raw and cubuf go first equally often. */
    static const int runs_of[] = {40, 40, 10, 6};
    _Static_assert(sizeof sizes / sizeof sizes[0] == sizeof runs_of / sizeof runs_of[0],
                   "one run count per size");
    static ac_row_t rows[NVARIANTS + 1];
    printf("\n== allocate + close vs the raw sequence (reserve, create, map, set access; unmap, "
           "release, free)\n");
    printf("   raw and cubuf alternate which goes first (even runs: raw). Diagnostic rows, no "
           "target: +resv reserves\n"
           "   what cubuf reserves, +sync calls cuStreamSynchronize(0) before the unmap as "
           "cubuf's close must.\n"
           "   total, alloc, close: medians; 1st/2nd: median total of the runs that went "
           "first/second; cubuf/this: cubuf's total over the row's\n");
    printf("%10s %5s %-14s %9s | %12s %12s %12s | %12s %12s | %10s\n", "size", "runs", "sequence",
           "reserved", "total", "alloc", "close", "1st", "2nd", "cubuf/this");
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        size_t size = sizes[i];
        if (size + 4 * BENCH_GIB > free_memory()) {
            bench_note("%zu MiB: no room on the device", size / BENCH_MIB);
            continue;
        }
        alloc_close_size(size, runs_of[i], rows);
    }
}

/* ---- 5. an A/A control: the floor against itself ----------------------------------------- */

/* The 2 MiB steps with the floor on both sides, measured exactly as cubuf
 * against the floor: how many steps above 1.10 the noise alone makes. */
static void bench_aa_control(void)
{
    size_t step = 2 * BENCH_MIB > g_gran ? 2 * BENCH_MIB : g_gran;
    int n = STEPS_2MIB;
    size_t top = (size_t)(n + 1) * step;
    if (2 * top + PAIR_MARGIN > free_memory()) {
        bench_note("A/A control skipped: no room for two chains");
        return;
    }
    double *t = xmalloc((size_t)n * REPEATS * 2 * sizeof *t); /* [k][r][side] */
    int reps = 0;
    for (int r = 0; r < REPEATS && !(over_budget() && r >= 2); r++, reps++) {
        settle_after(2 * top);
        chain_t c[2];
        chain_open(&c[0], SIDE_FLOOR, step, top, n, 0);
        chain_open(&c[1], SIDE_FLOOR, step, top, n, chain_base(&c[0]) + 2 * top);
        quiesce(0.02);
        for (int k = 0; k < n; k++) {
            int f = (k + r) % 2;
            size_t size = (size_t)(k + 2) * step;
            t[((size_t)k * REPEATS + (size_t)r) * 2 + (size_t)f] = chain_step(&c[f], size).t;
            t[((size_t)k * REPEATS + (size_t)r) * 2 + (size_t)(1 - f)] = chain_step(&c[1 - f], size).t;
        }
        chain_close(&c[0]);
        chain_close(&c[1]);
    }
    double *ratio = xmalloc((size_t)n * sizeof *ratio);
    for (int k = 0; k < n; k++) {
        double rr[REPEATS];
        for (int r = 0; r < reps; r++) {
            const double *x = &t[((size_t)k * REPEATS + (size_t)r) * 2];
            rr[r] = x[1] / x[0];
        }
        ratio[k] = median_of(rr, reps);
    }
    int over = 0;
    for (int k = 0; k < n; k++) over += ratio[k] > STEP_BOUND;
    double med = bench_median(ratio, n); /* sorts */
    printf("\n== A/A control: the same %d grows of %zu MiB with the floor on both sides, paired as "
           "above (%d runs)\n",
           n, step / BENCH_MIB, reps);
    printf("RESULT grow_2mib_steps_aa: floor/floor median %.3f, p90 %.3f, p99 %.3f, worst %.3f; %d of "
           "%d steps above %.2f\n",
           med, ratio[(n * 9) / 10], ratio[(n * 99) / 100], ratio[n - 1], over, n, STEP_BOUND);
    free(ratio);
    free(t);
}

/* ---- 4. what headroom costs ------------------------------------------------------------ */

/* A buffer's first granule mapped into reservations of growing size: how
 * much of allocate + close is the address space reserved for growth
 * (informational; it decides cubuf's reservation policy). */
static void bench_headroom(void)
{
    static const size_t resv[] = {2 * BENCH_MIB,  4 * BENCH_MIB,   8 * BENCH_MIB,
                                  32 * BENCH_MIB, 128 * BENCH_MIB, BENCH_GIB,
                                  8 * BENCH_GIB,  64 * BENCH_GIB,  256 * BENCH_GIB};
    printf("\n== one granule mapped into a reservation of each size: reserve, create, map, set "
           "access; unmap, release, free (median of 21)\n");
    printf("%12s | %12s %12s\n", "reserved", "total", "reserve+free");
    for (size_t i = 0; i < sizeof resv / sizeof resv[0]; i++) {
        double t[21], tr[21];
        for (int r = 0; r < 22; r++) { /* run 0 warms up */
            CUdeviceptr va = 0;
            CUmemGenericAllocationHandle h;
            double t0 = bench_now();
            B_CU(cuMemAddressReserve, &va, resv[i], g_gran, 0, 0);
            B_CU(cuMemCreate, &h, g_gran, &g_prop, 0);
            B_CU(cuMemMap, va, g_gran, 0, h, 0);
            B_CU(cuMemSetAccess, va, g_gran, &g_acc, 1);
            B_CU(cuMemUnmap, va, g_gran);
            B_CU(cuMemRelease, h);
            B_CU(cuMemAddressFree, va, resv[i]);
            double t1 = bench_now();
            B_CU(cuMemAddressReserve, &va, resv[i], g_gran, 0, 0);
            B_CU(cuMemAddressFree, va, resv[i]);
            double t2 = bench_now();
            if (r == 0) continue;
            t[r - 1] = t1 - t0;
            tr[r - 1] = t2 - t1;
        }
        char sz[32];
        bench_size_str(resv[i], false, sz, sizeof sz);
        printf("%12s | %9.1f us %9.1f us\n", sz, median_of(t, 21) * 1e6, median_of(tr, 21) * 1e6);
    }
}

/* The first VMM calls of a process set things up lazily: a short chain of
 * each side, untimed. */
static void warm_up(void)
{
    chain_t c;
    for (int side = SIDE_FLOOR; side <= SIDE_CUBUF; side++) {
        chain_open(&c, (side_t)side, g_gran, 9 * g_gran, 8, 0);
        for (int i = 0; i < 8; i++) (void)chain_step(&c, (size_t)(i + 2) * g_gran);
        chain_close(&c);
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

    warm_up();
    bench_doubling();
    bench_steps();
    bench_aa_control();
    bench_alloc_close();
    bench_headroom();

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
