/* Eight threads at once, each allocating from one shared device pool resource
 * (directly and through copy_to without a destination) and from one shared
 * context (new_buffer, new_host_buffer), filling, copying, checking the
 * bytes and closing, a few hundred times. Afterwards every counter is back to
 * zero and the totals add up. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "internal.h"
#include "test.h"

#define THREADS 8
#define ITERS 300
#define MAX_SIZE (256 * 1024)

static cubuf_resource_t *g_pool;
static cubuf_context_t *g_ctx;
static CUcontext g_handle;
static pthread_barrier_t g_start;
static atomic_int g_fail;

#define W_CHECK(cond)                                                                   \
    do {                                                                                \
        if (!(cond)) {                                                                  \
            fprintf(stderr, "%s:%d: thread %d iteration %d: check failed: %s (%s)\n",    \
                    __FILE__, __LINE__, tid, it, #cond, cubuf_last_error());            \
            atomic_fetch_add(&g_fail, 1);                                               \
            goto next;                                                                  \
        }                                                                               \
    } while (0)

static void *worker(void *arg)
{
    int tid = (int)(intptr_t)arg, it = -1;
    unsigned char *host = malloc(MAX_SIZE);
    CUstream s = NULL;
    if (!host || cubuf__drv.cuCtxSetCurrent(g_handle) != CUDA_SUCCESS ||
        cubuf__drv.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) {
        atomic_fetch_add(&g_fail, 1);
        free(host);
        return NULL;
    }
    pthread_barrier_wait(&g_start);
    for (it = 0; it < ITERS; it++) {
        size_t size = 1 + ((unsigned)tid * 7919u + (unsigned)it * 104729u) % MAX_SIZE;
        int value = (tid * 37 + it) & 0xff;
        cubuf_buffer_t *a = NULL, *b = NULL, *c = NULL, *h = NULL;
        /* a: from the shared pool on this thread's stream, filled there. */
        W_CHECK(cubuf_resource_allocate(g_pool, size, s, &a) == CUBUF_SUCCESS);
        W_CHECK(cubuf_buffer_fill_byte(a, value, s) == CUBUF_SUCCESS);
        /* b: from the shared context, ordered on its legacy stream. */
        W_CHECK(cubuf_context_new_buffer(g_ctx, size, &b) == CUBUF_SUCCESS);
        W_CHECK(cubuf_buffer_size(b) == size);
        W_CHECK(cubuf__drv.cuStreamSynchronize(s) == CUDA_SUCCESS); /* a is filled */
        W_CHECK(cubuf_buffer_copy_from(b, a, CU_STREAM_LEGACY, NULL) == CUBUF_SUCCESS);
        memset(host, ~value & 0xff, size);
        /* Synchronous and on the legacy stream: after the copy into b. */
        W_CHECK(cubuf__drv.cuMemcpyDtoH(host, cubuf_buffer_ptr(b), size) == CUDA_SUCCESS);
        size_t bad = 0;
        for (size_t i = 0; i < size; i++) bad += host[i] != (unsigned char)value;
        W_CHECK(bad == 0);
        /* c: a copy of a into a new buffer from a's resource, on s; h: pinned
         * host memory of the context (allocated on its legacy stream, which
         * the synchronous copy above has passed), read by the host. */
        W_CHECK(cubuf_buffer_copy_to_new(a, s, NULL, &c) == CUBUF_SUCCESS);
        W_CHECK(cubuf_context_new_host_buffer(g_ctx, size, &h) == CUBUF_SUCCESS);
        W_CHECK(cubuf__drv.cuStreamSynchronize(CU_STREAM_LEGACY) == CUDA_SUCCESS);
        W_CHECK(cubuf_buffer_copy_from(h, c, s, NULL) == CUBUF_SUCCESS);
        W_CHECK(cubuf__drv.cuStreamSynchronize(s) == CUDA_SUCCESS);
        const unsigned char *hp = (const unsigned char *)(uintptr_t)cubuf_buffer_ptr(h);
        bad = 0;
        for (size_t i = 0; i < size; i++) bad += hp[i] != (unsigned char)value;
        W_CHECK(bad == 0);
        W_CHECK(cubuf_buffer_close(c) == CUBUF_SUCCESS);
        W_CHECK(cubuf_buffer_close(h) == CUBUF_SUCCESS);
        W_CHECK(cubuf_buffer_close(a) == CUBUF_SUCCESS);
        W_CHECK(cubuf_buffer_close(b) == CUBUF_SUCCESS);
        W_CHECK(cubuf_buffer_is_closed(a) && cubuf_buffer_is_closed(b));
    next:
        cubuf_buffer_release(a); /* closes what a failed check left open */
        cubuf_buffer_release(b);
        cubuf_buffer_release(c);
        cubuf_buffer_release(h);
    }
    cubuf__drv.cuStreamSynchronize(s);
    cubuf__drv.cuStreamDestroy(s);
    cubuf__drv.cuCtxSetCurrent(NULL);
    free(host);
    return NULL;
}

int main(void)
{
    t_require_gpu();
    T_REQUIRE(cubuf_context_create(0, &g_ctx));
    T_REQUIRE(cubuf_context_handle(g_ctx, &g_handle));
    T_REQUIRE(cubuf_device_resource_create(0, NULL, &g_pool));
    pthread_barrier_init(&g_start, NULL, THREADS);
    pthread_t th[THREADS];
    for (int i = 0; i < THREADS; i++)
        T_CHECK(pthread_create(&th[i], NULL, worker, (void *)(intptr_t)i) == 0);
    for (int i = 0; i < THREADS; i++) pthread_join(th[i], NULL);
    pthread_barrier_destroy(&g_start);
    t_failures += atomic_load(&g_fail);

    cubuf_resource_stats_t s = CUBUF_RESOURCE_STATS_INIT;
    T_OK(cubuf_resource_stats(g_pool, &s));
    T_CHECK(s.current_bytes == 0 && s.current_count == 0);
    T_CHECK(s.total_allocations == (uint64_t)2 * THREADS * ITERS); /* a and c */
    T_CHECK(s.peak_count >= 2 && s.peak_count <= 2 * THREADS);
    T_CHECK(s.peak_bytes > 0 && s.peak_bytes <= (size_t)2 * THREADS * MAX_SIZE);
    size_t bytes = 1;
    T_OK(cubuf_context_bytes_allocated(g_ctx, &bytes));
    T_CHECK(bytes == 0);
    /* The context's own pool resource counted the new_buffer allocations. */
    cubuf_resource_t *cpool = cubuf__inspect_context_pool(g_ctx, false);
    T_CHECK(cpool != NULL);
    if (cpool) {
        T_OK(cubuf_resource_stats(cpool, &s));
        T_CHECK(s.current_bytes == 0 && s.current_count == 0);
        T_CHECK(s.total_allocations == (uint64_t)THREADS * ITERS);
        T_CHECK(s.peak_count >= 1 && s.peak_count <= THREADS);
    }
    cubuf_resource_t *hpool = cubuf__inspect_context_pool(g_ctx, true);
    T_CHECK(hpool != NULL);
    if (hpool) {
        T_OK(cubuf_resource_stats(hpool, &s));
        T_CHECK(s.current_bytes == 0 && s.current_count == 0);
        T_CHECK(s.total_allocations == (uint64_t)THREADS * ITERS);
    }
    cubuf_resource_release(g_pool);
    cubuf_context_destroy(g_ctx);
    return t_finish("test_threads");
}
