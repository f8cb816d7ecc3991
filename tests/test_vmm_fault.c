/* Nothing lost: every driver call on the create, allocate, grow (in place, in place
 * with a new reservation, moving) and close paths (unmapping everything, a
 * grown tail, the old mapping of a moved grow; unmapping nothing, which
 * records an event; unmapping after such a close) of virtual memory fails
 * in turn (fault injection, n = 1, 2, ... until the operation runs without
 * reaching the n-th call). Each time:
 *  - a failed operation returns an error; the input buffer is open, holds
 *    its data and works; nothing was left reserved, created or mapped, no
 *    stream or event made (cubuf's live counts, the resource's statistics and the driver's
 *    objects the process holds, counted at the table, are as before);
 *  - an operation that succeeds although a call failed (a release after the
 *    point of no return is retried) left everything exactly as a clean run.
 * Then the same with every host allocation failed in turn instead: each
 * failure is CUBUF_ERROR_OUT_OF_MEMORY, with the same checks. */
#include <stdint.h>

#include "alloc_fault_test.h"
#include "test.h"
#include "vmm_test.h"
#include "vmm.h"

#define MIB ((size_t)1 << 20)
#define SIZE (64 * MIB)
#define MAX_N 500

static cubuf_resource_t *g_res;
static int g_warnings;

static void on_warning(cubuf_status_t st, const char *msg, void *user)
{
    (void)st;
    (void)user;
    g_warnings++;
    fprintf(stderr, "unexpected warning: %s\n", msg);
}

/* The buffer still works: a write and a read at its end, then the pattern back. */
static bool still_works(cubuf_buffer_t *b, size_t base, unsigned seed)
{
    CUdeviceptr end = cubuf_buffer_ptr(b) + cubuf_buffer_size(b) - 4096;
    T_CU(cuMemsetD8, end, 0x5c, 4096);
    unsigned char h[4096];
    T_CU(cuMemcpyDtoH, h, end, sizeof h);
    bool ok = true;
    for (size_t i = 0; i < sizeof h; i++) ok &= h[i] == 0x5c;
    write_pattern(end, 4096, base + cubuf_buffer_size(b) - 4096, seed);
    return ok && check_pattern(cubuf_buffer_ptr(b), cubuf_buffer_size(b), base, seed);
}

typedef struct snap {
    cubuf_vmm_live_t live;
    t_held_t held;
    size_t bytes, count;
} snap_t;

static snap_t snap(void)
{
    snap_t s;
    cubuf__vmm_live(&s.live);
    cubuf_resource_stats_t st = CUBUF_RESOURCE_STATS_INIT;
    T_OK(cubuf_resource_stats(g_res, &st));
    s.bytes = st.current_bytes;
    s.count = st.current_count;
    s.held = t_held();
    return s;
}

static bool same(const snap_t *a, const snap_t *b, const char *what, unsigned n, const char *call)
{
    bool held = t_held_same(__FILE__, __LINE__, what, &a->held, &b->held);
    bool ok = held && a->live.reservations == b->live.reservations &&
              a->live.mappings == b->live.mappings && a->live.allocations == b->live.allocations &&
              a->live.waiters == b->live.waiters && a->bytes == b->bytes && a->count == b->count;
    if (!ok)
        fprintf(stderr,
                "%s, call %u (%s) failed: state changed: reservations %ld->%ld mappings %ld->%ld "
                "allocations %ld->%ld waiters %ld->%ld bytes %zu->%zu count %zu->%zu\n",
                what, n, call, a->live.reservations, b->live.reservations, a->live.mappings,
                b->live.mappings, a->live.allocations, b->live.allocations, a->live.waiters,
                b->live.waiters, a->bytes, b->bytes, a->count, b->count);
    return ok;
}

/* One injected failure: arms call n, runs nothing else, disarms. */
typedef struct shot {
    bool fired;
    char call[64];
} shot_t;

static bool g_alloc; /* the pass that fails host allocations instead of driver calls */

static void arm(unsigned n)
{
    if (g_alloc) t_fail_alloc_nth(n);
    else cubuf_fault_fail_any_nth(n, CUDA_ERROR_UNKNOWN);
}

static shot_t disarm(void)
{
    shot_t s;
    s.fired = cubuf_fault_fired();
    snprintf(s.call, sizeof s.call, "%s", cubuf_fault_fired_name());
    cubuf_fault_reset();
    return s;
}

static void report(const char *what, unsigned calls, unsigned errors, unsigned recovered)
{
    printf("%s: failed each of %u %s in turn: %u errors, %u absorbed after the point "
           "of no return\n",
           what, calls, g_alloc ? "host allocations" : "driver calls", errors, recovered);
}

/* ---- allocate ------------------------------------------------------------------------ */

static void fault_allocate(void)
{
    unsigned errors = 0, absorbed = 0, n;
    for (n = 1; n < MAX_N; n++) {
        snap_t before = snap();
        cubuf_buffer_t *b = NULL;
        arm(n);
        cubuf_status_t st = cubuf_resource_allocate(g_res, SIZE, 0, &b);
        shot_t shot = disarm();
        if (st != CUBUF_SUCCESS) {
            errors++;
            T_CHECK(shot.fired && b == NULL);
            if (g_alloc) T_STATUS(st, CUBUF_ERROR_OUT_OF_MEMORY);
        } else {
            if (shot.fired) absorbed++;
            write_pattern(cubuf_buffer_ptr(b), SIZE, 0, 1);
            T_CHECK(check_pattern(cubuf_buffer_ptr(b), SIZE, 0, 1));
            T_OK(cubuf_buffer_close(b));
            cubuf_buffer_release(b);
        }
        snap_t after = snap();
        T_CHECK(same(&before, &after, "allocate", n, shot.call));
        if (!shot.fired) break;
    }
    T_CHECK(n < MAX_N && errors > 0);
    report("allocate", n - 1, errors, absorbed);
}

/* ---- create --------------------------------------------------------------------------- */

static void fault_create(void)
{
    unsigned errors = 0, n;
    for (n = 1; n < MAX_N; n++) {
        snap_t before = snap();
        cubuf_resource_t *r = NULL;
        arm(n);
        cubuf_status_t st = cubuf_vmm_resource_create(0, NULL, &r);
        shot_t shot = disarm();
        if (st != CUBUF_SUCCESS) {
            errors++;
            T_CHECK(shot.fired && r == NULL);
            if (g_alloc) T_STATUS(st, CUBUF_ERROR_OUT_OF_MEMORY);
        } else {
            cubuf_resource_release(r);
        }
        snap_t after = snap();
        T_CHECK(same(&before, &after, "create", n, shot.call));
        if (!shot.fired) break;
    }
    T_CHECK(n < MAX_N && errors > 0);
    report("create", n - 1, errors, 0);
}

/* ---- grow ------------------------------------------------------------------------------ */

typedef enum grow_kind { GROW_HEADROOM, GROW_EXTEND, GROW_MOVE } grow_kind_t;

static void fault_grow(grow_kind_t kind)
{
    static const char *const names[] = {"grow in place", "grow in place past the reservation",
                                        "grow that moves"};
    const char *what = names[kind];
    cubuf_buffer_t *b = NULL, *x = NULL;
    snap_t start = snap();
    T_REQUIRE(cubuf_resource_allocate(g_res, SIZE, 0, &b));
    write_pattern(cubuf_buffer_ptr(b), SIZE, 0, 2);
    size_t want = 2 * SIZE;
    if (kind == GROW_EXTEND) {
        /* Past the space's first reservation (4 GiB): a reservation at its end. */
        CUdeviceptr end;
        size_t headroom;
        bool ext;
        T_REQUIRE(cubuf__vmm_tail(b, &end, &headroom, &ext));
        want = SIZE + headroom + 2 * SIZE;
    } else if (kind == GROW_MOVE) {
        /* x maps the addresses right after b: a grow of b must move. */
        T_REQUIRE(cubuf_vmm_modify_allocation(g_res, b, 2 * SIZE, NULL, &x));
        write_pattern(cubuf_buffer_ptr(x) + SIZE, SIZE, SIZE, 3);
        want = 3 * SIZE;
    }
    unsigned errors = 0, absorbed = 0, moved = 0, n;
    for (n = 1; n < MAX_N; n++) {
        snap_t before = snap();
        cubuf_buffer_t *g = NULL;
        arm(n);
        cubuf_status_t st = cubuf_vmm_modify_allocation(g_res, b, want, NULL, &g);
        shot_t shot = disarm();
        if (st != CUBUF_SUCCESS) {
            errors++;
            T_CHECK(shot.fired && g == NULL);
            if (g_alloc) T_STATUS(st, CUBUF_ERROR_OUT_OF_MEMORY);
            snap_t after = snap();
            T_CHECK(same(&before, &after, what, n, shot.call));
        } else {
            if (shot.fired) absorbed++;
            moved += cubuf_buffer_ptr(g) != cubuf_buffer_ptr(b);
            T_CHECK(cubuf_buffer_size(g) == want);
            if (kind == GROW_MOVE) T_CHECK(cubuf_buffer_ptr(g) != cubuf_buffer_ptr(b));
            if (kind == GROW_HEADROOM) T_CHECK(cubuf_buffer_ptr(g) == cubuf_buffer_ptr(b));
            T_CHECK(check_pattern(cubuf_buffer_ptr(g), SIZE, 0, 2));
            T_CU(cuMemsetD8, cubuf_buffer_ptr(g) + want - 4096, 0x66, 4096);
            T_OK(cubuf_buffer_close(g));
            cubuf_buffer_release(g);
            snap_t after = snap();
            /* The reservation an extending grow added stays with the space
             * as headroom while b keeps the space alive (address space, no
             * memory); it goes with b, checked below. */
            if (kind == GROW_EXTEND && after.live.reservations == before.live.reservations + 1 &&
                after.held.reservations == before.held.reservations + 1) {
                after.live.reservations--;
                after.held.reservations--;
            }
            T_CHECK(same(&before, &after, what, n, shot.call));
        }
        /* The buffer grown from is open, intact and works, whatever happened. */
        T_CHECK(!cubuf_buffer_is_closed(b));
        T_CHECK(still_works(b, 0, 2));
        if (x) T_CHECK(check_pattern(cubuf_buffer_ptr(x) + SIZE, SIZE, SIZE, 3));
        if (!shot.fired || t_failures > 20) break;
    }
    T_CHECK(n < MAX_N && errors > 0);
    report(what, n - 1, errors, absorbed);
    if (kind == GROW_EXTEND) printf("  (%u of the successful grows moved the range)\n", moved);
    if (x) {
        T_OK(cubuf_buffer_close(x));
        cubuf_buffer_release(x);
    }
    T_OK(cubuf_buffer_close(b));
    cubuf_buffer_release(b);
    snap_t end = snap();
    T_CHECK(same(&start, &end, what, 0, "closing everything"));
}

/* ---- close ------------------------------------------------------------------------------- */

typedef enum close_kind {
    CLOSE_ONLY,      /* the only buffer: everything goes */
    CLOSE_TAIL,      /* a grow in place: its new part goes */
    CLOSE_MOVED_OLD, /* the old buffer of a moved grow: its mapping goes, the memory stays */
    CLOSE_DEFERRED,  /* the old buffer of a grow in place: nothing goes, an event is recorded */
    CLOSE_AFTER_DEFERRED, /* the grown buffer after that: everything goes, after the event */
} close_kind_t;

typedef struct scene {
    cubuf_buffer_t *target; /* the buffer closed under fault injection */
    cubuf_buffer_t *other;  /* an alias that stays open, or NULL */
    size_t target_base;     /* logical offset of target's first byte in the pattern */
} scene_t;

static scene_t make_scene(close_kind_t kind, CUstream s1, CUstream s2)
{
    scene_t sc = {NULL, NULL, 0};
    cubuf_buffer_t *a = NULL;
    T_REQUIRE(cubuf_resource_allocate(g_res, SIZE, s1, &a));
    write_pattern(cubuf_buffer_ptr(a), SIZE, 0, 4);
    if (kind == CLOSE_ONLY) {
        sc.target = a;
    } else if (kind == CLOSE_DEFERRED || kind == CLOSE_AFTER_DEFERRED) {
        cubuf_buffer_t *g = NULL;
        T_REQUIRE(cubuf_vmm_modify_allocation(g_res, a, 3 * SIZE, NULL, &g));
        T_CHECK(cubuf_buffer_ptr(g) == cubuf_buffer_ptr(a));
        write_pattern(cubuf_buffer_ptr(g) + SIZE, 2 * SIZE, SIZE, 4);
        T_OK(cubuf_buffer_set_deallocation_stream(g, s2));
        if (kind == CLOSE_DEFERRED) {
            sc.target = a;
            sc.other = g;
        } else {
            T_OK(cubuf_buffer_close(a));
            cubuf_buffer_release(a);
            sc.target = g;
        }
    } else if (kind == CLOSE_TAIL) {
        cubuf_buffer_t *g = NULL;
        T_REQUIRE(cubuf_vmm_modify_allocation(g_res, a, 3 * SIZE, NULL, &g));
        write_pattern(cubuf_buffer_ptr(g) + SIZE, 2 * SIZE, SIZE, 4);
        T_OK(cubuf_buffer_set_deallocation_stream(g, s2));
        sc.target = g;
        sc.other = a;
    } else {
        cubuf_buffer_t *x = NULL, *m = NULL;
        T_REQUIRE(cubuf_vmm_modify_allocation(g_res, a, 2 * SIZE, NULL, &x));
        T_REQUIRE(cubuf_vmm_modify_allocation(g_res, a, 3 * SIZE, NULL, &m));
        T_CHECK(cubuf_buffer_ptr(m) != cubuf_buffer_ptr(a));
        T_OK(cubuf_buffer_close(x));
        cubuf_buffer_release(x);
        write_pattern(cubuf_buffer_ptr(m) + SIZE, 2 * SIZE, SIZE, 4);
        /* Closing a releases a mapping: it waits for m's stream too. */
        T_OK(cubuf_buffer_set_deallocation_stream(m, s2));
        sc.target = a;
        sc.other = m;
    }
    return sc;
}

static void fault_close(close_kind_t kind)
{
    static const char *const names[] = {"close of the only buffer", "close of a grown tail",
                                        "close of the old buffer of a moved grow",
                                        "close of the old buffer of a grow in place",
                                        "close of the grown buffer after that"};
    const char *what = names[kind];
    CUstream s1, s2;
    T_CU(cuStreamCreate, &s1, CU_STREAM_NON_BLOCKING);
    T_CU(cuStreamCreate, &s2, CU_STREAM_NON_BLOCKING);
    snap_t base = snap();
    unsigned errors = 0, absorbed = 0, n;
    for (n = 1; n < MAX_N; n++) {
        scene_t sc = make_scene(kind, s1, s2);
        size_t tsize = cubuf_buffer_size(sc.target);
        snap_t before = snap();
        arm(n);
        cubuf_status_t st = cubuf_buffer_close(sc.target);
        shot_t shot = disarm();
        if (st != CUBUF_SUCCESS) {
            errors++;
            T_CHECK(shot.fired);
            if (g_alloc) T_STATUS(st, CUBUF_ERROR_OUT_OF_MEMORY);
            T_CHECK(!cubuf_buffer_is_closed(sc.target) && cubuf_buffer_size(sc.target) == tsize);
            snap_t after = snap();
            T_CHECK(same(&before, &after, what, n, shot.call));
            T_CHECK(still_works(sc.target, 0, 4));
            T_OK(cubuf_buffer_close(sc.target));
        } else {
            if (shot.fired) absorbed++;
            T_CHECK(cubuf_buffer_is_closed(sc.target));
        }
        if (sc.other) {
            T_CHECK(still_works(sc.other, 0, 4));
            T_OK(cubuf_buffer_close(sc.other));
            cubuf_buffer_release(sc.other);
        }
        cubuf_buffer_release(sc.target);
        snap_t after = snap();
        T_CHECK(same(&base, &after, what, n, shot.call));
        if (!shot.fired || t_failures > 20) break;
    }
    T_CHECK(n < MAX_N && (errors > 0 || g_alloc)); /* a small close allocates nothing */
    report(what, n - 1, errors, absorbed);
    T_CU(cuStreamDestroy, s1);
    T_CU(cuStreamDestroy, s2);
}

/* ---- a last release that cannot close ---------------------------------------------- */

static int g_lost_warnings;

static void on_lost(cubuf_status_t st, const char *msg, void *user)
{
    (void)st;
    (void)msg;
    (void)user;
    g_lost_warnings++;
}

typedef enum lost_kind { LOST_ALONE, LOST_GROWN_IN_PLACE, LOST_GROWN_BY_MOVING } lost_kind_t;

/* The last release of a buffer whose close fails (its unmap, injected): the
 * warning handler is told and the memory stays mapped, data intact (vmm.h),
 * but nothing else is kept: the physical allocations only its space maps
 * are released (the driver frees them once the mappings go, here by the
 * test), cubuf's bookkeeping is freed (the ASan build's leak check), and the
 * lost memory stays counted. Then the test unmaps and frees what was lost by
 * hand: every driver object is back. In place, the buffer grown from closes
 * first (the lost space maps both parts); by moving, the grown buffer, which
 * maps b's allocation too, closes after the loss, and that allocation stays
 * counted. Its own resource: the loss stays in its statistics. */
static void lost_release(lost_kind_t kind)
{
    cubuf_resource_t *res = NULL;
    T_REQUIRE(cubuf_vmm_resource_create(0, NULL, &res));
    t_held_t h0 = t_held();
    cubuf_vmm_live_t l0;
    cubuf__vmm_live(&l0);
    cubuf_buffer_t *b = NULL, *g = NULL;
    T_REQUIRE(cubuf_resource_allocate(res, SIZE, 0, &b));
    write_pattern(cubuf_buffer_ptr(b), SIZE, 0, 7);
    if (kind == LOST_GROWN_IN_PLACE) {
        T_REQUIRE(cubuf_vmm_modify_allocation(res, b, 3 * SIZE, NULL, &g));
        T_OK(cubuf_buffer_close(b));
        cubuf_buffer_release(b);
        b = g; /* its space maps b's allocation and the grown part */
        g = NULL;
    } else if (kind == LOST_GROWN_BY_MOVING) {
        cubuf_buffer_t *x = NULL; /* maps the addresses after b: the grow moves */
        T_REQUIRE(cubuf_vmm_modify_allocation(res, b, 2 * SIZE, NULL, &x));
        T_REQUIRE(cubuf_vmm_modify_allocation(res, b, 3 * SIZE, NULL, &g));
        T_CHECK(cubuf_buffer_ptr(g) != cubuf_buffer_ptr(b));
        T_OK(cubuf_buffer_close(x)); /* unmaps x's part: b's space maps b's allocation only */
        cubuf_buffer_release(x);
    }
    /* b is the buffer lost; g (by moving) the one grown from it. */
    CUdeviceptr p = cubuf_buffer_ptr(b), start = 0;
    size_t n = cubuf_buffer_size(b), reserved = 0;
    T_CU(cuPointerGetAttribute, &start, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, p);
    T_CU(cuPointerGetAttribute, &reserved, CU_POINTER_ATTRIBUTE_RANGE_SIZE, p);
    cubuf_resource_stats_t s0 = CUBUF_RESOURCE_STATS_INIT;
    T_OK(cubuf_resource_stats(res, &s0));

    g_lost_warnings = 0;
    cubuf_set_warning_handler(on_lost, NULL);
    T_CHECK(cubuf_fault_fail_nth("cuMemUnmap", 1, CUDA_ERROR_UNKNOWN));
    cubuf_buffer_release(b);
    bool fired = cubuf_fault_fired();
    cubuf_fault_reset();
    cubuf_set_warning_handler(on_warning, NULL);
    T_CHECK(fired && g_lost_warnings == 1);

    cubuf_vmm_live_t l1;
    cubuf__vmm_live(&l1);
    long maps = kind == LOST_GROWN_IN_PLACE ? 2 : 1; /* the lost space's mappings */
    long g_maps = l1.mappings - l0.mappings - maps;  /* g's space's: b's allocation and more */
    T_CHECK(g ? g_maps >= 2 : g_maps == 0);
    /* Only g's space holds allocations now: those it maps. */
    T_CHECK(l1.allocations == l0.allocations + g_maps);
    T_CHECK(check_pattern(p, SIZE, 0, 7)); /* still mapped, intact */
    if (g) {
        T_CHECK(check_pattern(cubuf_buffer_ptr(g), SIZE, 0, 7));
        T_OK(cubuf_buffer_close(g));
        cubuf_buffer_release(g);
        cubuf__vmm_live(&l1);
        T_CHECK(l1.allocations == l0.allocations && l1.mappings == l0.mappings + maps);
    }
    /* The lost memory stays counted: b's allocation (and, in place, the grown part). */
    cubuf_resource_stats_t s1 = CUBUF_RESOURCE_STATS_INIT;
    T_OK(cubuf_resource_stats(res, &s1));
    T_CHECK(s1.current_bytes == (kind == LOST_GROWN_IN_PLACE ? 3 * SIZE : SIZE));
    T_CHECK(s1.current_bytes <= s0.current_bytes);

    /* What was lost, given back by hand: the mappings, then the reservation. */
    for (CUdeviceptr at = p; at < p + n;) {
        CUdeviceptr base = 0;
        size_t size = 0;
        T_CU(cuMemGetAddressRange, &base, &size, at);
        if (size == 0) break;
        T_CU(cuMemUnmap, base, size);
        at = base + size;
    }
    T_CU(cuMemAddressFree, start, reserved);
    T_HELD_BACK(h0, "a lost last release, given back by hand");
    cubuf_resource_release(res);
}

int main(void)
{
    cubuf_context_t *ctx = NULL;
    CUcontext cu = NULL;
    g_res = vmm_test_start(&ctx, &cu, NULL);
    g_host = malloc(3 * SIZE);
    if (!g_host) return 1;
    cubuf_set_warning_handler(on_warning, NULL);
    snap_t s0 = snap();

    for (int pass = 0; pass < 2; pass++) {
        g_alloc = pass == 1;
        fault_create();
        fault_allocate();
        fault_grow(GROW_HEADROOM);
        fault_grow(GROW_EXTEND);
        fault_grow(GROW_MOVE);
        fault_close(CLOSE_ONLY);
        fault_close(CLOSE_TAIL);
        fault_close(CLOSE_MOVED_OLD);
        fault_close(CLOSE_DEFERRED);
        fault_close(CLOSE_AFTER_DEFERRED);
    }

    snap_t s1 = snap();
    T_CHECK(same(&s0, &s1, "the whole test", 0, "-"));
    lost_release(LOST_ALONE);
    lost_release(LOST_GROWN_IN_PLACE);
    lost_release(LOST_GROWN_BY_MOVING);
    T_CHECK(g_warnings == 0);
    cubuf_set_warning_handler(NULL, NULL);
    cubuf_resource_release(g_res);
    free(g_host);
    cubuf_context_destroy(ctx);
    return t_finish("test_vmm_fault");
}
