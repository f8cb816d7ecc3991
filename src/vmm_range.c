/* Virtual memory: ranges, spaces and members (the model is in vmm.h), the
 * allocation that makes a range, and the queries IPC and the tests make of
 * a buffer's mappings. */
#include <stdlib.h>
#include <string.h>

#include "vmm.h"

/* Reservations are at least this large and leave room to double, so that a
 * growing buffer rarely needs a new reservation: a grow that must extend
 * the reservation costs one more cuMemAddressReserve, about 25 us on the
 * H200, next to 35-45 us for mapping a 2 MiB part. The size costs little
 * by itself (bench_vmm: reserve + free 3-4 us from 32 MiB to 8 GiB), but
 * any reservation beyond a few MiB adds 7-25 us to allocate + close over a
 * 2 MiB one. The price is address space: 4 GiB per small buffer, so about
 * 30000 such buffers fit in the 128 TiB a process has. */
#define VMM_MIN_RESERVE ((size_t)4 << 30)

/* ---- small helpers --------------------------------------------------------- */

bool cubuf__vmm_round_up(size_t size, size_t gran, size_t *out)
{
    size_t rem = size % gran;
    if (rem == 0) {
        *out = size;
        return true;
    }
    if (size > SIZE_MAX - (gran - rem)) return false;
    *out = size + (gran - rem);
    return true;
}

cubuf_status_t cubuf__vmm_round_size(const vmm_res_t *vr, size_t size, size_t *out, const char *what)
{
    if (cubuf__vmm_round_up(size, vr->gran, out)) return CUBUF_SUCCESS;
    return cubuf__fail(CUBUF_ERROR_OUT_OF_RANGE,
                       "%s: %zu bytes rounded up to the %zu-byte granularity do not fit in size_t",
                       what, size, vr->gran);
}

/* How much to reserve for a space that maps `total` bytes: the next power
 * of two, doubled, at least VMM_MIN_RESERVE. A doubling grow then finds its
 * addresses reserved every other step, and small grows almost always. */
size_t cubuf__vmm_reserve_target(size_t total, size_t gran)
{
    size_t t = 1;
    while (t < total && t <= SIZE_MAX / 2) t <<= 1;
    if (t < total) return total;
    if (t <= SIZE_MAX / 2) t <<= 1;
    if (t < VMM_MIN_RESERVE) t = VMM_MIN_RESERVE;
    size_t r;
    return cubuf__vmm_round_up(t, gran, &r) ? r : total;
}

/* Grows an array's capacity to at least `need` elements. Returns the array
 * (possibly moved) or NULL when out of memory (the old one is kept). */
static void *ensure_cap(void *arr, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap) return arr;
    size_t n = *cap ? *cap : 4;
    while (n < need) n *= 2;
    void *p = cubuf__realloc(arr, n * elem);
    if (p) *cap = n;
    return p;
}

/* ---- ranges, spaces, members ------------------------------------------------ */

static vmm_range_t *range_new(const vmm_access_t *first)
{
    vmm_range_t *r = cubuf__calloc(1, sizeof *r);
    if (!r) return NULL;
    r->access = cubuf__malloc(sizeof *r->access);
    if (!r->access || pthread_mutex_init(&r->lock, NULL) != 0) {
        free(r->access);
        free(r);
        return NULL;
    }
    r->access[0] = *first;
    r->naccess = r->cap_access = 1;
    return r;
}

void cubuf__vmm_range_free(vmm_range_t *r)
{
    if (!r) return;
    pthread_mutex_destroy(&r->lock);
    free(r->access);
    free(r);
}

/* The index of an access profile in the range, added if new. */
cubuf_status_t cubuf__vmm_range_access_index(vmm_range_t *r, const vmm_access_t *a,
                                             unsigned *index)
{
    for (unsigned i = 0; i < r->naccess; i++)
        if (memcmp(&r->access[i], a, sizeof *a) == 0) {
            *index = i;
            return CUBUF_SUCCESS;
        }
    size_t cap = r->cap_access;
    vmm_access_t *p = ensure_cap(r->access, &cap, (size_t)r->naccess + 1, sizeof *p);
    if (!p) return cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "out of host memory for an access profile");
    r->access = p;
    r->cap_access = (unsigned)cap;
    r->access[r->naccess] = *a;
    *index = r->naccess++;
    return CUBUF_SUCCESS;
}

void cubuf__vmm_range_link(vmm_range_t *r, vmm_member_t *m)
{
    m->range = r;
    m->prev = NULL;
    m->next = r->members;
    if (r->members) r->members->prev = m;
    r->members = m;
    r->nmembers++;
}

void cubuf__vmm_range_unlink(vmm_range_t *r, vmm_member_t *m)
{
    if (m->prev) m->prev->next = m->next;
    else r->members = m->next;
    if (m->next) m->next->prev = m->prev;
    r->nmembers--;
}

/* A space with room for `maps` mappings and `resv` reservations. */
vmm_space_t *cubuf__vmm_space_new(size_t maps, size_t resv)
{
    vmm_space_t *s = cubuf__calloc(1, sizeof *s);
    if (!s) return NULL;
    s->maps = ensure_cap(NULL, &s->cap_maps, maps, sizeof *s->maps);
    s->resv = ensure_cap(NULL, &s->cap_resv, resv, sizeof *s->resv);
    if (!s->maps || !s->resv) {
        free(s->maps);
        free(s->resv);
        free(s);
        return NULL;
    }
    return s;
}

void cubuf__vmm_space_free(vmm_space_t *s)
{
    if (!s) return;
    free(s->maps);
    free(s->resv);
    free(s);
}

/* Makes room for `maps` more mappings and `resv` more reservations. */
bool cubuf__vmm_space_make_room(vmm_space_t *s, size_t maps, size_t resv)
{
    vmm_mapping_t *m = ensure_cap(s->maps, &s->cap_maps, s->nmaps + maps, sizeof *m);
    if (!m) return false;
    s->maps = m;
    vmm_resv_t *r = ensure_cap(s->resv, &s->cap_resv, s->nresv + resv, sizeof *r);
    if (!r) return false;
    s->resv = r;
    return true;
}

/* ---- allocate ---------------------------------------------------------------- */

/* A new range of `size` bytes (rounded up) whose first member is buf. */
cubuf_status_t cubuf__vmm_range_create(cubuf_resource_t *res, const cubuf_vmm_options_t *o,
                                       size_t size, cubuf_buffer_t *buf, const char *what)
{
    const vmm_res_t *vr = res->impl;
    size_t total = 0;
    cubuf_status_t st = cubuf__vmm_round_size(vr, size, &total, what);
    if (st != CUBUF_SUCCESS) return st;
    vmm_access_t access;
    cubuf__vmm_build_access(vr, o, &access);
    CUmemAllocationProp prop;
    cubuf__vmm_fill_prop(vr, o->gpu_direct_rdma, &prop);
    size_t rsize = cubuf__vmm_reserve_target(total, vr->gran);

    vmm_range_t *r = range_new(&access);
    vmm_space_t *s = cubuf__vmm_space_new(1, 1);
    vmm_member_t *m = cubuf__calloc(1, sizeof *m);
    vmm_phys_t *p = cubuf__calloc(1, sizeof *p);
    vmm_guard_t g;
    bool entered = false, reserved = false, created = false, mapped = false;
    CUdeviceptr va = 0;
    if (!r || !s || !m || !p) {
        st = cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "%s: out of host memory", what);
        goto fail;
    }
    CHECK(cubuf__vmm_guard_enter(res, &g));
    entered = true;
    CHECK(cubuf__vmm_va_reserve(&va, rsize, o->address_alignment, o->address_hint));
    reserved = true;
    p->size = total;
    CHECK(cubuf__vmm_phys_create(&p->handle, total, &prop));
    created = true;
    CHECK(cubuf__vmm_map_phys(va, p));
    mapped = true;
    CHECK(cubuf__vmm_set_access(va, total, &access));
    cubuf__vmm_guard_exit(&g);

    p->maps = 1;
    p->access = 0;
    s->base = va;
    s->resv[0] = (vmm_resv_t){0, rsize};
    s->nresv = 1;
    s->reserved = rsize;
    s->maps[0] = (vmm_mapping_t){0, p, 1};
    s->nmaps = 1;
    s->mapped = total;
    s->buffers = 1;
    m->space = s;
    m->count = 1;
    m->buf = buf;
    cubuf__vmm_range_link(r, m);
    buf->ptr = va;
    buf->size = total;
    buf->impl = m;
    return CUBUF_SUCCESS;
fail:
    if (mapped) cubuf__vmm_unmap_quiet(va, total);
    if (created) cubuf__vmm_release_quiet(p->handle, total);
    if (reserved) cubuf__vmm_va_free_quiet(va, rsize);
    if (entered) cubuf__vmm_guard_exit(&g);
    free(p);
    free(m);
    cubuf__vmm_space_free(s);
    cubuf__vmm_range_free(r);
    return st;
}

cubuf_status_t cubuf__vmm_allocate(cubuf_resource_t *res, cubuf_buffer_t *buf, CUstream stream,
                                   bool in_ctx, cubuf_charge_t *charge)
{
    (void)stream; /* virtual memory operations are synchronous */
    const vmm_res_t *vr = res->impl;
    cubuf_status_t st =
        cubuf__vmm_range_create(res, &vr->opts, buf->size, buf, "allocating virtual memory");
    /* One physical allocation of the rounded size (buf->size now). */
    if (st == CUBUF_SUCCESS) *charge = (cubuf_charge_t){buf->size, 1};
    return st;
}

/* ---- queries for IPC and tests ---------------------------------------------------- */

/* The VMM buffer a buffer or slice lives in, checked open. */
static cubuf_status_t root_of(const cubuf_buffer_t *buf, const cubuf_buffer_t **root, const char *what)
{
    CHECK_ARG(buf, "%s: buf is NULL", what);
    const cubuf_buffer_t *b = buf;
    while (b->parent) b = b->parent;
    if (buf->closed || b->closed)
        return cubuf__fail(CUBUF_ERROR_CLOSED, "%s: the buffer is closed", what);
    CHECK_ARG(cubuf__vmm_of(b->resource) && (b->impl || b->size == 0),
              "%s: not a buffer made by a virtual memory resource", what);
    *root = b;
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf__vmm_chunks(const cubuf_buffer_t *buf, cubuf_vmm_chunk_t **chunks, size_t *count,
                                 size_t *first_offset)
{
    CHECK_ARG(buf, "cubuf__vmm_chunks: buf is NULL");
    return cubuf__vmm_chunks_at(buf, buf->ptr, buf->size, chunks, count, first_offset);
}

cubuf_status_t cubuf__vmm_chunks_at(const cubuf_buffer_t *buf, CUdeviceptr ptr, size_t size,
                                    cubuf_vmm_chunk_t **chunks, size_t *count, size_t *first_offset)
{
    static const char what[] = "cubuf__vmm_chunks";
    CHECK_ARG(chunks && count && first_offset, "%s: NULL argument", what);
    const cubuf_buffer_t *root = NULL;
    cubuf_status_t st = root_of(buf, &root, what);
    if (st != CUBUF_SUCCESS) return st;
    CHECK_ARG(ptr >= root->ptr && ptr - root->ptr <= root->size &&
                  size <= root->size - (size_t)(ptr - root->ptr),
              "%s: [0x%llx, +%zu) is not inside the buffer's memory", what, (unsigned long long)ptr,
              size);
    const vmm_member_t *m = root->impl;
    if (!m || size == 0) {
        *chunks = NULL;
        *count = 0;
        *first_offset = 0;
        return CUBUF_SUCCESS;
    }
    pthread_mutex_lock(&m->range->lock);
    const vmm_space_t *s = m->space;
    size_t off = (size_t)(ptr - root->ptr), end = off + size;
    /* First mapping that ends after `off`, by bisection over the prefix. */
    size_t lo = 0, hi = m->count;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (s->maps[mid].offset + s->maps[mid].phys->size <= off) lo = mid + 1;
        else hi = mid;
    }
    size_t first = lo, last = first;
    while (last + 1 < m->count && s->maps[last + 1].offset < end) last++;
    size_t n = last - first + 1;
    cubuf_vmm_chunk_t *c = cubuf__malloc(n * sizeof *c);
    if (!c) {
        pthread_mutex_unlock(&m->range->lock);
        return cubuf__fail(CUBUF_ERROR_OUT_OF_MEMORY, "%s: out of host memory", what);
    }
    size_t base = s->maps[first].offset;
    for (size_t i = 0; i < n; i++) {
        const vmm_mapping_t *mp = &s->maps[first + i];
        c[i] = (cubuf_vmm_chunk_t){mp->phys->handle, mp->offset - base, mp->phys->size};
    }
    pthread_mutex_unlock(&m->range->lock);
    *chunks = c;
    *count = n;
    *first_offset = off - base;
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf__vmm_tail(const cubuf_buffer_t *buf, CUdeviceptr *end, size_t *headroom,
                               bool *extendable)
{
    static const char what[] = "cubuf__vmm_tail";
    CHECK_ARG(end && headroom && extendable, "%s: NULL argument", what);
    const cubuf_buffer_t *root = NULL;
    cubuf_status_t st = root_of(buf, &root, what);
    if (st != CUBUF_SUCCESS) return st;
    CHECK_ARG(root == buf && buf->impl, "%s: not an open, non-empty VMM buffer", what);
    const vmm_member_t *m = buf->impl;
    pthread_mutex_lock(&m->range->lock);
    const vmm_space_t *s = m->space;
    *end = s->base + s->reserved;
    *extendable = m->count == s->nmaps;
    *headroom = *extendable ? s->reserved - s->mapped : 0;
    pthread_mutex_unlock(&m->range->lock);
    return CUBUF_SUCCESS;
}
