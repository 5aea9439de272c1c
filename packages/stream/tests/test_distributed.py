"""Data parallel over a streamed base with torch.distributed (gloo on the CPU), launched
the way users launch it (`torchrun`): two ranks, each one micro-batch of the global batch,
are `torch.equal` to one process accumulating both micro-batches — dropout included, and
against a *resident* model. It holds exactly because an all-reduce of two values is one
addition and DDP's division by the world size (2) is exact: (g0 + g1) / 2 = g0/2 + g1/2
bit for bit, the sum one process accumulates (0 + g0/2 + g1/2)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_identical

HERE = Path(__file__).parent
WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> Path:
    """One torchrun launch, two ranks: DDP, its fault twin, and a diverged rank."""
    out = tmp_path_factory.mktemp("ddp") / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
           str(HERE / "ddp_worker.py"), str(out)]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _load(out: Path, mode: str) -> list[dict]:
    return [torch.load(f"{out}.{mode}.rank{r}.pt") for r in range(WORLD)]


@pytest.fixture(scope="module")
def reference():
    """One process, one thread like each rank: a CPU matmul's summation order can depend
    on the thread count."""
    from ddp_worker import model, sequential

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return sequential(model(), WORLD)
    finally:
        torch.set_num_threads(threads)


def _as_ranks(ref: dict) -> list[dict]:
    """The reference's losses split the way the ranks see them (rank r: micro-batch r)."""
    return [{**ref, "loss": ref["loss"][r::WORLD]} for r in range(WORLD)]


@pytest.mark.parametrize("wrapper", ["ddp", "plain"])
def test_two_streamed_ranks_equal_one_resident_process_accumulating(ranks, reference, wrapper):
    """`ns.data_parallel`, and torch's own DDP as accelerate and Trainer build it (stream()
    leaves the frozen base out of any DDP)."""
    for got, want in zip(_load(ranks, wrapper), _as_ranks(reference)):
        assert_identical(want, got)


def test_ranks_that_do_not_all_reduce_are_caught(ranks, reference):
    """Fault twin: the same ranks without DDP's gradient all-reduce."""
    with pytest.raises(AssertionError):
        for got, want in zip(_load(ranks, "local"), _as_ranks(reference)):
            assert_identical(want, got)


def test_a_diverged_rank_stops_every_rank_with_its_name(ranks):
    for r in range(WORLD):
        said = Path(f"{ranks}.diverged.rank{r}.txt").read_text()
        assert said.startswith("rank 1 differs from rank 0 in trainable"), said


def test_step_mode_under_data_parallel_is_refused(ranks):
    said = Path(f"{ranks}.diverged.rank0.txt").read_text()
    assert "step mode under data_parallel is not supported yet" in said, said


def test_data_parallel_needs_a_process_group():
    from helpers import build

    import narrows.stream as ns

    with pytest.raises(ns.StreamSetupError, match="init_process_group"):
        ns.data_parallel(build(num_hidden_layers=2))
