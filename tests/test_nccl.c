/* NCCL with cubuf memory: a one-rank communicator registers a VMM buffer
 * (two physical allocations) and a pool buffer (ncclCommRegister), runs an
 * all-reduce in place on each and deregisters; the bytes read back are the
 * reduction's (a pre-multiplied sum: with one rank, 2 * x, so a reduction
 * that did not run shows). libnccl.so.2 is loaded at run time from
 * $CUBUF_TEST_LIBNCCL (tools/gpu_suite.sh sets it from the device's Python
 * packages); without it the test is skipped. NCCL_NVLS_ENABLE=0. The
 * declarations below are NCCL's documented API (nccl.h is not used). */
#include <dlfcn.h>

#include "test.h"

typedef struct nccl_unique_id {
    char internal[128]; /* NCCL_UNIQUE_ID_BYTES */
} nccl_unique_id_t;
typedef struct ncclComm *nccl_comm_t;
typedef int nccl_result_t;    /* ncclResult_t: ncclSuccess 0 */
typedef int nccl_data_type_t; /* ncclDataType_t */
typedef int nccl_red_op_t;    /* ncclRedOp_t */
enum { NCCL_SUCCESS = 0, NCCL_FLOAT32 = 7, NCCL_SCALAR_HOST_IMMEDIATE = 1 };

static struct nccl {
    nccl_result_t (*GetVersion)(int *version);
    const char *(*GetErrorString)(nccl_result_t result);
    nccl_result_t (*GetUniqueId)(nccl_unique_id_t *id);
    nccl_result_t (*CommInitRank)(nccl_comm_t *comm, int nranks, nccl_unique_id_t id, int rank);
    nccl_result_t (*CommDestroy)(nccl_comm_t comm);
    nccl_result_t (*CommRegister)(nccl_comm_t comm, void *buff, size_t size, void **handle);
    nccl_result_t (*CommDeregister)(nccl_comm_t comm, void *handle);
    nccl_result_t (*RedOpCreatePreMulSum)(nccl_red_op_t *op, void *scalar, nccl_data_type_t type,
                                          int residence, nccl_comm_t comm);
    nccl_result_t (*RedOpDestroy)(nccl_red_op_t op, nccl_comm_t comm);
    nccl_result_t (*AllReduce)(const void *send, void *recv, size_t count, nccl_data_type_t type,
                               nccl_red_op_t op, nccl_comm_t comm, CUstream stream);
} nccl;

#define NCCL_CHECK(call)                                                                   \
    do {                                                                                   \
        nccl_result_t n_r_ = (call);                                                       \
        if (n_r_ != NCCL_SUCCESS) {                                                        \
            fprintf(stderr, "%s:%d: %s failed: %d %s\n", __FILE__, __LINE__, #call, n_r_,   \
                    nccl.GetErrorString(n_r_));                                            \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

static void load_nccl(void)
{
    const char *path = getenv("CUBUF_TEST_LIBNCCL");
    if (!path || !*path) {
        printf("SKIP: CUBUF_TEST_LIBNCCL is not set (the path of libnccl.so.2; tools/gpu_suite.sh "
               "sets it from the device's python3 packages)\n");
        exit(T_SKIP);
    }
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        /* Named but unusable: a broken setup, not a skip. */
        fprintf(stderr, "dlopen %s: %s\n", path, dlerror());
        exit(1);
    }
#define NCCL_SYM_(field)                                                                    \
    do {                                                                                    \
        *(void **)&nccl.field = dlsym(lib, "nccl" #field);                                  \
        if (!nccl.field) {                                                                  \
            fprintf(stderr, "%s has no nccl" #field "\n", path);                            \
            exit(1);                                                                        \
        }                                                                                   \
    } while (0)
    NCCL_SYM_(GetVersion);
    NCCL_SYM_(GetErrorString);
    NCCL_SYM_(GetUniqueId);
    NCCL_SYM_(CommInitRank);
    NCCL_SYM_(CommDestroy);
    NCCL_SYM_(CommRegister);
    NCCL_SYM_(CommDeregister);
    NCCL_SYM_(RedOpCreatePreMulSum);
    NCCL_SYM_(RedOpDestroy);
    NCCL_SYM_(AllReduce);
#undef NCCL_SYM_
}

static float value(size_t i) { return (float)(i % 1000) * 0.5f; } /* exact, and so is 2x */

/* Registers buf with comm, all-reduces it in place with "2 * sum", reads it back. */
static void reduce_in_place(const char *what, nccl_comm_t comm, cubuf_buffer_t *buf, CUstream stream)
{
    size_t size = cubuf_buffer_size(buf), count = size / sizeof(float);
    float *host = malloc(size);
    T_CHECK(host != NULL);
    if (!host) return;
    for (size_t i = 0; i < count; i++) host[i] = value(i);
    T_REQUIRE(cubuf_buffer_copy_from_host(buf, host, size, 0, -1, stream, NULL));
    void *reg = NULL;
    void *ptr = (void *)(uintptr_t)cubuf_buffer_ptr(buf);
    NCCL_CHECK(nccl.CommRegister(comm, ptr, size, &reg));
    float two = 2.0f;
    nccl_red_op_t op;
    NCCL_CHECK(nccl.RedOpCreatePreMulSum(&op, &two, NCCL_FLOAT32, NCCL_SCALAR_HOST_IMMEDIATE, comm));
    NCCL_CHECK(nccl.AllReduce(ptr, ptr, count, NCCL_FLOAT32, op, comm, stream));
    T_OK(cubuf_stream_synchronize(stream));
    NCCL_CHECK(nccl.RedOpDestroy(op, comm));
    NCCL_CHECK(nccl.CommDeregister(comm, reg));
    memset(host, 0, size);
    T_OK(cubuf_buffer_copy_to_host(buf, 0, -1, host, size, stream, NULL));
    size_t bad = count;
    for (size_t i = 0; i < count && bad == count; i++)
        if (host[i] != 2.0f * value(i)) bad = i;
    if (bad != count) {
        fprintf(stderr, "%s: element %zu is %g, expected %g\n", what, bad, (double)host[bad],
                2.0 * value(bad));
        t_failures++;
    }
    printf("%s: %zu bytes registered, reduced in place and read back\n", what, size);
    free(host);
}

int main(void)
{
    t_require_gpu();
    if (getenv("CUBUF_LIBCUDA")) {
        /* NCCL loads libcuda.so.1 itself: it cannot run on a stand-in driver. */
        printf("SKIP: NCCL needs the real driver, not CUBUF_LIBCUDA's\n");
        return T_SKIP;
    }
#if defined(__SANITIZE_ADDRESS__)
    /* LeakSanitizer would report what NCCL (not built with it) keeps. */
    printf("SKIP: an AddressSanitizer build: NCCL's own allocations are not cubuf's\n");
    return T_SKIP;
#endif
    setenv("NCCL_NVLS_ENABLE", "0", 1);
    load_nccl();
    int version = 0;
    NCCL_CHECK(nccl.GetVersion(&version));
    printf("NCCL %d\n", version);

    cubuf_context_t *ctx = NULL;
    T_REQUIRE(cubuf_context_create(0, &ctx));
    CUstream stream = NULL;
    T_REQUIRE(cubuf_stream_create(ctx, CU_STREAM_NON_BLOCKING, 0, &stream));
    nccl_unique_id_t id;
    NCCL_CHECK(nccl.GetUniqueId(&id));
    nccl_comm_t comm = NULL;
    NCCL_CHECK(nccl.CommInitRank(&comm, 1, id, 0));

    /* Virtual memory of two physical allocations (a grow), exportable as NCCL's own is. */
    cubuf_vmm_options_t o = CUBUF_VMM_OPTIONS_INIT;
    o.handle_type = CUBUF_VMM_HANDLE_POSIX_FD;
    cubuf_resource_t *vmm = NULL;
    cubuf_buffer_t *one = NULL, *grown = NULL;
    size_t gran = 0;
    T_REQUIRE(cubuf_vmm_resource_create(0, &o, &vmm));
    T_REQUIRE(cubuf_vmm_granularity(vmm, &gran));
    T_REQUIRE(cubuf_resource_allocate(vmm, gran, stream, &one));
    T_REQUIRE(cubuf_vmm_modify_allocation(vmm, one, 2 * gran, NULL, &grown));
    reduce_in_place("vmm", comm, grown, stream);

    /* A private stream-ordered pool. */
    cubuf_device_resource_options_t po = CUBUF_DEVICE_RESOURCE_OPTIONS_INIT;
    po.private_pool = true;
    cubuf_resource_t *pool = NULL;
    cubuf_buffer_t *pbuf = NULL;
    T_REQUIRE(cubuf_device_resource_create(0, &po, &pool));
    T_REQUIRE(cubuf_resource_allocate(pool, (size_t)4 << 20, stream, &pbuf));
    reduce_in_place("pool", comm, pbuf, stream);

    NCCL_CHECK(nccl.CommDestroy(comm));
    T_OK(cubuf_buffer_close(pbuf));
    cubuf_buffer_release(pbuf);
    cubuf_buffer_release(grown);
    cubuf_buffer_release(one);
    T_OK(cubuf_stream_synchronize(stream));
    cubuf_resource_release(pool);
    cubuf_resource_release(vmm);
    T_OK(cubuf_stream_destroy(stream));
    cubuf_context_destroy(ctx);
    return t_finish("test_nccl");
}
