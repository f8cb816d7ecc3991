#!/usr/bin/env bash
# Builds bench/bench_torch_peer.cpp against the PyTorch that python3 imports
# and the libcubuf of a CMake build directory: BUILD_DIR/bench/bench_torch_peer
# (torch's library directory and BUILD_DIR in its rpath). Run it afterwards:
#     bench/build_torch_peer.sh build && build/bench/bench_torch_peer
#
# Usage: bench/build_torch_peer.sh BUILD_DIR [CXX]
# Needs: python3 with torch (a CUDA build), the CUDA toolkit headers
# ($CUDA_HOME, default /usr/local/cuda), a C++17 compiler. Exit status: 0
# built, 77 no torch (nothing to build), 1 the build failed, 2 bad usage.
set -euo pipefail

if [ $# -lt 1 ] || [ $# -gt 2 ]; then
    echo "usage: $0 BUILD_DIR [CXX]" >&2
    exit 2
fi
build=$(cd "$1" && pwd)
cxx=${2:-${CXX:-c++}}
here=$(cd "$(dirname "$0")" && pwd)
src=$(dirname "$here")

if ! paths=$(python3 -c 'import torch, os
d = os.path.dirname(torch.__file__)
print(os.path.join(d, "include"))
print(os.path.join(d, "include", "torch", "csrc", "api", "include"))
print(os.path.join(d, "lib"))
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))' 2>/dev/null); then
    echo "SKIP: python3 cannot import torch: nothing to build"
    exit 77
fi
mapfile -t p <<<"$paths"
torch_inc=${p[0]}
torch_api_inc=${p[1]}
torch_lib=${p[2]}
abi=${p[3]}
cuda_inc=${CUDA_HOME:-/usr/local/cuda}/include
lib=$(ls "$build"/libcubuf.so 2>/dev/null || true)
if [ -z "$lib" ]; then
    echo "$0: no libcubuf.so in $build (build cubuf first)" >&2
    exit 1
fi
mkdir -p "$build/bench"
set -x
"$cxx" -std=c++17 -O2 -D_GLIBCXX_USE_CXX11_ABI="$abi" \
    -I"$src/include" -I"$build/include" -I"$cuda_inc" -I"$torch_inc" -I"$torch_api_inc" \
    "$here/bench_torch_peer.cpp" -o "$build/bench/bench_torch_peer" \
    -L"$torch_lib" -lc10_cuda -lc10 -L"$build" -lcubuf -ldl -pthread \
    -Wl,-rpath,"$torch_lib" -Wl,-rpath,"$build"
