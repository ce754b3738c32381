#!/usr/bin/env bash
# Issue 35's GPU items on a lent GPU machine (the `device` tool), in one call:
#   pfl-research's own CIFAR-10 setting run by both frameworks on the GPU (benchmarks/pfl_cifar.py), and
#   the PFL CIFAR-10 workload on Ray's GPU slices, one client at a time and stacked (benchmarks/cifar_gpu.py).
#
#   here, once:  .whl: cp312 wheels of what the machine lacks (pydantic and its needs, as for device_pfl_cifar.sh;
#                jsonschema, jsonschema-specifications, referencing, rpds-py and wcwidth for Ray; pfl 0.6.0,
#                dp-accounting, dm-tree, prv-accountant, multiprocess and dill for pfl-research);
#                .devray/ray.tar.xz: Ray 2.60.0's cp312 wheel unpacked, less what no script here imports (its Java
#                jars, RLlib, Serve, ray.llm, the dashboard's web build and source maps), as tar + xz: 79 MB -> 29 MB
#                (one call carries 64 MiB); .whl and .devray in .git/info/exclude
#   call:        bash benchmarks/device_peers.sh [PART ...]     carry: .whl .devray
#                PART: pfl (pfl_cifar.py), slices (cifar_gpu.py), proto (the PFL protocol's Proto trials, PFLDyn and
#                PFLScaf, 10 rounds on stand-in files, stacked and one by one: device_sweep.py), ab (fedsweep's
#                variants of pfl_cifar.py with a module per client, as fedsweep does on a GPU, and with one shared
#                module, alternating, the second pair profiled: why sharing slowed stacked rounds 1.6x there);
#                default: pfl slices
#                $OUT/pfl_cifar.log, $OUT/cifar_gpu.log, $OUT/proto.log, $OUT/ab.log, $OUT/gpu.txt (the machine)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
tar xJf .devray/ray.tar.xz -C /tmp/site || exit 3
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader; nproc
  python3 -c "import torch, ray, pfl, pydantic; print('torch', torch.__version__, 'ray', ray.__version__, 'pydantic', pydantic.VERSION)"
} 2>&1 | tee "$OUT/gpu.txt"
parts=("$@"); [ ${#parts[@]} -gt 0 ] || parts=(pfl slices)
for part in "${parts[@]}"; do case $part in
pfl)
  timeout 260 python3 benchmarks/pfl_cifar.py --pfl-python python3 --peak-tflops 67 2>&1 | tee "$OUT/pfl_cifar.log"
  echo "pfl_cifar.py rc=$?" | tee -a "$OUT/pfl_cifar.log" ;;
slices)
  timeout 220 python3 benchmarks/cifar_gpu.py --rounds 4 2>&1 | grep -v "^(raylet\|^\[" | tee "$OUT/cifar_gpu.log"
  echo "cifar_gpu.py rc=$?" | tee -a "$OUT/cifar_gpu.log" ;;
proto)
  python3 benchmarks/device_data.py stand-in /tmp/standin
  for stack in on off; do
    FEDSWEEP_DATA_DIR=/tmp/standin timeout 150 python3 benchmarks/device_sweep.py run sweeps/pfl_acid_cifar10.yaml \
      --out "/tmp/proto_$stack" --workers 1 --trials 4,8 --rounds 10 $([ $stack = off ] && echo --no-stack) 2>&1 | tee -a "$OUT/proto.log"
  done
  python3 benchmarks/device_sweep.py pace /tmp/proto_on /tmp/proto_off 2>&1 | tee -a "$OUT/proto.log" ;;
ab)
  for flags in "" --shared-module "--profile" "--profile --shared-module"; do
    echo "== pfl_cifar.py --rounds 25 --pfl-python none $flags" | tee -a "$OUT/ab.log"
    timeout 120 python3 benchmarks/pfl_cifar.py --rounds 25 --pfl-python none $flags 2>&1 | tee -a "$OUT/ab.log"
  done ;;
esac; done
