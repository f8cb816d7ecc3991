# Closing lines of a ctest run: how many tests were skipped and why.
#
#   cmake -DJUNIT=BUILD/junit.xml -P cmake/test_summary.cmake
#
# ctest runs this after the tests (CTestCustom.cmake, generated into the build
# directory). It reads the JUnit file that the README's test command asks for
# (ctest --output-junit junit.xml): CTest's own log does not tell a skipped
# test from a passed one. A test skips by printing "SKIP: reason" and exiting
# 77 (tests/test.h); one that exits 77 without a reason fails the run.

if(NOT EXISTS "${JUNIT}")
  message("cubuf: no skip summary: run ctest with --output-junit junit.xml "
          "(as the README's test command does) to list the skipped tests and why")
  return()
endif()
file(READ "${JUNIT}" xml)

function(cubuf_unescape var text)
  string(REPLACE "&lt;" "<" text "${text}")
  string(REPLACE "&gt;" ">" text "${text}")
  string(REPLACE "&quot;" "\"" text "${text}")
  string(REPLACE "&apos;" "'" text "${text}")
  string(REPLACE "&amp;" "&" text "${text}")
  set(${var} "${text}" PARENT_SCOPE)
endfunction()

set(total 0)
set(skipped 0)
set(keys "")          # one per distinct reason, in the order first seen
set(silent "")        # tests that skipped without a reason
set(rest "${xml}")
string(FIND "${rest}" "<testcase " at)
while(NOT at EQUAL -1)
  math(EXPR total "${total} + 1")
  math(EXPR from "${at} + 10")
  string(SUBSTRING "${rest}" ${from} -1 rest)
  string(FIND "${rest}" "<testcase " at)
  string(SUBSTRING "${rest}" 0 ${at} case)   # the whole rest when at is -1
  if(NOT case MATCHES "status=\"notrun\"")
    continue()
  endif()
  math(EXPR skipped "${skipped} + 1")
  string(REGEX MATCH "name=\"([^\"]*)\"" _ "${case}")
  set(name "${CMAKE_MATCH_1}")
  set(reason "")
  if(case MATCHES "<skipped message=\"SKIP_RETURN_CODE=")
    set(out "")
    if(case MATCHES "<system-out>(.*)</system-out>")
      set(out "\n${CMAKE_MATCH_1}")
    endif()
    if(out MATCHES "\nSKIP:[ ]*([^\n]*)")
      cubuf_unescape(reason "${CMAKE_MATCH_1}")
    else()
      string(APPEND silent " ${name}")
      set(reason "(no reason printed)")
    endif()
  elseif(case MATCHES "<skipped message=\"([^\"]*)\"")
    cubuf_unescape(reason "not run: ${CMAKE_MATCH_1}")
  else()
    set(reason "not run")
  endif()
  string(MD5 key "${reason}")
  if(NOT DEFINED tests_${key})
    list(APPEND keys ${key})
    set(reason_${key} "${reason}")
    set(count_${key} 0)
  endif()
  string(APPEND tests_${key} " ${name}")
  math(EXPR count_${key} "${count_${key}} + 1")
endwhile()

if(skipped EQUAL 0)
  message("cubuf: ${total} of ${total} tests ran, none skipped")
  return()
endif()
set(report "cubuf: ${skipped} of ${total} tests skipped (skipped is not passed):")
foreach(key IN LISTS keys)
  string(APPEND report "\n  ${count_${key}} skipped: ${reason_${key}}\n     ${tests_${key}}")
endforeach()
message("${report}")
if(silent)
  message(FATAL_ERROR "cubuf: these tests exited 77 without printing \"SKIP: reason\":${silent}")
endif()
