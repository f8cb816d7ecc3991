/* Aliases of one range used from several threads at once:
 *  - sixteen aliases (grown in place, moved, plain aliases) closed by eight
 *    threads at the same moment, while a seventeenth stays open and keeps
 *    its data;
 *  - eight threads growing one shared buffer (most grows must move, since
 *    another thread's grow maps the addresses after it), writing, reading
 *    and closing their buffers;
 *  - eight threads allocating raw virtual memory, writing it and freeing
 *    it, the driver handing freed addresses out again at once.
 * Afterwards nothing is left: statistics, live mappings, device memory. */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>

#include "test.h"
#include "vmm_test.h"
#include "vmm.h"

#define THREADS 8
#define ALIASES 16

static size_t g_gran;
static CUcontext g_ctx;
static cubuf_resource_t *g_res;
static pthread_barrier_t g_bar;

typedef struct job {
    int id;
    cubuf_buffer_t *bufs[ALIASES];
    int n;
    cubuf_buffer_t *root;
    int fails;
} job_t;

#define J_CHECK(j, cond)                                                                  \
    do {                                                                                  \
        if (!(cond)) {                                                                    \
            fprintf(stderr, "%s:%d: thread %d: check failed: %s (%s)\n", __FILE__, __LINE__, \
                    (j)->id, #cond, cubuf_last_error());                                  \
            (j)->fails++;                                                                 \
        }                                                                                 \
    } while (0)

static bool live_equal(const cubuf_vmm_live_t *a, const cubuf_vmm_live_t *b)
{
    return a->reservations == b->reservations && a->mappings == b->mappings &&
           a->allocations == b->allocations && a->waiters == b->waiters;
}

static void *closer(void *arg)
{
    job_t *j = arg;
    J_CHECK(j, cubuf__drv.cuCtxSetCurrent(g_ctx) == CUDA_SUCCESS);
    pthread_barrier_wait(&g_bar);
    for (int i = 0; i < j->n; i++) J_CHECK(j, cubuf_buffer_close(j->bufs[i]) == CUBUF_SUCCESS);
    return NULL;
}

static void test_concurrent_closes(void)
{
    cubuf_vmm_live_t live0;
    cubuf__vmm_live(&live0);
    for (int it = 0; it < 20; it++) {
        cubuf_buffer_t *v[ALIASES + 1];
        T_REQUIRE(cubuf_resource_allocate(g_res, 2 * g_gran, 0, &v[0]));
        uint32_t word = 0xC0DE0000u + (uint32_t)it;
        T_CU(cuMemsetD32Async, cubuf_buffer_ptr(v[0]), word, 2 * g_gran / 4, NULL);
        /* Each alias grows from an earlier one: in place when it ends its
         * space, moved otherwise; every fifth is a plain alias. */
        for (int i = 1; i <= ALIASES; i++) {
            cubuf_buffer_t *src = v[(i * 7 + it) % i];
            size_t want = i % 5 == 0 ? 1 : cubuf_buffer_size(src) + (size_t)(1 + i % 3) * g_gran;
            T_REQUIRE(cubuf_vmm_modify_allocation(g_res, src, want, NULL, &v[i]));
        }
        /* v[0] stays open; v[1..16] are closed by eight threads at once, in
         * an order that changes with the iteration. */
        job_t jobs[THREADS];
        memset(jobs, 0, sizeof jobs);
        for (int i = 0; i < ALIASES; i++) {
            int k = 1 + (i * 5 + it * 3) % ALIASES;
            job_t *j = &jobs[(i + it) % THREADS];
            j->bufs[j->n++] = v[k];
        }
        pthread_t th[THREADS];
        pthread_barrier_init(&g_bar, NULL, THREADS);
        for (int t = 0; t < THREADS; t++) {
            jobs[t].id = t;
            pthread_create(&th[t], NULL, closer, &jobs[t]);
        }
        for (int t = 0; t < THREADS; t++) {
            pthread_join(th[t], NULL);
            t_failures += jobs[t].fails;
        }
        pthread_barrier_destroy(&g_bar);
        for (int i = 1; i <= ALIASES; i++) {
            T_CHECK(cubuf_buffer_is_closed(v[i]));
            cubuf_buffer_release(v[i]);
        }
        /* v[0] lost nothing. */
        cubuf_resource_stats_t s = CUBUF_RESOURCE_STATS_INIT;
        T_OK(cubuf_resource_stats(g_res, &s));
        T_CHECK(s.current_bytes == 2 * g_gran && s.current_count == 1);
        uint32_t h[1024];
        T_CU(cuMemcpyDtoH, h, cubuf_buffer_ptr(v[0]) + 2 * g_gran - sizeof h, sizeof h);
        bool ok = true;
        for (size_t i = 0; i < 1024; i++) ok &= h[i] == word;
        T_CHECK(ok);
        T_OK(cubuf_buffer_close(v[0]));
        cubuf_buffer_release(v[0]);
        if (t_failures) break;
    }
    cubuf_vmm_live_t live1;
    cubuf__vmm_live(&live1);
    T_CHECK(live_equal(&live0, &live1));
}

static void *grower(void *arg)
{
    job_t *j = arg;
    J_CHECK(j, cubuf__drv.cuCtxSetCurrent(g_ctx) == CUDA_SUCCESS);
    pthread_barrier_wait(&g_bar);
    size_t rs = cubuf_buffer_size(j->root);
    for (int i = 0; i < 40 && !j->fails; i++) {
        cubuf_buffer_t *a = NULL, *b = NULL;
        size_t want = rs + (size_t)(1 + (i + j->id) % 4) * g_gran;
        cubuf_status_t st = cubuf_vmm_modify_allocation(g_res, j->root, want, NULL, &a);
        J_CHECK(j, st == CUBUF_SUCCESS);
        if (st != CUBUF_SUCCESS) break;
        /* The root's data through the alias; then a part of our own. */
        uint32_t h[64];
        J_CHECK(j, cubuf__drv.cuMemcpyDtoH(h, cubuf_buffer_ptr(a), sizeof h) == CUDA_SUCCESS);
        J_CHECK(j, h[0] == 0xFEEDu && h[63] == 0xFEEDu);
        uint32_t mark = 0x10000u * (uint32_t)(j->id + 1) + (uint32_t)i;
        for (int k = 0; k < 64; k++) h[k] = mark;
        J_CHECK(j, cubuf__drv.cuMemcpyHtoD(cubuf_buffer_ptr(a) + rs, h, sizeof h) == CUDA_SUCCESS);
        /* Grow the alias again (in place: it ends its space), then close
         * in either order. */
        st = cubuf_vmm_modify_allocation(g_res, a, want + g_gran, NULL, &b);
        J_CHECK(j, st == CUBUF_SUCCESS);
        if (st == CUBUF_SUCCESS) {
            J_CHECK(j, cubuf__drv.cuMemcpyDtoH(h, cubuf_buffer_ptr(b) + rs, sizeof h) == CUDA_SUCCESS);
            J_CHECK(j, h[0] == mark && h[63] == mark);
        }
        if (i % 2) {
            J_CHECK(j, cubuf_buffer_close(a) == CUBUF_SUCCESS);
            if (b) J_CHECK(j, cubuf_buffer_close(b) == CUBUF_SUCCESS);
        } else {
            if (b) J_CHECK(j, cubuf_buffer_close(b) == CUBUF_SUCCESS);
            J_CHECK(j, cubuf_buffer_close(a) == CUBUF_SUCCESS);
        }
        cubuf_buffer_release(a);
        cubuf_buffer_release(b);
    }
    return NULL;
}

static void test_concurrent_grows(void)
{
    cubuf_vmm_live_t live0;
    cubuf__vmm_live(&live0);
    cubuf_buffer_t *root = NULL;
    T_REQUIRE(cubuf_resource_allocate(g_res, 4 * g_gran, 0, &root));
    T_CU(cuMemsetD32Async, cubuf_buffer_ptr(root), 0xFEEDu, 4 * g_gran / 4, NULL);
    T_CU(cuCtxSynchronize);
    job_t jobs[THREADS];
    memset(jobs, 0, sizeof jobs);
    pthread_t th[THREADS];
    pthread_barrier_init(&g_bar, NULL, THREADS);
    for (int t = 0; t < THREADS; t++) {
        jobs[t].id = t;
        jobs[t].root = root;
        pthread_create(&th[t], NULL, grower, &jobs[t]);
    }
    for (int t = 0; t < THREADS; t++) {
        pthread_join(th[t], NULL);
        t_failures += jobs[t].fails;
    }
    pthread_barrier_destroy(&g_bar);
    cubuf_resource_stats_t s = CUBUF_RESOURCE_STATS_INIT;
    T_OK(cubuf_resource_stats(g_res, &s));
    T_CHECK(s.current_bytes == 4 * g_gran && s.current_count == 1);
    uint32_t h[256];
    T_CU(cuMemcpyDtoH, h, cubuf_buffer_ptr(root) + 4 * g_gran - sizeof h, sizeof h);
    T_CHECK(h[0] == 0xFEEDu && h[255] == 0xFEEDu);
    T_OK(cubuf_buffer_close(root));
    cubuf_buffer_release(root);
    T_OK(cubuf_resource_stats(g_res, &s));
    T_CHECK(s.current_bytes == 0 && s.current_count == 0);
    cubuf_vmm_live_t live1;
    cubuf__vmm_live(&live1);
    T_CHECK(live_equal(&live0, &live1));
}

/* ---- raw allocations from eight threads ---- */

#define RAW_ITERS 200

typedef struct raw_job {
    int id;
    int fails;
    unsigned long reused; /* allocations at an address this thread had freed just before */
} raw_job_t;

/* Each thread allocates raw, writes its tag, reads it back and frees, over
 * and over: the driver hands freed addresses out again at once, so a free
 * and another thread's allocation of the same address meet in the raw map. */
static void *raw_worker(void *arg)
{
    raw_job_t *j = arg;
    if (cubuf__drv.cuCtxSetCurrent(g_ctx) != CUDA_SUCCESS) {
        j->fails++;
        return NULL;
    }
    pthread_barrier_wait(&g_bar);
    CUdeviceptr last = 0;
    for (int i = 0; i < RAW_ITERS; i++) {
        CUdeviceptr p = 0;
        if (cubuf_resource_allocate_raw(g_res, g_gran, CU_STREAM_PER_THREAD, &p) != CUBUF_SUCCESS) {
            fprintf(stderr, "raw allocate %d of thread %d: %s\n", i, j->id, cubuf_last_error());
            j->fails++;
            continue;
        }
        j->reused += p == last;
        const uint32_t tag = 0xA000u + (uint32_t)(j->id * RAW_ITERS + i);
        uint32_t back = 0;
        if (cubuf__drv.cuMemsetD32Async(p, tag, 64, CU_STREAM_PER_THREAD) != CUDA_SUCCESS ||
            cubuf__drv.cuMemcpyDtoH(&back, p + 252, 4) != CUDA_SUCCESS || back != tag)
            j->fails++;
        if (cubuf_resource_deallocate_raw(g_res, p, g_gran, CU_STREAM_PER_THREAD) != CUBUF_SUCCESS) {
            fprintf(stderr, "raw free %d of thread %d: %s\n", i, j->id, cubuf_last_error());
            j->fails++;
        }
        last = p;
    }
    return NULL;
}

static void test_concurrent_raw(void)
{
    cubuf_vmm_live_t live0;
    cubuf__vmm_live(&live0);
    raw_job_t jobs[THREADS];
    memset(jobs, 0, sizeof jobs);
    pthread_t th[THREADS];
    pthread_barrier_init(&g_bar, NULL, THREADS);
    for (int t = 0; t < THREADS; t++) {
        jobs[t].id = t;
        pthread_create(&th[t], NULL, raw_worker, &jobs[t]);
    }
    unsigned long reused = 0;
    for (int t = 0; t < THREADS; t++) {
        pthread_join(th[t], NULL);
        t_failures += jobs[t].fails;
        reused += jobs[t].reused;
    }
    pthread_barrier_destroy(&g_bar);
    printf("raw: %d allocations, %lu at the address their thread had just freed\n",
           THREADS * RAW_ITERS, reused);
    cubuf_resource_stats_t s = CUBUF_RESOURCE_STATS_INIT;
    T_OK(cubuf_resource_stats(g_res, &s));
    T_CHECK(s.current_bytes == 0 && s.current_count == 0);
    cubuf_vmm_live_t live1;
    cubuf__vmm_live(&live1);
    T_CHECK(live_equal(&live0, &live1));
}

int main(void)
{
    cubuf_context_t *ctx = NULL;
    g_res = vmm_test_start(&ctx, &g_ctx, &g_gran);
    t_held_t held0 = t_held();

    test_concurrent_closes();
    test_concurrent_grows();
    test_concurrent_raw();

    cubuf_resource_release(g_res);
    T_HELD_BACK(held0, "test_vmm_threads");
    cubuf_context_destroy(ctx);
    return t_finish("test_vmm_threads");
}
