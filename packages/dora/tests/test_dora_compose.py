"""The composition as a custom op: eager paths bitwise identical, torch.compile without graph breaks."""

from __future__ import annotations

import pytest
import torch

from narrows.dora import compose, fused_reason
from narrows.dora.compose import _compose_op, backward_eager, formula


def case(shape=(3, 5, 48), dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g).to(dtype).requires_grad_(True)
    lora = (torch.randn(shape, generator=g) * 0.1).to(dtype).requires_grad_(True)
    mag = (1 + 0.01 * torch.randn(shape[-1], generator=g)).requires_grad_(True)
    return base, lora, mag


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_op_forward_and_backward_equal_the_eager_formula(dtype):
    base, lora, g = case(dtype=dtype)
    out = compose(base, lora, g, 0.5)
    assert torch.equal(out, formula(base, lora, g, 0.5))
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (base, lora, g), grad)
    want = backward_eager(grad, base.detach(), lora.detach(), g.detach(), 0.5)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_inference_and_training_paths_agree_bitwise():
    base, lora, g = case()
    with torch.no_grad():
        inference = compose(base, lora, g, 2.0)
    assert torch.equal(inference, compose(base, lora, g, 2.0))


def test_torch_compile_keeps_the_op_in_one_graph():
    base, lora, g = case()

    def f(b, lo, m):
        return (compose(b * 1.0, lo, m, 0.25) ** 2).sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")  # fullgraph: a graph break is an error
    want = torch.autograd.grad(f(base, lora, g), (base, lora, g))
    got = torch.autograd.grad(compiled(base, lora, g), (base, lora, g))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_opcheck():
    base, lora, g = case(dtype=torch.float32)
    torch.library.opcheck(_compose_op, (base, lora, g, 0.5))
    from narrows.dora.compose import _compose_train_op  # tier 1's op, on its eager references here

    torch.library.opcheck(_compose_train_op, (base, lora, g, 0.5))


def test_cpu_and_odd_inputs_take_the_eager_tier(monkeypatch):
    base, lora, g = case()
    assert fused_reason(base, lora, g) == "not on CUDA"
    monkeypatch.setenv("NARROWS_DORA_FUSED", "0")
    assert "NARROWS_DORA_FUSED=0" in fused_reason(base, lora, g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_tier1_references_agree_with_the_eager_formula(dtype):
    """The dual-output forward and the backward from `inner` (the references of tier 1's
    kernels): the same output and activation gradients bit for bit; the magnitude gradient
    from `inner` differs only by `inner`'s rounding to the activation dtype."""
    from narrows.dora.compose import backward_eager, backward_inner_eager, formula, formula_dual

    g0 = torch.Generator().manual_seed(1)
    base = torch.randn(3, 50, 96, generator=g0).to(dtype)
    lora = torch.randn(3, 50, 96, generator=g0).to(dtype)
    g = 1 + 0.01 * torch.randn(96, generator=g0)
    go = torch.randn(3, 50, 96, generator=g0).to(dtype)
    out, inner = formula_dual(base, lora, g, 0.3)
    assert torch.equal(out, formula(base, lora, g, 0.3)) and inner.dtype == dtype
    assert torch.equal(inner, (0.3 * lora.float() + base.float()).to(dtype))
    d_base, d_lora, d_g = backward_inner_eager(go, inner, g, 0.3, dtype)
    e_base, e_lora, _ = backward_eager(go, base, lora, g, 0.3)
    assert torch.equal(d_base, e_base) and torch.equal(d_lora, e_lora)
    ref = (go.double() * (base.double() + 0.3 * lora.double())).sum((0, 1))
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}[dtype]
    torch.testing.assert_close(d_g.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_assemble_norm_is_the_papers_equation():
    from narrows.dora import assemble_norm

    base_sq = torch.tensor([4.0, 1.0, 0.0, float("nan")])
    cross = torch.tensor([0.5, -3.0, 0.0, 0.0])
    ba_sq = torch.tensor([1.0, 0.0, 0.0, 0.0])
    got = assemble_norm(base_sq, cross, ba_sq, 0.5)
    # the root of 4.75 in fp64, rounded once: IEEE's fp32 root on every CPU (Python's libm
    # and PyTorch's fp32 sqrt are not references for it); the negative sum clamps to 0
    want = torch.tensor([4.75, 0.0, 0.0], dtype=torch.float64).sqrt().float()
    assert torch.equal(got[:3], want)
    assert got[3].isnan()  # a NaN is not hidden by the clamp
