"""Data parallel on two and on four GPUs over NCCL, launched by torchrun: each rank streams
from its own GPU and the ranks equal one process on one GPU accumulating every rank's micro-batch,
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

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}gpus")
def runs(tmp_path_factory, request) -> tuple[Path, dict, int]:
    world = request.param
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices")
    root = tmp_path_factory.mktemp(f"nccl{world}")
    out = root / "run"
    tiny_model_folder(root / "model", num_hidden_layers=3)
    env = child_env(
        CUBLAS_WORKSPACE_CONFIG=":4096:8",
        NCCL_NVLS_ENABLE="0",
        PYTHONPATH=os.pathsep.join([str(HERE), *sys.path]),
    )
    worker = str(HERE / "ddp_worker.py")
    ref = subprocess.run(
        [sys.executable, worker, "reference", str(out), str(root / "model"), str(world)],
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
        f"--nproc-per-node={world}",
        worker,
        str(out),
        str(root / "model"),
        str(root / "cache"),
        "cuda",
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, torch.load(f"{out}.reference.pt"), world


def _ranks(out: Path, mode: str, world: int) -> list[dict]:
    return [torch.load(f"{out}.{mode}.rank{r}.pt") for r in range(world)]


def _as_ranks(ref: dict, world: int) -> list[dict]:
    return [{**ref, "loss": ref["loss"][r::world]} for r in range(world)]


def test_gpus_over_nccl_equal_one_gpu_accumulating(runs):
    """narrows' wrapper sums the ranks' gradients in rank order: equal at any number of ranks."""
    out, ref, world = runs
    for got, want in zip(_ranks(out, "ddp", world), _as_ranks(ref["sequential"], world)):
        assert_identical(want, got)


def test_torch_ddp_over_the_streamed_model_is_exact_with_the_rank_ordered_sum(runs):
    """Torch's own DDP (as accelerate and the Trainer build it) all-reduces: NCCL adds the
    ranks' gradients in an order of its own, which beyond two ranks also follows DDP's
    buckets (rebuilt after the first step from the order gradients arrive in), so there it
    is one GPU accumulating within rounding only. Given `rank_ordered_sum` it is exact."""
    out, ref, world = runs
    for got, want in zip(_ranks(out, "hooked", world), _as_ranks(ref["sequential"], world)):
        assert_identical(want, got)
    for got, want in zip(_ranks(out, "plain", world), _as_ranks(ref["sequential"], world)):
        if world == 2:  # a + b = b + a
            assert_identical(want, got)
        for key in want:
            assert all(
                torch.allclose(a.cpu(), b.cpu(), rtol=1e-3, atol=1e-9) for a, b in zip(want[key], got[key])
            )


def test_gpu_ranks_that_do_not_all_reduce_are_caught(runs):
    """Fault twin: the ranks' own gradients, never all-reduced."""
    out, ref, world = runs
    with pytest.raises(AssertionError):
        for got, want in zip(_ranks(out, "local", world), _as_ranks(ref["sequential"], world)):
            assert_identical(want, got)


def test_the_shared_copy_is_pinned_in_place_on_each_gpu_and_trains_as_a_private_one(runs):
    out, ref, world = runs
    for r in _ranks(out, "shared", world):
        assert r["shared"] == tuple(range(r["layers"])) and all(r["registered"]) and r["registered"]
        assert r["memory"]["Pss"] <= 0.55 * r["memory"]["Rss"], r["memory"]
        assert len(r["weight"]) == len(ref["private"]) > 0
        assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(r["weight"], ref["private"]))
