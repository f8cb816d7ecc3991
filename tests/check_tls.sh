#!/bin/sh
# Every TLS descriptor call in the given static libraries or object files
# sits in a function that does nothing else (CUBUF_TLS_ACCESSOR,
# src/common.h): glibc before 2.40 may change vector registers on the
# descriptor's dynamic path (BZ#31372), which the compiler takes to keep
# every register; a function that only returns the address, called as an
# ordinary function, leaves its callers nothing to lose. The descriptor
# calls are found by their relocation (R_X86_64_TLSDESC_CALL), so in
# static libraries or object files: the shared library is linked from the
# same objects. A build without descriptors (another compiler, another
# dialect) has none.
set -eu
status=0
for bin in "$@"; do
    objdump -dr --no-show-raw-insn "$bin" | awk -v bin="$bin" '
        function finish() {
            if (sites > 0) {
                total += sites
                if (other_calls > 0 || vec > 0) {
                    printf "%s: %s: a TLS descriptor call in a function that does more " \
                           "(%d other calls, %d vector-register uses)\n",
                           bin, fn, other_calls, vec
                    bad++
                }
            }
            sites = other_calls = vec = 0
            last_call = 0
        }
        /^[0-9a-f]+ <.*>:$/ { finish(); fn = $2; gsub(/^<|>:$/, "", fn); next }
        /R_X86_64_TLSDESC_CALL/ { sites++; other_calls--; next }
        /R_X86_64_[A-Z0-9_]+[ \t]+__(tsan|asan|ubsan|msan|sanitizer)_/ {
            if (last_call) other_calls-- # a sanitizer'"'"'s instrumentation
            next
        }
        /^ +[0-9a-f]+:\t/ {
            split($0, parts, "\t")
            insn = parts[2]
            if (insn ~ /%[xyz]mm/) vec++
            last_call = insn ~ /^call/
            if (last_call) other_calls++
        }
        END {
            finish()
            if (bad) exit 1
            if (total) printf "%s: %d TLS descriptor calls, each in a function of its own\n", bin, total
            else printf "%s: no TLS descriptor calls\n", bin
        }' || status=1
done
exit $status
