"""Step mode with the optimizer state in host memory (a plan with `host_state="optimizer"`): each
layer updated as soon as its gradients are complete, or, with clipping, after the total
norm — `torch.equal` to resident sequential accumulation followed by `clip_grad_norm_`
and one `optimizer.step()`. Each gate has a fault-injected twin."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_identical, build
from test_step_mode import STEPS, _batches, _optimizer, _record, _scheduler, _seed, resident

import narrows.stream as ns
from narrows.stream.errors import StreamSetupError
from narrows.stream.stepmode.host_optimizer import HostOptimizer
from narrows.stream.stepmode.host_params import HostAdapters

G = 3


def _trainer(clip, dropout, optimizer=_optimizer, device="cpu", adapters=False, **stream_kwargs):
    model = build("llama", dropout=dropout)
    torch.manual_seed(0)
    stream_kwargs.setdefault("offload", "off")
    # the plan decides what waits in host memory; the trainer follows it
    stream_kwargs.setdefault("host_state", "adapters" if adapters else "optimizer")
    ns.stream(model, device=device, **stream_kwargs)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer(params)
    trainer = ns.StepTrainer(model, opt, grad_accum=G, max_grad_norm=clip, scheduler=_scheduler(opt))
    return model, params, opt, trainer


def hosted(
    clip=0.5, dropout=0.05, steps=range(STEPS), trainer=None, device="cpu", adapters=False, **stream_kwargs
):
    _, params, opt, trainer = trainer or _trainer(
        clip, dropout, device=device, adapters=adapters, **stream_kwargs
    )
    stats = [trainer.step(_batches(step, G)) for step in steps]
    return trainer, stats, _record(params, opt, [])  # losses: compared through the weights


def _reference(clip, dropout, device="cpu"):
    ref = resident(dropout=dropout, clip=clip, g=G, device=device)
    return {k: ref[k] for k in ("weight", "adam")}


@pytest.mark.parametrize("clip", [None, 0.5])
def test_host_optimizer_is_identical_to_resident(clip):
    """Dropout on: the first step learns the RNG draws in sequential order (the update
    runs after it, group by group), the others run block-major."""
    _, stats, got = hosted(clip=clip)
    assert [s.mode for s in stats][1:] == ["block-major"] * (STEPS - 1)
    assert_identical(_reference(clip, 0.05), got)
    if clip is not None:
        assert all(s.grad_norm > clip for s in stats)  # clipping really scaled the gradients


def test_without_clipping_each_layer_updates_during_backward():
    """Each optimizer.step() of a block-major step sees exactly one layer's gradients, last
    layer first, while the earlier layers have none yet."""
    model, params, opt, trainer = _trainer(None, 0.0)
    layers = trainer.layer_params
    seen: list[list[int]] = []
    real = opt.step

    def step(*a, **k):
        seen.append([i for i, ps in enumerate(layers) if any(p.grad is not None for p in ps)])
        return real(*a, **k)

    opt.step = step
    hosted(clip=None, dropout=0.0, trainer=(model, params, opt, trainer))
    n = len(layers)
    assert seen == [[i] for i in reversed(range(n))] * STEPS


def test_state_waits_in_host_buffers_between_steps():
    """Between steps every per-element state tensor is the host buffer narrows allocated
    once; during an update it is a device copy (on a CPU run, a copy all the same)."""
    model, params, opt, trainer = _trainer(0.5, 0.0)
    during = []
    real = opt.step

    def step(*a, **k):
        out = real(*a, **k)
        during.extend(opt.state[p]["exp_avg"] for p in params if p.grad is not None)
        return out

    opt.step = step
    hosted(dropout=0.0, trainer=(model, params, opt, trainer))
    buffers = trainer.host_optimizer._host
    for p in params:
        for k in ("exp_avg", "exp_avg_sq"):
            assert opt.state[p][k] is buffers[(id(p), k)]
    assert during and not any(t is buffers[(id(p), "exp_avg")] for t in during for p in params)


def test_clipping_needs_every_gradient_first(monkeypatch):
    """Fault injection: updating each layer when its gradients are complete although
    clipping was asked for (the total norm is not known yet) changes training."""
    monkeypatch.setattr(
        HostOptimizer,
        "ready",
        lambda self, params: HostOptimizer._update(self, [p for p in params if p.grad is not None]),
    )
    _, _, got = hosted(clip=0.5, dropout=0.0)
    with pytest.raises(AssertionError):
        assert_identical(_reference(0.5, 0.0), got)


@pytest.mark.parametrize("adapters", [False, True])
def test_resume_from_a_checkpoint_is_exact(adapters):
    """Stop after two steps, keep adapters, optimizer, scheduler and RNG state; a fresh
    model and trainer that load them end the third step where an uninterrupted run does
    (with the adapters in host memory too: the load writes into their host buffers; no
    dropout there, since a plan with the adapters in host memory has no room for the
    sequential step that learns the RNG draws)."""
    dropout = 0.0 if adapters else 0.05
    trainer, _, _ = hosted(steps=range(2), adapters=adapters, dropout=dropout)
    params = trainer.params
    saved = {
        "weights": [p.detach().clone() for p in params],
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.scheduler.state_dict(),
        "rng": torch.get_rng_state(),
    }
    fresh = _trainer(0.5, dropout, adapters=adapters)
    _, params2, opt2, trainer2 = fresh
    with torch.no_grad():
        for p, w in zip(params2, saved["weights"]):
            p.copy_(w)
    opt2.load_state_dict(saved["optimizer"])
    trainer2.scheduler.load_state_dict(saved["scheduler"])
    torch.set_rng_state(saved["rng"])
    _, stats, got = hosted(steps=[2], trainer=fresh)
    if dropout:
        assert stats[0].mode.startswith("sequential (learning")  # a new trainer learns the draws again
    assert_identical(_reference(0.5, dropout), got)


def test_an_optimizer_that_reads_more_than_its_parameter_is_refused():
    class Custom(torch.optim.AdamW):  # not torch's own: narrows cannot know what it reads
        pass

    with pytest.raises(StreamSetupError, match="one layer at a time"):
        _trainer(None, 0.0, optimizer=lambda ps: Custom(ps))
    with pytest.raises(StreamSetupError, match="one layer at a time"):
        _trainer(None, 0.0, optimizer=lambda ps: torch.optim.LBFGS(ps))


# ---- adapter parameters in host memory too (host_state="adapters") ----------------------
@pytest.mark.parametrize("clip", [None, 0.5])
def test_adapters_in_host_memory_are_identical_to_resident(clip):
    """Between steps every adapter parameter's values are its host buffer; training is
    `torch.equal` to the resident reference (no dropout: the plan leaves no room for a
    sequential step; seeded dropout is `test_planned_adapters_in_host_memory_need_block_major_steps`)."""
    trainer, stats, got = hosted(clip=clip, dropout=0.0, adapters=True)
    assert [s.mode for s in stats] == ["block-major"] * STEPS
    assert_identical(_reference(clip, 0.0), got)
    assert all(trainer.adapters.is_home(p) for ps in trainer.layer_params for p in ps)
    assert trainer.adapters.bytes_d2h > 0


def _off_home_while_each_layer_runs(trainer):
    """For each call of a layer's MLP: the layers whose adapters are not in host memory."""
    seen = []
    for i, layer in enumerate(trainer.anat.layers):

        def hook(module, args, i=i):
            seen.append(
                (
                    i,
                    {
                        j
                        for j, ps in enumerate(trainer.layer_params)
                        if any(not trainer.adapters.is_home(p) for p in ps)
                    },
                )
            )

        layer.mlp.register_forward_pre_hook(hook)
    return seen


@pytest.mark.parametrize("clip", [None, 0.5])
def test_one_layer_of_adapters_on_the_device_at_a_time(clip):
    """Block-major, the device holds only the running layer's adapters, in the forward
    and in the backward's recompute. Catches a `bring` that never copies (none would be
    off home) or a `park` that is skipped (earlier layers would stay)."""
    model, params, opt, trainer = _trainer(clip, 0.0, adapters=True)
    seen = _off_home_while_each_layer_runs(trainer)
    _, stats, got = hosted(clip=clip, dropout=0.0, trainer=(model, params, opt, trainer))
    assert [s.mode for s in stats] == ["block-major"] * STEPS
    assert seen and all(off == {i} for i, off in seen)
    assert_identical(_reference(clip, 0.0), got)


def test_each_layers_adapters_come_to_the_same_device_addresses():
    """Block-major, each layer's adapters land in one device slot at the same offsets at
    every use, forward and backward, step after step (what a graph's replay reads); and
    through the graphs' buffer path (emulated on a CPU, no layer refused) training is
    unchanged."""
    model, params, opt, trainer = _trainer(0.5, 0.0, adapters=True, graphs=True)
    where: dict[int, set] = {}
    bring = trainer.adapters.bring

    def recorded(ps):
        bring(ps)
        ps = list(ps)
        for i, layer_ps in enumerate(trainer.layer_params):
            if ps and {id(p) for p in ps} == {id(p) for p in layer_ps}:
                where.setdefault(i, set()).add(tuple(p.data_ptr() for p in layer_ps))

    trainer.adapters.bring = recorded
    _, stats, got = hosted(clip=0.5, dropout=0.0, trainer=(model, params, opt, trainer))
    assert [s.mode for s in stats] == ["block-major"] * STEPS
    assert_identical(_reference(0.5, 0.0), got)
    graphed = trainer.handle.graphs.stats
    assert not graphed.refused and graphed.replays > 0, graphed
    assert len(where) == len(trainer.anat.layers) and all(len(ptrs) == 1 for ptrs in where.values())
    slot = trainer.adapters._slot
    assert {ptrs.pop()[0] for ptrs in where.values()} == {slot.data_ptr()}  # each layer's first at its start


def test_a_layer_brought_while_another_is_in_the_slot_gets_fresh_copies():
    """Fault twin of the slot's one rule: a second layer brought before the first is
    parked must not overwrite it."""
    *_, trainer = _trainer(0.5, 0.0, adapters=True)
    first, second = trainer.layer_params[0], trainer.layer_params[1]
    values = [p.detach().clone() for p in first]
    trainer.adapters.bring(first)
    trainer.adapters.bring(second)
    slot = trainer.adapters._slot
    assert all(p.data_ptr() == slot.data_ptr() for p in first[:1])
    assert all(not (slot.data_ptr() <= p.data_ptr() < slot.data_ptr() + slot.numel()) for p in second)
    assert all(torch.equal(p, v) for p, v in zip(first, values))
    trainer.adapters.park(first + second, changed=False)


def test_two_layers_adapters_never_share_the_slot():
    """Bringing several layers' adapters at once (every layer's, for a sequential step or
    `adapters_to_device`) gives fresh copies: the slot holds one layer's."""
    model, params, opt, trainer = _trainer(0.5, 0.0, adapters=True)
    hosted(steps=range(1), dropout=0.0, trainer=(model, params, opt, trainer))
    values = [p.detach().clone() for p in params]
    trainer.adapters_to_device()
    ptrs = [p.data_ptr() for p in params]
    assert len(set(ptrs)) == len(ptrs)
    assert all(torch.equal(p, v) for p, v in zip(params, values))


def test_updated_adapters_must_reach_host_memory(monkeypatch):
    """Fault injection: parking an updated layer without copying its new values back
    loses the update, which changes training."""
    real = HostAdapters.park
    monkeypatch.setattr(HostAdapters, "park", lambda self, params, changed: real(self, params, False))
    _, _, got = hosted(clip=None, dropout=0.0, adapters=True)
    with pytest.raises(AssertionError):
        assert_identical(_reference(None, 0.0), got)


def test_evaluation_between_steps_brings_one_layer_at_a_time():
    """Under no_grad (evaluation) each layer's adapters come to the device for that
    layer's call only, and the output is the one with every adapter on the device; with
    gradients on, such a call is refused rather than run on host tensors."""
    model, params, opt, trainer = _trainer(0.5, 0.0, adapters=True)
    hosted(steps=range(2), dropout=0.0, trainer=(model, params, opt, trainer))
    seen = _off_home_while_each_layer_runs(trainer)
    batch = _batches(0, 1)[0]
    model.eval()
    with torch.no_grad():
        served = model(**batch).logits
    assert seen and all(off == {i} for i, off in seen)
    assert all(trainer.adapters.is_home(p) for p in params)
    with pytest.raises(RuntimeError, match="wait in host memory between StepTrainer steps"):
        model(**batch)
    trainer.adapters_to_device()
    with torch.no_grad():
        assert torch.equal(served, model(**batch).logits)


def test_adapters_to_device_for_evaluation_then_training_goes_on():
    """After `adapters_to_device()` the model runs with every adapter on the device; the
    next step takes them back to host memory and training is unchanged."""
    model, params, opt, trainer = _trainer(0.5, 0.0, adapters=True)
    hosted(steps=range(2), trainer=(model, params, opt, trainer))
    trainer.adapters_to_device()
    assert not any(trainer.adapters.is_home(p) for p in params)
    model.eval()
    with torch.no_grad():
        model(**_batches(0, 1)[0])
    _, _, got = hosted(steps=[2], trainer=(model, params, opt, trainer))
    assert all(trainer.adapters.is_home(p) for p in params)
    assert_identical(_reference(0.5, 0.0), got)


def test_the_trainer_takes_no_mode_of_its_own():
    """Host state comes from the plan: a plan that keeps the optimizer's state in host
    memory needs the optimizer, and stream settings given to a trainer of a streamed
    model are refused (they belong to its stream config)."""
    model = build("llama")
    ns.stream(model, device="cpu", host_state="optimizer")
    with pytest.raises(StreamSetupError, match="pass it the optimizer"):
        ns.StepTrainer(model, None, grad_accum=G)
    with pytest.raises(StreamSetupError, match="host_state belong to its stream config"):
        ns.StepTrainer(model, _optimizer, grad_accum=G, host_state="adapters")


@pytest.mark.gpu
def test_host_optimizer_on_cuda():
    """On the GPU: the state between steps is in pinned host memory, every gradient and
    update on the device; still bit-identical (deterministic kernels)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import os

    from narrows.core import deterministic

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    deterministic(True)
    for clip in (None, 0.5):
        trainer, stats, got = hosted(clip=clip, device="cuda", offload="all")
        assert [s.mode for s in stats][1:] == ["block-major"] * (STEPS - 1)
        assert_identical(_reference(clip, 0.05, device="cuda"), got)
        for st in trainer.optimizer.state.values():
            assert st["exp_avg"].device.type == "cpu" and st["exp_avg"].is_pinned()
        # the adapters in host memory too (no dropout: a plan with them there has no room for
        # the sequential step that learns the RNG draws)
        trainer, stats, got = hosted(clip=clip, dropout=0.0, device="cuda", offload="all", adapters=True)
        assert [s.mode for s in stats] == ["block-major"] * STEPS
        assert_identical(_reference(clip, 0.0, device="cuda"), got)
        assert all(p.device.type == "cpu" and p.is_pinned() for ps in trainer.layer_params for p in ps)
        # through real CUDA graphs: each layer's adapters return to the same slot addresses
        trainer, stats, got = hosted(
            clip=clip, dropout=0.0, device="cuda", offload="all", adapters=True, graphs=True
        )
        assert [s.mode for s in stats] == ["block-major"] * STEPS
        assert_identical(_reference(clip, 0.0, device="cuda"), got)
        graphed = trainer.handle.graphs.stats
        assert graphed.replays > 0 and not graphed.refused, graphed


# ---- the plan leaves out of the budget what waits in host memory (host_state) -------------
def _least_budget(model, **kw) -> int:
    """The smallest budget the planner accepts (bisected)."""
    lo, hi = 0, ns.plan(model, None, device="cpu", **kw).predicted_peak * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            ns.plan(model, mid, device="cpu", **kw)
            hi = mid
        except ns.BudgetTooSmallError:
            lo = mid
    return hi


def test_host_state_takes_the_training_state_out_of_the_fixed_cost():
    """Against the model's own parameter counts: "optimizer" keeps one layer's AdamW
    state (8 bytes a parameter), "adapters" one layer's parameters, gradients and state."""
    model = build("llama")
    layers = [
        [p for p in layer.parameters() if p.requires_grad] for layer in model.base_model.model.model.layers
    ]
    size = [sum(p.numel() for p in ps) for ps in layers]  # fp32 parameters: 4 bytes each
    fixed = {
        s: ns.plan(model, None, device="cpu", host_state=s).fixed_bytes
        for s in ("none", "optimizer", "adapters")
    }
    # and one layer's update makes temporaries as large as its state
    assert fixed["none"] - fixed["optimizer"] == 8 * (sum(size) - max(size)) - 8 * max(size)
    assert fixed["none"] - fixed["adapters"] == 16 * (sum(size) - max(size)) - 8 * max(size)
    plan = ns.plan(model, None, device="cpu", host_state="adapters")
    assert plan.host_state == "adapters" and "one layer's at a time" in str(plan)
    # a budget the full state does not fit, the plan with the adapters in host memory does
    budget = _least_budget(model) - 1
    with pytest.raises(ns.BudgetTooSmallError):
        ns.plan(model, budget, device="cpu")
    assert ns.plan(model, budget, device="cpu", host_state="adapters").predicted_peak <= budget
    with pytest.raises(StreamSetupError, match="host_state='gpu'"):
        ns.plan(model, None, device="cpu", host_state="gpu")


def test_a_trainer_keeps_in_host_memory_what_the_plan_left_there():
    """The plan decides what waits in host memory and the trainer follows it; a plan with
    the adapters there cannot run one micro-batch a step (sequential order)."""
    for state in ("optimizer", "adapters"):
        model = build("llama")
        ns.stream(model, device="cpu", host_state=state)
        follows = ns.StepTrainer(model, _optimizer, grad_accum=G)
        assert follows.host_optimizer is not None
        assert (follows.adapters is not None) == (state == "adapters")
    plain = build("llama")
    ns.stream(plain, device="cpu")
    trainer = ns.StepTrainer(plain, _optimizer, grad_accum=G)
    assert trainer.host_optimizer is None and trainer.adapters is None
    model = build("llama")
    ns.stream(model, device="cpu", host_state="adapters")
    with pytest.raises(StreamSetupError, match="one micro-batch a step"):
        ns.StepTrainer(model, _optimizer, grad_accum=1)


def test_planned_adapters_in_host_memory_need_block_major_steps():
    """With dropout a step would first run in sequential order (every adapter on the
    device, over the plan): refused before any work. Seeded micro-batches need no
    prediction and run block-major, `torch.equal` to the seeded resident reference."""
    _, params, opt, trainer = _trainer(0.5, 0.05, adapters=True, host_state="adapters")
    with pytest.raises(StreamSetupError, match="pass seeds= to step"):
        trainer.step(_batches(0, G))
    assert all(p.grad is None for p in params) and trainer.host_optimizer.updates == 0
    _, params, opt, trainer = _trainer(0.5, 0.05, adapters=True, host_state="adapters")
    stats = [
        trainer.step(_batches(step, G), seeds=[_seed(step, k) for k in range(G)]) for step in range(STEPS)
    ]
    assert [s.mode for s in stats] == ["block-major"] * STEPS
    ref = resident(dropout=0.05, clip=0.5, g=G, seeded=True)
    assert_identical({k: ref[k] for k in ("weight", "adam")}, _record(params, opt, []))
