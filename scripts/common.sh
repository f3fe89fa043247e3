# Sourced by the scripts in this folder: repository root, build folder, compiler cache.
# shellcheck shell=bash
DTENSOR_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# The build folder, relative to the repository root unless absolute (default: build).
BUILD_DIR=${BUILD_DIR:-build}
case "$BUILD_DIR" in /*) ;; *) BUILD_DIR="$DTENSOR_ROOT/$BUILD_DIR" ;; esac
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.ccache}
export CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime

# The CMake that configured $BUILD_DIR (it may be a pip-installed one not on PATH).
cmake_of_build() {
  sed -n 's/^CMAKE_COMMAND:INTERNAL=//p' "$BUILD_DIR/CMakeCache.txt" 2>/dev/null
}
