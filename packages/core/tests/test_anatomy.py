import pytest
import torch
import transformers

from narrows.core import (
    ArchitectureSpec,
    LogitMath,
    UnsupportedArchitectureError,
    anatomy_of,
    register_architecture,
)
from narrows.core.protocol.anatomy import accepting_unannounced
from narrows.core.testing import TINY_ARCHITECTURES, tiny_model, with_adapter


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
@pytest.mark.parametrize("kind", ["none", "lora"])
def test_anatomy_finds_every_part(arch, kind):
    base = tiny_model(arch)
    model = with_adapter(base, kind)
    a = anatomy_of(model)
    assert a.model is base and a.announced
    assert a.model_type == base.config.model_type
    assert a.num_layers == base.config.get_text_config().num_hidden_layers
    assert a.embed is base.get_input_embeddings()
    assert a.head is base.get_output_embeddings()
    assert a.tied == (a.head.weight is a.embed.weight)
    named = dict(base.named_modules())
    assert all(named[p] is layer for p, layer in zip(a.layer_paths, a.layers))
    if arch in ("gemma2", "gemma3_text"):
        assert a.logit_math == LogitMath(softcap=30.0)
    # the parts really are what the model runs: embedding, every layer in order, final norm, head
    order: list[str] = []
    parts = [
        ("embed", a.embed),
        *((f"layer{i}", m) for i, m in enumerate(a.layers)),
        ("norm", a.norm),
        ("head", a.head),
    ]
    handles = [m.register_forward_hook(lambda *_, n=n: order.append(n)) for n, m in parts]
    with torch.no_grad():
        model(input_ids=torch.randint(3, 200, (1, 6)))
    for h in handles:
        h.remove()
    assert order == [n for n, _ in parts]


def test_tied_head_is_detected_through_peft_wrapping():
    model = with_adapter(tiny_model("qwen2"), "lora")
    a = anatomy_of(model)
    assert a.tied and a.head.weight is a.embed.weight


def test_unsupported_architecture_names_what_and_how():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64)
    model = transformers.GPT2LMHeadModel(cfg)
    with pytest.raises(UnsupportedArchitectureError) as e:
        anatomy_of(model)
    msg = str(e.value)
    assert (
        "gpt2" in msg and "llama" in msg and "register_architecture" in msg and "verify_architecture" in msg
    )


def test_structure_missing_is_reported_part_by_part():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64)
    model = transformers.GPT2LMHeadModel(cfg)
    with pytest.raises(UnsupportedArchitectureError, match="final norm"), accepting_unannounced():
        anatomy_of(model)  # GPT-2 calls it ln_f, and keeps layers in `h`
    register_architecture(
        ArchitectureSpec("gpt2", layers="transformer.h", norm="transformer.ln_f"), replace=True
    )
    try:
        a = anatomy_of(model)
        assert a.layers is model.transformer.h and a.norm is model.transformer.ln_f
        assert a.layer_paths == ("transformer.h.0", "transformer.h.1")
    finally:
        import narrows.core.protocol.anatomy as anatomy_module

        anatomy_module._ARCHITECTURES.pop("gpt2")


def test_registering_twice_needs_replace():
    with pytest.raises(ValueError, match="already registered"):
        register_architecture(ArchitectureSpec("llama"))


def test_structural_discovery_without_registration():
    model = tiny_model("llama")
    model.config.model_type = "my_llama_fork"
    with pytest.raises(UnsupportedArchitectureError, match="my_llama_fork"):
        anatomy_of(model)
    with accepting_unannounced():
        assert anatomy_of(model).num_layers == 3
