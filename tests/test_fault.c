/* The fault-injection seam itself: by name, by position, counting, reset;
 * host allocation faults told apart from driver faults. */
#include "internal.h"
#include "test.h"

int main(void)
{
    t_require_gpu();
    cubuf_context_t *ctx = NULL;
    T_REQUIRE(cubuf_context_create(0, &ctx));

    T_CHECK(!cubuf_fault_fail_nth("cuNoSuchEntryPoint", 1, CUDA_ERROR_UNKNOWN));

    /* The second cuCtxSynchronize fails, the first and third succeed. */
    T_CHECK(cubuf_fault_fail_nth("cuCtxSynchronize", 2, CUDA_ERROR_ILLEGAL_ADDRESS));
    T_OK(cubuf_context_synchronize(ctx));
    T_CHECK(!cubuf_fault_fired());
    T_STATUS(cubuf_context_synchronize(ctx), CUBUF_ERROR_DRIVER);
    T_CHECK(cubuf_fault_fired());
    T_CHECK(strcmp(cubuf_fault_fired_name(), "cuCtxSynchronize") == 0);
    T_CHECK(cubuf_last_cuda_result() == CUDA_ERROR_ILLEGAL_ADDRESS);
    T_OK(cubuf_context_synchronize(ctx));

    /* OUT_OF_MEMORY maps to its own status. */
    T_CHECK(cubuf_fault_fail_nth("cuCtxSynchronize", 1, CUDA_ERROR_OUT_OF_MEMORY));
    T_STATUS(cubuf_context_synchronize(ctx), CUBUF_ERROR_OUT_OF_MEMORY);

    /* Any-call mode: loop until the operation succeeds; each step fails one call. */
    unsigned steps = 0;
    for (unsigned n = 1; n < 100; n++) {
        cubuf_fault_fail_any_nth(n, CUDA_ERROR_UNKNOWN);
        cubuf_status_t st = cubuf_context_synchronize(ctx);
        if (!cubuf_fault_fired()) {
            T_CHECK(st == CUBUF_SUCCESS);
            break;
        }
        T_CHECK(st != CUBUF_SUCCESS);
        steps++;
    }
    cubuf_fault_reset();
    T_CHECK(steps >= 1); /* at least cuCtxSynchronize itself */

    /* Counting calls. */
    cubuf_fault_count_calls(true);
    T_OK(cubuf_context_synchronize(ctx));
    T_OK(cubuf_context_synchronize(ctx));
    T_CHECK(cubuf_fault_calls("cuCtxSynchronize") == 2);
    T_CHECK(cubuf_fault_calls("cuMemAlloc") == 0);
    cubuf_fault_count_calls(false);

    /* Reset disarms a pending fault. */
    T_CHECK(cubuf_fault_fail_nth("cuCtxSynchronize", 1, CUDA_ERROR_UNKNOWN));
    cubuf_fault_reset();
    T_OK(cubuf_context_synchronize(ctx));

    /* A host allocation fault: OUT_OF_MEMORY, told apart from a driver fault,
     * nothing retained (the context object is allocated before the retain). */
    cubuf_fault_count_calls(true);
    cubuf_fault_fail_alloc_nth(1);
    cubuf_context_t *c2 = NULL;
    T_STATUS(cubuf_context_create(0, &c2), CUBUF_ERROR_OUT_OF_MEMORY);
    T_CHECK(c2 == NULL && cubuf_fault_fired() && cubuf_fault_fired_alloc());
    T_CHECK(strcmp(cubuf_fault_fired_name(), "host allocation") == 0);
    T_CHECK(cubuf_fault_calls("cuDevicePrimaryCtxRetain") == 0);
    T_CHECK(cubuf_fault_allocs() == 1);
    cubuf_fault_count_calls(false);
    T_OK(cubuf_context_create(0, &c2)); /* fired once */
    cubuf_context_destroy(c2);
    CUcontext handle = NULL;
    T_OK(cubuf_context_handle(ctx, &handle));
    cubuf_fault_fail_alloc_nth(1);
    c2 = NULL;
    T_STATUS(cubuf_context_wrap(handle, &c2), CUBUF_ERROR_OUT_OF_MEMORY);
    T_CHECK(c2 == NULL && cubuf_fault_fired_alloc());
    T_OK(cubuf_context_wrap(handle, &c2));
    cubuf_context_destroy(c2);

    /* Both armed: each fires on its own kind, once. Arming the driver fault
     * clears fired but leaves the allocation fault pending. */
    cubuf_fault_fail_alloc_nth(1);
    T_CHECK(cubuf_fault_fail_nth("cuCtxSynchronize", 1, CUDA_ERROR_UNKNOWN));
    T_STATUS(cubuf_context_synchronize(ctx), CUBUF_ERROR_DRIVER);
    T_CHECK(cubuf_fault_fired() && !cubuf_fault_fired_alloc());
    T_CHECK(strcmp(cubuf_fault_fired_name(), "cuCtxSynchronize") == 0);
    c2 = NULL;
    T_STATUS(cubuf_context_create(0, &c2), CUBUF_ERROR_OUT_OF_MEMORY);
    T_CHECK(c2 == NULL && cubuf_fault_fired_alloc());
    T_OK(cubuf_context_synchronize(ctx));
    T_OK(cubuf_context_create(0, &c2));
    cubuf_context_destroy(c2);

    /* Reset disarms a pending allocation fault too. */
    cubuf_fault_fail_alloc_nth(1);
    cubuf_fault_reset();
    T_OK(cubuf_context_create(0, &c2));
    T_CHECK(!cubuf_fault_fired());
    cubuf_context_destroy(c2);
    cubuf_context_destroy(ctx);
    return t_finish("test_fault");
}
