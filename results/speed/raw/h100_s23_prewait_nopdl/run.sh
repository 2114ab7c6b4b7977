cd "$(dirname "$0")/.."
export MAX_JOBS=16
for v in prev new prev new; do
  if [ $v = prev ]; then PP=$PWD/.old/prev:$PWD; else PP=$PWD; fi
  PYTHONPATH=$PP timeout 120 python3 -m benchmarks.lora_gemv_bench --models 7b --m 1,8 --fmts nvfp4 --chunks 4 --out $OUT/$v --tag _$v 2>&1 | grep "layer (graph)\|layer (sum)" | sed "s/^/$v /"
done
