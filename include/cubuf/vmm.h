/* cubuf virtual memory: VirtualMemoryResource and VirtualMemoryBuffer. Included by <cubuf.h>. */
#ifndef CUBUF_VMM_H
#define CUBUF_VMM_H
#include <cubuf.h>
#ifdef __cplusplus
extern "C" {
#endif

#ifdef __cplusplus
}
#endif
#endif
