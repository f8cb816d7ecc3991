/* User-defined resources: version and callback checks, the sizes and streams
 * the callbacks see, errors that propagate, and destroy called once after the
 * last buffer is gone. A host-memory resource needs no driver, so that part
 * runs everywhere; the device part needs a GPU. */
#include <stdint.h>

#include "internal.h"
#include "test.h"

typedef struct user_state {
    int allocs, deallocs, destroys;
    int mallocs, frees; /* successful allocations and frees */
    int seq, dealloc_seq, destroy_seq; /* order of the calls */
    size_t alloc_size, dealloc_size;
    CUstream alloc_stream, dealloc_stream;
    CUdeviceptr given, freed;
    cubuf_status_t alloc_fails_with, dealloc_fails_with;
    bool device; /* cuMemAlloc instead of malloc */
} user_state_t;

static cubuf_status_t u_alloc(void *state, size_t size, CUstream stream, CUdeviceptr *ptr)
{
    user_state_t *u = state;
    u->allocs++;
    u->seq++;
    u->alloc_size = size;
    u->alloc_stream = stream;
    if (u->alloc_fails_with != CUBUF_SUCCESS) return u->alloc_fails_with;
    if (u->device) {
        if (cubuf__drv.cuMemAlloc(ptr, size) != CUDA_SUCCESS) return CUBUF_ERROR_OUT_OF_MEMORY;
    } else {
        void *p = malloc(size);
        if (!p) return CUBUF_ERROR_OUT_OF_MEMORY;
        *ptr = (CUdeviceptr)(uintptr_t)p;
    }
    u->given = *ptr;
    u->mallocs++;
    return CUBUF_SUCCESS;
}

static cubuf_status_t u_dealloc(void *state, CUdeviceptr ptr, size_t size, CUstream stream)
{
    user_state_t *u = state;
    u->deallocs++;
    u->dealloc_seq = ++u->seq;
    u->dealloc_size = size;
    u->dealloc_stream = stream;
    if (u->dealloc_fails_with != CUBUF_SUCCESS) return u->dealloc_fails_with;
    u->freed = ptr;
    if (u->device) {
        if (cubuf__drv.cuStreamSynchronize(stream) != CUDA_SUCCESS) return CUBUF_ERROR_DRIVER;
        if (cubuf__drv.cuMemFree(ptr) != CUDA_SUCCESS) return CUBUF_ERROR_DRIVER;
    } else {
        free((void *)(uintptr_t)ptr);
    }
    u->frees++;
    return CUBUF_SUCCESS;
}

static void u_destroy(void *state)
{
    user_state_t *u = state;
    u->destroys++;
    u->destroy_seq = ++u->seq;
}

static const cubuf_resource_ops_t k_ops = {CUBUF_RESOURCE_OPS_VERSION, u_alloc, u_dealloc, u_destroy};

static void test_create_checks(void)
{
    user_state_t u = {0};
    cubuf_resource_t *r = NULL;
    cubuf_resource_ops_t ops = k_ops;
    T_STATUS(cubuf_resource_create(NULL, NULL, &u, &r), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_resource_create(&ops, NULL, &u, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    ops.version = 0;
    T_STATUS(cubuf_resource_create(&ops, NULL, &u, &r), CUBUF_ERROR_NOT_SUPPORTED);
    ops.version = 99;
    T_STATUS(cubuf_resource_create(&ops, NULL, &u, &r), CUBUF_ERROR_NOT_SUPPORTED);
    T_CHECK(strstr(cubuf_last_error(), "99") != NULL);
    ops = k_ops;
    ops.allocate = NULL;
    T_STATUS(cubuf_resource_create(&ops, NULL, &u, &r), CUBUF_ERROR_INVALID_ARGUMENT);
    ops = k_ops;
    ops.deallocate = NULL;
    T_STATUS(cubuf_resource_create(&ops, NULL, &u, &r), CUBUF_ERROR_INVALID_ARGUMENT);
    cubuf_resource_props_t bad = CUBUF_RESOURCE_PROPS_INIT;
    bad.struct_size = 0;
    T_STATUS(cubuf_resource_create(&k_ops, &bad, &u, &r), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(r == NULL);
    T_CHECK(u.allocs == 0 && u.destroys == 0);

    /* destroy may be NULL; the ops struct is copied. */
    ops = k_ops;
    ops.destroy = NULL;
    T_REQUIRE(cubuf_resource_create(&ops, NULL, &u, &r));
    ops.allocate = NULL;
    cubuf_resource_props_t p = CUBUF_RESOURCE_PROPS_INIT;
    T_OK(cubuf_resource_props(r, &p));
    T_CHECK(p.device_accessible && !p.host_accessible && !p.managed);
    cubuf_resource_release(r);
    T_CHECK(u.destroys == 0);
}

/* Host memory behind the callbacks: no driver is involved. */
static void test_host_resource(void)
{
    user_state_t u = {0};
    cubuf_resource_props_t props = CUBUF_RESOURCE_PROPS_INIT;
    props.host_accessible = true; /* device_id -1, not device accessible */
    cubuf_resource_t *r = NULL;
    T_REQUIRE(cubuf_resource_create(&k_ops, &props, &u, &r));
    cubuf_resource_props_t p = CUBUF_RESOURCE_PROPS_INIT;
    T_OK(cubuf_resource_props(r, &p));
    T_CHECK(p.device_id == -1 && p.host_accessible && !p.device_accessible);

    /* Streams are opaque to a host-only resource: the callbacks get them as given. */
    CUstream s1 = (CUstream)(uintptr_t)0x1000, s2 = (CUstream)(uintptr_t)0x2000;
    cubuf_buffer_t *b = NULL;
    T_OK(cubuf_resource_allocate(r, 0, s1, &b)); /* size 0: no callback */
    T_CHECK(u.allocs == 0 && cubuf_buffer_ptr(b) == 0 && !cubuf_buffer_is_closed(b));
    cubuf_buffer_release(b);
    T_CHECK(u.deallocs == 0);

    T_REQUIRE(cubuf_resource_allocate(r, 1000, s1, &b));
    T_CHECK(u.allocs == 1 && u.alloc_size == 1000 && u.alloc_stream == s1);
    T_CHECK(cubuf_buffer_ptr(b) == u.given && cubuf_buffer_size(b) == 1000);
    T_CHECK(cubuf_buffer_resource(b) == r);
    T_CHECK(cubuf_buffer_is_host_accessible(b) && !cubuf_buffer_is_device_accessible(b));
    T_CHECK(cubuf_buffer_device_id(b) == -1);
    unsigned char *h = (unsigned char *)(uintptr_t)cubuf_buffer_ptr(b);
    memset(h, 0x42, 1000);
    T_CHECK(h[0] == 0x42 && h[999] == 0x42);
    cubuf_resource_stats_t s = CUBUF_RESOURCE_STATS_INIT;
    T_OK(cubuf_resource_stats(r, &s));
    T_CHECK(s.current_bytes == 1000 && s.current_count == 1 && s.total_allocations == 1);
    CUdeviceptr given = u.given;
    T_OK(cubuf_buffer_close_on(b, s2)); /* the replacement stream is the one used */
    T_CHECK(u.deallocs == 1 && u.freed == given && u.dealloc_size == 1000 && u.dealloc_stream == s2);
    T_OK(cubuf_buffer_close(b)); /* closing again does nothing */
    T_CHECK(u.deallocs == 1);
    cubuf_buffer_release(b);

    /* The last release closes on the recorded stream. */
    T_REQUIRE(cubuf_resource_allocate(r, 24, s1, &b));
    cubuf_buffer_release(b);
    T_CHECK(u.deallocs == 2 && u.dealloc_size == 24 && u.dealloc_stream == s1);

    /* A failing deallocate leaves the buffer open and counted. */
    T_REQUIRE(cubuf_resource_allocate(r, 64, s1, &b));
    u.dealloc_fails_with = CUBUF_ERROR_DRIVER;
    T_STATUS(cubuf_buffer_close(b), CUBUF_ERROR_DRIVER);
    T_CHECK(!cubuf_buffer_is_closed(b) && cubuf_buffer_ptr(b) == u.given);
    T_OK(cubuf_resource_stats(r, &s));
    T_CHECK(s.current_bytes == 64 && s.current_count == 1);
    u.dealloc_fails_with = CUBUF_SUCCESS;
    T_OK(cubuf_buffer_close(b));
    cubuf_buffer_release(b);

    /* Allocation errors propagate; nothing is returned or counted. */
    const cubuf_status_t errs[3] = {CUBUF_ERROR_OUT_OF_MEMORY, CUBUF_ERROR_NOT_SUPPORTED,
                                    CUBUF_ERROR_DRIVER};
    for (int i = 0; i < 3; i++) {
        u.alloc_fails_with = errs[i];
        b = NULL;
        T_STATUS(cubuf_resource_allocate(r, 4096, s1, &b), errs[i]);
        T_CHECK(b == NULL);
        T_CHECK(strstr(cubuf_last_error(), "user resource") != NULL);
    }
    u.alloc_fails_with = CUBUF_SUCCESS;
    T_OK(cubuf_resource_stats(r, &s));
    T_CHECK(s.current_bytes == 0 && s.current_count == 0 && s.total_allocations == 3);
    T_CHECK(s.peak_bytes == 1000 && s.peak_count == 1);

    /* Buffers hold the resource: destroy runs once, after the last one. */
    cubuf_buffer_t *b1 = NULL, *b2 = NULL;
    T_REQUIRE(cubuf_resource_allocate(r, 10, s1, &b1));
    T_REQUIRE(cubuf_resource_allocate(r, 20, s1, &b2));
    cubuf_resource_release(r);
    T_CHECK(u.destroys == 0);
    T_CHECK(cubuf_buffer_resource(b1) == r);
    T_OK(cubuf_buffer_close(b1));
    T_CHECK(u.destroys == 0);
    cubuf_buffer_release(b1);
    T_CHECK(u.destroys == 0);
    cubuf_buffer_release(b2); /* closes b2, then the resource goes */
    T_CHECK(u.destroys == 1);
    T_CHECK(u.dealloc_size == 20 && u.destroy_seq > u.dealloc_seq);
    T_CHECK(u.mallocs == 5 && u.frees == 5); /* every successful allocation freed once */
}

/* Device memory behind the callbacks, with real streams. */
static void test_device_resource(void)
{
    cubuf_context_t *ctx = NULL;
    T_REQUIRE(cubuf_context_create(0, &ctx));
    CUcontext h = NULL;
    T_REQUIRE(cubuf_context_handle(ctx, &h));
    T_CU(cuCtxSetCurrent, h);
    CUstream s, s2;
    T_CU(cuStreamCreate, &s, CU_STREAM_NON_BLOCKING);
    T_CU(cuStreamCreate, &s2, CU_STREAM_NON_BLOCKING);

    user_state_t u = {0};
    u.device = true;
    cubuf_resource_props_t props = CUBUF_RESOURCE_PROPS_INIT;
    props.device_id = 0;
    props.device_accessible = true;
    cubuf_resource_t *r = NULL;
    T_REQUIRE(cubuf_resource_create(&k_ops, &props, &u, &r));

    cubuf_buffer_t *b = NULL;
    T_REQUIRE(cubuf_resource_allocate(r, 5000, s, &b));
    T_CHECK(u.alloc_size == 5000 && u.alloc_stream == s);
    T_CHECK(cubuf_buffer_device_id(b) == 0 && cubuf_buffer_is_device_accessible(b));
    unsigned char w[5000], rd[5000];
    for (int i = 0; i < 5000; i++) w[i] = (unsigned char)(i * 13 + 1);
    T_CU(cuMemcpyHtoD, cubuf_buffer_ptr(b), w, sizeof w);
    T_CU(cuMemcpyDtoH, rd, cubuf_buffer_ptr(b), sizeof rd);
    T_CHECK(memcmp(w, rd, sizeof w) == 0);
    T_OK(cubuf_buffer_set_deallocation_stream(b, s2));
    T_OK(cubuf_buffer_close(b));
    T_CHECK(u.dealloc_stream == s2 && u.dealloc_size == 5000);
    cubuf_buffer_release(b);

    /* A default stream reaches the callbacks as given. */
    T_REQUIRE(cubuf_resource_allocate(r, 100, CU_STREAM_LEGACY, &b));
    T_CHECK(u.alloc_stream == CU_STREAM_LEGACY);
    cubuf_buffer_release(b);
    T_CHECK(u.dealloc_stream == CU_STREAM_LEGACY && u.dealloc_size == 100);

    cubuf_resource_release(r);
    T_CHECK(u.destroys == 1 && u.allocs == 2 && u.deallocs == 2);
    T_CU(cuStreamDestroy, s);
    T_CU(cuStreamDestroy, s2);
    T_CU(cuCtxSetCurrent, NULL);
    cubuf_context_destroy(ctx);
}

int main(void)
{
    test_create_checks();
    test_host_resource();
    int n = 0;
    if (cubuf_device_count(&n) != CUBUF_SUCCESS || n == 0) {
        printf("note: no CUDA device; the device part is skipped\n");
        return t_finish("test_resource_user");
    }
    test_device_resource();
    return t_finish("test_resource_user");
}
