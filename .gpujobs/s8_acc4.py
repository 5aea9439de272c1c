import sys, torch
sys.path.insert(0, "packages/core/tests")
import test_fastlayer as t

def errors(arch):
    ref = t._steps(t._model(arch, dtype=torch.bfloat16).to(torch.float64).cuda(), device="cuda", pad_last=0)
    model = t._model(arch, dtype=torch.bfloat16, adapter_dtype=torch.float32, device="cuda")
    c = model.config
    print(arch, c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, getattr(c, "head_dim", None))
    t.fuse_layers(model)
    got = t._steps(model, device="cuda", pad_last=0)
    return [round(((r - g.double()).norm() / r.norm()).item(), 5) for r, g in zip(ref, got)][:8]

print("reduced-precision reduction allowed", errors("qwen2"))
torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
print("not allowed", errors("qwen2"))
print("llama not allowed", errors("llama"))
# the kernels of one biased K/V-sized call, both orders
from torch.profiler import profile, ProfilerActivity
for flag in (True, False):
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = flag
    n = torch.randn(2 * 64, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)
    c = torch.randn(2 * 64, 16, device="cuda", dtype=torch.bfloat16)
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        c.addmm_(n, w.t()); torch.mm(n, w.t())
    print(flag, [e.key[:60] for e in p.key_averages() if "nvjet" in e.key or "gemm" in e.key or "Kernel" in e.key])
