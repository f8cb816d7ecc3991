/* Fault injection over the driver table: the test seam. Private; tests link
 * the static library and include this header. Not thread-safe to arm while
 * other threads call the driver; arm, run the operation, disarm. */
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

/* Disarms every fault. Call counting goes on until cubuf_fault_count_calls(false). */
void cubuf_fault_reset(void);

/* True if an armed fault fired since the last arm. */
bool cubuf_fault_fired(void);

/* Name of the entry point the last fired fault hit ("" if none). */
const char *cubuf_fault_fired_name(void);

/* Starts counting calls per entry point (counting costs nothing when off). */
void cubuf_fault_count_calls(bool on);
/* Calls of `name` counted since counting started. */
unsigned long cubuf_fault_calls(const char *name);

#endif
