/* Fault injection and call counting over the driver table and over host
 * allocations. */
#include <string.h>

#include "alloc.h"
#include "fault.h"
#include "internal.h"

atomic_bool cubuf__fault_armed;
atomic_bool cubuf__alloc_fault_armed;

static _Atomic unsigned long calls[CUBUF_DRV_COUNT];
static _Atomic unsigned long allocs;
static atomic_bool counting;
static atomic_int target = -1;          /* entry id, or -1 for any */
static atomic_uint countdown;            /* calls left before the one that fails */
static CUresult fail_with;
static atomic_bool fired;
static atomic_int fired_id = -1;
static atomic_bool fired_alloc;
static atomic_bool pending;
static atomic_uint alloc_countdown;      /* allocations left before the one that fails */
static atomic_bool alloc_pending;

static void arm_update(void)
{
    bool count = atomic_load(&counting);
    atomic_store(&cubuf__fault_armed, atomic_load(&pending) || count);
    atomic_store(&cubuf__alloc_fault_armed, atomic_load(&alloc_pending) || count);
}

static void fire(int id, bool alloc)
{
    atomic_store(&fired, true);
    atomic_store(&fired_id, id);
    atomic_store(&fired_alloc, alloc);
    arm_update();
}

bool cubuf__fault_hit(cubuf_drv_id_t id, CUresult *result)
{
    if (atomic_load_explicit(&counting, memory_order_relaxed))
        atomic_fetch_add_explicit(&calls[id], 1, memory_order_relaxed);
    if (!atomic_load(&pending)) return false;
    int t = atomic_load(&target);
    if (t >= 0 && t != (int)id) return false;
    if (atomic_fetch_sub(&countdown, 1) != 1) return false;
    atomic_store(&pending, false);
    fire((int)id, false);
    *result = fail_with;
    return true;
}

bool cubuf__alloc_fault_hit(void)
{
    if (atomic_load_explicit(&counting, memory_order_relaxed))
        atomic_fetch_add_explicit(&allocs, 1, memory_order_relaxed);
    if (!atomic_load(&alloc_pending)) return false;
    if (atomic_fetch_sub(&alloc_countdown, 1) != 1) return false;
    atomic_store(&alloc_pending, false);
    fire(-1, true);
    return true;
}

static void clear_fired(void)
{
    atomic_store(&fired, false);
    atomic_store(&fired_id, -1);
    atomic_store(&fired_alloc, false);
}

static void arm(int id, unsigned nth, CUresult result)
{
    fail_with = result;
    atomic_store(&target, id);
    atomic_store(&countdown, nth ? nth : 1);
    clear_fired();
    atomic_store(&pending, true);
    arm_update();
}

bool cubuf_fault_fail_nth(const char *name, unsigned nth, CUresult result)
{
    cubuf_drv_id_t id = cubuf__drv_lookup(name);
    if (id == CUBUF_DRV_COUNT) return false;
    arm((int)id, nth, result);
    return true;
}

void cubuf_fault_fail_any_nth(unsigned nth, CUresult result) { arm(-1, nth, result); }

void cubuf_fault_fail_alloc_nth(unsigned nth)
{
    atomic_store(&alloc_countdown, nth ? nth : 1);
    clear_fired();
    atomic_store(&alloc_pending, true);
    arm_update();
}

void cubuf_fault_reset(void)
{
    atomic_store(&pending, false);
    atomic_store(&alloc_pending, false);
    clear_fired();
    arm_update();
}

bool cubuf_fault_fired(void) { return atomic_load(&fired); }

bool cubuf_fault_fired_alloc(void) { return atomic_load(&fired_alloc); }

const char *cubuf_fault_fired_name(void)
{
    if (atomic_load(&fired_alloc)) return "host allocation";
    int id = atomic_load(&fired_id);
    return id < 0 ? "" : cubuf__drv_name((cubuf_drv_id_t)id);
}

void cubuf_fault_count_calls(bool on)
{
    if (on) {
        for (int i = 0; i < CUBUF_DRV_COUNT; i++) atomic_store(&calls[i], 0);
        atomic_store(&allocs, 0);
    }
    atomic_store(&counting, on);
    arm_update();
}

unsigned long cubuf_fault_calls(const char *name)
{
    cubuf_drv_id_t id = cubuf__drv_lookup(name);
    return id == CUBUF_DRV_COUNT ? 0 : atomic_load(&calls[id]);
}

unsigned long cubuf_fault_allocs(void) { return atomic_load(&allocs); }
