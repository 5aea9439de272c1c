"""`narrows finetune --pipeline-stages 2` launched by torchrun on two CPU ranks: each rank
streams one block of a tiny model's layers, torch's 1F1B schedule runs four packed
micro-batches a step through them, and the run equals one process accumulating the same
four micro-batches over a resident base, `torch.equal`: the losses of every step, the saved
adapter, and the checkpoints (the whole model's adapter and optimizer state, gathered). A
run stopped and resumed on its stages equals one run through. What the stages do not cover
is refused before the model loads."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from parity import one_process
from safetensors.torch import load_file

from narrows.core.app.cli import main
from narrows.core.testing import child_env, tiny_model_folder, write_jsonl

pytest.importorskip("narrows.stream")

ROWS = [{"text": " ".join(f"w{(5 * i + j) % 40}" for j in range(6 + i % 7))} for i in range(24)]
ENV = child_env(OMP_NUM_THREADS="1")
MICRO = 4


def _args(model, data, held_out) -> list[str]:
    args = ["finetune", "--model", str(model), "--data", str(data), "--rank", "4", "--batch", "2"]
    args += ["--seq-len", "32", "--packing", "--lr", "1e-2"]  # narrows-lmhead's loss, the job's default
    args += ["--eval-data", str(held_out), "--eval-rows", "5", "--eval-every", "1"]  # 5 rows: a short batch
    return [*args, "--save-every", "2", "--no-progress"]


def _stages(args: list[str], out, *more: str) -> subprocess.CompletedProcess:
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd = [*launch, "-m", "narrows.core.app.cli", *args, *more, "--out", str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)


def _losses(run, key: str = "loss") -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if key in r]


def test_two_stages_equal_one_process_accumulating_and_resume_on_their_checkpoints(tmp_path):
    model = tiny_model_folder(tmp_path / "model", num_hidden_layers=4)
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    held_out = write_jsonl(tmp_path / "held_out.jsonl", ROWS[::-3])
    args = _args(model, data, held_out)
    one_process([*args, "--steps", "3"], tmp_path / "one", ENV, ranks=MICRO)
    common = ["--pipeline-stages", "2", "--grad-accum", str(MICRO), "--gpu-budget", "min"]
    common += ["--cache", str(tmp_path / "cache")]
    first = _stages(args, tmp_path / "two", *common, "--steps", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "pipeline stages: 2 blocks of layers" in first.stderr
    # the checkpoint of step 2: the whole model's adapter and AdamW state, as one process saves them
    one, two = (torch.load(tmp_path / r / "checkpoints" / "step-000002" / "state.pt") for r in ("one", "two"))
    assert one["adapter"].keys() == two["adapter"].keys()
    assert all(torch.equal(one["adapter"][k], two["adapter"][k]) for k in one["adapter"])
    # the same group but its rate: the schedule of a run ending at step 2 is at 0 there
    (g1,), (g2,) = one["optimizer"]["param_groups"], two["optimizer"]["param_groups"]
    assert {**g1, "lr": None} == {**g2, "lr": None}
    assert one["optimizer"]["state"].keys() == two["optimizer"]["state"].keys()
    for i, moments in one["optimizer"]["state"].items():
        assert all(torch.equal(v, two["optimizer"]["state"][i][k]) for k, v in moments.items()), i
    resumed = _stages(args, tmp_path / "two", "--resume", str(tmp_path / "two"), "--steps", "3")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = (load_file(tmp_path / r / "adapter_model.safetensors") for r in ("one", "two"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _losses(tmp_path / "one") == _losses(tmp_path / "two")
    # the held-out loss, unpacked rows padded to each batch's longest, through the stages' blocks
    held = [_losses(tmp_path / r, "eval_loss") for r in ("one", "two")]
    assert held[0] == held[1] and len(held[0]) == 4  # before training and after each step
    config = [json.loads((tmp_path / r / "adapter_config.json").read_text()) for r in ("one", "two")]
    assert {**config[0], "target_modules": sorted(config[0]["target_modules"])} == {
        **config[1],
        "target_modules": sorted(config[1]["target_modules"]),  # a set PEFT writes in any order
    }
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    staged = summary["pipeline_stages"]
    assert [s["layers"] for s in staged] == [2, 2] and [s["resident_layers"] for s in staged] == [0, 0]
    assert [s["micro_batches_in_flight"] for s in staged] == [2, 1]  # 1F1B: one per stage still to run
    _resumes_where_each_step_is_shared_as_before(tmp_path)
    one_summary = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert summary["trainable"] == one_summary["trainable"]
    assert summary["loss_kernels"] == one_summary["loss_kernels"]  # narrows-lmhead's, on the last stage


def _resumes_where_each_step_is_shared_as_before(root) -> None:
    """A resume compares the data-parallel width (the ranks over the stages), not the ranks:
    stages to one process or back is free; as many ranks split another way needs --override."""
    from narrows.core.app.finetune.resuming import plan_resume
    from narrows.core.app.finetune.run_folder import RunFolder
    from narrows.core.errors import NarrowsError

    def settle(run: str, world: int, **given):
        file = RunFolder(root / run).read_file()
        return plan_resume(root / run, file, given, world, False, newest=3, logged=3)

    assert "world_size" in settle("two", 1, pipeline_stages=1, steps=4).changes.free
    assert "world_size" in settle("one", 2, pipeline_stages=2, gpu_budget="min", steps=4).changes.free
    with pytest.raises(
        NarrowsError, match=r"over 1 data-parallel rank .*this launch over 2 data-parallel ranks"
    ):
        settle("one", 2, steps=4)  # the same ranks as the stages, as data parallelism: another split


def test_stages_need_their_ranks(tmp_path, capsys):
    """One process asking for two stages is refused before anything is written."""
    model = tiny_model_folder(tmp_path / "model")
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    flags = ["--pipeline-stages", "2", "--gpu-budget", "min", "--packing"]
    code = main(
        ["finetune", "--model", str(model), "--data", str(data), *flags, "--out", str(tmp_path / "r")]
    )
    err = capsys.readouterr().err
    assert code == 2 and "narrows: error:" in err and "launch 2 ranks (torchrun --nproc-per-node 2" in err
    assert not (tmp_path / "r").exists()


def test_what_stages_do_not_cover_is_refused_by_name(monkeypatch):
    """Checked as a launch of two ranks sees them (WORLD_SIZE 2): each refusal names its flag."""
    from narrows.core.app.finetune.config import FinetuneConfig
    from narrows.core.errors import NarrowsError

    base = {"pipeline_stages": 2, "world_size": 2, "gpu_budget": "min", "packing": True, "grad_accum": 4}
    for change, flag in (
        ({"gpu_budget": "off"}, "needs --gpu-budget"),
        ({"grad_accum": 1}, "--grad-accum 2 or more"),  # torch's 1F1B: a micro-batch a stage at least
        ({"packing": False}, "needs --packing"),
        ({"dropout": 0.1}, "--dropout"),
        ({"step_mode": True}, "--step-mode"),
        ({"offload_optimizer": True}, "--offload-optimizer"),
    ):
        with pytest.raises(NarrowsError, match=flag):
            FinetuneConfig.of(**{**base, **change})._check_stages()
    FinetuneConfig.of(**base)._check_stages()  # what they cover
