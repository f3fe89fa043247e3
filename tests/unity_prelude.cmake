# cmake -DOUTPUT=<header> -DSOURCES=<a.cpp|b.cpp> -P unity_prelude.cmake
# Writes a header that #includes, once each, every header the SOURCES include, in order of first
# appearance. A test executable built in unity batches includes it before each of its files, at
# global scope, and then wraps the file in a namespace of its own (tests/CMakeLists.txt): the
# file's own #include lines are then no-ops instead of declaring headers inside that namespace.
# The header is rewritten only when its text changes, so editing a test rebuilds only its batch.
string(REPLACE "|" ";" _sources "${SOURCES}")
set(_includes "")
foreach(_src ${_sources})
  file(STRINGS ${_src} _lines REGEX "^#include [<\"]")
  list(APPEND _includes ${_lines})
endforeach()
list(REMOVE_DUPLICATES _includes)
string(JOIN "\n" _body ${_includes})
file(CONFIGURE OUTPUT ${OUTPUT} CONTENT "// generated from the test sources by tests/unity_prelude.cmake\n#pragma once\n${_body}\n" @ONLY)
