#!/usr/bin/env bash
# session 10: the issue's rows that this session's change touches (LoRA dropout, beside Unsloth) or
# that no run has measured since step eight (one sequence of 32K; 1 x 512 with 8 micro-batches).
# Carry .gpu and .gpu-unsloth. Usage: bash this drop|long|g8
source .gpu/env
export NARROWS_CACHE=/tmp/narrows-cache
unset CUBLAS_WORKSPACE_CONFIG
peers() {  # shape, out name, twin steps, modes, extra args...
  local shape=$1 name=$2 twin=$3 modes=$4; shift 4
  timeout 590 python3 benchmarks/peers.py --shape $shape --timeout 300 --twin $twin --modes $modes \
    --out $OUT/peers_$name.json "$@" 2>&1 | grep -v "^ *$" | tail -10
}
case "$1" in
drop) peers 7b-8x512 7b_8x512_drop_s10 1 unsloth,stream-8GiB-lmhead-fast-auto,stream-min-lmhead-fast --dropout 0.05 ;;
long) peers 7b-1x32768 7b_1x32768_s10 1 unsloth,stream-8GiB-lmhead-fast-tile ;;
g8)   peers 7b-1x512-g8 7b_1x512_g8_s10 0 unsloth,stream-8GiB-lmhead-fast-auto,stream-min-lmhead-fast-auto --steps 6 ;;
esac
case "$1" in
host)  # where the host's time goes in a 7B step (cProfile of one more step), with and without dropout
  timeout 400 python3 benchmarks/stream_qlora.py --model qwen2.5-7b --batch 8 --seq 512 --steps 6 --host-profile \
    --modes stream-8GiB-lmhead-fast-auto-drop,stream-8GiB-lmhead-fast-auto --out $OUT/host_7b_8x512_s10.json 2>&1 | tail -3
  python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/host_7b_8x512_s10.json"))
for r in d["rows"]:
    print(r["mode"], r.get("s_per_step"), "host", r.get("host_s_per_step"))
    for x in (r.get("host_profile") or [])[:40]: print("   ", x)
PY
  ;;
esac
