#!/usr/bin/env bash
# issue 45 step 5: the GPU tests of the blocked adapters, then the 7B 8x512 rows beside Unsloth with twins.
source .gpu/env
export CUBLAS_WORKSPACE_CONFIG=:4096:8 NARROWS_CACHE=/tmp/narrows-cache
timeout 120 python3 -m pytest packages/core/tests/test_fastlayer.py packages/stream/tests/test_fast_kernels.py \
  packages/core/tests/test_nf4held.py -m gpu -q -p no:cacheprovider -rfE 2>&1 | tee $OUT/gpu_tests.log | tail -3
timeout ${T:-400} python3 benchmarks/peers.py --shape 7b-8x512 --timeout 150 --twin 2 \
  --modes ${MODES:-unsloth,stream-8GiB-lmhead-fast,stream-6GiB-lmhead-fast,stream-min-lmhead-fast,peft-ckpt} \
  --out $OUT/peers_7b_8x512.json 2>&1 | tail -8
