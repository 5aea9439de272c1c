"""Slab re-pointing: once `stream()` has parked a decoder layer, nothing the layer runs may
read the storage its frozen tensors had before. Every frozen parameter, buffer and NF4
quantisation-state tensor is copied into the layer's host slab and its slot re-pointed
(`park_layer`: snapshot, pack, assign); resident layers are then re-pointed again at their
device copy. A layer left pointing at its original storage would still train correctly
while that storage happens to hold the same bytes, so this test keeps the originals alive,
poisons them (NaN, 0xFF bytes) right after `stream()`, and requires the streamed run to stay
bit-identical to an unpoisoned resident one — for fully streamed, partly resident and fully
resident plans, on a float and an NF4 base.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_identical, build, train

import narrows.stream as ns
from narrows.core import anatomy_of, frozen_slots, snapshot, trainable_parameters
from narrows.core.testing import reachable_tensors

NF4 = pytest.param("nf4", marks=pytest.mark.bnb)
CFG = dict(arch="llama", kind="lora", dropout=0.05, num_hidden_layers=4)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _original_frozen_tensors(model) -> list[torch.Tensor]:
    """References to every frozen tensor the decoder layers hold now: their frozen slots
    (parameter ``.data``, buffers, NF4 quant state) and, found independently by crawling,
    anything else frozen a layer holds. Holding them keeps the original storage alive."""
    anat = anatomy_of(model)
    trainable = {_storage(p) for p in trainable_parameters(model).values()}
    found: dict[int, torch.Tensor] = {}
    for path, layer in zip(anat.layer_paths, anat.layers):
        tensors = snapshot(frozen_slots(layer, prefix=path))
        tensors += [t for _, t in reachable_tensors(layer).values()]
        for t in tensors:
            if t.numel() and _storage(t) not in trainable:
                found.setdefault(id(t), t)
    return list(found.values())


def _poison(tensors: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for t in tensors:
            if t.is_floating_point():
                t.fill_(float("nan"))
            elif t.dtype == torch.uint8:  # NF4 packed weights, nested absmax
                t.fill_(0xFF)
            elif t.dtype == torch.bool:
                t.logical_not_()
            else:
                t.bitwise_not_()


def _is_poisoned(t: torch.Tensor) -> bool:
    if t.is_floating_point():
        return bool(torch.isnan(t).all())
    return t.dtype != torch.uint8 or bool((t == 0xFF).all())


def _budget(residency: str, cfg: dict):
    if residency == "streamed":
        return None
    if residency == "resident":
        return "fit"  # the CPU is the device: every layer stays resident
    p = ns.plan(build(**cfg), None, device="cpu", offload="off")
    return p.predicted_peak + p.layer_bytes[0]  # every saved input kept, and one resident layer (of four)


@pytest.mark.parametrize("residency", ["streamed", "partly-resident", "resident"])
@pytest.mark.parametrize("base", ["float", NF4])
def test_layers_never_read_their_original_storage_after_stream(base, residency):
    if base == "nf4":
        pytest.importorskip("bitsandbytes")
    cfg = dict(CFG, base=base)
    reference = train(build(**cfg), steps=2)

    model = build(**cfg)
    originals = _original_frozen_tensors(model)
    assert originals
    ns.stream(model, _budget(residency, cfg), device="cpu")
    layers = anatomy_of(model).num_layers
    resident = len(model.narrows_stream.plan.resident)
    assert resident == {"streamed": 0, "partly-resident": 1, "resident": layers}[residency]

    # no frozen tensor a layer holds after stream() shares storage with an original
    old = {_storage(t) for t in originals}
    for i, layer in enumerate(anatomy_of(model).layers):
        still = [path for key, (path, _) in reachable_tensors(layer).items() if key in old]
        assert not still, f"layer {i} still points at its original storage after stream(): {still[:4]}"

    _poison(originals)  # what a layer that was not re-pointed would now read
    assert all(_is_poisoned(t) for t in originals)
    streamed = train(model, steps=2)  # already streamed: train() only runs the loop
    assert all(_is_poisoned(t) for t in originals)  # nothing wrote the originals back
    assert_identical(reference, streamed)
