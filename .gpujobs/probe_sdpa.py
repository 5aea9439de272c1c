"""What SDPA's autograd graph looks like on this device (is its output a view; is it one node on its leaves)."""
import torch, torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
torch.manual_seed(0)
dev = "cuda"
for gqa in (False, True):
    for mask in (False, True):
        for det in (False, True):
            torch.use_deterministic_algorithms(det)
            kvh = 2 if gqa else 8
            q = torch.randn(2, 8, 256, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(2, kvh, 256, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
            v = torch.randn(2, 256, kvh, 128, device=dev, dtype=torch.bfloat16).transpose(1, 2).detach().requires_grad_()
            m = None
            if mask:
                m = torch.ones(2, 1, 256, 256, device=dev, dtype=torch.bool).tril()
                m = torch.where(m, 0.0, float("-inf")).to(torch.bfloat16)
            packed = []
            def pack(t):
                packed.append((tuple(t.shape), str(t.dtype), t.device.type, t.stride(), t.is_contiguous()))
                return t
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=m is None, enable_gqa=gqa)
            nf = out.grad_fn.next_functions
            print(f"gqa={gqa} mask={mask} det={det}: node={type(out.grad_fn).__name__} view={out._base is not None} "
                  f"strides={out.stride()} next={[type(f).__name__ if f else None for f, _ in nf]}")
            print("   packed:", packed)
            g = torch.randn_like(out)
            ref = torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
            try:
                got = out.grad_fn(g)
                print("   node call equal:", [torch.equal(a, b) if b is not None else None for a, b in zip(ref, got)], len(got))
            except Exception as e:
                print("   node call:", type(e).__name__, str(e)[:200])
