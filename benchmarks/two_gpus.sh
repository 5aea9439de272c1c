#!/usr/bin/env bash
# The runs on a machine with two GPUs (nvidia-h200-x2): the NCCL tests, then for each
# config in $CONFIGS one rank against two at the same per-GPU budget (seq 512 and 4096;
# narrows-lmhead; the ranks share one host copy) and answer.ai's FSDP+QLoRA on two ranks.
# Run from the repo root with .gpu (../shared/gpu/stage) and .whl (uv build --all-packages
# --wheel -o .whl) carried along; results land in $OUT.
#   CONFIGS="qwen2.5-32b qwen2.5-72b"   BUDGET=12GiB   SKIP_TESTS=1   T512/T4096/TFSDP: time limits
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
source .gpu/env
# NVLink multicast stays off (the machine's rule); the host budget is given because that
# machine's MemAvailable starts low and grows as memory is touched
export PYTHONPATH=/tmp/site:$PWD/.gpu/site:$PWD/benchmarks HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 \
  NARROWS_CACHE=/tmp/narrows-cache NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
if [[ ${SKIP_TESTS:-0} != 1 ]]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu packages/stream/tests/test_distributed_gpu.py \
    tests/test_finetune_ranks_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
fi
for c in ${CONFIGS:-qwen2.5-32b}; do
  sh="python3 benchmarks/shared_host.py --config $c --budget ${BUDGET:-12GiB} --lmhead --host-budget 160GiB \
    --work /tmp/dp_$c --steps 3 --warmup 2"
  timeout ${T512:-300} $sh --seq 512 --cases 1:share,2:share --out "$OUT/dp_${c}_512.json" 2>&1 | tail -6
  timeout ${T4096:-300} $sh --seq 4096 --cases 1:share,2:share --out "$OUT/dp_${c}_4096.json" 2>&1 | tail -6
  timeout ${TFSDP:-300} $sh --seq 512 --cases 2:fsdp --out "$OUT/dp_${c}_512_fsdp.json" 2>&1 | tail -6
  rm -rf "/tmp/dp_$c"  # the next config's checkpoint and cache need the disk
done
