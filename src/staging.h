/* Staging for DURING_API_CALL copies (staging.c). Private: never installed. */
#ifndef CUBUF_STAGING_H
#define CUBUF_STAGING_H

#include "common.h"

/* The pinned pool that DURING_API_CALL copies read their sources into, for
 * the current context's device (made on first use, kept for the process).
 * CUBUF_ERROR_NOT_SUPPORTED where the device has no host memory pools. */
cubuf_status_t cubuf__staging_pool(CUmemoryPool *out);

#endif
