#!/usr/bin/env bash
# session 8: the adapter's product first, the base accumulated in the matmul's epilogue (lora.py) —
# before (ab_old: git archive 4dbe331 packages) and after, same machine, alternating. Carry .gpu,
# .gpu-unsloth and ab_old.
source .gpu/env
export NARROWS_CACHE=/tmp/narrows-cache
unset CUBLAS_WORKSPACE_CONFIG
NEWPP=$PYTHONPATH
OLDPP="$PWD/.gpu/site"; for s in $PWD/ab_old/packages/*/src; do OLDPP="$s:$OLDPP"; done
ab() {  # version, out name, args...
  local v=$1 name=$2; shift 2
  if [ $v = old ]; then PP=$OLDPP; else PP=$NEWPP; fi
  PYTHONPATH=$PP timeout 280 python3 benchmarks/stream_qlora.py --seq 512 --batch 8 --warmup 2 \
    --out $OUT/ab_${name}_$v.json "$@" 2>&1 | tail -1 | sed "s/^/$v $name /"
}
case "$1" in
a)
  for r in 1 2; do for v in old new; do ab $v 7b_8x512_r$r --model qwen2.5-7b --steps 10 --modes stream-8GiB-lmhead-fast-auto,stream-min-lmhead-fast; done; done ;;
b)
  for v in old new; do ab $v 32b_8x512 --model qwen2.5-32b --steps 6 --modes stream-12GiB-lmhead-fast-auto; done ;;
c)
  timeout 580 python3 benchmarks/peers.py --shape 7b-8x512 --timeout 200 --twin 2 \
    --modes unsloth,stream-8GiB-lmhead-fast-auto,stream-min-lmhead-fast-graphs,peft-ckpt \
    --out $OUT/peers_7b_8x512_s8.json 2>&1 | tail -9 ;;
d)
  timeout 590 python3 benchmarks/peers.py --shape 32b-8x512 --timeout 260 --twin 2 \
    --modes unsloth,stream-12GiB-lmhead-fast-auto \
    --out $OUT/peers_32b_8x512_s8.json 2>&1 | tail -9 ;;
e)
  timeout 590 python3 benchmarks/peers.py --shape 7b-1x32768 --timeout 260 --twin 2 \
    --modes unsloth,stream-8GiB-lmhead-fast-tile \
    --out $OUT/peers_7b_1x32768_s8.json 2>&1 | tail -9 ;;
f)
  timeout 590 python3 benchmarks/peers.py --shape 72b-8x512 --timeout 300 --twin 0 \
    --modes stream-16GiB-lmhead-fast-auto \
    --out $OUT/peers_72b_8x512_s8.json 2>&1 | tail -9 ;;
esac
case "$1" in
g)
  for r in 1 2; do for v in old new; do ab $v 7b_8x512_drop_r$r --model qwen2.5-7b --steps 10 --modes stream-8GiB-lmhead-fast-auto-drop,stream-min-lmhead-fast-drop; done; done ;;
h)
  CUBLAS_WORKSPACE_CONFIG=:4096:8 timeout 200 python3 -m pytest packages/core/tests/test_fastlayer.py -m gpu -q -p no:cacheprovider -rfE 2>&1 | tail -2
  CUBLAS_WORKSPACE_CONFIG=:4096:8 timeout 330 python3 -m pytest packages/stream/tests/test_stream_gpu_exact.py -q -p no:cacheprovider -rfE -x 2>&1 | tail -2 ;;
esac
