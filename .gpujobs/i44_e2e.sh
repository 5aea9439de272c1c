#!/usr/bin/env bash
# issue 44 end to end on CUDA: `narrows finetune` with --grad-accum 4 and a budget, the planner
# choosing the accumulation (no flag) against --no-step-mode; the two adapters must be torch.equal.
# A random llama of 8 layers of 2048 x 5632 (about 100 MB a layer in bf16), every layer streamed.
source .gpu/env
export CUBLAS_WORKSPACE_CONFIG=:4096:8 NARROWS_CACHE=/tmp/narrows-cache
nvidia-smi --query-gpu=name --format=csv,noheader
python3 - <<'PY'
from narrows.core.testing import tiny_model_folder, write_jsonl
tiny_model_folder("/tmp/e2e/model", "llama", hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                  num_attention_heads=16, num_key_value_heads=4, head_dim=128)
write_jsonl("/tmp/e2e/train.jsonl", [{"text": " ".join(f"w{(7 * i + j) % 50}" for j in range(60))} for i in range(64)])
PY
for mode in auto sequential; do
  extra=""; [ $mode = sequential ] && extra="--no-step-mode"
  /usr/bin/time -f "$mode wall %e s" python3 -m narrows.core.cli finetune --model /tmp/e2e/model --data /tmp/e2e/train.jsonl \
    --steps 6 --batch 2 --seq-len 64 --grad-accum 4 --gpu-budget 400MiB --dropout 0.1 --eval-rows 0 --deterministic \
    --no-progress --out $OUT/$mode $extra 2>&1 | grep -E "narrows: (accumulation|step mode|plan|stream)|step [0-9]|wall|rror" | head -20
done
python3 - <<'PY'
import json, os, torch
from safetensors.torch import load_file
out = os.environ["OUT"]
a, b = (load_file(f"{out}/{m}/adapter_model.safetensors") for m in ("auto", "sequential"))
rows = {m: [json.loads(l) for l in open(f"{out}/{m}/metrics.jsonl")] for m in ("auto", "sequential")}
same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
losses = {m: [r["loss"] for r in rs if "loss" in r] for m, rs in rows.items()}
print("adapters torch.equal:", same, "| losses equal:", losses["auto"] == losses["sequential"])
print("accumulation per step:", {m: [r.get("accumulation") for r in rs if "loss" in r] for m, rs in rows.items()})
for m in ("auto", "sequential"):
    s = json.load(open(f"{out}/{m}/summary.json"))["stream"]
    print(m, {k: s.get(k) for k in ("accumulation", "resident_layers", "peak_allocated", "predicted_peak", "seconds_per_step") if k in s})
PY
