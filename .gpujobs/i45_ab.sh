#!/usr/bin/env bash
# issue 45: streamed fast layers with and without Liger's kernels, alternating, one machine (7B, 8x512)
source .gpu/env
M=stream-8GiB-lmhead-fast,stream-min-lmhead-fast
for round in 1 2; do
  for liger in 1 0; do
    NARROWS_LIGER=$liger timeout 150 python3 benchmarks/stream_qlora.py --model qwen2.5-7b --seq 512 --batch 8 --steps 10 \
      --warmup 2 --modes $M --out $OUT/ab_liger${liger}_r${round}.json 2>&1 | tail -3 | sed "s/^/liger=$liger r$round  /"
  done
done
