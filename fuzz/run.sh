#!/usr/bin/env bash
# Fuzzes the IPC descriptor deserializer (pure CPU, no GPU or driver) with
# clang's libFuzzer, ASan and UBSan, for a bounded time.
#
#   fuzz/run.sh [SECONDS]     (default 60, or $FUZZ_SECONDS)
#
# Builds with CMake (-DCUBUF_BUILD_FUZZ=ON, fuzz/CMakeLists.txt) into the
# build directory $FUZZ_OUT (default build-fuzz/ at the repository root, which
# git ignores) and runs there: the seed corpus from fuzz/ipc_seeds.h (seeds/),
# the growing corpus (corpus/) and any crash file stay in that directory,
# never in the source tree. Exits non-zero on a crash or a broken property
# (the input is saved as $FUZZ_OUT/crash-*).
# Needs the Debian packages clang and libclang-rt-dev (libFuzzer and the
# sanitizer runtimes); without them it prints SKIP and exits 0.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
secs="${1:-${FUZZ_SECONDS:-60}}"
out="${FUZZ_OUT:-$root/build-fuzz}"
cc="${FUZZ_CC:-clang}"

if ! command -v "$cc" >/dev/null 2>&1; then
  echo "fuzz: SKIP: $cc not found (Debian: apt-get install clang libclang-rt-dev)"
  exit 0
fi
cuda_inc=""
for d in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda; do
  if [ -n "$d" ] && [ -f "$d/include/cuda.h" ]; then cuda_inc="$d/include"; break; fi
done
if [ -z "$cuda_inc" ]; then
  echo "fuzz: SKIP: cuda.h not found (set CUDA_HOME); only the header is needed"
  exit 0
fi
mkdir -p "$out"
out="$(cd "$out" && pwd)"
printf 'int LLVMFuzzerTestOneInput(const unsigned char *d, unsigned long n);\nint LLVMFuzzerTestOneInput(const unsigned char *d, unsigned long n) { (void)d; (void)n; return 0; }\n' >"$out/probe.c"
if ! "$cc" -fsanitize=fuzzer,address,undefined "$out/probe.c" -o "$out/probe" >"$out/probe.log" 2>&1; then
  echo "fuzz: SKIP: $cc cannot link -fsanitize=fuzzer,address,undefined: the libFuzzer runtime is missing (Debian: apt-get install libclang-rt-dev)"
  sed 's/^/  /' "$out/probe.log" | head -5
  exit 0
fi

CC="$cc" cmake -S "$root" -B "$out" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCUBUF_BUILD_FUZZ=ON \
  -DCUBUF_BUILD_TESTS=OFF -DCUBUF_BUILD_BENCH=OFF >"$out/configure.log" 2>&1 ||
  { cat "$out/configure.log"; exit 1; }
cmake --build "$out" --target ipc_gen_seeds fuzz_ipc_deserialize
# libFuzzer writes its logs and artifacts into the current directory.
cd "$out"
rm -rf seeds
./fuzz/ipc_gen_seeds seeds
mkdir -p corpus
echo "fuzz: running fuzz_ipc_deserialize for ${secs}s"
./fuzz/fuzz_ipc_deserialize -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 \
  -max_len=8400 -print_final_stats=1 -artifact_prefix="$out/" corpus seeds
echo "fuzz: passed (${secs}s, no crash, no broken property)"
