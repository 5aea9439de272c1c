"""What `stream` leaves of the user's model config, and what it refuses whatever the RNG.

Packed rows (position ids restarting inside a row, no attention mask) train with
per-sequence masks only without a KV cache: with ``use_cache=True`` (transformers'
default) transformers skips its packed-sequence detection. So ``use_cache`` is part of
what a run computes, and `stream` must not change it behind the user's back."""

import copy

import pytest
import torch
import transformers as tf
from helpers import build
from peft import LoraConfig, get_peft_model

import narrows.stream as ns
from narrows.core import anatomy_of
from narrows.core.testing import tiny_model, with_adapter


def _packed_batch() -> dict[str, torch.Tensor]:
    """Two rows, each two sequences packed end to end: positions restart, no mask."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 256, (2, 12), generator=g)
    positions = torch.tensor([list(range(5)) + list(range(7)), list(range(8)) + list(range(4))])
    labels = ids.clone()
    labels[0, 5] = labels[1, 8] = -100  # no target across a sequence boundary
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


def _loss_and_grads(model, **kwargs) -> list[torch.Tensor]:
    named = [p for p in model.parameters() if p.requires_grad]
    torch.manual_seed(0)
    loss = model(**_packed_batch(), **kwargs).loss
    return [loss.detach(), *torch.autograd.grad(loss, named)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_stream_leaves_the_config_alone_and_packed_rows_train_as_resident():
    """`stream` once set ``config.use_cache = False`` on the user's model and left it, so a
    streamed run on packed rows used the packed masks while the user's own resident run
    (default ``use_cache=True``) did not: losses 1e-2 apart. Now the config is the one the
    user gave, before and after a streamed step, and each ``use_cache`` the user passes
    trains streamed as it does resident. (Catches: the config write put back.)"""
    model = build("llama", dropout=0.1)
    resident = copy.deepcopy(model)
    before = model.config.to_dict()
    assert before["use_cache"] is True  # transformers' default: the trap this test is about
    ns.stream(model, device="cpu")
    assert model.config.to_dict() == before
    for use_cache in ({}, {"use_cache": True}, {"use_cache": False}):
        assert _same(_loss_and_grads(resident, **use_cache), _loss_and_grads(model, **use_cache)), use_cache
    assert model.config.to_dict() == before
    # the reason it matters: the cache decides the packed rows' masks
    assert not torch.equal(_loss_and_grads(resident)[0], _loss_and_grads(resident, use_cache=False)[0])


def test_a_streamed_layer_runs_without_a_cache_where_the_config_asks_for_one():
    """With ``use_cache=True`` the model builds a KV cache and hands it to every layer; a
    streamed layer's backward recomputes it, which would write the cache twice, so the
    layers narrows runs get none in training. (Catches: the per-call cache drop removed.)"""
    model = build("llama")
    ns.stream(model, device="cpu")
    seen = []
    hooks = [
        layer.self_attn.register_forward_pre_hook(
            lambda m, args, kwargs: seen.append(kwargs.get("past_key_values")), with_kwargs=True
        )
        for layer in anatomy_of(model).layers
    ]
    try:
        model(**_packed_batch()).loss.backward()
    finally:
        for h in hooks:
            h.remove()
    assert model.config.use_cache is True
    assert len(seen) == 2 * anatomy_of(model).num_layers  # the forward and the recompute
    assert all(cache is None for cache in seen)


def _xglm(layerdrop: float):
    cfg = tf.XGLMConfig(
        vocab_size=256,
        d_model=64,
        ffn_dim=128,
        num_layers=3,
        attention_heads=4,
        max_position_embeddings=128,
        layerdrop=layerdrop,
    )
    torch.manual_seed(0)
    return with_adapter(tf.XGLMForCausalLM(cfg), "lora").train()


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_layerdrop_is_refused_whatever_the_rng_state(seed):
    """XGLM skips each layer with probability ``layerdrop`` in training; whether a streamed
    run met a skipped layer (and failed somewhere) used to depend on the RNG. Now the
    refusal comes first, the same for every seed, naming the field and the fix; a model
    whose decoder keeps its own copy of the value (XGLMModel.layerdrop) is refused too."""
    model = _xglm(0.3)
    torch.manual_seed(seed)
    with pytest.raises(ns.StreamSetupError, match=r"layerdrop=0\.3.*config\.layerdrop = 0"):
        ns.stream(model, device="cpu")
    assert getattr(model, "narrows_stream", None) is None  # refused before anything moved
    model.config.layerdrop = 0.0  # the config alone: the decoder still drops layers
    with pytest.raises(ns.StreamSetupError, match=r"\.layerdrop=0\.3"):
        ns.stream(model, device="cpu")


@pytest.mark.parametrize("inference", [False, True])
def test_alora_is_refused(inference):
    """aLoRA's per-call offsets reach the adapters through hooks that live only inside
    PeftModel.forward: a recomputed layer would run with its adapter off (its gradients
    silently zero). Refused, and the model is left as it was."""
    model = get_peft_model(
        tiny_model("llama", num_hidden_layers=2),
        LoraConfig(
            r=4,
            lora_alpha=8,
            alora_invocation_tokens=[5, 6],
            target_modules=["q_proj", "v_proj"],
            task_type="CAUSAL_LM",
        ),
    )
    with pytest.raises(ns.StreamSetupError, match="aLoRA adapter"):
        ns.stream(model, device="cpu", inference=inference)
    assert getattr(model, "narrows_stream", None) is None
