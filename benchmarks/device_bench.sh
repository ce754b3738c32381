#!/usr/bin/env bash
# A full-scale CIFAR-10 benchmark cell's methods on a lent GPU machine (the `device` tool; benchmarks/device_bench.py),
# in three calls one right after the other (the machine keeps /tmp while it stays warm; one call carries 64 MiB, and
# the repository's 14 MB, CIFAR-10 packed (98 MiB) and pydantic's wheels need three):
#
#   here, once:  python benchmarks/device_data.py pack ../shared/data/cifar-10-batches-py .devpack --parts 2, the six
#                batch files then moved into three folders of two each, with their manifests' entries (batches.meta with
#                the last): .devpack/a, b and c; .whl: pydantic, pydantic-core, annotated-types, typing-inspection and
#                typing-extensions as cp312 wheels (the machine has torch, numpy, pandas and PyYAML, not pydantic);
#                .devpack and .whl in .git/info/exclude
#   calls 1, 2:  bash benchmarks/device_bench.sh unpack a        carry: .devpack/a .whl   (then b, carry .devpack/b)
#   call 3:      bash benchmarks/device_bench.sh run c CELL METHODS SECONDS COMMIT        carry: .devpack/c
#                unpacks c, checks the seven files are there, then `device_bench.py run CELL --methods METHODS
#                --time-box SECONDS --code COMMIT` in 14 processes on the GPU; $OUT/trials.tar.gz holds DIR (a copy
#                each minute, in case the call ends first), $OUT/run.log its output, $OUT/gpu.csv nvidia-smi's samples
#   here:        tar xzf trials.tar.gz && python benchmarks/device_bench.py log CELL bench --output docs/results/benchmark
set -euo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ -d .whl ] && [ ! -d /tmp/site/pydantic ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site
data=/tmp/devdata/cifar-10-batches-py
python3 benchmarks/device_data.py unpack ".devpack/$2" "$data"
[ "$1" = unpack ] && exit 0
[ "$(ls "$data" | wc -l)" = 7 ] || { echo "a part is missing: the machine was not the same"; exit 3; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT   # the samplers below hold the output open: end them with the script
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader,nounits -l 2 > "$OUT/gpu.csv" &
( while sleep 60; do tar czf "$OUT/partial.tar.gz" -C /tmp bench 2>/dev/null && mv -f "$OUT/partial.tar.gz" "$OUT/trials.tar.gz"; done ) &
rc=0
FEDSWEEP_DATA_DIR=/tmp/devdata python3 benchmarks/device_bench.py run "$3" --methods "$4" --out /tmp/bench \
  --workers 14 --time-box "$5" --code "$6" 2>&1 | tee "$OUT/run.log" || rc=$?
tar czf "$OUT/partial.tar.gz" -C /tmp bench && mv -f "$OUT/partial.tar.gz" "$OUT/trials.tar.gz"
exit $rc
