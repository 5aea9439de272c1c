"""Held NF4 weights (`HeldWeights`): a layer run on its once-dequantised weights computes
the same bits as bitsandbytes dequantising on every call — forward, input gradient and
adapter gradients — and only calls bitsandbytes would run as dequantise-then-matmul take
the held copy. Each claim has a twin that shows the test would see it broken."""

from __future__ import annotations

import pytest
import torch

from narrows.core import (
    HeldWeights,
    dequantized_bytes,
    held_bytes,
    held_token,
    held_weight,
    is_nf4_linear,
    quantize_nf4,
)
from narrows.core.testing import tiny_batch, tiny_model, with_adapter

pytestmark = pytest.mark.bnb
bnb = pytest.importorskip("bitsandbytes")


def _model(arch: str, double_quant: bool = True, dtype: torch.dtype = torch.bfloat16):
    model = quantize_nf4(tiny_model(arch, dtype=dtype), double_quant=double_quant)
    return with_adapter(model, "lora").train()


def _run(model, batch=None) -> list[torch.Tensor]:
    for p in model.parameters():
        p.grad = None
    loss = model(**(batch or tiny_batch())).loss
    loss.backward()
    return [loss.detach()] + [p.grad.clone() for p in model.parameters() if p.requires_grad]


def _layers(model):
    return list(model.base_model.model.model.layers)


@pytest.mark.parametrize(("arch", "double_quant"), [("qwen2", True), ("llama", False)])
def test_a_held_layer_trains_bit_identically(arch, double_quant):
    """qwen2 has biased q/k/v; with and without the nested (double-quantised) scales."""
    model = _model(arch, double_quant)
    ref = _run(model)
    layers = _layers(model)
    held = HeldWeights(layers, "cpu")
    assert held.nbytes == max(held_bytes(layer) for layer in layers) > 0
    for layer in layers:
        with held.hold(layer) as n:
            assert n == 7 and held_token(layer) == held.buffer.data_ptr()
            got = _run(model)
        assert held_token(layer) == 0
        assert all(torch.equal(a, b) for a, b in zip(ref, got))


def test_the_held_copy_is_what_the_layer_computes_with():
    """Twin: zeroing the held buffer changes the loss, so the calls do read it; and
    refilling the buffer between the forward and its backward is caught by autograd."""
    model = _model("llama")
    ref = _run(model)
    layer = _layers(model)[0]
    held = HeldWeights(_layers(model), "cpu")
    with held.hold(layer):
        q = layer.self_attn.q_proj.base_layer
        assert torch.equal(
            held_weight(q), bnb.functional.dequantize_4bit(q.weight.data, q.weight.quant_state)
        )
        held.buffer.zero_()
        assert not torch.equal(_run(model)[0], ref[0])
        loss = model(**tiny_batch()).loss
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()  # after release: the copy it saved may hold another layer's weights by now
    with held.hold(layer):
        loss = model(**tiny_batch()).loss
    with held.hold(_layers(model)[1]), pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()  # the buffer refilled for another layer


def test_calls_bitsandbytes_would_not_dequantise_go_to_it():
    """An fp32 input to a bf16-quantised weight is not served from the held copy (the
    forward would dequantise into fp32, the backward into bf16): same result as without
    holding, even with the held buffer zeroed."""
    layer = _model("llama").base_model.model.model.layers[0]
    down = layer.mlp.down_proj.base_layer
    x = torch.randn(3, down.in_features, dtype=torch.float32, requires_grad=True)
    ref = bnb.matmul_4bit(x, down.weight, quant_state=down.weight.quant_state)
    held = HeldWeights([layer], "cpu")
    with held.hold(layer):
        held.buffer.zero_()
        got = bnb.matmul_4bit(x, down.weight, quant_state=down.weight.quant_state)
    assert torch.equal(ref, got)


def test_release_restores_bitsandbytes_even_on_error():
    model = _model("llama")
    layers = _layers(model)
    held = HeldWeights(layers, "cpu")
    before = bnb.matmul_4bit
    with pytest.raises(ValueError, match="boom"), held.hold(layers[0]):
        assert bnb.matmul_4bit is not before
        with pytest.raises(RuntimeError, match="another layer is held"), held.hold(layers[1]):
            pass
        raise ValueError("boom")
    assert bnb.matmul_4bit is before and held_token(layers[0]) == 0
    assert held_weight(layers[0].self_attn.q_proj.base_layer) is None


def test_a_float_layer_holds_nothing():
    model = with_adapter(tiny_model("llama"), "lora")
    layer = _layers(model)[0]
    assert held_bytes(layer) == dequantized_bytes(layer) == 0 and not any(
        is_nf4_linear(m) for m in layer.modules()
    )
    held = HeldWeights([layer], "cpu")
    with held.hold(layer) as n:
        assert n == 0 and held_token(layer) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [512, 4])
def test_real_shapes_on_cuda_are_bit_identical(tokens):
    """A 7B MLP weight in bf16 on the GPU: at 512 tokens bitsandbytes dequantises and the
    held copy serves the call; at 4 it runs its own fused kernel, and the held path
    leaves the call to it. Either way output and input gradient are `torch.equal`."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(0)
    lin = torch.nn.Linear(3584, 18944, bias=False, dtype=torch.bfloat16)
    q = bnb.nn.Linear4bit(3584, 18944, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
    q.weight = bnb.nn.Params4bit(lin.weight.data, requires_grad=False, quant_type="nf4")
    q = q.cuda()
    layer = torch.nn.Sequential(q)
    x = torch.randn(1, tokens, 3584, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    g = torch.randn(1, tokens, 18944, dtype=torch.bfloat16, device="cuda")

    def run():
        x.grad = None
        y = layer(x)
        y.backward(g)
        return y.detach(), x.grad.clone()

    ref = run()
    held = HeldWeights([layer], "cuda")  # the current device, whose index the weights carry
    with held.hold(layer) as n:
        assert n == 1
        got = run()
        held.buffer.zero_()
        zeroed = run()
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    if tokens == 512:  # served from the held copy: the zeroed buffer shows in the output
        assert not zeroed[0].any()
    else:  # bitsandbytes' own kernel: the held copy is not read
        assert torch.equal(zeroed[0], ref[0])


def test_dequantized_bytes_is_the_largest_weight_dequantised():
    """What one call's transient copy takes: the largest 4-bit weight in its compute
    dtype, as bitsandbytes' own dequantisation returns it (an independent measure)."""
    layer = _layers(_model("llama"))[0]
    copies = [
        bnb.functional.dequantize_4bit(m.weight.data, m.weight.quant_state)
        for m in layer.modules()
        if is_nf4_linear(m)
    ]
    largest = max(c.numel() * c.element_size() for c in copies)
    assert dequantized_bytes(layer) == -(-largest // 512) * 512
    assert dequantized_bytes(layer) < held_bytes(layer)
