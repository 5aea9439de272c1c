"""The protocol with a second adapter type (what narrows-dora or a third party does)."""

import pytest
import torch
from torch import nn

from narrows.core import (
    AdapterType,
    adapter_type_of,
    adapter_views,
    register_adapter_type,
    registered_adapter_types,
)
from narrows.core.protocol import adapters as adapters_module
from narrows.core.testing import check_partition, tiny_model, with_adapter


class ScaledLinear(nn.Module):
    """A toy adapter: y = base(x) * (1 + scale), with one trainable vector."""

    def __init__(self, base: nn.Linear):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.scale = nn.Parameter(torch.zeros(base.out_features))

    def forward(self, x):
        return self.base(x) * (1 + self.scale)


class ScaledAdapter:
    name = "test-scaled"

    def matches(self, module):
        return isinstance(module, ScaledLinear)

    def base_layer(self, module):
        return module.base

    def trainable(self, module):
        return {"scale": ("scale", module.scale)} if module.scale.requires_grad else {}

    def variant(self, module):
        return "scaled"


@pytest.fixture
def scaled_registered():
    register_adapter_type(ScaledAdapter(), first=True)
    yield
    adapters_module._REGISTRY[:] = [t for t in adapters_module._REGISTRY if t.name != "test-scaled"]


def test_a_new_adapter_type_plugs_in(scaled_registered):
    model = tiny_model("llama").requires_grad_(False)
    for layer in model.model.layers:
        layer.mlp.down_proj = ScaledLinear(layer.mlp.down_proj)
    views = list(adapter_views(model))
    assert [v.name for v in views] == [f"model.layers.{i}.mlp.down_proj" for i in range(3)]
    v = views[0]
    assert v.variant == "scaled" and v.base is model.model.layers[0].mlp.down_proj.base
    assert list(v.trainable) == ["model.layers.0.mlp.down_proj.scale"]
    assert [s.name for s in v.frozen_slots()] == ["model.layers.0.mlp.down_proj.base.weight"]
    check_partition(model)


def test_peft_layers_are_seen_as_peft_lora():
    model = with_adapter(tiny_model("mistral"), "dora")
    views = list(adapter_views(model))
    assert len(views) == 3 * 7
    assert {v.type.name for v in views} == {"peft-lora"}
    roles = sorted(role for role, _ in views[0].trainable.values())
    assert roles == ["lora_A", "lora_B", "magnitude"]


def test_registration_is_checked():
    assert isinstance(registered_adapter_types()[0], AdapterType)
    with pytest.raises(TypeError, match="AdapterType"):
        register_adapter_type(object())
    with pytest.raises(ValueError, match="already registered"):
        register_adapter_type(adapters_module.PeftLoraAdapter())
    assert adapter_type_of(nn.Linear(2, 2)) is None
