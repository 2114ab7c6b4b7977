cd /root/qerl
export PYTHONPATH=/tmp/site:/root/qerl QERL_CACHE=/root/cache HF_HUB_OFFLINE=1 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 QERL_REWARD_WORKERS=2
pids=""
for lr in 1e-05 3e-05 0.0001; do
  d=/root/res/evidence/small/bf16-full-lr$lr-s0
  args=$(python3 -c "import json,shlex; a=json.load(open('$d/env.json'))['argv']; i=a.index('--'); print(' '.join(shlex.quote(x) for x in a[i+1:]))")
  eval "python3 -m experiments.worker --runner qerl.train:run -- $args" >> $d/worker.log 2>&1 &
  pids="$pids $!"
done
while pgrep -f "[e]xperiments[.]evidence" > /dev/null; do sleep 5; done
wait $pids
echo "full reruns done" >> /root/res/evidence-small.log
python3 -m experiments.evidence --scale small --stage main --workers 8 --root /root/res >> /root/res/evidence-small.log 2>&1
python3 -m experiments.evidence --scale small --stage aqn --workers 8 --root /root/res >> /root/res/evidence-small.log 2>&1
echo CHAIN EXIT $? >> /root/res/evidence-small.log
