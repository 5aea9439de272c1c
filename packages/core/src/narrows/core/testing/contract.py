"""The adapter-layer protocol's contract, as plain functions any test suite can call.

Every adapter type and every architecture runs the same checks (narrows-core's tests run
them over the tiny models; narrows-dora runs them over its layer). Each function raises
AssertionError with a message saying which tensor or slot broke the contract.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from ..protocol.adapters import adapter_views
from ..protocol.anatomy import anatomy_of
from ..protocol.slab import SlabLayout
from ..protocol.slots import FrozenSlot, assign, frozen_slots, snapshot, trainable_parameters

__all__ = [
    "check_adapter_views",
    "check_gradients_flow",
    "check_layer_swap_roundtrip",
    "check_partition",
    "check_slots_cover_forward",
    "forward_backward",
    "reachable_tensors",
    "run_contract",
]


def forward_backward(model: nn.Module, batch: dict[str, Tensor]) -> list[Tensor]:
    """Loss (or logits when the batch has no labels) and the gradient of every trainable
    parameter: the numbers that must not change when frozen storage moves."""
    out = model(**batch)
    if "labels" not in batch:
        return [out.logits.detach()]
    params = list(trainable_parameters(model).values())
    grads = torch.autograd.grad(out.loss, params) if params else []
    return [out.loss.detach(), *grads]


def _equal(a: Sequence[Tensor], b: Sequence[Tensor], what: str) -> None:
    assert len(a) == len(b), f"{what}: {len(a)} vs {len(b)} tensors"
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), (
            f"{what}: tensor {i} differs (max abs diff {(x.float() - y.float()).abs().max()})"
        )


def _storage(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


def reachable_tensors(module: nn.Module) -> dict[int, tuple[str, Tensor]]:
    """Every tensor reachable from `module`'s attributes (parameters, buffers, plain tensor
    attributes, and tensors inside helper objects such as a bitsandbytes QuantState), by
    storage. Found by crawling, independently of `frozen_slots`, so the two can be compared."""
    found: dict[int, tuple[str, Tensor]] = {}
    seen: set[int] = set()

    def walk(obj: object, path: str, depth: int) -> None:
        if id(obj) in seen or depth > 6 or isinstance(obj, nn.Module | str | bytes | int | float | type):
            return
        seen.add(id(obj))
        if isinstance(obj, Tensor):
            if obj.numel() and obj.device.type != "meta":
                found.setdefault(_storage(obj), (path, obj.detach()))  # the storage, not the holder
            for k, v in vars(obj).items() if hasattr(obj, "__dict__") else ():
                walk(v, f"{path}.{k}", depth + 1)  # Params4bit.quant_state
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{path}.{k}", depth + 1)
        elif isinstance(obj, list | tuple | set):
            for i, v in enumerate(obj):
                walk(v, f"{path}[{i}]", depth + 1)
        elif hasattr(obj, "__dict__") and not callable(obj):
            for k, v in vars(obj).items():
                walk(v, f"{path}.{k}", depth + 1)

    for name, m in module.named_modules():
        for k, v in vars(m).items():
            if k != "_modules":
                walk(v, f"{name}.{k}" if name else k, 0)
    return found


def check_partition(module: nn.Module) -> list[FrozenSlot]:
    """Every parameter is either trainable or a frozen slot, never both, never neither;
    every tensor reachable from the module is a slot or a trainable parameter; every
    trainable parameter belongs to an adapter view; slot names are unique."""
    slots = frozen_slots(module)
    covered = {_storage(s.tensor) for s in slots} | {
        _storage(p) for p in trainable_parameters(module).values()
    }
    missed = [path for key, (path, _) in reachable_tensors(module).items() if key not in covered]
    assert not missed, f"tensors the module holds that are neither frozen slots nor trainable: {missed[:6]}"
    names = [s.name for s in slots]
    assert len(names) == len(set(names)), (
        f"duplicate slot names: {sorted(n for n in names if names.count(n) > 1)}"
    )
    trainable = trainable_parameters(module)
    slot_params = {id(s.owner) for s in slots if s.kind == "parameter"}
    for name, p in module.named_parameters():
        is_slot, is_train = id(p) in slot_params, name in trainable
        assert is_slot != is_train, f"parameter {name!r}: frozen slot={is_slot}, trainable={is_train}"
    in_views = {id(p) for v in adapter_views(module) for _, p in v.trainable.values()}
    for name, p in trainable.items():
        assert id(p) in in_views, f"trainable parameter {name!r} belongs to no adapter view"
    return slots


def check_adapter_views(model: nn.Module, variant: str, expected_layers: int) -> None:
    """One view per adapted module, each with the roles its variant trains, and its base
    layer's weight among its frozen slots."""
    views = list(adapter_views(model))
    assert len(views) == expected_layers, f"expected {expected_layers} adapter layers, found {len(views)}"
    want = {"lora_A", "lora_B"} | ({"magnitude"} if variant == "dora" else set())
    for v in views:
        assert v.variant == variant, f"{v.name}: variant {v.variant!r}, expected {variant!r}"
        roles = {role for role, _ in v.trainable.values()}
        assert roles == want, f"{v.name}: trainable roles {sorted(roles)}, expected {sorted(want)}"
        # the base's weights (a Linear's weight, a fused MoE block's expert tensors) are frozen slots
        owners = {id(s.owner) for s in v.frozen_slots() if s.kind == "parameter"}
        base_ws = [p for p in v.base.parameters(recurse=False)]
        assert base_ws and all(id(p) in owners for p in base_ws), (
            f"{v.name}: base weight is not a frozen slot"
        )


def _poison(t: Tensor) -> None:
    with torch.no_grad():
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype == torch.bool:
            t.logical_not_()
        else:
            t.bitwise_not_()


def check_slots_cover_forward(model: nn.Module, run: Callable[[], list[Tensor]]) -> None:
    """The frozen slots are *everything* frozen the forward reads: point them all at copies
    packed into one slab, poison the original storage, and the results must not change
    (any tensor read from outside the slots would now be NaN or bit-flipped). Then move
    everything back and check again."""
    reference = run()
    slots = frozen_slots(model)
    originals = snapshot(slots)
    _, _, views = SlabLayout.packed(originals, originals[0].device)
    trainable = {_storage(p) for p in trainable_parameters(model).values()}
    # poison every frozen tensor the crawler finds, whether or not it is a slot
    victims = [t for key, (_, t) in reachable_tensors(model).items() if key not in trainable]
    saved = [v.clone() for v in victims]  # to repair them afterwards
    assign(slots, views)
    try:
        for v in victims:
            _poison(v)
        _equal(run(), reference, "after moving every frozen slot into a slab")
    finally:
        with torch.no_grad():
            for v, s in zip(victims, saved):
                v.copy_(s)
        assign(slots, originals)
    _equal(run(), reference, "after moving the slots back")


def check_layer_swap_roundtrip(model: nn.Module, run: Callable[[], list[Tensor]]) -> None:
    """One decoder layer at a time (what streaming does): its slots pointed at a slab
    copy and back leaves loss and gradients bit-identical."""
    reference = run()
    anat = anatomy_of(model)
    for path, layer in zip(anat.layer_paths, anat.layers):
        slots = frozen_slots(layer, prefix=path)
        originals = snapshot(slots)
        _, _, views = SlabLayout.packed(originals, originals[0].device)
        assign(slots, views)
        try:
            assert all(s.tensor.data_ptr() == v.data_ptr() for s, v in zip(slots, views)), (
                f"{path}: a slot did not take its slab view"
            )
            _equal(run(), reference, f"layer {path} in a slab")
        finally:
            assign(slots, originals)
        _equal(run(), reference, f"layer {path} moved back")


def check_gradients_flow(model: nn.Module, batch: dict[str, Tensor]) -> None:
    """An inference pass (eval, no grad — what triggers bitsandbytes' in-place CPU
    repacking) followed by the protocol's entry point leaves loss and gradients exactly as
    they were, and every adapter parameter receives a non-zero gradient."""
    reference = forward_backward(model, batch)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        model(**{k: v for k, v in batch.items() if k != "labels"})
    model.train(was_training)
    frozen_slots(model)  # the protocol's entry point: it must make the model safe again
    after = forward_backward(model, batch)
    _equal(after, reference, "after an inference pass")
    names = list(trainable_parameters(model))
    dead = [n for n, g in zip(names, after[1:]) if "lora_A" in n and not g.abs().sum() > 0]
    assert not dead, f"adapter parameters with zero gradient: {dead[:4]}"


def run_contract(model: nn.Module, batch: dict[str, Tensor], *, variant: str | None) -> None:
    """The whole suite on one (possibly PEFT-wrapped) model. `variant` is the adapter
    variant the model carries (``"lora"``, ``"dora"``) or None for a fully frozen model."""
    anat = anatomy_of(model)
    slots = check_partition(model)
    assert slots, "a frozen model must expose frozen slots"
    if variant is not None:
        n_linear = sum(1 for layer in anat.layers for v in adapter_views(layer))
        assert n_linear > 0, "no adapter layers inside the decoder layers"
        check_adapter_views(model, variant, n_linear)

    def run() -> list[Tensor]:
        return forward_backward(model, batch)

    check_slots_cover_forward(model, run)
    check_layer_swap_roundtrip(model, run)
    if variant is not None:
        check_gradients_flow(model, batch)
