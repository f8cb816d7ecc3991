#!/bin/sh
# Every host allocation in src/ goes through src/alloc.h (cubuf__malloc,
# cubuf__calloc, cubuf__realloc), so that the allocation fault seam
# (cubuf_fault_fail_alloc_nth) reaches it; a raw call here would be a failure
# path no fault loop ever runs.
set -eu
cd "${1:-.}"
raw=$(grep -nE '(^|[^_[:alnum:]])(malloc|calloc|realloc|strdup|strndup|aligned_alloc|posix_memalign|asprintf|vasprintf)[[:space:]]*\(' \
      src/*.c src/*.h | grep -v '^src/alloc\.h:' | grep -vE '^[^:]+:[0-9]+:[[:space:]]*(/?\*|//)' || true)
if [ -n "$raw" ]; then
    echo "host allocations that bypass src/alloc.h (use cubuf__malloc/cubuf__calloc/cubuf__realloc):"
    echo "$raw"
    exit 1
fi
echo "every host allocation in src/ goes through src/alloc.h"
