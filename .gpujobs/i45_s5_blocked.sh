#!/usr/bin/env bash
# issue 45 step 5: blocked adapters (one matmul for a group's adapters) against the commit before
# (abx: git archive 1c8d562 packages, untracked), same machine, then the 1x512 G=8 rows beside Unsloth.
source .gpu/env
export CUBLAS_WORKSPACE_CONFIG=:4096:8 NARROWS_CACHE=/tmp/narrows-cache
NEWPP=$PYTHONPATH
OLDPP="$PWD/.gpu/site"; for s in $PWD/abx/packages/*/src; do OLDPP="$s:$OLDPP"; done
show() { python3 -c "import json,sys; [print('$1', r['mode'], 's/step %.3f host_s %.3f' % (r['s_per_step'], r['host_s_per_step'] or 0) if 's_per_step' in r else r.get('error','')[-200:]) for r in json.load(open('$OUT/$1.json'))['rows']]"; }
for v in new old; do
  if [ $v = old ]; then PP=$OLDPP; else PP=$NEWPP; fi
  PYTHONPATH=$PP timeout 150 python3 benchmarks/stream_qlora.py --model qwen2.5-7b --seq 512 --batch 8 --steps 10 --warmup 2 \
    --modes stream-8GiB-lmhead-fast,stream-min-lmhead-fast --out $OUT/b8_$v.json > /dev/null 2>&1; show b8_$v
  PYTHONPATH=$PP timeout 150 python3 benchmarks/stream_qlora.py --model qwen2.5-7b --seq 512 --batch 1 --grad-accum 8 --steps 5 --warmup 2 \
    --modes stream-8GiB-lmhead-fast --out $OUT/g8_$v.json > /dev/null 2>&1; show g8_$v
done
timeout ${T:-280} python3 benchmarks/peers.py --shape 7b-1x512-g8 --timeout 150 --twin 0 --steps 6 \
  --modes ${MODES:-unsloth,stream-8GiB-lmhead-fast,stream-min-lmhead-fast} --out $OUT/peers_7b_1x512_g8.json 2>&1 | tail -6
