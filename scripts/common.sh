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

# CMake arguments that let a CUDA build of LibTorch find the CUDA toolkit, for the torch whose
# CMake prefix is $1: sets CUDA_CMAKE_ARGS and CUDA_ROOT and puts the toolkit's nvcc first on
# PATH (TorchConfig finds the toolkit from nvcc's folder, so a wrapper on PATH such as
# /usr/local/bin/nvcc would point it at the wrong root). A toolkit without NVRTC (the
# compiler-only packages) gets the one the torch wheel ships. Returns 1, saying why in
# CUDA_ERROR, when no toolkit is found.
cuda_cmake_args() {
  local prefix=$1 nvrtc
  CUDA_CMAKE_ARGS=() CUDA_ERROR=
  CUDA_ROOT=${CUDA_HOME:-/usr/local/cuda}
  if [ ! -x "$CUDA_ROOT/bin/nvcc" ]; then
    if ! command -v nvcc >/dev/null; then
      CUDA_ERROR="nvcc not found (install the CUDA toolkit or set CUDA_HOME)"
      return 1
    fi
    CUDA_ROOT=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
  fi
  if [ ! -f "$CUDA_ROOT/include/cuda_runtime.h" ]; then
    CUDA_ERROR="no cuda_runtime.h under $CUDA_ROOT/include"
    return 1
  fi
  PATH="$CUDA_ROOT/bin:$PATH"
  CUDA_CMAKE_ARGS=("-DCUDA_TOOLKIT_ROOT_DIR=$CUDA_ROOT" "-DCUDAToolkit_ROOT=$CUDA_ROOT")
  if ! ls "$CUDA_ROOT"/lib*/libnvrtc.so* >/dev/null 2>&1; then
    nvrtc=$(find "$(dirname "$(dirname "$(dirname "$prefix")")")/nvidia" -name 'libnvrtc.so.*' \
      2>/dev/null | head -n 1)
    if [ -z "$nvrtc" ]; then
      CUDA_ERROR="no libnvrtc in $CUDA_ROOT or in the torch wheel's nvidia packages"
      return 1
    fi
    CUDA_CMAKE_ARGS+=("-DCUDA_nvrtc_LIBRARY=$nvrtc")
  fi
}
