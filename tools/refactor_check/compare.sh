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
  if [ ! -x "$dir/dump" ] || ! cmp -s "$here/dump.cpp" "$dir/dump.cpp"; then
    rm -rf "$dir" && mkdir -p "$dir/src"
    git -C "$repo" archive "$sha" include | tar -x -C "$dir/src"
    cp "$here/dump.cpp" "$dir/dump.cpp"
    echo "building dump against $1 ($sha)" >&2
    $CXX $CXXFLAGS -I"$dir/src/include" -I"$EIGEN" "$dir/dump.cpp" -o "$dir/dump"
  fi
  echo "$dir/dump"
}

a=$(build "$1")
b=$(build "$2")
out_a="$work/out-a" out_b="$work/out-b"
rm -rf "$out_a" "$out_b" && mkdir -p "$out_a" "$out_b"
"$a" "$out_a" >/dev/null
"$b" "$out_b" >/dev/null

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
