"""Pipeline stages over a streamed base (`narrows.stream.pipeline_stage`), launched the way
users launch them (`torchrun`, gloo on the CPU): two ranks, each one contiguous block of a
tiny model's layers, streamed at the smallest budget, run by torch's GPipe and 1F1B
schedules over four micro-batches a step, train adapters `torch.equal` to one process accumulating the
four micro-batches on the whole model, resident (gradients at every step and the weights
AdamW leaves)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from narrows.core.testing import child_env, tiny_model_folder
from narrows.stream.pipeline import stage_layers

HERE = Path(__file__).parent
STAGES = 2


WORKER = str(HERE / "pipeline_worker.py")
LAUNCH = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={STAGES}"]


def _run(args: list[str]) -> None:
    env = child_env(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(HERE), *sys.path]))
    done = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    """Where the runs write; the one-process reference runs once."""
    out = tmp_path_factory.mktemp("pipeline") / "run"
    _run([WORKER, "reference", str(out)])
    return out


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stages_equal_one_process_accumulating(out, schedule):
    _run([*LAUNCH, WORKER, schedule, str(out)])
    assert_stages_equal(out, schedule, STAGES)


def test_stages_of_a_from_pretrained_model_stream_their_layers_of_one_shared_host_copy(tmp_path):
    """Loaded by `from_pretrained` into one host copy both ranks map, each stage keeps its
    layers' homes, renumbered, and equals one process on a private copy."""
    folder, out = tiny_model_folder(tmp_path / "model", num_hidden_layers=4), tmp_path / "run"
    _run([WORKER, "reference", str(out), "cpu", str(folder)])
    _run([*LAUNCH, WORKER, "gpipe", str(out), "cpu", str(folder)])
    assert_stages_equal(out, "gpipe", STAGES)
    assert [torch.load(f"{out}.gpipe.stage{r}.pt")["shared"] for r in range(STAGES)] == [[0, 1], [0, 1]]


def assert_stages_equal(out: Path, schedule: str, stages: int) -> None:
    """Each stage's adapters, gradients at every step and final weights, are the one
    process's, and every adapter trains on exactly one stage."""
    reference = torch.load(f"{out}.reference.pt", map_location="cpu")  # stages saved from their own GPUs
    ranks = [torch.load(f"{out}.{schedule}.stage{r}.pt", map_location="cpu") for r in range(stages)]
    layers = [list(stage_layers(4, stages, r)) for r in range(stages)]
    assert [s["layers"] for s in ranks] == layers  # contiguous blocks, each its own
    assert [(s["planned"], s["resident"]) for s in ranks] == [(len(x), 0) for x in layers]  # streamed, alone
    assert [s["head_streamed"] for s in ranks] == [True] * (stages - 1) + [False]  # held by the last alone
    saved = load_file(f"{out}.{schedule}.adapter/adapter_model.safetensors")
    want = load_file(f"{out}.reference.adapter/adapter_model.safetensors")
    assert saved.keys() == want.keys() and all(torch.equal(saved[k], want[k]) for k in want)  # one adapter
    held = [name for s in ranks for name in s["weight"]]
    assert sorted(held) == sorted(reference["weight"])
    for s in ranks:
        for name, w in s["weight"].items():
            assert torch.equal(w, reference["weight"][name]), name
        for step, grads in enumerate(s["grad"]):
            for name, g in grads.items():
                assert torch.equal(g, reference["grad"][step][name]), (step, name)


def test_a_stage_split_is_contiguous_and_refused_past_the_layers():
    import narrows.stream as ns

    assert [list(stage_layers(10, 3, s)) for s in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]
    with pytest.raises(ns.StreamSetupError, match="stages <= the model's 2 layers"):
        stage_layers(2, 3, 0)


def test_pipeline_stage_needs_a_process_group_and_a_family_it_covers():
    from helpers import build

    import narrows.stream as ns

    with pytest.raises(ns.StreamSetupError, match="init_process_group"):
        ns.pipeline_stage(build(num_hidden_layers=2))
    with pytest.raises(ns.StreamSetupError, match="this is a gemma2"):
        ns.pipeline_stage(build("gemma2", num_hidden_layers=2), stage=0, stages=2)


def test_each_stage_is_planned_for_what_its_schedule_keeps():
    """GPipe keeps every micro-batch's activations on every stage until the backward; 1F1B
    keeps one per stage still to run; the last stage alone computes the loss; the boundary
    buffers: received hidden states (not the first), received gradients and kept outputs
    (not the last)."""
    from narrows.stream.pipeline import _in_flight

    one_f_one_b = [_in_flight(s, 4, 8, "1f1b") for s in range(4)]
    assert [x["in_flight"] for x in one_f_one_b] == [4, 3, 2, 1]
    assert [x["computes_loss"] for x in one_f_one_b] == [False, False, False, True]
    assert [x["stage_buffers"] for x in one_f_one_b] == [8 + 4, 2 * (8 + 3), 2 * (8 + 2), 8 + 1]
    assert [_in_flight(s, 4, 8, "gpipe")["in_flight"] for s in range(4)] == [8] * 4
    assert _in_flight(0, 4, 2, "1f1b")["in_flight"] == 2  # never more than the step has


def test_the_plan_prices_micro_batches_in_flight_the_loss_and_the_boundaries():
    from helpers import build

    import narrows.stream as ns
    from narrows.core import anatomy_of
    from narrows.stream.planning.memory import Shapes, input_bytes

    model = build(num_hidden_layers=4, vocab_size=8192)  # its loss outweighs a layer's working set
    shape = {"batch_size": 2, "seq_len": 32, "device": "cpu"}
    s = Shapes.of(anatomy_of(model), 2, 32)
    logits = 2 * 32 * s.vocab
    alone = ns.plan(model, **shape)
    assert alone.work_bytes == logits * (2 * s.act_bytes + 10)
    assert ns.plan(model, computes_loss=False, **shape).work_bytes < alone.work_bytes
    held = ns.plan(model, in_flight=3, computes_loss=False, **shape)
    assert held.activation_bytes == 3 * alone.activation_bytes
    assert held.fixed_bytes == alone.fixed_bytes  # one working set at a time, no loss kept
    last = ns.plan(model, in_flight=3, **shape)  # GPipe's last stage: two more losses kept
    assert last.fixed_bytes == alone.fixed_bytes + 2 * logits * (s.act_bytes + 4)
    assert ns.plan(model, stage_buffers=5, **shape).fixed_bytes == alone.fixed_bytes + 5 * input_bytes(s)
