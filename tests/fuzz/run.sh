#!/usr/bin/env bash
# Builds the libFuzzer target of the safetensors loader and runs it for a
# bounded time.
#
#   tests/fuzz/run.sh [SECONDS]        (default 60)
#
# Needs clang++ with libFuzzer (Debian: clang, libclang-rt-14-dev), Eigen 3.4
# and nlohmann-json3-dev. Environment: FUZZ_BUILD_DIR (default build-fuzz),
# CXX_FUZZ (default clang++). The committed seeds (corpus/) and past crashes
# (regressions/) are read, never modified; new inputs go to
# $FUZZ_BUILD_DIR/corpus. A crash leaves crash-* in $FUZZ_BUILD_DIR/artifacts
# and a non-zero exit: copy that file into tests/fuzz/regressions/, where
# test_checkpoint.cpp replays it on every test run, then fix the loader.
set -euo pipefail
seconds=${1:-60}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${FUZZ_BUILD_DIR:-$root/build-fuzz}
cxx=${CXX_FUZZ:-clang++}
eigen=$(pkg-config --cflags eigen3 2>/dev/null || echo "-I/usr/include/eigen3")
mkdir -p "$out/corpus" "$out/artifacts"

bin="$out/fuzz_safetensors"
if [[ ! -x "$bin" || -n "$(find "$here" "$root/include" -newer "$bin" -name '*.[ch]pp' -print -quit)" ]]; then
  echo "building $bin"
  # shellcheck disable=SC2086
  "$cxx" -std=c++17 -g -O1 -fno-omit-frame-pointer \
    -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -I"$root/include" $eigen "$here/fuzz_safetensors.cpp" -o "$bin"
fi

export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
# -rss_limit_mb: the loader must stay far below it for inputs of -max_len.
"$bin" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=1024 -max_len=16384 \
  -dict="$here/safetensors.dict" -artifact_prefix="$out/artifacts/" -print_final_stats=1 \
  "$out/corpus" "$here/corpus" "$here/regressions"
