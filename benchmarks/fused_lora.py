"""Fused LoRA branches (`narrows.core.fuse_lora`) against PEFT inside real-shape layers
: time, host time, saved activations, and the bits.

Qwen2.5 decoder layers of the real shape (NF4 base, LoRA r16 on all seven linears with
PEFT's float32 adapters, bf16 activations, batch 1) run forward and backward from a fixed
input, four ways, in one process:

* ``peft``: PEFT's own forwards (the reference).
* ``fused``: `fuse_lora` — each linear's branch one autograd node, the float32 cast of a
  shared input made and saved once.
* ``lean``: PEFT's arithmetic with its Python dispatch bypassed: how much of a layer's
  time PEFT's Python is.
* ``grouped``: Q/K/V's and gate/up's A matrices concatenated into one matmul each. cuBLAS
  may pick another kernel for the wider matmul, so its bits are checked, not assumed.

For each: median wall time of a forward+backward over the layers (synchronised), the host
time to issue it (until the last call returns, before waiting for the device), the bytes
the forward leaves allocated for the backward, and whether the output, the input
gradient and every LoRA gradient are `torch.equal` to ``peft``'s (that one pass runs
with deterministic kernels, `narrows.core.deterministic`; the timed ones with the
defaults).

    python benchmarks/fused_lora.py --model qwen2.5-7b --layers 4 --seq 512 --out fused_lora_7b.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _models import add_lora, load_config, random_nf4_model

from narrows.core import deterministic, fuse_lora, unfuse_lora


def _parts(m):
    return m.lora_A["default"], m.lora_B["default"], m.scaling["default"]


def lean(self, x):
    """PEFT's Linear4bit arithmetic without its Python dispatch."""
    a, b, s = _parts(self)
    result = self.base_layer(x).clone()
    return result + (b(a(x.to(a.weight.dtype))) * s).to(result.dtype)


def grouped_forwards(layer):
    """Q/K/V (and gate/up) share one cast and one matmul for their A's; each B separate.
    The first member called computes the group's low-rank inputs; the others take theirs."""
    out = {}
    for names in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
        mods = [m for n, m in layer.named_modules() if n.split(".")[-1] in names and hasattr(m, "lora_A")]
        cache: dict[str, object] = {}

        def make(i, mods=mods, cache=cache):
            def fwd(self, x):
                a, b, s = _parts(self)
                if i == 0:
                    a_all = torch.cat([m.lora_A["default"].weight for m in mods])
                    widths = [m.lora_A["default"].out_features for m in mods]
                    cache["h"] = torch.nn.functional.linear(x.to(a.weight.dtype), a_all).split(widths, -1)
                result = self.base_layer(x).clone()
                return result + (b(cache["h"][i]) * s).to(result.dtype)

            return fwd

        for i, m in enumerate(mods):
            out[m] = make(i)
    return out


def lora_linears(layers):
    return [
        m for layer in layers for m in layer.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")
    ]


def set_forward(layers, how):
    for layer in layers:
        unfuse_lora(layer)
    for m in lora_linears(layers):
        m.__dict__.pop("forward", None)
    if how == "fused":
        for layer in layers:
            fuse_lora(layer)
    elif how == "lean":
        for m in lora_linears(layers):
            m.forward = types.MethodType(lean, m)
    elif how == "grouped":
        for layer in layers:
            for m, f in grouped_forwards(layer).items():
                m.forward = types.MethodType(f, m)
        for m in lora_linears(layers):
            if "forward" not in m.__dict__:
                m.forward = types.MethodType(lean, m)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-7b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    cfg = load_config(args.model)
    cfg.num_hidden_layers = args.layers
    model = add_lora(random_nf4_model(cfg, work_device=device))
    gen = torch.Generator().manual_seed(1)
    for n, p in model.named_parameters():
        if "lora_B" in n:  # PEFT starts B at zero: give every gradient something to carry
            p.data.copy_(torch.randn(p.shape, generator=gen).mul_(0.02))
    model.to(device).train()
    inner = model.base_model.model.model
    layers = list(inner.layers)
    x0 = torch.randn(1, args.seq, cfg.hidden_size, generator=gen).to(device, torch.bfloat16)
    pos = torch.arange(args.seq, device=device)[None]
    rope = inner.rotary_emb(x0, pos)
    weight = torch.randn(x0.shape, generator=gen).to(device, torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]

    def run(saved=None):
        x = x0.detach().requires_grad_()
        before = torch.cuda.memory_allocated() if device == "cuda" else 0
        h = x
        for layer in layers:
            h = layer(h, position_embeddings=rope, position_ids=pos)
            h = h[0] if isinstance(h, tuple) else h
        if saved is not None and device == "cuda":
            saved.append(torch.cuda.memory_allocated() - before)
        (h.float() * weight).sum().backward()
        return h.detach(), x.grad

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    modes = ("peft", "fused", "lean", "grouped")
    rows, ref = {}, None
    for how in modes:  # bits and saved bytes, one deterministic pass each
        set_forward(layers, how)
        for p in params:
            p.grad = None
        saved: list[int] = []
        deterministic(True)  # the bits check needs a deterministic reference (SDPA's backward)
        out, gx = run(saved)
        deterministic(False)
        got = [out, gx] + [p.grad.clone() for p in params]
        ref = ref or got
        rows[how] = {
            "mode": how,
            "layers": args.layers,
            "seq": args.seq,
            "saved_bytes_per_layer": saved[0] // args.layers if saved else None,
            "identical_to_peft": all(torch.equal(a, b) for a, b in zip(ref, got)),
        }
        for _ in range(3):  # warm-up
            run()
    walls: dict[str, list[float]] = {how: [] for how in modes}
    hosts: dict[str, list[float]] = {how: [] for how in modes}
    for _ in range(args.reps):  # interleaved, so drift (clocks, allocator) hits every mode alike
        for how in modes:
            set_forward(layers, how)
            for p in params:
                p.grad = None
            sync()
            t0 = time.perf_counter()
            run()
            t1 = time.perf_counter()
            sync()
            hosts[how].append(t1 - t0)
            walls[how].append(time.perf_counter() - t0)
    for how, row in rows.items():
        row["ms_per_layer"] = 1e3 * statistics.median(walls[how]) / args.layers
        row["host_ms_per_layer"] = 1e3 * statistics.median(hosts[how]) / args.layers
        print(
            f"{how:8s} {row['ms_per_layer']:8.3f} ms/layer  host {row['host_ms_per_layer']:8.3f} ms/layer  "
            f"saved {row['saved_bytes_per_layer']}  identical {row['identical_to_peft']}",
            flush=True,
        )
    rows = list(rows.values())
    base = rows[0]["ms_per_layer"]
    for r in rows:
        r["vs_peft"] = r["ms_per_layer"] / base
    result = {
        "model": args.model,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
