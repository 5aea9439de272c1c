#!/usr/bin/env bash
# session 8: where a step's device time goes now (categories, compute stream busy share)
source .gpu/env
export NARROWS_CACHE=/tmp/narrows-cache
unset CUBLAS_WORKSPACE_CONFIG
timeout 200 python3 benchmarks/stream_qlora.py --model qwen2.5-7b --batch 8 --seq 512 --steps 4 --torch-profile \
  --modes stream-8GiB-lmhead-fast-auto --out $OUT/prof_7b_8x512_s8.json 2>&1 | grep -v "torch profile" | tail -3
timeout 250 python3 benchmarks/stream_qlora.py --model qwen2.5-32b --batch 8 --seq 512 --steps 3 --torch-profile \
  --modes stream-12GiB-lmhead-fast-auto --out $OUT/prof_32b_8x512_s8.json 2>&1 | grep -v "torch profile" | tail -3
python3 - <<'PY'
import json,glob,os
for f in sorted(glob.glob(os.environ['OUT']+'/prof_*.json')):
    d=json.load(open(f))
    for r in d['rows']:
        p=r.get('torch_profile') or {}
        print(f, r['mode'], r['s_per_step'], p.get('wall_s'), p.get('compute_stream'))
        print('  ', p.get('device_s_by_kind'))
        for k in p.get('other_kernels_top', []): print('    ', k)
PY
