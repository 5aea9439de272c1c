"""`narrows finetune` launched by torchrun on two CPU ranks (gloo), as a user launches it:
the adapter, every logged loss and every checkpoint are `torch.equal` to one process
accumulating the same two micro-batches per step (``--grad-accum 2``), dropout included;
a resumed two-rank run equals an uninterrupted one; a resume on another number of ranks,
ranks given different flags, and step mode on several ranks are refused with
``narrows: error:``. Each claim has a planted-fault twin (`finetune_rank.py`)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from narrows.core.app.cli import main
from narrows.core.optional import is_available
from narrows.core.testing import child_env, tiny_model_folder, write_jsonl

HERE = Path(__file__).parent
ROWS = [{"text": " ".join(f"w{(7 * i + j) % 50}" for j in range(8 + i % 5))} for i in range(16)]
# one thread per process, like each torchrun rank: a CPU matmul's sums can depend on it
ENV = child_env(OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("ranks")
    model = tiny_model_folder(root / "model")
    data = write_jsonl(root / "train.jsonl", ROWS)
    args = [
        "--model",
        str(model),
        "--data",
        str(data),
        "--rank",
        "4",
        "--dropout",
        "0.1",
        "--batch",
        "2",
        "--seq-len",
        "32",
        "--lr",
        "1e-2",
        "--eval-rows",
        "0",
        "--save-every",
        "2",
        "--no-progress",
    ]
    return root, args


def one(*args):
    cmd = [sys.executable, "-m", "narrows.core.app.cli", "finetune", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)


def two(*args, fault=""):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(HERE / "finetune_rank.py"),
        *args,
    ]
    return subprocess.run(
        cmd, capture_output=True, text=True, env={**ENV, "NARROWS_TEST_FAULT": fault}, timeout=600
    )


def ok(done):
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def adapter_at(run: Path, step: int | None = None) -> dict:
    if step is None:
        return load_file(run / "adapter_model.safetensors")
    return torch.load(run / "checkpoints" / f"step-{step:06d}" / "state.pt")["adapter"]


def same(a: dict, b: dict) -> bool:
    assert a.keys() == b.keys() and a
    return all(torch.equal(a[k], b[k]) for k in a)


def losses(run: Path) -> list:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(job):
    root, args = job
    ok(one(*args, "--grad-accum", "2", "--steps", "4", "--out", str(root / "one")))
    done = ok(two(*args, "--steps", "4", "--out", str(root / "two")))
    return root, args, done


def test_two_ranks_equal_one_process_accumulating_both_micro_batches(runs):
    root, _, done = runs
    assert same(adapter_at(root / "one"), adapter_at(root / "two"))
    assert same(adapter_at(root / "one", 2), adapter_at(root / "two", 2))
    assert losses(root / "one") == losses(root / "two")
    assert done.stdout.count("adapter (PEFT format)") == 1  # rank 0 reports, and writes alone
    config = json.loads((root / "two" / "config.json").read_text())["config"]
    assert config["world_size"] == 2 and config["grad_accum"] == 1
    summary = json.loads((root / "two" / "summary.json").read_text())
    one_summary = json.loads((root / "one" / "summary.json").read_text())
    assert summary["last_loss"] == one_summary["last_loss"]


@pytest.mark.parametrize("fault", ["mean", "seed"])
def test_twin_averaged_gradients_or_unseeded_micro_batches_differ(runs, fault):
    """DDP's default mean (the loss is already normalised over the whole step), or dropout
    seeded without the micro-batch's index: training differs from the one process."""
    root, args, _ = runs
    out = root / f"twin-{fault}"
    ok(two(*args, "--steps", "2", "--out", str(out), fault=fault))
    assert not same(adapter_at(root / "one", 2), adapter_at(out))


def test_two_ranks_resume_exactly(runs):
    """What a run killed after its step-2 checkpoint leaves (config, metrics, that
    checkpoint), resumed on two ranks: the same adapter and losses as the whole run."""
    root, _, _ = runs
    cut = root / "cut"
    shutil.copytree(root / "two", cut)
    shutil.rmtree(cut / "checkpoints" / "step-000004")
    for name in ("adapter_model.safetensors", "adapter_config.json", "summary.json"):
        (cut / name).unlink()
    ok(two("--resume", str(cut), "--no-progress"))
    assert same(adapter_at(root / "two"), adapter_at(cut))
    assert losses(root / "two") == losses(cut)


def test_resume_on_another_number_of_ranks_is_refused(runs, capsys):
    root, _, _ = runs
    before = (root / "two" / "config.json").read_text()
    assert main(["finetune", "--resume", str(root / "two"), "--steps", "6", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("narrows: error:") and "over 2 data-parallel ranks" in err
    assert "this launch over 1 data-parallel rank" in err
    assert "torchrun with 2 ranks" in err and "--override" in err
    assert (root / "two" / "config.json").read_text() == before
    done = two("--resume", str(root / "one"), "--steps", "6", "--no-progress")
    assert done.returncode != 0 and "over 1 data-parallel rank (without torchrun)" in done.stderr
    assert "this launch over 2 data-parallel ranks" in done.stderr


def test_ranks_given_different_flags_stop_before_loading_the_model(job):
    root, args = job
    done = two(*args, "--steps", "2", "--out", str(root / "diverged"), fault="diverge")
    assert done.returncode != 0
    assert "narrows: error: rank 1 differs from rank 0 in its config" in done.stderr
    assert not (root / "diverged" / "checkpoints").exists() or not any(
        (root / "diverged" / "checkpoints").iterdir()
    )


def test_step_mode_on_several_ranks_is_refused_before_anything(job, capsys, monkeypatch):
    root, args = job
    for k, v in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    out = root / "step-mode"
    if is_available("narrows.stream"):
        code = main(["finetune", *args, "--gpu-budget", "fit", "--step-mode", "--out", str(out)])
        err = capsys.readouterr().err
        assert code == 2 and "--step-mode is not supported on several ranks" in err
        assert not out.exists()
    monkeypatch.delenv("RANK")
    assert main(["finetune", *args, "--out", str(out)]) == 2
    assert "WORLD_SIZE, RANK, LOCAL_RANK" in capsys.readouterr().err
