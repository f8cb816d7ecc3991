/* Sharing stream-ordered pool memory (device and pinned pools, and a
 * context's own pool) with another
 * process started with fork+exec: data both ways from 2 MiB to 1 GiB and
 * through a slice at an odd offset, duplicate imports over one pool import,
 * import failures at every driver call, descriptors that lie, either side
 * exiting or being killed first, fds and memory back to their baselines;
 * a close that waits for its stream holding up no other pool's import or
 * close, and an import racing that close's destroy; duplicate imports
 * closed on different streams freeing only after the first close's stream
 * has run; wrap refusing an imported resource. */
#include <pthread.h>
#include <stdatomic.h>

#include "helper_ipc_suite.h"
#include "ipc.h"

static void run(peer_t *me, helper_t *h, peer_mech_t m)
{
    printf("%s\n", peer_mech_name(m));
    suite_arguments(me, m);
    suite_transfer(me, h, m, 2 * PEER_MIB, 0, 0, 0, false); /* warm-up */
    /* From here on the driver's once-per-process files are open: every fd
     * opened later must be closed again (the helper's socket aside). */
    static fd_snap_t warm;
    fds_take(&warm, 0, h->sock);
    suite_transfer(me, h, m, 2 * PEER_MIB, 0, 0, 0, true);
    suite_transfer(me, h, m, 64 * PEER_MIB + 4096, 5 * PEER_MIB + 12, 3 * PEER_MIB + 100, 0, true);
    suite_transfer(me, h, m, PEER_GIB, 0, 0, 0, true);
    suite_duplicate(me, h, m);
    suite_faults(me, h, m, 0);
    suite_malformed(me, h, m);
    suite_exporter_exits(me, h, m);
    suite_importer_exits(me, h, m, false);
    suite_importer_exits(me, h, m, true);
    suite_exporter_killed(me, h, m);
    char what[80];
    snprintf(what, sizeof what, "%s: all scenarios after the warm-up", peer_mech_name(m));
    T_CHECK(fds_back(what, &warm, h->sock));
}

/* ---- a close that waits for its stream holds up no other pool ---- */

/* The last close of a device pool import synchronizes its deallocation
 * stream before destroying the import. Here that stream is held by a host
 * function until g_release is set; a wrapper in front of the driver table
 * tells when the close has reached that synchronization. A watchdog sets
 * g_release after 10 s (and records that it had to), so a close that
 * stalls everything cannot hang the test. */
static CUstream g_held;
static atomic_bool g_held_syncing, g_release, g_watchdog_fired, g_watchdog_stop;
static __typeof__(cubuf__drv.cuStreamSynchronize) g_real_sync;

static CUresult CUDAAPI held_cuStreamSynchronize(CUstream s)
{
    if (s == g_held) atomic_store(&g_held_syncing, true);
    return g_real_sync(s);
}

static void pause_1ms(void)
{
    struct timespec ts = {0, 1000 * 1000};
    nanosleep(&ts, NULL);
}

static void CUDA_CB hold_stream(void *arg)
{
    (void)arg;
    while (!atomic_load(&g_release)) pause_1ms();
}

static void *watchdog(void *arg)
{
    (void)arg;
    for (int i = 0; i < 10000 && !atomic_load(&g_watchdog_stop); i++) pause_1ms();
    if (!atomic_load(&g_watchdog_stop)) {
        atomic_store(&g_watchdog_fired, true);
        atomic_store(&g_release, true);
    }
    return NULL;
}

typedef struct held_op {
    CUcontext ctx;
    const cubuf_ipc_descriptor_t *desc; /* import: this; close: NULL */
    CUstream stream;
    cubuf_buffer_t *buf;                /* close: this; import: the result */
    cubuf_status_t st;
    atomic_bool done;
} held_op_t;

static void *run_held_op(void *arg)
{
    held_op_t *op = arg;
    if (cubuf__drv.cuCtxSetCurrent(op->ctx) != CUDA_SUCCESS) op->st = CUBUF_ERROR_DRIVER;
    else if (op->desc) op->st = cubuf_buffer_from_ipc_descriptor(NULL, NULL, op->desc, op->stream, &op->buf);
    else op->st = cubuf_buffer_close(op->buf);
    atomic_store(&op->done, true);
    return NULL;
}

/* Thread A closes the last buffer of pool 1's import, whose stream is held:
 * it waits in the synchronization. Meanwhile this thread imports a buffer
 * of pool 2 (another exporter pool), reads it and closes it; that must all
 * finish while A is still held. Then thread C imports pool 1 again while its
 * import is being destroyed: it must wait for the destroy (never use the
 * dying import) and then import the pool afresh; its buffer reads pool 1's
 * bytes. Nothing is left imported at the end. */
static void close_while_held(peer_t *me, helper_t *h)
{
    static const char what[] = "device pool: a close waiting for its stream";
    printf("%s\n", what);
    const uint64_t seed1 = 0x4e1d, seed2 = 0x4e1e;
    cubuf_ipc_descriptor_t *d1 = NULL, *d2 = NULL;
    if (!H_OK(h, .op = OP_EXPORT, .mech = PEER_POOL_DEVICE, .size = 2 * PEER_MIB, .seed = seed1, .slot = 1).status)
        d1 = suite_recv(h);
    if (!H_OK(h, .op = OP_EXPORT, .mech = PEER_POOL_DEVICE, .size = 2 * PEER_MIB, .seed = seed2, .slot = 2).status)
        d2 = suite_recv(h);
    CUcontext cx = NULL;
    T_OK(cubuf_context_handle(me->ctx, &cx));
    CUstream sa = NULL, sb = NULL;
    T_CU(cuStreamCreate, &sa, CU_STREAM_NON_BLOCKING);
    T_CU(cuStreamCreate, &sb, CU_STREAM_NON_BLOCKING);
    const int pools0 = g_pw.n;
    const unsigned imports0 = g_pw.imports;
    cubuf_buffer_t *a = NULL;
    size_t bad = 0;
    if (d1) T_OK(cubuf_buffer_from_ipc_descriptor(NULL, NULL, d1, sa, &a));
    if (!a || !d2) goto out;
    T_OK(peer_verify(a, seed1, 0, &bad));
    T_CHECK(bad == SIZE_MAX);

    g_held = sa;
    atomic_store(&g_held_syncing, false);
    atomic_store(&g_release, false);
    atomic_store(&g_watchdog_fired, false);
    atomic_store(&g_watchdog_stop, false);
    g_real_sync = cubuf__drv.cuStreamSynchronize;
    cubuf__drv.cuStreamSynchronize = held_cuStreamSynchronize;
    T_CU(cuLaunchHostFunc, sa, hold_stream, NULL);
    pthread_t wd, ta, tc;
    T_CHECK(pthread_create(&wd, NULL, watchdog, NULL) == 0);
    held_op_t close_a = {.ctx = cx, .buf = a};
    atomic_init(&close_a.done, false);
    T_CHECK(pthread_create(&ta, NULL, run_held_op, &close_a) == 0);
    while (!atomic_load(&g_held_syncing) && !atomic_load(&g_watchdog_fired)) pause_1ms();
    T_CHECK(atomic_load(&g_held_syncing)); /* A reached the synchronization */

    /* pool 2, from this thread, while A waits */
    cubuf_buffer_t *b = NULL;
    T_OK(cubuf_buffer_from_ipc_descriptor(NULL, NULL, d2, sb, &b));
    if (b) {
        T_OK(peer_verify(b, seed2, 0, &bad));
        T_CHECK(bad == SIZE_MAX);
        T_OK(cubuf_buffer_close(b));
        cubuf_buffer_release(b);
    }
    bool b_first = !atomic_load(&close_a.done) && !atomic_load(&g_watchdog_fired);
    if (!b_first)
        fprintf(stderr, "  %s: the import and close of another pool waited for the held close\n", what);
    T_CHECK(b_first);

    /* pool 1 again, from thread C, while A's close is destroying its import */
    held_op_t import_c = {.ctx = cx, .desc = d1, .stream = sb};
    atomic_init(&import_c.done, false);
    T_CHECK(pthread_create(&tc, NULL, run_held_op, &import_c) == 0);
    while (cubuf__ipc_pool_imports_waiting() == 0 && !atomic_load(&import_c.done) &&
           !atomic_load(&g_watchdog_fired))
        pause_1ms();
    bool c_waits = cubuf__ipc_pool_imports_waiting() == 1 && !atomic_load(&import_c.done) &&
                   !atomic_load(&close_a.done);
    if (!c_waits)
        fprintf(stderr, "  %s: an import of the pool being destroyed did not wait for the destroy\n", what);
    T_CHECK(c_waits);

    atomic_store(&g_release, true);
    pthread_join(ta, NULL);
    T_OK(close_a.st);
    pthread_join(tc, NULL);
    T_OK(import_c.st);
    atomic_store(&g_watchdog_stop, true);
    pthread_join(wd, NULL);
    T_CHECK(!atomic_load(&g_watchdog_fired));
    cubuf__drv.cuStreamSynchronize = g_real_sync;
    if (import_c.buf) {
        T_OK(peer_verify(import_c.buf, seed1, 0, &bad));
        T_CHECK(bad == SIZE_MAX);
        T_OK(cubuf_buffer_close(import_c.buf));
        cubuf_buffer_release(import_c.buf);
    }
    cubuf__drv.cuCtxSynchronize();
    /* pool 1, pool 2, pool 1 afresh; all destroyed again */
    if (g_pw.imports != imports0 + 3 || g_pw.n != pools0) {
        fprintf(stderr, "  %s: %u pool imports made (expected 3), %d live (expected %d)\n", what,
                g_pw.imports - imports0, g_pw.n, pools0);
        t_failures++;
    }
out:
    cubuf_buffer_release(a);
    T_CU(cuStreamDestroy, sa);
    T_CU(cuStreamDestroy, sb);
    cubuf_ipc_descriptor_destroy(d1);
    cubuf_ipc_descriptor_destroy(d2);
    H_OK(h, .op = OP_CLEAR, .slot = 1);
    H_OK(h, .op = OP_CLEAR, .slot = 2);
}

/* ---- duplicate imports closed on two streams ---- */

/* Buffers a and b import one pointer (one descriptor, twice). Work on a's
 * stream sa, held by a host function, copies a into dst and then sets
 * g_sa_done. Thread A closes a on sa: not the last close, it waits for sa.
 * This thread then closes b on sb, and after sa is let go, a's close is the
 * last and frees. A wrapper in front of cuMemFreeAsync queues, on the
 * free's stream just before the free of that pointer, a host function
 * that notes whether sa's work has run: the free must come after it, since
 * that work reads the memory. */
static CUdeviceptr g_free_ptr;
static atomic_bool g_sa_done, g_free_seen, g_sa_done_at_free;
static __typeof__(cubuf__drv.cuMemFreeAsync) g_real_free_async;

static void CUDA_CB mark_sa_done(void *arg)
{
    (void)arg;
    atomic_store(&g_sa_done, true);
}

static void CUDA_CB note_sa_at_free(void *arg)
{
    (void)arg;
    atomic_store(&g_sa_done_at_free, atomic_load(&g_sa_done));
}

static CUresult CUDAAPI noting_cuMemFreeAsync(CUdeviceptr p, CUstream s)
{
    if (p == g_free_ptr && !atomic_load(&g_free_seen)) {
        CUresult r = cubuf__drv.cuLaunchHostFunc(s, note_sa_at_free, NULL);
        if (r != CUDA_SUCCESS) return r;
        atomic_store(&g_free_seen, true);
    }
    return g_real_free_async(p, s);
}

static void duplicate_closes_ordered(peer_t *me, helper_t *h)
{
    static const char what[] = "device pool: duplicate imports closed on two streams";
    printf("%s\n", what);
    const uint64_t seed = 0xd0b1;
    const size_t size = 2 * PEER_MIB;
    cubuf_ipc_descriptor_t *d = NULL;
    if (!H_OK(h, .op = OP_EXPORT, .mech = PEER_POOL_DEVICE, .size = size, .seed = seed, .slot = 1).status)
        d = suite_recv(h);
    if (!d) return;
    CUcontext cx = NULL;
    T_OK(cubuf_context_handle(me->ctx, &cx));
    CUstream sa = NULL, sb = NULL;
    T_CU(cuStreamCreate, &sa, CU_STREAM_NON_BLOCKING);
    T_CU(cuStreamCreate, &sb, CU_STREAM_NON_BLOCKING);
    cubuf_buffer_t *a = NULL, *b = NULL, *dst = NULL;
    T_OK(cubuf_buffer_from_ipc_descriptor(NULL, NULL, d, sa, &a));
    T_OK(cubuf_buffer_from_ipc_descriptor(NULL, NULL, d, sb, &b));
    T_OK(cubuf_context_new_buffer(me->ctx, size, &dst));
    if (!a || !b || !dst) goto out;
    T_CHECK(cubuf_buffer_ptr(a) == cubuf_buffer_ptr(b));

    g_held = sa;
    atomic_store(&g_held_syncing, false);
    atomic_store(&g_release, false);
    atomic_store(&g_watchdog_fired, false);
    atomic_store(&g_watchdog_stop, false);
    atomic_store(&g_sa_done, false);
    atomic_store(&g_free_seen, false);
    atomic_store(&g_sa_done_at_free, false);
    g_free_ptr = cubuf_buffer_ptr(a);
    g_real_free_async = cubuf__drv.cuMemFreeAsync;
    cubuf__drv.cuMemFreeAsync = noting_cuMemFreeAsync;
    g_real_sync = cubuf__drv.cuStreamSynchronize;
    cubuf__drv.cuStreamSynchronize = held_cuStreamSynchronize;
    pthread_t wd, ta;
    T_CHECK(pthread_create(&wd, NULL, watchdog, NULL) == 0);
    T_CU(cuLaunchHostFunc, sa, hold_stream, NULL);
    T_OK(cubuf_buffer_copy_from(dst, a, sa, NULL));
    T_CU(cuLaunchHostFunc, sa, mark_sa_done, NULL);
    held_op_t close_a = {.ctx = cx, .buf = a};
    atomic_init(&close_a.done, false);
    T_CHECK(pthread_create(&ta, NULL, run_held_op, &close_a) == 0);
    /* a's close, while b holds the pointer too, waits for sa or frees */
    while (!atomic_load(&g_held_syncing) && !atomic_load(&close_a.done) && !atomic_load(&g_watchdog_fired))
        pause_1ms();
    T_OK(cubuf_buffer_close(b));
    atomic_store(&g_release, true);
    pthread_join(ta, NULL);
    T_OK(close_a.st);
    atomic_store(&g_watchdog_stop, true);
    pthread_join(wd, NULL);
    cubuf__drv.cuMemFreeAsync = g_real_free_async;
    cubuf__drv.cuStreamSynchronize = g_real_sync;
    T_CHECK(!atomic_load(&g_watchdog_fired));
    T_CU(cuStreamSynchronize, sa);
    T_CU(cuStreamSynchronize, sb);
    T_CHECK(atomic_load(&g_free_seen));
    if (!atomic_load(&g_sa_done_at_free))
        fprintf(stderr, "  %s: the pointer was freed before the work queued on the first close's "
                        "stream ran\n", what);
    T_CHECK(atomic_load(&g_sa_done_at_free));
    size_t bad = 0;
    T_OK(peer_verify(dst, seed, 0, &bad)); /* sa's copy read the exporter's bytes */
    T_CHECK(bad == SIZE_MAX);
out:
    cubuf_buffer_release(a);
    cubuf_buffer_release(b);
    cubuf_buffer_release(dst);
    T_CU(cuStreamDestroy, sa);
    T_CU(cuStreamDestroy, sb);
    cubuf_ipc_descriptor_destroy(d);
    H_OK(h, .op = OP_CLEAR, .slot = 1);
}

/* The context's own pool (cubuf_context_new_buffer's) goes to another
 * process as a private pool does. Baselines (fds, driver objects held) are
 * not compared: the context's pool keeps freed memory for reuse. */
static void run_context(peer_t *me, helper_t *h)
{
    printf("context\n");
    suite_arguments(me, PEER_CONTEXT);
    suite_transfer(me, h, PEER_CONTEXT, 2 * PEER_MIB, 0, 0, 0, false);
    suite_transfer(me, h, PEER_CONTEXT, 64 * PEER_MIB + 4096, 5 * PEER_MIB + 12, 3 * PEER_MIB + 100, 0,
                   false);
}

int main(void)
{
    t_require_gpu();
    peer_t me;
    T_REQUIRE(peer_init(&me, -1));
    track_install();
    suite_require(PEER_POOL_DEVICE);
    suite_require(PEER_POOL_PINNED);
    suite_require(PEER_CONTEXT);
    static fd_snap_t start;
    fds_take(&start, 0, -1);
    helper_t h = helper_start();
    run(&me, &h, PEER_POOL_DEVICE);
    close_while_held(&me, &h);
    duplicate_closes_ordered(&me, &h);
    suite_wrap_refused(&h, PEER_POOL_DEVICE);
    run(&me, &h, PEER_POOL_PINNED);
    run_context(&me, &h);
    helper_stop(&h);
    cubuf_context_destroy(me.ctx);
    suite_end_fds("test_ipc_pool", &start);
    return t_finish("test_ipc_pool");
}
