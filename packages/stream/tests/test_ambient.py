"""Streaming under ``torch.autocast`` or ``sdpa_kernel``: the backward recompute replays
the forward's autocast and attention-backend settings, so streamed training stays
`torch.equal` to resident training under the same contexts (CPU bf16 autocast, the math
SDPA backend). Without the replay the recompute runs in full precision, or with another
attention kernel — the fault twins show it."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import assert_identical, build

import narrows.stream as ns
from narrows.core import anatomy_of, fuse_layers
from narrows.core.testing import tiny_batch
from narrows.stream.errors import StreamSetupError
from narrows.stream.execution import remat, tiling


def _train(streamed: bool, tile: int | None = None, **stream_kwargs) -> dict:
    model = build(num_hidden_layers=3, dropout=0.05)
    if streamed:
        ns.stream(model, None, device="cpu", seq_tile=tile, **stream_kwargs)
    elif tile is not None:
        ns.tile_sequence(model, tile)
    torch.manual_seed(0)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    record = {"loss": [], "grad": []}
    for step in range(2):
        for micro in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(**tiny_batch(seed=10 * step + micro)).loss / 2
            loss.backward()
            record["loss"].append(loss.detach())
        record["grad"] += [p.grad.clone() for p in params]
        opt.step()
        opt.zero_grad()
    record["weight"] = [p.detach().clone() for p in params]
    return record


def test_streamed_under_autocast_is_identical_to_resident():
    assert_identical(_train(False), _train(True))


def test_recompute_without_the_forwards_autocast_differs(monkeypatch):
    monkeypatch.setattr(remat, "ambient_as", lambda state: contextlib.nullcontext())
    with pytest.raises(AssertionError):
        assert_identical(_train(False), _train(True))


def test_graphs_under_autocast_are_identical_and_keyed_by_it():
    assert_identical(_train(False), _train(True, graphs=True))
    model = build(num_hidden_layers=3, dropout=0.0)
    ns.stream(model, None, device="cpu", graphs=True)
    for _ in range(2):  # a shape is captured when it comes round again
        model(**tiny_batch()).loss.backward()
    plain = model.narrows_stream.graphs.stats.captured
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**tiny_batch()).loss
        loss.backward()
    assert plain > 0
    assert (
        model.narrows_stream.graphs.stats.captured == 2 * plain
    )  # other graphs, not the full-precision ones


def test_step_mode_refuses_autocast():
    model = build(num_hidden_layers=3, dropout=0.0)
    ns.stream(model, None, device="cpu")
    trainer = ns.StepTrainer(model, lambda ps: torch.optim.AdamW(ps), grad_accum=2)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(StreamSetupError, match="autocast"):
        trainer.step([tiny_batch(seed=0), tiny_batch(seed=1)])


def test_tiled_mlp_under_autocast_streamed_is_identical_to_resident():
    assert_identical(_train(False, tile=4), _train(True, tile=4))


@pytest.mark.parametrize("fault", [False, True])
def test_mlp_tiles_recompute_under_the_forwards_autocast(monkeypatch, fault):
    """Every call of a tiled MLP's projection — forward and backward recompute — runs
    under bf16 autocast; the fault twin (no replay) recomputes in full precision."""
    if fault:
        monkeypatch.setattr(tiling, "ambient_as", lambda state: contextlib.nullcontext())
    model = build(num_hidden_layers=2, dropout=0.0)
    ns.tile_sequence(model, 4)
    down = anatomy_of(model).layers[0].mlp.down_proj
    seen, forward = [], down.forward

    def recording(*args, **kwargs):
        seen.append(torch.is_autocast_enabled("cpu"))
        return forward(*args, **kwargs)

    down.forward = recording
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**tiny_batch()).loss
    n_forward = len(seen)
    loss.backward()
    assert n_forward > 0 and len(seen) == 2 * n_forward  # each tile recomputed once
    assert all(seen) != fault


def _sdpa_model():
    model = build(num_hidden_layers=3, dropout=0.0)
    model.base_model.model.config._attn_implementation = "sdpa"
    return model


def _grads_under_math_sdpa(streamed: bool) -> list[torch.Tensor]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = _sdpa_model()
    if streamed:
        ns.stream(model, None, device="cpu")
    else:
        fuse_layers(model)  # what the stream's default kernels train
    with sdpa_kernel(SDPBackend.MATH):
        loss = model(**tiny_batch()).loss
    loss.backward()  # outside the context, as a training loop does
    return [p.grad.clone() for p in model.parameters() if p.requires_grad]


def test_streamed_under_an_sdpa_backend_is_identical_to_resident():
    assert all(torch.equal(a, b) for a, b in zip(_grads_under_math_sdpa(False), _grads_under_math_sdpa(True)))


@pytest.mark.parametrize("fault", [False, True])
def test_the_recompute_keeps_the_forwards_attention_backends(monkeypatch, fault):
    """Every attention call, forward and recompute, runs with only the math backend
    allowed; the fault twin (no replay) recomputes with the CPU's flash kernel allowed."""
    if fault:
        monkeypatch.setattr(remat, "ambient_as", lambda state: contextlib.nullcontext())
    seen, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append(torch.backends.cuda.flash_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    _grads_under_math_sdpa(True)
    step = seen[-6:]  # three layers, forward and recompute (stream()'s self-check ran some before)
    assert len(step) == 6 and any(step) == fault
