"""transformers.Trainer launched by torchrun over a streamed model: Trainer (through
accelerate) wraps the model in DistributedDataParallel itself, which leaves the frozen
base alone because `stream()` marked it, and the two ranks train exactly what the same
Trainer trains over the resident model. Two CPU ranks, gloo."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

from narrows.core.testing import child_env

HERE = Path(__file__).parent
WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trainer") / "run"
    env = child_env(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(HERE), *sys.path]))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={WORLD}",
        str(HERE / "trainer_ddp_worker.py"),
        str(out),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _load(out: Path, mode: str) -> list[dict]:
    return [torch.load(f"{out}.{mode}.rank{r}.pt") for r in range(WORLD)]


def test_trainer_under_torchrun_trains_streamed_as_resident(ranks):
    resident, streamed = _load(ranks, "resident"), _load(ranks, "streamed")
    for r, s in zip(resident, streamed):
        assert r["wrapped"] == s["wrapped"] == "DistributedDataParallel"
        assert len(s["loss"]) == 3 and s["loss"] == r["loss"]
        assert all(torch.equal(a, b) for a, b in zip(r["weight"], s["weight"]))


def test_the_ranks_saw_different_rows_and_ended_equal(ranks):
    """What makes the check above mean data parallel: each rank trained its own share of
    the rows, and the all-reduce kept their adapters equal."""
    streamed = _load(ranks, "streamed")
    assert len(streamed[0]["seen"]) == 3 and streamed[0]["seen"] != streamed[1]["seen"]
    assert all(torch.equal(a, b) for a, b in zip(streamed[0]["weight"], streamed[1]["weight"]))
