#!/usr/bin/env bash
# issue 45 step 3: one fast layer's memory beside the planner's figures, then where a streamed step's time goes
source .gpu/env
export CUBLAS_WORKSPACE_CONFIG=:4096:8
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python3 benchmarks/fast_memory.py --out $OUT/fast_memory.json 2>&1 | tail -8
timeout ${T:-330} python3 benchmarks/stream_qlora.py --model qwen2.5-7b --seq 512 --batch 8 --steps 6 --warmup 2 \
  --modes ${MODES:-resident-ckpt-fast-lmhead,stream-8GiB-lmhead-fast,stream-12GiB-lmhead-fast} --torch-profile --profile \
  --out $OUT/prof_7b_8x512.json 2>&1 | tail -12
