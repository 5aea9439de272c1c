"""Fast decoder layers (`narrows.core.fuse_layers`): the same training with and without
recompute, bit for bit (dropout included, through the RNG replay); close to PEFT in
float32; in bf16 no further from a float64 reference than PEFT's own bf16 path; NF4
weights dequantised twice a step, not three times; uncovered layers and calls refused
with their reason or left to their own forward. Each claim has a twin that would show
it broken."""

from __future__ import annotations

import contextlib

import pytest
import torch

import narrows.core.fastlayer.fuse as fuse
from narrows.core import fuse_layers, quantize_nf4, unfuse_layers
from narrows.core.fastlayer import ops, why_not
from narrows.core.testing import tiny_batch, tiny_model, with_adapter

FAMILY = ("llama", "qwen2", "qwen3", "mistral")


def _sdpa(model):
    for m in model.modules():
        if hasattr(m, "config"):
            m.config._attn_implementation = "sdpa"
    return model


def _model(arch="llama", dtype=torch.float32, dropout=0.0, base="float", adapter_dtype=None, device="cpu"):
    model = _sdpa(tiny_model(arch, dtype=dtype))
    if base == "nf4":
        model = quantize_nf4(model)
    model = with_adapter(model, "lora", dropout=dropout).train().to(device)
    model.config.use_cache = False
    if adapter_dtype is not None:
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(adapter_dtype)
    return model


def _steps(model, n=2, seed=0, device="cpu", pad_last=3):
    """Losses of `n` micro-batches, then every adapter gradient accumulated."""
    torch.manual_seed(seed)
    for p in model.parameters():
        p.grad = None
    losses = []
    for i in range(n):
        batch = {k: v.to(device) for k, v in tiny_batch(seed=i + 1, pad_last=pad_last).items()}
        loss = model(**batch).loss
        (loss / n).backward()
        losses.append(loss.detach())
    return losses + [p.grad.clone() for p in model.parameters() if p.requires_grad]


def _equal(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _close(a, b, rtol, atol) -> bool:
    return len(a) == len(b) and all(torch.allclose(x, y, rtol=rtol, atol=atol) for x, y in zip(a, b))


@pytest.mark.parametrize("arch", FAMILY)
def test_fast_layers_train_what_peft_trains_in_float32(arch):
    model = _model(arch)
    peft = _steps(model)
    report = fuse_layers(model)
    assert report.fused == [0, 1, 2] and not report.refused
    fast = _steps(model)
    assert _close(peft, fast, rtol=1e-4, atol=1e-6)
    assert not _equal(peft, fast)  # its own kernels: close, not PEFT's bits
    assert unfuse_layers(model) == 3
    assert _equal(_steps(model), peft)


def test_a_dropped_adapter_gradient_would_show():
    model = _model("qwen2")
    fuse_layers(model)
    good = _steps(model)
    original = fuse.compute.backward

    def lose_down(parts, saved, grad, cache=None):
        g_x, grads = original(parts, saved, grad, cache)
        return g_x, [*grads[:-1], torch.zeros_like(grads[-1])]

    fuse.compute.backward = lose_down
    try:
        assert not _close(good, _steps(model), rtol=1e-3, atol=1e-5)
    finally:
        fuse.compute.backward = original


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_recompute_trains_the_same_bits_as_keeping(arch, dropout):
    model = _model(arch, dtype=torch.bfloat16, dropout=dropout, adapter_dtype=torch.float32)
    fuse_layers(model, recompute=False)
    kept = _steps(model, seed=3)
    fuse_layers(model, recompute=True)
    assert _equal(_steps(model, seed=3), kept)


def test_dropout_masks_come_from_the_replayed_rng(monkeypatch):
    """Without the replay the recompute draws new masks: the gradients change."""
    model = _model("llama", dropout=0.1)
    fuse_layers(model, recompute=False)
    kept = _steps(model, seed=3)
    fuse_layers(model, recompute=True)
    with monkeypatch.context() as m:
        m.setattr(
            fuse._Rng, "replay", lambda self: contextlib.nullcontext()
        )  # from wherever the generator is
        drifted = _steps(model, seed=3)
    assert torch.equal(drifted[0], kept[0]) and not _equal(drifted[2:], kept[2:])
    assert _equal(_steps(model, seed=3), kept)


def test_dropout_changes_the_training():
    model = _model("llama", dropout=0.1)
    fuse_layers(model)
    on = _steps(model, seed=3)
    model.eval()  # PEFT's dropout off
    for p in model.parameters():
        p.grad = None
    off = _steps(model, seed=3)
    assert not _equal(on, off)


def _bf16_error(arch, fuse_it: bool) -> float:
    """Largest relative error (norm) of a bf16 step's adapter gradients and loss against
    the same weights in float64."""
    ref_model = _model(arch, dtype=torch.bfloat16).to(torch.float64)
    ref = _steps(ref_model, pad_last=0)
    model = _model(arch, dtype=torch.bfloat16, adapter_dtype=torch.float32)
    if fuse_it:
        fuse_layers(model)
    got = _steps(model, pad_last=0)
    return max(((r.double() - g.double()).norm() / r.double().norm()).item() for r, g in zip(ref, got))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_bf16_error_is_no_worse_than_pefts(arch):
    peft, fast = _bf16_error(arch, False), _bf16_error(arch, True)
    assert 0 < fast <= 1.5 * peft, (fast, peft)


@pytest.mark.bnb
def test_nf4_weights_are_dequantised_twice_a_step_when_recomputing(monkeypatch):
    import bitsandbytes.functional as bf

    model = _model("llama", base="nf4")
    calls = []
    original = bf.dequantize_4bit
    monkeypatch.setattr(bf, "dequantize_4bit", lambda *a, **k: calls.append(1) or original(*a, **k))
    peft = _steps(model, n=1)
    fuse_layers(model, recompute=True)
    calls.clear()
    fast = _steps(model, n=1)
    assert len(calls) == 2 * 7 * 3  # forward + (recompute and backward) for 7 linears, 3 layers
    assert _close(peft, fast, rtol=1e-3, atol=1e-5)


def test_ops_match_autograd_of_their_references():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, dtype=torch.float64)
    g = torch.randn(3, 5, 16, dtype=torch.float64)
    y, rstd = ops.rms_norm(x, w, 1e-6)
    (gx,) = torch.autograd.grad(y, x, g)
    assert torch.allclose(ops.rms_norm_backward(g, x.detach(), w, rstd.detach()), gx)
    cos, sin = torch.randn(5, 16, dtype=torch.float64), torch.randn(5, 16, dtype=torch.float64)
    (gx,) = torch.autograd.grad(ops.rope(x, cos, sin), x, g)
    assert torch.allclose(ops.rope_backward(g, cos, sin), gx)
    up = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    (ga, gu) = torch.autograd.grad(ops.swiglu(x, up), (x, up), g)
    da, du = ops.swiglu_backward(g, x.detach(), up.detach())
    assert torch.allclose(da, ga) and torch.allclose(du, gu)


def test_uncovered_layers_and_adapters_are_refused_with_their_reason():
    eager = with_adapter(tiny_model("llama"), "lora")
    assert "attn_implementation='sdpa'" in fuse_layers(eager).refused[0]
    gemma = with_adapter(_sdpa(tiny_model("gemma2")), "lora")
    report = fuse_layers(gemma)
    assert not report.fused and "Gemma2DecoderLayer" in report.refused[0]
    assert "the others run as before" in str(report)
    dora = with_adapter(_sdpa(tiny_model("llama")), "dora")
    assert "DoRA" in why_not(dora.base_model.model.model.layers[0])
    hooked = _model("llama")
    hooked.base_model.model.model.layers[1].mlp.register_forward_hook(lambda *a: None)
    assert fuse_layers(hooked).refused == {1: "its attention or its MLP has hooks or a replaced forward"}


def test_a_kv_cache_is_filled_and_decoding_runs_the_layers_own_forward():
    model = _model("qwen2").eval()
    ids = tiny_batch(batch=1, pad_last=0)["input_ids"]
    with torch.no_grad():
        plain = model.generate(ids, max_new_tokens=5, do_sample=False, use_cache=True)
        fuse_layers(model)
        fast = model.generate(ids, max_new_tokens=5, do_sample=False, use_cache=True)
    assert torch.equal(plain, fast)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_cuda_recompute_trains_the_same_bits_as_keeping(arch, dropout):
    from narrows.core.determinism import deterministic

    deterministic(True)
    try:
        model = _model(
            arch, dtype=torch.bfloat16, dropout=dropout, adapter_dtype=torch.float32, device="cuda"
        )
        fuse_layers(model, recompute=False)
        kept = _steps(model, seed=3, device="cuda")
        fuse_layers(model, recompute=True)
        assert _equal(_steps(model, seed=3, device="cuda"), kept)
        assert all(t.dtype == torch.float32 for t in kept[2:])
    finally:
        deterministic(False)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_cuda_bf16_error_is_no_worse_than_pefts(arch):
    def error(fuse_it):
        ref = _steps(_model(arch, dtype=torch.bfloat16).to(torch.float64).cuda(), device="cuda", pad_last=0)
        model = _model(arch, dtype=torch.bfloat16, adapter_dtype=torch.float32, device="cuda")
        if fuse_it:
            fuse_layers(model)
        got = _steps(model, device="cuda", pad_last=0)
        return max(((r - g.double()).norm() / r.norm()).item() for r, g in zip(ref, got))

    peft, fast = error(False), error(True)
    assert 0 < fast <= 1.5 * peft, (fast, peft)


@pytest.mark.gpu
def test_cuda_library_kernels_match_the_references():
    """Where Liger-Kernel is installed its RMSNorm and SwiGLU run on CUDA; each matches the
    float64 reference no worse than the PyTorch reference in bf16 does (plus one ulp)."""
    torch.manual_seed(0)
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    used = ops.kernels_in_use("cuda")
    y, st = ops.rms_norm(x, w, 1e-6)
    dx = ops.rms_norm_backward(g, x, w, st)
    y64, r64 = ops.rms_norm(x.double(), w.double(), 1e-6)
    dx64 = ops.rms_norm_backward(g.double(), x.double(), w.double(), r64)
    up = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    a = ops.swiglu(x, up)
    da, du = ops.swiglu_backward(g, x, up)
    a64 = ops.swiglu(x.double(), up.double())
    da64, du64 = ops.swiglu_backward(g.double(), x.double(), up.double())
    for got, ref in ((y, y64), (dx, dx64), (a, a64), (da, da64), (du, du64)):
        assert ((got.double() - ref).abs() <= ref.abs() * 2**-7 + 1e-2).all()
    assert set(used.values()) <= {"liger", "torch"}


def test_checkpointing_turned_on_after_fusing_recomputes(monkeypatch):
    """The model's gradient checkpointing is read at each call: on after `fuse_layers`, the
    layers recompute (same bits); off again, they keep."""
    model = _model("llama", dtype=torch.bfloat16, adapter_dtype=torch.float32)
    fuse_layers(model)
    kept = _steps(model)
    calls = []
    real = fuse.compute.recompute
    monkeypatch.setattr(fuse.compute, "recompute", lambda *a, **k: calls.append(1) or real(*a, **k))
    model.gradient_checkpointing_enable()
    assert _equal(_steps(model), kept) and len(calls) == 2 * 3
    model.gradient_checkpointing_disable()
    calls.clear()
    assert _equal(_steps(model), kept) and not calls


def _tile_mlps(model, tokens: int):
    """What `narrows.stream.tile_sequence` leaves on each MLP: a forward that says its tile."""
    for layer in model.base_model.model.model.layers:

        def forward(x, _orig=layer.mlp.forward):
            return _orig(x)

        forward.narrows_tile_tokens = tokens
        layer.mlp.forward = forward
    return model


@pytest.mark.parametrize("recompute", [False, True])
def test_an_mlp_in_sequence_tiles_trains_as_untiled_up_to_summation_order(recompute):
    untiled = _model("qwen2")
    fuse_layers(untiled, recompute=recompute)
    tiled = _tile_mlps(_model("qwen2"), 10)  # 2 rows of 12: 5 positions a tile, then 5, then 2
    assert not fuse_layers(tiled, recompute=recompute).refused
    parts = fuse.parts_or_none(tiled.base_model.model.model.layers[0])
    assert parts.mlp_tiles(2, 12) == [slice(0, 5), slice(5, 10), slice(10, 12)]
    a, b = _steps(untiled, pad_last=0), _steps(tiled, pad_last=0)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)
    assert not _equal(a, b)  # the tiles ran: the adapters' gradients are sums over them


def test_a_tiled_mlp_with_dropout_is_refused_by_name():
    model = _tile_mlps(_model("llama", dropout=0.1), 8)
    assert "sequence tiles with LoRA dropout" in fuse_layers(model).refused[0]
