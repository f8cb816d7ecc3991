#!/usr/bin/env bash
# Installs the build into a temporary prefix, then builds and runs a consumer
# through find_package(cubuf) and through pkg-config.
set -euo pipefail
build=$1 src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
test -f "$tmp/prefix/include/cubuf.h" && test -f "$tmp/prefix/include/cubuf/vmm.h"
libdir=$(ls -d "$tmp"/prefix/lib*/ | head -n1)
test -f "$libdir/pkgconfig/cubuf.pc"
ls "$libdir"/libcubuf.so.0 "$libdir"/libcubuf.a >/dev/null
cmake -S "$src/tests/consumer" -B "$tmp/consumer" -DCMAKE_PREFIX_PATH="$tmp/prefix" >/dev/null
cmake --build "$tmp/consumer" >/dev/null
LD_LIBRARY_PATH="$libdir" "$tmp/consumer/consumer"
export PKG_CONFIG_PATH="$libdir/pkgconfig"
sed -i "s|^prefix=.*|prefix=$tmp/prefix|" "$libdir/pkgconfig/cubuf.pc"
cc -std=c11 -Wall -Werror "$src/tests/consumer/main.c" $(pkg-config --cflags --libs cubuf) -o "$tmp/pc_consumer"
LD_LIBRARY_PATH="$libdir" "$tmp/pc_consumer"
echo "install ok"
