#!/usr/bin/env bash
# The runs on a machine with several GPUs (nvidia-h200-x2, -x4): the NCCL tests, then for each
# config:budget in $CONFIGS and each sequence length in $SEQS one shared_host.py run: the main job
# under torchrun on each rank count of $RANKS at that per-GPU budget (8 rows of --seq a rank, the
# ranks sharing one host copy), and the other cases of $PEERS (fsdp, deepspeed; stages: the main job
# with --pipeline-stages, one micro-batch a stage) at the rank counts of
# $PEER_RANKS where $PEER_SEQS holds the sequence length. Run from the repo root with .gpu
# (../shared/gpu/stage --lock) and, for the DeepSpeed rows, .gpu-deepspeed (stage_deepspeed.sh)
# carried along; results land in $OUT.
#   CONFIGS="qwen2.5-7b:8GiB qwen2.5-72b:16GiB"  SEQS="512 2048"  RANKS="1 2 4" (RANKS="": no job rows)
#   BATCH=8 (rows of --seq a rank, a micro-batch)  PEERS="fsdp deepspeed stages"  PEER_RANKS="1 2 4"  PEER_SEQS="512"  SKIP_TESTS=1  TESTS="paths"  KEEP=1 (keep /tmp/dp_*)
set -u
source .gpu/env
[[ -f .gpu-deepspeed/env ]] && source .gpu-deepspeed/env
# NVLink multicast stays off (the machine's rule), in every process the runs start
export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks NARROWS_CACHE=/tmp/narrows-cache \
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
if [[ ${SKIP_TESTS:-0} != 1 ]]; then
  timeout ${TTESTS:-420} python3 -m pytest -q -p no:cacheprovider -m gpu \
    ${TESTS:-packages/stream/tests/test_distributed_gpu.py packages/stream/tests/test_pipeline_gpu.py tests/test_finetune_ranks_gpu.py} 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
fi
for spec in ${CONFIGS:-qwen2.5-7b:8GiB}; do
  IFS=: read -r c budget <<<"$spec"
  for seq in ${SEQS:-512}; do
    cases=$(for r in ${RANKS-1 2}; do printf '%s:job,' "$r"; done)
    if [[ " ${PEER_SEQS:-512} " == *" $seq "* ]]; then
      for p in ${PEERS:-}; do for r in ${PEER_RANKS:-1 2}; do cases+="$r:$p,"; done; done
    fi
    timeout ${TCASE:-590} python3 benchmarks/shared_host.py --config "$c" --budget "$budget" --batch ${BATCH:-8} --seq "$seq" \
      --cases "${cases%,}" --steps ${STEPS:-3} --warmup 2 --host-budget ${HOST_BUDGET:-200GiB} --work "/tmp/dp_$c" \
      --timeout ${TIMEOUT:-300} --out "$OUT/dp_${c}_${BATCH:-8}x${seq}.json" 2>&1 | grep -v '^{' | tail -12
  done
  [[ ${KEEP:-0} == 1 ]] || rm -rf "/tmp/dp_$c"  # the next config's checkpoint and cache need the disk
done
