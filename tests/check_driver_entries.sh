#!/bin/sh
# Required driver entries (X in src/driver.h) are exactly those the library
# calls: an entry only tests or benchmarks call must be optional (XO), so it
# never raises the driver floor (cubuf_driver_min_version). An optional
# entry the library calls is allowed: CU() then returns
# CUBUF_ERROR_NOT_SUPPORTED naming it where the driver lacks it.
set -eu
cd "${1:-.}"
entries=$(grep -oE '\bX\(cu[A-Za-z0-9_]+, *[0-9]+\)' src/driver.h | sed -E 's/^X\((cu[A-Za-z0-9_]+),.*/\1/')
[ -n "$entries" ] || { echo "no required entries found in src/driver.h"; exit 1; }
bad=0
for name in $entries; do
    if ! grep -qE "\b(CU|CU_CALL)\($name\b|cubuf__drv\.$name\b" src/*.c; then
        echo "$name is required (X) but src/ never calls it: make it XO in src/driver.h"
        bad=1
    fi
done
[ $bad = 0 ] && echo "every required driver entry is called by src/"
exit $bad
