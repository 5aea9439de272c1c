#!/usr/bin/env bash
# session 10: a dropout step's forward reads the draw's own output (Masks.outs) against HEAD
# before it (ab_old/: git archive of 806e3eb's packages), alternating on one machine; the fast
# layer's GPU tests first. Carry .gpu and ab_old. Usage: bash this tests|ab
source .gpu/env
export NARROWS_CACHE=/tmp/narrows-cache
NEWPP=$PYTHONPATH
OLDPP="$PWD/.gpu/site"; for s in $PWD/ab_old/packages/*/src; do OLDPP="$s:$OLDPP"; done
case "$1" in
tests)
  export CUBLAS_WORKSPACE_CONFIG=:4096:8
  timeout 200 python3 -m pytest packages/core/tests/test_fastlayer.py -m gpu -q -p no:cacheprovider -rfE 2>&1 | tail -3
  timeout 250 python3 -m pytest packages/stream/tests/test_stream_gpu_exact.py packages/stream/tests/test_step_mode.py \
    -k drop -m gpu -q -p no:cacheprovider -rfE 2>&1 | tail -3 ;;
ab)
  unset CUBLAS_WORKSPACE_CONFIG
  for r in 1 2; do for v in old new; do
    if [ $v = old ]; then PP=$OLDPP; else PP=$NEWPP; fi
    PYTHONPATH=$PP timeout 140 python3 benchmarks/stream_qlora.py --seq 512 --batch 8 --warmup 2 --steps 10 \
      --model qwen2.5-7b --modes stream-8GiB-lmhead-fast-auto-drop \
      --out $OUT/ab_7b_8x512_drop10_r${r}_$v.json 2>&1 | tail -1 | sed "s/^/$v r$r /"
  done; done ;;
esac
