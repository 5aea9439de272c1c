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

`--precision` picks how the adapters compute (the frozen base is bf16 in all three):
  fp32-adapters  PEFT's default: adapter weights kept in fp32, the input cast to them
  autocast       the same weights under torch.autocast(bf16), what HF Trainer(bf16=True) runs
  bf16           adapter weights cast to bf16 (``autocast_adapter_dtype=False``; the paper's setting)
"peft-lora" is plain LoRA of the same rank through PEFT: the floor any DoRA can reach.
Fidelity: besides the cosine against PEFT, the last 16 positions' logits of PEFT and narrows
are compared with the same model run entirely in fp64 (exact DoRA of the same weights;
not with NF4).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(args, device, dora: bool = True):
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
        r=args.rank, lora_alpha=args.rank // 2, use_dora=dora, target_modules=TARGETS, lora_dropout=0.0
    )
    model = get_peft_model(model, cfg)
    for name, p in model.named_parameters():  # B = 0 at init would make the norm trivial
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=1e-3)
    if args.precision == "bf16":
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(torch.bfloat16)
    return model.train()


def autocast(args):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.precision == "autocast")


@torch.no_grad()
def fp64_logits(model, ids, args) -> torch.Tensor:
    """The same weights, every tensor in fp64: exact DoRA (PEFT's dense formula)."""
    import copy

    ref = copy.deepcopy(model).double().eval()
    out = ref(input_ids=ids, logits_to_keep=16).logits[0].double()
    del ref
    torch.cuda.empty_cache()
    return out


def measure(model, ids, args, device) -> dict:
    from narrows.core import read_peaks, reset_peaks

    times, host = [], []
    for i in range(args.steps + 2):
        if i == 2:
            reset_peaks(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        with autocast(args):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        end.record()
        issued = time.perf_counter() - t0  # the host's time to launch the step: close to s/step = host-bound
        torch.cuda.synchronize()
        model.zero_grad(set_to_none=True)
        if i >= 2:
            times.append(start.elapsed_time(end) / 1e3)
            host.append(issued)
    with torch.no_grad(), autocast(args):
        logits = model(input_ids=ids, logits_to_keep=16).logits[0].double()
    return {
        "s_per_step": statistics.median(times),
        "host_s": statistics.median(host),
        "peak_allocated": read_peaks(device).cuda_allocated,
        "logits": logits,
    }


def profile(model, ids, args, mode: str) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with autocast(args):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    print(f"--- {mode}: top CUDA kernels of one step")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-7b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rank", type=int, default=384)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--quant", choices=["none", "nf4"], default="none")
    ap.add_argument("--precision", choices=["fp32-adapters", "autocast", "bf16"], default="fp32-adapters")
    ap.add_argument("--no-fp64", action="store_true", help="skip the fp64 reference")
    ap.add_argument("--profile", action="store_true", help="print each mode's top CUDA kernels for one step")
    ap.add_argument("--out", default="benchmarks/results/dora_model.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("dora_model.py measures CUDA time and memory: run it on a GPU")
    import narrows.dora as nd

    device = torch.device("cuda")
    ids = torch.randint(0, 1000, (1, args.seq), generator=torch.Generator().manual_seed(0)).to(device)
    rows = {}
    ref64 = None
    for mode in ("peft-lora", "peft", "narrows-eager", "narrows-fused"):
        model = build(args, device, dora=mode != "peft-lora")
        if mode == "peft" and args.quant == "none" and not args.no_fp64:
            ref64 = fp64_logits(model, ids, args)
        if mode.startswith("narrows"):
            nd.use_narrows_dora(model)
        # the eager tier forced off the kernels; the fused tier as dispatch picks it
        os.environ["NARROWS_DORA_FUSED"] = "0" if mode == "narrows-eager" else ""
        rows[mode] = measure(model, ids, args, device)
        if args.profile:
            profile(model, ids, args, mode)
        del model
        torch.cuda.empty_cache()
    ref = rows["peft"]
    gib = 2**30
    base = "NF4 (QDoRA)" if args.quant == "nf4" else "bf16"

    def cos(x, y):
        return torch.nn.functional.cosine_similarity(x, y, dim=-1).min().item()  # the worst of 16 positions

    print(
        f"\n{args.model} x{args.layers} layers, DoRA r{args.rank}, seq {args.seq}, {base} base, "
        f"{args.precision}, {torch.cuda.get_device_name()}"
    )
    print(
        f"{'mode':<15}{'s/step':>9}{'host s':>8}{'vs PEFT':>9}{'peak GiB':>10}{'vs PEFT GiB':>13}{'cos PEFT':>10}{'cos fp64':>10}"
    )
    out = []
    for mode, r in rows.items():
        dora = mode != "peft-lora"
        row = {
            "mode": mode,
            "s_per_step": r["s_per_step"],
            "host_s": r["host_s"],
            "speedup_vs_peft": ref["s_per_step"] / r["s_per_step"],
            "peak_allocated": r["peak_allocated"],
            "peak_delta_vs_peft": r["peak_allocated"] - ref["peak_allocated"],
            "logit_cosine_vs_peft": cos(r["logits"], ref["logits"]) if dora else None,
            "logit_cosine_vs_fp64": cos(r["logits"], ref64) if dora and ref64 is not None else None,
        }
        out.append(row)
        c1 = f"{row['logit_cosine_vs_peft']:>10.6f}" if dora else f"{'-':>10}"
        c2 = (
            f"{row['logit_cosine_vs_fp64']:>10.6f}"
            if row["logit_cosine_vs_fp64"] is not None
            else f"{'-':>10}"
        )
        print(
            f"{mode:<15}{row['s_per_step']:>9.3f}{row['host_s']:>8.3f}{row['speedup_vs_peft']:>9.2f}{r['peak_allocated'] / gib:>10.2f}"
            f"{row['peak_delta_vs_peft'] / gib:>13.2f}{c1}{c2}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"args": vars(args), "device": torch.cuda.get_device_name(), "rows": out}, indent=2)
    )


if __name__ == "__main__":
    main()
