"""Data parallel on two GPUs over NCCL, launched by torchrun: each rank streams from its
own GPU and the ranks equal one process on one GPU accumulating both micro-batches,
`torch.equal`, with deterministic kernels (the condition on CUDA). The ranks' shared host
copy — the cache file's pages, mapped by both and page-locked by each for its own GPU —
trains what one process's private copy does. The same worker as the CPU test
(`ddp_worker.py`); the reference runs in a process of its own so that it too sets
cuBLAS's workspace before CUDA starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_identical

from narrows.core.testing import child_env, tiny_model_folder

HERE = Path(__file__).parent
WORLD = 2

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict]:
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} CUDA devices")
    root = tmp_path_factory.mktemp("nccl")
    out = root / "run"
    tiny_model_folder(root / "model", num_hidden_layers=3)
    env = child_env(
        CUBLAS_WORKSPACE_CONFIG=":4096:8",
        NCCL_NVLS_ENABLE="0",
        PYTHONPATH=os.pathsep.join([str(HERE), *sys.path]),
    )
    worker = str(HERE / "ddp_worker.py")
    ref = subprocess.run(
        [sys.executable, worker, "reference", str(out), str(root / "model")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={WORLD}",
        worker,
        str(out),
        str(root / "model"),
        str(root / "cache"),
        "cuda",
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, torch.load(f"{out}.reference.pt")


def _ranks(out: Path, mode: str) -> list[dict]:
    return [torch.load(f"{out}.{mode}.rank{r}.pt") for r in range(WORLD)]


def _as_ranks(ref: dict) -> list[dict]:
    return [{**ref, "loss": ref["loss"][r::WORLD]} for r in range(WORLD)]


@pytest.mark.parametrize("wrapper", ["ddp", "plain"])
def test_two_gpus_over_nccl_equal_one_gpu_accumulating(runs, wrapper):
    out, ref = runs
    for got, want in zip(_ranks(out, wrapper), _as_ranks(ref["sequential"])):
        assert_identical(want, got)


def test_gpu_ranks_that_do_not_all_reduce_are_caught(runs):
    """Fault twin: the ranks' own gradients, never all-reduced."""
    out, ref = runs
    with pytest.raises(AssertionError):
        for got, want in zip(_ranks(out, "local"), _as_ranks(ref["sequential"])):
            assert_identical(want, got)


def test_the_shared_copy_is_pinned_in_place_on_each_gpu_and_trains_as_a_private_one(runs):
    out, ref = runs
    for r in _ranks(out, "shared"):
        assert r["shared"] == tuple(range(r["layers"])) and all(r["registered"]) and r["registered"]
        assert r["memory"]["Pss"] <= 0.55 * r["memory"]["Rss"], r["memory"]
        assert len(r["weight"]) == len(ref["private"]) > 0
        assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(r["weight"], ref["private"]))
