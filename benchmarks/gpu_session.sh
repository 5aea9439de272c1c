#!/usr/bin/env bash
# One device session: GPU tests, then the stream benchmark specs in $BENCH, then (with
# LMHEAD set) the LM-head memory benchmark. Run on the GPU machine from the repo root with
# .gpu (../shared/gpu/stage, then benchmarks/stage_kernels.sh) and .whl
# (uv build --all-packages --wheel -o .whl) carried along; results land in $OUT.
#   SKIP_TESTS=1            skip the tests
#   BENCH="model:seq:mode,mode ..."   stream_qlora.py runs (STEPS, BENCH_TIMEOUT)
#   LMHEAD="--contexts ..."           lmhead_memory.py arguments
#   QUALITY="--model GGUF ..."        lmhead_quality.py arguments (SmolLM2 staged by stage_smollm2.sh)
#   SHAPES="--tokenizer DIR ..."      finetune_shapes.py arguments
#   TESTS="paths"                     which GPU tests (default: core, stream, lmhead, stream+lmhead)
#   DORA="args;args"                  dora_model.py runs, one per ';'-separated argument list
#   EVAL="args"                       eval_streamed.py arguments
#   KERNELS="args"                    dora_kernels.py arguments
#   GA=8, PROFILE=1                   stream_qlora.py: micro-batches per step; one profiled step per mode
#   PROBE="args"                      architecture_probe.py arguments (e.g. --device cuda --graphs --dora "")
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.gpu/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 NARROWS_CACHE=/tmp/narrows-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [[ ${SKIP_TESTS:-0} != 1 ]]; then
  timeout 300 python3 -m pytest ${TESTS:-packages/core/tests/test_core_gpu.py packages/stream/tests \
    packages/lmhead/tests tests/test_lmhead_with_stream.py} -q -p no:cacheprovider -m gpu 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -15
fi
for spec in ${BENCH:-}; do
  IFS=: read -r model seq modes <<<"$spec"
  timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/stream_qlora.py --model "$model" --seq "$seq" --steps ${STEPS:-10} \
    --modes "$modes" --attn ${ATTN:-sdpa} --grad-accum ${GA:-1} ${PROFILE:+--profile} \
    --out "$OUT/stream_${model}_${seq}_g${GA:-1}_${ATTN:-sdpa}.json" 2>&1 | grep -v -i "warn" | tee -a "$OUT/bench.log" | tail -14
done
if [[ -n ${LMHEAD:-} ]]; then
  timeout ${LMHEAD_TIMEOUT:-400} python3 benchmarks/lmhead_memory.py $LMHEAD --out "$OUT/lmhead_memory.json" \
    > "$OUT/lmhead_memory.log" 2>&1
  grep -v '^{' "$OUT/lmhead_memory.log" | tail -150
fi
if [[ -n ${QUALITY:-} ]]; then
  timeout ${QUALITY_TIMEOUT:-420} python3 benchmarks/lmhead_quality.py $QUALITY --out "$OUT/lmhead_quality.json" 2>&1 \
    | grep -v -i "warn" | tee "$OUT/lmhead_quality.log" | tail -14
fi
if [[ -n ${SHAPES:-} ]]; then
  timeout ${SHAPES_TIMEOUT:-420} python3 benchmarks/finetune_shapes.py $SHAPES --out "$OUT/finetune_shapes.json" 2>&1 \
    | grep -v -i "warn" | tee "$OUT/finetune_shapes.log" | tail -14
fi
IFS=';' read -ra dora_runs <<<"${DORA:-}"
for i in "${!dora_runs[@]}"; do
  timeout ${DORA_TIMEOUT:-300} python3 benchmarks/dora_model.py ${dora_runs[$i]} --out "$OUT/dora_model_$i.json" 2>&1 \
    | grep -v -i "warn" | tee -a "$OUT/dora_model.log" | tail -8
done
if [[ -n ${EVAL:-} ]]; then
  timeout ${EVAL_TIMEOUT:-500} python3 benchmarks/eval_streamed.py $EVAL --out "$OUT/eval_streamed.json" 2>&1 \
    | grep -v -i "warn" | tee "$OUT/eval_streamed.log" | tail -20
fi
if [[ -n ${PROBE:-} ]]; then
  timeout ${PROBE_TIMEOUT:-300} python3 benchmarks/architecture_probe.py $PROBE --out "$OUT/architecture_probe.json" 2>&1 \
    | grep -v -i "warn" | tee "$OUT/architecture_probe.log" | tail -25
fi
if [[ -n ${KERNELS+x} ]]; then
  timeout ${KERNELS_TIMEOUT:-400} python3 benchmarks/dora_kernels.py $KERNELS --out "$OUT/dora_kernels.json" 2>&1 \
    | grep -v -i "warn" | grep -v '^{' | tee "$OUT/dora_kernels.log" | tail -40
fi
