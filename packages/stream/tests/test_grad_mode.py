"""Grad mode inside a streamed layer: the layer's forward must run with grad enabled, exactly
as resident training runs it (`StreamedLayer.forward` wraps the call in
``torch.enable_grad()``). ``autograd.Function.forward`` runs under no_grad by default, and
on some kernels and devices grad mode picks another code path; the CPU parity gate does not
notice a no_grad forward, so this test looks at the mode itself, seen from inside the layer.
"""

from __future__ import annotations

import pytest
import torch
from helpers import build

import narrows.stream as ns
from narrows.core import anatomy_of
from narrows.core.testing import tiny_batch


def _record_grad_mode(model, phase: list[str]) -> tuple[list[tuple[str, int, bool]], list]:
    """Forward PRE-hooks on every decoder layer's attention and MLP: (phase, layer, grad mode)
    at the moment the layer's own code reaches them."""
    seen: list[tuple[str, int, bool]] = []
    handles = []
    for i, layer in enumerate(anatomy_of(model).layers):
        for sub in (layer.self_attn, layer.mlp):

            def pre(module, args, i=i):
                seen.append((phase[0], i, torch.is_grad_enabled()))

            handles.append(sub.register_forward_pre_hook(pre))
    return seen, handles


def _steps(model, micro_steps: int = 2) -> list[tuple[str, int, bool]]:
    """A few training micro-steps (forward then backward), grad mode recorded by phase."""
    phase = ["forward"]
    seen, handles = _record_grad_mode(model, phase)
    try:
        torch.manual_seed(0)
        for micro in range(micro_steps):
            phase[0] = "forward"
            loss = model(**tiny_batch(seed=100 + micro)).loss
            phase[0] = "backward"
            loss.backward()
    finally:
        for h in handles:
            h.remove()
    return seen


@pytest.mark.parametrize("dropout", [0.0, 0.05])
def test_streamed_layer_forward_runs_with_grad_on_as_resident_training_does(dropout):
    resident = _steps(build(dropout=dropout))
    streamed_model = build(dropout=dropout)
    ns.stream(streamed_model, device="cpu")  # hooks go on after: the start-up self-check is not recorded
    streamed = _steps(streamed_model)

    layers = anatomy_of(streamed_model).num_layers
    forward = [(i, on) for p, i, on in streamed if p == "forward"]
    # resident training: each layer once per micro-step, in order, grad on
    assert resident == [("forward", i, True) for _ in range(2) for i in range(layers) for _ in range(2)]
    # streamed forward: the same calls in the same order, with the same grad mode
    assert forward == [(i, on) for _, i, on in resident], (
        "a streamed layer's forward did not see the grad mode resident training runs it with "
        f"(resident: all True; streamed forward saw {sorted({on for _, on in forward})})"
    )
    # the backward recompute runs each layer again, in reverse, and differentiates it: grad on
    backward = [(i, on) for p, i, on in streamed if p == "backward"]
    assert backward == [(i, True) for _ in range(2) for i in reversed(range(layers)) for _ in range(2)]


def test_streamed_evaluation_runs_without_grad_as_resident_evaluation_does():
    """Under ``torch.no_grad()`` (evaluation) a streamed layer sees grad off, like a resident one."""
    batch = tiny_batch(seed=7)

    def evaluate(model):
        phase = ["eval"]
        seen, handles = _record_grad_mode(model, phase)
        try:
            with torch.no_grad():
                out = model(**batch).loss
        finally:
            for h in handles:
                h.remove()
        return seen, out

    resident_seen, resident_loss = evaluate(build().eval())
    streamed_model = build()
    ns.stream(streamed_model, device="cpu")
    streamed_seen, streamed_loss = evaluate(streamed_model.eval())
    assert streamed_seen == resident_seen and {on for _, _, on in resident_seen} == {False}
    assert torch.equal(resident_loss, streamed_loss)
