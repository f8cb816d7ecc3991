/* The umbrella of the private headers, one per concern: common.h (errors,
 * checking macros, the driver table), context.h, stream_token.h,
 * resource.h, buffer.h. Never installed. */
#ifndef CUBUF_INTERNAL_H
#define CUBUF_INTERNAL_H

#include "common.h"
#include "context.h"
#include "stream_token.h"
#include "resource.h"
#include "buffer.h"

#endif
