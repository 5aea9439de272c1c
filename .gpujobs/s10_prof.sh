#!/usr/bin/env bash
# session 10: the GPU tests no device ran since step 8's last changes, then where one fast
# layer's device time goes at 72B, 32B and 7B (benchmarks/layer_profile.py). Carry .gpu.
source .gpu/env
export NARROWS_CACHE=/tmp/narrows-cache
case "$1" in
tests)
  CUBLAS_WORKSPACE_CONFIG=:4096:8 timeout 400 python3 -m pytest packages/stream/tests/test_step_mode.py \
    packages/core/tests/test_fastlayer.py -m gpu -q -p no:cacheprovider -rfE 2>&1 | tail -8 ;;
prof)
  unset CUBLAS_WORKSPACE_CONFIG
  for m in 72b 7b; do
    timeout 200 python3 benchmarks/layer_profile.py --case qwen2.5-$m:4096:512 --out $OUT/layer_profile_$m.json 2>&1 | tail -34
  done ;;
esac
case "$1" in
step72)  # one 72B step under torch.profiler: is the compute stream ever idle, and for how long
  unset CUBLAS_WORKSPACE_CONFIG
  timeout 580 python3 benchmarks/stream_qlora.py --model qwen2.5-72b --batch 8 --seq 512 --steps 3 --warmup 1 \
    --torch-profile --modes stream-16GiB-lmhead-fast-auto --out $OUT/prof_72b_8x512_s10.json 2>&1 | grep -v "torch profile" | tail -3
  python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/prof_72b_8x512_s10.json"))
for r in d["rows"]:
    p = r.get("torch_profile") or {}
    print(r["mode"], r.get("s_per_step"), "host", r.get("host_s_per_step"), p.get("wall_s"), p.get("compute_stream"))
    print("  ", p.get("device_s_by_kind"))
PY
  ;;
esac
