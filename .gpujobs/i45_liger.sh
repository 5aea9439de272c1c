#!/usr/bin/env bash
# issue 45: Liger RMSNorm in the fast layer — GPU tests, then the benchmark rows again (7B, 8x512)
source .gpu/env
export CUBLAS_WORKSPACE_CONFIG=:4096:8
python3 -c "from narrows.core.fastlayer import kernels_in_use; print(kernels_in_use('cuda'))"
timeout 200 python3 -m pytest packages/core/tests/test_fastlayer.py packages/stream/tests/test_fast_kernels.py packages/stream/tests/test_stream_gpu_exact.py -m gpu -q -p no:cacheprovider -rfE 2>&1 | tail -4
timeout ${T:-330} python3 benchmarks/stream_qlora.py --model qwen2.5-7b --seq 512 --batch 8 --steps 10 --warmup 2 \
  --modes ${MODES:-resident-fast,resident-ckpt-fast,stream-min-lmhead-fast,stream-8GiB-lmhead-fast,resident-ckpt} --out $OUT/liger_7b_8x512.json 2>&1 | tail -8
