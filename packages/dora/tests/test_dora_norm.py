"""The factored row norm against the dense fp64 reference and PEFT's own DoRA norm."""

import pytest
import torch

from narrows.dora.norm import assemble_norm, base_row_norm_sq, dense_row_norm, factored_row_norm


def mats(d_out, d_in, r, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(d_out, d_in, generator=g).to(dtype)
    a = (torch.randn(r, d_in, generator=g) / d_in**0.5).to(dtype)
    b = (torch.randn(d_out, r, generator=g) * 0.1).to(dtype)
    return w, a, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(48, 80, 4), (130, 300, 16), (64, 256, 96)])
@pytest.mark.parametrize("budget", [64 * 4 * 130, 1 << 20])  # several chunks, one chunk
def test_matches_the_dense_fp64_norm(dtype, shape, budget):
    w, a, b = mats(*shape, dtype)
    ours = factored_row_norm(w, a, b, 0.7, chunk_budget=budget)
    ref = dense_row_norm(w, a, b, 0.7)
    assert ours.dtype == torch.float32 and ours.shape == (shape[0],)
    torch.testing.assert_close(ours.double(), ref, rtol=2e-6, atol=1e-6)


def test_rank_768_and_cached_base_and_zero_scale():
    w, a, b = mats(96, 1024, 768, torch.float32)
    base = base_row_norm_sq(w, chunk_budget=96 * 4 * 128)
    torch.testing.assert_close(
        factored_row_norm(w, a, b, 2.0, base_sq=base).double(),
        dense_row_norm(w, a, b, 2.0),
        rtol=2e-6,
        atol=1e-6,
    )
    assert torch.equal(factored_row_norm(w, a, b, 0.0, base_sq=base), base.double().sqrt().float())
    torch.testing.assert_close(
        factored_row_norm(w, a, b, 0.0).double(), w.double().norm(dim=1), rtol=2e-6, atol=1e-6
    )


def test_no_gradient_flows_through_the_norm():
    w, a, b = mats(16, 32, 4, torch.float32)
    a.requires_grad_(True)
    assert not factored_row_norm(w, a, b, 1.0).requires_grad


def test_agrees_with_peft_dora_norm():
    peft_dora = pytest.importorskip("peft.tuners.lora.dora")
    w, a, b = mats(40, 72, 8, torch.float32)
    layer = peft_dora.DoraLinearLayer(fan_in_fan_out=False)
    lora_weight = b @ a
    peft_norm = layer.get_weight_norm(w, lora_weight, scaling=0.5)
    torch.testing.assert_close(factored_row_norm(w, a, b, 0.5), peft_norm, rtol=1e-5, atol=1e-5)


def test_the_bf16_split_of_an_fp32_adapter_is_exact():
    from narrows.dora.norm import split_bf16x3

    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 300, generator=g) * torch.logspace(-6, 2, 300)  # many magnitudes
    parts = split_bf16x3(a)
    assert parts.dtype == torch.bfloat16 and parts.shape == (192, 300)
    hi, mid, lo = parts.double().chunk(3)
    assert torch.equal(hi + mid + lo, a.double())
    assert (hi + mid != a.double()).any()  # all three parts are needed


def awkward_squares() -> torch.Tensor:
    """fp32 values whose roots are easy to misround: 4.75 (PyTorch's fp32 sqrt gives it one
    ulp low on an AVX2 AMD EPYC), exact squares, subnormals, the largest finite fp32, and
    random values over sixty decades."""
    g = torch.Generator().manual_seed(0)
    spread = torch.rand(4096, generator=g) * torch.logspace(-30, 30, 4096)
    return torch.cat([torch.tensor([4.75, 4.0, 2.0, 1e-45, 1e-40, torch.finfo().max, 0.0]), spread])


def test_assemble_norm_takes_the_correctly_rounded_root():
    """The PyTorch path must round √ as IEEE (and the kernel's sqrt_rn) does on every CPU, so
    it is pinned to the root taken in fp64 and rounded once, not to PyTorch's fp32 sqrt (wrong
    on some CPUs). Checked without any sqrt as well: each x > 0 lies strictly between the
    squares of the fp32 midpoints around its root, squares that fp64 holds exactly."""
    x = awkward_squares()
    zeros = torch.zeros_like(x)
    got = assemble_norm(x, zeros, zeros, 0.5)  # x + 1·0 + 0.25·0 == x exactly
    assert torch.equal(got, x.double().sqrt().float())
    assert got[0].item() == float.fromhex("0x1.16f834p+1")
    below = (got.double() + torch.nextafter(got, torch.tensor(0.0)).double()) / 2
    above = (got.double() + torch.nextafter(got, torch.tensor(float("inf"))).double()) / 2
    positive = x > 0
    assert (below.square() < x.double())[positive].all() and (x.double() < above.square())[positive].all()
