"""The one door into the fast layer: one `FastLayer` a decoder layer, whose parts are built
once and rebuilt exactly when the layer changes — each change below is compared with parts
built afresh from the layer as it now is (`build_parts`), so a signature that missed one
would keep stale parts and fail here."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from narrows.core import fuse_layers
from narrows.core.kernels.fastlayer import FastLayer, read_call
from narrows.core.kernels.fastlayer.parts import LayerParts, build_parts
from narrows.core.testing import tiny_batch, tiny_model, with_adapter


def _model(dropout=0.1):
    model = tiny_model("qwen2")
    for m in model.modules():
        if hasattr(m, "config"):
            m.config._attn_implementation = "sdpa"
    model = with_adapter(model, "lora", dropout=dropout).train()
    model.config.use_cache = False
    return model


def _layer(model) -> nn.Module:
    return model.base_model.model.model.layers[0]


def _described(parts: LayerParts | str | None):
    """What parts compute with: per linear its adapter tensors (by identity), scale and
    dropout; per group whether it runs blocked; the tile. A reason where refused."""
    if parts is None or isinstance(parts, str):
        return parts
    return (
        [
            (lin.name, id(lin.a), id(lin.b), lin.scaling, lin.dropout, id(lin.bias))
            for g in parts.groups
            for lin in g.linears
        ],
        [(g.blocked, g.lora_dtype) for g in parts.groups],
        parts.mlp_tile,
    )


def _agrees(layer: nn.Module) -> None:
    fast = FastLayer.of(layer)
    fresh = build_parts(layer, fast.lora_dtype)
    assert _described(fast.parts() or fast.why_not()) == _described(fresh)


def test_one_object_a_layer_built_once_over_training_steps():
    model = _model()
    report = fuse_layers(model)
    layer = _layer(model)
    assert layer.forward is FastLayer.of(layer)  # the resident door is the object itself
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for seed in range(3):
        model(**tiny_batch(seed=seed)).loss.backward()
        opt.step()
        opt.zero_grad()
    assert report.fused == [0, 1, 2]
    assert FastLayer.of(layer).builds == 1


def _add_hook(layer):
    layer.self_attn.q_proj.register_forward_hook(lambda *a: None)


def _unfreeze_bias(layer):
    layer.self_attn.q_proj.base_layer.bias.requires_grad_(True)


def _replace_b(layer):
    lin = layer.mlp.down_proj.lora_B["default"]
    lin.weight = nn.Parameter(lin.weight.detach().clone())


def _rescale(layer):
    layer.self_attn.o_proj.scaling["default"] = 0.5


def _second_adapter_active(model):
    from peft import LoraConfig

    model.add_adapter("other", LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    model.set_adapter("other")


CHANGES = {
    "eval mode (dropout off)": lambda model, layer: model.eval(),
    "a hook on q_proj": lambda model, layer: _add_hook(layer),
    "a frozen bias set to train": lambda model, layer: _unfreeze_bias(layer),
    "an adapter weight replaced": lambda model, layer: _replace_b(layer),
    "a scale changed": lambda model, layer: _rescale(layer),
    "another adapter active": lambda model, layer: _second_adapter_active(model),
    "adapters disabled": lambda model, layer: model.base_model.disable_adapter_layers(),
    "a module replaced": lambda model, layer: setattr(layer.mlp, "down_proj", nn.Linear(128, 64, bias=False)),
    "eager attention": lambda model, layer: setattr(layer.self_attn.config, "_attn_implementation", "eager"),
    "float32 adapters": lambda model, layer: setattr(FastLayer.of(layer), "lora_dtype", torch.float32),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_change_to_the_layer_rebuilds_its_parts(change):
    model = _model()
    layer = _layer(model)
    fast = FastLayer.of(layer)
    before = _described(fast.parts())
    assert before is not None and fast.builds == 1
    CHANGES[change](model, layer)
    _agrees(layer)
    assert fast.builds == 2 and _described(fast.parts() or fast.why_not()) != before
    fast.parts()
    assert fast.builds == 2  # and kept again


def test_a_copied_model_gets_its_own_fast_layers_with_the_same_options():
    model = _model()
    fuse_layers(model, recompute=True, lora_dtype=torch.float32)
    twin = copy.deepcopy(model)
    a, b = FastLayer.of(_layer(model)), FastLayer.of(_layer(twin))
    assert a is not b and _layer(twin).forward is b
    assert (b.recompute, b.lora_dtype) == (True, torch.float32)
    assert b.parts().qkv.linears[0].a is _layer(twin).self_attn.q_proj.lora_A["default"].weight


def test_the_call_parser_reads_positional_and_keyword_calls_alike():
    model = _model()
    layer = _layer(model)
    cos, sin, mask = torch.ones(1, 4, 16), torch.zeros(1, 4, 16), torch.ones(1, 1, 4, 4, dtype=torch.bool)
    by_name = read_call(layer, (), {"attention_mask": mask, "position_embeddings": (cos, sin)})
    by_place = read_call(layer, (mask, None, None, False, (cos, sin)), {})
    assert by_name == by_place and by_name.mask is mask and by_name.cos is cos
    assert read_call(layer, (), {"attention_mask": mask}) is None  # no rotary tables
    assert read_call(layer, (), {"position_embeddings": (cos, sin), "is_causal": False}) is None


def test_a_fused_model_is_freed_when_its_user_lets_it_go():
    """The fast layers hold their layers weakly: a fused, trained model does not outlive its
    last reference (the GPU memory it holds would not come back)."""
    import gc
    import weakref

    model = _model()
    fuse_layers(model)
    model(**tiny_batch()).loss.backward()
    gone = [weakref.ref(layer) for layer in model.base_model.model.model.layers]
    del model
    gc.collect()
    assert all(ref() is None for ref in gone)
