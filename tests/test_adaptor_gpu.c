/* The adaptors over device memory: a stack over the device pool with bytes
 * read back, the cap on real allocations, the failure callback freeing a
 * buffer of a full private pool so the retry succeeds, requested against
 * allocated bytes over virtual memory, driver faults through a stack, and
 * a recorded log (several threads and streams) replayed by `cubuf replay`,
 * and the logs it refuses. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "alloc_fault_test.h"
#include "cubuf/ipc.h"

#define MiB ((size_t)1 << 20)

static CUstream g_s;

static cubuf_statistics_t stats_of(cubuf_resource_t *r)
{
    cubuf_statistics_t s = CUBUF_STATISTICS_INIT;
    T_OK(cubuf_statistics_get(r, &s));
    return s;
}

static bool all_bytes(const unsigned char *p, size_t n, unsigned char v)
{
    for (size_t i = 0; i < n; i++)
        if (p[i] != v) return false;
    return true;
}

/* Statistics over limiting over the device pool: buffers and raw pointers
 * hold what is written to them; every layer counts them. */
static void test_stack_bytes(cubuf_resource_t *pool)
{
    t_held_t held0 = t_held();
    cubuf_resource_t *lim = NULL, *st = NULL;
    T_REQUIRE(cubuf_limit_adaptor_create(pool, 8 * MiB, &lim));
    T_REQUIRE(cubuf_statistics_adaptor_create(lim, &st));
    cubuf_buffer_t *b = NULL;
    T_REQUIRE(cubuf_resource_allocate(st, 4 * MiB, g_s, &b));
    T_CHECK(cubuf_buffer_is_device_accessible(b) && cubuf_buffer_device_id(b) == 0 &&
            cubuf_buffer_resource(b) == st);
    T_OK(cubuf_buffer_fill_byte(b, 0x5c, g_s));
    unsigned char *host = malloc(4 * MiB);
    T_OK(cubuf_buffer_copy_to_host(b, 0, -1, host, 4 * MiB, g_s, NULL));
    T_CU(cuStreamSynchronize, g_s);
    T_CHECK(all_bytes(host, 4 * MiB, 0x5c));
    CUdeviceptr p = 0;
    T_REQUIRE(cubuf_resource_allocate_raw(st, 3 * MiB, g_s, &p));
    T_CU(cuMemsetD8Async, p, 0x3e, 3 * MiB, g_s);
    T_CU(cuStreamSynchronize, g_s);
    T_CU(cuMemcpyDtoH, host, p, 3 * MiB);
    T_CHECK(all_bytes(host, 3 * MiB, 0x3e));
    /* The cap: 7 MiB through it, 2 more would pass 8. */
    CUdeviceptr q = 0;
    T_STATUS(cubuf_resource_allocate_raw(st, 2 * MiB, g_s, &q), CUBUF_ERROR_OUT_OF_MEMORY);
    T_CHECK(strstr(cubuf_last_error(), "cap of 8388608 bytes") && strstr(cubuf_last_error(), "7340032 bytes allocated"));
    cubuf_statistics_t s = stats_of(st), l = stats_of(lim);
    T_CHECK(s.current_bytes == (int64_t)(7 * MiB) && s.current_count == 2 && s.total_count == 2);
    T_CHECK(l.current_bytes == s.current_bytes && l.total_count == 2); /* the refused one left no trace */
    /* A default stream means the pool's context's: allocate and free there. */
    CUdeviceptr d = 0;
    T_OK(cubuf_resource_deallocate_raw(st, p, 3 * MiB, g_s));
    T_REQUIRE(cubuf_resource_allocate_raw(st, 1 * MiB, CU_STREAM_PER_THREAD, &d));
    T_CU(cuMemsetD8Async, d, 1, MiB, CU_STREAM_PER_THREAD);
    T_OK(cubuf_resource_deallocate_raw(st, d, 1 * MiB, CU_STREAM_PER_THREAD));
    T_OK(cubuf_buffer_close(b));
    cubuf_buffer_release(b);
    s = stats_of(st);
    T_CHECK(s.current_bytes == 0 && s.total_count == 3 && s.peak_bytes == (int64_t)(7 * MiB));
    free(host);
    cubuf_resource_release(st);
    cubuf_resource_release(lim);
    T_CU(cuCtxSynchronize);
    T_HELD_BACK(held0, "the stack over the device pool");
}

/* The pool figures of cubuf_resource_stats: an adaptor that keeps no
 * statistics of its own reads its upstream pool's (they read 0 before);
 * one that keeps its own is no pool and reads none. */
static bool never_retry(void *user, size_t size, unsigned attempt)
{
    (void)user, (void)size, (void)attempt;
    return false;
}

static void test_pool_figures_through(cubuf_resource_t *pool)
{
    cubuf_resource_t *tr = NULL, *lg = NULL, *st = NULL;
    T_REQUIRE(cubuf_tracking_adaptor_create(pool, false, &tr));
    T_REQUIRE(cubuf_failure_adaptor_create(tr, never_retry, NULL, &lg));
    T_REQUIRE(cubuf_statistics_adaptor_create(pool, &st));
    cubuf_buffer_t *b = NULL;
    T_REQUIRE(cubuf_resource_allocate(lg, 2 * MiB, g_s, &b));
    cubuf_resource_stats_t ps = CUBUF_RESOURCE_STATS_INIT, ts = CUBUF_RESOURCE_STATS_INIT,
                           ls = CUBUF_RESOURCE_STATS_INIT, ss = CUBUF_RESOURCE_STATS_INIT;
    T_OK(cubuf_resource_stats(pool, &ps));
    T_OK(cubuf_resource_stats(tr, &ts));
    T_OK(cubuf_resource_stats(lg, &ls));
    T_OK(cubuf_resource_stats(st, &ss));
    T_CHECK(ps.pool_used_current >= 2 * MiB && ps.pool_reserved_current >= ps.pool_used_current);
    T_CHECK(ts.pool_used_current == ps.pool_used_current && ls.pool_used_current == ps.pool_used_current);
    T_CHECK(ts.pool_reserved_current == ps.pool_reserved_current && ls.pool_used_high == ps.pool_used_high);
    T_CHECK(ls.current_bytes == ps.current_bytes && ls.current_count == ps.current_count);
    T_CHECK(ss.pool_used_current == 0 && ss.pool_reserved_current == 0 && ss.current_count == 0);
    T_OK(cubuf_buffer_close(b));
    cubuf_buffer_release(b);
    cubuf_resource_release(st);
    cubuf_resource_release(lg);
    cubuf_resource_release(tr);
    T_CU(cuStreamSynchronize, g_s);
}

/* A private pool of 64 MiB holds one 40 MiB buffer; a second fails until
 * the callback closes the first, then the retry succeeds. */
typedef struct rescue {
    cubuf_buffer_t *victim;
    int calls;
} rescue_t;

static bool free_victim(void *user, size_t size, unsigned attempt)
{
    rescue_t *r = user;
    r->calls++;
    if (!r->victim || attempt > 1) return false;
    T_OK(cubuf_buffer_close(r->victim)); /* freed on g_s, where the retry allocates */
    cubuf_buffer_release(r->victim);
    r->victim = NULL;
    return size > 0;
}

static void test_failure_retry(void)
{
    t_held_t held0 = t_held();
    cubuf_device_resource_options_t o = CUBUF_DEVICE_RESOURCE_OPTIONS_INIT;
    o.private_pool = true;
    o.max_size = 64 * MiB;
    cubuf_resource_t *pool = NULL, *fa = NULL;
    T_REQUIRE(cubuf_device_resource_create(0, &o, &pool));
    rescue_t r = {NULL, 0};
    T_REQUIRE(cubuf_failure_adaptor_create(pool, free_victim, &r, &fa));
    T_REQUIRE(cubuf_resource_allocate(fa, 40 * MiB, g_s, &r.victim));
    cubuf_buffer_t *b = NULL;
    T_REQUIRE(cubuf_resource_allocate(fa, 40 * MiB, g_s, &b)); /* the driver said out of memory first */
    T_CHECK(r.calls == 1 && r.victim == NULL && b != NULL);
    T_OK(cubuf_buffer_fill_byte(b, 0x11, g_s));
    unsigned char check[4096];
    T_CU(cuStreamSynchronize, g_s);
    T_CU(cuMemcpyDtoH, check, cubuf_buffer_ptr(b) + 40 * MiB - sizeof check, sizeof check);
    T_CHECK(all_bytes(check, sizeof check, 0x11));
    /* With nothing left to free, the callback declines and the failure stays. */
    cubuf_buffer_t *c = NULL;
    T_STATUS(cubuf_resource_allocate(fa, 40 * MiB, g_s, &c), CUBUF_ERROR_OUT_OF_MEMORY);
    T_CHECK(r.calls == 2 && c == NULL && strstr(cubuf_last_error(), "declined"));
    cubuf_statistics_t s = stats_of(fa);
    T_CHECK(s.current_bytes == (int64_t)(40 * MiB) && s.total_count == 2);
    T_OK(cubuf_buffer_close(b));
    cubuf_buffer_release(b);
    cubuf_resource_release(fa);
    cubuf_resource_release(pool);
    T_CU(cuCtxSynchronize);
    T_HELD_BACK(held0, "the failure adaptor over a full private pool");
}

/* Over virtual memory: a raw allocation is a buffer kept by pointer;
 * requested bytes are what was asked, allocated bytes the granule. */
static void test_vmm_raw(void)
{
    cubuf_resource_t *vmm = NULL;
    T_REQUIRE(cubuf_vmm_resource_create(0, NULL, &vmm)); /* every GPU this suite runs on has VMM */
    t_held_t held0 = t_held();
    size_t gran = 0;
    T_REQUIRE(cubuf_vmm_granularity(vmm, &gran));
    cubuf_resource_t *st = NULL;
    T_REQUIRE(cubuf_statistics_adaptor_create(vmm, &st));
    CUdeviceptr p = 0;
    T_REQUIRE(cubuf_resource_allocate_raw(st, 1000, g_s, &p));
    T_CU(cuMemsetD8, p, 0x77, gran); /* the whole granule is mapped */
    unsigned char last = 0;
    T_CU(cuMemcpyDtoH, &last, p + gran - 1, 1);
    T_CHECK(last == 0x77);
    cubuf_statistics_t s = stats_of(st);
    T_CHECK(s.current_requested == 1000 && s.current_bytes == (int64_t)gran && s.current_count == 1);
    s = stats_of(vmm);
    T_CHECK(s.current_bytes == (int64_t)gran && s.current_requested == (int64_t)gran);
    /* Not its pointer or not its size: refused, the memory stays. */
    T_STATUS(cubuf_resource_deallocate_raw(st, p + 4096, 1000, g_s), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_resource_deallocate_raw(st, p, 999, g_s), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(strstr(cubuf_last_error(), "not a raw allocation") != NULL);
    T_CU(cuMemcpyDtoH, &last, p, 1);
    T_CHECK(last == 0x77);
    T_OK(cubuf_resource_deallocate_raw(st, p, 1000, g_s));
    s = stats_of(st);
    T_CHECK(s.current_bytes == 0 && s.current_requested == 0 && s.total_requested == 1000);
    T_CHECK(stats_of(vmm).current_bytes == 0);
    /* Each host allocation of the raw path failed in turn, on a fresh
     * resource (whose pointer map is still to be made and grown): a status,
     * no pointer, and the statistics as they were (totals and peaks too). */
    cubuf_resource_t *fresh = NULL;
    T_REQUIRE(cubuf_vmm_resource_create(0, NULL, &fresh));
    const cubuf_statistics_t before = stats_of(fresh);
    int rounds = 0;
    for (unsigned nth = 1; nth < 100; nth++, rounds++) {
        t_fail_alloc_nth(nth);
        CUdeviceptr q = 0;
        cubuf_status_t rs = cubuf_resource_allocate_raw(fresh, 3 * gran, g_s, &q);
        bool fired = cubuf_fault_fired();
        cubuf_fault_reset();
        if (rs == CUBUF_SUCCESS) {
            T_CHECK(!fired && q != 0);
            T_OK(cubuf_resource_deallocate_raw(fresh, q, 3 * gran, g_s));
            break;
        }
        T_STATUS(rs, CUBUF_ERROR_OUT_OF_MEMORY);
        cubuf_statistics_t now = stats_of(fresh);
        T_CHECK(q == 0 && now.current_bytes == 0 && now.total_count == before.total_count);
        T_CHECK(now.peak_bytes == before.peak_bytes && now.total_requested == before.total_requested);
    }
    T_CHECK(rounds >= 2);
    printf("raw virtual memory host allocation faults: %d rounds\n", rounds);
    cubuf_resource_release(fresh);
    cubuf_resource_release(st);
    T_HELD_BACK(held0, "raw virtual memory through an adaptor");
    cubuf_resource_release(vmm);
}

/* Driver failures under a stack: nothing is counted, nothing leaks; a
 * refused free leaves the buffer open and counted. */
static void test_faults(cubuf_resource_t *pool)
{
    t_held_t held0 = t_held();
    cubuf_resource_t *tr = NULL, *lim = NULL, *st = NULL;
    T_REQUIRE(cubuf_tracking_adaptor_create(pool, false, &tr));
    T_REQUIRE(cubuf_limit_adaptor_create(tr, 64 * MiB, &lim));
    T_REQUIRE(cubuf_statistics_adaptor_create(lim, &st));
    cubuf_resource_t *layers[2] = {st, lim}; /* the tracker's statistics are the pool's */
    cubuf_buffer_t *b = NULL;
    T_CHECK(cubuf_fault_fail_nth("cuMemAllocFromPoolAsync", 1, CUDA_ERROR_OUT_OF_MEMORY));
    T_STATUS(cubuf_resource_allocate(st, MiB, g_s, &b), CUBUF_ERROR_OUT_OF_MEMORY);
    T_CHECK(cubuf_fault_fired());
    cubuf_fault_reset();
    for (int i = 0; i < 2; i++) {
        cubuf_statistics_t s = stats_of(layers[i]);
        T_CHECK(s.current_bytes == 0 && s.total_count == 0);
    }
    size_t outstanding = 1;
    T_OK(cubuf_tracking_outstanding(tr, &outstanding, NULL));
    T_CHECK(outstanding == 0);
    T_REQUIRE(cubuf_resource_allocate(st, MiB, g_s, &b));
    T_CHECK(cubuf_fault_fail_nth("cuMemFreeAsync", 1, CUDA_ERROR_UNKNOWN));
    T_STATUS(cubuf_buffer_close(b), CUBUF_ERROR_DRIVER);
    cubuf_fault_reset();
    T_CHECK(!cubuf_buffer_is_closed(b));
    size_t n = 0;
    T_OK(cubuf_tracking_outstanding(tr, &n, NULL));
    T_CHECK(n == 1 && stats_of(st).current_bytes == (int64_t)MiB);
    T_OK(cubuf_buffer_close(b));
    cubuf_buffer_release(b);
    T_OK(cubuf_tracking_outstanding(tr, &n, NULL));
    T_CHECK(n == 0 && stats_of(st).current_bytes == 0 && stats_of(lim).current_bytes == 0);
    cubuf_resource_release(st);
    cubuf_resource_release(lim);
    cubuf_resource_release(tr);
    T_CU(cuCtxSynchronize);
    T_HELD_BACK(held0, "driver faults through a stack");
}

/* ---- a log, recorded and replayed ---- */

typedef struct worker {
    cubuf_resource_t *res;
    CUstream stream;
    CUcontext ctx;
    int seed;
    long allocs;
    cubuf_status_t st;
} worker_t;

static void *work(void *arg)
{
    worker_t *w = arg;
    if (cubuf__drv.cuCtxSetCurrent(w->ctx) != CUDA_SUCCESS) {
        w->st = CUBUF_ERROR_DRIVER;
        return NULL;
    }
    CUdeviceptr held[8] = {0};
    size_t sizes[8] = {0};
    for (int i = 0; i < 400 && w->st == CUBUF_SUCCESS; i++) {
        int k = (i * 7 + w->seed) % 8;
        if (held[k]) {
            w->st = cubuf_resource_deallocate_raw(w->res, held[k], sizes[k], w->stream);
            held[k] = 0;
        } else {
            sizes[k] = (size_t)256 << ((i + w->seed) % 12);
            w->st = cubuf_resource_allocate_raw(w->res, sizes[k], w->stream, &held[k]);
            w->allocs += w->st == CUBUF_SUCCESS;
        }
    }
    for (int k = 0; k < 8 && w->st == CUBUF_SUCCESS; k++)
        if (held[k]) w->st = cubuf_resource_deallocate_raw(w->res, held[k], sizes[k], w->stream);
    return NULL;
}

/* `cubuf replay LOG --resource KIND` on the device, its output echoed:
 * whether a line said `expect`, whether the per-operation rows came;
 * returns its status. `env`: assignments for the tool's environment. */
static int replay_env(const char *env, const char *path, const char *kind, const char *expect, bool *saw,
                      bool *rows)
{
    char cmd[2048], line[256];
    snprintf(cmd, sizeof cmd, "%s %s replay %s --resource %s --rounds 1 2>&1", env, CUBUF_TOOL, path, kind);
    FILE *pipe = popen(cmd, "r");
    while (pipe && fgets(line, sizeof line, pipe)) {
        fputs(line, stdout);
        *saw |= strstr(line, expect) != NULL;
        *rows |= strstr(line, "free     cubuf") != NULL && strstr(line, "ratio") != NULL;
    }
    return pipe ? pclose(pipe) : -1;
}

static int replay_on(const char *path, const char *kind, const char *expect, bool *saw, bool *rows)
{
    return replay_env("", path, kind, expect, saw, rows);
}

static int replay(const char *path, const char *expect, bool *saw, bool *rows)
{
    return replay_on(path, "device", expect, saw, rows);
}

static void test_log_replay(cubuf_resource_t *pool, CUcontext ctx)
{
    char path[] = "/tmp/cubuf_replay_XXXXXX";
    int fd = mkstemp(path);
    T_CHECK(fd >= 0);
    close(fd);
    cubuf_log_options_t o = CUBUF_LOG_OPTIONS_INIT;
    o.path = path;
    cubuf_resource_t *lg = NULL;
    T_REQUIRE(cubuf_log_adaptor_create(pool, &o, &lg));
    CUstream s2;
    T_CU(cuStreamCreate, &s2, CU_STREAM_NON_BLOCKING);
    worker_t w[4] = {{lg, g_s, ctx, 1, 0, CUBUF_SUCCESS},
                     {lg, s2, ctx, 2, 0, CUBUF_SUCCESS},
                     {lg, CU_STREAM_LEGACY, ctx, 3, 0, CUBUF_SUCCESS},
                     {lg, g_s, ctx, 4, 0, CUBUF_SUCCESS}};
    pthread_t th[4];
    for (int i = 0; i < 4; i++) T_CHECK(pthread_create(&th[i], NULL, work, &w[i]) == 0);
    long total = 0;
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        T_OK(w[i].st);
        total += w[i].allocs;
    }
    T_CHECK(total > 0);
    cubuf_resource_release(lg); /* flushes */
    T_CU(cuStreamSynchronize, s2);
    T_CU(cuStreamDestroy, s2);
    /* The log: a header, then one line per event, each thread's in order. */
    FILE *f = fopen(path, "r");
    T_CHECK(f != NULL);
    char line[256];
    long lines = 0, allocs = 0;
    while (f && fgets(line, sizeof line, f)) {
        if (lines++ == 0) continue;
        allocs += strstr(line, ",allocate,") != NULL;
    }
    if (f) fclose(f);
    T_CHECK(lines == 1 + 2 * (long)total && allocs == (long)total);
    /* Replayed by the tool, with the same driver (the environment carries it). */
    char expect[128];
    snprintf(expect, sizeof expect, "%ld events (%ld allocations) on 4 thread(s) and 3 stream(s)",
             2 * allocs, allocs);
    bool saw = false, rows = false;
    int rc = replay(path, expect, &saw, &rows);
    T_CHECK(rc == 0 && saw && rows);
    /* Over the caching resource: its blocks cached on the replay's streams
     * go back to the upstream before those streams are destroyed. */
    saw = rows = false;
    rc = replay_on(path, "caching", "cubuf warning", &saw, &rows);
    T_CHECK(rc == 0 && !saw && rows);
    unlink(path);
}

/* Logs the tool reads besides the adaptor's own: a version 1 log (no
 * order field: its time orders it; lines out of order in the file), and a
 * version it does not know (refused, naming it). */
static bool replay_says(const char *log, const char *expect, int *rc)
{
    char path[] = "/tmp/cubuf_replay_v_XXXXXX";
    int fd = mkstemp(path);
    FILE *f = fd >= 0 ? fdopen(fd, "w") : NULL;
    if (!f) return false;
    fputs(log, f);
    fclose(f);
    bool saw = false, rows = false;
    *rc = replay(path, expect, &saw, &rows);
    unlink(path);
    return saw;
}

static void test_replay_versions(void)
{
    int rc = -1;
    T_CHECK(replay_says("# cubuf log 1: time_ns,thread,stream,operation,pointer,size,status\n"
                        "300,7,(nil),free,0x2000,256,CUBUF_SUCCESS\n"
                        "100,7,(nil),allocate,0x2000,256,CUBUF_SUCCESS\n"
                        "200,7,(nil),allocate,0x3000,512,CUBUF_SUCCESS\n"
                        "400,7,(nil),free,0x3000,512,CUBUF_SUCCESS\n",
                        "4 events (2 allocations) on 1 thread(s) and 1 stream(s)", &rc));
    T_CHECK(rc == 0);
    T_CHECK(replay_says("# cubuf log 7: what,ever\n1,2,3\n", "log version 7", &rc));
    T_CHECK(rc != 0);
    /* A pointer handed out again with no free logged between (here by a
     * version 1 log's times, which order threads only roughly): the first
     * allocation is freed too, before the second. */
    T_CHECK(replay_says("# cubuf log 1: time_ns,thread,stream,operation,pointer,size,status\n"
                        "100,7,(nil),allocate,0x2000,256,CUBUF_SUCCESS\n"
                        "200,8,(nil),allocate,0x2000,256,CUBUF_SUCCESS\n"
                        "201,7,(nil),free,0x2000,256,CUBUF_SUCCESS\n",
                        "4 events (2 allocations) on 2 thread(s) and 1 stream(s), 0 skipped", &rc));
    T_CHECK(rc == 0);
    /* A log with no event that succeeded replays nothing (under UBSan too). */
    T_CHECK(replay_says("# cubuf log 2: order,time_ns,thread,stream,operation,pointer,size,status\n"
                        "0,5,7,(nil),allocate,0x0,256,CUBUF_ERROR_OUT_OF_MEMORY\n",
                        "0 events (0 allocations) on 0 thread(s) and 0 stream(s), 1 skipped", &rc));
    T_CHECK(rc == 0);
}

/* A free line's size is not its allocation's (a device pool takes any size
 * at a free, so such a log can be made) or is 0: the replay frees the
 * allocation at its own size, which a virtual memory resource checks (the
 * free failed) and a caching resource files the block by; the size-0 free
 * is a free (it was skipped, the memory kept live until reused). */
static void test_replay_free_size(void)
{
    static const char log[] =
        "# cubuf log 2: order,time_ns,thread,stream,operation,pointer,size,status\n"
        "0,5,7,(nil),allocate,0x2000,256,CUBUF_SUCCESS\n"
        "1,6,7,(nil),free,0x2000,4096,CUBUF_SUCCESS\n"
        "2,7,7,(nil),allocate,0x3000,512,CUBUF_SUCCESS\n"
        "3,8,7,(nil),free,0x3000,0,CUBUF_SUCCESS\n";
    char path[] = "/tmp/cubuf_replay_s_XXXXXX";
    int fd = mkstemp(path);
    FILE *f = fd >= 0 ? fdopen(fd, "w") : NULL;
    T_REQUIRE(f ? CUBUF_SUCCESS : CUBUF_ERROR_SYSTEM);
    fputs(log, f);
    fclose(f);
    static const char *const kinds[] = {"vmm", "caching", "device"};
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
        bool saw = false, rows = false;
        int rc = replay_on(path, kinds[i], "4 events (2 allocations) on 1 thread(s) and 1 stream(s), 0 skipped",
                           &saw, &rows);
        T_CHECK(rc == 0 && saw && rows);
    }
    unlink(path);
}

/* A free that fails during a replay: the tool's driver is a stand-in
 * (tests/shim_libcuda.c) over the real one that fails the third
 * cuMemFreeAsync: the first round replays the raw side (two frees), then
 * cubuf's side, whose first free fails. The round stops, and the tool frees
 * both allocations it left, the one whose free failed too (it used to
 * forget that one). */
static void test_replay_failed_free(void)
{
    static const char log[] =
        "# cubuf log 2: order,time_ns,thread,stream,operation,pointer,size,status\n"
        "0,5,7,(nil),allocate,0x2000,256,CUBUF_SUCCESS\n"
        "0,6,7,(nil),allocate,0x3000,512,CUBUF_SUCCESS\n"
        "1,7,7,(nil),free,0x2000,256,CUBUF_SUCCESS\n"
        "3,8,7,(nil),free,0x3000,512,CUBUF_SUCCESS\n";
    char path[] = "/tmp/cubuf_replay_f_XXXXXX";
    int fd = mkstemp(path);
    FILE *f = fd >= 0 ? fdopen(fd, "w") : NULL;
    T_REQUIRE(f ? CUBUF_SUCCESS : CUBUF_ERROR_SYSTEM);
    fputs(log, f);
    fclose(f);
    const char *target = getenv("CUBUF_LIBCUDA"); /* the test driver, or the real one */
    char env[1024];
    snprintf(env, sizeof env, "CUBUF_SHIM_TARGET='%s' CUBUF_LIBCUDA='%s' CUBUF_SHIM_FAIL_FREE=3",
             target && *target ? target : "libcuda.so.1", CUBUF_SHIM_LIBCUDA);
    bool failed_free = false, freed = false, rows = false;
    int rc = replay_env(env, path, "device", "free of allocation 0 failed", &failed_free, &rows);
    T_CHECK(rc != 0 && failed_free && !rows);
    rc = replay_env(env, path, "device", "freed 2 of the 2 allocation(s) the failed round left", &freed, &rows);
    T_CHECK(rc != 0 && freed);
    unlink(path);
}

/* Lines the tool refuses (exit 2, naming the line) rather than replaying
 * what it could make of them: a field after the status, text after it, a
 * negative size, one past SIZE_MAX, and a line longer than the tool reads
 * whose pieces would each read as a line, a minus sign anywhere (scanf
 * negates what follows it); and a log that cannot be read. */
static void test_replay_malformed(void)
{
    static const char head[] = "# cubuf log 2: order,time_ns,thread,stream,operation,pointer,size,status\n";
    static const char free_line[] = "1,5,7,(nil),free,0x2000,256,CUBUF_SUCCESS\n";
    static const char *const bad[] = {
        "0,5,7,(nil),allocate,0x2000,256,CUBUF_SUCCESS,CUBUF_SUCCESS\n",
        "0,5,7,(nil),allocate,0x2000,256,CUBUF_SUCCESS trailing text\n",
        "0,5,7,(nil),allocate,0x2000,-256,CUBUF_SUCCESS\n",
        "0,5,7,(nil),allocate,0x2000,99999999999999999999999,CUBUF_SUCCESS\n",
        "0,5,7,(nil),allocate,0x2000,-18446744073709551615,CUBUF_SUCCESS\n", /* read as 1 */
        "0,5,7,(nil),allocate,0x-2000,256,CUBUF_SUCCESS\n",
        "-1,5,7,(nil),allocate,0x2000,256,CUBUF_SUCCESS\n",
    };
    char log[2048];
    int rc = -1;
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        snprintf(log, sizeof log, "%s%s%s", head, bad[i], free_line);
        T_CHECK(replay_says(log, ":2: not a log line", &rc));
        T_CHECK(WIFEXITED(rc) && WEXITSTATUS(rc) == 2);
    }
    snprintf(log, sizeof log, "%s0,5,7,(nil),allocate,0x2000,256,CUBUF_SUCCESS%*s%s", head, 600, "",
             free_line);
    T_CHECK(replay_says(log, ":2: a line longer than", &rc));
    T_CHECK(WIFEXITED(rc) && WEXITSTATUS(rc) == 2);
    char dir[] = "/tmp/cubuf_replay_d_XXXXXX";
    T_CHECK(mkdtemp(dir) != NULL);
    bool saw = false, rows = false;
    rc = replay(dir, "the log cannot be read", &saw, &rows);
    T_CHECK(saw && !rows && WIFEXITED(rc) && WEXITSTATUS(rc) == 2);
    rmdir(dir);
}

/* An adaptor's buffers are not shared, even over a pool whose own are: the
 * detail says so and what to share instead; no fd is opened. */
static void test_not_shared(void)
{
    cubuf_device_resource_options_t o = CUBUF_DEVICE_RESOURCE_OPTIONS_INIT;
    o.private_pool = true;
    o.ipc_enabled = true;
    cubuf_resource_t *pool = NULL, *stats = NULL;
    T_REQUIRE(cubuf_device_resource_create(0, &o, &pool));
    T_REQUIRE(cubuf_statistics_adaptor_create(pool, &stats));
    cubuf_buffer_t *own = NULL, *through = NULL;
    T_REQUIRE(cubuf_resource_allocate(pool, 4096, g_s, &own));
    T_REQUIRE(cubuf_resource_allocate(stats, 4096, g_s, &through));
    cubuf_ipc_descriptor_t *d = NULL;
    T_OK(cubuf_buffer_ipc_descriptor(own, &d)); /* the pool's own: shared */
    cubuf_ipc_descriptor_destroy(d);
    d = NULL;
    t_held_t before = t_held();
    T_STATUS(cubuf_buffer_ipc_descriptor(through, &d), CUBUF_ERROR_NOT_SUPPORTED);
    T_CHECK(d == NULL && strstr(cubuf_last_error(), "statistics adaptor") &&
            strstr(cubuf_last_error(), "share a buffer allocated from the upstream resource itself"));
    T_HELD_BACK(before, "a refused export");
    T_OK(cubuf_buffer_close(through));
    T_OK(cubuf_buffer_close(own));
    cubuf_buffer_release(through);
    cubuf_buffer_release(own);
    cubuf_resource_release(stats);
    cubuf_resource_release(pool);
}

int main(void)
{
    t_require_gpu();
    t_held_count();
    t_held_t held0 = t_held();
    cubuf_context_t *ctx = NULL;
    CUcontext cu = NULL;
    T_REQUIRE(cubuf_context_create(0, &ctx));
    T_REQUIRE(cubuf_context_handle(ctx, &cu));
    T_CU(cuCtxSetCurrent, cu);
    T_CU(cuStreamCreate, &g_s, CU_STREAM_NON_BLOCKING);
    cubuf_resource_t *pool = NULL;
    T_REQUIRE(cubuf_device_resource_create(0, NULL, &pool));
    test_stack_bytes(pool);
    test_pool_figures_through(pool);
    test_not_shared();
    test_failure_retry();
    test_vmm_raw();
    test_faults(pool);
    test_log_replay(pool, cu);
    test_replay_versions();
    test_replay_malformed();
    test_replay_free_size();
    test_replay_failed_free();
    cubuf_resource_release(pool);
    T_CU(cuStreamDestroy, g_s);
    cubuf_context_destroy(ctx);
    T_HELD_BACK(held0, "everything");
    return t_finish("test_adaptor_gpu");
}
