/* What every resource adaptor shares (adaptor.c): an upstream it holds
 * (res->upstream) and reaches one layer down. Private: never installed. */
#ifndef CUBUF_ADAPTOR_BASE_H
#define CUBUF_ADAPTOR_BASE_H

#include "internal.h"

/* Why cubuf_buffer_wrap refuses every adaptor (vtbl no_adopt). */
extern const char cubuf__adaptor_no_adopt[];
extern const char cubuf__adaptor_no_export[];

/* A new adaptor resource over `up` (retained in res->upstream), with up's
 * properties, context and lock, and `impl_size` zeroed bytes of state (0:
 * none). `what` names the create function for messages. */
cubuf_status_t cubuf__adaptor_new(cubuf_resource_t *up, const cubuf_resource_vtbl_t *vt,
                                  size_t impl_size, const char *what, cubuf_resource_t **out);
/* The calling thread's kernel id (cached per thread): what the log and the
 * tracker name a thread by. Inline around the thread-local's accessor
 * (CUBUF_TLS_ACCESSOR, adaptor.c), which does nothing else: the tracker
 * reads it at every allocation, and a call more showed in its cost. */
int32_t *cubuf__adaptor_tid_slot(void);
int32_t cubuf__adaptor_thread_id_slow(int32_t *slot); /* the first read: asks the kernel */
static inline int32_t cubuf__adaptor_thread_id(void)
{
    int32_t *slot = cubuf__adaptor_tid_slot();
    const int32_t tid = *slot;
    return __builtin_expect(tid != 0, 1) ? tid : cubuf__adaptor_thread_id_slow(slot);
}

/* The vtbl destroy of an adaptor with no state to free: lets the upstream go. */
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
    return cubuf__layer_allocate(res->upstream, buf, in_ctx, charge);
}
static inline cubuf_status_t cubuf__adaptor_up_deallocate(cubuf_resource_t *res, cubuf_buffer_t *buf,
                                                          const cubuf_stream_token_t *token,
                                                          cubuf_charge_t *charge)
{
    return cubuf__layer_free(res->upstream, buf, token, charge);
}

static inline void cubuf__adaptor_up_undo(cubuf_resource_t *res, cubuf_buffer_t *buf)
{
    cubuf__layer_undo(res->upstream, buf);
}

#endif
