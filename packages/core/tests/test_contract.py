"""The protocol contract over every supported architecture × adapter × base precision."""

import pytest

from narrows.core import quantize_nf4
from narrows.core.testing import (
    ADAPTER_KINDS,
    TINY_ARCHITECTURES,
    run_contract,
    tiny_batch,
    tiny_model,
    with_adapter,
)

BASES = ["float", pytest.param("nf4", marks=pytest.mark.bnb)]


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("kind", ADAPTER_KINDS)
@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_contract(arch, kind, base):
    model = tiny_model(arch)
    if base == "nf4":
        quantize_nf4(model)
    if kind == "none":
        model.requires_grad_(False)  # a fully frozen base: every tensor is a slot
    model = with_adapter(model, kind)
    run_contract(model, tiny_batch(), variant=None if kind == "none" else kind)


@pytest.mark.bnb
def test_peft_uses_its_4bit_layer_on_our_nf4_base():
    import bitsandbytes as bnb
    from peft.tuners.lora.bnb import Linear4bit as PeftLinear4bit

    model = with_adapter(quantize_nf4(tiny_model("llama")), "lora")
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(q, PeftLinear4bit)
    assert isinstance(q.get_base_layer(), bnb.nn.Linear4bit)
