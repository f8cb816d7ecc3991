/* What the resource tests share: counting driver calls around injected faults. */
#ifndef CUBUF_RESOURCE_TEST_H
#define CUBUF_RESOURCE_TEST_H

#include "test.h"

static unsigned long total_calls(void)
{
    unsigned long n = 0;
    for (int i = 0; i < CUBUF_DRV_COUNT; i++) n += cubuf_fault_calls(cubuf__drv_name((cubuf_drv_id_t)i));
    return n;
}

static long long kib_delta(size_t now, size_t base)
{
    return ((long long)now - (long long)base) / (long long)1024;
}

/* During a failed operation every handle the driver gave out was given back:
 * primary context retains, pools and allocations (counted calls; the
 * injected failure is the one call that did not happen). */
static long succeeded(const char *const *names, const char *fired)
{
    long n = 0;
    for (; *names; names++) n += (long)cubuf_fault_calls(*names) - (strcmp(fired, *names) == 0);
    return n;
}

static void check_balanced(const char *what, unsigned nth, const char *fired)
{
    static const char *const retains[] = {"cuDevicePrimaryCtxRetain", NULL};
    static const char *const releases[] = {"cuDevicePrimaryCtxRelease", NULL};
    static const char *const creates[] = {"cuMemPoolCreate", NULL};
    static const char *const destroys[] = {"cuMemPoolDestroy", NULL};
    static const char *const allocs[] = {"cuMemAlloc", "cuMemAllocManaged", "cuMemHostAlloc",
                                         "cuMemAllocHost", "cuMemAllocFromPoolAsync",
                                         "cuMemAllocAsync", NULL};
    static const char *const frees[] = {"cuMemFree", "cuMemFreeHost", "cuMemFreeAsync", NULL};
    if (succeeded(retains, fired) != succeeded(releases, fired) ||
        succeeded(creates, fired) != succeeded(destroys, fired) ||
        succeeded(allocs, fired) != succeeded(frees, fired)) {
        fprintf(stderr, "%s: failing call %u (%s) leaked: %ld/%ld retains/releases, %ld/%ld pools "
                "created/destroyed, %ld/%ld allocations/frees\n",
                what, nth, fired, succeeded(retains, fired), succeeded(releases, fired),
                succeeded(creates, fired), succeeded(destroys, fired), succeeded(allocs, fired),
                succeeded(frees, fired));
        t_failures++;
    }
}

#endif
