"""On CUDA: the chunked loss against the full-logits reference, bf16 and fp32."""

import pytest
import torch

import narrows.lmhead as lmh
from narrows.core import LogitMath, ResidentHead

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_cuda_chunked_matches_reference(dtype, softcap):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1000, 256, generator=g).to("cuda", dtype).requires_grad_(True)
    weight = (torch.randn(5000, 256, generator=g) * 0.05).to("cuda", dtype)
    targets = torch.randint(0, 5000, (1000,), generator=g).cuda()
    w = torch.full((1000,), 1e-3, device="cuda")
    ours = lmh.linear_cross_entropy(
        hidden,
        targets,
        ResidentHead(weight, math=LogitMath(softcap=softcap)),
        w,
        head_rows=1024,
        tile_bytes=1 << 20,
    )
    ref = lmh.reference_cross_entropy(hidden, targets, weight, None, w, LogitMath(softcap=softcap))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(ours, ref, **tol)
    (a,) = torch.autograd.grad(ours, hidden)
    (b,) = torch.autograd.grad(ref, hidden)
    torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("library", ["liger", "cce"])
@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("mask", [True, False])
def test_cuda_fused_dispatch_matches_the_chunked_loss(softcap, mask, library):
    pytest.importorskip({"liger": "liger_kernel", "cce": "cut_cross_entropy"}[library])
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 300, 256, generator=g).to("cuda", torch.bfloat16).requires_grad_(True)
    head = torch.nn.Linear(256, 5000, bias=False).to("cuda", torch.bfloat16)
    labels = torch.randint(0, 5000, (2, 300), generator=g).cuda()
    labels[0, :100] = -100
    source = ResidentHead.of(head, LogitMath(softcap=softcap))
    out = {}
    for fused in ("off", library, library):  # twice: the same bits again
        loss = lmh.causal_lm_loss(hidden, labels, source, lmh.LossOptions(mask=mask, fused=fused))
        again = out.get(fused)
        out[fused] = (loss, *torch.autograd.grad(loss, hidden))
    tol = dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(out[library][0], out["off"][0], **tol)
    torch.testing.assert_close(out[library][1], out["off"][1], **tol)
    assert not torch.equal(out[library][1], out["off"][1])  # its own kernels ran
    if library == "liger":  # deterministic: its chunks sum in a fixed order
        assert all(torch.equal(a, b) for a, b in zip(again, out[library]))
