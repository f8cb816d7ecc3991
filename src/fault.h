/* Fault injection over the driver table and over host allocations
 * (src/alloc.h): the test seam. Private; tests link the static library and
 * include this header. Not thread-safe to arm while other threads call the
 * driver or allocate; arm, run the operation, disarm. A driver fault and an
 * allocation fault can be armed at the same time; each fires once. */
#ifndef CUBUF_FAULT_H
#define CUBUF_FAULT_H

#include "driver.h"

/* Makes the nth (1-based) call of entry point `name` from now fail with
 * `result` (once). Returns false for an unknown name. */
bool cubuf_fault_fail_nth(const char *name, unsigned nth, CUresult result);

/* Makes the nth (1-based) driver call from now, of any entry point, fail with
 * `result` (once). Loop nth = 1, 2, ... until the operation succeeds to fail
 * every call on its path in turn. */
void cubuf_fault_fail_any_nth(unsigned nth, CUresult result);

/* Makes the nth (1-based) host allocation by the library from now (malloc,
 * calloc or realloc through src/alloc.h) return NULL (once). Loop nth = 1,
 * 2, ... until the operation succeeds to fail every allocation on its path in
 * turn; a path that runs out of host memory returns CUBUF_ERROR_OUT_OF_MEMORY
 * unless its header documents otherwise. */
void cubuf_fault_fail_alloc_nth(unsigned nth);

/* Disarms every fault, driver and allocation. Call counting goes on until
 * cubuf_fault_count_calls(false). */
void cubuf_fault_reset(void);

/* True if an armed fault (driver or allocation) fired since the last arm. */
bool cubuf_fault_fired(void);

/* True if the fault that fired since the last arm was a host allocation. */
bool cubuf_fault_fired_alloc(void);

/* Name of the entry point the last fired fault hit, "host allocation" for an
 * allocation fault ("" if none). */
const char *cubuf_fault_fired_name(void);

/* Starts counting calls per entry point and host allocations (counting costs
 * nothing when off); on == true zeroes the counts. */
void cubuf_fault_count_calls(bool on);
/* Calls of `name` counted since counting started. */
unsigned long cubuf_fault_calls(const char *name);
/* Host allocations counted since counting started. */
unsigned long cubuf_fault_allocs(void);

#endif
