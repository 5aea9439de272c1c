import sys, torch
sys.path.insert(0, "packages/core/tests")
import test_fastlayer as t
from narrows.core.fastlayer import lora, loramath
orig = loramath.adapter_then_base

def old(n, w, h, b, s, bias=None):
    out = n.mm(w.t()) if bias is None else torch.addmm(bias.to(n.dtype), n, w.t())
    out.addmm_(h, b.t(), alpha=s)
    return out

def old_if_bias(n, w, h, b, s, bias=None):
    return orig(n, w, h, b, s, None) if bias is None else old(n, w, h, b, s, bias)

def contiguous_h(n, w, h, b, s, bias=None):
    return orig(n, w, h.contiguous(), b, s, bias)

def errors(arch):
    ref = t._steps(t._model(arch, dtype=torch.bfloat16).to(torch.float64).cuda(), device="cuda", pad_last=0)
    model = t._model(arch, dtype=torch.bfloat16, adapter_dtype=torch.float32, device="cuda")
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    print("q bias abs max", q.base_layer.bias.abs().max().item(), "B abs max", q.lora_B.default.weight.abs().max().item())
    t.fuse_layers(model)
    got = t._steps(model, device="cuda", pad_last=0)
    return [round(((r - g.double()).norm() / r.norm()).item(), 5) for r, g in zip(ref, got)][:8]

for name, f in (("new", orig), ("old if bias", old_if_bias), ("contiguous h", contiguous_h), ("old", old)):
    lora.adapter_then_base = f
    print(name, errors("qwen2"))
