#!/usr/bin/env bash
# Bitwise check of a refactoring: builds tools/refactor_check/dump.cpp (the
# version in the working tree, so both sides run the same cases) against the
# headers of REV_A and of REV_B, runs both and `cmp`s every file they write.
#
#   tools/refactor_check/compare.sh REV_A REV_B [WORK_DIR]
#
# dump.cpp includes only the umbrella headers, whose paths every revision
# since the folder move keeps. Exit status 0 only if both wrote the same set
# of files and every pair is byte-identical. Builds are cached per commit in
# WORK_DIR (default /tmp/apex_refactor_check).
#
# MPI=1 also builds dump_mpi.cpp with mpicxx and runs it at P = 2 and 3
# (ExpertParallelMoE), adding its files to the comparison.
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 REV_A REV_B [WORK_DIR]" >&2; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
repo=$(git -C "$here" rev-parse --show-toplevel)
work=${3:-/tmp/apex_refactor_check}
CXX=${CXX:-g++}
CXXFLAGS=${CXXFLAGS:-"-std=c++17 -O2 -DNDEBUG"}
EIGEN=${EIGEN_INCLUDE:-/usr/include/eigen3}
mkdir -p "$work"

build() {  # rev → path of the dump binary built against its headers
  local sha; sha=$(git -C "$repo" rev-parse --verify "$1^{commit}")
  local dir="$work/$sha"
  if [ ! -x "$dir/dump" ] || ! cmp -s "$here/dump.cpp" "$dir/dump.cpp" ||
     ! cmp -s "$here/dump_files.hpp" "$dir/dump_files.hpp"; then
    rm -rf "$dir" && mkdir -p "$dir/src"
    git -C "$repo" archive "$sha" include | tar -x -C "$dir/src"
    cp "$here/dump.cpp" "$here/dump_files.hpp" "$dir/"
    echo "building dump against $1 ($sha)" >&2
    $CXX $CXXFLAGS -I"$dir/src/include" -I"$EIGEN" "$dir/dump.cpp" -o "$dir/dump"
  fi
  if [ "${MPI:-0}" = 1 ] && { [ ! -x "$dir/dump_mpi" ] || ! cmp -s "$here/dump_mpi.cpp" "$dir/dump_mpi.cpp"; }; then
    cp "$here/dump_mpi.cpp" "$dir/dump_mpi.cpp"
    echo "building dump_mpi against $1 ($sha)" >&2
    mpicxx $CXXFLAGS -I"$dir/src/include" -I"$EIGEN" "$dir/dump_mpi.cpp" -o "$dir/dump_mpi"
  fi
  echo "$dir/dump"
}

run_mpi() {  # binary dir, out dir
  [ "${MPI:-0}" = 1 ] || return 0
  for p in 2 3; do
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
      mpirun --oversubscribe -np "$p" "$1/dump_mpi" "$2" >/dev/null
  done
}

a=$(build "$1")
b=$(build "$2")
out_a="$work/out-a" out_b="$work/out-b"
rm -rf "$out_a" "$out_b" && mkdir -p "$out_a" "$out_b"
"$a" "$out_a" >/dev/null
"$b" "$out_b" >/dev/null
run_mpi "$(dirname "$a")" "$out_a"
run_mpi "$(dirname "$b")" "$out_b"

status=0
if ! diff <(cd "$out_a" && ls) <(cd "$out_b" && ls) >/dev/null; then
  echo "the two revisions wrote different sets of files:" >&2
  diff <(cd "$out_a" && ls) <(cd "$out_b" && ls) >&2 || true
  status=1
fi
same=0 differ=0
for f in "$out_a"/*.bin; do
  n=$(basename "$f")
  [ -f "$out_b/$n" ] || continue
  if cmp -s "$f" "$out_b/$n"; then same=$((same + 1)); else differ=$((differ + 1)); echo "DIFFERS: $n"; fi
done
echo "paths:"; sed 's/^/  /' "$out_a/paths.txt"
echo "$same files byte-identical, $differ differ ($1 vs $2)"
[ "$differ" -eq 0 ] || status=1
exit $status
