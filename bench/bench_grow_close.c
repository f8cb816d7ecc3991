/* The grow-then-close idiom of examples/grow.c, against the raw driver, in
 * one run. One step of a chain:
 *  - cubuf: grown = cubuf_vmm_modify_allocation(old, size + one granule),
 *    then cubuf_buffer_close(old) and cubuf_buffer_release(old). The grows
 *    stay in place (the range's reservation has room), so the close of the
 *    old buffer unmaps nothing;
 *  - raw: cuMemCreate + cuMemMap + cuMemSetAccess of one granule right after
 *    the mapped part of a range reserved up front, the mapping work of such
 *    a grow, with no stream synchronization.
 * Three cases for the deallocation stream of the buffers: the per-thread
 * default stream (what examples/grow.c uses), a created stream that is idle,
 * and the same stream with a backlog: before each step of either side,
 * untimed, BACKLOG_OPS cuMemsetD8Async of BACKLOG_BYTES into another buffer
 * are queued on it, and drained after the step, untimed. A close that
 * synchronizes its stream pays for that backlog inside the step.
 *
 * Each case runs REPEATS chains of STEPS steps per side, interleaved step by
 * step (which side goes first alternates), after one unmeasured chain of
 * each. A row gives the median and the best step of each side; ratio =
 * cubuf/raw of the medians.
 *
 * This program uses only the public API that the grow idiom needs
 * (<cubuf.h>, <cubuf/vmm.h>, as they were at commit 202f045 and are now)
 * and the raw driver, so that the same source measures a library before
 * and after a change to it. */
#include "bench_common.h"

#define STEPS 32
#define REPEATS 40
#define BACKLOG_OPS 4
#define BACKLOG_BYTES (256 * BENCH_MIB)
/* What the raw chain reserves: what cubuf reserves for a buffer this small
 * (docs/DESIGN.md, "Headroom"), so that both map into alike ranges. */
#define RAW_RESERVE (4 * BENCH_GIB)

static bench_env_t env;
static cubuf_resource_t *g_res;
static size_t g_gran;
static CUmemAllocationProp g_prop;
static CUmemAccessDesc g_acc;
static CUdeviceptr g_scratch; /* what the backlog writes */

/* ---- the two sides ---------------------------------------------------------------- */

typedef struct raw_chain {
    CUdeviceptr base;
    CUmemGenericAllocationHandle h[STEPS + 1];
    int n; /* granules mapped */
} raw_chain_t;

static void raw_map_next(raw_chain_t *c)
{
    CUdeviceptr va = c->base + (size_t)c->n * g_gran;
    B_CU(cuMemCreate, &c->h[c->n], g_gran, &g_prop, 0);
    B_CU(cuMemMap, va, g_gran, 0, c->h[c->n], 0);
    B_CU(cuMemSetAccess, va, g_gran, &g_acc, 1);
    c->n++;
}

static void raw_open(raw_chain_t *c)
{
    c->n = 0;
    B_CU(cuMemAddressReserve, &c->base, RAW_RESERVE, g_gran, 0, 0);
    raw_map_next(c);
}

static double raw_step(raw_chain_t *c)
{
    double t0 = bench_now();
    raw_map_next(c);
    return bench_now() - t0;
}

static void raw_close(raw_chain_t *c)
{
    for (int i = c->n - 1; i >= 0; i--) {
        B_CU(cuMemUnmap, c->base + (size_t)i * g_gran, g_gran);
        B_CU(cuMemRelease, c->h[i]);
    }
    B_CU(cuMemAddressFree, c->base, RAW_RESERVE);
}

typedef struct lib_chain {
    cubuf_buffer_t *buf;
    int moved; /* steps whose grow moved the range */
} lib_chain_t;

static void lib_open(lib_chain_t *c, CUstream stream)
{
    c->buf = NULL;
    c->moved = 0;
    B_OK(cubuf_resource_allocate(g_res, g_gran, stream, &c->buf));
}

static double lib_step(lib_chain_t *c)
{
    CUdeviceptr old = cubuf_buffer_ptr(c->buf);
    double t0 = bench_now();
    cubuf_buffer_t *grown = NULL;
    B_OK(cubuf_vmm_modify_allocation(g_res, c->buf, cubuf_buffer_size(c->buf) + g_gran, NULL,
                                     &grown));
    B_OK(cubuf_buffer_close(c->buf));
    double t1 = bench_now();
    c->moved += cubuf_buffer_ptr(grown) != old;
    cubuf_buffer_release(c->buf);
    c->buf = grown;
    return t1 - t0;
}

static void lib_close(lib_chain_t *c)
{
    if (cubuf_buffer_size(c->buf) != (size_t)(STEPS + 1) * g_gran)
        bench_error(&env, "a cubuf chain ended at %zu bytes, expected %zu", cubuf_buffer_size(c->buf),
                    (size_t)(STEPS + 1) * g_gran);
    B_OK(cubuf_buffer_close(c->buf));
    cubuf_buffer_release(c->buf);
    /* Either library: the stats struct gained a struct_size after 202f045. */
#ifdef CUBUF_RESOURCE_STATS_INIT
    cubuf_resource_stats_t s = CUBUF_RESOURCE_STATS_INIT;
#else
    cubuf_resource_stats_t s;
    memset(&s, 0, sizeof s);
#endif
    B_OK(cubuf_resource_stats(g_res, &s));
    if (s.current_bytes != 0 || s.current_count != 0)
        bench_error(&env, "after a chain the resource still holds %zu bytes in %zu allocations",
                    s.current_bytes, s.current_count);
}

/* ---- one case ------------------------------------------------------------------------ */

typedef struct grow_case {
    const char *name;
    CUstream stream;
    bool backlog;
} grow_case_t;

static void queue_backlog(const grow_case_t *gc)
{
    if (!gc->backlog) return;
    for (int i = 0; i < BACKLOG_OPS; i++)
        B_CU(cuMemsetD8Async, g_scratch, (unsigned char)i, BACKLOG_BYTES, gc->stream);
}

/* One step of one side, the backlog queued before it and drained after it. */
static double timed_step(const grow_case_t *gc, bool lib, raw_chain_t *rc, lib_chain_t *lc)
{
    queue_backlog(gc);
    double t = lib ? lib_step(lc) : raw_step(rc);
    B_CU(cuStreamSynchronize, gc->stream);
    return t;
}

/* One chain per side, step by step; samples (may be NULL: unmeasured) get
 * STEPS values each. Returns the steps cubuf's grows moved. */
static int run_chains(const grow_case_t *gc, int r, double *raw_t, double *lib_t)
{
    raw_chain_t rc;
    lib_chain_t lc;
    raw_open(&rc);
    lib_open(&lc, gc->stream);
    for (int k = 0; k < STEPS; k++) {
        bool lib_first = (r + k) % 2 == 1;
        double a = timed_step(gc, lib_first, &rc, &lc);
        double b = timed_step(gc, !lib_first, &rc, &lc);
        if (raw_t) raw_t[k] = lib_first ? b : a;
        if (lib_t) lib_t[k] = lib_first ? a : b;
    }
    int moved = lc.moved;
    lib_close(&lc);
    raw_close(&rc);
    return moved;
}

static double min_of(const double *v, int n)
{
    double m = v[0];
    for (int i = 1; i < n; i++)
        if (v[i] < m) m = v[i];
    return m;
}

static void run_case(const grow_case_t *gc)
{
    int n = REPEATS * STEPS, moved = 0;
    double *raw = malloc((size_t)n * sizeof *raw), *lib = malloc((size_t)n * sizeof *lib);
    if (!raw || !lib) {
        fprintf(stderr, "error: out of host memory\n");
        exit(1);
    }
    run_chains(gc, 0, NULL, NULL); /* unmeasured */
    for (int r = 0; r < REPEATS; r++)
        moved += run_chains(gc, r, raw + (size_t)r * STEPS, lib + (size_t)r * STEPS);

    bench_result_t res;
    memset(&res, 0, sizeof res);
    res.raw_min = min_of(raw, n);
    res.lib_min = min_of(lib, n);
    res.raw_med = bench_median(raw, n);
    res.lib_med = bench_median(lib, n);
    res.ratio = res.lib_med / res.raw_med;
    res.best_ratio = res.lib_min / res.raw_min;
    res.batch = STEPS;
    res.pairs = REPEATS;
    char target[96];
    snprintf(target, sizeof target, "vmm/grow+close/%s", gc->name);
    bench_case_t c = {.group = "vmm", .name = gc->name, .size = g_gran, .mode = BENCH_LATENCY,
                      .stream = gc->stream, .target = BENCH_TARGET_LE, .bound = 1.10,
                      .target_name = target};
    bench_print_row(&c, &res);
    bench_add_target(target, res.ratio, c.target, c.bound);
    if (moved) bench_note("%d of cubuf's %d grows moved the range", moved, n);
    free(raw);
    free(lib);
}

int main(void)
{
    bench_init(&env, "bench_grow_close");
    B_OK(cubuf_vmm_resource_create(0, NULL, &g_res));
    B_OK(cubuf_vmm_granularity(g_res, &g_gran));
    memset(&g_prop, 0, sizeof g_prop);
    g_prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    g_prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    g_prop.location.id = 0;
    memset(&g_acc, 0, sizeof g_acc);
    g_acc.location = g_prop.location;
    g_acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    B_CU(cuMemAlloc, &g_scratch, BACKLOG_BYTES);

    printf("A step: raw = create + map + set access of one %zu-byte granule in a reserved range;\n"
           "cubuf = cubuf_vmm_modify_allocation by one granule + close of the old buffer.\n"
           "n = steps per chain, pairs = chains per side. With backlog: %d x %zu MiB of\n"
           "cuMemsetD8Async queued on the deallocation stream before each step (untimed).\n",
           g_gran, BACKLOG_OPS, BACKLOG_BYTES / BENCH_MIB);
    /* The host ran slower in the first seconds after setup (bench_common.h). */
    grow_case_t warm = {"warm-up", env.stream, false};
    for (double t0 = bench_now(); bench_now() - t0 < 2.0;) run_chains(&warm, 0, NULL, NULL);

    bench_section("VMM grow by one granule, then close the old buffer");
    grow_case_t cases[] = {
        {"per-thread", CU_STREAM_PER_THREAD, false},
        {"stream", env.stream, false},
        {"stream+backlog", env.stream, true},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_case(&cases[i]);

    B_CU(cuMemFree, g_scratch);
    cubuf_resource_release(g_res);
    bench_fini(&env);
    return bench_summary(&env, "bench_grow_close");
}
