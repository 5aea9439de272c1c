"""The layer executor is the one seam through which narrows runs its layers: an executor
installed on a streamed model is called for every streamed layer's forward and backward
(sequential steps, block-major steps, hooked side outputs), and training through one
that only records is `torch.equal` to training through the default. A path that ran a
layer around the executor would leave a layer unrecorded here."""

from __future__ import annotations

import torch
from helpers import assert_identical, build, train

import narrows.stream as ns
from narrows.core import anatomy_of
from narrows.core.testing import tiny_batch
from narrows.stream import api
from narrows.stream.execution.executor import EagerExecutor, SideGrads


class Recording(EagerExecutor):
    """The eager executor, writing down each call (and the side gradients it was given)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.side: list[int] = []  # how many side gradients each backward received

    def forward(self, run, hidden):
        self.calls.append(("forward", run.index))
        return super().forward(run, hidden)

    def backward(self, run, hidden, grad_out, params, side: SideGrads | None = None):
        self.calls.append(("backward", run.index))
        self.side.append(len(side.grads) if side is not None else 0)
        return super().backward(run, hidden, grad_out, params, side)


def _record(monkeypatch) -> list[Recording]:
    """Every model streamed from now on runs its layers through a new `Recording`."""
    made: list[Recording] = []

    def executor_for(plan, device, kernels="fast", attention=None):
        made.append(Recording())
        return made[-1]

    monkeypatch.setattr(api, "executor_for", executor_for)
    return made


def _layers(model) -> int:
    return len(anatomy_of(model).layers)


def _each_layer_both_ways(executor: Recording, n: int, times: int) -> None:
    for kind in ("forward", "backward"):
        seen = sorted(i for k, i in executor.calls if k == kind)
        assert seen == sorted(list(range(n)) * times), kind


def test_a_sequential_step_runs_every_layer_through_the_installed_executor(monkeypatch):
    expected = train(build(dropout=0.05), steps=2, grad_accum=2, stream_kwargs={})
    recording = _record(monkeypatch)
    model = build(dropout=0.05)
    got = train(model, steps=2, grad_accum=2, stream_kwargs={})
    (executor,) = recording
    assert model.narrows_stream.executor is executor and model.narrows_stream.graphs is None
    assert not model.narrows_stream.plan.whole
    _each_layer_both_ways(executor, _layers(model), times=4)
    assert_identical(expected, got)


def test_a_block_major_step_runs_every_layer_through_the_installed_executor(monkeypatch):
    def stepped(model):
        torch.manual_seed(0)
        ns.stream(model, device="cpu", offload="off")
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-2)
        trainer = ns.StepTrainer(model, opt, grad_accum=2)
        stats = [trainer.step([tiny_batch(seed=10 * s + k) for k in range(2)]) for s in range(3)]
        assert [s.mode for s in stats][1:] == ["block-major"] * 2  # the first learns the RNG draws
        return {"weight": [p.detach().clone() for p in params]}

    expected = stepped(build(dropout=0.05))
    recording = _record(monkeypatch)
    model = build(dropout=0.05)
    got = stepped(model)
    (executor,) = recording
    # the capture runs no layer: every forward and backward of the three steps is the executor's
    _each_layer_both_ways(executor, _layers(model), times=6)
    assert_identical(expected, got)


def test_side_outputs_reach_the_executors_backward(monkeypatch):
    """MoE router logits (hooked tensors, `side_outputs`): their gradients go to the
    executor's backward with the output's, and training matches the default executor."""
    cfg = dict(arch="mixtral", dropout=0.0, output_router_logits=True, router_aux_loss_coef=0.02)
    expected = train(build(**cfg), steps=2, grad_accum=2, stream_kwargs={})
    recording = _record(monkeypatch)
    model = build(**cfg)
    got = train(model, steps=2, grad_accum=2, stream_kwargs={})
    (executor,) = recording
    _each_layer_both_ways(executor, _layers(model), times=4)
    assert all(n > 0 for n in executor.side)
    assert_identical(expected, got)
