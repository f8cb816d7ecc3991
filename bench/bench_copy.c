/* Copies and fills, cubuf against cuMemcpyAsync / cuMemsetD8Async /
 * cuMemsetD32Async on the same buffers and stream, from 4 KiB to 1 GiB in
 * powers of 4.
 *  - up to 1 MiB: time per operation (wall clock around a synchronized
 *    batch), target <= 1.05x raw;
 *  - 4 and 16 MiB: bandwidth, for information;
 *  - 64 MiB and up: bandwidth (CUDA events around a batch), target >= 0.98x;
 *  - H2D from the pinned resource's memory against H2D from cuMemHostAlloc
 *    memory, 64 MiB and up: target >= 0.95x;
 *  - copy with options (a batch of one) against a raw cuMemcpyBatchAsync of
 *    one copy with the same attributes, reported separately.
 * After each row cubuf's operation runs once more and a few probes of the
 * destination are read back: a fast but wrong copy is an error, not a PASS.
 * Device memory: about 2.7 GiB (two buffers of each size); pinned host
 * memory: about 1.3 GiB from the pinned resource and 1 GiB of
 * cuMemHostAlloc. */
#include "bench_common.h"

#define FILL8_VALUE 0x5a
#define FILL32_VALUE 0x01020304u
#define COPY_VALUE 0x3c
#define PROBE_BYTES 256

enum { NSIZES = 10 };

typedef struct size_set {
    size_t size;
    cubuf_buffer_t *d_src, *d_dst; /* device pool */
    cubuf_buffer_t *h_pool;        /* pinned resource */
    cubuf_buffer_t *h_view;        /* a view of the cuMemHostAlloc memory */
} size_set_t;

typedef struct copy_arg {
    CUstream stream;
    size_t size;
    cubuf_buffer_t *lib_dst;
    const cubuf_buffer_t *lib_src; /* NULL for fills */
    CUdeviceptr raw_dst, raw_src;
    const cubuf_copy_options_t *opts;
    CUmemcpyAttributes attr;
} copy_arg_t;

/* ---- the operations ---- */

static void raw_copy(void *p)
{
    copy_arg_t *a = p;
    B_CU(cuMemcpyAsync, a->raw_dst, a->raw_src, a->size, a->stream);
}

static void lib_copy(void *p)
{
    copy_arg_t *a = p;
    B_OK(cubuf_buffer_copy_from(a->lib_dst, a->lib_src, a->stream, NULL));
}

static void raw_fill8(void *p)
{
    copy_arg_t *a = p;
    B_CU(cuMemsetD8Async, a->raw_dst, FILL8_VALUE, a->size, a->stream);
}

static void lib_fill8(void *p)
{
    copy_arg_t *a = p;
    B_OK(cubuf_buffer_fill_byte(a->lib_dst, FILL8_VALUE, a->stream));
}

static void raw_fill32(void *p)
{
    copy_arg_t *a = p;
    B_CU(cuMemsetD32Async, a->raw_dst, FILL32_VALUE, a->size / 4, a->stream);
}

static const uint32_t fill32_pattern = FILL32_VALUE;

static void lib_fill32(void *p)
{
    copy_arg_t *a = p;
    B_OK(cubuf_buffer_fill(a->lib_dst, &fill32_pattern, sizeof fill32_pattern, a->stream));
}

/* A batch of one copy with explicit attributes: what a copy with options
 * amounts to on a 12.8+ driver. */
static void raw_batch_one(void *p)
{
    copy_arg_t *a = p;
    CUdeviceptr dst = a->raw_dst, src = a->raw_src;
    size_t size = a->size, first = 0;
    B_CU(cuMemcpyBatchAsync, &dst, &src, &size, 1, &a->attr, &first, 1, a->stream);
}

static void lib_copy_options(void *p)
{
    copy_arg_t *a = p;
    B_OK(cubuf_buffer_copy_from(a->lib_dst, a->lib_src, a->stream, a->opts));
}

/* ---- read-back probes: the start, the middle and the end of a buffer ---- */

static size_t probe_len(size_t size) { return size < PROBE_BYTES ? size : PROBE_BYTES; }

static void probe_offsets(size_t size, size_t off[3])
{
    size_t len = probe_len(size);
    off[0] = 0;
    off[1] = (size / 2) & ~(size_t)3;
    if (off[1] + len > size) off[1] = size - len;
    off[2] = size - len;
}

/* Host-accessible memory (pinned) is written and read directly; device
 * memory through the stream (set) or a synchronous copy (read). */
static void probe_set(CUstream stream, const cubuf_buffer_t *b, unsigned char v)
{
    CUdeviceptr p = cubuf_buffer_ptr(b);
    size_t size = cubuf_buffer_size(b), len = probe_len(size), off[3];
    probe_offsets(size, off);
    for (int i = 0; i < 3; i++) {
        if (cubuf_buffer_is_host_accessible(b))
            memset((unsigned char *)(uintptr_t)p + off[i], v, len);
        else
            B_CU(cuMemsetD8Async, p + off[i], v, len, stream);
    }
}

static void probe_read(const cubuf_buffer_t *b, size_t off, size_t len, unsigned char *out)
{
    CUdeviceptr p = cubuf_buffer_ptr(b);
    if (cubuf_buffer_is_host_accessible(b))
        memcpy(out, (const unsigned char *)(uintptr_t)p + off, len);
    else
        B_CU(cuMemcpyDtoH, out, p + off, len);
}

/* True if every probe holds `v` (pattern_size 1) or the 4-byte pattern. */
static bool probe_check(const cubuf_buffer_t *b, const void *pattern, size_t pattern_size)
{
    size_t size = cubuf_buffer_size(b), len = probe_len(size), off[3];
    unsigned char got[PROBE_BYTES];
    probe_offsets(size, off);
    for (int i = 0; i < 3; i++) {
        probe_read(b, off[i], len, got);
        for (size_t j = 0; j < len; j++)
            if (got[j] != ((const unsigned char *)pattern)[(off[i] + j) % pattern_size]) return false;
    }
    return true;
}

typedef enum op_kind { OP_COPY, OP_FILL8, OP_FILL32 } op_kind_t;

/* Runs cubuf's operation once on fresh probes and checks the result. */
static void verify(bench_env_t *env, const bench_case_t *c, op_kind_t kind)
{
    copy_arg_t *a = c->arg;
    B_CU(cuStreamSynchronize, a->stream);
    if (kind == OP_COPY) probe_set(a->stream, a->lib_src, COPY_VALUE);
    probe_set(a->stream, a->lib_dst, 0);
    B_CU(cuStreamSynchronize, a->stream);
    c->lib(a);
    B_CU(cuStreamSynchronize, a->stream);
    static const unsigned char copy_value = COPY_VALUE, fill8_value = FILL8_VALUE;
    bool ok = kind == OP_COPY    ? probe_check(a->lib_dst, &copy_value, 1)
              : kind == OP_FILL8 ? probe_check(a->lib_dst, &fill8_value, 1)
                                 : probe_check(a->lib_dst, &fill32_pattern, 4);
    if (!ok)
        bench_error(env, "%s/%s/%zu: cubuf's result read back wrong", c->group, c->name, c->size);
}

/* ---- the rows ---- */

typedef enum row_kind { D2D, H2D_POOL, H2D_HOSTALLOC, D2H_POOL, FILL8, FILL32, NROWS } row_kind_t;

static const struct {
    const char *name;
    const char *raw;
    op_kind_t op;
} row_info[NROWS] = {
    [D2D] = {"D2D", "cuMemcpyAsync device -> device", OP_COPY},
    [H2D_POOL] = {"H2D_pinned_pool", "cuMemcpyAsync from cubuf_pinned_resource memory", OP_COPY},
    [H2D_HOSTALLOC] = {"H2D_cuMemHostAlloc", "cuMemcpyAsync from cuMemHostAlloc memory", OP_COPY},
    [D2H_POOL] = {"D2H_pinned_pool", "cuMemcpyAsync to cubuf_pinned_resource memory", OP_COPY},
    [FILL8] = {"fill_1byte", "cuMemsetD8Async (cubuf_buffer_fill_byte)", OP_FILL8},
    [FILL32] = {"fill_4byte", "cuMemsetD32Async (cubuf_buffer_fill, 4-byte pattern)", OP_FILL32},
};

/* Points arg at the buffers of `row` in `set`; raw and cubuf use the same memory. */
static void bind_row(copy_arg_t *a, row_kind_t row, const size_set_t *set, CUstream stream)
{
    memset(a, 0, sizeof *a);
    a->stream = stream;
    a->size = set->size;
    a->lib_dst = row == D2H_POOL ? set->h_pool : set->d_dst;
    switch (row) {
    case D2D:
    case D2H_POOL: a->lib_src = set->d_src; break;
    case H2D_POOL: a->lib_src = set->h_pool; break;
    case H2D_HOSTALLOC: a->lib_src = set->h_view; break;
    default: a->lib_src = NULL; break; /* fills */
    }
    a->raw_dst = cubuf_buffer_ptr(a->lib_dst);
    a->raw_src = a->lib_src ? cubuf_buffer_ptr(a->lib_src) : 0;
}

static bench_case_t make_case(const char *group, const char *name, copy_arg_t *a, bench_op_fn raw,
                              bench_op_fn lib)
{
    /* Targets: time per operation up to 1 MiB, bandwidth from 64 MiB. */
    bool small = a->size <= BENCH_MIB;
    bench_case_t c = {
        .group = group,
        .name = name,
        .size = a->size,
        .mode = small ? BENCH_LATENCY : BENCH_BANDWIDTH,
        .stream = a->stream,
        .raw = raw,
        .lib = lib,
        .arg = a,
        .sample_s = small ? 1e-3 : 4e-3,
        .max_batch = 256,
        .budget_s = small ? 0.4 : 0.6,
        .min_pairs = small ? 11 : 5,
        .max_pairs = small ? 41 : 21,
    };
    if (small) {
        c.target = BENCH_TARGET_LE;
        c.bound = 1.05;
    } else if (a->size >= 64 * BENCH_MIB) {
        c.target = BENCH_TARGET_GE;
        c.bound = 0.98;
    }
    return c;
}

/* Copy with options (a batch of one) against a raw cuMemcpyBatchAsync of
 * one copy with the same attributes. A first try of each side decides
 * whether the section can run, so that a driver refusing the attributed
 * copy skips it instead of ending the program before its summary. */
static void options_section(bench_env_t *env, const size_set_t *sets)
{
    bench_section("copy with options (a batch of one) vs raw cuMemcpyBatchAsync of one copy");
    if (!cubuf__drv.cuMemcpyBatchAsync) {
        bench_note("skipped: this driver has no cuMemcpyBatchAsync");
        return;
    }
    /* Default options: source read in stream order, no location hints. */
    static const cubuf_copy_options_t opts = CUBUF_COPY_OPTIONS_INIT;
    CUmemcpyAttributes attr;
    memset(&attr, 0, sizeof attr);
    attr.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;

    copy_arg_t a;
    bind_row(&a, D2D, &sets[0], env->stream);
    size_t first = 0;
    CUresult r = cubuf__drv.cuMemcpyBatchAsync(&a.raw_dst, &a.raw_src, &a.size, 1, &attr, &first, 1,
                                               env->stream);
    if (r != CUDA_SUCCESS) {
        const char *name = "?";
        cubuf__drv.cuGetErrorName(r, &name);
        bench_note("skipped: the raw cuMemcpyBatchAsync of one copy failed: %s", name);
        return;
    }
    cubuf_status_t st = cubuf_buffer_copy_from(a.lib_dst, a.lib_src, env->stream, &opts);
    if (st != CUBUF_SUCCESS) {
        if (st == CUBUF_ERROR_NOT_SUPPORTED)
            bench_note("skipped: %s", cubuf_last_error());
        else
            bench_error(env, "cubuf_buffer_copy_from with options returned %s: %s",
                        cubuf_status_name(st), cubuf_last_error());
        return;
    }
    B_CU(cuStreamSynchronize, env->stream);

    static const row_kind_t opt_rows[] = {D2D, H2D_POOL};
    static const size_t opt_sizes[] = {4 * BENCH_KIB, 64 * BENCH_KIB, BENCH_MIB, 256 * BENCH_MIB};
    for (size_t k = 0; k < sizeof opt_rows / sizeof opt_rows[0]; k++) {
        bench_note("%s: raw = cuMemcpyBatchAsync(count 1, srcAccessOrder STREAM)",
                   row_info[opt_rows[k]].name);
        for (size_t j = 0; j < sizeof opt_sizes / sizeof opt_sizes[0]; j++) {
            int i = 0;
            while (i < NSIZES - 1 && sets[i].size < opt_sizes[j]) i++;
            bind_row(&a, opt_rows[k], &sets[i], env->stream);
            a.opts = &opts;
            a.attr = attr;
            bench_case_t c = make_case("copyopt", row_info[opt_rows[k]].name, &a, raw_batch_one,
                                       lib_copy_options);
            bench_compare(env, &c);
            verify(env, &c, OP_COPY);
        }
    }
}

int main(void)
{
    bench_env_t env;
    bench_init(&env, "bench_copy");
    double t_start = bench_now();

    cubuf_resource_t *devres = NULL, *pinres = NULL;
    B_OK(cubuf_device_resource_create(0, NULL, &devres));
    B_OK(cubuf_pinned_resource_create(0, false, &pinres));
    void *hostalloc = NULL;
    B_CU(cuMemHostAlloc, &hostalloc, BENCH_GIB, CU_MEMHOSTALLOC_PORTABLE);

    size_set_t sets[NSIZES];
    size_t size = 4 * BENCH_KIB;
    for (int i = 0; i < NSIZES; i++, size *= 4) {
        size_set_t *s = &sets[i];
        s->size = size;
        B_OK(cubuf_resource_allocate(devres, size, env.stream, &s->d_src));
        B_OK(cubuf_resource_allocate(devres, size, env.stream, &s->d_dst));
        B_OK(cubuf_resource_allocate(pinres, size, env.stream, &s->h_pool));
        B_OK(cubuf_buffer_view((CUdeviceptr)(uintptr_t)hostalloc, size, &s->h_view));
        /* The probes and the first touch below write pinned memory directly. */
        if (!cubuf_buffer_is_host_accessible(s->h_pool) || !cubuf_buffer_is_host_accessible(s->h_view)) {
            fprintf(stderr, "error: pinned memory does not read as host accessible\n");
            return 1;
        }
    }
    B_CU(cuStreamSynchronize, env.stream);
    /* Touch everything once so no row pays for first use. */
    for (int i = 0; i < NSIZES; i++) {
        B_CU(cuMemsetD8Async, cubuf_buffer_ptr(sets[i].d_src), 1, sets[i].size, env.stream);
        B_CU(cuMemsetD8Async, cubuf_buffer_ptr(sets[i].d_dst), 2, sets[i].size, env.stream);
        memset((void *)(uintptr_t)cubuf_buffer_ptr(sets[i].h_pool), 3, sets[i].size);
    }
    memset(hostalloc, 4, BENCH_GIB);
    B_CU(cuStreamSynchronize, env.stream);
    printf("setup (allocations, first touch): %.1f s\n", bench_now() - t_start);

    static const bench_op_fn raw_ops[NROWS] = {raw_copy, raw_copy, raw_copy, raw_copy, raw_fill8, raw_fill32};
    static const bench_op_fn lib_ops[NROWS] = {lib_copy, lib_copy, lib_copy, lib_copy, lib_fill8, lib_fill32};

    bench_section("copies and fills: time per operation up to 1 MiB, bandwidth from 4 MiB");
    for (int r = 0; r < NROWS; r++) {
        bench_note("%s: raw = %s", row_info[r].name, row_info[r].raw);
        for (int i = 0; i < NSIZES; i++) {
            copy_arg_t a;
            bind_row(&a, (row_kind_t)r, &sets[i], env.stream);
            bench_case_t c = make_case("copy", row_info[r].name, &a, raw_ops[r], lib_ops[r]);
            bench_compare(&env, &c);
            verify(&env, &c, row_info[r].op);
        }
    }

    bench_section("H2D bandwidth: cubuf copy from pinned-resource memory vs raw copy from cuMemHostAlloc memory");
    bench_note("the pinned resource must grant device access to its pool, or this falls to ~8 GB/s");
    for (int i = 0; i < NSIZES; i++) {
        if (sets[i].size < 64 * BENCH_MIB) continue;
        copy_arg_t a;
        bind_row(&a, H2D_POOL, &sets[i], env.stream);
        a.raw_src = (CUdeviceptr)(uintptr_t)hostalloc;
        bench_case_t c = make_case("pinned", "H2D_pool_vs_cuMemHostAlloc", &a, raw_copy, lib_copy);
        c.target = BENCH_TARGET_GE;
        c.bound = 0.95;
        bench_compare(&env, &c);
        verify(&env, &c, OP_COPY);
    }

    options_section(&env, sets);

    B_CU(cuStreamSynchronize, env.stream);
    for (int i = 0; i < NSIZES; i++) {
        cubuf_buffer_t *bufs[] = {sets[i].d_src, sets[i].d_dst, sets[i].h_pool, sets[i].h_view};
        for (int j = 0; j < 4; j++) {
            B_OK(cubuf_buffer_close(bufs[j]));
            cubuf_buffer_release(bufs[j]);
        }
    }
    B_CU(cuStreamSynchronize, env.stream);
    B_CU(cuMemFreeHost, hostalloc);
    cubuf_resource_release(devres);
    cubuf_resource_release(pinres);
    printf("\nbench_copy took %.1f s\n", bench_now() - t_start);
    int rc = bench_summary(&env, "bench_copy");
    bench_fini(&env);
    return rc;
}
