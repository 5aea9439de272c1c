"""Start-up self-check: one layer run streamed (autograd node, RNG replay, slab transfer,
the saved input's trip to host memory when the plan offloads it)
against the same layer run as resident training would, forward and backward, compared
with `torch.equal` — cheap (one layer, a few tokens) and needs no full residency."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from narrows.core import Anatomy

from ..errors import SelfCheckError
from ..execution.executor import LayerRun
from ..execution.offload import ActivationOffload
from ..execution.remat import LayerCall, StreamedLayer, checked_forward, layer_original, replaced_forwards
from ..execution.side_outputs import SideOutputs
from ..storage.engine import TransferEngine


class _Captured(Exception):
    pass


def _capture_layer_inputs(model: nn.Module, anat: Anatomy, device: torch.device) -> tuple[Any, tuple, dict]:
    """The arguments the model passes to its first layer for a short input (the model
    stops there: nothing past the embedding runs)."""
    got: dict[str, Any] = {}

    def capture(*args: Any, **kwargs: Any) -> None:
        got["args"], got["kwargs"] = args, kwargs
        raise _Captured

    ids = (torch.arange(8, device=device) * 7 + 3).remainder(anat.config.vocab_size).unsqueeze(0)
    try:
        with replaced_forwards(anat.layers[:1], lambda i: capture), torch.no_grad():
            model(input_ids=ids, use_cache=False)  # no cache built for a forward cut short
    except _Captured:
        pass
    if "args" not in got:
        raise SelfCheckError("self-check: the model never called its first decoder layer")
    args, kwargs = got["args"], dict(got["kwargs"])
    hidden = args[0] if args else kwargs.pop("hidden_states")
    return hidden, tuple(args[1:]), kwargs


def self_check(
    model: nn.Module, anat: Anatomy, engine: TransferEngine, offload: ActivationOffload | None = None
) -> None:
    device = engine.device
    layer = anat.layers[0]
    original = layer_original(layer)
    params = tuple(p for p in layer.parameters() if p.requires_grad)
    devices = [device.index] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"):  # leave the user's RNG alone
        hidden, args, kwargs = _capture_layer_inputs(model, anat, device)
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(hidden.shape, dtype=hidden.dtype, device=device, generator=g)
        grad_out = torch.randn(hidden.shape, dtype=hidden.dtype, device=device, generator=g)

        torch.manual_seed(1234)
        with engine.using(0), torch.enable_grad():
            h = x.clone().requires_grad_(True)
            out = original(h, *args, **kwargs)
            ref = [out.detach(), *torch.autograd.grad(out, [h, *params], grad_out, allow_unused=True)]

        torch.manual_seed(1234)
        with torch.enable_grad():
            h = x.clone().requires_grad_(True)
            run = LayerRun(0, layer, checked_forward(0, original), args, kwargs)
            call = LayerCall(run, engine, params, SideOutputs(layer, 0), offload)
            out = StreamedLayer.apply(call, h, *params)[0]
            got = [out.detach(), *torch.autograd.grad(out, [h, *params], grad_out, allow_unused=True)]

    names = ["output", "input gradient"] + [f"gradient of adapter parameter {i}" for i in range(len(params))]
    for name, a, b in zip(names, ref, got):
        same = (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        if not same:
            raise SelfCheckError(
                f"narrows.stream self-check failed: the {name} of layer 0 differs between streamed and resident "
                "execution, so streamed training would not reproduce resident training. This usually means a "
                "nondeterministic kernel or a layer with hidden state. Report it with `narrows doctor`; to train "
                "anyway (not bit-exact), pass check=False to narrows.stream.stream()."
            )
