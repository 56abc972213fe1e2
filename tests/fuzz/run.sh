#!/usr/bin/env bash
# Builds the libFuzzer targets and runs each for a bounded time:
#
#   target              input                         seeds / past crashes (replayed by)
#   fuzz_safetensors    a safetensors file            corpus/, regressions/ (test_malformed_files.cpp)
#   fuzz_shard_index    a shard index                 corpus_index/, regressions_index/ (test_file_inputs.cpp)
#   fuzz_gguf           a GGUF file                   corpus_gguf/, regressions_gguf/ (test_gguf.cpp)
#   fuzz_hf_config      a config.json, both readers   corpus_config/, regressions_config/ (test_hf_config.cpp)
#   fuzz_gpt_oss        a gpt-oss checkpoint          corpus_gpt_oss/, regressions_gpt_oss/ (test_gpt_oss_checkpoint.cpp)
#   fuzz_packed_layout  a pack-once file / quantized  corpus_packed/, regressions_packed/ (test_packed_load.cpp)
#                       checkpoint, both readers
#
#   tests/fuzz/run.sh [SECONDS]        (default 60; each target gets SECONDS)
#
# Needs clang++ with libFuzzer (Debian: clang, libclang-rt-14-dev), Eigen 3.4
# and nlohmann-json3-dev. Environment: FUZZ_BUILD_DIR (default build-fuzz),
# CXX_FUZZ (default clang++). The committed seeds and past crashes are read,
# never modified; new inputs go to $FUZZ_BUILD_DIR/corpus<suffix>. A crash
# leaves crash-* in $FUZZ_BUILD_DIR/artifacts<suffix> and a non-zero exit:
# copy that file into the target's regressions folder, where its test file
# (above) replays it on every test run, then fix the reader. The model-file
# seeds (corpus_gpt_oss/, corpus_packed/) are written by make_model_corpus.cpp.
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

# fuzz TARGET SUFFIX DICT MAX_LEN: SECONDS of TARGET on corpus$SUFFIX and
# regressions$SUFFIX, its output in $out/log$SUFFIX.txt (the final stats
# printed, the whole log if it fails).
# -rss_limit_mb: the reader must stay far below it for inputs of -max_len.
fuzz() {
  mkdir -p "$out/corpus$2" "$out/artifacts$2"
  local log="$out/log$2.txt" status=0
  "$out/$1" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=1024 -max_len="$4" \
    -dict="$here/$3" -artifact_prefix="$out/artifacts$2/" -print_final_stats=1 \
    "$out/corpus$2" "$here/corpus$2" "$here/regressions$2" > "$log" 2>&1 || status=$?
  if [[ $status -ne 0 ]]; then
    cat "$log"
    echo "$1: FAILED (exit $status); the input is in $out/artifacts$2/"
  else
    echo "$1: $(grep -E '^Done [0-9]+ runs' "$log")"
  fi
  return "$status"
}

# Two at a time (FUZZ_JOBS): the targets are independent, and CI's machine
# has two cores. The build of the model-file targets (the packed engine
# under the sanitizers) is most of the stage's time.
jobs=${FUZZ_JOBS:-2}
export -f build fuzz
export out cxx eigen here root seconds
mkdir -p "$out"
printf '%s\n' fuzz_safetensors fuzz_shard_index fuzz_gguf fuzz_hf_config fuzz_gpt_oss fuzz_packed_layout |
  xargs -P "$jobs" -I{} bash -c 'build "$1"' _ {}
printf '%s\n' "fuzz_safetensors '' safetensors.dict 16384" \
  "fuzz_shard_index _index shard_index.dict 65536" \
  "fuzz_gguf _gguf gguf.dict 16384" \
  "fuzz_hf_config _config config.dict 4096" \
  "fuzz_gpt_oss _gpt_oss gpt_oss.dict 32768" \
  "fuzz_packed_layout _packed packed.dict 16384" |
  xargs -P "$jobs" -L 1 bash -c 'fuzz "$@"' _
