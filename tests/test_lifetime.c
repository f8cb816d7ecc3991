/* Who may free what, checked without a GPU (a user resource over host
 * memory): a buffer with open slices refuses to close, and its memory lives
 * until the last slice goes; cubuf_buffer_wrap refuses a resource that
 * cannot adopt memory; copy_to_new writes its out-parameter only on
 * success; the host copies' position and size rules. */
#include <pthread.h>

#include "internal.h"
#include "test.h"

/* ---- a host-only user resource over malloc/free, counting its calls ---- */

typedef struct host_res {
    int allocs, deallocs;
    void *last_freed;
} host_res_t;

static cubuf_status_t hr_alloc(void *state, size_t size, CUstream stream, CUdeviceptr *ptr)
{
    void *p = malloc(size);
    if (!p) return CUBUF_ERROR_OUT_OF_MEMORY;
    ((host_res_t *)state)->allocs++;
    *ptr = (CUdeviceptr)(uintptr_t)p;
    return CUBUF_SUCCESS;
}

static cubuf_status_t hr_dealloc(void *state, CUdeviceptr ptr, size_t size, CUstream stream)
{
    host_res_t *h = state;
    h->deallocs++;
    h->last_freed = (void *)(uintptr_t)ptr;
    free((void *)(uintptr_t)ptr);
    return CUBUF_SUCCESS;
}

static cubuf_resource_t *host_resource(host_res_t *h)
{
    memset(h, 0, sizeof *h);
    cubuf_resource_ops_t ops = {CUBUF_RESOURCE_OPS_VERSION, hr_alloc, hr_dealloc, NULL};
    cubuf_resource_props_t props = CUBUF_RESOURCE_PROPS_INIT;
    props.device_id = -1;
    props.host_accessible = true;
    props.device_accessible = false;
    cubuf_resource_t *res = NULL;
    T_REQUIRE(cubuf_resource_create(&ops, &props, h, &res));
    return res;
}

static size_t live_bytes(const cubuf_resource_t *res)
{
    cubuf_resource_stats_t st = CUBUF_RESOURCE_STATS_INIT;
    T_OK(cubuf_resource_stats(res, &st));
    return st.current_bytes;
}

static unsigned char *host_of(const cubuf_buffer_t *b)
{
    return (unsigned char *)(uintptr_t)cubuf_buffer_ptr(b);
}

/* ---- slices ---- */

static void test_slices_keep_memory(void)
{
    host_res_t h;
    cubuf_resource_t *res = host_resource(&h);
    cubuf_buffer_t *root = NULL, *a = NULL, *b = NULL;
    T_REQUIRE(cubuf_resource_allocate(res, 4096, NULL, &root));
    unsigned char *mem = host_of(root);
    for (size_t i = 0; i < 4096; i++) mem[i] = (unsigned char)(i * 7);
    T_REQUIRE(cubuf_buffer_slice(root, 100, 200, &a));
    T_REQUIRE(cubuf_buffer_slice(a, 10, 20, &b)); /* a slice of a slice depends on the root */
    T_CHECK(cubuf_buffer_parent(a) == root && cubuf_buffer_parent(b) == root);
    T_CHECK(host_of(b) == mem + 110 && cubuf_buffer_size(b) == 20);

    /* The root refuses to close while slices are open, and stays as it was. */
    T_STATUS(cubuf_buffer_close(root), CUBUF_ERROR_BUSY);
    T_CHECK(strstr(cubuf_last_error(), "2 slices") != NULL);
    T_CHECK(!cubuf_buffer_is_closed(root) && cubuf_buffer_ptr(root) == (CUdeviceptr)(uintptr_t)mem);
    T_CHECK(cubuf_buffer_size(root) == 4096 && h.deallocs == 0 && live_bytes(res) == 4096);
    /* close_on too, and its stream is not recorded. */
    CUstream before = t_dealloc_stream(root);
    T_STATUS(cubuf_buffer_close_on(root, (CUstream)(uintptr_t)0x1234), CUBUF_ERROR_BUSY);
    T_CHECK(t_dealloc_stream(root) == before && !cubuf_buffer_is_closed(root));
    /* A slice frees nothing: its deallocation stream needs no context or driver. */
    T_OK(cubuf_buffer_set_deallocation_stream(a, NULL));
    T_OK(cubuf_buffer_set_deallocation_stream(a, CU_STREAM_PER_THREAD));
    /* The last release of a slice while the root is in use elsewhere. */
    T_OK(cubuf_buffer_close(a));
    T_CHECK(cubuf_buffer_is_closed(a));
    T_STATUS(cubuf_buffer_close(root), CUBUF_ERROR_BUSY); /* b is still open */
    T_CHECK(strstr(cubuf_last_error(), "1 slice ") != NULL);
    cubuf_buffer_release(a);

    /* Dropping the root's handle while a slice is open keeps the memory. */
    cubuf_buffer_release(root);
    T_CHECK(h.deallocs == 0 && live_bytes(res) == 4096);
    T_CHECK(!cubuf_buffer_is_closed(b) && host_of(b) == mem + 110);
    for (size_t i = 0; i < 20; i++) T_CHECK(host_of(b)[i] == (unsigned char)((110 + i) * 7));
    /* The last slice frees it. */
    cubuf_buffer_release(b);
    T_CHECK(h.deallocs == 1 && h.last_freed == mem && live_bytes(res) == 0);

    /* With no slice left open, the root closes. */
    T_REQUIRE(cubuf_resource_allocate(res, 64, NULL, &root));
    T_REQUIRE(cubuf_buffer_slice(root, 0, 64, &a));
    cubuf_buffer_release(a);
    T_OK(cubuf_buffer_close(root));
    T_CHECK(h.deallocs == 2 && live_bytes(res) == 0);
    T_STATUS(cubuf_buffer_slice(root, 0, 0, &a), CUBUF_ERROR_CLOSED);
    cubuf_buffer_release(root);
    cubuf_resource_release(res);
}

typedef struct slicer {
    cubuf_buffer_t *root;
    int failures;
} slicer_t;

static void *slice_and_drop(void *arg)
{
    slicer_t *s = arg;
    for (int i = 0; i < 2000; i++) {
        cubuf_buffer_t *x = NULL, *y = NULL;
        if (cubuf_buffer_slice(s->root, (size_t)i % 64, 16, &x) != CUBUF_SUCCESS ||
            cubuf_buffer_slice(x, 1, 8, &y) != CUBUF_SUCCESS)
            s->failures++;
        if (i % 2) cubuf_buffer_close(y);
        cubuf_buffer_release(x);
        cubuf_buffer_release(y);
    }
    return NULL;
}

/* Slices made and dropped on eight threads at once: the count of open
 * slices comes back to zero, and only then does the root close. */
static void test_slices_threads(void)
{
    host_res_t h;
    cubuf_resource_t *res = host_resource(&h);
    cubuf_buffer_t *root = NULL;
    T_REQUIRE(cubuf_resource_allocate(res, 128, NULL, &root));
    pthread_t t[8];
    slicer_t s[8];
    for (int i = 0; i < 8; i++) {
        s[i] = (slicer_t){root, 0};
        T_CHECK(pthread_create(&t[i], NULL, slice_and_drop, &s[i]) == 0);
    }
    for (int i = 0; i < 8; i++) {
        pthread_join(t[i], NULL);
        T_CHECK(s[i].failures == 0);
    }
    T_CHECK(cubuf__inspect_open_slices(root) == 0);
    T_CHECK(cubuf__inspect_buffer_refs(root) == 1);
    T_OK(cubuf_buffer_close(root));
    T_CHECK(h.deallocs == 1 && live_bytes(res) == 0);
    cubuf_buffer_release(root);
    cubuf_resource_release(res);
}

/* ---- adoption ---- */

static int g_nocalls;
static cubuf_status_t never_allocate(cubuf_resource_t *res, cubuf_buffer_t *buf, CUstream stream,
                                     bool in_ctx, cubuf_charge_t *charge)
{
    g_nocalls++;
    return CUBUF_ERROR_DRIVER;
}
static cubuf_status_t never_deallocate(cubuf_resource_t *res, cubuf_buffer_t *buf,
                                       const cubuf_stream_token_t *token, cubuf_charge_t *charge)
{
    g_nocalls++;
    return CUBUF_ERROR_DRIVER;
}

static void test_wrap_refuses(void)
{
    /* A resource whose vtable says it cannot adopt (as VMM and IPC imports say). */
    static const cubuf_resource_vtbl_t vt = {
        .allocate = never_allocate,
        .deallocate = never_deallocate,
        .no_adopt = "its frees need the state of its own allocations",
    };
    cubuf_resource_t *res = NULL;
    T_REQUIRE(cubuf__resource_new(&vt, NULL, 0, &res)); /* its properties: of no device, host memory */
    cubuf_buffer_t *b = (cubuf_buffer_t *)&b;
    unsigned char mem[16];
    T_STATUS(cubuf_buffer_wrap((CUdeviceptr)(uintptr_t)mem, sizeof mem, res, NULL, &b),
             CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(strstr(cubuf_last_error(), "own allocations") != NULL);
    T_CHECK(b == (cubuf_buffer_t *)&b && g_nocalls == 0 && live_bytes(res) == 0);
    T_CHECK(cubuf__inspect_resource_refs(res) == 1);
    cubuf_resource_release(res);

    /* A user resource adopts. */
    host_res_t h;
    res = host_resource(&h);
    void *p = malloc(32);
    T_REQUIRE(cubuf_buffer_wrap((CUdeviceptr)(uintptr_t)p, 32, res, NULL, &b));
    T_CHECK(live_bytes(res) == 32);
    cubuf_buffer_release(b);
    T_CHECK(h.deallocs == 1 && h.last_freed == p && live_bytes(res) == 0);
    cubuf_resource_release(res);
}

/* ---- argument rules that need no driver ---- */

static void test_copy_to_new_out(void)
{
    host_res_t h;
    cubuf_resource_t *res = host_resource(&h);
    cubuf_buffer_t *a = NULL;
    T_REQUIRE(cubuf_resource_allocate(res, 64, NULL, &a));
    cubuf_buffer_t *out = (cubuf_buffer_t *)&out; /* never read, written only on success */
    T_STATUS(cubuf_buffer_copy_to_new(NULL, NULL, NULL, &out), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_buffer_copy_to_new(a, NULL, NULL, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    cubuf_copy_options_t o = CUBUF_COPY_OPTIONS_INIT;
    T_STATUS(cubuf_buffer_copy_to_new(a, CU_STREAM_LEGACY, &o, &out), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(h.allocs == 1); /* refused before allocating */
    T_OK(cubuf_buffer_close(a));
    T_STATUS(cubuf_buffer_copy_to_new(a, NULL, NULL, &out), CUBUF_ERROR_CLOSED);
    T_CHECK(out == (cubuf_buffer_t *)&out);
    T_STATUS(cubuf_buffer_copy_to(a, NULL, NULL, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    cubuf_buffer_release(a);
    cubuf_resource_release(res);
}

static void test_host_copy_rules(void)
{
    host_res_t h;
    cubuf_resource_t *res = host_resource(&h);
    cubuf_buffer_t *b = NULL;
    T_REQUIRE(cubuf_resource_allocate(res, 100, NULL, &b));
    unsigned char host[64];
    size_t copied = 777;
    const cubuf_status_t R = CUBUF_ERROR_OUT_OF_RANGE;
    T_STATUS(cubuf_buffer_copy_to_host(NULL, 0, -1, host, 64, NULL, &copied), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_buffer_copy_to_host(b, 0, -1, NULL, 64, NULL, &copied), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_buffer_copy_to_host(b, -1, -1, host, 64, NULL, &copied), R);
    T_STATUS(cubuf_buffer_copy_to_host(b, 101, -1, host, 64, NULL, &copied), R);
    T_STATUS(cubuf_buffer_copy_to_host(b, 0, -2, host, 64, NULL, &copied), R);
    T_STATUS(cubuf_buffer_copy_to_host(b, 50, 51, host, 64, NULL, &copied), R); /* past the buffer */
    T_CHECK(strstr(cubuf_last_error(), "pass the end") != NULL);
    T_STATUS(cubuf_buffer_copy_to_host(b, 0, 65, host, 64, NULL, &copied), R); /* past the host side */
    T_CHECK(strstr(cubuf_last_error(), "do not fit") != NULL);
    T_STATUS(cubuf_buffer_copy_from_host(NULL, host, 64, 0, -1, NULL, &copied), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_buffer_copy_from_host(b, NULL, 64, 0, -1, NULL, &copied), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_buffer_copy_from_host(b, host, 64, -1, -1, NULL, &copied), R);
    T_STATUS(cubuf_buffer_copy_from_host(b, host, 64, 101, -1, NULL, &copied), R);
    T_STATUS(cubuf_buffer_copy_from_host(b, host, 64, 0, 65, NULL, &copied), R); /* more than the data */
    T_STATUS(cubuf_buffer_copy_from_host(b, host, 64, 60, 41, NULL, &copied), R); /* past the buffer */
    T_CHECK(copied == 777); /* written only on success */
    /* Nothing to copy: success, no driver needed. */
    T_OK(cubuf_buffer_copy_to_host(b, 100, -1, host, 64, NULL, &copied));
    T_CHECK(copied == 0);
    copied = 777;
    T_OK(cubuf_buffer_copy_from_host(b, host, 0, 5, -1, NULL, &copied));
    T_CHECK(copied == 0);
    T_OK(cubuf_buffer_copy_to_host(b, 3, 0, NULL, 0, NULL, NULL));
    T_OK(cubuf_buffer_close(b));
    T_STATUS(cubuf_buffer_copy_to_host(b, 0, -1, host, 64, NULL, &copied), CUBUF_ERROR_CLOSED);
    T_STATUS(cubuf_buffer_copy_from_host(b, host, 64, 0, -1, NULL, &copied), CUBUF_ERROR_CLOSED);
    cubuf_buffer_release(b);
    cubuf_resource_release(res);
}

int main(void)
{
    test_slices_keep_memory();
    test_slices_threads();
    test_wrap_refuses();
    test_copy_to_new_out();
    test_host_copy_rules();
    return t_finish("test_lifetime");
}
