"""Which bias order loses precision (Qwen2's Q/K/V bias) — errors against float64."""
import sys
import torch
sys.path.insert(0, "packages/core/tests")
import test_fastlayer as t
from narrows.core.fastlayer import lora, loramath

torch.manual_seed(0)
T, K, N, r = 512, 64, 96, 8
n = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
w = (torch.randn(N, K, device="cuda") * 0.1).bfloat16()
h = torch.randn(T, r, device="cuda", dtype=torch.bfloat16)
b = (torch.randn(N, r, device="cuda") * 0.02).bfloat16()
for bias in (torch.zeros(N, device="cuda", dtype=torch.bfloat16), (torch.randn(N, device="cuda") * 0.5).bfloat16()):
    ref = n.double() @ w.double().t() + 2.0 * h.double() @ b.double().t() + bias.double()
    lt = torch.addmm(bias, h, b.t(), alpha=2.0)
    lt_ref = bias.double() + 2.0 * h.double() @ b.double().t()
    print("bias-epilogue adapter product err", ((lt.double() - lt_ref).abs().max()).item(),
          "plain", ((torch.addmm(loramath._unread(n.device, n.dtype), h, b.t(), beta=0, alpha=2.0).double() + bias.double() - lt_ref).abs().max()).item())
    new = loramath.adapter_then_base(n, w, h, b, 2.0, bias)
    old = torch.addmm(bias, n, w.t()); old.addmm_(h, b.t(), alpha=2.0)
    sep = loramath.adapter_then_base(n, w, h, b, 2.0, None).add_(bias)
    for name, x in (("new", new), ("old", old), ("separate bias", sep)):
        print(name, ((x.double() - ref).norm() / ref.norm()).item())


def sep_then_base(n, w, h, b, s, bias=None):
    out = loramath.adapter_then_base(n, w, h, b, s, None)
    return out if bias is None else out.add_(bias)


def errors(arch):
    ref = t._steps(t._model(arch, dtype=torch.bfloat16).to(torch.float64).cuda(), device="cuda", pad_last=0)
    model = t._model(arch, dtype=torch.bfloat16, adapter_dtype=torch.float32, device="cuda")
    t.fuse_layers(model)
    got = t._steps(model, device="cuda", pad_last=0)
    return [round(((r - g.double()).norm() / r.norm()).item(), 5) for r, g in zip(ref, got)][:8]


print("qwen2 new", errors("qwen2"))
lora.adapter_then_base = sep_then_base
print("qwen2 bias added after", errors("qwen2"))
