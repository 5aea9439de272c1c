"""The CUDA bf16 error test over seeds: fast / PEFT (max relative error against float64), both orders."""

import sys

import torch

sys.path.insert(0, "packages/core/tests")
import test_fastlayer as t

from narrows.core.fastlayer import lora, loramath
from narrows.core.testing import tiny_model, with_adapter

orig = loramath.adapter_then_base


def old(n, w, h, b, s, bias=None):
    out = n.mm(w.t()) if bias is None else torch.addmm(bias.to(n.dtype), n, w.t())
    out.addmm_(h, b.t(), alpha=s)
    return out


def model(arch, seed, dtype, adapter_dtype=None):
    m = with_adapter(t._sdpa(tiny_model(arch, dtype=dtype, seed=seed)), "lora", seed=seed).train().cuda()
    m.config.use_cache = False
    if adapter_dtype is not None:
        for p in m.parameters():
            if p.requires_grad:
                p.data = p.data.to(adapter_dtype)
    return m


def err(ref, got):
    return max(((r - g.double()).norm() / r.norm()).item() for r, g in zip(ref, got))


for arch in ("qwen2", "llama", "mistral", "qwen3"):
    for seed in range(4):
        ref = t._steps(model(arch, seed, torch.bfloat16).to(torch.float64), device="cuda", pad_last=0)
        peft = err(ref, t._steps(model(arch, seed, torch.bfloat16, torch.float32), device="cuda", pad_last=0))
        row = []
        for name, f in (("new", orig), ("old", old)):
            lora.adapter_then_base = f
            m = model(arch, seed, torch.bfloat16, torch.float32)
            t.fuse_layers(m)
            row.append(f"{name} {err(ref, t._steps(m, device='cuda', pad_last=0)) / peft:.2f}")
        lora.adapter_then_base = orig
        print(arch, seed, f"peft {peft:.4f}", *row)
