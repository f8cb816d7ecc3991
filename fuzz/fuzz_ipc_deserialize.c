/* libFuzzer target: untrusted bytes (and a matching or mismatching number of
 * fds) through cubuf_ipc_descriptor_deserialize. Pure CPU: no driver is
 * loaded. Build and run with fuzz/run.sh. */
#include <stddef.h>
#include <stdint.h>

#include "ipc_fuzz_one.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    (void)ipc_fuzz_one(data, size);
    return 0;
}
