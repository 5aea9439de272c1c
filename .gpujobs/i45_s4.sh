#!/usr/bin/env bash
# issue 45 step 4 (stacked Q/K/V and gate/up, the halves SwiGLU kernel, Liger RoPE, tiled pricing):
# first the GPU tests of what changed, then one layer's time and memory, then the 7B rows beside
# Unsloth with each narrows row's twin check. Carry .gpu and .gpu-unsloth. Usage: T=secs bash this
source .gpu/env
export CUBLAS_WORKSPACE_CONFIG=:4096:8 NARROWS_CACHE=/tmp/narrows-cache
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 240 python3 -m pytest packages/core/tests/test_fastlayer.py packages/stream/tests/test_fast_kernels.py \
  packages/core/tests/test_nf4held.py -m gpu -q -p no:cacheprovider -rfE 2>&1 | tee $OUT/gpu_tests.log | tail -12
timeout 120 python3 benchmarks/fast_memory.py --cases qwen2.5-7b:4096:512 --out $OUT/fast_layer_time_7b.json 2>&1 | tail -2
timeout 120 python3 benchmarks/fast_memory.py --no-timing --cases qwen2.5-7b:32768:32768:2048 \
  --out $OUT/fast_memory_tiled_7b.json 2>&1 | tail -2
timeout 150 python3 benchmarks/fast_accuracy.py --out $OUT/fast_accuracy_7b.json 2>&1 | sed -n 5,25p
timeout ${T:-420} python3 benchmarks/peers.py --shape 7b-8x512 --timeout 200 --twin 3 \
  --modes ${MODES:-unsloth,stream-8GiB-lmhead-fast,stream-6GiB-lmhead-fast,stream-min-lmhead-fast,stream-8GiB-lmhead-fast-f32lora} \
  --out $OUT/peers_7b_8x512.json 2>&1 | tail -9
