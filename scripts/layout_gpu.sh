#!/usr/bin/env bash
# Issue 10, one resident layout: quant.layout=kernel against compressed on one GPU, in one call — the GPU tests of
# the kernels' layout, then resident memory, rollouts and GRPO steps of both layouts back to back (same machine, so
# the ratios hold). Run from the repository root on the GPU host (device tool: carry .whl):
#
#   bash scripts/layout_gpu.sh                      # 7B (memory, rollout, step) and 32B (memory, step)
#   MODELS=tiny BIG= DEVICE=cpu bash scripts/layout_gpu.sh   # the plumbing on a CPU, in minutes
#
# Writes $OUT/layout.tgz (or /tmp/layout_out when OUT is unset): logs, memory.csv, rollout.csv, step.csv, env.json,
# layers_layout.csv/.md (benchmarks.kernel_bench --layout both: every linear in both layouts, M = 1 ... 2048).
# Back here: mkdir -p DIR && tar -xzf layout.tgz -C DIR && python -m experiments.speed --merge DIR/speed --name
# NAME --sha SHA (rows carry a `layout` column; rollout tables mark kernel-layout rows).
set -uo pipefail
OUT=${OUT:-/tmp/layout_out}
R=$OUT/r
mkdir -p "$R/speed"
MODELS=${MODELS:-7b}   # memory, rollout and step
BIG=${BIG-32b}         # memory and step only (the 32B step peak target: < 45 GB); empty: none
DEVICE=${DEVICE:-cuda}
NEW=${NEW:-2048}
PARTS=${PARTS:-tests memory rollout step layers}   # a subset splits the work over calls of the device's 10 minutes
has() { [[ " $PARTS " == *" $1 "* ]]; }
trap 'tar -czf "$OUT/layout.tgz" -C "$R" . 2>/dev/null' EXIT
if [ -d .whl ] && [ "$DEVICE" = cuda ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$R/pip.log" 2>&1
  export PYTHONPATH=/tmp/site:$PWD
fi
export MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1
bench() { python3 -m qerl.bench "$@" --device "$DEVICE" --out "$R/speed" 2>&1 | grep -v "^  warnings.warn"; }

if [ "$DEVICE" = cuda ] && has tests; then
  timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_relaid_layout.py tests/test_cuda_fp4.py \
    -k "relaid or relayout or kernel_layout or row_slices" > "$R/gpu_tests.log" 2>&1
  tail -3 "$R/gpu_tests.log"
fi
for L in compressed kernel; do
  has memory && bench memory --models "$MODELS${BIG:+,$BIG}" --formats nvfp4 --layout $L > "$R/memory-$L.log"
  has rollout && bench rollout --models "$MODELS" --formats nvfp4 --batch 8,64 --new "$NEW" --layout $L \
    > "$R/rollout-$L.log"
done
for L in compressed kernel; do  # the update's dense weights: Triton dequantization vs dequantize_relaid
  has step && bench step --models "$MODELS${BIG:+,$BIG}" --formats nvfp4 --batch 8 --gc on --steps 2 --new "$NEW" --layout $L \
    > "$R/step-$L.log"
done
if has layers && [ "$DEVICE" = cuda ]; then  # per linear, both layouts side by side: decode, mid and large M, backward
  python3 -m benchmarks.kernel_bench --models "$MODELS" --m 1,8,32,64,128,256,512,2048 --fmts bf16,nvfp4,mxfp4 \
    --layout both --out "$R/speed" --tag layout > "$R/layers.log" 2>&1
  grep "^\[bench\]" "$R/layers.log" | tail -40
fi
python3 - "$R/speed" <<'EOF'
import sys
from pathlib import Path

import pandas as pd

root = Path(sys.argv[1])
for name, cols in (("memory.csv", ["quantized_linears_gb", "model_size_gb", "cuda_allocated_gb"]),
                   ("rollout.csv", ["batch_size", "tokens_per_s", "peak_mem_gb"]),
                   ("step.csv", ["batch_size", "step_s", "rollout_s", "update_s", "peak_mem_gb"])):
    f = root / name
    if f.exists():
        d = pd.read_csv(f)
        print(f"== {name}\n" + d[["model", "weights", "layout", *[c for c in cols if c in d]]].to_string(index=False))
EOF
