"""Pipeline stages on two and on four GPUs over NCCL, launched by torchrun: each rank one
contiguous block of layers, streamed from its own GPU at the smallest budget, torch's GPipe
and 1F1B schedules; the adapters equal one process on one GPU accumulating the same
micro-batches, `torch.equal`, with deterministic kernels. The CPU test's worker
(`pipeline_worker.py`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_pipeline import assert_stages_equal

from narrows.core.testing import child_env

HERE = Path(__file__).parent

pytestmark = pytest.mark.gpu


def _run(args: list[str], env: dict) -> None:
    done = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpu_stages_over_nccl_equal_one_gpu_accumulating(tmp_path, stages, schedule):
    if torch.cuda.device_count() < stages:
        pytest.skip(f"needs {stages} CUDA devices")
    out = tmp_path / "run"
    env = child_env(
        CUBLAS_WORKSPACE_CONFIG=":4096:8",
        NCCL_NVLS_ENABLE="0",
        TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
        NVSHMEM_DISABLE_NVLS="1",
        PYTHONPATH=os.pathsep.join([str(HERE), *sys.path]),
    )
    worker = str(HERE / "pipeline_worker.py")
    _run([worker, "reference", str(out), "cuda"], env)  # MODE OUT DEVICE
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={stages}"]
    _run([*launch, worker, schedule, str(out), "cuda"], env)
    assert_stages_equal(out, schedule, stages)
