#!/bin/sh
# Thread-local reads cannot lose a vector register (CUBUF_TLS_ACCESSOR,
# src/common.h). glibc before 2.40 may change vector registers on the TLS
# descriptor's dynamic path (BZ#31372), which the compiler takes to keep
# every register. So, in the given static libraries or object files:
#  - every descriptor call sits in a function that does nothing else (an
#    accessor: no other call, no vector register);
#  - after each call of an accessor, the caller touches no vector register
#    before it writes it (it keeps none across the call). The scan follows
#    the code in address order up to the next other call or return, which
#    is conservative for branches within that stretch.
# Descriptor calls are found by their relocation (R_X86_64_TLSDESC_CALL),
# so the objects are read before linking: the shared library and the
# Python module are linked from the same objects. With --expect-descriptors
# (the build uses -mtls-dialect=gnu2) finding none fails; without, a build
# with none has nothing to check and the script exits 77 (skipped).
# Usage: check_tls.sh [--expect-descriptors] LIB...
set -eu
expect=0
if [ "${1:-}" = --expect-descriptors ]; then
    expect=1
    shift
fi
[ $# -gt 0 ] || { echo "usage: check_tls.sh [--expect-descriptors] LIB..." >&2; exit 2; }
dump=$(mktemp)
trap 'rm -f "$dump"' EXIT

prog='
function vregs(text, out,    n, r) {   # the vector register numbers in text
    n = 0
    while (match(text, /%[xyz]mm[0-9]+/)) {
        r = substr(text, RSTART + 4, RLENGTH - 4)
        out[++n] = r + 0
        text = substr(text, RSTART + RLENGTH)
    }
    return n
}
function operands(text, ops,    n, depth, i, c, cur) {   # split at commas outside ()
    n = 0; depth = 0; cur = ""
    for (i = 1; i <= length(text); i++) {
        c = substr(text, i, 1)
        if (c == "(") depth++
        if (c == ")") depth--
        if (c == "," && depth == 0) { ops[++n] = cur; cur = ""; continue }
        cur = cur c
    }
    if (cur != "") ops[++n] = cur
    return n
}
function finish1() {
    if (sites > 0) {
        total += sites
        accessor[fn] = 1
        accessors++
        if (other_calls > 0 || vec > 0) {
            printf "%s: %s (%s): a TLS descriptor call in a function that does more " \
                   "(%d other calls, %d vector-register uses)\n", bin, fn, obj, other_calls, vec
            bad++
        }
    }
    sites = other_calls = vec = 0; last_call = 0
}
# An instruction of pass 2, appended to the current function.
function keep(insn) { ni++; text[ni] = insn; acc_call[ni] = 0 }
function is_accessor_call(insn,    name) {
    if (insn !~ /^call/) return 0
    if (match(insn, /<[^>+]+>/)) {
        name = substr(insn, RSTART + 1, RLENGTH - 2)
        if (name in accessor) return 1
    }
    return 0
}
function finish2(    i, j, k, m, mn, rest, nops, ops, v, nv, d, killed, hit, pure) {
    for (i = 1; i <= ni; i++) {
        if (!acc_call[i]) continue
        split("", killed)
        hit = ""
        for (j = i + 1; j <= ni && hit == ""; j++) {
            mn = text[j]; sub(/[ \t].*$/, "", mn)
            if (mn ~ /^(call|ret)/) break
            rest = text[j]; sub(/^[^ \t]+[ \t]*/, "", rest); sub(/[ \t]*#.*$/, "", rest)
            nops = operands(rest, ops)
            if (mn ~ /xor|pcmpeq/ && nops >= 2 && ops[1] == ops[nops] && vregs(ops[1], d) == 1) {
                killed[d[1]] = 1                   # an idiom: a write of a constant
                continue
            }
            for (k = 1; k < nops; k++) {           # sources: read
                nv = vregs(ops[k], v)
                for (m = 1; m <= nv; m++) if (!(v[m] in killed)) hit = text[j]
            }
            if (nops == 0 || hit != "") continue
            nv = vregs(ops[nops], d)             # the destination
            if (nv != 1) continue
            pure = mn ~ /^v?(mov|cvt)/
            if (!pure && !(d[1] in killed)) hit = text[j]  # read, then written
            killed[d[1]] = 1
        }
        if (hit != "") {
            printf "%s: %s (%s): a vector register kept across a call of a thread-local accessor " \
                   "(%s, then %s)\n", bin, fname, obj, text[i], hit
            bad++
        }
    }
    ni = 0
}
FNR == 1 { pass++; if (pass == 2) finish1() }
/file format/ { obj = $1; sub(/:$/, "", obj); next }
pass == 1 && /^[0-9a-f]+ <.*>:$/ { finish1(); fn = $2; gsub(/^<|>:$/, "", fn); next }
pass == 1 && /R_X86_64_TLSDESC_CALL/ { sites++; other_calls--; next }
pass == 1 && /R_X86_64_[A-Z0-9_]+[ \t]+__(tsan|asan|ubsan|msan|sanitizer)_/ {
    if (last_call) other_calls--                 # a sanitizer instrumentation call
    next
}
pass == 1 && /^ +[0-9a-f]+:\t/ {
    split($0, parts, "\t")
    if (parts[2] ~ /%[xyz]mm/) vec++
    last_call = parts[2] ~ /^call/
    if (last_call) other_calls++
    next
}
pass == 2 && /^[0-9a-f]+ <.*>:$/ { finish2(); fname = $2; gsub(/^<|>:$/, "", fname); next }
pass == 2 && /^ +[0-9a-f]+:\t/ {
    split($0, parts, "\t")
    keep(parts[2])
    if (is_accessor_call(parts[2])) acc_call[ni] = 1
    next
}
pass == 2 && /R_X86_64_(PLT32|PC32)[ \t]/ {     # a call through a relocation names its target
    if (ni > 0 && text[ni] ~ /^call/) {
        name = $NF; sub(/[-+]0x[0-9a-f]+$/, "", name)
        if (name in accessor) acc_call[ni] = 1
    }
    next
}
END {
    if (pass < 2) finish1(); else finish2()
    if (bad) exit 1
    if (total == 0) {
        if (expect) { printf "%s: no TLS descriptor call, but the build uses them\n", bin; exit 1 }
        printf "SKIP: no TLS descriptor calls in %s (the build does not use them): nothing to check\n", bin
        exit 77
    }
    printf "%s: %d TLS descriptor calls in %d accessors, each alone in its function; " \
           "no caller keeps a vector register across one\n", bin, total, accessors
}'

status=0
for lib in "$@"; do
    if ! objdump -dr --no-show-raw-insn "$lib" >"$dump"; then
        echo "$lib: objdump failed"
        status=1
        continue
    fi
    rc=0
    awk -v bin="$lib" -v expect="$expect" "$prog" "$dump" "$dump" || rc=$?
    if [ "$rc" -eq 77 ]; then
        [ "$status" -ne 0 ] || status=77
    elif [ "$rc" -ne 0 ]; then
        status=1
    fi
done
exit $status
