#!/usr/bin/env bash
# issue 45 step 6: kept attention (keep_attention) on the H100 — its exactness gate, then 7B 32K
# with the library's choice (auto: kept) beside the same row without it, Unsloth in the same run.
source .gpu/env
export NARROWS_CACHE=/tmp/narrows-cache
unset CUBLAS_WORKSPACE_CONFIG
case "$1" in
a)
  CUBLAS_WORKSPACE_CONFIG=:4096:8 timeout 200 python3 -m pytest packages/stream/tests/test_stream_gpu_exact.py \
    -k "kept_attention or offloaded_inputs" -q -p no:cacheprovider -rfE 2>&1 | tail -4
  timeout 380 python3 benchmarks/peers.py --shape 7b-1x32768 --timeout 180 --twin 0 \
    --modes stream-8GiB-lmhead-fast-tile,stream-8GiB-lmhead-fast-tile-noattn \
    --out $OUT/peers_7b_1x32768_attn.json 2>&1 | tail -6 ;;
b)
  timeout 580 python3 benchmarks/peers.py --shape 7b-1x32768 --timeout 200 --twin 0 \
    --modes unsloth,stream-8GiB-lmhead-fast-tile,stream-8GiB-lmhead-fast-tile-noattn \
    --out $OUT/peers_7b_1x32768_attn_twin.json 2>&1 | tail -6 ;;
esac
