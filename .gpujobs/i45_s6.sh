#!/usr/bin/env bash
# issue 45 step 6 (first thing next session): is cuBLAS's host cost a setting? then CUDA graphs where
# the host sets the pace (7B 1x512 G=8) beside Unsloth in one run; -auto is the library's default
# (graphs="auto": the planner's choice), which the benchmark rows have not run so far. Carry .gpu and .gpu-unsloth.
source .gpu/env
export NARROWS_CACHE=/tmp/narrows-cache
CUBLAS_WORKSPACE_CONFIG=:4096:8 timeout 150 python3 -m pytest packages/core/tests/test_fastlayer.py \
  packages/stream/tests/test_fast_kernels.py packages/core/tests/test_nf4held.py -m gpu -q -p no:cacheprovider -rfE 2>&1 | tail -3
python3 benchmarks/host_launch.py --out $OUT/host_launch_plain.json | tail -9
CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 benchmarks/host_launch.py --out $OUT/host_launch_ws.json | tail -9
python3 benchmarks/host_launch.py --blas cublaslt --out $OUT/host_launch_lt.json | tail -9
export CUBLAS_WORKSPACE_CONFIG=:4096:8
timeout ${T:-420} python3 benchmarks/peers.py --shape 7b-1x512-g8 --timeout 200 --twin 0 --steps 6 \
  --modes ${MODES:-unsloth,stream-8GiB-lmhead-fast,stream-8GiB-lmhead-fast-graphs,stream-8GiB-lmhead-fast-auto,stream-min-lmhead-fast-graphs} \
  --out $OUT/peers_7b_1x512_g8.json 2>&1 | tail -8
