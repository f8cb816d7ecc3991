/* The Context buffer functions (pyarrow.cuda.Context): new_buffer,
 * new_host_buffer, buffer_from_data with its offset/size rules,
 * foreign_buffer, device_address, bytes_allocated per context, the lazily
 * made pools under a race, and fault injection on each allocating path. */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "alloc_fault_test.h"
#include "resource_pool.h"
#include "test.h"

static CUcontext ctx;

static size_t allocated(const cubuf_context_t *c)
{
    size_t b = 0;
    T_OK(cubuf_context_bytes_allocated(c, &b));
    return b;
}

static unsigned char pattern_byte(size_t i, unsigned seed)
{
    return (unsigned char)((i * 29u + seed * 13u + (i >> 9)) & 0xffu);
}

static void fill_pattern(unsigned char *p, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++) p[i] = pattern_byte(i, seed);
}

/* The device bytes of b equal pattern `seed` from index `from` on. */
static bool holds(const cubuf_buffer_t *b, unsigned seed, size_t from)
{
    size_t n = cubuf_buffer_size(b);
    if (!n) return true;
    unsigned char *h = malloc(n);
    T_CU(cuCtxSynchronize);
    T_CU(cuMemcpyDtoH, h, cubuf_buffer_ptr(b), n);
    bool ok = true;
    for (size_t i = 0; i < n && ok; i++) ok = h[i] == pattern_byte(from + i, seed);
    free(h);
    return ok;
}

static int releases;
static void count_release(void *owner)
{
    T_CHECK(owner == &releases);
    releases++;
}

static void test_new_buffer(cubuf_context_t *c)
{
    const size_t sizes[] = {0, 1, 1000, (size_t)1 << 30};
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        size_t n = sizes[k], base = allocated(c);
        cubuf_buffer_t *b = NULL;
        T_REQUIRE(cubuf_context_new_buffer(c, n, &b));
        T_CHECK(cubuf_buffer_size(b) == n && !cubuf_buffer_is_closed(b));
        T_CHECK(allocated(c) == base + n);
        T_CHECK(cubuf_buffer_resource(b) != NULL);
        if (n) {
            T_CHECK(cubuf_buffer_ptr(b) != 0 && cubuf_buffer_device_id(b) == 0);
            T_CHECK(cubuf_buffer_is_device_accessible(b) && !cubuf_buffer_is_host_accessible(b));
            /* Usable: write the last byte and read it back. */
            T_OK(cubuf_buffer_fill_byte(b, 0x42, CU_STREAM_LEGACY));
            unsigned char last = 0;
            T_CU(cuCtxSynchronize);
            T_CU(cuMemcpyDtoH, &last, cubuf_buffer_ptr(b) + n - 1, 1);
            T_CHECK(last == 0x42);
        } else {
            T_CHECK(cubuf_buffer_ptr(b) == 0);
        }
        T_OK(cubuf_buffer_close(b));
        T_CHECK(allocated(c) == base);
        cubuf_buffer_release(b);
        T_CHECK(allocated(c) == base);
    }
    /* The last release of an open buffer uncounts it too. */
    cubuf_buffer_t *b = NULL;
    T_REQUIRE(cubuf_context_new_buffer(c, 4096, &b));
    T_CHECK(allocated(c) == 4096);
    cubuf_buffer_release(b);
    T_CHECK(allocated(c) == 0);
    T_STATUS(cubuf_context_new_buffer(NULL, 1, &b), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_context_new_buffer(c, 1, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    /* An impossible size fails cleanly. */
    b = NULL;
    T_CHECK(cubuf_context_new_buffer(c, (size_t)1 << 50, &b) != CUBUF_SUCCESS);
    T_CHECK(b == NULL && allocated(c) == 0);
}

/* Context memory can be shared with other processes (pyarrow's
 * export_for_ipc) wherever the device exports pools as POSIX fds; an
 * exported buffer counts until it is closed. The import in another process
 * is test_ipc_pool's context run. */
static void test_exported(cubuf_context_t *c)
{
    CUdevice dev;
    int types = 0;
    T_CU(cuDeviceGet, &dev, 0);
    T_CU(cuDeviceGetAttribute, &types, CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES, dev);
    const size_t n = 3 * 4096 + 5, base = allocated(c);
    cubuf_buffer_t *b = NULL;
    T_REQUIRE(cubuf_context_new_buffer(c, n, &b));
    cubuf_ipc_descriptor_t *d = NULL;
    cubuf_status_t st = cubuf_buffer_ipc_descriptor(b, &d);
    if (!(types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) {
        T_STATUS(st, CUBUF_ERROR_NOT_SUPPORTED); /* the default pool served */
    } else {
        T_OK(st);
        cubuf_ipc_descriptor_info_t info = CUBUF_IPC_DESCRIPTOR_INFO_INIT;
        T_OK(cubuf_ipc_descriptor_info(d, &info));
        T_CHECK(info.size == n && info.mechanism == CUBUF_IPC_MECHANISM_POOL);
        T_CHECK(allocated(c) == base + n);
        cubuf_ipc_descriptor_destroy(d);
        T_CHECK(allocated(c) == base + n);
    }
    T_OK(cubuf_buffer_close(b));
    T_CHECK(allocated(c) == base);
    cubuf_buffer_release(b);
}

static void test_two_contexts(void)
{
    cubuf_context_t *a = NULL, *b = NULL;
    T_REQUIRE(cubuf_context_create(0, &a));
    T_REQUIRE(cubuf_context_create(0, &b));
    cubuf_buffer_t *x = NULL, *y = NULL, *z = NULL;
    T_REQUIRE(cubuf_context_new_buffer(a, 1000, &x));
    T_REQUIRE(cubuf_context_new_buffer(b, 2000, &y));
    T_REQUIRE(cubuf_context_new_host_buffer(b, 300, &z));
    T_CHECK(allocated(a) == 1000 && allocated(b) == 2300);
    /* copy_to without a destination counts in the source's context. */
    cubuf_buffer_t *w = NULL;
    T_OK(cubuf_buffer_copy_to_new(x, CU_STREAM_LEGACY, NULL, &w));
    T_CHECK(allocated(a) == 2000 && allocated(b) == 2300);
    cubuf_buffer_release(x);
    T_CHECK(allocated(a) == 1000 && allocated(b) == 2300);
    cubuf_buffer_release(w);
    cubuf_buffer_release(y);
    T_CHECK(allocated(a) == 0 && allocated(b) == 300);
    /* A buffer keeps its context alive past destroy. */
    cubuf_context_destroy(b);
    T_OK(cubuf_buffer_fill_byte(z, 1, CU_STREAM_LEGACY));
    T_CU(cuCtxSynchronize);
    T_CHECK(((unsigned char *)(uintptr_t)cubuf_buffer_ptr(z))[299] == 1);
    cubuf_buffer_release(z);
    cubuf_context_destroy(a);
}

static void test_host_buffer(cubuf_context_t *c)
{
    const size_t n = 1000;
    cubuf_buffer_t *h = NULL, *d = NULL;
    T_REQUIRE(cubuf_context_new_host_buffer(c, n, &h));
    T_CHECK(allocated(c) == n);
    T_CHECK(cubuf_buffer_is_host_accessible(h) && cubuf_buffer_is_device_accessible(h));
    T_CHECK(cubuf_buffer_device_id(h) == -1 && !cubuf_buffer_is_managed(h));
    T_CU(cuCtxSynchronize);
    unsigned char *p = (unsigned char *)(uintptr_t)cubuf_buffer_ptr(h);
    fill_pattern(p, n, 5); /* the host writes it directly */
    T_REQUIRE(cubuf_context_new_buffer(c, n, &d));
    T_OK(cubuf_buffer_copy_from(d, h, CU_STREAM_LEGACY, NULL));
    T_CHECK(holds(d, 5, 0));
    T_OK(cubuf_buffer_fill_byte(h, 0x77, CU_STREAM_LEGACY)); /* and the device too */
    T_CU(cuCtxSynchronize);
    T_CHECK(p[0] == 0x77 && p[n - 1] == 0x77);
    /* The device address of pinned pool memory. */
    CUdeviceptr da = 0;
    T_OK(cubuf_context_device_address(c, p, &da));
    T_CHECK(da != 0);
    /* The pool behind it granted the device access (copies at pinned speed). */
    CUmemLocation loc = {CU_MEM_LOCATION_TYPE_DEVICE, 0};
    CUmemAccess_flags flags = CU_MEM_ACCESS_FLAGS_PROT_NONE;
    T_CU(cuMemPoolGetAccess, &flags, cubuf__pool_handle(cubuf_buffer_resource(h)), &loc);
    T_CHECK(flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    cubuf_buffer_release(h);
    cubuf_buffer_release(d);
    T_CHECK(allocated(c) == 0);
    /* Sizes 0, 1 and 1 GiB: counted, written by the device, read by the host. */
    const size_t sizes[] = {0, 1, (size_t)1 << 30};
    for (size_t k = 0; k < 3; k++) {
        cubuf_buffer_t *e = NULL;
        T_REQUIRE(cubuf_context_new_host_buffer(c, sizes[k], &e));
        T_CHECK(cubuf_buffer_size(e) == sizes[k] && allocated(c) == sizes[k]);
        if (sizes[k]) {
            T_OK(cubuf_buffer_fill_byte(e, 0x5a, CU_STREAM_LEGACY));
            T_CU(cuCtxSynchronize);
            const unsigned char *q = (const unsigned char *)(uintptr_t)cubuf_buffer_ptr(e);
            T_CHECK(q[0] == 0x5a && q[sizes[k] - 1] == 0x5a && q[sizes[k] / 2] == 0x5a);
        }
        cubuf_buffer_release(e);
        T_CHECK(allocated(c) == 0);
    }
}

/* buffer_from_data's offset and size rules over one kind of source. */
static void from_data_rules(cubuf_context_t *c, const void *data, size_t n, unsigned seed,
                            const char *kind)
{
    struct {
        int64_t offset, size;
        size_t expect; /* bytes, or SIZE_MAX for OUT_OF_RANGE */
    } cases[] = {
        {0, CUBUF_SIZE_REST, n}, {10, CUBUF_SIZE_REST, n - 10}, {10, 20, 20}, {0, 0, 0},
        {(int64_t)n - 1, CUBUF_SIZE_REST, 1}, {(int64_t)n - 1, 1, 1}, {0, (int64_t)n, n},
        {(int64_t)n, CUBUF_SIZE_REST, SIZE_MAX}, {(int64_t)n, 0, SIZE_MAX},
        {-1, CUBUF_SIZE_REST, SIZE_MAX}, {(int64_t)n + 1, 0, SIZE_MAX},
        {0, (int64_t)n + 1, SIZE_MAX}, {10, (int64_t)n - 9, SIZE_MAX}, {0, -2, SIZE_MAX},
        {0, INT64_MIN, SIZE_MAX}, {INT64_MAX, CUBUF_SIZE_REST, SIZE_MAX},
        {1, INT64_MAX, SIZE_MAX}, {INT64_MIN, 1, SIZE_MAX},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        size_t base = allocated(c);
        cubuf_buffer_t *b = NULL;
        cubuf_status_t st = cubuf_context_buffer_from_data(c, data, n, cases[k].offset,
                                                           cases[k].size, &b);
        if (cases[k].expect == SIZE_MAX) {
            if (st != CUBUF_ERROR_OUT_OF_RANGE) {
                fprintf(stderr, "%s: offset %lld size %lld gave %s, expected OUT_OF_RANGE\n", kind,
                        (long long)cases[k].offset, (long long)cases[k].size,
                        cubuf_status_name(st));
                t_failures++;
            }
            T_CHECK(b == NULL && allocated(c) == base);
            continue;
        }
        if (st != CUBUF_SUCCESS) {
            fprintf(stderr, "%s: offset %lld size %lld failed: %s\n", kind,
                    (long long)cases[k].offset, (long long)cases[k].size, cubuf_last_error());
            t_failures++;
            continue;
        }
        T_CHECK(cubuf_buffer_size(b) == cases[k].expect);
        T_CHECK(allocated(c) == base + cases[k].expect);
        T_CHECK(cubuf_buffer_is_device_accessible(b) && cubuf_buffer_device_id(b) == 0);
        if (!holds(b, seed, (size_t)cases[k].offset)) {
            fprintf(stderr, "%s: offset %lld size %lld: wrong data\n", kind,
                    (long long)cases[k].offset, (long long)cases[k].size);
            t_failures++;
        }
        cubuf_buffer_release(b);
        T_CHECK(allocated(c) == base);
    }
}

static void test_from_data(cubuf_context_t *c)
{
    const size_t n = 1000;
    /* Pageable. */
    unsigned char *pageable = malloc(n);
    fill_pattern(pageable, n, 1);
    from_data_rules(c, pageable, n, 1, "pageable");
    /* The copy has completed on return: changing the source afterwards changes nothing. */
    cubuf_buffer_t *b = NULL;
    T_REQUIRE(cubuf_context_buffer_from_data(c, pageable, n, 0, CUBUF_SIZE_REST, &b));
    memset(pageable, 0, n);
    T_CHECK(holds(b, 1, 0));
    cubuf_buffer_release(b);
    free(pageable);

    /* Pinned. */
    void *pinned = NULL;
    T_CU(cuMemHostAlloc, &pinned, n, 0);
    fill_pattern(pinned, n, 2);
    from_data_rules(c, pinned, n, 2, "pinned");
    T_REQUIRE(cubuf_context_buffer_from_data(c, pinned, n, 0, CUBUF_SIZE_REST, &b));
    memset(pinned, 0, n);
    T_CHECK(holds(b, 2, 0));
    cubuf_buffer_release(b);
    T_CU(cuMemFreeHost, pinned);

    /* Device. */
    CUdeviceptr dev = 0;
    T_CU(cuMemAlloc, &dev, n);
    unsigned char *tmp = malloc(n);
    fill_pattern(tmp, n, 3);
    T_CU(cuMemcpyHtoD, dev, tmp, n);
    free(tmp);
    from_data_rules(c, (const void *)(uintptr_t)dev, n, 3, "device");
    T_CU(cuMemFree, dev);

    /* Empty data: offset 0 only. */
    cubuf_buffer_t *e = NULL;
    T_OK(cubuf_context_buffer_from_data(c, NULL, 0, 0, CUBUF_SIZE_REST, &e));
    T_CHECK(e && cubuf_buffer_size(e) == 0);
    cubuf_buffer_release(e);
    char one = 'x';
    e = NULL;
    T_OK(cubuf_context_buffer_from_data(c, &one, 0, 0, 0, &e));
    T_CHECK(e && cubuf_buffer_size(e) == 0);
    cubuf_buffer_release(e);
    e = NULL;
    T_STATUS(cubuf_context_buffer_from_data(c, &one, 0, 1, CUBUF_SIZE_REST, &e),
             CUBUF_ERROR_OUT_OF_RANGE);
    T_STATUS(cubuf_context_buffer_from_data(c, &one, 0, 0, 1, &e), CUBUF_ERROR_OUT_OF_RANGE);
    T_STATUS(cubuf_context_buffer_from_data(c, NULL, 10, 0, CUBUF_SIZE_REST, &e),
             CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_context_buffer_from_data(NULL, &one, 1, 0, CUBUF_SIZE_REST, &e),
             CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_context_buffer_from_data(c, &one, 1, 0, CUBUF_SIZE_REST, NULL),
             CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(e == NULL && allocated(c) == 0);
}

static void test_foreign(cubuf_context_t *c)
{
    cubuf_buffer_t *b = NULL;
    /* 0/0: an empty buffer; the owner still goes through release once. */
    releases = 0;
    T_REQUIRE(cubuf_context_foreign_buffer(c, 0, 0, NULL, &releases, count_release, &b));
    T_CHECK(cubuf_buffer_size(b) == 0 && cubuf_buffer_ptr(b) == 0 && !cubuf_buffer_is_closed(b));
    T_CHECK(cubuf_buffer_owner(b) == &releases);
    cubuf_buffer_release(b);
    T_CHECK(releases == 1);
    T_REQUIRE(cubuf_context_foreign_buffer(c, 0, 0, NULL, NULL, NULL, &b));
    cubuf_buffer_release(b);

    /* A view of device memory with an owner: not counted, released once. */
    CUdeviceptr dev = 0;
    T_CU(cuMemAlloc, &dev, 4096);
    releases = 0;
    T_REQUIRE(cubuf_context_foreign_buffer(c, dev + 16, 1024, NULL, &releases, count_release, &b));
    T_CHECK(cubuf_buffer_ptr(b) == dev + 16 && cubuf_buffer_size(b) == 1024);
    T_CHECK(cubuf_buffer_device_id(b) == 0 && cubuf_buffer_is_device_accessible(b));
    T_CHECK(cubuf_buffer_resource(b) == NULL && allocated(c) == 0);
    T_OK(cubuf_buffer_close(b));
    T_CHECK(releases == 1);
    cubuf_buffer_release(b);
    T_CHECK(releases == 1);
    /* Described in the context even when nothing is current. */
    T_CU(cuCtxSetCurrent, NULL);
    T_REQUIRE(cubuf_context_foreign_buffer(c, dev, 4096, NULL, NULL, NULL, &b));
    T_CHECK(cubuf_buffer_device_id(b) == 0 && cubuf_buffer_is_device_accessible(b));
    CUcontext cur = (CUcontext)(uintptr_t)1;
    T_CU(cuCtxGetCurrent, &cur);
    T_CHECK(cur == NULL);
    T_CU(cuCtxSetCurrent, ctx);
    cubuf_buffer_release(b);
    T_CU(cuMemFree, dev);

    /* Errors leave the owner with the caller. */
    releases = 0;
    b = NULL;
    T_STATUS(cubuf_context_foreign_buffer(c, 0, 16, NULL, &releases, count_release, &b),
             CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_context_foreign_buffer(NULL, 0, 0, NULL, &releases, count_release, &b),
             CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_context_foreign_buffer(c, 0, 0, NULL, &releases, count_release, NULL),
             CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(releases == 0 && b == NULL);
}

/* A view made through a context runs its work there: copied into a host
 * view with no context current, filled on stream 0 from a foreign context
 * (cubuf.h, "Default streams"). */
static void test_view_context(cubuf_context_t *c)
{
    CUdeviceptr dev = 0;
    T_CU(cuMemAlloc, &dev, 4096);
    T_CU(cuMemsetD8, dev, 0x3c, 4096);
    unsigned char host[4096];
    memset(host, 0, sizeof host);
    cubuf_buffer_t *hv = NULL, *v = NULL, *sv = NULL;
    T_REQUIRE(cubuf_buffer_view((CUdeviceptr)(uintptr_t)host, sizeof host, &hv));
    T_REQUIRE(cubuf_context_foreign_buffer(c, dev, 4096, NULL, NULL, NULL, &v));
    T_REQUIRE(cubuf_context_buffer_from_strided(c, dev, 1, ((int64_t[]){1024}),
                                                ((int64_t[]){4}), 4, NULL, NULL, NULL, &sv));
    T_CU(cuCtxSetCurrent, NULL);
    T_OK(cubuf_buffer_copy_from(hv, v, NULL, NULL)); /* runs in c, on its legacy stream */
    T_OK(cubuf_context_synchronize(c));
    T_CHECK(host[0] == 0x3c && host[4095] == 0x3c);
    CUcontext other = NULL;
    T_CU(cuCtxCreate, &other, NULL, 0, 0);
    T_CHECK(cubuf__buffer_exec_ctx(sv) == ctx && cubuf__buffer_exec_ctx(v) == ctx);
    T_OK(cubuf_buffer_fill_byte(sv, 0x5d, NULL)); /* c's legacy stream, not other's */
    T_OK(cubuf_buffer_copy_from(hv, sv, NULL, NULL));
    T_OK(cubuf_context_synchronize(c));
    T_CHECK(host[0] == 0x5d && host[4095] == 0x5d);
    T_CU(cuCtxDestroy, other);
    T_CU(cuCtxSetCurrent, NULL);
    cubuf_buffer_release(v); /* drops the view's hold on c with nothing current */
    cubuf_buffer_release(sv);
    cubuf_buffer_release(hv);
    T_CU(cuCtxSetCurrent, ctx);
    T_CU(cuMemFree, dev);
}

/* Views with a base (pyarrow's base): the base cannot be closed while the
 * view is open, and its memory outlives its own handle. */
static void test_view_base(cubuf_context_t *c)
{
    size_t before = allocated(c);
    cubuf_buffer_t *base = NULL, *v = NULL, *sv = NULL;
    T_REQUIRE(cubuf_context_new_buffer(c, 8192, &base));
    T_OK(cubuf_buffer_fill_byte(base, 0x61, CU_STREAM_LEGACY));
    CUdeviceptr p = cubuf_buffer_ptr(base);
    releases = 0;
    T_REQUIRE(cubuf_context_foreign_buffer(c, p + 4096, 4096, base, &releases, count_release, &v));
    T_REQUIRE(cubuf_context_buffer_from_strided(c, p, 2, ((int64_t[]){16, 16}),
                                                ((int64_t[]){256, 8}), 8, base, NULL, NULL, &sv));
    T_CHECK(cubuf_buffer_parent(v) == base && cubuf_buffer_parent(sv) == base);
    T_CHECK(cubuf_buffer_owner(v) == &releases);
    T_STATUS(cubuf_buffer_close(base), CUBUF_ERROR_BUSY);
    T_CHECK(!cubuf_buffer_is_closed(base) && allocated(c) == before + 8192);
    /* The base's handle goes; its memory stays for the views. */
    cubuf_buffer_release(base);
    T_CHECK(allocated(c) == before + 8192);
    unsigned char h[4096];
    T_OK(cubuf_buffer_copy_to_host(v, 0, -1, h, sizeof h, CU_STREAM_LEGACY, NULL));
    T_CHECK(h[0] == 0x61 && h[4095] == 0x61);
    cubuf_buffer_release(sv);
    T_CHECK(allocated(c) == before + 8192 && releases == 0);
    cubuf_buffer_release(v);
    T_CHECK(allocated(c) == before && releases == 1);

    /* A view made through another context over a base runs where the base's
     * memory belongs (cubuf.h, "Default streams"). */
    CUcontext priv = NULL, popped = NULL;
    T_CU(cuCtxCreate, &priv, NULL, 0, 0); /* pushed */
    T_CU(cuCtxPopCurrent, &popped);        /* ctx is current again */
    cubuf_context_t *other = NULL;
    T_REQUIRE(cubuf_context_wrap(priv, &other));
    T_REQUIRE(cubuf_context_new_buffer(c, 4096, &base));
    T_REQUIRE(cubuf_context_foreign_buffer(other, cubuf_buffer_ptr(base), 4096, base, NULL, NULL, &v));
    T_CHECK(cubuf__buffer_exec_ctx(v) == ctx);
    cubuf_buffer_release(v);
    /* Over a base that names no context (a plain view), the view runs in
     * the context it was made through, and so do its slices. */
    cubuf_buffer_t *plain = NULL, *part = NULL;
    T_REQUIRE(cubuf_buffer_view(cubuf_buffer_ptr(base), 4096, &plain));
    T_REQUIRE(cubuf_context_foreign_buffer(other, cubuf_buffer_ptr(base), 4096, plain, NULL, NULL, &v));
    T_REQUIRE(cubuf_buffer_slice(v, 1024, 1024, &part));
    T_CHECK(cubuf__buffer_exec_ctx(v) == priv && cubuf__buffer_exec_ctx(part) == priv);
    T_CHECK(cubuf_buffer_parent(part) == plain);
    cubuf_buffer_release(part);
    cubuf_buffer_release(v);
    cubuf_buffer_release(plain);
    cubuf_buffer_release(base);
    cubuf_context_destroy(other);
    T_CU(cuCtxDestroy, priv);
    T_CU(cuCtxSetCurrent, ctx);

    /* Refusals change nothing: a range outside the base, a closed base. */
    T_REQUIRE(cubuf_context_new_buffer(c, 4096, &base));
    v = (cubuf_buffer_t *)&v;
    T_STATUS(cubuf_context_foreign_buffer(c, cubuf_buffer_ptr(base) + 1, 4096, base, &releases,
                                          count_release, &v), CUBUF_ERROR_OUT_OF_RANGE);
    T_STATUS(cubuf_context_buffer_from_strided(c, cubuf_buffer_ptr(base), 1, ((int64_t[]){2}),
                                               ((int64_t[]){4096}), 1, base, NULL, NULL, &v),
             CUBUF_ERROR_OUT_OF_RANGE);
    /* An empty range outside the base, before it and past its end; an
     * empty strided array there. */
    T_STATUS(cubuf_context_foreign_buffer(c, cubuf_buffer_ptr(base) - 1, 0, base, NULL, NULL, &v),
             CUBUF_ERROR_OUT_OF_RANGE);
    T_STATUS(cubuf_context_foreign_buffer(c, cubuf_buffer_ptr(base) + 4097, 0, base, NULL, NULL, &v),
             CUBUF_ERROR_OUT_OF_RANGE);
    T_STATUS(cubuf_context_buffer_from_strided(c, cubuf_buffer_ptr(base) + 8192, 1, ((int64_t[]){0}),
                                               ((int64_t[]){4}), 4, base, NULL, NULL, &v),
             CUBUF_ERROR_OUT_OF_RANGE);
    T_CHECK(v == (cubuf_buffer_t *)&v && cubuf__inspect_buffer_refs(base) == 1 &&
            cubuf__inspect_open_slices(base) == 0 && releases == 1);
    /* Empty ranges inside: at the base's end, and the empty buffer. */
    T_OK(cubuf_context_foreign_buffer(c, cubuf_buffer_ptr(base) + 4096, 0, base, NULL, NULL, &v));
    T_CHECK(cubuf_buffer_size(v) == 0);
    cubuf_buffer_release(v);
    T_OK(cubuf_context_foreign_buffer(c, 0, 0, base, NULL, NULL, &v));
    T_CHECK(cubuf_buffer_size(v) == 0 && cubuf_buffer_ptr(v) == 0);
    cubuf_buffer_release(v);
    T_OK(cubuf_buffer_close(base));
    T_STATUS(cubuf_context_foreign_buffer(c, 0, 0, base, NULL, NULL, &v), CUBUF_ERROR_CLOSED);
    cubuf_buffer_release(base);
    T_CHECK(allocated(c) == before);
}

/* Host copies (pyarrow's copy_to_host / copy_from_host): bytes at a
 * position, "as much as fits", complete on return. */
static void test_host_copies(cubuf_context_t *c)
{
    cubuf_buffer_t *b = NULL;
    T_REQUIRE(cubuf_context_new_buffer(c, 1000, &b));
    unsigned char in[600], out[1000];
    for (size_t i = 0; i < sizeof in; i++) in[i] = (unsigned char)(i * 13 + 1);
    T_OK(cubuf_buffer_fill_byte(b, 0, CU_STREAM_LEGACY));
    size_t n = 0;
    T_OK(cubuf_buffer_copy_from_host(b, in, sizeof in, 500, -1, CU_STREAM_LEGACY, &n));
    T_CHECK(n == 500); /* the rest of the buffer */
    T_OK(cubuf_buffer_copy_from_host(b, in, sizeof in, 10, 20, CU_STREAM_PER_THREAD, &n));
    T_CHECK(n == 20);
    memset(out, 0xff, sizeof out);
    T_OK(cubuf_buffer_copy_to_host(b, 0, -1, out, sizeof out, CU_STREAM_LEGACY, &n));
    T_CHECK(n == 1000);
    bool ok = true;
    for (size_t i = 0; i < 1000; i++) {
        unsigned char want = i >= 500 ? in[i - 500] : (i >= 10 && i < 30) ? in[i - 10] : 0;
        ok = ok && out[i] == want;
    }
    T_CHECK(ok);
    /* nbytes -1 into a smaller host buffer: as much as fits. */
    unsigned char small[100];
    T_OK(cubuf_buffer_copy_to_host(b, 500, -1, small, sizeof small, NULL, &n));
    T_CHECK(n == 100 && memcmp(small, in, 100) == 0);
    T_STATUS(cubuf_buffer_copy_to_host(b, 990, 11, out, sizeof out, NULL, &n), CUBUF_ERROR_OUT_OF_RANGE);
    /* On a capturing stream: refused, the capture intact. */
    CUstream cs = NULL;
    T_CU(cuStreamCreate, &cs, CU_STREAM_NON_BLOCKING);
    T_CU(cuStreamBeginCapture, cs, CU_STREAM_CAPTURE_MODE_RELAXED);
    T_STATUS(cubuf_buffer_copy_to_host(b, 0, -1, out, sizeof out, cs, &n), CUBUF_ERROR_STREAM_CAPTURING);
    CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
    T_CU(cuStreamIsCapturing, cs, &st);
    T_CHECK(st == CU_STREAM_CAPTURE_STATUS_ACTIVE);
    CUgraph g = NULL;
    T_CU(cuStreamEndCapture, cs, &g);
    if (g) T_CU(cuGraphDestroy, g);
    T_CU(cuStreamDestroy, cs);
    /* Every driver call on the path fails once in turn: an error, or the bytes. */
    bool done = false;
    for (unsigned nth = 1; nth < 50 && !done; nth++) {
        memset(out, 0xff, sizeof out);
        cubuf_fault_fail_any_nth(nth, CUDA_ERROR_UNKNOWN);
        cubuf_status_t r = cubuf_buffer_copy_to_host(b, 500, 100, out, 100, NULL, &n);
        cubuf_fault_reset();
        if (r == CUBUF_SUCCESS) done = memcmp(out, in, 100) == 0 && n == 100;
        else T_CHECK(r == CUBUF_ERROR_DRIVER);
        T_CU(cuCtxSynchronize); /* a copy enqueued before a failed sync still writes `out` */
    }
    T_CHECK(done);
    cubuf_buffer_release(b);
}

static void test_device_address(cubuf_context_t *c)
{
    CUdeviceptr d = 0, dpin = 0, out = 0;
    /* Device and managed pointers are their own device address. */
    CUdeviceptr dev = 0, managed = 0;
    T_CU(cuMemAlloc, &dev, 4096);
    T_OK(cubuf_context_device_address(c, (const void *)(uintptr_t)(dev + 100), &out));
    T_CHECK(out == dev + 100);
    T_CU(cuMemAllocManaged, &managed, 4096, CU_MEM_ATTACH_GLOBAL);
    T_OK(cubuf_context_device_address(c, (const void *)(uintptr_t)managed, &out));
    T_CHECK(out == managed);

    /* Pinned host memory gives its device alias, interior pointers included. */
    void *pinned = NULL;
    T_CU(cuMemHostAlloc, &pinned, 4096, CU_MEMHOSTALLOC_DEVICEMAP);
    T_CU(cuMemHostGetDevicePointer, &dpin, pinned, 0);
    T_OK(cubuf_context_device_address(c, pinned, &out));
    T_CHECK(out == dpin);
    T_OK(cubuf_context_device_address(c, (char *)pinned + 100, &out));
    T_CHECK(out == dpin + 100);

    /* Registered host memory too. */
    void *reg = NULL;
    if (posix_memalign(&reg, 4096, 8192) == 0) {
        CUresult r = cubuf__drv.cuMemHostRegister(reg, 8192, CU_MEMHOSTREGISTER_DEVICEMAP);
        if (r == CUDA_SUCCESS) {
            T_CU(cuMemHostGetDevicePointer, &d, reg, 0);
            T_OK(cubuf_context_device_address(c, (char *)reg + 8, &out));
            T_CHECK(out == d + 8);
            T_CU(cuMemHostUnregister, reg);
        } else {
            printf("note: cuMemHostRegister failed (%d); registered case not checked\n", (int)r);
        }
    }

    /* Pageable memory: a clear error. The caller's context stays current. */
    char *pageable = malloc(4096);
    out = 12345;
    T_STATUS(cubuf_context_device_address(c, pageable, &out), CUBUF_ERROR_INVALID_ARGUMENT);
    T_CHECK(strstr(cubuf_last_error(), "pageable") != NULL);
    T_CHECK(out == 12345);
    if (reg) {
        T_STATUS(cubuf_context_device_address(c, reg, &out), CUBUF_ERROR_INVALID_ARGUMENT);
        free(reg);
    }
    CUcontext cur = NULL;
    T_CU(cuCtxGetCurrent, &cur);
    T_CHECK(cur == ctx);
    /* With nothing current it still answers in the context. */
    T_CU(cuCtxSetCurrent, NULL);
    T_OK(cubuf_context_device_address(c, pinned, &out));
    T_CHECK(out == dpin);
    T_CU(cuCtxGetCurrent, &cur);
    T_CHECK(cur == NULL);
    T_CU(cuCtxSetCurrent, ctx);

    T_STATUS(cubuf_context_device_address(c, NULL, &out), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_context_device_address(c, pageable, NULL), CUBUF_ERROR_INVALID_ARGUMENT);
    T_STATUS(cubuf_context_device_address(NULL, pageable, &out), CUBUF_ERROR_INVALID_ARGUMENT);
    free(pageable);
    T_CU(cuMemFreeHost, pinned);
    T_CU(cuMemFree, managed);
    T_CU(cuMemFree, dev);
}

/* Eight threads race to make a fresh context's pool. */
typedef struct race {
    cubuf_context_t *c;
    cubuf_buffer_t *buf;
    cubuf_status_t st;
} race_t;

static void *race_new_buffer(void *arg)
{
    race_t *r = arg;
    r->st = cubuf_context_new_buffer(r->c, 1 << 16, &r->buf);
    return NULL;
}

static void test_pool_race(void)
{
    cubuf_context_t *c = NULL;
    T_REQUIRE(cubuf_context_create(0, &c));
    race_t r[8];
    pthread_t t[8];
    for (int i = 0; i < 8; i++) {
        r[i] = (race_t){c, NULL, CUBUF_ERROR_DRIVER};
        T_CHECK(pthread_create(&t[i], NULL, race_new_buffer, &r[i]) == 0);
    }
    for (int i = 0; i < 8; i++) pthread_join(t[i], NULL);
    for (int i = 0; i < 8; i++) {
        T_OK(r[i].st);
        T_CHECK(r[i].buf && cubuf_buffer_resource(r[i].buf) == cubuf_buffer_resource(r[0].buf));
    }
    T_CHECK(allocated(c) == 8u << 16);
    for (int i = 0; i < 8; i++) cubuf_buffer_release(r[i].buf);
    T_CHECK(allocated(c) == 0);
    cubuf_context_destroy(c);
}

/* Fails every driver call on an allocating path in turn, on a fresh context
 * (so the pool's creation is on the path too). */
typedef cubuf_status_t (*make_fn)(cubuf_context_t *c, cubuf_buffer_t **out);

static cubuf_status_t make_device(cubuf_context_t *c, cubuf_buffer_t **out)
{
    return cubuf_context_new_buffer(c, 4096, out);
}
static cubuf_status_t make_host(cubuf_context_t *c, cubuf_buffer_t **out)
{
    return cubuf_context_new_host_buffer(c, 4096, out);
}
static unsigned char source[512];
static cubuf_status_t make_from_data(cubuf_context_t *c, cubuf_buffer_t **out)
{
    return cubuf_context_buffer_from_data(c, source, sizeof source, 12, CUBUF_SIZE_REST, out);
}

/* Pool allocations the driver made minus those it freed while calls were
 * counted (the failed call, `fired`, made nothing). */
static long net_allocations(const char *fired)
{
    long allocs = (long)cubuf_fault_calls("cuMemAllocFromPoolAsync") -
                  (strcmp(fired, "cuMemAllocFromPoolAsync") == 0);
    long frees = (long)cubuf_fault_calls("cuMemFreeAsync") - (strcmp(fired, "cuMemFreeAsync") == 0);
    return allocs - frees;
}

/* Fails every driver call (alloc false) or every host allocation (alloc
 * true) on the path in turn: first in a new context, then again once the
 * context has made its pool (the path is shorter then, so the failures
 * land on its later calls: buffer_from_data's copy and its wait). */
static void fault_path(make_fn make, const char *name, bool alloc)
{
    cubuf_context_t *c = NULL;
    T_REQUIRE(cubuf_context_create(0, &c));
    for (int round = 0; round < 2; round++) {
        unsigned failures = 0;
        bool succeeded = false;
        for (unsigned nth = 1; nth < 300 && !succeeded; nth++) {
            cubuf_buffer_t *b = NULL;
            cubuf_fault_count_calls(true);
            if (alloc) t_fail_alloc_nth(nth);
            else cubuf_fault_fail_any_nth(nth, CUDA_ERROR_OUT_OF_MEMORY);
            cubuf_status_t st = make(c, &b);
            bool fired = cubuf_fault_fired();
            if (fired) T_CHECK(cubuf_fault_fired_alloc() == alloc);
            if (fired && alloc) T_STATUS(st, CUBUF_ERROR_OUT_OF_MEMORY);
            long net = net_allocations(fired ? cubuf_fault_fired_name() : "");
            cubuf_fault_reset();
            /* The driver's own count: what a failure allocated, it freed. */
            if (net != (st == CUBUF_SUCCESS ? 1 : 0)) {
                fprintf(stderr, "%s: failing %s (n=%u) left %ld pool allocations in the driver\n", name,
                        fired ? cubuf_fault_fired_name() : "nothing", nth, net - (st == CUBUF_SUCCESS));
                t_failures++;
            }
            if (!fired) {
                T_CHECK(st == CUBUF_SUCCESS && b != NULL);
                if (make == make_from_data) T_CHECK(holds(b, 9, 12));
                cubuf_buffer_release(b);
                succeeded = true;
                break;
            }
            failures++;
            if (st == CUBUF_SUCCESS) {
                fprintf(stderr, "%s succeeded although %s failed (n=%u)\n", name,
                        cubuf_fault_fired_name(), nth);
                t_failures++;
                cubuf_buffer_release(b);
            } else if (b != NULL || allocated(c) != 0) {
                fprintf(stderr, "%s: failing %s (n=%u) left out=%p, bytes_allocated %zu\n", name,
                        cubuf_fault_fired_name(), nth, (void *)b, allocated(c));
                t_failures++;
            }
            /* The caller's context is restored on every failure. */
            CUcontext cur = NULL;
            T_CU(cuCtxGetCurrent, &cur);
            T_CHECK(cur == ctx);
        }
        cubuf_fault_count_calls(false);
        T_CHECK(succeeded && failures >= (alloc ? 1u : 2u));
        T_CHECK(allocated(c) == 0);
    }
    cubuf_context_destroy(c);
}

int main(void)
{
    t_require_gpu();
    cubuf_context_t *c = NULL;
    T_REQUIRE(cubuf_context_create(0, &c));
    T_OK(cubuf_context_handle(c, &ctx));
    T_CU(cuCtxSetCurrent, ctx);

    test_new_buffer(c);
    test_exported(c);
    test_two_contexts();
    test_host_buffer(c);
    test_from_data(c);
    test_foreign(c);
    test_view_context(c);
    test_view_base(c);
    test_host_copies(c);
    test_device_address(c);
    test_pool_race();
    fill_pattern(source, sizeof source, 9);
    for (int alloc = 0; alloc < 2; alloc++) {
        fault_path(make_device, "cubuf_context_new_buffer", alloc);
        fault_path(make_host, "cubuf_context_new_host_buffer", alloc);
        fault_path(make_from_data, "cubuf_context_buffer_from_data", alloc);
    }

    T_CHECK(allocated(c) == 0);
    T_CU(cuCtxSynchronize);
    T_CU(cuCtxSetCurrent, NULL);
    cubuf_context_destroy(c);
    return t_finish("test_context_buffers");
}
