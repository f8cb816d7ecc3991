/* cubuf IPC: sharing buffers between processes. Included by <cubuf.h>. */
#ifndef CUBUF_IPC_H
#define CUBUF_IPC_H
#include <cubuf.h>
#ifdef __cplusplus
extern "C" {
#endif

#ifdef __cplusplus
}
#endif
#endif
