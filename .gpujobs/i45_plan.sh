#!/usr/bin/env bash
# issue 45 step 3: a fast layer's eager vs graphed time, then the 7B 8x512 rows with the planner pricing fast layers
source .gpu/env
export CUBLAS_WORKSPACE_CONFIG=:4096:8
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
nproc; lscpu | grep -i "model name"
timeout 120 python3 benchmarks/fast_memory.py --cases qwen2.5-7b:4096:512 --out $OUT/fast_time.json 2>&1 | tail -3
timeout ${T:-420} python3 benchmarks/stream_qlora.py --model qwen2.5-7b --seq 512 --batch 8 --steps 8 --warmup 2 \
  --modes ${MODES:-resident-ckpt-fast,stream-8GiB-lmhead-fast,stream-8GiB-lmhead-fast-graphs,stream-6GiB-lmhead-fast,stream-min-lmhead-fast-graphs} \
  --out $OUT/plan_7b_8x512.json 2>&1 | tail -9
