"""`use_narrows_dora`: PEFT's DoRA layers with the factored norm and the stable compose —
the same numbers as PEFT's own DoRA (up to rounding) and as the fp64 DoRA formula."""

import pytest
import torch

import narrows.dora as nd
from narrows.core.testing import tiny_batch, tiny_model, with_adapter


def loss_and_grads(model):
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    loss = model(**tiny_batch()).loss
    return loss.detach(), torch.autograd.grad(loss, params)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])
def test_same_loss_and_gradients_as_peft_dora(arch):
    ref_loss, ref_grads = loss_and_grads(with_adapter(tiny_model(arch), "dora"))
    model = with_adapter(tiny_model(arch), "dora")
    assert nd.use_narrows_dora(model) == 7 * model.config.num_hidden_layers
    loss, grads = loss_and_grads(model)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_one_layer_against_the_fp64_formula():
    torch.manual_seed(0)
    model = with_adapter(tiny_model("llama"), "dora")
    nd.use_narrows_dora(model)
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    x = torch.randn(3, 5, layer.in_features)
    out = layer(x)
    w = layer.base_layer.weight.double()
    a, b = layer.lora_A["default"].weight.double(), layer.lora_B["default"].weight.double()
    s = layer.scaling["default"]
    m = layer.lora_magnitude_vector["default"].weight.double()
    composed = w + s * b @ a
    ref = x.double() @ (m[:, None] * composed / composed.norm(dim=1, keepdim=True)).t()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)


def test_compose_keeps_the_small_correction_in_bf16():
    base = torch.full((4, 8), 3.0, dtype=torch.bfloat16)
    lora = torch.zeros(4, 8, dtype=torch.bfloat16)
    g = torch.full((8,), 1.0 + 2**-10)  # |g - 1| below bf16's resolution at 1
    out = nd.compose(base, lora, g, 1.0)
    assert out.dtype == torch.bfloat16 and (out.float() - 3.0 * 2**-10).abs().max() < 1e-4
    naive = (g.to(torch.bfloat16) * (lora + base) - base).float()
    assert naive.abs().max() == 0  # the algebraically equal form loses it entirely


def test_a_model_without_dora_is_refused_clearly():
    with pytest.raises(ValueError, match="use_dora=True"):
        nd.use_narrows_dora(with_adapter(tiny_model("llama"), "lora"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compose_backward_matches_autograd_of_the_formula(dtype):
    from narrows.dora.compose import formula

    g0 = torch.Generator().manual_seed(0)
    base = torch.randn(2, 7, 16, generator=g0).to(dtype).requires_grad_(True)
    lora = torch.randn(2, 7, 16, generator=g0).to(dtype).requires_grad_(True)
    g = (1 + 0.01 * torch.randn(16, generator=g0)).requires_grad_(True)
    go = torch.randn(2, 7, 16, generator=g0).to(dtype)
    ours = nd.compose(base, lora, g, 0.5)
    ref = formula(base, lora, g, 0.5)
    assert torch.equal(ours, ref)
    a = torch.autograd.grad(ours, (base, lora, g), go)
    b = torch.autograd.grad(ref, (base, lora, g), go)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    torch.testing.assert_close(a[2], b[2], rtol=1e-6, atol=1e-6)  # the magnitude sum: order may differ


def test_the_base_norm_is_cached_per_weight_and_recomputed_when_the_weight_changes(monkeypatch):
    import narrows.dora.layer as dora_layer

    model = with_adapter(tiny_model("llama"), "dora")
    nd.use_narrows_dora(model)
    calls = []
    real = dora_layer.base_row_norm_sq
    monkeypatch.setattr(dora_layer, "base_row_norm_sq", lambda w: calls.append(1) or real(w))
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    x = torch.randn(2, 4, layer.in_features)
    first = layer(x)
    assert len(calls) == 1
    assert torch.equal(layer(x), first) and len(calls) == 1  # cached
    with torch.no_grad():
        layer.base_layer.weight.mul_(1.5)  # an in-place edit: a new version of the same storage
    edited = layer(x)
    assert len(calls) == 2
    fresh = with_adapter(tiny_model("llama"), "dora")
    nd.use_narrows_dora(fresh)
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(edited, fresh.base_model.model.model.layers[0].self_attn.q_proj(x))
