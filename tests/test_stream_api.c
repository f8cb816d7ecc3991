/* Streams and events through cubuf (include/cubuf/stream.h), on the GPU:
 * creation with each flag and priority (clamped to the range), record /
 * wait / synchronize / query outcomes with a host function holding a stream
 * busy, destroy, argument checks, and an injected driver failure in every
 * call (CUBUF_ERROR_DRIVER with the CUresult, outputs untouched, the
 * caller's context restored). The argument checks without a driver are in
 * test_nodriver.c. */
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "test.h"

static CUcontext current(void)
{
    CUcontext c = NULL;
    T_CU(cuCtxGetCurrent, &c);
    return c;
}

/* ---- creation ---------------------------------------------------------------- */

static void test_create(cubuf_context_t *ctx)
{
    int least = 99, greatest = 99;
    T_OK(cubuf_stream_priority_range(ctx, &least, &greatest));
    T_CHECK(greatest <= least && least != 99 && greatest != 99);
    printf("stream priorities: least %d, greatest %d\n", least, greatest);
    const unsigned flags[] = {CU_STREAM_DEFAULT, CU_STREAM_NON_BLOCKING};
    /* Asked for, and what the driver clamps it to. */
    const int asked[] = {0, least, greatest, least + 7, greatest - 7};
    const int clamped[] = {0, least, greatest, least, greatest};
    for (size_t f = 0; f < 2; f++) {
        for (size_t p = 0; p < sizeof asked / sizeof asked[0]; p++) {
            CUstream s = NULL;
            T_OK(cubuf_stream_create(ctx, flags[f], asked[p], &s));
            T_CHECK(s != NULL && !(s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD));
            unsigned got_flags = 99;
            int got_priority = 99;
            T_CU(cuStreamGetFlags, s, &got_flags);
            T_CU(cuStreamGetPriority, s, &got_priority);
            if (got_flags != flags[f] || got_priority != clamped[p]) {
                fprintf(stderr, "flags %u priority %d: the stream has flags %u priority %d\n",
                        flags[f], asked[p], got_flags, got_priority);
                t_failures++;
            }
            bool idle = false;
            T_OK(cubuf_stream_query(s, &idle));
            T_CHECK(idle);
            T_OK(cubuf_stream_synchronize(s));
            T_OK(cubuf_stream_destroy(s));
        }
    }
    /* A stream made here works with the rest of cubuf (a blocking one: the
     * context's buffers are allocated on the legacy default stream). */
    CUstream s = NULL;
    T_REQUIRE(cubuf_stream_create(ctx, CU_STREAM_DEFAULT, 0, &s));
    cubuf_buffer_t *buf = NULL;
    T_OK(cubuf_context_new_buffer(ctx, 4096, &buf));
    T_OK(cubuf_buffer_fill_byte(buf, 0x5c, s));
    T_OK(cubuf_stream_synchronize(s));
    cubuf_buffer_release(buf);
    T_OK(cubuf_stream_destroy(s));

    CUevent e = NULL;
    const unsigned eflags[] = {CU_EVENT_DEFAULT, CU_EVENT_BLOCKING_SYNC, CU_EVENT_DISABLE_TIMING,
                               CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS};
    for (size_t i = 0; i < sizeof eflags / sizeof eflags[0]; i++) {
        e = NULL;
        T_OK(cubuf_event_create(ctx, eflags[i], &e));
        T_CHECK(e != NULL);
        bool done = false;
        T_OK(cubuf_event_query(e, &done)); /* never recorded: complete */
        T_CHECK(done);
        T_OK(cubuf_event_synchronize(e));
        T_OK(cubuf_event_destroy(e));
    }
    /* An interprocess event cannot have timing. */
    e = NULL;
    T_STATUS(cubuf_event_create(ctx, CU_EVENT_INTERPROCESS, &e), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(e == NULL);
    T_CHECK(current() == NULL); /* nothing left current */
}

/* ---- busy streams -------------------------------------------------------------- */

static atomic_int gate;   /* 0: the host function holds its stream */
static atomic_int marked; /* set by the host function after the wait */

static void CUDA_CB hold(void *arg)
{
    (void)arg;
    const struct timespec ms = {0, 1000000};
    while (!atomic_load(&gate)) nanosleep(&ms, NULL);
}

static void CUDA_CB mark(void *arg)
{
    (void)arg;
    atomic_store(&marked, 1);
}

static void test_busy(cubuf_context_t *ctx)
{
    CUstream s = NULL, s2 = NULL;
    CUevent e = NULL;
    T_REQUIRE(cubuf_stream_create(ctx, CU_STREAM_NON_BLOCKING, 0, &s));
    T_REQUIRE(cubuf_stream_create(ctx, CU_STREAM_NON_BLOCKING, 0, &s2));
    T_REQUIRE(cubuf_event_create(ctx, CU_EVENT_DISABLE_TIMING, &e));
    atomic_store(&gate, 0);
    atomic_store(&marked, 0);
    T_CU(cuLaunchHostFunc, s, hold, NULL);
    T_OK(cubuf_event_record(e, s));
    T_OK(cubuf_stream_wait_event(s2, e));
    T_CU(cuLaunchHostFunc, s2, mark, NULL);

    bool done = true;
    T_OK(cubuf_stream_query(s, &done));
    T_CHECK(!done);
    done = true;
    T_OK(cubuf_event_query(e, &done));
    T_CHECK(!done);
    done = true;
    T_OK(cubuf_stream_query(s2, &done)); /* waits for e */
    T_CHECK(!done);
    T_CHECK(atomic_load(&marked) == 0);

    atomic_store(&gate, 1);
    T_OK(cubuf_event_synchronize(e));
    T_OK(cubuf_event_query(e, &done));
    T_CHECK(done);
    T_OK(cubuf_stream_synchronize(s2));
    T_CHECK(atomic_load(&marked) == 1);
    T_OK(cubuf_stream_query(s2, &done));
    T_CHECK(done);
    T_OK(cubuf_stream_synchronize(s));
    T_OK(cubuf_stream_query(s, &done));
    T_CHECK(done);

    /* Recording again replaces the record; destroying a pending event is fine. */
    atomic_store(&gate, 0);
    T_CU(cuLaunchHostFunc, s, hold, NULL);
    T_OK(cubuf_event_record(e, s));
    T_OK(cubuf_event_query(e, &done));
    T_CHECK(!done);
    T_OK(cubuf_event_destroy(e));
    atomic_store(&gate, 1);
    T_OK(cubuf_stream_synchronize(s));
    T_OK(cubuf_stream_destroy(s));
    T_OK(cubuf_stream_destroy(s2));
}

/* ---- arguments ------------------------------------------------------------------- */

static void test_arguments(cubuf_context_t *ctx)
{
    CUstream s = (CUstream)(uintptr_t)0x77;
    CUevent e = (CUevent)(uintptr_t)0x77;
    int a = 0;
    bool b = false;
    T_STATUS(cubuf_stream_create(NULL, 0, 0, &s), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_stream_create(ctx, 0, 0, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_stream_create(ctx, 4, 0, &s), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(s == (CUstream)(uintptr_t)0x77);
    T_STATUS(cubuf_stream_priority_range(ctx, NULL, &a), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_stream_priority_range(ctx, &a, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_stream_query(NULL, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_stream_destroy(CU_STREAM_LEGACY), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_stream_destroy(CU_STREAM_PER_THREAD), CUBUF_ERROR_INVALID_ARGUMENT);
    T_OK(cubuf_stream_destroy(NULL));
    T_STATUS(cubuf_stream_wait_event(NULL, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_event_create(ctx, 0x100, &e), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_event_create(NULL, 0, &e), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_event_create(ctx, 0, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(e == (CUevent)(uintptr_t)0x77);
    T_STATUS(cubuf_event_record(NULL, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_event_synchronize(NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_event_query(NULL, &b), CUBUF_ERROR_INVALID_ARGUMENT);
    T_OK(cubuf_event_destroy(NULL));
    CUevent real = NULL;
    T_REQUIRE(cubuf_event_create(ctx, 0, &real));
    T_STATUS(cubuf_event_query(real, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_OK(cubuf_event_destroy(real));
}

/* ---- injected driver failures ----------------------------------------------------- */

/* Arms a failure of the first call of `entry`; the caller then makes the call. */
static void arm(const char *entry, CUresult r)
{
    T_CHECK(cubuf_fault_fail_nth(entry, 1, r));
}

/* After the call: the fault fired, the status and the detail tell. */
static void fired(const char *entry, cubuf_status_t got, cubuf_status_t want, CUresult r)
{
    if (!cubuf_fault_fired() || strcmp(cubuf_fault_fired_name(), entry) != 0 || got != want ||
        cubuf_last_cuda_result() != r || !strstr(cubuf_last_error(), entry)) {
        fprintf(stderr, "%s: status %s (want %s), fired %d (%s), detail \"%s\"\n", entry,
                cubuf_status_name(got), cubuf_status_name(want), cubuf_fault_fired(),
                cubuf_fault_fired_name(), cubuf_last_error());
        t_failures++;
    }
    cubuf_fault_reset();
    T_CHECK(current() == NULL);
}

static void test_faults(cubuf_context_t *ctx)
{
    const CUresult bad = CUDA_ERROR_INVALID_VALUE;
    CUstream s = NULL, s2 = NULL;
    CUevent e = NULL;
    int lo = 42, hi = 42;
    arm("cuCtxGetStreamPriorityRange", bad);
    fired("cuCtxGetStreamPriorityRange", cubuf_stream_priority_range(ctx, &lo, &hi),
          CUBUF_ERROR_DRIVER, bad);
    T_CHECK(lo == 42 && hi == 42);
    arm("cuStreamCreateWithPriority", CUDA_ERROR_OUT_OF_MEMORY);
    fired("cuStreamCreateWithPriority", cubuf_stream_create(ctx, 0, 0, &s),
          CUBUF_ERROR_OUT_OF_MEMORY, CUDA_ERROR_OUT_OF_MEMORY);
    T_CHECK(s == NULL);
    arm("cuEventCreate", bad);
    fired("cuEventCreate", cubuf_event_create(ctx, 0, &e), CUBUF_ERROR_DRIVER, bad);
    T_CHECK(e == NULL);
    /* Every driver call of a create fails in turn, then it succeeds. */
    for (unsigned n = 1;; n++) {
        cubuf_fault_fail_any_nth(n, bad);
        cubuf_status_t st = cubuf_stream_create(ctx, CU_STREAM_NON_BLOCKING, 0, &s);
        bool hit = cubuf_fault_fired();
        cubuf_fault_reset();
        T_CHECK(current() == NULL);
        if (!hit) {
            T_OK(st);
            break;
        }
        T_CHECK(st == CUBUF_ERROR_DRIVER && s == NULL);
        if (n > 20) {
            t_failures++;
            break;
        }
    }
    T_REQUIRE(cubuf_stream_create(ctx, CU_STREAM_NON_BLOCKING, 0, &s2));
    T_REQUIRE(cubuf_event_create(ctx, CU_EVENT_DISABLE_TIMING, &e));
    bool done = false;
    arm("cuStreamQuery", bad);
    fired("cuStreamQuery", cubuf_stream_query(s, &done), CUBUF_ERROR_DRIVER, bad);
    T_CHECK(!done); /* untouched */
    /* NOT_READY from the driver is an answer. */
    T_CHECK(cubuf_fault_fail_nth("cuStreamQuery", 1, CUDA_ERROR_NOT_READY));
    done = true;
    T_OK(cubuf_stream_query(s, &done));
    T_CHECK(!done && cubuf_fault_fired());
    cubuf_fault_reset();
    T_CHECK(cubuf_fault_fail_nth("cuEventQuery", 1, CUDA_ERROR_NOT_READY));
    done = true;
    T_OK(cubuf_event_query(e, &done));
    T_CHECK(!done && cubuf_fault_fired());
    cubuf_fault_reset();
    arm("cuEventQuery", bad);
    fired("cuEventQuery", cubuf_event_query(e, &done), CUBUF_ERROR_DRIVER, bad);
    arm("cuStreamSynchronize", bad);
    fired("cuStreamSynchronize", cubuf_stream_synchronize(s), CUBUF_ERROR_DRIVER, bad);
    arm("cuEventRecord", bad);
    fired("cuEventRecord", cubuf_event_record(e, s), CUBUF_ERROR_DRIVER, bad);
    arm("cuStreamWaitEvent", bad);
    fired("cuStreamWaitEvent", cubuf_stream_wait_event(s2, e), CUBUF_ERROR_DRIVER, bad);
    arm("cuEventSynchronize", bad);
    fired("cuEventSynchronize", cubuf_event_synchronize(e), CUBUF_ERROR_DRIVER, bad);
    /* A failed destroy destroyed nothing: the handles still work. */
    arm("cuEventDestroy", bad);
    fired("cuEventDestroy", cubuf_event_destroy(e), CUBUF_ERROR_DRIVER, bad);
    T_OK(cubuf_event_record(e, s));
    T_OK(cubuf_event_synchronize(e));
    arm("cuStreamDestroy", bad);
    fired("cuStreamDestroy", cubuf_stream_destroy(s), CUBUF_ERROR_DRIVER, bad);
    T_OK(cubuf_stream_synchronize(s));
    T_OK(cubuf_event_destroy(e));
    T_OK(cubuf_stream_destroy(s));
    T_OK(cubuf_stream_destroy(s2));
}

int main(void)
{
    t_require_gpu();
    cubuf_context_t *ctx = NULL;
    T_REQUIRE(cubuf_context_create(0, &ctx));
    T_CHECK(current() == NULL);
    test_arguments(ctx);
    test_create(ctx);
    test_busy(ctx);
    test_faults(ctx);
    cubuf_context_destroy(ctx);
    return t_finish("test_stream_api");
}
