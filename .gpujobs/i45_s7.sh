#!/usr/bin/env bash
# issue 45 step 6: CUBLAS_WORKSPACE_CONFIG=:4096:8 costs the host ~37 µs a matmul (host_launch_ws.json
# 51 µs against 14.5 plain); every earlier row ran with it. Rows as a user runs them (no variable; the
# twins set it in their own processes through narrows.core.deterministic). Carry .gpu and .gpu-unsloth.
source .gpu/env
export NARROWS_CACHE=/tmp/narrows-cache
unset CUBLAS_WORKSPACE_CONFIG
case "$1" in
a)
  CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 benchmarks/host_launch.py --workspace-bytes 33554432 \
    --out $OUT/host_launch_ws_setter.json | tail -9
  timeout 500 python3 benchmarks/peers.py --shape 7b-1x512-g8 --timeout 200 --twin 0 --steps 6 \
    --modes unsloth,stream-8GiB-lmhead-fast,stream-8GiB-lmhead-fast-graphs,stream-8GiB-lmhead-fast-auto,stream-min-lmhead-fast-graphs \
    --out $OUT/peers_7b_1x512_g8.json 2>&1 | tail -9 ;;
b)
  timeout 560 python3 benchmarks/peers.py --shape 7b-8x512 --timeout 200 --twin 2 \
    --modes unsloth,stream-8GiB-lmhead-fast,stream-min-lmhead-fast,peft-ckpt \
    --out $OUT/peers_7b_8x512.json 2>&1 | tail -9 ;;
c)
  timeout 580 python3 benchmarks/peers.py --shape 7b-8x512 --timeout 200 --twin 2 \
    --modes unsloth,stream-8GiB-lmhead-fast-graphs,stream-8GiB-lmhead-fast-auto,stream-min-lmhead-fast-graphs \
    --out $OUT/peers_7b_8x512_graphs.json 2>&1 | tail -9 ;;
d)
  timeout 580 python3 benchmarks/peers.py --shape 32b-8x512 --timeout 200 --twin 0 \
    --modes unsloth,stream-12GiB-lmhead-fast,stream-12GiB-lmhead-fast-auto,stream-min-lmhead-fast-auto \
    --out $OUT/peers_32b_8x512.json 2>&1 | tail -9 ;;
e)
  timeout 580 python3 benchmarks/peers.py --shape 7b-1x32768 --timeout 240 --twin 0 \
    --modes unsloth,stream-8GiB-lmhead-fast-tile,stream-min-lmhead-fast-tile \
    --out $OUT/peers_7b_1x32768.json 2>&1 | tail -9 ;;
f)
  timeout 580 python3 benchmarks/peers.py --shape 72b-8x512 --timeout 260 --twin 0 \
    --modes stream-16GiB-lmhead-fast-auto,stream-min-lmhead-fast-auto \
    --out $OUT/peers_72b_8x512.json 2>&1 | tail -9 ;;
g)
  python3 benchmarks/stream_qlora.py --model qwen2.5-7b --batch 8 --seq 512 --steps 4 --torch-profile \
    --modes stream-8GiB-lmhead-fast-auto --out $OUT/prof_7b_8x512.json 2>&1 | tail -4
  timeout 300 python3 benchmarks/stream_qlora.py --model qwen2.5-72b --batch 8 --seq 512 --steps 2 --torch-profile \
    --modes stream-16GiB-lmhead-fast-auto --out $OUT/prof_72b_8x512.json 2>&1 | tail -4 ;;
esac
