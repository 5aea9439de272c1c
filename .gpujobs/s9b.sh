#!/usr/bin/env bash
# session 9, second batch: dropout masks from the fused dropout kernel (bool, one pass to apply)
# against the session's first code (snap/: bf7a2b7, bf16 masks from bernoulli_), alternating
# on one machine; the fast layer's GPU tests; dropout beside Unsloth with the new masks.
# Carry .gpu, .gpu-unsloth and snap.
source .gpu/env
export NARROWS_CACHE=/tmp/narrows-cache
NEWPP=$PYTHONPATH
OLDPP="$PWD/.gpu/site"; for s in $PWD/snap/packages/*/src; do OLDPP="$s:$OLDPP"; done
CUBLAS_WORKSPACE_CONFIG=:4096:8 timeout 150 python3 -m pytest packages/core/tests/test_fastlayer.py -m gpu -q -p no:cacheprovider -rfE 2>&1 | tail -3
unset CUBLAS_WORKSPACE_CONFIG
ab() {  # version, out name, args...
  local v=$1 name=$2; shift 2
  if [ $v = old ]; then PP=$OLDPP; else PP=$NEWPP; fi
  PYTHONPATH=$PP timeout 150 python3 benchmarks/stream_qlora.py --seq 512 --batch 8 --warmup 2 \
    --out $OUT/ab_${name}_$v.json "$@" 2>&1 | tail -1 | sed "s/^/$v $name /"
}
for v in old new; do ab $v 7b_8x512_drop9 --model qwen2.5-7b --steps 10 --modes stream-8GiB-lmhead-fast-auto-drop,stream-min-lmhead-fast-drop; done
timeout 330 python3 benchmarks/peers.py --shape 7b-8x512 --timeout 150 --twin 1 --dropout 0.05 \
  --modes unsloth,stream-8GiB-lmhead-fast-auto,stream-min-lmhead-fast \
  --out $OUT/peers_7b_8x512_drop_s9.json 2>&1 | grep -v "^ *$" | tail -9
