/* Host allocation faults without a GPU: the seam itself (counting, firing
 * once, reset), then every host-only path (user resources over malloc,
 * allocating from them, adopting memory, external owners, views of nothing,
 * slices and slices of slices) with its n-th host allocation failing for
 * n = 1, 2, ... until it succeeds. Each failure returns
 * CUBUF_ERROR_OUT_OF_MEMORY, writes no result, leaves its inputs as they
 * were (the user callbacks' counts, the resource's statistics, the root's
 * open slices) and leaks nothing (a sanitizer build's LeakSanitizer checks
 * the objects). Each path runs once on fresh threads, whose buffer-object
 * cache is empty (so the object and the cache are allocated in turn), and
 * once on a warm thread. IPC descriptors are covered by test_ipc_wire. */
#include <pthread.h>
#include <stdint.h>

#include "internal.h"
#include "test.h"

/* ---- a user resource over malloc ---- */

typedef struct host_state {
    int mallocs, frees, destroys;
    int releases; /* external owner releases */
} host_state_t;

static cubuf_status_t h_alloc(void *state, size_t size, CUstream stream, CUdeviceptr *ptr)
{
    (void)stream;
    host_state_t *h = state;
    void *p = malloc(size);
    if (!p) return CUBUF_ERROR_OUT_OF_MEMORY;
    memset(p, 0x5a, size);
    h->mallocs++;
    *ptr = (CUdeviceptr)(uintptr_t)p;
    return CUBUF_SUCCESS;
}

static cubuf_status_t h_dealloc(void *state, CUdeviceptr ptr, size_t size, CUstream stream)
{
    (void)size;
    (void)stream;
    host_state_t *h = state;
    free((void *)(uintptr_t)ptr);
    h->frees++;
    return CUBUF_SUCCESS;
}

static void h_destroy(void *state) { ((host_state_t *)state)->destroys++; }

static void h_owner_release(void *owner) { ((host_state_t *)owner)->releases++; }

static const cubuf_resource_ops_t k_ops = {CUBUF_RESOURCE_OPS_VERSION, h_alloc, h_dealloc, h_destroy};

#define STREAM ((CUstream)(uintptr_t)0x1000) /* opaque to a host-only resource */

static cubuf_resource_t *host_resource(host_state_t *h)
{
    cubuf_resource_props_t props = CUBUF_RESOURCE_PROPS_INIT;
    props.host_accessible = true;
    cubuf_resource_t *r = NULL;
    T_REQUIRE(cubuf_resource_create(&k_ops, &props, h, &r));
    return r;
}

static bool stats_are(cubuf_resource_t *r, size_t bytes, size_t count, uint64_t total)
{
    cubuf_resource_stats_t s = {.struct_size = CUBUF_RESOURCE_STATS_SIZE_V1};
    if (cubuf_resource_stats(r, &s) != CUBUF_SUCCESS) return false;
    if (s.current_bytes == bytes && s.current_count == count && s.total_allocations == total)
        return true;
    fprintf(stderr, "  stats %zu bytes, %zu count, %llu total; expected %zu, %zu, %llu\n",
            s.current_bytes, s.current_count, (unsigned long long)s.total_allocations, bytes,
            count, (unsigned long long)total);
    return false;
}

/* ---- the loop ---- */

static const char *g_what;
static bool g_fired; /* the armed fault fired during the call under test */

/* Called right after the call under test: disarms, and says whether the
 * fault fired. A fired fault must have failed the call with OUT_OF_MEMORY
 * and a detail; otherwise the call must have succeeded. */
static bool faulted(cubuf_status_t st)
{
    g_fired = cubuf_fault_fired();
    bool alloc = cubuf_fault_fired_alloc();
    cubuf_fault_reset();
    if (g_fired) {
        T_CHECK(alloc);
        if (st != CUBUF_ERROR_OUT_OF_MEMORY) {
            fprintf(stderr, "%s: a failed host allocation gave %s, not CUBUF_ERROR_OUT_OF_MEMORY\n",
                    g_what, cubuf_status_name(st));
            t_failures++;
        }
        T_CHECK(cubuf_last_error()[0] != '\0');
        return true;
    }
    if (st != CUBUF_SUCCESS) {
        fprintf(stderr, "%s: failed with no fault: %s (%s)\n", g_what, cubuf_status_name(st),
                cubuf_last_error());
        t_failures++;
    }
    return false;
}

typedef struct attempt {
    void (*op)(void *);
    void *arg;
} attempt_t;

static void *run_attempt(void *p)
{
    attempt_t *a = p;
    a->op(a->arg);
    return NULL;
}

/* Fails the op's n-th host allocation for n = 1, 2, ... until it succeeds;
 * cold: each attempt on a new thread (empty buffer-object cache). Returns
 * the number of allocations that failed it. */
static unsigned fault_loop(const char *what, bool cold, void (*op)(void *), void *arg)
{
    g_what = what;
    unsigned n = 1;
    for (;; n++) {
        if (n > 64) {
            fprintf(stderr, "%s: still failing after 64 allocations\n", what);
            t_failures++;
            break;
        }
        cubuf_fault_fail_alloc_nth(n);
        if (cold) {
            attempt_t a = {op, arg};
            pthread_t t;
            if (pthread_create(&t, NULL, run_attempt, &a) != 0) {
                cubuf_fault_reset();
                fprintf(stderr, "%s: cannot start a thread\n", what);
                t_failures++;
                break;
            }
            pthread_join(t, NULL);
        } else {
            op(arg);
        }
        if (!g_fired) break;
    }
    cubuf_fault_reset();
    printf("  %s (%s thread): %u host allocation(s) failed in turn\n", what, cold ? "new" : "warm",
           n - 1);
    return n - 1;
}

/* ---- the paths ---- */

typedef struct fixture {
    host_state_t h;
    cubuf_resource_t *res;
    cubuf_buffer_t *root, *slice;
} fixture_t;

static void op_resource_create(void *arg)
{
    fixture_t *f = arg;
    cubuf_resource_props_t props = CUBUF_RESOURCE_PROPS_INIT;
    props.host_accessible = true;
    cubuf_resource_props_t before = props;
    cubuf_resource_t *r = (cubuf_resource_t *)&f->h; /* a sentinel: never written on failure */
    cubuf_status_t st = cubuf_resource_create(&k_ops, &props, &f->h, &r);
    T_CHECK(memcmp(&props, &before, sizeof props) == 0);
    if (faulted(st)) {
        T_CHECK(r == (cubuf_resource_t *)&f->h);
        T_CHECK(f->h.destroys == 0); /* the state stays the caller's */
        return;
    }
    cubuf_resource_release(r);
    T_CHECK(f->h.destroys == 1);
    f->h.destroys = 0;
}

static void op_allocate(void *arg)
{
    fixture_t *f = arg;
    cubuf_buffer_t *b = NULL;
    cubuf_status_t st = cubuf_resource_allocate(f->res, 1000, STREAM, &b);
    if (faulted(st)) {
        T_CHECK(b == NULL);
        T_CHECK(f->h.mallocs == f->h.frees); /* nothing taken from the user resource, or given back */
        T_CHECK(stats_are(f->res, 0, 0, 0));
        return;
    }
    T_CHECK(cubuf_buffer_size(b) == 1000 && cubuf_buffer_is_host_accessible(b));
    unsigned char *p = (unsigned char *)(uintptr_t)cubuf_buffer_ptr(b);
    T_CHECK(p && p[0] == 0x5a && p[999] == 0x5a);
    T_CHECK(stats_are(f->res, 1000, 1, 1));
    cubuf_buffer_release(b);
    T_CHECK(f->h.mallocs == f->h.frees && f->h.mallocs > 0);
    T_CHECK(stats_are(f->res, 0, 0, 1));
    /* The next attempt starts from the same statistics. */
    cubuf_resource_release(f->res);
    f->res = host_resource(&f->h);
}

static void op_wrap(void *arg)
{
    fixture_t *f = arg;
    void *mem = malloc(64);
    T_CHECK(mem != NULL);
    cubuf_buffer_t *b = NULL;
    int frees = f->h.frees;
    cubuf_status_t st = cubuf_buffer_wrap((CUdeviceptr)(uintptr_t)mem, 64, f->res, STREAM, &b);
    if (faulted(st)) {
        T_CHECK(b == NULL);
        T_CHECK(f->h.frees == frees); /* the memory stays the caller's */
        T_CHECK(stats_are(f->res, 0, 0, 0));
        free(mem);
        return;
    }
    T_CHECK(cubuf_buffer_ptr(b) == (CUdeviceptr)(uintptr_t)mem && cubuf_buffer_size(b) == 64);
    f->h.mallocs++; /* the resource owns mem now: h_dealloc frees it */
    T_CHECK(stats_are(f->res, 64, 1, 1));
    cubuf_buffer_release(b); /* frees mem through the resource */
    T_CHECK(f->h.frees == frees + 1);
    cubuf_resource_release(f->res);
    f->res = host_resource(&f->h);
}

static void op_wrap_external(void *arg)
{
    fixture_t *f = arg;
    cubuf_buffer_t *b = NULL;
    f->h.releases = 0;
    cubuf_status_t st = cubuf_buffer_wrap_external(0, 0, &f->h, h_owner_release, &b);
    if (faulted(st)) {
        T_CHECK(b == NULL);
        T_CHECK(f->h.releases == 0); /* the owner is not released by a failed wrap */
        return;
    }
    T_CHECK(cubuf_buffer_owner(b) == &f->h && f->h.releases == 0);
    cubuf_buffer_release(b);
    T_CHECK(f->h.releases == 1);
}

static void op_view(void *arg)
{
    (void)arg;
    cubuf_buffer_t *b = NULL;
    if (faulted(cubuf_buffer_view(0, 0, &b))) {
        T_CHECK(b == NULL);
        return;
    }
    T_CHECK(b && cubuf_buffer_size(b) == 0);
    cubuf_buffer_release(b);
}

static int open_slices(const cubuf_buffer_t *b) { return cubuf__inspect_open_slices(b); }

static void op_slice(void *arg)
{
    fixture_t *f = arg;
    cubuf_buffer_t *parent = f->slice ? f->slice : f->root;
    cubuf_buffer_t *s = NULL;
    int before = open_slices(f->root);
    cubuf_status_t st = cubuf_buffer_slice(parent, 4, 8, &s);
    if (faulted(st)) {
        T_CHECK(s == NULL);
        T_CHECK(open_slices(f->root) == before); /* the root is as it was: closable */
        return;
    }
    T_CHECK(cubuf_buffer_ptr(s) == cubuf_buffer_ptr(parent) + 4 && cubuf_buffer_size(s) == 8);
    T_CHECK(cubuf_buffer_parent(s) == f->root);
    T_CHECK(open_slices(f->root) == before + 1);
    cubuf_buffer_release(s);
    T_CHECK(open_slices(f->root) == before);
}

/* Releasing on a thread whose buffer-object cache cannot be made: the
 * object is freed instead; the release always succeeds. */
static void op_release_cold(void *arg)
{
    fixture_t *f = arg;
    cubuf_buffer_t *b = NULL;
    cubuf_fault_reset();
    T_REQUIRE(cubuf_resource_allocate(f->res, 16, STREAM, &b));
    cubuf_fault_fail_alloc_nth(1);
    int frees = f->h.frees;
    cubuf_buffer_release(b);
    g_fired = false; /* one attempt: a release has no failure */
    T_CHECK(cubuf_fault_fired());
    cubuf_fault_reset();
    T_CHECK(f->h.frees == frees + 1);
}

static void test_seam(void)
{
    host_state_t h = {0};
    cubuf_fault_count_calls(true);
    cubuf_resource_t *r = host_resource(&h);
    T_CHECK(cubuf_fault_allocs() == 1); /* the resource object */
    cubuf_fault_count_calls(false);

    /* The second allocation from now fails, once; counting is off. */
    cubuf_fault_fail_alloc_nth(2);
    cubuf_resource_t *r1 = NULL, *r2 = NULL, *r3 = NULL;
    T_OK(cubuf_resource_create(&k_ops, NULL, &h, &r1));
    T_CHECK(!cubuf_fault_fired());
    T_STATUS(cubuf_resource_create(&k_ops, NULL, &h, &r2), CUBUF_ERROR_OUT_OF_MEMORY);
    T_CHECK(r2 == NULL);
    T_CHECK(cubuf_fault_fired() && cubuf_fault_fired_alloc());
    T_CHECK(strcmp(cubuf_fault_fired_name(), "host allocation") == 0);
    T_CHECK(strstr(cubuf_last_error(), "allocate") != NULL);
    T_OK(cubuf_resource_create(&k_ops, NULL, &h, &r3));
    cubuf_resource_release(r1);
    cubuf_resource_release(r3);

    /* Arming again clears fired; reset disarms. */
    cubuf_fault_fail_alloc_nth(1);
    T_CHECK(!cubuf_fault_fired() && !cubuf_fault_fired_alloc());
    T_CHECK(strcmp(cubuf_fault_fired_name(), "") == 0);
    cubuf_fault_reset();
    T_OK(cubuf_resource_create(&k_ops, NULL, &h, &r1));
    T_CHECK(!cubuf_fault_fired());
    cubuf_resource_release(r1);

    /* A driver fault armed alongside does not fire on host allocations. */
    cubuf_fault_fail_any_nth(1, CUDA_ERROR_UNKNOWN);
    cubuf_fault_fail_alloc_nth(1);
    T_STATUS(cubuf_resource_create(&k_ops, NULL, &h, &r1), CUBUF_ERROR_OUT_OF_MEMORY);
    T_CHECK(cubuf_fault_fired_alloc());
    cubuf_fault_reset();
    cubuf_resource_release(r);
    T_CHECK(h.destroys == 4);
}

static void run_paths(bool cold)
{
    fixture_t f = {{0}, NULL, NULL, NULL};
    f.res = host_resource(&f.h);
    T_CHECK(fault_loop("cubuf_resource_create", cold, op_resource_create, &f) >= 1);
    unsigned n = fault_loop("cubuf_resource_allocate", cold, op_allocate, &f);
    T_CHECK(!cold || n >= 1); /* a new thread has no cached buffer object */
    n = fault_loop("cubuf_buffer_wrap", cold, op_wrap, &f);
    T_CHECK(!cold || n >= 1);
    n = fault_loop("cubuf_buffer_wrap_external", cold, op_wrap_external, &f);
    T_CHECK(!cold || n >= 1);
    n = fault_loop("cubuf_buffer_view", cold, op_view, &f);
    T_CHECK(!cold || n >= 1);

    T_REQUIRE(cubuf_resource_allocate(f.res, 64, STREAM, &f.root));
    n = fault_loop("cubuf_buffer_slice", cold, op_slice, &f);
    T_CHECK(!cold || n >= 1);
    T_REQUIRE(cubuf_buffer_slice(f.root, 16, 32, &f.slice));
    n = fault_loop("cubuf_buffer_slice of a slice", cold, op_slice, &f);
    T_CHECK(!cold || n >= 1);
    cubuf_buffer_release(f.slice);
    T_OK(cubuf_buffer_close(f.root)); /* no failed slice left it busy */
    cubuf_buffer_release(f.root);

    if (cold) {
        attempt_t a = {op_release_cold, &f};
        pthread_t t;
        T_CHECK(pthread_create(&t, NULL, run_attempt, &a) == 0);
        pthread_join(t, NULL);
    }
    cubuf_resource_release(f.res);
    T_CHECK(f.h.mallocs == f.h.frees);
    T_CHECK(f.h.destroys > 0);
}

int main(void)
{
    test_seam();
    run_paths(true);
    run_paths(false);
    return t_finish("test_alloc_fault");
}
