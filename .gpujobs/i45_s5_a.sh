#!/usr/bin/env bash
# issue 45 step 5: a host-speed probe (the previous machine ran every mode, Unsloth's too, 10-60% slow
# and noisy), then the 7B 8x512 rows side by side (twins ran at 3 steps on this code: equal).
source .gpu/env
export CUBLAS_WORKSPACE_CONFIG=:4096:8 NARROWS_CACHE=/tmp/narrows-cache
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader; uptime
python3 - <<'PY' | tee $OUT/host_probe.txt
import time, torch
x = torch.zeros(16, device="cuda"); torch.cuda.synchronize()
for _ in range(3):
    t = time.perf_counter()
    for _ in range(20000): x.add_(1)
    torch.cuda.synchronize(); launch = (time.perf_counter() - t) / 20000 * 1e6
    t = time.perf_counter(); s = 0
    for i in range(2_000_000): s += i
    print(f"launch {launch:.2f} us/op, python loop {(time.perf_counter() - t):.3f} s")
PY
timeout ${T:-500} python3 benchmarks/peers.py --shape 7b-8x512 --timeout 200 --twin 0 \
  --modes ${MODES:-unsloth,stream-8GiB-lmhead-fast,stream-6GiB-lmhead-fast,stream-min-lmhead-fast,peft-ckpt,stream-8GiB-lmhead} \
  --out $OUT/peers_7b_8x512.json 2>&1 | tail -10
