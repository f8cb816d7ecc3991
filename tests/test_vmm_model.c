/* Random sequences of allocate, modify_allocation (in place, past the
 * reservation, moving, shrinking aliases) and close on one virtual memory
 * resource, checked after every step against a model of the physical
 * allocations the open buffers map (read through cubuf__vmm_chunks): each
 * new buffer aliases the one it grew from, every allocation keeps the tag
 * written at both its ends, and the resource's statistics and the live
 * driver objects equal the distinct allocations still mapped. Three passes:
 * no faults, driver calls failing at random, host allocations failing at
 * random; a failed grow or close must leave every live count, the buffer
 * and its data as they were, and no warning may be raised. */
#include <stdint.h>

#include "test.h"
#include "vmm_test.h"
#include "vmm.h"

#define MAXB 24
#define MAXH 4096

static cubuf_resource_t *g_res;
static size_t g_gran;

typedef struct hent {
    CUmemGenericAllocationHandle h;
    size_t size;
    uint64_t tag;
    bool seen;
} hent_t;
static hent_t g_h[MAXH];
static size_t g_nh;
static uint64_t g_tagc = 1;

static hent_t *hfind(CUmemGenericAllocationHandle h)
{
    for (size_t i = 0; i < g_nh; i++)
        if (g_h[i].h == h) return &g_h[i];
    return NULL;
}

static cubuf_buffer_t *g_b[MAXB];
static size_t g_nb;
static unsigned long g_rng = 12345;
static unsigned rnd(unsigned n)
{
    g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
    return (unsigned)((g_rng >> 33) % n);
}

static long g_base_allocs;
static bool g_faults, g_allocf;
static int g_fired, g_gfail, g_cfail;
static int g_warn;
static void on_warn(cubuf_status_t st, const char *m, void *u)
{
    (void)st, (void)u;
    g_warn++;
    fprintf(stderr, "warning: %s\n", m);
}

static int check_all(int step)
{
    for (size_t i = 0; i < g_nh; i++) g_h[i].seen = false;
    size_t ucount = 0, ubytes = 0;
    for (size_t k = 0; k < g_nb; k++) {
        cubuf_buffer_t *b = g_b[k];
        if (cubuf_buffer_size(b) == 0) continue;
        cubuf_vmm_chunk_t *c = NULL;
        size_t n = 0, first = 0;
        T_REQUIRE(cubuf__vmm_chunks(b, &c, &n, &first));
        size_t total = 0;
        for (size_t i = 0; i < n; i++) {
            if (c[i].offset != total) {
                fprintf(stderr, "step %d: chunk offsets not contiguous\n", step);
                t_failures++;
            }
            total += c[i].size;
            hent_t *e = hfind(c[i].handle);
            CUdeviceptr p = cubuf_buffer_ptr(b) + c[i].offset;
            if (!e) {
                if (g_nh == MAXH) {
                    fprintf(stderr, "too many handles\n");
                    exit(1);
                }
                e = &g_h[g_nh++];
                *e = (hent_t){c[i].handle, c[i].size, g_tagc++, false};
                uint64_t w[2] = {e->tag, ~e->tag};
                T_CU(cuMemcpyHtoD, p, w, sizeof w);
                T_CU(cuMemcpyHtoD, p + c[i].size - sizeof w, w, sizeof w);
            } else {
                uint64_t w[2], v[2];
                T_CU(cuMemcpyDtoH, w, p, sizeof w);
                T_CU(cuMemcpyDtoH, v, p + c[i].size - sizeof v, sizeof v);
                if (w[0] != e->tag || w[1] != ~e->tag || v[0] != e->tag || v[1] != ~e->tag) {
                    fprintf(stderr, "step %d: buffer %zu chunk %zu: data lost (tag %llu got %llu)\n",
                            step, k, i, (unsigned long long)e->tag, (unsigned long long)w[0]);
                    t_failures++;
                }
                if (e->size != c[i].size) {
                    fprintf(stderr, "step %d: handle size changed\n", step);
                    t_failures++;
                }
            }
            if (!e->seen) {
                e->seen = true;
                ucount++;
                ubytes += e->size;
            }
        }
        if (total != cubuf_buffer_size(b)) {
            fprintf(stderr, "step %d: buffer %zu: chunks cover %zu, size %zu\n", step, k, total,
                    cubuf_buffer_size(b));
            t_failures++;
        }
        free(c);
    }
    /* forget handles no open buffer maps */
    size_t j = 0;
    for (size_t i = 0; i < g_nh; i++)
        if (g_h[i].seen) g_h[j++] = g_h[i];
    g_nh = j;
    cubuf_resource_stats_t s = CUBUF_RESOURCE_STATS_INIT;
    T_OK(cubuf_resource_stats(g_res, &s));
    cubuf_vmm_live_t live;
    cubuf__vmm_live(&live);
    if (s.current_count != ucount || s.current_bytes != ubytes ||
        live.allocations - g_base_allocs != (long)ucount) {
        fprintf(stderr,
                "step %d: stats count %zu bytes %zu live allocs %ld; model count %zu bytes %zu\n",
                step, s.current_count, s.current_bytes, live.allocations - g_base_allocs, ucount,
                ubytes);
        t_failures++;
        return 1;
    }
    return 0;
}

/* A failed step changed what is live (reservations, mappings, physical
 * allocations, waiters): reported, counted as a failure. */
static void report_live(int step, const char *what, const cubuf_vmm_live_t *b, const cubuf_vmm_live_t *a)
{
    fprintf(stderr,
            "step %d: a failed %s (%s) changed the live counts: reservations %ld -> %ld, mappings "
            "%ld -> %ld, allocations %ld -> %ld, waiters %ld -> %ld\n",
            step, what, cubuf_last_error(), b->reservations, a->reservations, b->mappings, a->mappings,
            b->allocations, a->allocations, b->waiters, a->waiters);
    t_failures++;
}

static void run_pass(unsigned long seed, int steps, bool faults, bool alloc_faults)
{
    g_rng = seed;
    g_faults = faults;
    g_allocf = alloc_faults;
    g_fired = g_gfail = g_cfail = 0;
    cubuf_vmm_live_t l0;
    cubuf__vmm_live(&l0);
    g_base_allocs = l0.allocations;
    for (int step = 0; step < steps && t_failures == 0; step++) {
        unsigned op = rnd(10);
        cubuf_vmm_live_t lb;
        cubuf__vmm_live(&lb);
        bool armed = g_faults && rnd(2) == 0;
        if (armed && g_allocf) cubuf_fault_fail_alloc_nth(1 + rnd(4));
        else if (armed) cubuf_fault_fail_any_nth(1 + rnd(8), CUDA_ERROR_UNKNOWN);
        cubuf__vmm_test_refuse_extension(rnd(4) == 0);
        if (g_nb == 0 || (op < 2 && g_nb < MAXB)) {
            cubuf_buffer_t *b = NULL;
            cubuf_status_t ast = cubuf_resource_allocate(g_res, (1 + rnd(3)) * g_gran - rnd(2), 0, &b);
            if (armed) cubuf_fault_reset();
            if (ast != CUBUF_SUCCESS && armed) { if (check_all(step)) break; continue; }
            T_REQUIRE(ast);
            g_b[g_nb++] = b;
        } else if (op < 6 && g_nb < MAXB) {
            cubuf_buffer_t *from = g_b[rnd((unsigned)g_nb)];
            size_t cur = cubuf_buffer_size(from);
            size_t ns;
            unsigned k = rnd(16);
            if (k == 0) ns = cur / 2;
            else if (k == 15) ns = cur + ((size_t)4 << 30) + rnd(4) * g_gran; /* past the reservation */
            else ns = cur + rnd(4) * g_gran + rnd(2);
            cubuf_buffer_t *nb = NULL;
            cubuf_status_t gst = cubuf_vmm_modify_allocation(g_res, from, ns, NULL, &nb);
            if (armed) { g_fired += cubuf_fault_fired(); cubuf_fault_reset(); }
            if (gst != CUBUF_SUCCESS) g_gfail++;
            if (gst != CUBUF_SUCCESS && (armed || gst == CUBUF_ERROR_OUT_OF_MEMORY)) {
                cubuf_vmm_live_t la;
                cubuf__vmm_live(&la);
                if (memcmp(&la, &lb, sizeof la)) {
                    report_live(step, "grow", &lb, &la);
                }
                if (check_all(step)) break;
                continue;
            }
            T_REQUIRE(gst);
            size_t want = (ns + g_gran - 1) / g_gran * g_gran;
            if (want < cur) want = cur;
            if (cubuf_buffer_size(nb) != want) {
                fprintf(stderr, "step %d: size %zu, want %zu\n", step, cubuf_buffer_size(nb), want);
                t_failures++;
            }
            /* aliasing: nb's prefix maps from's chunks */
            cubuf_vmm_chunk_t *a = NULL, *c = NULL;
            size_t na = 0, nc = 0, f = 0;
            T_REQUIRE(cubuf__vmm_chunks(from, &a, &na, &f));
            T_REQUIRE(cubuf__vmm_chunks(nb, &c, &nc, &f));
            for (size_t i = 0; i < na; i++)
                if (i >= nc || a[i].handle != c[i].handle || a[i].offset != c[i].offset) {
                    fprintf(stderr, "step %d: not an alias\n", step);
                    t_failures++;
                    break;
                }
            free(a);
            free(c);
            g_b[g_nb++] = nb;
        } else if (g_nb > 0) {
            size_t k = rnd((unsigned)g_nb);
            size_t bsz = cubuf_buffer_size(g_b[k]);
            cubuf_status_t cst = cubuf_buffer_close(g_b[k]);
            if (armed) { g_fired += cubuf_fault_fired(); cubuf_fault_reset(); }
            if (cst != CUBUF_SUCCESS) g_cfail++;
            if (cst != CUBUF_SUCCESS && armed) {
                cubuf_vmm_live_t la;
                cubuf__vmm_live(&la);
                if (memcmp(&la, &lb, sizeof la) || cubuf_buffer_is_closed(g_b[k]) ||
                    cubuf_buffer_size(g_b[k]) != bsz) {
                    report_live(step, "close", &lb, &la);
                }
                if (check_all(step)) break;
                continue;
            }
            T_OK(cst);
            cubuf_buffer_release(g_b[k]);
            g_b[k] = g_b[--g_nb];
        }
        if (armed) cubuf_fault_reset();
        if (check_all(step)) break;
    }
    cubuf__vmm_test_refuse_extension(false);
    while (g_nb > 0) {
        T_OK(cubuf_buffer_close(g_b[g_nb - 1]));
        cubuf_buffer_release(g_b[--g_nb]);
        check_all(-1);
    }
    cubuf_vmm_live_t l1;
    cubuf__vmm_live(&l1);
    T_CHECK(l1.reservations == l0.reservations && l1.mappings == l0.mappings &&
            l1.allocations == l0.allocations && l1.waiters == l0.waiters);
    printf("seed %lu, %d steps, %s: %d faults fired, %d grows and %d closes failed\n", seed, steps,
           !faults ? "no faults" : alloc_faults ? "host allocations failing" : "driver calls failing",
           g_fired, g_gfail, g_cfail);
    T_CHECK(!faults || g_fired > 0);
}

int main(void)
{
    cubuf_context_t *ctx = NULL;
    CUcontext cu = NULL;
    g_res = vmm_test_start(&ctx, &cu, &g_gran);
    cubuf_set_warning_handler(on_warn, NULL);
    run_pass(12345, 600, false, false);
    run_pass(777, 600, true, false);
    run_pass(4242, 400, true, true);
    T_CHECK(g_warn == 0);
    cubuf_set_warning_handler(NULL, NULL);
    cubuf_resource_release(g_res);
    cubuf_context_destroy(ctx);
    return t_finish("test_vmm_model");
}
