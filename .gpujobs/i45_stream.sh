#!/usr/bin/env bash
# issue 45: streamed fast layers on the GPU — their exactness tests, then streamed rows beside PEFT (7B, 8x512)
source .gpu/env
export CUBLAS_WORKSPACE_CONFIG=:4096:8
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python3 -m pytest packages/stream/tests/test_fast_kernels.py packages/core/tests/test_fastlayer.py -m gpu -q -p no:cacheprovider -rfE 2>&1 | tail -15
timeout ${T:-360} python3 benchmarks/stream_qlora.py --model qwen2.5-7b --seq 512 --batch 8 --steps 10 --warmup 2 \
  --modes ${MODES:-stream-min-fast,stream-8GiB-fast,stream-8GiB-auto-fast,stream-min,stream-8GiB,resident-ckpt-fast,resident-ckpt} --out $OUT/fast_stream_7b_8x512.json 2>&1 | tail -14
