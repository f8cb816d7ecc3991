#!/usr/bin/env bash
# The GPU suite in one go: build, tests, tests under compute-sanitizer, cubuf
# info, benchmarks, and the whole suite built with ASan+UBSan.
# Usage: tools/gpu_suite.sh OUTDIR [parts...]
# parts: build tests sanitize pysanitize info bench asan (default: all of them). Logs go to OUTDIR.
set -uo pipefail
out=${1:?usage: gpu_suite.sh OUTDIR [build|tests|sanitize|pysanitize|info|bench|asan]...}
shift
parts=${*:-build tests sanitize pysanitize info bench asan}
mkdir -p "$out"
cd "$(dirname "$0")/.."
build=build-gpu
rc=0
# tests/test_nccl.c loads libnccl.so.2 at run time from the Python packages
# (nvidia-nccl, with PyTorch); it is skipped where none is found.
if [ -z "${CUBUF_TEST_LIBNCCL:-}" ]; then
  CUBUF_TEST_LIBNCCL=$(python3 - <<'PY' 2>/dev/null
import os
import nvidia.nccl
for d in nvidia.nccl.__path__:
    for f in ("libnccl.so.2", "libnccl.so"):
        p = os.path.join(d, "lib", f)
        if os.path.exists(p):
            print(p)
            raise SystemExit
PY
) || CUBUF_TEST_LIBNCCL=
fi
export CUBUF_TEST_LIBNCCL NCCL_NVLS_ENABLE=0
has() { [[ " $parts " == *" $1 "* ]]; }

if has build; then
  # The python3 on PATH is the one with torch, CuPy and numba there.
  { cmake -S . -B $build -G Ninja -DCUBUF_WERROR=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DCUBUF_PYTHON="$(command -v python3)" &&
    cmake --build $build -j 16; } >"$out/build.log" 2>&1 || { tail -50 "$out/build.log"; exit 1; }
  echo "build ok"
fi
if has info; then
  { ./$build/cubuf info; ./$build/cubuf info --json; ./$build/cubuf demo;
    ./$build/examples/example_grow; } 2>&1 | tee "$out/info.log"
fi
if has tests; then
  # -j: the *_testdriver variants run on the host beside the GPU programs,
  # which take the RESOURCE_LOCK gpu and so run one at a time.
  ctest --test-dir $build -j 8 --output-on-failure --output-junit junit.xml --timeout 300 >"$out/ctest.log" 2>&1 || rc=1
  cp $build/junit.xml "$out/" 2>/dev/null || true
  # The closing lines: failures, then each skipped test with its reason.
  grep -E "tests passed|tests failed|Failed|\*\*\*" "$out/ctest.log" | tail -25
  sed -n '/^cubuf: .* tests /,$p' "$out/ctest.log"
fi
if has sanitize; then
  : >"$out/sanitize.log"
  # The longest programs last, so a bounded run covers the most tests.
  for t in $(ls $build/tests/test_* | grep -v -e test_vmm_grow -e test_ipc_) \
           $(ls $build/tests/test_ipc_* $build/tests/test_vmm_grow 2>/dev/null); do
    [ -x "$t" ] || continue
    name=$(basename "$t")
    # CPU-only programs make no CUDA call: the sanitizer has nothing to check.
    # test_driver_floor loads stand-in drivers only (tests/fake_libcuda.c),
    # which the sanitizer cannot instrument (it crashes after the test passed).
    case $name in test_header_*|test_nodriver|test_status|test_ipc_wire|test_driver_floor) continue ;; esac
    # API errors the tests provoke on purpose (capture queries, bad input) are
    # not reported; leaks and memory errors are.
    # CUBUF_TEST_SANITIZER: a test that checks a stream is still busy knows
    # the sanitizer may have waited for it (test_caching_gpu says where).
    res=$(CUBUF_TEST_SANITIZER=1 timeout 150 compute-sanitizer --tool memcheck --leak-check full --report-api-errors no --error-exitcode 99 \
          --target-processes all "$t" 2>&1)
    code=$?
    echo "== $name exit $code" >>"$out/sanitize.log"
    echo "$res" | tail -40 >>"$out/sanitize.log"
    summary=$(echo "$res" | grep -E "ERROR SUMMARY" | tail -1)
    leaks=$(echo "$res" | grep -E "LEAK SUMMARY" | tail -1 | sed 's/^=* *//')
    # A program that makes no CUDA call has nothing to check: the sanitizer
    # says so and exits 255 after the program itself passed.
    if echo "$res" | grep -q "terminated before first instrumented API call" &&
       echo "$res" | grep -q "all checks passed"; then
      echo "sanitize $name: makes no CUDA call (passed without the sanitizer's check)"
      continue
    fi
    echo "sanitize $name: exit $code ${summary#========= } ${leaks}"
    [ $code -eq 0 ] || [ $code -eq 77 ] || rc=1
  done
fi
if has pysanitize; then
  # The pytest suite's GPU tests, interop included, under the sanitizer. The
  # verdict is pytest's own (its junit file: tests ran, none failed) and the
  # leaks at exit: the frameworks still hold memory of their own then (torch's,
  # numba's and XLA's caches), so a leak counts against cubuf when the first
  # frame of its allocation backtrace lies in cubuf (libcubuf, or the
  # extension, which links it); records without a backtrace are counted apart.
  # The sanitizer's own exit status is printed, not judged: with the
  # frameworks loaded it has reported "Target application returned an error"
  # after pytest had reported every test passed.
  junit="$out/pysanitize-junit.xml"
  rm -f "$junit"
  (cd python/tests && PYTHONPATH=../../$build/python timeout 400 compute-sanitizer --tool memcheck \
     --leak-check full --report-api-errors no --target-processes all \
     python3 -m pytest -q -p no:cacheprovider -m gpu --junitxml="$junit" .) >"$out/pysanitize.log" 2>&1
  echo "pysanitize: the sanitizer's exit status $?"
  grep -E "^[0-9]+ [a-z]+.* in [0-9.]+s|ERROR SUMMARY|LEAK SUMMARY" "$out/pysanitize.log" | tail -3
  python3 - "$junit" <<'PY' || rc=1
import sys
import xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError) as e:
    sys.exit(f"pysanitize: no junit file from pytest ({e})")
s = root if root.tag == "testsuite" else root.find("testsuite")
n, bad = int(s.get("tests", 0)), int(s.get("failures", 0)) + int(s.get("errors", 0))
print(f"pysanitize: pytest ran {n} test(s), {bad} failed or errored, {s.get('skipped', 0)} skipped")
sys.exit(n == 0 or bad > 0)
PY
  awk '/Leaked [0-9,]+ bytes/ {n++; b=$3; gsub(",", "", b); first=1; next}
       /^=+ *$/ {first=0}
       first && /Host Frame:/ {first=0; if ($0 ~ /libcubuf|_cubuf\./) {c++; cb+=b} else {o++; ob+=b}}
       END {printf "pysanitize: %d leak record(s): %d made by cubuf (%.0f bytes), %d by others (%.0f bytes), " \
                   "%d without a backtrace\n", n, c, cb, o, ob, n - c - o; exit (c > 0)}' "$out/pysanitize.log" || rc=1
fi
if has bench; then
  for b in $build/bench/bench_*; do
    [ -x "$b" ] || continue
    name=$(basename "$b")
    timeout 300 "$b" >"$out/$name.log" 2>&1
    echo "== $name exit $?"
    grep -E "^TARGET|^SUMMARY" "$out/$name.log"
  done
fi
if has asan; then
  # The whole suite built with CUBUF_SANITIZE=address,undefined (build-gpu-asan).
  # protect_shadow_gap=0: cuInit maps memory where ASan's shadow gap lies
  # (without it cuInit fails with CUDA_ERROR_OUT_OF_MEMORY).
  asan=build-gpu-asan
  if { cmake -S . -B $asan -G Ninja -DCUBUF_WERROR=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
             -DCUBUF_SANITIZE=address,undefined && cmake --build $asan -j 16; } >"$out/asan-build.log" 2>&1; then
    ASAN_OPTIONS=protect_shadow_gap=0:detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
      ctest --test-dir $asan --output-on-failure --output-junit junit.xml --timeout 300 >"$out/asan.log" 2>&1 || rc=1
    cp $asan/junit.xml "$out/asan-junit.xml" 2>/dev/null || true
    cp $asan/Testing/Temporary/LastTest.log "$out/asan-LastTest.log" 2>/dev/null || true
    reports=$(grep -E -c 'ERROR: (Address|Leak)Sanitizer|runtime error:' "$out/asan-LastTest.log" 2>/dev/null)
    grep -E "tests passed|tests failed|Failed|\*\*\*" "$out/asan.log" | tail -25
    sed -n '/^cubuf: .* tests /,$p' "$out/asan.log"
    echo "asan: ${reports:-0} sanitizer report line(s) in the tests' output (asan-LastTest.log)"
    [ "${reports:-0}" -eq 0 ] || rc=1
  else
    tail -50 "$out/asan-build.log"
    echo "asan: the build failed (asan-build.log)"
    rc=1
  fi
fi
exit $rc
