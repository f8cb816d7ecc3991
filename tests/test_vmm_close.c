/* What a close of a virtual memory buffer waits for:
 *  - a close that unmaps nothing (the old buffer after a grow in place)
 *    returns while its deallocation stream is still held by a host function,
 *    and its stream may be destroyed while the work queued on it waits;
 *  - the close that then unmaps that memory does not return before the work
 *    queued on the first stream has run: a copy out of the memory, queued
 *    behind the held host function, reads back complete, and the context has
 *    no illegal-address fault (the copy never ran on unmapped memory). The
 *    same with the first stream in another context of the device;
 *  - the grow-then-close idiom of examples/grow.c on the per-thread default
 *    stream keeps every step's data;
 *  - cubuf_buffer_set_deallocation_stream stores the token under the range
 *    lock that closes of aliases read it under.
 * A watchdog opens the held host function after WATCHDOG_S seconds, so that
 * a close that waits when it must not fails the test instead of hanging it.
 * Afterwards nothing is left: statistics, mappings, streams and events. */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "test.h"
#include "vmm_test.h"
#include "vmm.h"

#define WATCHDOG_S 30 /* generous: compute-sanitizer slows every step */

static size_t g_gran;
static CUcontext g_ctx;

static bool live_equal(const cubuf_vmm_live_t *a, const cubuf_vmm_live_t *b)
{
    return a->reservations == b->reservations && a->mappings == b->mappings &&
           a->allocations == b->allocations && a->waiters == b->waiters;
}

static void sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* ---- a stream held by a host function -------------------------------------------------- */

typedef struct gate {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool open;        /* the host function may return */
    bool last_close;  /* the test is about to close the last alias */
    bool by_watchdog; /* opened because the test never got that far */
} gate_t;

static void CUDA_CB hold_stream(void *arg)
{
    gate_t *g = arg;
    pthread_mutex_lock(&g->mu);
    while (!g->open) pthread_cond_wait(&g->cv, &g->mu);
    pthread_mutex_unlock(&g->mu);
}

/* Opens the gate 100 ms after the test says it is closing the last alias
 * (so that the close is under way, waiting, when the held work runs), or
 * after WATCHDOG_S seconds if the test never says so. */
static void *opener(void *arg)
{
    gate_t *g = arg;
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += WATCHDOG_S;
    pthread_mutex_lock(&g->mu);
    while (!g->open && !g->last_close)
        if (pthread_cond_timedwait(&g->cv, &g->mu, &deadline) == ETIMEDOUT) break;
    if (!g->open && !g->last_close) {
        g->by_watchdog = true;
    } else if (!g->open) {
        pthread_mutex_unlock(&g->mu);
        sleep_ms(100);
        pthread_mutex_lock(&g->mu);
    }
    g->open = true;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
    return NULL;
}

/* Destroys a stream from a thread of its own, with its context current:
 * compute-sanitizer's cuStreamDestroy waits for the work a host function
 * holds, and the test goes on meanwhile. */
typedef struct destroyer {
    CUstream stream;
    CUcontext ctx;
    CUresult result;
} destroyer_t;

static void *destroy_stream(void *arg)
{
    destroyer_t *d = arg;
    CUcontext popped = NULL;
    d->result = cubuf__drv.cuCtxPushCurrent(d->ctx);
    if (d->result == CUDA_SUCCESS) {
        d->result = cubuf__drv.cuStreamDestroy(d->stream);
        (void)cubuf__drv.cuCtxPopCurrent(&popped);
    }
    return NULL;
}

static bool gate_is_open(gate_t *g)
{
    pthread_mutex_lock(&g->mu);
    bool open = g->open;
    pthread_mutex_unlock(&g->mu);
    return open;
}

/* a (on stream s) and its grow in place g (on an idle stream): closing a
 * unmaps nothing, closing g then unmaps everything. With `foreign`, s and
 * the copy's destination belong to another context of the device. */
static void test_deferred_close(cubuf_resource_t *res, bool foreign)
{
    const char *what = foreign ? "a stream of another context" : "a stream of the resource's context";
    cubuf_vmm_live_t live0;
    cubuf__vmm_live(&live0);
    size_t n = 2 * g_gran;
    CUcontext other = NULL, popped = NULL;
    CUstream s = NULL, idle = NULL;
    CUdeviceptr dst = 0;
    if (foreign && !cubuf__drv.cuCtxCreate) {
        fprintf(stderr, "%s: the driver has no cuCtxCreate\n", what);
        t_failures++;
        return;
    }
    if (foreign) {
        CUdevice dev;
        T_CU(cuDeviceGet, &dev, 0);
        T_CU(cuCtxCreate, &other, NULL, 0, dev); /* and makes it current */
    }
    T_CU(cuStreamCreate, &s, CU_STREAM_NON_BLOCKING);
    T_CU(cuMemAlloc, &dst, n);
    T_CU(cuMemsetD8, dst, 0, n);
    if (foreign) T_CU(cuCtxPopCurrent, &popped);
    T_CU(cuStreamCreate, &idle, CU_STREAM_NON_BLOCKING);

    cubuf_buffer_t *a = NULL, *g = NULL;
    T_REQUIRE(cubuf_resource_allocate(res, n, s, &a));
    write_pattern(cubuf_buffer_ptr(a), n, 0, 90);
    T_REQUIRE(cubuf_vmm_modify_allocation(res, a, 2 * n, NULL, &g));
    T_CHECK(cubuf_buffer_ptr(g) == cubuf_buffer_ptr(a)); /* in place: closing a unmaps nothing */
    T_OK(cubuf_buffer_set_deallocation_stream(g, idle));
    CUdeviceptr ap = cubuf_buffer_ptr(a);

    gate_t gate = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, false, false, false};
    pthread_t th;
    T_CHECK(pthread_create(&th, NULL, opener, &gate) == 0);
    if (foreign) T_CU(cuCtxPushCurrent, other); /* s's work is queued in its own context */
    T_CU(cuLaunchHostFunc, s, hold_stream, &gate);
    T_CU(cuMemcpyAsync, dst, ap, n, s); /* reads a's memory once the stream runs again */
    if (foreign) T_CU(cuCtxPopCurrent, &popped);

    T_OK(cubuf_buffer_close(a));
    bool held = !gate_is_open(&gate);
    T_CHECK(held); /* the close did not wait for its stream */
    if (!held) fprintf(stderr, "%s: closing the old alias waited for its stream\n", what);
    cubuf_buffer_release(a);

    /* Allowed once the buffer is closed, while the work queued on it waits. */
    destroyer_t d = {s, other, CUDA_ERROR_UNKNOWN};
    if (!foreign) T_CU(cuCtxGetCurrent, &d.ctx);
    pthread_t dth;
    T_CHECK(pthread_create(&dth, NULL, destroy_stream, &d) == 0);

    pthread_mutex_lock(&gate.mu);
    gate.last_close = true;
    pthread_cond_broadcast(&gate.cv);
    pthread_mutex_unlock(&gate.mu);
    T_CHECK(!gate_is_open(&gate)); /* the opener waits 100 ms: the close below starts held */
    T_OK(cubuf_buffer_close(g));
    /* The unmap waited for the held copy, which could only run once the gate opened. */
    T_CHECK(gate_is_open(&gate));
    pthread_join(dth, NULL);
    T_CHECK(d.result == CUDA_SUCCESS);
    if (foreign) T_CU(cuCtxPushCurrent, other);
    T_CHECK(check_pattern(dst, n, 0, 90));
    pthread_join(th, NULL);
    T_CHECK(!gate.by_watchdog);
    cubuf_buffer_release(g);
    /* An illegal access of the copy (memory unmapped under it) is sticky here. */
    T_CU(cuCtxSynchronize);
    T_CU(cuMemFree, dst);
    if (foreign) {
        T_CU(cuCtxPopCurrent, &popped);
        T_CU(cuCtxDestroy, other);
    }
    T_CU(cuCtxSynchronize);
    T_CU(cuStreamDestroy, idle);

    cubuf_resource_stats_t st = CUBUF_RESOURCE_STATS_INIT;
    T_OK(cubuf_resource_stats(res, &st));
    T_CHECK(st.current_bytes == 0 && st.current_count == 0);
    cubuf_vmm_live_t live1;
    cubuf__vmm_live(&live1);
    T_CHECK(live_equal(&live0, &live1));
    printf("deferred close on %s: ok\n", what);
}

/* ---- the idiom of examples/grow.c --------------------------------------------------------- */

/* Grow, queue a fill of the new part on the per-thread default stream,
 * close the old buffer (which unmaps nothing), eight times; then every
 * part holds its fill. */
static void test_grow_idiom(cubuf_resource_t *res)
{
    cubuf_vmm_live_t live0;
    cubuf__vmm_live(&live0);
    CUstream pt = CU_STREAM_PER_THREAD;
    cubuf_buffer_t *buf = NULL;
    T_REQUIRE(cubuf_resource_allocate(res, g_gran, pt, &buf));
    T_CU(cuMemsetD8Async, cubuf_buffer_ptr(buf), 1, g_gran, pt);
    int moved = 0;
    for (int k = 2; k <= 9; k++) {
        cubuf_buffer_t *grown = NULL;
        T_REQUIRE(cubuf_vmm_modify_allocation(res, buf, (size_t)k * g_gran, NULL, &grown));
        moved += cubuf_buffer_ptr(grown) != cubuf_buffer_ptr(buf);
        T_CU(cuMemsetD8Async, cubuf_buffer_ptr(grown) + (size_t)(k - 1) * g_gran,
             (unsigned char)k, g_gran, pt);
        T_OK(cubuf_buffer_close(buf));
        cubuf_buffer_release(buf);
        buf = grown;
    }
    T_CHECK(moved == 0);
    T_CU(cuStreamSynchronize, pt);
    unsigned char h[64];
    for (int k = 1; k <= 9; k++) {
        T_CU(cuMemcpyDtoH, h, cubuf_buffer_ptr(buf) + (size_t)k * g_gran - sizeof h, sizeof h);
        bool ok = true;
        for (size_t i = 0; i < sizeof h; i++) ok &= h[i] == (unsigned char)k;
        T_CHECK(ok);
    }
    T_OK(cubuf_buffer_close(buf));
    cubuf_buffer_release(buf);
    cubuf_vmm_live_t live1;
    cubuf__vmm_live(&live1);
    T_CHECK(live_equal(&live0, &live1));
}

/* ---- the token store ------------------------------------------------------------------------ */

typedef struct setter {
    cubuf_buffer_t *buf;
    CUstream stream;
    atomic_bool done;
    cubuf_status_t st;
} setter_t;

static void *set_stream(void *arg)
{
    setter_t *j = arg;
    j->st = cubuf_buffer_set_deallocation_stream(j->buf, j->stream);
    atomic_store(&j->done, true);
    return NULL;
}

/* A close of an alias reads the other aliases' tokens under the range lock:
 * with that lock held here, setting a token must wait for it. */
static void test_token_store_locked(cubuf_resource_t *res)
{
    CUstream s;
    T_CU(cuStreamCreate, &s, CU_STREAM_NON_BLOCKING);
    cubuf_buffer_t *a = NULL;
    T_REQUIRE(cubuf_resource_allocate(res, g_gran, CU_STREAM_LEGACY, &a));
    setter_t j = {a, s, false, CUBUF_ERROR_DRIVER};
    T_REQUIRE(cubuf__vmm_test_lock_range(a, true));
    pthread_t th;
    T_CHECK(pthread_create(&th, NULL, set_stream, &j) == 0);
    sleep_ms(100);
    bool waited = !atomic_load(&j.done);
    bool unchanged = t_dealloc_stream(a) == CU_STREAM_LEGACY;
    T_OK(cubuf__vmm_test_lock_range(a, false));
    pthread_join(th, NULL);
    T_CHECK(waited && unchanged);
    T_OK(j.st);
    T_CHECK(t_dealloc_stream(a) == s && t_dealloc_ctx(a) == NULL);
    T_OK(cubuf_buffer_close(a));
    cubuf_buffer_release(a);
    T_CU(cuStreamDestroy, s);
}

int main(void)
{
    cubuf_context_t *ctx = NULL;
    cubuf_resource_t *res = vmm_test_start(&ctx, &g_ctx, &g_gran);
    g_host = malloc(SCRATCH);
    if (!g_host) return 1;
    t_held_t held0 = t_held();
    cubuf_vmm_live_t live0;
    cubuf__vmm_live(&live0);

    test_deferred_close(res, false);
    test_deferred_close(res, true);
    test_grow_idiom(res);
    test_token_store_locked(res);

    cubuf_resource_stats_t s = CUBUF_RESOURCE_STATS_INIT;
    T_OK(cubuf_resource_stats(res, &s));
    T_CHECK(s.current_bytes == 0 && s.current_count == 0);
    cubuf_vmm_live_t live1;
    cubuf__vmm_live(&live1);
    T_CHECK(live1.reservations == live0.reservations && live1.mappings == live0.mappings &&
            live1.allocations == live0.allocations && live1.waiters == live0.waiters);
    cubuf_resource_release(res);
    T_HELD_BACK(held0, "test_vmm_close");
    free(g_host);
    cubuf_context_destroy(ctx);
    return t_finish("test_vmm_close");
}
