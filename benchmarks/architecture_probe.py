"""The held-out exactness probe over announced architectures: tiny
random models on the CPU, PEFT LoRA r8 on all linear layers with dropout 0.05 (where PEFT
allows it), gradient accumulation 2, 5 AdamW steps; streamed vs resident compared with
`torch.equal` on every loss, gradient and final weight; narrows-lmhead's training loss
against the model's own; PEFT DoRA streamed on the architectures named in --dora.
Prints a table and writes JSON. With --device cuda the same comparison runs on the GPU
(deterministic algorithms on), and --graphs streams with CUDA graphs: each row then says
how many layer graphs were captured and which layers ran eagerly, and why.

    python benchmarks/architecture_probe.py --out probe.json [--arch phi3,cohere] [--dora phi3,cohere]
    python benchmarks/architecture_probe.py --device cuda --graphs --dora "" --out probe_graphs.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from peft import LoraConfig, get_peft_model

import narrows.core as nc
import narrows.lmhead as lmh
import narrows.stream as ns
from narrows.core.testing import TINY_ARCHITECTURES, tiny_batch, tiny_model

NEW = [a for a in TINY_ARCHITECTURES if a not in TINY_ARCHITECTURES[:6]]


def build(arch: str, dora: bool, dropout: float):
    model = tiny_model(arch, **({"output_router_logits": True} if "moe" in arch or arch == "mixtral" else {}))
    cfg = LoraConfig(
        r=8,
        lora_alpha=16,
        lora_dropout=dropout,
        target_modules="all-linear",
        use_dora=dora,
        exclude_modules=r".*(\.router|vision_tower\..*|multi_modal_projector\..*)",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = get_peft_model(model, cfg)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.data.normal_(0, 0.05)
    return model.train()


DEVICE, GRAPHS = "cpu", False
STATS: dict[str, object] = {}


def train(model, streamed: bool) -> list[torch.Tensor]:
    if not streamed:  # stream() takes the model from host memory and places it itself
        model.to(DEVICE)
    else:
        ns.stream(model, device=DEVICE, **({"graphs": True} if GRAPHS else {}))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    torch.manual_seed(0)
    out = []
    for step in range(5):
        for micro in range(2):
            batch = {k: v.to(DEVICE) for k, v in tiny_batch(seed=10 * step + micro).items()}
            loss = model(**batch).loss / 2
            loss.backward()
            out.append(loss.detach())
        out += [p.grad.clone() for p in params if p.grad is not None]
        opt.step()
        opt.zero_grad()
    if streamed and GRAPHS:
        STATS.update(model.narrows_stream.graphs.stats.as_dict())
    return out + [p.detach().clone() for p in params]


def parity(arch: str, dora: bool) -> dict:
    dropout = 0.05
    try:
        build(arch, dora, dropout)
    except ValueError:  # PEFT: fused MoE experts (lora.ParamWrapper) take no dropout
        dropout = 0.0
    a, b = train(build(arch, dora, dropout), False), train(build(arch, dora, dropout), True)
    diffs = [float((x - y).abs().max()) for x, y in zip(a, b) if not torch.equal(x, y)]
    row = {
        "dropout": dropout,
        "tensors": len(a),
        "differing": len(diffs),
        "max_diff": max(diffs, default=0.0),
    }
    if GRAPHS:
        row["graphs"] = dict(STATS)
    return row


def lmhead_vs_model(arch: str) -> dict:
    model = build(arch, False, 0.0)
    model.to(DEVICE)
    batch = {k: v.to(DEVICE) for k, v in tiny_batch().items()}
    own = model(**batch).loss.item()
    lmh.apply(model)
    ours = model(**batch).loss.item()
    evaluated = model.eval()(**batch).loss.item()
    return {
        "model_loss": own,
        "lmhead_loss": ours,
        "eval_loss": evaluated,
        "rel_diff": abs(ours - own) / abs(own),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default=",".join(NEW))
    ap.add_argument("--dora", default="phi3,cohere")
    ap.add_argument("--out", default="architecture_probe.json")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--graphs", action="store_true", help="stream with CUDA graphs (graphs=True)")
    args = ap.parse_args()
    global DEVICE, GRAPHS
    DEVICE, GRAPHS = args.device, args.graphs
    if DEVICE.startswith("cuda"):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    rows = []
    for arch in args.arch.split(","):
        t = time.perf_counter()
        anat = nc.anatomy_of(build(arch, False, 0.0))
        row = {
            "arch": arch,
            "layers": anat.num_layers,
            "tied": anat.tied,
            "logit_math": str(anat.logit_math),
            "lora": parity(arch, False),
            "lmhead": lmhead_vs_model(arch),
        }
        if arch in args.dora.split(","):
            row["dora"] = parity(arch, True)
        row["seconds"] = round(time.perf_counter() - t, 1)
        rows.append(row)
        lo, lm = row["lora"], row["lmhead"]
        dora = row.get("dora")
        graphed = lo.get("graphs")
        print(
            f"{arch:12} layers {anat.num_layers} tied {anat.tied!s:5} | LoRA dropout {lo['dropout']}: "
            f"{lo['tensors'] - lo['differing']}/{lo['tensors']} equal | lmhead {lm['lmhead_loss']:.6f} vs model "
            f"{lm['model_loss']:.6f} (rel {lm['rel_diff']:.1e}), eval {lm['eval_loss']:.6f}"
            + (f" | DoRA {dora['tensors'] - dora['differing']}/{dora['tensors']} equal" if dora else "")
            + (
                f" | graphs {graphed['captured']} captured, eager layers {graphed['refused'] or 'none'}"
                if graphed
                else ""
            ),
            flush=True,
        )
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "device": DEVICE, "graphs": GRAPHS, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
