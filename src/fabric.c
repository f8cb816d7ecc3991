/* Fabric handles (include/cubuf/dist.h): whether a resource fell back from
 * fabric handles to POSIX fds, and the per-allocation export and import of
 * fabric handles that fabric-handle IPC descriptors carry. */
#include <string.h>

#include "dist.h"
#include "ipc.h"

cubuf_status_t cubuf_resource_fabric_fallback(const cubuf_resource_t *res, bool *fell_back)
{
    CHECK_ARG(res && fell_back, "cubuf_resource_fabric_fallback: NULL argument");
    const vmm_res_t *vr = cubuf__vmm_of(res);
    *fell_back = res->fabric_fallback || (vr && vr->fabric_fallback);
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf__ipc_fabric_export(CUmemGenericAllocationHandle handle,
                                        uint8_t out[CUBUF__IPC_FABRIC_HANDLE_BYTES])
{
    CUmemFabricHandle fh;
    memset(&fh, 0, sizeof fh);
    cubuf_status_t st = CU(cuMemExportToShareableHandle, &fh, handle, CU_MEM_HANDLE_TYPE_FABRIC, 0);
    if (st != CUBUF_SUCCESS) return st;
    memcpy(out, fh.data, CUBUF__IPC_FABRIC_HANDLE_BYTES);
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf__ipc_fabric_import(const uint8_t in[CUBUF__IPC_FABRIC_HANDLE_BYTES],
                                        CUmemGenericAllocationHandle *handle)
{
    CUmemFabricHandle fh;
    memcpy(fh.data, in, CUBUF__IPC_FABRIC_HANDLE_BYTES);
    return CU(cuMemImportFromShareableHandle, handle, &fh, CU_MEM_HANDLE_TYPE_FABRIC);
}
