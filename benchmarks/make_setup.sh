#!/usr/bin/env bash
# `make setup` from fresh clones of two commits, alternating (the order swapped each repeat), cold caches: the whole
# set-up a new user and CI pay.
# usage: benchmarks/make_setup.sh OLD_REV NEW_REV [REPEATS]   (from the repository root; clones into a temp folder)
# Prints each run's seconds; give the day's reference beside them (python benchmarks/demo.py --worker --variant reference).
set -euo pipefail
[ $# -ge 2 ] || { sed -n '2,5p' "$0" >&2; exit 2; }
old=$1 new=$2 repeats=${3:-2}
repo=$(pwd) work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for i in $(seq "$repeats"); do
  pair=("$old" "$new"); [ $((i % 2)) = 0 ] && pair=("$new" "$old")
  for rev in "${pair[@]}"; do
    rm -rf "$work/clone" "$work/uv-cache"
    git clone -q "$repo" "$work/clone"
    git -C "$work/clone" checkout -q "$rev"
    start=$(date +%s.%N)
    (cd "$work/clone" && UV_CACHE_DIR="$work/uv-cache" PIP_NO_CACHE_DIR=1 make setup >"$work/log" 2>&1) || { tail -20 "$work/log"; exit 1; }
    python3 -c "import sys; print(f'{sys.argv[1]}: make setup {float(sys.argv[3]) - float(sys.argv[2]):.1f} s')" "$rev" "$start" "$(date +%s.%N)"
  done
done
