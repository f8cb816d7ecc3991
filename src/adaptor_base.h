/* What every resource adaptor shares (adaptor.c): an upstream it holds and
 * reaches through its raw-pointer path. Private: never installed. */
#ifndef CUBUF_ADAPTOR_BASE_H
#define CUBUF_ADAPTOR_BASE_H

#include "internal.h"

/* The first member of every adaptor's state (res->impl). */
typedef struct cubuf_adaptor {
    cubuf_resource_t *up; /* retained */
} cubuf_adaptor_t;

/* Why cubuf_buffer_wrap refuses every adaptor (vtbl no_adopt). */
extern const char cubuf__adaptor_no_adopt[];

/* A new adaptor resource over `up` (retained), with up's properties and
 * context, and `impl_size` zeroed bytes of state whose first member is a
 * cubuf_adaptor_t. `what` names the create function for messages. */
cubuf_status_t cubuf__adaptor_new(cubuf_resource_t *up, const cubuf_resource_vtbl_t *vt,
                                  size_t impl_size, const char *what, cubuf_resource_t **out);
/* The vtbl destroy of an adaptor with no state to free besides its own. */
void cubuf__adaptor_destroy(cubuf_resource_t *res);

/* One allocation and one free through the upstream, with the vtbl's
 * signatures (the stream is buf->dealloc's, bound already): the entries of
 * an adaptor that only passes them on, and the steps of the others.
 * Uncounted (cubuf__layer_allocate): an adaptor that fails after its
 * upstream allocated gives the memory back with cubuf__adaptor_up_undo. */
static inline cubuf_status_t cubuf__adaptor_up_allocate(cubuf_resource_t *res, cubuf_buffer_t *buf,
                                                        CUstream stream, bool in_ctx,
                                                        cubuf_charge_t *charge)
{
    (void)stream;
    const cubuf_adaptor_t *a = res->impl;
    return cubuf__layer_allocate(a->up, buf, in_ctx, charge);
}
static inline cubuf_status_t cubuf__adaptor_up_deallocate(cubuf_resource_t *res, cubuf_buffer_t *buf,
                                                          const cubuf_stream_token_t *token,
                                                          cubuf_charge_t *charge)
{
    const cubuf_adaptor_t *a = res->impl;
    return cubuf__layer_free(a->up, buf, token, charge);
}

static inline void cubuf__adaptor_up_undo(cubuf_resource_t *res, cubuf_buffer_t *buf)
{
    const cubuf_adaptor_t *a = res->impl;
    cubuf__layer_undo(a->up, buf);
}

#endif
