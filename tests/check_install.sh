#!/usr/bin/env bash
# Installs the build into a temporary prefix and checks what a user gets:
#  - the headers (the generated <cubuf/version.h> included), the libraries,
#    the soname the README's version policy names;
#  - a consumer built through find_package(cubuf);
#  - the README's code example, compiled with warnings as errors;
#  - the README's pkg-config recipe run exactly as written, with only
#    /opt/cubuf and the build directory replaced, on that example: it must
#    compile, link, load libcubuf at run time and run (without a GPU it
#    stops at its first call with CUBUF_ERROR_NO_DRIVER or _NO_DEVICE);
#  - the same program linked with -Wl,-rpath instead of LD_LIBRARY_PATH;
#  - the installed cubuf.pc unchanged after the install tree is moved.
#
# Usage: check_install.sh BUILD_DIR SOURCE_DIR LIBDIR CC
#   LIBDIR: CMAKE_INSTALL_LIBDIR (lib, lib64, ...); CC: the build's C compiler.
set -euo pipefail
build=$1 src=$2 libdir_rel=$3 cc=$4
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "check_install: $*" >&2; exit 1; }

prefix=$tmp/prefix
cmake --install "$build" --prefix "$prefix" >/dev/null
libdir=$prefix/$libdir_rel
for f in include/cubuf.h include/cubuf/vmm.h include/cubuf/ipc.h include/cubuf/dist.h include/cubuf/version.h \
         "$libdir_rel/pkgconfig/cubuf.pc" "$libdir_rel/libcubuf.a" "$libdir_rel/libcubuf.so"; do
  test -f "$prefix/$f" || fail "$f is not installed"
done
if ls "$prefix"/include/cubuf/*.in >/dev/null 2>&1; then fail "a template (.in) was installed"; fi

# The soname follows the version (README, "Versions"): 0.MINOR while 0.x.
ver() { sed -n "s/^#define CUBUF_VERSION_$1 \\([0-9]*\\)\$/\\1/p" "$prefix/include/cubuf/version.h"; }
major=$(ver MAJOR) minor=$(ver MINOR) patch=$(ver PATCH)
[ -n "$major" ] && [ -n "$minor" ] && [ -n "$patch" ] || fail "version.h lacks the version macros"
if [ "$major" = 0 ]; then soname=libcubuf.so.0.$minor; else soname=libcubuf.so.$major; fi
test -f "$libdir/$soname" || fail "$soname is not installed"
test -f "$libdir/libcubuf.so.$major.$minor.$patch" || fail "libcubuf.so.$major.$minor.$patch is not installed"
got=$(readelf -d "$libdir/libcubuf.so" | sed -n 's/.*Library soname: \[\(.*\)\].*/\1/p')
[ "$got" = "$soname" ] || fail "soname is '$got', expected $soname"

# find_package(cubuf)
cmake -S "$src/tests/consumer" -B "$tmp/consumer" -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$tmp/consumer" >/dev/null
LD_LIBRARY_PATH="$libdir" "$tmp/consumer/consumer"

# The pkg-config file points into wherever it lies now.
pc=$libdir/pkgconfig/cubuf.pc
grep -q '^prefix=${pcfiledir}/' "$pc" || fail "cubuf.pc is not relocatable: $(grep '^prefix=' "$pc")"
[ "$(PKG_CONFIG_PATH=$libdir/pkgconfig pkg-config --modversion cubuf)" = "$major.$minor.$patch" ] ||
  fail "cubuf.pc's Version differs from version.h"

# The README's example and recipe, taken from README.md.
mkdir "$tmp/app"
awk '/^## Using it/ { s = 1 } s == 1 && /^```c$/ { s = 2; next } s == 2 && /^```$/ { exit } s == 2' \
  "$src/README.md" >"$tmp/app/app.c"
[ -s "$tmp/app/app.c" ] || fail "no \`\`\`c example under '## Using it' in README.md"
recipe_start='    cmake --install build --prefix /opt/cubuf'
awk -v first="$recipe_start" '$0 == first { s = 1 } s && !/^    / { exit } s { sub(/^    /, ""); print }' \
  "$src/README.md" >"$tmp/recipe.sh"
[ -s "$tmp/recipe.sh" ] || fail "README.md has no recipe starting with '$recipe_start'"
grep -q 'app\.c' "$tmp/recipe.sh" || fail "the README's recipe does not build app.c"

# No call of the example drops a status: a function that returns one is never
# called as a statement of its own (or cast to void).
status_fns=$(grep -ho 'cubuf_status_t cubuf_[a-z0-9_]*(' "$prefix"/include/cubuf.h "$prefix"/include/cubuf/*.h |
             sed 's/.* \(cubuf_[a-z0-9_]*\)(/\1/' | sort -u)
[ -n "$status_fns" ] || fail "no function returning cubuf_status_t found in the installed headers"
dropped=$(sed -n 's/^[[:space:]]*\((void)[[:space:]]*\)\{0,1\}\(cubuf_[a-z0-9_]*\)(.*/\2/p' "$tmp/app/app.c" |
          grep -Fxf <(echo "$status_fns") || true)
[ -z "$dropped" ] || fail "the README's example ignores the status of: $(echo $dropped)"

"$cc" -std=c11 -Wall -Wextra -Wpedantic -Werror -c "$tmp/app/app.c" -o "$tmp/app.o" \
  $(PKG_CONFIG_PATH=$libdir/pkgconfig pkg-config --cflags cubuf) ||
  fail "the README's example does not compile cleanly"

rm -rf "$prefix"          # the recipe installs it again, as a user would
sed -i -e "s|/opt/cubuf/lib\\b|$libdir|g" -e "s|/opt/cubuf|$prefix|g" \
       -e "s|--install build |--install $build |" "$tmp/recipe.sh"
set +e
(cd "$tmp/app" && bash -e "$tmp/recipe.sh") >"$tmp/recipe.log" 2>&1
rc=$?
set -e
expect_ran() {  # LOG RC WHAT
  if [ "$2" -eq 0 ]; then return; fi
  if [ "$2" -eq 1 ] && grep -Eq 'CUBUF_ERROR_NO_(DRIVER|DEVICE)' "$1"; then
    echo "$3: loaded libcubuf and stopped without a GPU: $(grep -E 'CUBUF_ERROR_NO_' "$1" | head -1)"
    return
  fi
  sed 's/^/  /' "$1" >&2
  fail "$3 exited $2"
}
expect_ran "$tmp/recipe.log" $rc "the README's recipe"

# The rpath alternative the README names: no LD_LIBRARY_PATH needed.
cc "$tmp/app/app.c" $(PKG_CONFIG_PATH=$libdir/pkgconfig pkg-config --cflags --libs cubuf) \
  -Wl,-rpath,"$libdir" -o "$tmp/app/app_rpath"
set +e
env -u LD_LIBRARY_PATH "$tmp/app/app_rpath" >"$tmp/rpath.log" 2>&1
rc=$?
set -e
expect_ran "$tmp/rpath.log" $rc "the example linked with -Wl,-rpath"

# Moved after the install, the tree still builds through its cubuf.pc.
mv "$prefix" "$tmp/moved"
moved_cflags=$(PKG_CONFIG_PATH=$tmp/moved/$libdir_rel/pkgconfig pkg-config --cflags --libs cubuf)
case $moved_cflags in *"$tmp/moved/"*include*) ;; *) fail "moved cubuf.pc gives '$moved_cflags'" ;; esac
cc "$tmp/app/app.c" $moved_cflags -o "$tmp/app_moved"
echo "install ok"
