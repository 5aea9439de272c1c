#!/usr/bin/env bash
# issue 45 step 5: is the step host-bound? host_s (time to hand a step over) beside s/step, at the
# commit before the host-cost change (ab_old: git archive fbfc6f1 packages) and now, same machine.
source .gpu/env
export CUBLAS_WORKSPACE_CONFIG=:4096:8 NARROWS_CACHE=/tmp/narrows-cache
NEWPP=$PYTHONPATH
OLDPP="$PWD/.gpu/site"; for s in $PWD/ab_old/packages/*/src; do OLDPP="$s:$OLDPP"; done
run() {  # version, out name, args...
  local v=$1 name=$2; shift 2
  if [ $v = old ]; then PP=$OLDPP; else PP=$NEWPP; fi
  PYTHONPATH=$PP timeout 200 python3 benchmarks/stream_qlora.py --model qwen2.5-7b --seq 512 --steps 10 --warmup 2 \
    --out $OUT/${name}_$v.json "$@" 2>&1 | tail -4 | sed "s/^/$v /"
  python3 -c "import json,sys; [print('$v', r['mode'], 's/step %.3f host_s %.3f' % (r['s_per_step'], r['host_s_per_step'] or 0)) for r in json.load(open('$OUT/${name}_$v.json'))['rows']]"
}
for v in new old; do run $v b8 --batch 8 --modes stream-8GiB-lmhead-fast,stream-min-lmhead-fast,resident-ckpt-fast-lmhead; done
for v in new old; do run $v g8 --batch 1 --grad-accum 8 --modes stream-8GiB-lmhead-fast; done
