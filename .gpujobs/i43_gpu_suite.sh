#!/usr/bin/env bash
# issue 43: the GPU-marked tests on the final tree (run from the repo root, .gpu carried); $1: test paths
source .gpu/env
export CUBLAS_WORKSPACE_CONFIG=:4096:8 NARROWS_CACHE=/tmp/narrows-cache
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 560 python3 -m pytest ${@:-packages tests} -m gpu -q -p no:cacheprovider -rfE 2>&1 | tee $OUT/gpu_suite.log | tail -25
