#!/usr/bin/env bash
# issue 45 step 5: where does the host's time go? 7B 1x512 G=8 (28 whole layers resident: 2.3 s/step, host 2.0 s)
# with the collector on, frozen and off, and one step under cProfile; then 8x512 with the collector frozen.
source .gpu/env
export CUBLAS_WORKSPACE_CONFIG=:4096:8 NARROWS_CACHE=/tmp/narrows-cache
show() { python3 -c "import json,sys; [print('$1', r['mode'], 's/step %.3f host_s %.3f' % (r['s_per_step'], r['host_s_per_step'] or 0)) for r in json.load(open('$OUT/$1.json'))['rows']]"; }
for gc in on freeze off; do
  timeout 150 python3 benchmarks/stream_qlora.py --model qwen2.5-7b --seq 512 --batch 1 --grad-accum 8 --steps 6 --warmup 2 \
    --modes stream-8GiB-lmhead-fast --gc $gc $([ $gc = on ] && echo --host-profile) --out $OUT/g8_gc$gc.json > /dev/null 2>&1; show g8_gc$gc
done
python3 -c "import json; [print(x) for x in json.load(open('$OUT/g8_gcon.json'))['rows'][0].get('host_profile', [])]"
for gc in on freeze; do
  timeout 150 python3 benchmarks/stream_qlora.py --model qwen2.5-7b --seq 512 --batch 8 --steps 10 --warmup 2 \
    --modes stream-8GiB-lmhead-fast,stream-min-lmhead-fast --gc $gc --out $OUT/b8_gc$gc.json > /dev/null 2>&1; show b8_gc$gc
done
