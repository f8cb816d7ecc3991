/* Threads with their own streams sharing one memory resource. Each of four
 * threads creates a stream in a shared context and, a few times over,
 * allocates from one stream-ordered device resource on that stream, fills
 * the buffer, copies it to the host on the same stream (no synchronization
 * needed in between: one stream orders it all), checks the bytes and closes
 * the buffer on its stream. At the end the main thread reads the resource's
 * statistics: every allocation is counted and none is left.
 * Build: part of the cubuf build (example_threads). Run: ./build/examples/example_threads */
#define _POSIX_C_SOURCE 200809L
#include <cubuf.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#define THREADS 4
#define ROUNDS 8
#define MAX_SIZE ((size_t)ROUNDS << 16)

typedef struct job {
    int index;
    cubuf_context_t *ctx;
    cubuf_resource_t *res;
    int rc; /* 0: all rounds checked */
} job_t;

#define TRY(expr)                                                                              \
    do {                                                                                       \
        if ((st = (expr)) != CUBUF_SUCCESS) {                                                  \
            fprintf(stderr, "thread %d: %s: %s: %s\n", job->index, #expr, cubuf_status_name(st), \
                    cubuf_last_error()); /* the detail is per thread */                       \
            goto done;                                                                         \
        }                                                                                      \
    } while (0)

static void *work(void *arg)
{
    job_t *job = arg;
    cubuf_status_t st;
    CUstream stream = NULL;
    cubuf_buffer_t *buf = NULL;
    unsigned char *host = malloc(MAX_SIZE);
    job->rc = 1;
    if (!host) return NULL;
    TRY(cubuf_stream_create(job->ctx, CU_STREAM_NON_BLOCKING, 0, &stream));
    for (int round = 0; round < ROUNDS; round++) {
        size_t size = (size_t)(round + 1) << 16, n = 0;
        unsigned char value = (unsigned char)(0x10 * (job->index + 1) + round);
        TRY(cubuf_resource_allocate(job->res, size, stream, &buf));
        TRY(cubuf_buffer_fill_byte(buf, value, stream));
        TRY(cubuf_buffer_copy_to_host(buf, 0, -1, host, MAX_SIZE, stream, &n));
        if (n != size) {
            fprintf(stderr, "thread %d: %zu bytes copied, not %zu\n", job->index, n, size);
            goto done;
        }
        for (size_t i = 0; i < size; i++)
            if (host[i] != value) {
                fprintf(stderr, "thread %d, round %d: byte %zu is 0x%02x, not 0x%02x\n",
                        job->index, round, i, host[i], value);
                goto done;
            }
        TRY(cubuf_buffer_close_on(buf, stream)); /* the free is ordered on our stream */
        cubuf_buffer_release(buf);
        buf = NULL;
    }
    job->rc = 0;
done:
    cubuf_buffer_release(buf);
    if ((st = cubuf_stream_destroy(stream)) != CUBUF_SUCCESS) { /* queued frees still run */
        fprintf(stderr, "thread %d: cubuf_stream_destroy: %s\n", job->index, cubuf_last_error());
        job->rc = 1;
    }
    free(host);
    return NULL;
}

int main(void)
{
    int count = 0, rc = 1, started = 0, failed = 0;
    cubuf_status_t st = cubuf_device_count(&count);
    if (st != CUBUF_SUCCESS || count == 0) {
        printf("SKIP: needs 1 CUDA device(s): %s\n", /* the tests' words */
               st != CUBUF_SUCCESS ? cubuf_last_error() : "not enough devices");
        return 77;
    }
    cubuf_context_t *ctx = NULL;
    cubuf_resource_t *res = NULL;
    job_t jobs[THREADS];
    pthread_t tid[THREADS];
    cubuf_resource_stats_t stats = CUBUF_RESOURCE_STATS_INIT;
    if ((st = cubuf_context_create(0, &ctx)) != CUBUF_SUCCESS ||
        (st = cubuf_device_resource_create(0, NULL, &res)) != CUBUF_SUCCESS) {
        fprintf(stderr, "setup: %s: %s\n", cubuf_status_name(st), cubuf_last_error());
        goto out;
    }
    for (; started < THREADS; started++) {
        jobs[started] = (job_t){started, ctx, res, 1};
        if (pthread_create(&tid[started], NULL, work, &jobs[started]) != 0) {
            fprintf(stderr, "pthread_create failed\n");
            break;
        }
    }
    failed = started < THREADS;
    for (int i = 0; i < started; i++) {
        pthread_join(tid[i], NULL);
        failed |= jobs[i].rc;
    }
    if ((st = cubuf_resource_stats(res, &stats)) != CUBUF_SUCCESS) {
        fprintf(stderr, "cubuf_resource_stats: %s: %s\n", cubuf_status_name(st), cubuf_last_error());
        goto out;
    }
    printf("%llu allocations, peak %zu buffers and %zu bytes live at once, %zu bytes left\n",
           (unsigned long long)stats.total_allocations, stats.peak_count, stats.peak_bytes,
           stats.current_bytes);
    if (failed || stats.current_bytes != 0 || stats.current_count != 0 ||
        stats.total_allocations != (uint64_t)THREADS * ROUNDS || stats.peak_count < 1 ||
        stats.peak_count > THREADS || stats.peak_bytes > (size_t)THREADS * MAX_SIZE) {
        fprintf(stderr, "example_threads: a thread failed or the statistics are wrong\n");
        goto out;
    }
    rc = 0;
out:
    /* The frees the threads queued may still be running: wait for them. */
    if (ctx && (st = cubuf_context_synchronize(ctx)) != CUBUF_SUCCESS) {
        fprintf(stderr, "cubuf_context_synchronize: %s\n", cubuf_last_error());
        rc = 1;
    }
    cubuf_resource_release(res);
    cubuf_context_destroy(ctx);
    return rc;
}
