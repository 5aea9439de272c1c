#!/usr/bin/env bash
# issue 45: fast layers on the GPU — their tests, then the resident benchmark rows (7B, 8x512)
source .gpu/env
export CUBLAS_WORKSPACE_CONFIG=:4096:8
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 -m pytest packages/core/tests/test_fastlayer.py -m gpu -q -p no:cacheprovider -rfE 2>&1 | tail -15
timeout ${T:-400} python3 benchmarks/stream_qlora.py --model qwen2.5-7b --seq 512 --batch 8 --steps 10 --warmup 2 \
  --modes ${MODES:-resident-fast,resident-ckpt-fast,resident,resident-ckpt} ${EXTRA:-} --out $OUT/fast_7b_8x512.json 2>&1 | tail -20
