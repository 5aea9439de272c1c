import pytest
import torch
import transformers

from narrows.core import ArchitectureSpec, UnsupportedArchitectureError, anatomy_of, register_architecture
from narrows.core.testing import TINY_ARCHITECTURES, tiny_model, with_adapter


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
@pytest.mark.parametrize("kind", ["none", "lora"])
def test_anatomy_finds_every_part(arch, kind):
    base = tiny_model(arch)
    model = with_adapter(base, kind)
    a = anatomy_of(model)
    assert a.model is base
    assert a.model_type == arch
    assert a.num_layers == base.config.num_hidden_layers
    assert a.layers is base.model.layers
    assert a.embed is base.model.embed_tokens
    assert a.norm is base.model.norm
    assert a.head is base.lm_head
    assert a.tied == bool(base.config.tie_word_embeddings)
    assert a.layer_paths == tuple(f"model.layers.{i}" for i in range(a.num_layers))
    if arch.startswith("gemma"):
        assert a.head_config == {"final_logit_softcapping": 30.0}
    # the layers really are what the model runs: hidden states pass through them in order
    x = torch.randint(3, 200, (1, 6))
    with torch.no_grad():
        h = a.embed(x)
        assert h.shape == (1, 6, base.config.hidden_size)


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
    assert "gpt2" in msg and "llama" in msg and "register_architecture" in msg


def test_structure_missing_is_reported_part_by_part():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64)
    model = transformers.GPT2LMHeadModel(cfg)
    with pytest.raises(UnsupportedArchitectureError, match="final norm"):
        anatomy_of(model, strict=False)  # GPT-2 calls it ln_f, and keeps layers in `h`
    register_architecture(
        ArchitectureSpec("gpt2", layers="transformer.h", norm="transformer.ln_f"), replace=True
    )
    try:
        a = anatomy_of(model)
        assert a.layers is model.transformer.h and a.norm is model.transformer.ln_f
        assert a.layer_paths == ("transformer.h.0", "transformer.h.1")
    finally:
        import narrows.core.anatomy as anatomy_module

        anatomy_module._ARCHITECTURES.pop("gpt2")


def test_registering_twice_needs_replace():
    with pytest.raises(ValueError, match="already registered"):
        register_architecture(ArchitectureSpec("llama"))


def test_structural_discovery_without_registration():
    model = tiny_model("llama")
    model.config.model_type = "my_llama_fork"
    with pytest.raises(UnsupportedArchitectureError, match="my_llama_fork"):
        anatomy_of(model)
    assert anatomy_of(model, strict=False).num_layers == 3
