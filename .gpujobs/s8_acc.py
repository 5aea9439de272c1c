"""Diagnose test_cuda_bf16_error_is_no_worse_than_pefts[qwen2] under the adapter-first order."""
import sys
import torch
sys.path.insert(0, "packages/core/tests")
import test_fastlayer as t
from narrows.core.fastlayer import lora


def old(n, w, h, b, s, bias=None):
    out = n.mm(w.t()) if bias is None else torch.addmm(bias.to(n.dtype), n, w.t())
    out.addmm_(h, b.t(), alpha=s)
    return out


def errors(arch):
    ref = t._steps(t._model(arch, dtype=torch.bfloat16).to(torch.float64).cuda(), device="cuda", pad_last=0)
    out = {}
    for name, fuse_it in (("peft", False), ("fast", True)):
        model = t._model(arch, dtype=torch.bfloat16, adapter_dtype=torch.float32, device="cuda")
        if fuse_it:
            t.fuse_layers(model)
        got = t._steps(model, device="cuda", pad_last=0)
        out[name] = [round(((r - g.double()).norm() / r.norm()).item(), 5) for r, g in zip(ref, got)]
    return out


for arch in ("qwen2", "llama"):
    print(arch, "new", errors(arch))
    keep = lora.adapter_then_base
    lora.adapter_then_base = old
    print(arch, "old forward order", errors(arch))
    lora.adapter_then_base = keep
