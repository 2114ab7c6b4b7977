#!/usr/bin/env bash
# The GPU measurements behind results/speed/ (run on an H100 from the repo root; logs and CSVs go to $OUT).
#   scripts/gpu_bench.sh core     GPU tests + memory (7B) + rollout (7B, all formats, batch 2/8) + E2E step (7B)
#   scripts/gpu_bench.sh large    rollout 14B/32B + 32B NVFP4 GRPO step (GC) + LoRA-rank sweep (7B)
#   scripts/gpu_bench.sh small    rollout 3B + rank sweep 14B
# Optional wheels for an offline host: a folder .whl built by ../shared/tools/gpu-wheels.sh (see README).
set -uo pipefail
OUT=${OUT:-results/speed/logs}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1 QERL_REWARD_WORKERS=2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
S=results/speed
case "${1:-core}" in
core)
  python3 -m pytest -q -m gpu tests/test_gpu.py 2>&1 | tail -5 | tee "$OUT/pytest_gpu.txt"
  python3 -m qerl.bench memory --models 7b --formats bf16,nf4,mxfp4,nvfp4 2>&1 | tail -6 | tee "$OUT/memory.txt"
  python3 -m qerl.bench rollout --models 7b --formats nvfp4,bf16,mxfp4,nf4 --batch 8,2 2>&1 | grep -v Warn | tee "$OUT/rollout7b.txt"
  python3 -m qerl.bench step --models 7b --formats nvfp4,bf16,nf4 --batch 8 --gc off --steps 2 2>&1 | grep "bench" | tee "$OUT/step7b.txt"
  ;;
large)
  python3 -m qerl.bench rollout --models 14b,32b --formats nvfp4,bf16,nf4 --batch 8,2 2>&1 | grep -v Warn | tee "$OUT/rollout_large.txt"
  python3 -m qerl.bench step --models 32b --formats nvfp4 --batch 8 --gc on --steps 2 2>&1 | grep "bench" | tee "$OUT/step32b.txt"
  ;;
small)
  python3 -m qerl.bench rollout --models 3b --formats nvfp4,bf16,nf4 --batch 8,2 2>&1 | grep -v Warn | tee "$OUT/rollout3b.txt"
  python3 -m qerl.bench rollout --models 7b --formats nvfp4,bf16 --batch 2 --ranks 16,64 2>&1 | grep -v Warn | tee "$OUT/rank7b.txt"
  ;;
esac
cp $S/*.csv "$OUT/" 2>/dev/null; ls "$OUT"
