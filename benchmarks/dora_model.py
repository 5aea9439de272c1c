"""DoRA gradient computation on real layer shapes: PEFT's DoRA against narrows' eager and
fused (Triton compose) paths (`use_narrows_dora`), same model, same batch, one process.

    python benchmarks/dora_model.py --model qwen2.5-7b --layers 4 --rank 384 --seq 4096 [--quant nf4]

A stack of `--layers` decoder layers of the real shape (random bf16 weights, head and
embedding included), DoRA on all seven projections, batch 1. Per mode: median seconds of
forward+backward (optimizer excluded, CUDA-event timing), peak allocated memory, and the
final logits' cosine similarity against PEFT. "narrows-eager" forces the eager tier
(NARROWS_DORA_FUSED=0); "narrows-fused" lets the dispatch pick the Triton kernels.
`--quant nf4` quantises the decoder linears to bitsandbytes NF4 first (QDoRA): PEFT then
dequantises every whole weight for its norm, narrows reads it a few rows at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(args, device):
    from _models import load_config
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = load_config(args.model)
    config.num_hidden_layers = args.layers
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    if args.quant == "nf4":
        from narrows.core import quantize_nf4

        quantize_nf4(model)
    cfg = LoraConfig(
        r=args.rank, lora_alpha=args.rank // 2, use_dora=True, target_modules=TARGETS, lora_dropout=0.0
    )
    model = get_peft_model(model, cfg)
    for name, p in model.named_parameters():  # B = 0 at init would make the norm trivial
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=1e-3)
    return model.train()


def measure(model, ids, steps: int, device) -> dict:
    from narrows.core import read_peaks, reset_peaks

    times = []
    for i in range(steps + 2):
        if i == 2:
            reset_peaks(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        end.record()
        torch.cuda.synchronize()
        model.zero_grad(set_to_none=True)
        if i >= 2:
            times.append(start.elapsed_time(end) / 1e3)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, -1].float()
    return {"s_per_step": statistics.median(times), "peak_allocated": read_peaks(device).cuda_allocated,
            "logits": logits}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-7b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rank", type=int, default=384)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--quant", choices=["none", "nf4"], default="none")
    ap.add_argument("--out", default="benchmarks/results/dora_model.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("dora_model.py measures CUDA time and memory: run it on a GPU")
    import narrows.dora as nd

    device = torch.device("cuda")
    ids = torch.randint(0, 1000, (1, args.seq), generator=torch.Generator().manual_seed(0)).to(device)
    rows = {}
    for mode in ("peft", "narrows-eager", "narrows-fused"):
        model = build(args, device)
        if mode != "peft":
            nd.use_narrows_dora(model)
        # the eager tier forced off the kernels; the fused tier as dispatch picks it
        os.environ["NARROWS_DORA_FUSED"] = "0" if mode == "narrows-eager" else ""
        rows[mode] = measure(model, ids, args.steps, device)
        del model
        torch.cuda.empty_cache()
    ref = rows["peft"]
    gib = 2**30
    base = "NF4 (QDoRA)" if args.quant == "nf4" else "bf16"
    print(
        f"\n{args.model} x{args.layers} layers, DoRA r{args.rank}, seq {args.seq}, {base}, {torch.cuda.get_device_name()}"
    )
    print(f"{'mode':<15}{'s/step':>9}{'speedup':>9}{'peak GiB':>10}{'vs PEFT GiB':>13}{'logit cos':>12}")
    out = []
    for mode, r in rows.items():
        cos = torch.nn.functional.cosine_similarity(r["logits"], ref["logits"], dim=0).item()
        row = {"mode": mode, "s_per_step": r["s_per_step"], "speedup_vs_peft": ref["s_per_step"] / r["s_per_step"],
               "peak_allocated": r["peak_allocated"], "peak_delta_vs_peft": r["peak_allocated"] - ref["peak_allocated"],
               "logit_cosine_vs_peft": cos}  # fmt: skip
        out.append(row)
        print(f"{mode:<15}{row['s_per_step']:>9.3f}{row['speedup_vs_peft']:>9.2f}{r['peak_allocated'] / gib:>10.2f}"
              f"{row['peak_delta_vs_peft'] / gib:>13.2f}{cos:>12.6f}")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"args": vars(args), "device": torch.cuda.get_device_name(), "rows": out}, indent=2)
    )


if __name__ == "__main__":
    main()
