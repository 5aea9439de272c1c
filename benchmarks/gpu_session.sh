#!/usr/bin/env bash
# One device session: GPU tests of core and stream, then the stream benchmark.
# Run on the GPU machine from the repo root with .gpu (../shared/gpu/stage) and .whl
# (uv build --all-packages --wheel -o .whl) carried along; results land in $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.gpu/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [[ ${SKIP_TESTS:-0} != 1 ]]; then
  timeout 240 python3 -m pytest packages/core/tests/test_core_gpu.py packages/stream/tests -q -p no:cacheprovider -x 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
fi
for spec in ${BENCH:-qwen2.5-7b:512:stream-min,stream-24GiB,resident-ckpt,resident}; do
  IFS=: read -r model seq modes <<<"$spec"
  timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/stream_qlora.py --model "$model" --seq "$seq" --steps ${STEPS:-10} \
    --modes "$modes" --out "$OUT/stream_${model}_${seq}.json" 2>&1 | grep -v -i "warn" | tee -a "$OUT/bench.log" | tail -12
done
