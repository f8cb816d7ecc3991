#!/usr/bin/env bash
# Runs every benchmark program (bench_*) of a build directory, one after the
# other, and tees each one's output to OUT_DIR/<program>.txt. The TARGET
# lines of all of them are gathered in OUT_DIR/summary.txt.
#
# Usage: bench/run_all.sh BUILD_DIR OUT_DIR
#
# Exit status: 0 when every program exited 0 (a MISS is not a failure:
# benchmarks are not tests), 77 when every program skipped (no GPU), 1 when
# one failed (an error, a leak, a wrong result), 2 on bad usage.
set -u

if [ $# -ne 2 ]; then
    echo "usage: $0 BUILD_DIR OUT_DIR" >&2
    exit 2
fi
build=$1
out=$2
if [ ! -d "$build" ]; then
    echo "$0: $build is not a directory" >&2
    exit 2
fi
mkdir -p "$out" || exit 2

# Programs live in BUILD_DIR/bench with CMake; accept a flat directory too.
mapfile -t programs < <(find "$build" -maxdepth 2 -type f -name 'bench_*' -perm -u+x \
                            ! -name '*.*' | sort)
if [ ${#programs[@]} -eq 0 ]; then
    echo "$0: no bench_* program in $build (build first: ninja -C $build)" >&2
    exit 2
fi

failed=0
skipped=0
summary=$out/summary.txt
: > "$summary"
for prog in "${programs[@]}"; do
    name=$(basename "$prog")
    echo "=== $name ($(date -u +%Y-%m-%dT%H:%M:%SZ))"
    start=$(date +%s)
    "$prog" 2>&1 | tee "$out/$name.txt"
    rc=${PIPESTATUS[0]}
    echo "=== $name exited $rc after $(( $(date +%s) - start )) s"
    case $rc in
        0) ;;
        77) skipped=$((skipped + 1)) ;;
        *) failed=$((failed + 1)); echo "$name: FAILED (exit $rc)" >> "$summary" ;;
    esac
    grep '^TARGET ' "$out/$name.txt" | sed "s/^/$name: /" >> "$summary"
done

echo
echo "=== summary (also in $summary)"
cat "$summary"
pass=$(grep -c ' PASS$' "$summary")
miss=$(grep -c ' MISS$' "$summary")
echo "targets: $pass PASS, $miss MISS; programs: ${#programs[@]} run, $skipped skipped, $failed failed"

if [ $failed -gt 0 ]; then exit 1; fi
if [ $skipped -eq ${#programs[@]} ]; then exit 77; fi
exit 0
