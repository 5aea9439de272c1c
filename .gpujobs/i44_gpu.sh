#!/usr/bin/env bash
# issue 44: the GPU-marked tests of what the StreamConfig step touched (run from the repo root, .gpu carried)
source .gpu/env
export CUBLAS_WORKSPACE_CONFIG=:4096:8 NARROWS_CACHE=/tmp/narrows-cache
nvidia-smi --query-gpu=name --format=csv,noheader
timeout ${T:-480} python3 -m pytest "$@" -m gpu -q -p no:cacheprovider -rfE 2>&1 | tee $OUT/gpu.log | tail -25
