import pytest
import torch
from torch import nn

from narrows.core import (
    SLAB_ALIGNMENT,
    SlabLayout,
    SlotMismatchError,
    assign,
    copies,
    frozen_slots,
    pointed_at,
    snapshot,
    trainable_parameters,
)
from narrows.core.testing import reachable_tensors, tiny_model, with_adapter


def _frozen_linear():
    lin = nn.Linear(8, 4)
    lin.register_buffer("scale", torch.ones(4))
    lin.requires_grad_(False)
    return lin


def test_slots_cover_frozen_parameters_and_buffers_only():
    model = with_adapter(tiny_model("llama"), "lora")
    slots = frozen_slots(model)
    names = {s.name for s in slots}
    assert "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight" in names
    assert "base_model.model.model.rotary_emb.inv_freq" in names
    assert not any("lora_" in n for n in names)
    assert all(k.split(".")[-2] in ("default",) for k in trainable_parameters(model))


def test_set_refuses_another_layout_and_names_the_slot():
    lin = _frozen_linear()
    weight = next(s for s in frozen_slots(lin) if s.name == "weight")
    with pytest.raises(SlotMismatchError, match=r"'weight'.*stride"):
        weight.set(torch.zeros(8, 4).t())  # same shape, transposed strides
    with pytest.raises(SlotMismatchError, match="float64"):
        weight.set(torch.zeros(4, 8, dtype=torch.float64))


def test_assign_checks_everything_before_changing_anything():
    lin = _frozen_linear()
    slots = frozen_slots(lin)
    before = [t.data_ptr() for t in snapshot(slots)]
    bad = [torch.zeros_like(t) for t in snapshot(slots)]
    bad[-1] = torch.zeros(5)
    with pytest.raises(SlotMismatchError):
        assign(slots, bad)
    assert [t.data_ptr() for t in snapshot(slots)] == before


def test_pointed_at_swaps_and_restores_in_place():
    lin = _frozen_linear()
    x = torch.randn(3, 8)
    ref = lin(x)
    weight_param = lin.weight
    slots = frozen_slots(lin)
    moved = copies(slots, "cpu")
    with pointed_at(slots, moved):
        assert lin.weight is weight_param  # same Parameter object, new storage
        assert lin.weight.data_ptr() == moved[0].data_ptr()
        assert torch.equal(lin(x), ref)
        moved[0].zero_()  # the module really reads the new storage
        assert not torch.equal(lin(x), ref)
    assert torch.equal(lin(x), ref)


def test_slab_layout_alignment_strides_and_roundtrip():
    tensors = [
        torch.randn(5, 7),
        torch.randn(7, 5).t(),  # non-contiguous: strides are kept
        torch.randint(0, 255, (33,), dtype=torch.uint8),
        torch.tensor(3.5),  # a 0-d tensor, like a QuantState offset
        torch.empty(0, 4),
        torch.randn(3, dtype=torch.bfloat16),
    ]
    layout = SlabLayout.of(tensors)
    assert all(e.offset % SLAB_ALIGNMENT == 0 for e in layout.entries)
    assert layout.nbytes % SLAB_ALIGNMENT == 0
    views = layout.pack(tensors, layout.empty())
    for t, v in zip(tensors, views):
        assert v.stride() == t.stride() and v.dtype == t.dtype and torch.equal(v, t)
    assert views[1].untyped_storage().data_ptr() == views[0].untyped_storage().data_ptr()  # one buffer


def test_slab_rejects_a_wrong_buffer():
    layout = SlabLayout.of([torch.randn(4)])
    with pytest.raises(ValueError, match="uint8 slab"):
        layout.views(torch.empty(layout.nbytes, dtype=torch.float32))


def test_crawler_finds_tensors_outside_parameters():
    lin = _frozen_linear()
    lin.cache = torch.randn(2)  # a plain tensor attribute the protocol does not know
    found = {path for path, _ in reachable_tensors(lin).values()}
    assert "cache" in found and "_parameters.weight" in found and "_buffers.scale" in found
