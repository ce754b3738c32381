#!/usr/bin/env bash
# A benchmark cell's rerun in batches of methods, across sessions and machines (docs/results/benchmark/reruns/README.md).
#
#   benchmarks/rerun_cell.sh start  CELL COMMIT   a work tree of COMMIT with the rerun's file, and the rerun's folder
#                                                 copied out of the repository (once per machine, or per commit)
#   benchmarks/rerun_cell.sh run    CELL COMMIT METHOD[,METHOD...]   one batch, resumable (`fedsweep bench --resume`)
#   benchmarks/rerun_cell.sh record CELL COMMIT [METHOD,...]   the folder back into the repository once checked:
#                                                 from its runs alone, in a fresh MLflow store, --resume naming every
#                                                 done method (default: those its bench_state.json has done) runs
#                                                 nothing and writes the same tables, compact.md and final runs;
#                                                 refused if the repository's folder has a method done that this one
#                                                 lacks (recorded from another machine since `start`)
#
# From the repository root (its .venv; `../shared/data` beside it, Fashion-MNIST from Debian's dataset-fashion-mnist).
# Work trees, outputs and stores live under $RERUN_ROOT (default ../rerun), one MLflow store per cell (Tune's saved
# sweep belongs to its runs: keep it between the batches of one machine). `run` appends start/end times to
# $RERUN_ROOT/CELL/times.txt and the command's output to run.log. Commit the repository's folder after `record`.
set -euo pipefail
usage() { sed -n '2,17p' "$0" >&2; exit 2; }
action=${1:-} cell=${2:-} commit=${3:-} methods=${4:-}
[ -n "$cell" ] && [ -n "$commit" ] || usage
case $action in start|record) ;; run) [ -n "$methods" ] || usage ;; *) usage ;; esac
repo=$(pwd)
saved=$repo/docs/results/benchmark/reruns/$cell
[ -f "$saved/$cell.yaml" ] || { echo "no rerun file $saved/$cell.yaml" >&2; exit 2; }
py=$repo/.venv/bin/python
name=$("$py" -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['sweep']['name'])" "$saved/$cell.yaml")
root=$(realpath -m "${RERUN_ROOT:-$repo/../rerun}")
short=$(git rev-parse --short "$commit")
wt=$root/wt-$short out=$root/$cell/out
data=$(realpath -m "${FEDSWEEP_DATA_DIR:-$repo/../shared/data}")

bench() {  # bench STORE OUTPUT METHODS: the cell's file in the work tree, that tree's code
  (cd "$wt" && PYTHONPATH=$wt FEDSWEEP_DATA_DIR=$data MLFLOW_TRACKING_URI=sqlite:///$1 \
     "$repo/.venv/bin/fedsweep" bench "sweeps/benchmark/$cell.yaml" --methods "$3" --output "$2" --resume --quiet)
}

done_methods() {  # the methods with a final run in a bench_state.json, one a line
  "$py" -c "import json, sys; [print(k) for k, e in json.load(open(sys.argv[1]))['methods'].items() if 'final_run' in e]" "$1"
}

case $action in
  start)
    [ -d "$wt" ] || git worktree add --quiet --detach "$wt" "$commit"
    cp "$saved/$cell.yaml" "$wt/sweeps/benchmark/"
    if [ -d "$out/$name" ]; then echo "kept $out/$name (remove it to start from the repository's copy)"
    elif [ -d "$saved/$name" ]; then mkdir -p "$out" && cp -r "$saved/$name" "$out/"
    else mkdir -p "$out"; fi
    echo "work tree $wt at $short; output $out/$name" ;;
  run)
    [ -d "$wt" ] && [ -d "$out" ] || { echo "run '$0 start $cell $commit' first" >&2; exit 2; }
    echo "$(date -u +%FT%T) start $methods at $short ($(uname -n))" >> "$root/$cell/times.txt"
    rc=0; bench "$root/$cell/mlflow.db" "$out" "$methods" >> "$root/$cell/run.log" 2>&1 || rc=$?
    echo "$(date -u +%FT%T) end $methods rc=$rc" >> "$root/$cell/times.txt"
    exit $rc ;;
  record)
    [ -f "$out/$name/bench_state.json" ] || { echo "nothing to record: no $out/$name/bench_state.json" >&2; exit 2; }
    if [ -f "$saved/$name/bench_state.json" ]; then
      lost=$(comm -23 <(done_methods "$saved/$name/bench_state.json" | sort) <(done_methods "$out/$name/bench_state.json" | sort))
      [ -z "$lost" ] || { echo "the repository's folder has methods done that $out/$name lacks: $lost" >&2; exit 1; }
    fi
    [ -n "$methods" ] || methods=$(done_methods "$out/$name/bench_state.json" | paste -sd, -)
    check=$(mktemp -d); trap 'rm -rf "$check"' EXIT
    mkdir -p "$check/out" && cp -r "$out/$name" "$check/out/"
    rm -f "$check/out/$name"/{compact.md,table_b*,final_runs_b*,*.png}   # written again from the runs alone
    bench "$check/mlflow.db" "$check/out" "$methods" > "$check/log" 2>&1 || { tail -20 "$check/log"; exit 1; }
    grep -q "nothing left to run" "$check/log" || { echo "the check ran something:"; tail -20 "$check/log"; exit 1; }
    for f in compact.md "$out/$name"/table_b*.md "$out/$name"/table_b*.csv "$out/$name"/final_runs_b*.csv; do
      cmp "$check/out/$name/${f##*/}" "$out/$name/${f##*/}"; done
    rm -rf "${saved:?}/${name:?}" && cp -r "$out/$name" "$saved/"
    grep -o "[0-9]* of the file's [0-9]* methods done" "$check/log"
    echo "recorded into $saved/$name: its tables, compact.md and final runs written again from its runs in a fresh store" ;;
esac
