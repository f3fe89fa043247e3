#!/usr/bin/env bash
# Installs the build into a temporary prefix, builds tests/install/consumer against it with
# find_package(dtensor), and runs it on one rank.
set -euo pipefail
build_dir=$1
torch_prefix=$2
src_dir=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build_dir" --prefix "$tmp/prefix" > "$tmp/install.log"
test -f "$tmp/prefix/lib/cmake/dtensor/dtensorConfig.cmake"
test -f "$tmp/prefix/include/dtensor/dtensor.h"
cmake -S "$src_dir/consumer" -B "$tmp/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$tmp/prefix;$torch_prefix" > "$tmp/configure.log" 2>&1 \
  || { tail -30 "$tmp/configure.log"; exit 1; }
cmake --build "$tmp/build" > "$tmp/build.log" 2>&1 || { tail -30 "$tmp/build.log"; exit 1; }
RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=${MASTER_PORT:-29791} "$tmp/build/consumer"
