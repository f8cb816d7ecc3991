/* Fault injection and call counting over the driver table. */
#include <string.h>

#include "fault.h"
#include "internal.h"

atomic_bool cubuf__fault_armed;

static _Atomic unsigned long calls[CUBUF_DRV_COUNT];
static atomic_bool counting;
static atomic_int target = -1;          /* entry id, or -1 for any */
static atomic_uint countdown;            /* calls left before the one that fails */
static CUresult fail_with;
static atomic_bool fired;
static atomic_int fired_id = -1;
static atomic_bool pending;

static void arm_update(void)
{
    atomic_store(&cubuf__fault_armed, atomic_load(&pending) || atomic_load(&counting));
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
    atomic_store(&fired, true);
    atomic_store(&fired_id, (int)id);
    arm_update();
    *result = fail_with;
    return true;
}

static void arm(int id, unsigned nth, CUresult result)
{
    fail_with = result;
    atomic_store(&target, id);
    atomic_store(&countdown, nth ? nth : 1);
    atomic_store(&fired, false);
    atomic_store(&fired_id, -1);
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

void cubuf_fault_reset(void)
{
    atomic_store(&pending, false);
    atomic_store(&fired, false);
    atomic_store(&fired_id, -1);
    arm_update();
}

bool cubuf_fault_fired(void) { return atomic_load(&fired); }

const char *cubuf_fault_fired_name(void)
{
    int id = atomic_load(&fired_id);
    return id < 0 ? "" : cubuf__drv_name((cubuf_drv_id_t)id);
}

void cubuf_fault_count_calls(bool on)
{
    if (on)
        for (int i = 0; i < CUBUF_DRV_COUNT; i++) atomic_store(&calls[i], 0);
    atomic_store(&counting, on);
    arm_update();
}

unsigned long cubuf_fault_calls(const char *name)
{
    cubuf_drv_id_t id = cubuf__drv_lookup(name);
    return id == CUBUF_DRV_COUNT ? 0 : atomic_load(&calls[id]);
}
