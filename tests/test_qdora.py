"""narrows-dora on a bitsandbytes NF4 base (QDoRA): the row norm reads the 4-bit weight a
few dequantised rows at a time and gives PEFT's numbers."""

import pytest
import torch

import narrows.dora as nd
from narrows.core import nf4_rows, quantize_nf4
from narrows.core.testing import tiny_batch, tiny_model, with_adapter

pytestmark = pytest.mark.bnb


def qdora(dropout=0.0):
    pytest.importorskip("bitsandbytes")
    return with_adapter(quantize_nf4(tiny_model("llama")), "dora", dropout=dropout)


def loss_and_grads(model):
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    loss = model(**tiny_batch()).loss
    return loss.detach(), torch.autograd.grad(loss, params)


def assert_like_peft(ours, reference):
    torch.testing.assert_close(ours[0], reference[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(ours[1], reference[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("chunk_budget", [4096, 2**25])
def test_row_norm_of_a_4bit_weight_matches_the_dense_reference(chunk_budget):
    from bitsandbytes.functional import dequantize_4bit

    layer = qdora().base_model.model.model.layers[0].mlp.up_proj
    base = layer.get_base_layer()
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    w = dequantize_4bit(base.weight.data, base.weight.quant_state)
    rows = nf4_rows(base)
    got = nd.factored_row_norm(rows, a, b, 0.7, chunk_budget=chunk_budget)
    torch.testing.assert_close(got.double(), nd.dense_row_norm(w, a, b, 0.7), rtol=2e-6, atol=0)
    assert torch.equal(
        nd.base_row_norm_sq(rows, chunk_budget=chunk_budget), nd.base_row_norm_sq(w, chunk_budget=2**30)
    )


def test_qdora_gives_peft_numbers_without_dequantising_whole_weights(monkeypatch):
    import peft.utils.integrations as integrations

    reference = loss_and_grads(qdora())
    model = qdora()

    def refuse(*args, **kwargs):
        raise AssertionError("the whole 4-bit weight was dequantised")

    monkeypatch.setattr(integrations, "dequantize_module_weight", refuse)
    nd.use_narrows_dora(model)
    assert_like_peft(loss_and_grads(model), reference)


def test_qdora_with_dropout_trains_like_peft():
    torch.manual_seed(0)
    reference = loss_and_grads(qdora(dropout=0.1))
    model = qdora(dropout=0.1)
    nd.use_narrows_dora(model)
    torch.manual_seed(0)
    assert_like_peft(loss_and_grads(model), reference)


def test_narrows_dora_layer_on_nf4_gives_the_peft_path_numbers(tmp_path):
    """`load_dora` on a 4-bit base: bit-identical to PEFT's QDoRA switched to narrows."""
    reference = qdora()
    nd.use_narrows_dora(reference)
    reference.save_pretrained(tmp_path)
    ours = nd.load_dora(quantize_nf4(tiny_model("llama")), tmp_path, trainable=True)
    ref_loss, ref_grads = loss_and_grads(reference)
    loss, grads = loss_and_grads(ours)
    assert torch.equal(loss, ref_loss)
    ref_named = dict(zip((n for n, p in reference.named_parameters() if p.requires_grad), ref_grads))
    for (name, _), g in zip(((n, p) for n, p in ours.named_parameters() if p.requires_grad), grads):
        module, _, leaf = name.rpartition(".")
        if leaf == "magnitude":
            ref = f"base_model.model.{module}.lora_magnitude_vector.default.weight"
        else:
            module, _, ab = module.rpartition(".")
            ref = f"base_model.model.{module}.{ab}.default.{leaf}"
        assert torch.equal(g, ref_named[ref]), name


@pytest.mark.gpu
def test_row_norm_kernel_on_nf4_slices_matches_the_chunked_path(monkeypatch):
    model = with_adapter(
        quantize_nf4(tiny_model("llama", hidden_size=256, intermediate_size=512).cuda()), "dora"
    )
    layer = model.base_model.model.model.layers[0].mlp.up_proj
    rows = nf4_rows(layer.get_base_layer())
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    with torch.no_grad():
        b.normal_(0, 0.05)
    monkeypatch.setattr("narrows.dora.norm._NF4_MIN_SLICE_ROWS", 64)
    fused = nd.factored_row_norm(rows, a, b, 0.7, chunk_budget=4096 * 16)  # several slices
    monkeypatch.setenv("NARROWS_DORA_FUSED", "0")
    eager = nd.factored_row_norm(rows, a, b, 0.7)
    torch.testing.assert_close(fused, eager, rtol=2e-6, atol=0)
