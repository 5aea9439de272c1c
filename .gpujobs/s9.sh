#!/usr/bin/env bash
# session 9: the rows the issue's benchmark lists that no run has measured with the fast layers'
# final code, and LoRA dropout beside Unsloth. Run from a snapshot (snap/, `git archive` of the
# commit measured) holding links to .gpu and .gpu-unsloth; carry .gpu, .gpu-unsloth and snap.
source .gpu/env
export NARROWS_CACHE=/tmp/narrows-cache
unset CUBLAS_WORKSPACE_CONFIG
peers() {  # shape, out name, twin steps, modes, extra args...
  local shape=$1 name=$2 twin=$3 modes=$4; shift 4
  timeout 590 python3 benchmarks/peers.py --shape $shape --timeout 300 --twin $twin --modes $modes \
    --out $OUT/peers_$name.json "$@" 2>&1 | grep -v "^ *$" | tail -14
}
case "$1" in
drop)  # dropout 0.05 on every row: the 8GiB plan's peak against its budget, and Unsloth off its fast LoRA path
  peers 7b-8x512 7b_8x512_drop 2 unsloth,stream-8GiB-lmhead-fast-auto,stream-min-lmhead-fast,peft-ckpt --dropout 0.05 ;;
7b)
  peers 7b-8x512 7b_8x512_s9 2 unsloth,stream-8GiB-lmhead-fast-auto,stream-min-lmhead-fast,stream-8GiB-lmhead,peft,peft-ckpt ;;
72b)
  peers 72b-8x512 72b_8x512_s9 0 stream-16GiB-lmhead-fast-auto,stream-24GiB-lmhead-fast-auto,stream-min-lmhead-fast-auto ;;
72bpeft)
  peers 72b-8x512 72b_8x512_peft_s9 0 stream-16GiB-lmhead --steps 4 ;;
32b)
  rm -rf /tmp/peers/qwen2.5-72b*
  peers 32b-8x512 32b_8x512_s9 1 unsloth,stream-12GiB-lmhead-fast-auto,stream-min-lmhead-fast-auto,stream-12GiB-lmhead ;;
esac
