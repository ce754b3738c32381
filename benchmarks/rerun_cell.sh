#!/usr/bin/env bash
# A benchmark cell's rerun in batches of methods, across sessions and machines (docs/results/benchmark/reruns/README.md).
#
#   benchmarks/rerun_cell.sh start  CELL COMMIT   a work tree of COMMIT with the rerun's file, and the rerun's folder
#                                                 copied out of the repository (once per machine, or per commit)
#   benchmarks/rerun_cell.sh run    CELL COMMIT METHOD[,METHOD...]   one batch, resumable (`fedsweep bench --resume`)
#   benchmarks/rerun_cell.sh record CELL COMMIT METHOD[,METHOD...]   the folder back into the repository, checked: into
#                                                 a fresh MLflow store, --resume naming every done METHOD must run
#                                                 nothing and write the same tables, compact.md and final runs
#
# From the repository root (its .venv; `../shared/data` beside it, Fashion-MNIST from Debian's dataset-fashion-mnist).
# Work trees, outputs and stores live under $RERUN_ROOT (default ../rerun), one MLflow store per cell (Tune's saved
# sweep belongs to its runs: keep it between the batches of one machine). `run` appends start/end times to
# $RERUN_ROOT/CELL/times.txt and the command's output to run.log. Commit the repository's folder after `record`.
set -euo pipefail
action=$1 cell=$2 commit=$3 methods=${4:-}
repo=$(pwd)
root=$(realpath -m "${RERUN_ROOT:-$repo/../rerun}")
short=$(git rev-parse --short "$commit")
wt=$root/wt-$short out=$root/$cell/out
saved=$repo/docs/results/benchmark/reruns/$cell
data=$(realpath -m "${FEDSWEEP_DATA_DIR:-$repo/../shared/data}")
[ -f "$saved/$cell.yaml" ] || { echo "no rerun file $saved/$cell.yaml" >&2; exit 2; }
name=$(cd "$saved" && ls -d bench-*/ | head -1); name=${name%/}

bench() {  # bench STORE OUTPUT METHODS: the cell's file in the work tree, that tree's code
  (cd "$wt" && PYTHONPATH=$wt FEDSWEEP_DATA_DIR=$data MLFLOW_TRACKING_URI=sqlite:///$1 \
     "$repo/.venv/bin/fedsweep" bench "sweeps/benchmark/$cell.yaml" --methods "$3" --output "$2" --resume --quiet)
}

case $action in
  start)
    [ -d "$wt" ] || git worktree add --quiet --detach "$wt" "$commit"
    cp "$saved/$cell.yaml" "$wt/sweeps/benchmark/"
    if [ -d "$out/$name" ]; then echo "kept $out/$name (remove it to start from the repository's copy)"
    else mkdir -p "$out" && cp -r "$saved/$name" "$out/"; fi
    echo "work tree $wt at $short; output $out/$name" ;;
  run)
    [ -d "$wt" ] && [ -d "$out/$name" ] || { echo "run '$0 start $cell $commit' first" >&2; exit 2; }
    echo "$(date -u +%FT%T) start $methods at $short ($(uname -n))" >> "$root/$cell/times.txt"
    rc=0; bench "$root/$cell/mlflow.db" "$out" "$methods" >> "$root/$cell/run.log" 2>&1 || rc=$?
    echo "$(date -u +%FT%T) end $methods rc=$rc" >> "$root/$cell/times.txt"
    exit $rc ;;
  record)
    rm -rf "${saved:?}/$name" && cp -r "$out/$name" "$saved/"
    check=$(mktemp -d); trap 'rm -rf "$check"' EXIT
    mkdir -p "$check/out" && cp -r "$saved/$name" "$check/out/"
    bench "$check/mlflow.db" "$check/out" "$methods" > "$check/log" 2>&1 || { tail -20 "$check/log"; exit 1; }
    grep -q "nothing left to run" "$check/log" || { echo "the check ran something:"; tail -20 "$check/log"; exit 1; }
    diff -rq "$check/out/$name/runs" "$saved/$name/runs"
    for f in compact.md "$saved/$name"/table_b*.md "$saved/$name"/table_b*.csv "$saved/$name"/final_runs_b*.csv; do
      cmp "$check/out/$name/${f##*/}" "$saved/$name/${f##*/}"; done
    grep -o "[0-9]* of the file's [0-9]* methods done" "$check/log"
    echo "recorded into $saved/$name: the same tables, compact.md and final runs from a fresh store" ;;
  *) sed -n '2,14p' "$0"; exit 2 ;;
esac
