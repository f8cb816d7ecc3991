/* Copies between two devices: cubuf_buffer_copy_from from a buffer of one
 * device into a buffer of the other (pyarrow's copy from another device),
 * against cuMemcpyPeerAsync of the same bytes on the same stream, both
 * directions, 64 MiB to 1 GiB, as bandwidth. Target: >= 0.98x raw.
 * The copy runs in the destination's context on a stream of that context,
 * the way cubuf runs it; peer access is left as the driver has it (cubuf
 * does not enable it). Exits 77 with fewer than two devices. */
#include "bench_common.h"

typedef struct peer_arg {
    cubuf_buffer_t *dst, *src;
    CUcontext dctx, sctx;
    size_t size;
    CUstream stream; /* of the destination's context */
} peer_arg_t;

static void raw_peer(void *p)
{
    const peer_arg_t *a = p;
    B_CU(cuMemcpyPeerAsync, cubuf_buffer_ptr(a->dst), a->dctx, cubuf_buffer_ptr(a->src), a->sctx,
         a->size, a->stream);
}

static void lib_peer(void *p)
{
    const peer_arg_t *a = p;
    B_OK(cubuf_buffer_copy_from(a->dst, a->src, a->stream, NULL));
}

/* The first and last byte of dst are src's (one value each run). */
static void check_copied(bench_env_t *env, const peer_arg_t *a, CUcontext dctx, unsigned char v)
{
    unsigned char h[2] = {0, 0};
    B_CU(cuCtxSetCurrent, dctx);
    B_CU(cuMemcpyDtoH, &h[0], cubuf_buffer_ptr(a->dst), 1);
    B_CU(cuMemcpyDtoH, &h[1], cubuf_buffer_ptr(a->dst) + a->size - 1, 1);
    if (h[0] != v || h[1] != v) bench_error(env, "peer copy of %zu bytes: wrong bytes", a->size);
}

int main(void)
{
    bench_env_t env;
    bench_init(&env, "bench_peer");
    int count = 0;
    B_OK(cubuf_device_count(&count));
    if (count < 2) {
        printf("bench_peer: %d device(s); copies between devices need two\n", count);
        return BENCH_SKIP;
    }
    bool can01 = false, can10 = false;
    B_OK(cubuf_device_can_access_peer(0, 1, &can01));
    B_OK(cubuf_device_can_access_peer(1, 0, &can10));
    printf("peer access possible: 0 -> 1 %s, 1 -> 0 %s (not enabled by cubuf or this program)\n",
           can01 ? "yes" : "no", can10 ? "yes" : "no");

    cubuf_context_t *c1 = NULL;
    B_OK(cubuf_context_create(1, &c1));
    CUcontext h0 = env.cu_ctx, h1 = NULL;
    B_OK(cubuf_context_handle(c1, &h1));
    /* Device 1's own stream and events, for the copies that run there. */
    bench_env_t env1 = env;
    B_CU(cuCtxSetCurrent, h1);
    B_CU(cuStreamCreate, &env1.stream, CU_STREAM_NON_BLOCKING);
    B_CU(cuEventCreate, &env1.ev_start, CU_EVENT_DEFAULT);
    B_CU(cuEventCreate, &env1.ev_stop, CU_EVENT_DEFAULT);
    B_CU(cuCtxSetCurrent, h0);

    cubuf_resource_t *r0 = NULL, *r1 = NULL;
    B_OK(cubuf_sync_device_resource_create(0, &r0));
    B_OK(cubuf_sync_device_resource_create(1, &r1));
    static const size_t sizes[] = {64 * BENCH_MIB, 256 * BENCH_MIB, BENCH_GIB};
    bench_section("copies between devices, bandwidth (cubuf: copy_from in the destination's "
                  "context; raw: cuMemcpyPeerAsync)");
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        size_t size = sizes[i];
        cubuf_buffer_t *b0 = NULL, *b1 = NULL;
        B_OK(cubuf_resource_allocate(r0, size, CU_STREAM_LEGACY, &b0));
        B_OK(cubuf_resource_allocate(r1, size, CU_STREAM_LEGACY, &b1));
        for (int dir = 0; dir < 2; dir++) {
            /* dir 0: device 0 -> device 1, run on device 1; dir 1: the reverse. */
            bench_env_t *e = dir ? &env : &env1;
            peer_arg_t a = {dir ? b0 : b1, dir ? b1 : b0, dir ? h0 : h1, dir ? h1 : h0, size,
                            e->stream};
            unsigned char v = (unsigned char)(0x11 * (i + 1) + dir);
            B_CU(cuCtxSetCurrent, a.sctx);
            B_CU(cuMemsetD8, cubuf_buffer_ptr(a.src), v, size);
            B_CU(cuCtxSetCurrent, a.dctx);
            bench_case_t c = {
                .group = "peer",
                .name = dir ? "device1_to_device0" : "device0_to_device1",
                .size = size,
                .mode = BENCH_BANDWIDTH,
                .stream = e->stream,
                .raw = raw_peer,
                .lib = lib_peer,
                .arg = &a,
                .sample_s = 4e-3,
                .max_batch = 64,
                .budget_s = 0.6,
                .min_pairs = 5,
                .max_pairs = 21,
                .target = BENCH_TARGET_GE,
                .bound = 0.98,
            };
            bench_compare(e, &c);
            B_CU(cuStreamSynchronize, e->stream);
            check_copied(&env, &a, a.dctx, v);
            if (e == &env1) { /* what the comparison found on device 1 */
                env.errors += env1.errors;
                env1.errors = 0;
            }
        }
        B_CU(cuCtxSetCurrent, h0);
        cubuf_buffer_release(b0);
        cubuf_buffer_release(b1);
    }

    B_CU(cuCtxSetCurrent, h1);
    B_CU(cuStreamDestroy, env1.stream);
    B_CU(cuEventDestroy, env1.ev_start);
    B_CU(cuEventDestroy, env1.ev_stop);
    B_CU(cuCtxSetCurrent, h0);
    cubuf_resource_release(r0);
    cubuf_resource_release(r1);
    cubuf_context_destroy(c1);
    int rc = bench_summary(&env, "bench_peer");
    bench_fini(&env);
    return rc;
}
