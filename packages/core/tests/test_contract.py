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


# every adapter kind on the first six and on two of the others; LoRA (float and NF4) on all
CASES = [
    (arch, kind)
    for arch in TINY_ARCHITECTURES
    for kind in ADAPTER_KINDS
    if kind == "lora" or arch in (*TINY_ARCHITECTURES[:6], "phi3", "cohere")
]


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("arch,kind", CASES)
def test_contract(arch, kind, base):
    model = tiny_model(arch)
    if base == "nf4":
        quantize_nf4(model)
    if kind == "none":
        model.requires_grad_(False)  # a fully frozen base: every tensor is a slot
    try:
        model = with_adapter(model, kind)
    except ValueError as e:  # PEFT: fused MoE experts (lora.ParamWrapper) take no DoRA
        if "ParamWrapper does not work with use_dora" not in str(e):
            raise
        pytest.skip(f"PEFT refuses it: {e}")
    run_contract(model, tiny_batch(), variant=None if kind == "none" else kind)


@pytest.mark.bnb
def test_peft_uses_its_4bit_layer_on_our_nf4_base():
    import bitsandbytes as bnb
    from peft.tuners.lora.bnb import Linear4bit as PeftLinear4bit

    model = with_adapter(quantize_nf4(tiny_model("llama")), "lora")
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(q, PeftLinear4bit)
    assert isinstance(q.get_base_layer(), bnb.nn.Linear4bit)
