#!/usr/bin/env bash
# The PFL CIFAR-10 protocol (sweeps/pfl_acid_cifar10.yaml) on a lent GPU machine, through the `device` tool, in two
# calls one right after the other (the machine keeps what the first unpacked while it stays warm):
#
#   here, once:  python benchmarks/device_data.py pack ../shared/data/cifar-10-batches-py .devpack --parts 2
#                (folders .devpack/part_0 and part_1 renamed a and b; .devpack and .whl in .git/info/exclude;
#                 .whl: pydantic and its needs as cp312 wheels, the machine has torch but not pydantic)
#   call 1:      bash benchmarks/device_pfl_cifar.sh probe         carry: .devpack/a .whl
#                unpacks part a to /tmp/devdata (the copy of the repository there keeps no ignored folder between
#                calls; /tmp stays while the machine is held); per-round cost of PFLDyn-MAML on stand-in files,
#                stacked and one by one, on the GPU ("unpack" instead: part a alone)
#   call 2:      bash benchmarks/device_pfl_cifar.sh run SECONDS [FILE]   carry: .devpack/b .whl
#                unpacks part b (every file's SHA-256 checked); the file's 12 trials at once (FILE: the sweep
#                file, sweeps/pfl_acid_cifar10.yaml unless given; sweeps/pfl_alid_cifar10.yaml for Table 2), each in
#                its own process on the GPU, stopping after the round that passes SECONDS; $OUT/trials.tar.gz
#                holds a .jsonl per trial, $OUT/gpu.csv nvidia-smi's samples
#   here:        tar xzf trials.tar.gz && python benchmarks/device_sweep.py log FILE trials
set -euo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ ! -d /tmp/site/pydantic ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, pydantic; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'cpus', __import__('os').cpu_count())"

case "$1" in
unpack)  # part a again, without the probe
  python3 benchmarks/device_data.py unpack .devpack/a /tmp/devdata/cifar-10-batches-py
  ;;
probe)
  python3 benchmarks/device_data.py unpack .devpack/a /tmp/devdata/cifar-10-batches-py
  python3 benchmarks/device_data.py stand-in /tmp/standin
  for stack in on off; do
    FEDSWEEP_DATA_DIR=/tmp/standin python3 benchmarks/device_sweep.py run sweeps/pfl_acid_cifar10.yaml \
      --out "/tmp/probe_$stack" --workers 1 --trials 2 --rounds 10 $([ $stack = off ] && echo --no-stack)
  done
  python3 benchmarks/device_sweep.py pace /tmp/probe_on /tmp/probe_off
  python3 - <<'PY'
import sys
sys.path.insert(0, ".")
from benchmarks.device_sweep import paces
(t,) = paces("/tmp/probe_on", "/tmp/probe_off")
on, off = (d["s"] for d in t["sides"])
ok = t["gap"] < 0.05 and on < off
print("the main run stacks where allowed" if ok else "the main run trains one by one")
open("/tmp/devdata/stack_ok", "w").write("1" if ok else "0")
PY
  ;;
run)
  python3 benchmarks/device_data.py unpack .devpack/b /tmp/devdata/cifar-10-batches-py
  [ "$(ls /tmp/devdata/cifar-10-batches-py | wc -l)" = 7 ] || { echo "part a missing: the machine was not the same"; exit 3; }
  stack=$([ "$(cat /tmp/devdata/stack_ok 2>/dev/null)" = 1 ] || echo --no-stack)
  trap 'kill $(jobs -p) 2>/dev/null || true' EXIT   # the samplers below hold the output open: end them with the script
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader,nounits -l 2 > "$OUT/gpu.csv" &
  # a copy every minute, written aside and renamed (never half-written), in case the call ends before the last one
  ( while sleep 60; do tar czf "$OUT/partial.tar.gz" -C /tmp trials 2>/dev/null && mv -f "$OUT/partial.tar.gz" "$OUT/trials.tar.gz"; done ) &
  copier=$!
  FEDSWEEP_DATA_DIR=/tmp/devdata python3 benchmarks/device_sweep.py run "${3:-sweeps/pfl_acid_cifar10.yaml}" \
    --out /tmp/trials --workers 12 --time-box "$2" $stack || echo "device_sweep.py ended with an error; the files are kept"
  kill $copier; wait $copier 2>/dev/null || true
  tar czf "$OUT/final.tar.gz" -C /tmp trials && mv -f "$OUT/final.tar.gz" "$OUT/trials.tar.gz"  # (a copy under way may leave partial.tar.gz)
  for f in /tmp/trials/*.jsonl; do python3 -c "
import json, sys; lines = open(sys.argv[1]).read().splitlines(); h = json.loads(lines[0]); e = json.loads(lines[-1])
print(h['trial'], h['overrides'].get('algorithm.name'), h['overrides'].get('algorithm.transform', ''), 'seed', h['overrides']['seed'],
      'stacked' if h['vectorize_clients'] else 'one by one', 'reached', e.get('reached'), 'wall', round(e.get('wall_s', 0)))" "$f"; done
  ;;
esac
