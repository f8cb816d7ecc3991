/* cuGetProcAddress_v2: every entry point of src/driver.h's table, by name
 * and ABI version, and the driver's name. */
#include <string.h>

#include "fake.h"

typedef struct td_entry {
    const char *name;
    int version; /* the ABI this function implements */
    void *fn;
} td_entry_t;

static const td_entry_t entries[] = {
#define TD_ENTRY_(name, version) {#name, version, (void *)td_##name},
    CUBUF_DRIVER_ENTRIES(TD_ENTRY_, TD_ENTRY_)
#undef TD_ENTRY_
};

TD_API CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                    cuuint64_t flags, CUdriverProcAddressQueryResult *status);

TD_API CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                    cuuint64_t flags, CUdriverProcAddressQueryResult *status)
{
    (void)flags;
    if (!symbol || !pfn) return CUDA_ERROR_INVALID_VALUE;
    *pfn = NULL;
    for (size_t i = 0; i < sizeof entries / sizeof entries[0]; i++) {
        if (strcmp(entries[i].name, symbol) != 0) continue;
        /* Only the one ABI each entry has: an older one asked for does not
         * exist here, as for a symbol newer than the version asked for. */
        if (cudaVersion < entries[i].version || cudaVersion > TD_DRIVER_VERSION) {
            if (status) *status = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
            return CUDA_ERROR_NOT_FOUND;
        }
        *pfn = entries[i].fn;
        if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
        return CUDA_SUCCESS;
    }
    if (status) *status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    return CUDA_ERROR_NOT_FOUND;
}

TD_API const char *cubuf_testdriver_name(void) { return "cubuf test driver"; }
