"""On CUDA: the Triton kernels against the eager reference, with poisoned outputs."""

from __future__ import annotations

import pytest
import torch

from narrows.dora import compose, fused_reason
from narrows.dora.compose import backward_eager, formula

pytestmark = pytest.mark.gpu

SHAPES = [(1, 64), (37, 1000), (4, 129, 4096), (2, 2048, 3584), (8192, 512)]


def case(shape, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    base = torch.randn(shape, generator=g, device="cuda").to(dtype)
    lora = (torch.randn(shape, generator=g, device="cuda") * 0.1).to(dtype)
    mag = 1 + 0.01 * torch.randn(shape[-1], generator=g, device="cuda")
    return base, lora, mag


def poisoned(like):
    return torch.full_like(like, float("nan"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_kernel_equals_eager_bitwise_and_writes_everything(shape, dtype):
    from narrows.dora.kernels import compose_forward

    base, lora, g = case(shape, dtype)
    out = compose_forward(base, lora, g, 0.37, out=poisoned(base))
    assert not out.isnan().any()
    assert torch.equal(out, formula(base, lora, g, 0.37))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_backward_kernel_against_eager(shape, dtype):
    from narrows.dora.kernels import compose_backward

    base, lora, g = case(shape, dtype)
    grad = torch.randn(shape, device="cuda").to(dtype)
    d_base, d_lora, d_g = compose_backward(grad, base, lora, g, 0.37, outs=(poisoned(base), poisoned(lora)))
    e_base, e_lora, e_g = backward_eager(grad, base, lora, g, 0.37)
    assert not (d_base.isnan().any() or d_lora.isnan().any())
    assert torch.equal(d_base, e_base) and torch.equal(d_lora, e_lora)
    torch.testing.assert_close(d_g, e_g, rtol=1e-5, atol=1e-5 * e_g.abs().max().item())  # summation order


def test_backward_kernel_is_deterministic():
    from narrows.dora.kernels import compose_backward

    base, lora, g = case((4096, 4096), torch.bfloat16)
    grad = torch.randn_like(base)
    first = compose_backward(grad, base, lora, g, 0.5)
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(first, compose_backward(grad, base, lora, g, 0.5)))


def test_dispatch_picks_the_kernels_above_the_crossover_and_autograd_matches_eager(monkeypatch):
    base, lora, g = case((4, 2048, 4096), torch.bfloat16)
    assert fused_reason(base, lora, g, "backward") is None
    assert fused_reason(base[:, :, :64].contiguous(), lora[:, :, :64].contiguous(), g[:64]) is not None
    assert fused_reason(base.transpose(0, 1), lora.transpose(0, 1), g) == "non-contiguous activations"
    leaves = [t.clone().requires_grad_(True) for t in (base, lora, g)]
    out = compose(*leaves, 0.5)
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    monkeypatch.setenv("NARROWS_DORA_FUSED", "0")
    eager = compose(*leaves, 0.5)
    assert torch.equal(out, eager)
    e_grads = torch.autograd.grad(eager, leaves, torch.ones_like(eager))
    assert torch.equal(grads[0], e_grads[0]) and torch.equal(grads[1], e_grads[1])
    # tier 1 sums go·inner with inner rounded to bf16 (relative error ≤ 2^-9 per element):
    # each column's magnitude gradient stays within that rounding summed over the rows
    inner = base.double() + 0.5 * lora.double()
    ref, bound = inner.sum((0, 1)), inner.abs().sum((0, 1)) * 2**-8
    assert ((grads[2].double() - ref).abs() <= bound).all()
    assert ((e_grads[2].double() - ref).abs() <= bound * 1e-2).all()  # eager sums base and lora exactly


MIXED = [
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
]


@pytest.mark.parametrize("dtypes", MIXED)
@pytest.mark.parametrize("shape", SHAPES)
def test_dual_forward_and_inner_backward_kernels_equal_their_references(shape, dtypes):
    from narrows.dora.compose import backward_inner_eager, formula_dual
    from narrows.dora.kernels import compose_backward_inner, compose_forward_dual

    base, lora, g = case(shape, dtypes[0])
    lora = lora.to(dtypes[1])  # PEFT's fp32 adapter beside a bf16 base
    out, inner = compose_forward_dual(base, lora, g, 0.37, outs=(poisoned(base), poisoned(base)))
    e_out, e_inner = formula_dual(base, lora, g, 0.37)
    assert not (out.isnan().any() or inner.isnan().any())
    assert torch.equal(out, e_out) and torch.equal(inner, e_inner)
    grad = torch.randn(shape, device="cuda").to(dtypes[0])
    got = compose_backward_inner(grad, inner, g, 0.37, dtypes[1], outs=(poisoned(base), poisoned(lora)))
    ref = backward_inner_eager(grad, inner, g, 0.37, dtypes[1])
    assert not (got[0].isnan().any() or got[1].isnan().any())
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]) and got[1].dtype == dtypes[1]
    torch.testing.assert_close(got[2], ref[2], rtol=1e-5, atol=1e-5 * ref[2].abs().max().item())


@pytest.mark.parametrize("n", [1, 255, 4096, 18944, 152064])
def test_norm_assembly_kernel_equals_pytorch_bitwise(n):
    """The kernel against the CPU path of `narrows.dora.assemble_norm` itself (fp32 sum, the
    root in fp64 rounded once): which device assembled the norm never shows."""
    from narrows.dora.kernels import assemble_norm
    from narrows.dora.norm import assemble_norm as pytorch_path

    gen = torch.Generator(device="cuda").manual_seed(n)
    base_sq = torch.rand(n, generator=gen, device="cuda") * 50
    cross = torch.randn(n, generator=gen, device="cuda") * 10
    ba_sq = torch.rand(n, generator=gen, device="cuda")
    base_sq[0] = float("nan") if n > 1 else base_sq[0]
    for scale in (0.0625, 2.0, 1 / 3):
        got = assemble_norm(base_sq, cross, ba_sq, scale, out=torch.full_like(base_sq, float("nan")))
        ref = pytorch_path(base_sq.cpu(), cross.cpu(), ba_sq.cpu(), scale).cuda()
        assert torch.equal(got.isnan(), ref.isnan()) and torch.equal(got.nan_to_num(), ref.nan_to_num())


def test_training_tier_saves_one_activation_per_module():
    base, lora, g = case((4, 2048, 4096), torch.bfloat16)
    leaves = [base.requires_grad_(True), lora.requires_grad_(True), g.requires_grad_(True)]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = compose(*leaves, 0.5)
    big = [t for t in saved if t.numel() == base.numel()]
    assert len(big) == 1  # inner, not base and lora
    out.sum().backward()
    assert all(t.grad is not None for t in leaves)


@pytest.mark.parametrize("adapter_dtype", [torch.float32, torch.bfloat16])
def test_norm_on_tensor_cores_matches_the_fp64_reference(adapter_dtype):
    """bf16 W on CUDA: with an fp32 A (split in three bf16 parts) or a bf16 one."""
    from narrows.dora.norm import dense_row_norm, factored_row_norm

    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(3000, 1536, device="cuda", generator=g).to(torch.bfloat16) * 0.02
    a = (torch.randn(384, 1536, device="cuda", generator=g) * 0.02).to(adapter_dtype)
    b = (torch.randn(3000, 384, device="cuda", generator=g) * 0.02).to(adapter_dtype)
    ref = dense_row_norm(w, a, b, 2.0)
    for budget in (1 << 20, 1 << 30):
        got = factored_row_norm(w, a, b, 2.0, chunk_budget=budget)
        torch.testing.assert_close(got.double(), ref, rtol=2e-6, atol=0)


@pytest.mark.parametrize(
    "d_out,d_in,r,w_dtype,a_dtype",
    [
        (3000, 1536, 384, torch.bfloat16, torch.float32),  # the split: PEFT's fp32 adapters on a bf16 base
        (3000, 1536, 384, torch.bfloat16, torch.bfloat16),
        (1000, 700, 96, torch.float16, torch.float16),
        (257, 129, 8, torch.bfloat16, torch.float32),  # nothing a multiple of a block; r below a dot's 16
        (64, 4096, 768, torch.bfloat16, torch.float32),
    ],
)
def test_row_norm_kernel_matches_fp64_writes_every_row_and_repeats_exactly(d_out, d_in, r, w_dtype, a_dtype):
    from narrows.dora.kernels import row_norm
    from narrows.dora.norm import _gram, base_row_norm_sq, dense_row_norm, split_bf16x3

    g = torch.Generator(device="cuda").manual_seed(1)
    w = (torch.randn(d_out, d_in, device="cuda", generator=g) * 0.02).to(w_dtype)
    a = (torch.randn(r, d_in, device="cuda", generator=g) * 0.02).to(a_dtype)
    b = (torch.randn(d_out, r, device="cuda", generator=g) * 0.02).to(a_dtype)
    ref = dense_row_norm(w, a, b, 1.5)
    parts = split_bf16x3(a) if a_dtype == torch.float32 else a
    for base_sq in (None, base_row_norm_sq(w)):
        out = row_norm(w, parts, b, _gram(a), 1.5, base_sq, torch.full((d_out,), float("nan"), device="cuda"))
        assert not out.isnan().any()
        torch.testing.assert_close(out.double(), ref, rtol=2e-6, atol=0)
        again = row_norm(w, parts, b, _gram(a), 1.5, base_sq, torch.empty(d_out, device="cuda"))
        assert torch.equal(out, again)


def test_factored_norm_runs_the_kernel_on_cuda_and_the_chunks_elsewhere(monkeypatch):
    import narrows.dora.kernels as kernels
    from narrows.dora.norm import _kernel_reason, factored_row_norm

    calls = []
    real = kernels.row_norm
    monkeypatch.setattr(kernels, "row_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    w = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    a, b = torch.randn(16, 256, device="cuda"), torch.randn(512, 16, device="cuda")
    fused = factored_row_norm(w, a, b, 0.5)
    assert calls == [1]
    monkeypatch.setenv("NARROWS_DORA_FUSED", "0")
    assert _kernel_reason(w.dtype, a, b) == "turned off by NARROWS_DORA_FUSED=0"
    eager = factored_row_norm(w, a, b, 0.5)
    assert calls == [1]
    torch.testing.assert_close(fused, eager, rtol=2e-6, atol=0)
    assert _kernel_reason(torch.float16, a, b) is not None  # fp16 W with an fp32 A: chunks


@pytest.mark.parametrize("split", [True, False])
def test_every_row_norm_config_is_right(split):
    """The autotuner may pick any configuration: each one, with ||W||² in the pass and cached."""
    import triton

    from narrows.dora import kernels
    from narrows.dora.norm import _gram, base_row_norm_sq, dense_row_norm, split_bf16x3

    g = torch.Generator(device="cuda").manual_seed(2)
    d_out, d_in, r = 300, 1100, 160
    w = (torch.randn(d_out, d_in, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    a = torch.randn(r, d_in, device="cuda", generator=g) * 0.02
    b = torch.randn(d_out, r, device="cuda", generator=g) * 0.02
    if not split:
        a = a.to(torch.bfloat16)
    parts = split_bf16x3(a) if split else a
    ref = dense_row_norm(w, a, b, 1.5)
    for cfg in kernels._ROW_NORM_CONFIGS:
        for cached in (False, True):
            out = torch.full((d_out,), float("nan"), device="cuda")
            base = base_row_norm_sq(w) if cached else out
            kernels._row_norm_kernel.fn[(triton.cdiv(d_out, cfg.kwargs["BLOCK_M"]),)](
                w,
                parts,
                b,
                _gram(a),
                base,
                out,
                d_out,
                d_in,
                r,
                512,
                w.stride(0),
                3.0,
                2.25,
                SPLIT=split,
                NEED_BASE=not cached,
                num_warps=cfg.num_warps,
                num_stages=cfg.num_stages,
                enable_fp_fusion=False,
                **cfg.kwargs,
            )
            torch.testing.assert_close(out.double(), ref, rtol=2e-6, atol=0, msg=f"{cfg} cached={cached}")
