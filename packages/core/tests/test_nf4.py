import pytest
import torch

import narrows.core.optional as env
from narrows.core import (
    MissingDependencyError,
    NarrowsError,
    disable_cpu_repacking,
    frozen_slots,
    quantize_nf4,
)
from narrows.core.testing import tiny_batch, tiny_model, with_adapter


@pytest.mark.bnb
def test_quantize_replaces_decoder_linears_only():
    import bitsandbytes as bnb

    model = tiny_model("qwen2")  # attention bias: biases must survive quantisation
    ref = model(**tiny_batch()).loss
    quantize_nf4(model)
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, bnb.nn.Linear4bit)
    assert layer.self_attn.q_proj.bias is not None
    assert isinstance(model.lm_head, torch.nn.Linear) and not isinstance(model.lm_head, bnb.nn.Linear4bit)
    assert model.is_loaded_in_4bit
    qs = layer.mlp.down_proj.weight.quant_state
    assert qs.nested and qs.quant_type == "nf4" and qs.blocksize == 64
    slot_names = {s.name.split("down_proj.")[-1] for s in frozen_slots(layer.mlp.down_proj)}
    assert slot_names == {
        "weight",
        "weight.quant_state.absmax",
        "weight.quant_state.code",
        "weight.quant_state.offset",
        "weight.quant_state.state2.absmax",
        "weight.quant_state.state2.code",
    }
    loss = model(**tiny_batch()).loss
    assert torch.isfinite(loss) and abs(loss.item() - ref.item()) < 0.05  # NF4 error is small


@pytest.mark.bnb
def test_quantize_without_double_quant_and_filter():
    import bitsandbytes as bnb

    model = quantize_nf4(tiny_model("llama"), double_quant=False, filter_fn=lambda name, _: "mlp" in name)
    layer = model.model.layers[0]
    assert isinstance(layer.mlp.up_proj, bnb.nn.Linear4bit)
    assert type(layer.self_attn.q_proj) is torch.nn.Linear
    assert not layer.mlp.up_proj.weight.quant_state.nested


@pytest.mark.bnb
def test_park_moves_each_quantised_layer_and_no_other(monkeypatch):
    model = tiny_model("llama")
    layers = list(model.model.layers)
    parked = []
    for i, layer in enumerate(layers):
        monkeypatch.setattr(layer, "to", lambda *a, i=i, **k: parked.append((i, a)))
    quantize_nf4(model, park="cpu", filter_fn=lambda name, _: name.startswith("model.layers.1."))
    assert parked == [(1, ("cpu",))]


@pytest.mark.bnb
def test_inference_before_training_is_safe_once_repacking_is_disabled():
    """bitsandbytes repacks 4-bit weights in place on AVX512-BF16 CPUs during no-grad
    inference; with repacking disabled, gradients after an inference pass are unchanged."""
    import bitsandbytes as bnb

    model = with_adapter(quantize_nf4(tiny_model("llama")), "lora")
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    for m in layers:
        m.support_avx512bf16_for_cpu = True  # what a Linear4bit built by hand does here
    assert disable_cpu_repacking(model) == len(layers)
    batch = tiny_batch()
    params = [p for p in model.parameters() if p.requires_grad]
    ref = torch.autograd.grad(model(**batch).loss, params)
    model.eval()
    with torch.no_grad():
        model(input_ids=batch["input_ids"])
    model.train()
    got = torch.autograd.grad(model(**batch).loss, params)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


@pytest.mark.bnb
def test_already_repacked_model_is_refused_with_the_fix():
    import bitsandbytes as bnb

    model = with_adapter(quantize_nf4(tiny_model("llama")), "lora")
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    for m in layers:
        m.support_avx512bf16_for_cpu = True
    model.eval()
    with torch.no_grad():
        model(input_ids=tiny_batch()["input_ids"])
    if not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in layers):
        pytest.skip("this CPU has no AVX512-BF16: bitsandbytes does not repack here")
    with pytest.raises(NarrowsError, match="disable_cpu_repacking"):
        frozen_slots(model)


def test_missing_bitsandbytes_says_how_to_install(monkeypatch):
    monkeypatch.setattr(env, "is_available", lambda module: False)
    with pytest.raises(MissingDependencyError, match=r"pip install 'narrows-core\[nf4\]'"):
        quantize_nf4(tiny_model("llama"))


@pytest.mark.bnb
def test_no_linear_to_quantise_is_an_error():
    with pytest.raises(ValueError, match=r"no nn\.Linear"):
        quantize_nf4(tiny_model("llama"), filter_fn=lambda name, _: False)


@pytest.mark.bnb
@pytest.mark.parametrize("double_quant", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nf4_rows_equal_the_full_dequantisation(double_quant, dtype):
    from bitsandbytes.functional import dequantize_4bit

    from narrows.core import nf4_rows

    model = tiny_model("llama", dtype=dtype)
    quantize_nf4(model, double_quant=double_quant)
    layer = model.model.layers[0].mlp.down_proj  # in_features 128 = two blocks per row
    full = dequantize_4bit(layer.weight.data, layer.weight.quant_state)
    rows = nf4_rows(layer)
    assert rows.shape == tuple(full.shape)
    for step in (1, 3, 7, full.shape[0]):
        parts = [rows.rows(i, i + step) for i in range(0, full.shape[0], step)]
        assert torch.equal(torch.cat(parts), full)


@pytest.mark.bnb
def test_nf4_rows_refuses_what_it_cannot_slice():
    from narrows.core import nf4_rows

    with pytest.raises(TypeError, match="Linear4bit"):
        nf4_rows(torch.nn.Linear(4, 4))
    model = tiny_model("llama")
    quantize_nf4(model, blocksize=128, filter_fn=lambda name, lin: lin.in_features == 64)
    with pytest.raises(ValueError, match="multiple of the block size"):
        nf4_rows(model.model.layers[0].self_attn.q_proj)
