#!/usr/bin/env bash
# Builds the libFuzzer targets — the safetensors loader (fuzz_safetensors),
# the shard-index parser (fuzz_shard_index) and the GGUF reader and writer
# (fuzz_gguf) — and runs each for a bounded time.
#
#   tests/fuzz/run.sh [SECONDS]        (default 60; each target gets SECONDS)
#
# Needs clang++ with libFuzzer (Debian: clang, libclang-rt-14-dev), Eigen 3.4
# and nlohmann-json3-dev. Environment: FUZZ_BUILD_DIR (default build-fuzz),
# CXX_FUZZ (default clang++). The committed seeds (corpus/, corpus_index/,
# corpus_gguf/) and past crashes (regressions/, regressions_index/,
# regressions_gguf/) are read, never modified; new inputs go to
# $FUZZ_BUILD_DIR/corpus, corpus_index and corpus_gguf. A crash leaves
# crash-* in $FUZZ_BUILD_DIR/artifacts (artifacts_index, artifacts_gguf) and
# a non-zero exit: copy that file into tests/fuzz/regressions/ (or
# regressions_index/, regressions_gguf/), where test_malformed_files.cpp
# (test_file_inputs.cpp, test_gguf.cpp) replays it on every test run, then
# fix the reader.
set -euo pipefail
seconds=${1:-60}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${FUZZ_BUILD_DIR:-$root/build-fuzz}
cxx=${CXX_FUZZ:-clang++}
eigen=$(pkg-config --cflags eigen3 2>/dev/null || echo "-I/usr/include/eigen3")
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

# build TARGET: $out/TARGET from $here/TARGET.cpp, when a source is newer.
build() {
  local bin="$out/$1"
  if [[ ! -x "$bin" || -n "$(find "$here" "$root/include" -newer "$bin" -name '*.[ch]pp' -print -quit)" ]]; then
    echo "building $bin"
    # shellcheck disable=SC2086
    "$cxx" -std=c++17 -g -O1 -fno-omit-frame-pointer \
      -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
      -I"$root/include" $eigen "$here/$1.cpp" -o "$bin"
  fi
}

# fuzz TARGET SUFFIX DICT MAX_LEN: SECONDS of TARGET on corpus$SUFFIX and regressions$SUFFIX.
# -rss_limit_mb: the reader must stay far below it for inputs of -max_len.
fuzz() {
  mkdir -p "$out/corpus$2" "$out/artifacts$2"
  "$out/$1" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=1024 -max_len="$4" \
    -dict="$here/$3" -artifact_prefix="$out/artifacts$2/" -print_final_stats=1 \
    "$out/corpus$2" "$here/corpus$2" "$here/regressions$2"
}

mkdir -p "$out"
build fuzz_safetensors
build fuzz_shard_index
build fuzz_gguf
fuzz fuzz_safetensors "" safetensors.dict 16384
fuzz fuzz_shard_index _index shard_index.dict 65536
fuzz fuzz_gguf _gguf gguf.dict 16384
