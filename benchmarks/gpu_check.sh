#!/usr/bin/env bash
# GPU checks for a session that is lent a GPU machine (see the device tool's README).
# The GPU image has torch, numpy, click, rich, pyyaml, psutil, matplotlib, scikit-learn,
# nvidia-ml-py and pytest but no pydantic: fetch its wheels here first (Python 3.12):
#   echo /.whl/ >> .git/info/exclude
#   for p in pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5; do
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$p"; done
# then run (carry: [".whl"]):  bash benchmarks/gpu_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
# 1. GPU-marked tests (device binding, nccl, fp16 GradScaler, DP, ...)
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest_gpu.log" | tail -15
# 2. the main job on the GPU: one process per GPU, nccl, then bf16 and fp16
for prec in fp32 bf16 fp16; do
  timeout 120 python3 -m disttrain.cli.main run --epochs 3 --precision $prec --run-dir "$OUT/run-$prec" 2>&1 | tail -4
done
# 3. verification and all-reduce bandwidth on nccl
timeout 120 python3 -m disttrain.cli.main verify --json 2>&1 | tail -3
timeout 120 python3 -m disttrain.cli.main bench allreduce --sizes 1M:256M --json 2>&1 | tail -6
# 4. a user's task on the GPU: chargpt (a TrainTask, many DDP buckets) in bf16, and under
#    FSDP with one unit per transformer block; the Trainer beside the plain loop
timeout 150 python3 -m disttrain.cli.main run --example chargpt --epochs 3 --precision bf16 \
  --run-dir "$OUT/chargpt-bf16" 2>&1 | tail -3
timeout 150 python3 -m disttrain.cli.main run --example chargpt --epochs 2 --strategy fsdp \
  --run-dir "$OUT/chargpt-fsdp" 2>&1 | tail -3
timeout 200 python3 -m disttrain.cli.main bench overhead --example chargpt --rounds 2 2>&1 | tail -4
# 5. the step-time breakdown with CUDA events (train/step_timing.py): its test, and the
#    chargpt run's per-rank phases and straggler verdict from summary.json
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/train/test_step_timing.py -k cuda 2>&1 | tail -3
python3 -c "import json, sys; s = json.load(open(sys.argv[1])); [print(r) for r in s['ranks']]; \
print('straggler:', s['straggler'])" "$OUT/chargpt-bf16/summary.json"
# 6. the memory plan's slice constants (docs/memory.md): CUDA context, NCCL buffers, and
#    reserved / allocated of two real steps against the plan of the same job
timeout 300 python3 benchmarks/gpu_memory_check.py --out "$OUT" 2>&1 | tail -40
