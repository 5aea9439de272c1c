"""On CUDA: the chunked loss against the full-logits reference, bf16 and fp32."""

import pytest
import torch

import narrows.lmhead as lmh
from narrows.core import ResidentHead

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_cuda_chunked_matches_reference(dtype, softcap):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1000, 256, generator=g).to("cuda", dtype).requires_grad_(True)
    weight = (torch.randn(5000, 256, generator=g) * 0.05).to("cuda", dtype)
    targets = torch.randint(0, 5000, (1000,), generator=g).cuda()
    w = torch.full((1000,), 1e-3, device="cuda")
    ours = lmh.linear_cross_entropy(hidden, targets, ResidentHead(weight, softcap=softcap), w, head_rows=1024,
                                    tile_bytes=1 << 20)  # fmt: skip
    ref = lmh.reference_cross_entropy(hidden, targets, weight, None, w, softcap)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(ours, ref, **tol)
    (a,) = torch.autograd.grad(ours, hidden)
    (b,) = torch.autograd.grad(ref, hidden)
    torch.testing.assert_close(a, b, **tol)
