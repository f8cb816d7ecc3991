/* Grow a virtual-memory buffer from 2 MiB to 1 GiB without copying, and show
 * that data written before each grow is still there after it.
 * Build: part of the cubuf build (example_grow). Run: ./build/examples/example_grow */
#include <cubuf.h>
#include <stdio.h>
#include <string.h>

#define TRY(expr)                                                                       \
    do {                                                                                \
        cubuf_status_t st_ = (expr);                                                    \
        if (st_ != CUBUF_SUCCESS) {                                                     \
            fprintf(stderr, "%s: %s: %s\n", #expr, cubuf_status_name(st_), cubuf_last_error()); \
            rc = st_ == CUBUF_ERROR_NO_DRIVER || st_ == CUBUF_ERROR_NO_DEVICE ? 77 : 1;  \
            goto done;                                                                  \
        }                                                                               \
    } while (0)

int main(void)
{
    int rc = 0;
    cubuf_context_t *ctx = NULL;
    cubuf_resource_t *vmm = NULL;
    cubuf_buffer_t *buf = NULL, *probe = NULL, *host = NULL;
    const char msg[] = "written before the first grow";

    int devices = 0;
    cubuf_status_t found = cubuf_device_count(&devices);
    if (found != CUBUF_SUCCESS || devices == 0) {
        printf("SKIP: needs 1 CUDA device(s): %s\n",
               found != CUBUF_SUCCESS ? cubuf_last_error() : "not enough devices");
        return 77;
    }
    TRY(cubuf_context_create(0, &ctx));
    TRY(cubuf_vmm_resource_create(0, NULL, &vmm));
    TRY(cubuf_resource_allocate(vmm, 2u << 20, CU_STREAM_PER_THREAD, &buf));
    TRY(cubuf_context_buffer_from_data(ctx, msg, sizeof msg, 0, CUBUF_SIZE_REST, &probe));
    cubuf_buffer_t *head = NULL;
    TRY(cubuf_buffer_slice(buf, 0, sizeof msg, &head));
    cubuf_status_t st = cubuf_buffer_copy_from(head, probe, CU_STREAM_PER_THREAD, NULL);
    cubuf_buffer_release(head);
    TRY(st);

    for (size_t size = 4u << 20; size <= (1u << 30); size *= 2) {
        cubuf_buffer_t *grown = NULL;
        CUdeviceptr before = cubuf_buffer_ptr(buf);
        TRY(cubuf_vmm_modify_allocation(vmm, buf, size, NULL, &grown));
        printf("grew to %5zu MiB %s\n", cubuf_buffer_size(grown) >> 20,
               cubuf_buffer_ptr(grown) == before ? "in place" : "by remapping elsewhere");
        /* The old buffer aliases the new one: closing it frees nothing and
         * does not wait for its stream (the final close waits for that work). */
        cubuf_buffer_release(buf);
        buf = grown;
    }

    TRY(cubuf_context_new_host_buffer(ctx, sizeof msg, &host));
    TRY(cubuf_buffer_slice(buf, 0, sizeof msg, &head));
    st = cubuf_buffer_copy_from(host, head, CU_STREAM_PER_THREAD, NULL);
    cubuf_buffer_release(head);
    TRY(st);
    TRY(cubuf_context_synchronize(ctx));
    const char *back = (const char *)(uintptr_t)cubuf_buffer_ptr(host);
    printf("after growing: \"%s\"\n", back);
    if (strcmp(back, msg) != 0) rc = 1;
done:
    cubuf_buffer_release(host);
    cubuf_buffer_release(probe);
    cubuf_buffer_release(buf);
    cubuf_resource_release(vmm);
    cubuf_context_destroy(ctx);
    return rc;
}
