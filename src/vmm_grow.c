/* Virtual memory: cubuf_vmm_modify_allocation. A new buffer over an
 * existing one's range: an alias of it, a grow in place into the addresses
 * right after it, or a grow that maps its physical memory again elsewhere.
 * The model is in vmm.h. */
#include <stdlib.h>

#include "vmm.h"

static atomic_bool refuse_extension;

void cubuf__vmm_test_refuse_extension(bool on) { atomic_store(&refuse_extension, on); }

typedef struct vmm_piece {
    size_t offset; /* from the space's base */
    size_t size;
    vmm_phys_t *phys;
} vmm_piece_t;

/* What one grow needs, gathered before any driver call. */
typedef struct vmm_grow {
    cubuf_resource_t *res;
    const vmm_res_t *vr;
    vmm_range_t *range;
    vmm_member_t *from; /* the buffer grown */
    vmm_member_t *to;   /* the new buffer's membership */
    size_t cur, want;   /* bytes: covered by `from`, and by the new buffer */
    CUmemAllocationProp prop;
    unsigned access; /* profile of the new part */
    const cubuf_vmm_options_t *o;
    CUdeviceptr move_hint;
} vmm_grow_t;

static void free_pieces(vmm_piece_t *pieces, size_t n)
{
    for (size_t i = 0; i < n; i++) free(pieces[i].phys);
    free(pieces);
}

/* Grows into the addresses right after `from`: the space's own reservations
 * first, then a reservation requested right at the space's end. Sets *must_move
 * (and does nothing) when those addresses are taken: then the range moves. */
static cubuf_status_t grow_in_place(vmm_grow_t *gr, bool *must_move)
{
    vmm_space_t *s = gr->from->space;
    *must_move = false;
    if (gr->from->count != s->nmaps) { /* another alias maps right after us */
        *must_move = true;
        return CUBUF_SUCCESS;
    }
    size_t start = s->mapped, end = gr->want;
    /* The reservation holding `start`, counted from the end: a space has a
     * few reservations (each at least doubles it), so this is short. */
    size_t ri = s->nresv;
    while (ri > 0 && s->resv[ri - 1].offset + s->resv[ri - 1].size > start) ri--;
    size_t cap = s->nresv - ri + 1;
    vmm_piece_t *pieces = cubuf__calloc(cap, sizeof *pieces);
    if (!pieces) return cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "out of host memory");
    size_t np = 0, pos = start;
    for (size_t i = ri; i < s->nresv && pos < end; i++) {
        size_t rend = s->resv[i].offset + s->resv[i].size;
        size_t stop = rend < end ? rend : end;
        pieces[np++] = (vmm_piece_t){pos, stop - pos, NULL};
        pos = stop;
    }
    bool extend = pos < end;
    size_t npieces = np + (extend ? 1 : 0);
    cubuf_status_t st = CUBUF_SUCCESS;
    vmm_guard_t g;
    bool entered = false;
    CUdeviceptr ext_va = 0;
    size_t ext_size = 0, created = 0, mapped = 0;
    for (size_t i = 0; i < npieces; i++)
        if (!(pieces[i].phys = cubuf__calloc(1, sizeof *pieces[i].phys))) {
            st = cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "out of host memory");
            goto fail;
        }
    if (!cubuf__vmm_space_make_room(s, npieces, extend ? 1 : 0)) {
        st = cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "out of host memory");
        goto fail;
    }
    CHECK(cubuf__vmm_guard_enter(gr->res, &g));
    entered = true;
    if (extend) {
        CUdeviceptr hint = s->base + s->reserved;
        ext_size = cubuf__vmm_reserve_target(end, gr->vr->gran) - s->reserved;
        CHECK(cubuf__vmm_va_reserve(&ext_va, ext_size, gr->vr->gran, hint));
        if (ext_va != hint || atomic_load_explicit(&refuse_extension, memory_order_relaxed)) {
            /* granted elsewhere: give it back and move */
            cubuf__vmm_va_free_quiet(ext_va, ext_size);
            cubuf__vmm_guard_exit(&g);
            free_pieces(pieces, npieces);
            *must_move = true;
            return CUBUF_SUCCESS;
        }
        pieces[np].offset = pos;
        pieces[np].size = end - pos;
        np++;
    }
    const vmm_access_t *a = &gr->range->access[gr->access];
    for (size_t i = 0; i < npieces; i++) {
        vmm_phys_t *p = pieces[i].phys;
        CUdeviceptr va = s->base + pieces[i].offset;
        p->size = pieces[i].size;
        CHECK(cubuf__vmm_phys_create(&p->handle, p->size, &gr->prop));
        created++;
        CHECK(cubuf__vmm_map_phys(va, p));
        mapped++;
        /* Access for the new mapping only: the cost follows the new part. */
        CHECK(cubuf__vmm_set_access(va, p->size, a));
    }
    cubuf__vmm_guard_exit(&g);

    if (extend) {
        s->resv[s->nresv++] = (vmm_resv_t){s->reserved, ext_size};
        s->reserved += ext_size;
    }
    for (size_t i = 0; i < npieces; i++) {
        vmm_phys_t *p = pieces[i].phys;
        p->maps = 1;
        p->access = gr->access;
        s->maps[s->nmaps++] = (vmm_mapping_t){pieces[i].offset, p, 0};
        cubuf__resource_count(gr->res, +1, 0, &(cubuf_charge_t){p->size, 1});
    }
    s->maps[s->nmaps - 1].ends = 1;
    s->mapped = end;
    s->buffers++;
    gr->to->space = s;
    gr->to->count = s->nmaps;
    free(pieces); /* the allocations now belong to the space */
    return CUBUF_SUCCESS;
fail:
    while (mapped > 0) {
        mapped--;
        cubuf__vmm_unmap_quiet(s->base + pieces[mapped].offset, pieces[mapped].size);
    }
    while (created > 0) {
        created--;
        cubuf__vmm_release_quiet(pieces[created].phys->handle, pieces[created].size);
    }
    if (ext_va) cubuf__vmm_va_free_quiet(ext_va, ext_size);
    if (entered) cubuf__vmm_guard_exit(&g);
    free_pieces(pieces, npieces);
    return st;
}

/* Reserves a larger range elsewhere and maps every physical allocation of
 * `from` into it, then the new part; `from` keeps its own mapping. */
static cubuf_status_t grow_moving(vmm_grow_t *gr)
{
    const vmm_space_t *old = gr->from->space;
    size_t c = gr->from->count, extra = gr->want - gr->cur;
    size_t rsize = cubuf__vmm_reserve_target(gr->want, gr->vr->gran);
    cubuf_status_t st = CUBUF_SUCCESS;
    vmm_space_t *ns = cubuf__vmm_space_new(c + 1, 1);
    vmm_phys_t *np = cubuf__calloc(1, sizeof *np);
    vmm_guard_t g;
    bool entered = false, created = false, mapped_new = false;
    size_t mapped = 0;
    CUdeviceptr base = 0;
    if (!ns || !np) {
        st = cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "out of host memory");
        goto fail;
    }
    CHECK(cubuf__vmm_guard_enter(gr->res, &g));
    entered = true;
    CHECK(cubuf__vmm_va_reserve(&base, rsize, gr->o->address_alignment, gr->move_hint));
    for (; mapped < c; mapped++)
        CHECK(cubuf__vmm_map_phys(base + old->maps[mapped].offset, old->maps[mapped].phys));
    np->size = extra;
    CHECK(cubuf__vmm_phys_create(&np->handle, extra, &gr->prop));
    created = true;
    CHECK(cubuf__vmm_map_phys(base + gr->cur, np));
    mapped_new = true;
    /* Access on the whole new range, one call per run of allocations that
     * share an access profile (one call unless grows used other options).
     * Entries 0..c-1 are the old allocations, entry c the new one. */
    np->access = gr->access;
    for (size_t i = 0; i <= c;) {
        unsigned prof = i < c ? old->maps[i].phys->access : np->access;
        size_t j = i + 1;
        while (j <= c && (j < c ? old->maps[j].phys->access : np->access) == prof) j++;
        size_t off = i < c ? old->maps[i].offset : gr->cur;
        size_t stop = j < c ? old->maps[j].offset : j == c ? gr->cur : gr->want;
        CHECK(cubuf__vmm_set_access(base + off, stop - off, &gr->range->access[prof]));
        i = j;
    }
    cubuf__vmm_guard_exit(&g);

    for (size_t i = 0; i < c; i++) {
        old->maps[i].phys->maps++;
        ns->maps[i] = (vmm_mapping_t){old->maps[i].offset, old->maps[i].phys, 0};
    }
    np->maps = 1;
    ns->maps[c] = (vmm_mapping_t){gr->cur, np, 1};
    ns->nmaps = c + 1;
    ns->mapped = gr->want;
    ns->base = base;
    ns->resv[0] = (vmm_resv_t){0, rsize};
    ns->nresv = 1;
    ns->reserved = rsize;
    ns->buffers = 1;
    cubuf__resource_count(gr->res, +1, 0, &(cubuf_charge_t){extra, 1});
    gr->to->space = ns;
    gr->to->count = c + 1;
    return CUBUF_SUCCESS;
fail:
    if (mapped_new) cubuf__vmm_unmap_quiet(base + gr->cur, extra);
    if (created) cubuf__vmm_release_quiet(np->handle, extra);
    while (mapped > 0) {
        mapped--;
        cubuf__vmm_unmap_quiet(base + old->maps[mapped].offset, old->maps[mapped].phys->size);
    }
    if (base) cubuf__vmm_va_free_quiet(base, rsize);
    if (entered) cubuf__vmm_guard_exit(&g);
    free(np);
    cubuf__vmm_space_free(ns);
    return st;
}

/* The new buffer `nb` over `from`'s range: an alias, a grow in place or a
 * grow that moves. */
static cubuf_status_t grow_member(cubuf_resource_t *res, vmm_member_t *from, size_t cur,
                                  size_t new_size, const cubuf_vmm_options_t *o, CUdeviceptr move_hint,
                                  cubuf_buffer_t *nb, const char *what)
{
    const vmm_res_t *vr = res->impl;
    size_t want = 0;
    cubuf_status_t st = cubuf__vmm_round_size(vr, new_size, &want, what);
    if (st != CUBUF_SUCCESS) return st;
    vmm_member_t *to = cubuf__calloc(1, sizeof *to);
    if (!to) return cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "%s: out of host memory", what);
    vmm_range_t *r = from->range;
    pthread_mutex_lock(&r->lock);
    nb->dealloc = from->buf->dealloc; /* written under this lock (cubuf__vmm_set_token) */
    if (want <= cur) {
        /* Within the buffer: the same mappings again, no driver call. */
        to->space = from->space;
        to->count = from->count;
        from->space->maps[from->count - 1].ends++;
        from->space->buffers++;
        want = cur;
    } else {
        vmm_grow_t gr = {.res = res, .vr = vr, .range = r, .from = from, .to = to, .cur = cur,
                         .want = want, .o = o, .move_hint = move_hint};
        vmm_access_t access;
        cubuf__vmm_build_access(vr, o, &access);
        cubuf__vmm_fill_prop(vr, o->gpu_direct_rdma, &gr.prop);
        bool must_move = false;
        CHECK(cubuf__vmm_range_access_index(r, &access, &gr.access));
        CHECK(grow_in_place(&gr, &must_move));
        if (must_move) CHECK(grow_moving(&gr));
    }
    to->buf = nb;
    cubuf__vmm_range_link(r, to);
    pthread_mutex_unlock(&r->lock);
    nb->ptr = to->space->base;
    nb->size = want;
    nb->impl = to;
    return CUBUF_SUCCESS;
fail:
    pthread_mutex_unlock(&r->lock);
    free(to);
    return st;
}

cubuf_status_t cubuf_vmm_modify_allocation(cubuf_resource_t *res, cubuf_buffer_t *buf,
                                           size_t new_size, const cubuf_vmm_options_t *options,
                                           cubuf_buffer_t **out)
{
    static const char what[] = "cubuf_vmm_modify_allocation";
    CHECK_ARG(res && buf && out, "%s: NULL argument", what);
    const vmm_res_t *vr = cubuf__vmm_of(res);
    CHECK_ARG(vr, "%s: the resource is not a virtual memory resource", what);
    cubuf_status_t st = cubuf__buffer_check_open(buf, what);
    if (st != CUBUF_SUCCESS) return st;
    CHECK_ARG(buf->resource == res, "%s: the buffer was not made by this resource", what);
    cubuf_vmm_options_t o;
    if ((st = cubuf__vmm_grow_options(vr, options, &o, what)) != CUBUF_SUCCESS) return st;
    cubuf_buffer_t *nb = NULL;
    if ((st = cubuf__buffer_new(&nb)) != CUBUF_SUCCESS) return st;
    cubuf__buffer_take_props(nb, res);
    vmm_member_t *from = buf->impl;
    if (!from) {
        nb->dealloc = buf->dealloc;
        /* Growing an empty buffer is a fresh allocation (the hint applies). */
        if (new_size) {
            if (!options) o.address_hint = vr->opts.address_hint;
            CHECK(cubuf__vmm_range_create(res, &o, new_size, nb, what));
            cubuf__resource_count(res, +1, nb->size, &(cubuf_charge_t){nb->size, 1});
        }
    } else {
        /* The physical allocations it adds are counted as it makes them. */
        CHECK(grow_member(res, from, buf->size, new_size, &o, o.address_hint, nb, what));
        if (nb->size) cubuf__resource_count(res, +1, nb->size, &(cubuf_charge_t){0, 0});
    }
    nb->resource = cubuf_resource_retain(res);
    *out = nb;
    return CUBUF_SUCCESS;
fail:
    cubuf__buffer_discard(nb);
    return st;
}
