"""`narrows finetune` launched by torchrun on two and on four GPUs (NCCL), each rank
streaming the base from the host copy they share, against one process on one GPU
accumulating as many micro-batches (``--grad-accum`` the ranks) over the resident base: the
adapter and every logged loss are `torch.equal` with ``--deterministic``. With
``--pipeline-stages`` each GPU holds one block of the layers instead."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from parity import one_process
from safetensors.torch import load_file

from narrows.core.testing import child_env, tiny_model_folder, write_jsonl

pytest.importorskip("narrows.stream")
pytestmark = pytest.mark.gpu

ROWS = [{"text": " ".join(f"w{(3 * i + j) % 40}" for j in range(8 + i % 5))} for i in range(24)]


@pytest.mark.parametrize("ranks", [2, 4])
def test_gpu_ranks_equal_one_gpu_accumulating(tmp_path, ranks):
    if torch.cuda.device_count() < ranks:
        pytest.skip(f"needs {ranks} CUDA devices")
    model = tiny_model_folder(tmp_path / "model")
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    args = [
        "finetune",
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
        "--steps",
        "3",
        "--no-progress",
        "--deterministic",
        "--dtype",
        "float32",
    ]
    one_process(args, tmp_path / "one", child_env(CUDA_VISIBLE_DEVICES="0"), ranks)
    ranked = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={ranks}",
            "-m",
            "narrows.core.app.cli",
            *args,
            "--gpu-budget",
            "min",  # every layer streamed (a fixed size would fall below the planner's floor on some GPUs)
            "--cache",
            str(tmp_path / "cache"),
            "--out",
            str(tmp_path / "ranked"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=child_env(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1"),
    )
    assert ranked.returncode == 0, ranked.stderr[-3000:]
    assert ranked.stdout.count("layers mapped from") == ranks  # each rank maps the shared cache
    a, b = (load_file(tmp_path / r / "adapter_model.safetensors") for r in ("one", "ranked"))
    assert a.keys() == b.keys() and a and all(torch.equal(a[k], b[k]) for k in a)
    rows = [
        [json.loads(line)["loss"] for line in (tmp_path / r / "metrics.jsonl").read_text().splitlines()]
        for r in ("one", "ranked")
    ]
    assert rows[0] == rows[1]
    summary = json.loads((tmp_path / "ranked" / "summary.json").read_text())
    assert summary["stream"]["resident_layers"] == 0 and summary["device"].startswith("cuda")


@pytest.mark.parametrize("stages", [2, 4])
def test_gpu_pipeline_stages_equal_one_gpu_accumulating(tmp_path, stages):
    """``--pipeline-stages``: each GPU one block of layers, streamed; bf16, deterministic;
    four packed micro-batches a step, equal to one process on one GPU accumulating them,
    the held-out loss included (sent from stage to stage with NCCL's point-to-point)."""
    if torch.cuda.device_count() < stages:
        pytest.skip(f"needs {stages} CUDA devices")
    model = tiny_model_folder(tmp_path / "model", num_hidden_layers=4)
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    args = ["finetune", "--model", str(model), "--data", str(data), "--rank", "4", "--batch", "2"]
    held_out = write_jsonl(tmp_path / "held_out.jsonl", ROWS[::-3])
    args += ["--seq-len", "32", "--packing", "--lr", "1e-2"]  # narrows-lmhead's loss
    args += ["--eval-data", str(held_out), "--eval-rows", "5", "--eval-every", "1"]
    args += ["--steps", "3", "--no-progress", "--deterministic"]
    one_process(args, tmp_path / "one", child_env(CUDA_VISIBLE_DEVICES="0"), 4)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={stages}"]
    flags = ["--pipeline-stages", str(stages), "--grad-accum", "4", "--gpu-budget", "min"]
    flags += ["--cache", str(tmp_path / "cache"), "--out", str(tmp_path / "staged")]
    staged = subprocess.run(
        [*launch, "-m", "narrows.core.app.cli", *args, *flags],
        capture_output=True,
        text=True,
        timeout=600,
        env=child_env(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1"),
    )
    assert staged.returncode == 0, staged.stderr[-3000:]
    a, b = (load_file(tmp_path / r / "adapter_model.safetensors") for r in ("one", "staged"))
    assert a.keys() == b.keys() and a and all(torch.equal(a[k], b[k]) for k in a)
    rows = [
        [json.loads(line) for line in (tmp_path / r / "metrics.jsonl").read_text().splitlines()]
        for r in ("one", "staged")
    ]
    for key in ("loss", "eval_loss"):  # the held-out loss through the stages' blocks too
        assert [r[key] for r in rows[0] if key in r] == [r[key] for r in rows[1] if key in r]
    assert sum("eval_loss" in r for r in rows[1]) == 4
    summary = json.loads((tmp_path / "staged" / "summary.json").read_text())
    assert [s["layers"] for s in summary["pipeline_stages"]] == [4 // stages] * stages
