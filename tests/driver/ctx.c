/* Contexts: primary contexts with retain counts, created contexts, and the
 * per-thread stack of current contexts. */
#include <pthread.h>
#include <stdlib.h>

#include "fake.h"

struct CUctx_st {
    int device;
    bool primary;
    int retains;          /* primary: retain count (active while > 0) */
    struct CUctx_st *next; /* created contexts: the live list */
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct CUctx_st primaries[TD_DEVICE_COUNT] = {
    {.device = 0, .primary = true},
    {.device = 1, .primary = true},
};
static struct CUctx_st *created; /* live created contexts */

/* Each thread's stack of current contexts, behind a pthread key: no
 * _Thread_local in a library that is dlopen'ed (ThreadSanitizer reports the
 * release of such dynamic TLS as a race). */
#define TD_CTX_STACK 64
typedef struct thread_stack {
    CUcontext at[TD_CTX_STACK];
    int depth;
} thread_stack_t;

static pthread_key_t stack_key;
static pthread_once_t stack_once = PTHREAD_ONCE_INIT;

static void stack_init(void) { pthread_key_create(&stack_key, free); }

/* This thread's stack, made on first use; NULL if memory ran out. */
static thread_stack_t *stack_of_thread(void)
{
    pthread_once(&stack_once, stack_init);
    thread_stack_t *t = pthread_getspecific(stack_key);
    if (!t && (t = calloc(1, sizeof *t)) && pthread_setspecific(stack_key, t) != 0) {
        free(t);
        t = NULL;
    }
    return t;
}

static bool live_locked(CUcontext ctx)
{
    if (!ctx) return false;
    for (int i = 0; i < TD_DEVICE_COUNT; i++)
        if (ctx == &primaries[i]) return true;
    for (struct CUctx_st *c = created; c; c = c->next)
        if (c == ctx) return true;
    return false;
}

CUcontext td_ctx_current(void)
{
    thread_stack_t *t = stack_of_thread();
    return t && t->depth > 0 ? t->at[t->depth - 1] : NULL;
}

CUresult td_ctx_require(CUcontext *ctx)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    CUcontext c = td_ctx_current();
    if (!c || td_ctx_device(c) < 0) return CUDA_ERROR_INVALID_CONTEXT;
    *ctx = c;
    return CUDA_SUCCESS;
}

int td_ctx_device(CUcontext ctx)
{
    pthread_mutex_lock(&lock);
    int dev = live_locked(ctx) ? ctx->device : -1;
    pthread_mutex_unlock(&lock);
    return dev;
}

CUresult td_cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice_v1 dev)
{
    CUresult r = td_check_device(dev);
    if (r != CUDA_SUCCESS) return r;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    primaries[dev].retains++;
    pthread_mutex_unlock(&lock);
    *pctx = &primaries[dev];
    return CUDA_SUCCESS;
}

CUresult td_cuDevicePrimaryCtxRelease(CUdevice_v1 dev)
{
    CUresult r = td_check_device(dev);
    if (r != CUDA_SUCCESS) return r;
    pthread_mutex_lock(&lock);
    /* The real driver answers a release without a retain with
     * CUDA_ERROR_INVALID_CONTEXT. */
    bool had = primaries[dev].retains > 0;
    bool last = had && --primaries[dev].retains == 0;
    pthread_mutex_unlock(&lock);
    if (!had) return CUDA_ERROR_INVALID_CONTEXT;
    if (last) td_ctx_streams_destroy(&primaries[dev]);
    return CUDA_SUCCESS;
}

CUresult td_cuDevicePrimaryCtxGetState(CUdevice_v1 dev, unsigned int *flags, int *active)
{
    CUresult r = td_check_device(dev);
    if (r != CUDA_SUCCESS) return r;
    if (!flags || !active) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    *active = primaries[dev].retains > 0;
    pthread_mutex_unlock(&lock);
    *flags = 0;
    return CUDA_SUCCESS;
}

CUresult td_cuCtxPushCurrent(CUcontext ctx)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (td_ctx_device(ctx) < 0) return CUDA_ERROR_INVALID_CONTEXT;
    thread_stack_t *t = stack_of_thread();
    if (!t || t->depth == TD_CTX_STACK) return CUDA_ERROR_OUT_OF_MEMORY;
    t->at[t->depth++] = ctx;
    return CUDA_SUCCESS;
}

CUresult td_cuCtxPopCurrent(CUcontext *pctx)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    thread_stack_t *t = stack_of_thread();
    if (!t || t->depth == 0) return CUDA_ERROR_INVALID_CONTEXT;
    CUcontext c = t->at[--t->depth];
    if (pctx) *pctx = c;
    return CUDA_SUCCESS;
}

CUresult td_cuCtxGetCurrent(CUcontext *pctx)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    *pctx = td_ctx_current();
    return CUDA_SUCCESS;
}

CUresult td_cuCtxSetCurrent(CUcontext ctx)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    thread_stack_t *t = stack_of_thread();
    if (!t) return CUDA_ERROR_OUT_OF_MEMORY;
    if (!ctx) { /* pops the top, if any */
        if (t->depth > 0) t->depth--;
        return CUDA_SUCCESS;
    }
    if (td_ctx_device(ctx) < 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (t->depth == 0) t->depth = 1;
    t->at[t->depth - 1] = ctx;
    return CUDA_SUCCESS;
}

CUresult td_cuCtxGetDevice(CUdevice_v1 *device)
{
    CUcontext c;
    CUresult r = td_ctx_require(&c);
    if (r != CUDA_SUCCESS) return r;
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    *device = td_ctx_device(c);
    return CUDA_SUCCESS;
}

CUresult td_cuCtxSynchronize(void)
{
    CUcontext c;
    CUresult r = td_ctx_require(&c);
    return r != CUDA_SUCCESS ? r : td_ctx_synchronize(c);
}

CUresult td_cuCtxCreate(CUcontext *pctx, CUctxCreateParams *ctxCreateParams, unsigned int flags, CUdevice dev)
{
    CUresult r = td_check_device(dev);
    if (r != CUDA_SUCCESS) return r;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    if (ctxCreateParams && (ctxCreateParams->execAffinityParams || ctxCreateParams->cigParams))
        return CUDA_ERROR_NOT_SUPPORTED;
    thread_stack_t *t = stack_of_thread();
    if (!t || t->depth == TD_CTX_STACK) return CUDA_ERROR_OUT_OF_MEMORY;
    struct CUctx_st *c = calloc(1, sizeof *c);
    if (!c) return CUDA_ERROR_OUT_OF_MEMORY;
    c->device = dev;
    pthread_mutex_lock(&lock);
    c->next = created;
    created = c;
    pthread_mutex_unlock(&lock);
    t->at[t->depth++] = c; /* the new context is current */
    *pctx = c;
    return CUDA_SUCCESS;
}

CUresult td_cuCtxDestroy(CUcontext ctx)
{
    CUresult r = td_check_init();
    if (r != CUDA_SUCCESS) return r;
    pthread_mutex_lock(&lock);
    struct CUctx_st **at = &created;
    while (*at && *at != ctx) at = &(*at)->next;
    bool found = *at != NULL;
    if (found) *at = ctx->next;
    pthread_mutex_unlock(&lock);
    if (!found) return CUDA_ERROR_INVALID_CONTEXT; /* also a primary context */
    td_ctx_streams_destroy(ctx);
    /* Current to this thread: popped, as by cuCtxPopCurrent. */
    thread_stack_t *t = stack_of_thread();
    if (t && t->depth > 0 && t->at[t->depth - 1] == ctx) t->depth--;
    free(ctx);
    return CUDA_SUCCESS;
}

CUresult td_cuCtxGetStreamPriorityRange(int *leastPriority, int *greatestPriority)
{
    CUcontext c;
    CUresult r = td_ctx_require(&c);
    if (r != CUDA_SUCCESS) return r;
    if (leastPriority) *leastPriority = 0;
    if (greatestPriority) *greatestPriority = -5;
    return CUDA_SUCCESS;
}
