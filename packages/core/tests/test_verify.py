"""Shrunk twins and the head check: what narrows runs before training an architecture it
does not announce, and what it runs in CI on every architecture it does."""

import pytest
import torch
import transformers as tf

import narrows.core as nc
import narrows.core.protocol.anatomy as anatomy_module
from narrows.core.protocol.verify import _PASSED, check_head
from narrows.core.testing import TINY_ARCHITECTURES, tiny_model, with_adapter


@pytest.fixture(autouse=True)
def forget_verified():
    yield
    anatomy_module._VERIFIED.clear()
    _PASSED.clear()


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_the_head_hook_gives_the_models_own_logits(arch):
    """Every announced architecture declares its logit arithmetic correctly (train and eval)."""
    check_head(with_adapter(tiny_model(arch), "lora"))


def test_real_configs_shrink_to_two_small_layers_keeping_layer_kinds():
    gemma = nc.shrink_config(tf.Gemma3TextConfig())  # 26 layers: five sliding, then one full
    assert gemma.num_hidden_layers == 2 and gemma.hidden_size == 64
    assert sorted(gemma.layer_types) == ["full_attention", "sliding_attention"]
    mixtral = nc.shrink_config(tf.MixtralConfig())
    assert (mixtral.num_local_experts, mixtral.num_experts_per_tok, mixtral.num_key_value_heads) == (4, 2, 2)
    assert mixtral.vocab_size == 512 and mixtral.intermediate_size == 128
    qwen = nc.shrink_config(tf.Qwen2Config(bos_token_id=151643, eos_token_id=151645))
    assert qwen.bos_token_id < qwen.vocab_size and qwen.eos_token_id < qwen.vocab_size
    # DeepSeek-V3's latent attention: its head_dim is the rotary part's, shrunk with it; its
    # groups of experts fit the capped experts
    deepseek = nc.shrink_config(tf.DeepseekV3Config())
    assert deepseek.head_dim == deepseek.qk_rope_head_dim < tf.DeepseekV3Config().qk_rope_head_dim
    assert deepseek.qk_head_dim == deepseek.qk_nope_head_dim + deepseek.qk_rope_head_dim
    assert deepseek.n_routed_experts % deepseek.n_group == 0 and deepseek.topk_group <= deepseek.n_group
    model = tf.AutoModelForCausalLM.from_config(deepseek, attn_implementation="eager")
    assert model(torch.arange(6)[None]).logits.shape == (1, 6, deepseek.vocab_size)


def test_a_twin_is_the_same_class_with_the_same_adapters_and_seeded():
    model = with_adapter(tiny_model("qwen3"), "lora", dropout=0.1)
    a, b = nc.shrunk_twin(model), nc.shrunk_twin(model)
    assert type(nc.unwrap_model(a)) is type(nc.unwrap_model(model))
    assert nc.unwrap_model(a).config.num_hidden_layers == 2
    assert a.peft_config["default"].lora_dropout == 0.05  # the check always exercises dropout
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n


def _fork(arch: str, name: str) -> torch.nn.Module:
    """A tiny model of `arch` posing as an unannounced architecture."""
    model = tiny_model(arch)
    model.config.model_type = name
    return with_adapter(model, "lora")


def test_an_unannounced_architecture_is_refused_until_its_twin_passes():
    model = _fork("llama", "my_llama_fork")
    with pytest.raises(nc.UnsupportedArchitectureError, match="verify_architecture"):
        nc.anatomy_of(model)
    assert nc.verify_architecture(model, "head") == ["head"]
    assert not nc.anatomy_of(model).announced


def test_undeclared_logit_arithmetic_is_found_on_the_twin(monkeypatch):
    """Cohere multiplies its logits: without that declared, the head check refuses."""
    model = _fork("cohere", "my_cohere_fork")
    monkeypatch.setattr(anatomy_module, "KNOWN_LOGIT_OPS", ())
    with pytest.raises(nc.UnsupportedArchitectureError, match=r"'head' check.*logits differ"):
        nc.verify_architecture(model, "head")
    with pytest.raises(nc.UnsupportedArchitectureError):
        nc.anatomy_of(model)  # still refused


def test_the_known_config_keys_cover_an_unannounced_scaled_head():
    nc.verify_architecture(_fork("granite", "my_granite_fork"), "head")


def test_a_twin_that_cannot_be_built_is_refused_with_the_reason():
    model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(nc.UnsupportedArchitectureError, match="register_architecture"):
        nc.verify_architecture(model, "head")
