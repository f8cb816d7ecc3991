/* The close of a device-pool import racing an import of the same pointer
 * (ipc.c, imported_pool_deallocate; helper-6's reproduction). A close that
 * found itself the pointer's last holder used to let go of the import lock
 * and take it again to free; an import of the same pointer in between made
 * it drop its reference instead, without the synchronization of its stream
 * that ipc.h promises a close which leaves the pointer to another buffer
 * (the other buffer's free could then run before the closed one's work).
 *
 * The interleaving is forced: pthread_mutex_lock/unlock are interposed (the
 * static library's calls bind to these), a first import held inside
 * cuMemPoolImportPointer identifies the import lock (the one lock it
 * holds), and the closing thread pauses right after its first unlock of it
 * while another thread imports the pointer. Exporter and importer are this
 * process. Built without sanitizers only (their runtimes intercept the same
 * functions). */
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>

#include "test.h"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define T_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define T_SANITIZED 1
#endif
#endif

#ifdef T_SANITIZED
int main(void)
{
    puts("SKIP: test_ipc_pool_race interposes pthread_mutex_lock, which a sanitizer runtime intercepts");
    return 77;
}
#else

static pthread_mutex_t *g_held[16], *g_import_lock;
static int g_nheld;
static pthread_t g_first, g_closer; /* set by the threads themselves (run) */
static atomic_bool g_first_set, g_closer_set, g_pause_armed, g_paused, g_hold_import, g_in_import;
static int (*real_lock)(pthread_mutex_t *), (*real_unlock)(pthread_mutex_t *);

static bool is(atomic_bool *set, pthread_t t) { return atomic_load(set) && pthread_equal(pthread_self(), t); }

int pthread_mutex_lock(pthread_mutex_t *m)
{
    if (!real_lock) real_lock = (int (*)(pthread_mutex_t *))dlsym(RTLD_NEXT, "pthread_mutex_lock");
    const int r = real_lock(m);
    if (is(&g_first_set, g_first) && g_nheld < 16) g_held[g_nheld++] = m;
    return r;
}

int pthread_mutex_unlock(pthread_mutex_t *m)
{
    if (!real_unlock) real_unlock = (int (*)(pthread_mutex_t *))dlsym(RTLD_NEXT, "pthread_mutex_unlock");
    if (is(&g_first_set, g_first))
        for (int i = g_nheld - 1; i >= 0; i--)
            if (g_held[i] == m) {
                g_held[i] = g_held[--g_nheld];
                break;
            }
    const int r = real_unlock(m);
    if (m == g_import_lock && is(&g_closer_set, g_closer) && atomic_exchange(&g_pause_armed, false)) {
        atomic_store(&g_paused, true);
        usleep(100 * 1000); /* the closer, between its looks at the pointer's references */
    }
    return r;
}

static CUstream g_closer_stream;
static CUdeviceptr g_ptr;
static atomic_int g_syncs, g_frees;
static __typeof__(cubuf__drv.cuStreamSynchronize) real_sync;
static __typeof__(cubuf__drv.cuMemFreeAsync) real_free;
static __typeof__(cubuf__drv.cuMemPoolImportPointer) real_import;

static CUresult CUDAAPI counted_sync(CUstream s)
{
    if (s == g_closer_stream) atomic_fetch_add(&g_syncs, 1);
    return real_sync(s);
}

static CUresult CUDAAPI counted_free(CUdeviceptr p, CUstream s)
{
    if (p == g_ptr) atomic_fetch_add(&g_frees, 1);
    return real_free(p, s);
}

static CUresult CUDAAPI held_import(CUdeviceptr *out, CUmemoryPool pool, CUmemPoolPtrExportData *d)
{
    if (is(&g_first_set, g_first)) {
        g_import_lock = g_nheld == 1 ? g_held[0] : NULL; /* the import lock, its only one */
        atomic_store(&g_in_import, true);
        while (atomic_load(&g_hold_import)) usleep(100);
    }
    return real_import(out, pool, d);
}

typedef struct op {
    CUcontext cx;
    cubuf_buffer_t *close;            /* close this, */
    const cubuf_ipc_descriptor_t *d;  /* or import this */
    CUstream s;
    pthread_t *self;                  /* set to the thread before it starts (then *self_set) */
    atomic_bool *self_set;
    cubuf_buffer_t *out;
    cubuf_status_t st;
} op_t;

static void *run(void *arg)
{
    op_t *o = arg;
    if (o->self) {
        *o->self = pthread_self();
        atomic_store(o->self_set, true);
    }
    o->st = cubuf__drv.cuCtxSetCurrent(o->cx) != CUDA_SUCCESS ? CUBUF_ERROR_DRIVER
            : o->close ? cubuf_buffer_close(o->close)
                       : cubuf_buffer_from_ipc_descriptor(NULL, NULL, o->d, o->s, &o->out);
    return NULL;
}

/* Waits up to 10 s for *flag; false (a failed check, no hang) otherwise. */
static bool wait_for(atomic_bool *flag)
{
    for (int i = 0; i < 10000 && !atomic_load(flag); i++) usleep(1000);
    return atomic_load(flag);
}

static cubuf_ipc_descriptor_t *exported(cubuf_resource_t *res, CUstream s, cubuf_buffer_t **buf)
{
    cubuf_ipc_descriptor_t *d = NULL;
    T_REQUIRE(cubuf_resource_allocate(res, 2 << 20, s, buf));
    T_CU(cuStreamSynchronize, s);
    T_REQUIRE(cubuf_buffer_ipc_descriptor(*buf, &d));
    return d;
}

int main(void)
{
    t_require_gpu();
    cubuf_context_t *ctx = NULL;
    T_REQUIRE(cubuf_context_create(0, &ctx));
    CUcontext cx = t_cu(ctx);
    T_CU(cuCtxSetCurrent, cx);
    cubuf_device_resource_options_t o = CUBUF_DEVICE_RESOURCE_OPTIONS_INIT;
    o.private_pool = true;
    o.ipc_enabled = true;
    cubuf_resource_t *res = NULL;
    T_REQUIRE(cubuf_device_resource_create(0, &o, &res));
    CUstream s = NULL;
    T_CU(cuStreamCreate, &g_closer_stream, CU_STREAM_NON_BLOCKING);
    T_CU(cuStreamCreate, &s, CU_STREAM_NON_BLOCKING);
    cubuf_buffer_t *e1 = NULL, *e2 = NULL, *e3 = NULL, *keep = NULL, *a = NULL;
    cubuf_ipc_descriptor_t *d1 = exported(res, s, &e1), *d2 = exported(res, s, &e2), *d3 = exported(res, s, &e3);
    const cubuf_status_t first = cubuf_buffer_from_ipc_descriptor(NULL, NULL, d2, s, &keep); /* the pool stays imported */
    if (first != CUBUF_SUCCESS) {
        printf("SKIP: this driver does not import a pool pointer into its exporting process (%s)\n",
               cubuf_last_error());
        return 77;
    }
    T_REQUIRE(cubuf_buffer_from_ipc_descriptor(NULL, NULL, d1, g_closer_stream, &a));
    g_ptr = cubuf_buffer_ptr(a);
    real_sync = cubuf__drv.cuStreamSynchronize;
    real_free = cubuf__drv.cuMemFreeAsync;
    real_import = cubuf__drv.cuMemPoolImportPointer;
    cubuf__drv.cuStreamSynchronize = counted_sync;
    cubuf__drv.cuMemFreeAsync = counted_free;
    cubuf__drv.cuMemPoolImportPointer = held_import;
    /* The first import (of another pointer) holds the import lock, to find it. */
    op_t o1 = {.cx = cx, .d = d3, .s = s, .self = &g_first, .self_set = &g_first_set};
    pthread_t first_thread;
    atomic_store(&g_hold_import, true);
    T_CHECK(pthread_create(&first_thread, NULL, run, &o1) == 0);
    T_CHECK(wait_for(&g_in_import));
    atomic_store(&g_hold_import, false);
    pthread_join(first_thread, NULL);
    atomic_store(&g_first_set, false);
    T_OK(o1.st);
    T_CHECK(g_import_lock != NULL);
    /* The close pauses after its first look; the pointer is imported again meanwhile. */
    pthread_t closer;
    op_t oc = {.cx = cx, .close = a, .self = &g_closer, .self_set = &g_closer_set},
         oi = {.cx = cx, .d = d1, .s = s};
    pthread_t ti;
    atomic_store(&g_pause_armed, g_import_lock != NULL);
    T_CHECK(pthread_create(&closer, NULL, run, &oc) == 0);
    if (g_import_lock) T_CHECK(wait_for(&g_paused));
    T_CHECK(pthread_create(&ti, NULL, run, &oi) == 0);
    pthread_join(closer, NULL);
    pthread_join(ti, NULL);
    atomic_store(&g_closer_set, false);
    T_OK(oc.st);
    T_OK(oi.st);
    T_CHECK(oi.out != NULL);
    /* The close left the pointer to the other buffer, or freed it as its
     * last holder: it synchronized its stream, or freed on it. */
    printf("the close: %d synchronization(s) of its stream, %d free(s) of the pointer\n",
           atomic_load(&g_syncs), atomic_load(&g_frees));
    T_CHECK(atomic_load(&g_syncs) + atomic_load(&g_frees) >= 1);
    cubuf_buffer_release(oi.out); /* the pointer's last holder: freed */
    /* Two buffers on one pointer, closed one after the other: the first
     * close is not the last, and synchronizes its stream; the second frees. */
    cubuf_buffer_t *b1 = NULL, *b2 = NULL;
    T_REQUIRE(cubuf_buffer_from_ipc_descriptor(NULL, NULL, d1, g_closer_stream, &b1));
    T_REQUIRE(cubuf_buffer_from_ipc_descriptor(NULL, NULL, d1, s, &b2));
    g_ptr = cubuf_buffer_ptr(b1);
    T_CHECK(cubuf_buffer_ptr(b2) == g_ptr); /* one import of the pointer, two holders */
    atomic_store(&g_syncs, 0);
    atomic_store(&g_frees, 0);
    T_OK(cubuf_buffer_close(b1));
    T_CHECK(atomic_load(&g_syncs) >= 1 && atomic_load(&g_frees) == 0);
    T_OK(cubuf_buffer_close(b2));
    T_CHECK(atomic_load(&g_frees) == 1);
    cubuf_buffer_release(b1);
    cubuf_buffer_release(b2);
    cubuf__drv.cuStreamSynchronize = real_sync;
    cubuf__drv.cuMemFreeAsync = real_free;
    cubuf__drv.cuMemPoolImportPointer = real_import;
    cubuf_buffer_release(a);
    cubuf_buffer_release(o1.out);
    cubuf_buffer_release(keep);
    cubuf_ipc_descriptor_destroy(d1);
    cubuf_ipc_descriptor_destroy(d2);
    cubuf_ipc_descriptor_destroy(d3);
    cubuf_buffer_release(e1);
    cubuf_buffer_release(e2);
    cubuf_buffer_release(e3);
    T_CU(cuCtxSynchronize);
    T_CU(cuStreamDestroy, g_closer_stream);
    T_CU(cuStreamDestroy, s);
    cubuf_resource_release(res);
    cubuf_context_destroy(ctx);
    return t_finish("test_ipc_pool_race");
}
#endif
