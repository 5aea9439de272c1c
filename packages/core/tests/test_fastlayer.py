"""Fast decoder layers (`narrows.core.fuse_layers`): the same training with and without
recompute, bit for bit (dropout included, through the RNG replay); close to PEFT in
float32; in bf16 no further from a float64 reference than PEFT's own bf16 path; NF4
weights dequantised twice a step, not three times; uncovered layers and calls refused
with their reason or left to their own forward. Each claim has a twin that would show
it broken."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

import narrows.core.kernels.fastlayer.fuse as fuse
import narrows.core.kernels.rng as rng
from narrows.core import fuse_layers, quantize_nf4, unfuse_layers
from narrows.core.kernels.fastlayer import FastLayer, adapter_math, compute, ops, why_not
from narrows.core.kernels.fastlayer.lora import Masks
from narrows.core.testing import tiny_batch, tiny_model, with_adapter

FAMILY = ("llama", "qwen2", "qwen3", "mistral")


def _sdpa(model):
    for m in model.modules():
        if hasattr(m, "config"):
            m.config._attn_implementation = "sdpa"
    return model


def _model(
    arch="llama", dtype=torch.float32, dropout=0.0, base="float", adapter_dtype=None, device="cpu", seed=0
):
    model = _sdpa(tiny_model(arch, dtype=dtype, seed=seed))
    if base == "nf4":
        model = quantize_nf4(model)
    model = with_adapter(model, "lora", dropout=dropout, seed=seed).train().to(device)
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
    original = compute.backward

    def lose_down(parts, saved, grad, cache=None):
        g_x, grads = original(parts, saved, grad, cache)
        return g_x, [*grads[:-1], torch.zeros_like(grads[-1])]

    compute.backward = lose_down
    try:
        assert not _close(good, _steps(model), rtol=1e-3, atol=1e-5)
    finally:
        compute.backward = original


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
        m.setattr(rng, "replay", lambda state: contextlib.nullcontext())  # from wherever the generator is
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


@pytest.mark.bnb
@pytest.mark.parametrize("arch", FAMILY)
def test_nf4_fast_layers_with_stacked_weights_train_what_peft_trains(arch):
    """On a 4-bit base Q/K/V and gate/up run stacked (Qwen2's biases with them, Qwen3's
    per-head norms after them): close to PEFT in float32; with dropout, keeping and
    recomputing train the same bits."""
    model = _random_biases(_model(arch, base="nf4"))
    peft = _steps(model)
    assert not fuse_layers(model).refused
    parts = fuse.parts_or_none(model.base_model.model.model.layers[0])
    assert parts.qkv.stacked and parts.gate_up.stacked
    assert (arch == "qwen2") == all(p.bias is not None for p in parts.qkv.linears)
    assert _close(peft, _steps(model), rtol=1e-3, atol=1e-5)
    dropped = _random_biases(_model(arch, base="nf4", dropout=0.1))
    fuse_layers(dropped, recompute=False)
    kept = _steps(dropped, seed=3)
    fuse_layers(dropped, recompute=True)
    assert _equal(_steps(dropped, seed=3), kept)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_dropout_masks_are_bool_draws_applied_with_one_rounding(dtype):
    """A group's masks are bool, drawn by dropout's own kernel (on the CPU: `bernoulli_` in
    the input's dtype, PEFT's draws for adapters in that dtype), and a dropped-out tensor is ``(t · mask) ·
    (1/keep)``, the product rounded once — not `t` times a 1/keep rounded to `t`'s dtype."""
    model = _model("llama", dropout=0.3)
    fuse_layers(model)
    group = fuse.parts_or_none(model.base_model.model.model.layers[0]).qkv
    n = torch.randn(64, group.linears[0].weight.shape[1], dtype=dtype)
    torch.manual_seed(5)
    masks = group.masks(n)
    torch.manual_seed(5)
    draws = [torch.empty_like(n).bernoulli_(0.7) for _ in masks]
    assert all(m.dtype == torch.bool and torch.equal(m.to(dtype), d) for m, d in zip(masks, draws))
    p = group.linears[0]
    got = adapter_math.dropped(n, masks[0], p)
    assert torch.equal(got, (n * draws[0]).mul_(1 / 0.7))
    if dtype == torch.bfloat16:
        assert not torch.equal(got, n * (draws[0] / 0.7))  # the scale rounded first: other bits


def test_the_forward_reads_a_dropped_out_input_once_with_droppeds_bits():
    """The forward's adapters compute on ``dropped(n, mask)``: on the CPU they compute it
    (the CPU's dropout output is rounded twice in bf16, other bits); where the draws'
    outputs ride along they read them, and let them go once read, so a group's state
    keeps the masks alone."""
    model = _model("llama", dropout=0.3)
    fuse_layers(model)
    group = fuse.parts_or_none(model.base_model.model.model.layers[0]).qkv
    n = torch.randn(64, group.linears[0].weight.shape[1], dtype=torch.bfloat16)
    torch.manual_seed(5)
    masks = group.masks(n)
    assert masks.outs is None  # nothing rides along on the CPU
    with torch.no_grad():
        _, state = group.forward(n, masks)
        for p, h, m in zip(group.linears, state.h, state.masks):
            assert torch.equal(h, adapter_math.dropped(n, m, p).mm(p.a.to(n.dtype).t()))
    assert type(state.masks) is list
    torch.manual_seed(5)
    draws = [torch.native_dropout(n, 0.3, True)[0] for _ in masks]  # the CPU kernel's own output
    assert not all(torch.equal(d, adapter_math.dropped(n, m, group.linears[0])) for d, m in zip(draws, masks))
    # where outputs ride along (CUDA) the forward reads them, and computes those that do not
    cuda_like = Masks(list(masks), [torch.zeros_like(n), None, None])
    with torch.no_grad():
        _, again = group.forward(n, cuda_like)
    assert cuda_like.outs is None and not again.h[0].any()
    assert all(torch.equal(a, b) for a, b in zip(again.h[1:], state.h[1:]))


@pytest.mark.bnb
def test_a_stacked_group_with_dropout_computes_what_each_adapter_would():
    """With dropout a stacked group runs each adapter on its own dropped-out input (one
    base matmul on the stacked weights). Its outputs, input gradient and adapter gradients
    match a float64 computation of each linear on its own with the same masks (a mask given
    to the wrong adapter, a lost 1/keep or a gradient of the wrong adapter would not).
    Running B's side as one matmul there (as without dropout) measured no faster on the
    H100 (an A/B kept in git history)."""
    model = _model("llama", base="nf4", dropout=0.25)
    assert not fuse_layers(model).refused
    group = fuse.parts_or_none(model.base_model.model.model.layers[0]).qkv
    assert group.stacked and group.dropout and not group.blocked
    torch.manual_seed(0)
    n = torch.randn(10, group.linears[0].weight.shape[1])
    masks = group.masks(n)
    assert all(m is not None for m in masks) and not torch.equal(masks[0], masks[1])
    grads = [torch.randn(n.shape[0], w) for w in group.widths]
    with torch.no_grad():
        outs, state = group.forward(n, masks)
        g_n, p_grads = group.backward(grads, state)
    x = n.double().requires_grad_()
    leaves, ref_outs = [], []
    for p, m in zip(group.linears, masks):
        a, b = (t.detach().double().requires_grad_() for t in (p.a, p.b))
        leaves += [a, b]
        dropped = x * m.double() / (1 - p.dropout)
        ref_outs.append(x @ p.weight(n).double().t() + p.scaling * (dropped @ a.t()) @ b.t())
    ref_grads = torch.autograd.grad(
        sum((o * g.double()).sum() for o, g in zip(ref_outs, grads)), [x, *leaves]
    )
    for got, ref in zip([*outs, g_n, *p_grads], [*ref_outs, *ref_grads]):
        assert got.shape == ref.shape and torch.allclose(got.double(), ref.detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.bnb
def test_stacked_groups_run_their_adapters_as_one_where_they_share_a_scale():
    """A stacked 4-bit group whose adapters share one scale runs them as one matmul on a
    block-diagonal B (`blocked`), also where some linears of the group have no adapter
    (Q and V adapted, K not); a group with two scales (Q's rank differs) keeps one matmul
    per adapter. Either way: close to PEFT in float32."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = quantize_nf4(_sdpa(tiny_model("llama")))
    cfg = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj"],
        rank_pattern={"gate_proj": 2},
        alpha_pattern={"gate_proj": 2},
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, cfg).train()
    model.config.use_cache = False
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    peft = _steps(model)
    assert not fuse_layers(model).refused
    parts = fuse.parts_or_none(model.base_model.model.model.layers[0])
    assert parts.qkv.blocked and [p.a is not None for p in parts.qkv.linears] == [True, False, True]
    assert not parts.gate_up.blocked  # gate's scale is 1, up's 2
    assert _close(peft, _steps(model), rtol=1e-3, atol=1e-5)
    with torch.no_grad():  # no tokens (empty tensors have no address to lie side by side at)
        n0 = torch.zeros(0, parts.qkv.linears[0].weight.shape[1])
        outs, _ = parts.qkv.forward(n0, parts.qkv.masks(n0))
    assert [tuple(o.shape) for o in outs] == [(0, w) for w in parts.qkv.widths]


def test_float32_lora_gives_the_adapters_float32_precision():
    """``lora_dtype=torch.float32``: one group's adapter gradients and output against a
    float64 computation on the same (bf16) input, weight and gradient are far more precise
    than with LoRA in bf16; through `fuse_layers` keeping and recomputing (with dropout)
    train the same bits, the report says so, and another dtype is refused."""
    from narrows.core.kernels.fastlayer import LinearGroup

    torch.manual_seed(0)
    model = _model("llama", dtype=torch.bfloat16, adapter_dtype=torch.float32)
    (lin,) = fuse.parts_or_none(model.base_model.model.model.layers[0]).o.linears
    torch.nn.init.normal_(lin.b, std=0.1)  # B starts at zero: its product would vanish
    n = torch.randn(96, lin.weight.shape[1]).to(torch.bfloat16)
    g = torch.randn(96, lin.weight.shape[0]).to(torch.bfloat16)
    n64, g64, w64 = n.double(), g.double(), lin.weight(n).double()
    a64, b64, s = lin.a.double(), lin.b.double(), lin.scaling

    def error(lora_dtype, dropout):
        group = LinearGroup([dataclasses.replace(lin, dropout=dropout)], lora_dtype)
        torch.manual_seed(1)
        masks = group.masks(n)
        keep = 1.0 if masks[0] is None else masks[0].double() / (1 - dropout)  # the exact scale
        d64 = n64 * keep  # the adapter's input, dropped out
        want_out = n64 @ w64.t() + s * (d64 @ a64.t()) @ b64.t()
        want = [s * ((g64 @ b64).t() @ d64), s * (g64.t() @ (d64 @ a64.t()))]  # A's, B's gradients
        (out,), state = group.forward(n, masks)
        _, grads = group.backward([g], state)
        got = [out, *grads]
        return [((x.double() - y).norm() / y.norm()).item() for x, y in zip(got, [want_out, *want])]

    for dropout in (0.0, 0.1):  # with dropout too: the mask's 1/keep is not rounded to bf16
        wide, low = error(torch.float32, dropout), error(None, dropout)
        assert wide[0] <= low[0]  # the output: rounded to bf16 either way
        assert all(w < b / 50 for w, b in zip(wide[1:], low[1:])), (dropout, wide, low)
    report = fuse_layers(model, lora_dtype=torch.float32)
    assert "LoRA in float32" in str(report)
    dropped = _model("llama", dtype=torch.bfloat16, dropout=0.1, adapter_dtype=torch.float32)
    fuse_layers(dropped, recompute=False, lora_dtype=torch.float32)
    kept = _steps(dropped, seed=3)
    fuse_layers(dropped, recompute=True, lora_dtype=torch.float32)
    assert _equal(_steps(dropped, seed=3), kept)
    fuse_layers(dropped, recompute=True)
    assert not _equal(_steps(dropped, seed=3), kept)  # bf16 LoRA: other bits
    unfuse_layers(dropped)
    assert all(FastLayer.of(layer).lora_dtype is None for layer in dropped.base_model.model.model.layers)
    with pytest.raises(ValueError, match="lora_dtype"):
        fuse_layers(_model("llama"), lora_dtype=torch.float16)


def _random_biases(model):
    """Non-zero biases where the model has them (a fresh model's are zero: a bias dropped
    would not show)."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") and "lora_" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model


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


def test_a_dropout_of_one_runs_the_layers_own_forward():
    """PEFT trains with ``lora_dropout=1.0`` (every adapter's branch zero); the fast layer's
    inverted dropout would divide by zero, so it names the reason and PEFT's forward runs."""
    model = _model("llama", dropout=1.0)
    peft = _steps(model)
    report = fuse_layers(model)
    assert not report.fused and all(
        "dropout is 1: it drops every input" in r for r in report.refused.values()
    )
    assert _equal(peft, _steps(model))


@pytest.mark.parametrize("where", ["call", "config", "module"])
def test_bidirectional_attention_runs_the_layers_own_forward(where):
    """``is_causal=False`` (transformers' bidirectional attention: a call's keyword, the
    config's, or a layer's attention module's), with no padding mask to follow: the fast
    layer, causal, would compute something else; the layer's own forward runs instead."""
    model = _model("llama")
    extra = {"is_causal": False} if where == "call" else {}
    if where == "config":
        model.config.is_causal = False
    if where == "module":
        for layer in model.base_model.model.model.layers:
            layer.self_attn.is_causal = False

    def steps():
        for p in model.parameters():
            p.grad = None
        loss = model(**tiny_batch(pad_last=0), **extra).loss
        loss.backward()
        return [loss.detach(), *(p.grad.clone() for p in model.parameters() if p.requires_grad)]

    peft = steps()
    report = fuse_layers(model)
    if where != "call":
        assert all("bidirectional" in r for r in report.refused.values()) and not report.fused
    assert _close(peft, steps(), rtol=1e-5, atol=1e-7)


def test_a_kv_cache_is_filled_and_decoding_runs_the_layers_own_forward():
    model = _model("qwen2").eval()
    ids = tiny_batch(batch=1, pad_last=0)["input_ids"]
    with torch.no_grad():
        plain = model.generate(ids, max_new_tokens=5, do_sample=False, use_cache=True)
        fuse_layers(model)
        fast = model.generate(ids, max_new_tokens=5, do_sample=False, use_cache=True)
    assert torch.equal(plain, fast)


@pytest.mark.gpu
def test_cuda_dropout_masks_are_pefts_draws():
    """On CUDA a group's masks are the fused dropout kernel's, as PEFT's `nn.Dropout` draws
    them from the same generator state for an input in the activations' dtype (PEFT's
    float32 adapters drop out a float32 copy: the kernel's vector width differs, and so do
    the masks), and a dropped-out input has that dropout's bits."""
    model = _model("llama", dropout=0.3, device="cuda")
    fuse_layers(model)
    group = fuse.parts_or_none(model.base_model.model.model.layers[0]).qkv
    n = torch.randn(512, group.linears[0].weight.shape[1], device="cuda", dtype=torch.bfloat16)
    torch.manual_seed(5)
    masks = group.masks(n)
    torch.manual_seed(5)
    peft = [torch.nn.functional.dropout(n, 0.3, training=True) for _ in masks]
    assert all(torch.equal(m, d != 0) for m, d in zip(masks, peft))
    assert all(torch.equal(adapter_math.dropped(n, m, group.linears[0]), d) for m, d in zip(masks, peft))
    # the forward's adapters read the draws' own outputs: the bits `dropped` gives the backward,
    # at a width with a tail past the kernel's vectors too
    for rows in (512, 517):
        n = torch.randn(rows, n.shape[1] - 3, device="cuda", dtype=torch.bfloat16)
        masks = group.masks(n)
        assert len(masks.outs) == 3 and all(o is not None for o in masks.outs)
        assert all(
            torch.equal(adapter_math.dropped(n, m, group.linears[0]), o) for m, o in zip(masks, masks.outs)
        )


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_cuda_recompute_trains_the_same_bits_as_keeping(arch, dropout):
    from narrows.core.protocol.determinism import deterministic

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
    """The worst relative error (losses, every adapter gradient) against float64, fast
    layers over PEFT's bf16 path, averaged over four seeded models: one seed's worst of 44
    tensors is a noisy statistic. These tiny adapters' outputs are as large as the base's
    (random B), where rounding the adapter's product before the base is added onto it
    (`adapter_math.adapter_then_base`) costs as much as rounding the base first: on the H100,
    Qwen2's ratios over seeds 0-3 were 1.53, 1.13, 0.97, 1.45 that way, and 1.09, 1.24,
    1.14, 1.02 base first. A real shape's layer, whose adapters are small beside the base,
    is measured in `benchmarks/fast_accuracy.py` (worst ratio 1.05)."""

    def error(fuse_it, seed):
        ref = _steps(
            _model(arch, dtype=torch.bfloat16, seed=seed).to(torch.float64).cuda(), device="cuda", pad_last=0
        )
        model = _model(arch, dtype=torch.bfloat16, adapter_dtype=torch.float32, device="cuda", seed=seed)
        if fuse_it:
            fuse_layers(model)
        got = _steps(model, device="cuda", pad_last=0)
        return max(((r - g.double()).norm() / r.norm()).item() for r, g in zip(ref, got))

    ratios = [error(True, seed) / error(False, seed) for seed in range(4)]
    assert all(r > 0 for r in ratios) and sum(ratios) / len(ratios) <= 1.5, ratios


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
    q = torch.randn(2, 4, 32, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 2, 32, 64, device="cuda", dtype=torch.bfloat16)
    half = torch.randn(2, 32, 32, device="cuda")  # tables as the family builds them: cat(freqs, freqs)
    cos, sin = torch.cat([half.cos(), half.cos()], -1), torch.cat([half.sin(), half.sin()], -1)
    cos, sin = cos.to(torch.bfloat16), sin.to(torch.bfloat16)
    rq, rk = ops.rope_pair(q.clone(), k.clone(), cos, sin)
    gq, gk = ops.rope_pair_backward(q.clone(), k.clone(), cos, sin)
    c64, s64 = cos.double().unsqueeze(1), sin.double().unsqueeze(1)
    rq64, rk64 = ops.rope(q.double(), c64, s64), ops.rope(k.double(), c64, s64)
    gq64, gk64 = ops.rope_backward(q.double(), c64, s64), ops.rope_backward(k.double(), c64, s64)
    qkv = torch.randn(64, 3 * 256, device="cuda", dtype=torch.bfloat16)
    heads = qkv[:, :256].view(64, 4, 64)  # per-head norms' input: a column block of Q/K/V's output
    wh = torch.randn(64, device="cuda", dtype=torch.bfloat16)
    yh, rows, sth = ops.rms_norm_rows(heads, wh, 1e-6)
    gh = torch.randn_like(yh)
    dxh = ops.rms_norm_backward(gh.reshape(rows.shape), rows, wh, sth).view(heads.shape)
    yh64, rh64 = ops.rms_norm(heads.double(), wh.double(), 1e-6)
    dxh64 = ops.rms_norm_backward(gh.double(), heads.double(), wh.double(), rh64)
    assert used["rope"] == ("liger" if ops._liger() is not None else "torch")
    for got, ref in (
        (y, y64),
        (dx, dx64),
        (yh, yh64),
        (dxh, dxh64),
        (a, a64),
        (da, da64),
        (du, du64),
        (rq, rq64),
        (rk, rk64),
        (gq, gq64),
        (gk, gk64),
    ):
        assert ((got.double() - ref).abs() <= ref.abs() * 2**-7 + 1e-2).all()
    assert set(used.values()) <= {"liger", "torch", "narrows-triton"}
    assert used["swiglu_halves"] == "narrows-triton"  # our one kernel: Triton is on every CUDA machine


def test_checkpointing_turned_on_after_fusing_recomputes(monkeypatch):
    """The model's gradient checkpointing is read at each call: on after `fuse_layers`, the
    layers recompute (same bits); off again, they keep."""
    model = _model("llama", dtype=torch.bfloat16, adapter_dtype=torch.float32)
    fuse_layers(model)
    kept = _steps(model)
    calls = []
    real = compute.recompute
    monkeypatch.setattr(compute, "recompute", lambda *a, **k: calls.append(1) or real(*a, **k))
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


def test_side_by_side_joins_only_tensors_that_lie_so():
    from narrows.core.kernels.fastlayer import side_by_side

    buf = torch.arange(40.0).view(4, 10)
    left, right = buf[:, :6], buf[:, 6:]
    assert torch.equal(side_by_side([left, right], dim=1), buf)
    assert side_by_side([left, right], dim=1).data_ptr() == buf.data_ptr()  # a view: nothing copied
    assert side_by_side([buf[:, :4], buf[:, 6:]], dim=1) is None  # a gap
    assert side_by_side([right, left], dim=1) is None  # out of order
    assert side_by_side([buf[:, :3], buf[:, 3:6]], dim=1) is None  # blocks of a wider buffer
    rows = torch.arange(40.0)
    top, bottom = rows[:16].view(4, 4), rows[16:].view(6, 4)
    assert torch.equal(side_by_side([top, bottom], dim=0), rows.view(10, 4))
    assert side_by_side([top, bottom.clone()], dim=0) is None  # another allocation
    assert side_by_side([top, None], dim=0) is None


def test_swiglu_over_a_buffers_halves_writes_the_gradients_over_them():
    torch.manual_seed(0)
    buf = torch.randn(6, 16)
    g = torch.randn(6, 8)
    gate, up = buf[:, :8], buf[:, 8:]
    # (strided and contiguous operands may take other vectorised CPU paths: close, not equal)
    torch.testing.assert_close(ops.swiglu(gate, up), ops.swiglu(gate.contiguous(), up.contiguous()))
    d_gate, d_up = ops.swiglu_backward(g, gate.contiguous(), up.contiguous())
    h_gate, h_up = ops.swiglu_backward(g, gate, up, inplace=True)
    torch.testing.assert_close((h_gate, h_up), (d_gate, d_up))
    assert h_gate.data_ptr() == buf.data_ptr() and h_up.data_ptr() == buf[:, 8:].data_ptr()
    assert torch.equal(buf, torch.cat([h_gate, h_up], dim=1))  # the stacked gradient, in place


@pytest.mark.bnb
def test_4bit_q_k_v_and_gate_up_each_run_one_matmul_on_their_weights_stacked():
    """Each 4-bit group's weights are stacked once per pass (one entry each in the shared
    cache); held weights are stacked already (a view of the held buffer) and train the
    same bits as weights dequantised into a stacked buffer; plain weights are not stacked."""
    from narrows.core import HeldWeights

    model = _model("llama", base="nf4")
    layer = model.base_model.model.model.layers[0]
    parts = fuse.parts_or_none(layer)
    assert [g.stacked for g in parts.groups] == [True, False, True, False]
    x = torch.randn(2, 12, 64)
    cos, sin = _rotary(model, x)
    cache = {}
    saved = compute.recompute(parts, x, cos, sin, None, cache)
    grads = compute.backward(parts, saved, torch.ones_like(x), cache)
    assert sorted(cache) == ["down", "gate+up", "o", "q+k+v"]
    held = HeldWeights([layer], "cpu")
    with held.hold(layer):
        w = parts.qkv.stacked_weight(x, None)
        assert w.untyped_storage().data_ptr() == held.buffer.untyped_storage().data_ptr()
        assert torch.equal(w, cache["q+k+v"])
        held_saved = compute.recompute(parts, x, cos, sin, None)
        held_grads = compute.backward(parts, held_saved, torch.ones_like(x))
    assert torch.equal(grads[0], held_grads[0]) and _equal(grads[1], held_grads[1])
    dense = fuse.parts_or_none(_model("llama").base_model.model.model.layers[0])
    assert not any(g.stacked for g in dense.groups)


def _rotary(model, x):
    rotary = model.base_model.model.model.rotary_emb
    return rotary(x, torch.arange(x.shape[1]).unsqueeze(0).expand(x.shape[0], -1))


_INTERPRETED = """
import torch
from narrows.core.kernels.fastlayer import ops, swiglu
torch.manual_seed(0)
buf = torch.randn(5, 2 * 1500)  # two column blocks of the kernel, the second partial
g = torch.randn(5, 1500)
gate, up = buf[:, :1500].contiguous(), buf[:, 1500:].contiguous()
torch.testing.assert_close(swiglu.swiglu_halves(buf), ops.swiglu(gate, up), rtol=4e-7, atol=1e-7)
d_gate, d_up = ops.swiglu_backward(g, gate, up)
swiglu.swiglu_halves_backward(g, buf)
torch.testing.assert_close((buf[:, :1500], buf[:, 1500:]), (d_gate, d_up), rtol=4e-7, atol=1e-7)
print("ok")
"""


def test_the_halves_kernel_computes_the_reference_under_tritons_interpreter():
    """The Triton SwiGLU over halves, run by Triton's CPU interpreter in float32: its
    indexing (which half, which row, the last partial block) and its formula are the
    reference's. (The interpreter rounds to bf16 by truncation, so bf16 is left to the
    CUDA test.)"""
    pytest.importorskip("triton")
    from narrows.core.testing import under_triton_interpreter

    done = under_triton_interpreter(_INTERPRETED)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.gpu
def test_cuda_swiglu_over_halves_matches_the_reference():
    """narrows' Triton SwiGLU over a stacked buffer's halves: within one bf16 ulp of the
    float32 formula, forward and backward (the gradients written over the halves)."""
    torch.manual_seed(0)
    buf = torch.randn(96, 2 * 1500, device="cuda", dtype=torch.bfloat16)  # not a multiple of the block
    g = torch.randn(96, 1500, device="cuda", dtype=torch.bfloat16)
    assert ops.kernels_in_use("cuda")["swiglu_halves"] == "narrows-triton"
    gate, up = buf[:, :1500], buf[:, 1500:]
    g32, u32, d32 = gate.float(), up.float(), g.float()
    sig = torch.sigmoid(g32)
    ref = (g32 * sig * u32).to(torch.bfloat16)
    ref_gate = (d32 * u32 * sig * (1 + g32 * (1 - sig))).to(torch.bfloat16)
    ref_up = (d32 * g32 * sig).to(torch.bfloat16)
    ulp = 2**-7

    def near(got, want):
        return bool(((got.float() - want.float()).abs() <= want.float().abs() * ulp + 1e-30).all())

    assert near(ops.swiglu(gate, up), ref)
    h_gate, h_up = ops.swiglu_backward(g, gate, up, inplace=True)
    assert h_gate.data_ptr() == buf.data_ptr()  # written over the halves
    assert near(h_gate, ref_gate) and near(h_up, ref_up)
