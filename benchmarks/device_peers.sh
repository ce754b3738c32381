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
#   call:        bash benchmarks/device_peers.sh        carry: .whl .devray
#                $OUT/pfl_cifar.log, $OUT/cifar_gpu.log, $OUT/gpu.txt (the machine)
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
timeout 260 python3 benchmarks/pfl_cifar.py --pfl-python python3 --peak-tflops 67 2>&1 | tee "$OUT/pfl_cifar.log"
echo "pfl_cifar.py rc=$?" | tee -a "$OUT/pfl_cifar.log"
timeout 220 python3 benchmarks/cifar_gpu.py --rounds 4 2>&1 | grep -v "^(raylet\|^\[" | tee "$OUT/cifar_gpu.log"
echo "cifar_gpu.py rc=$?" | tee -a "$OUT/cifar_gpu.log"
