"""`narrows finetune --gpu-budget` launched by torchrun on two CPU ranks: each rank streams
the base from the one host copy they share (the prepared cache, mapped), and the run
equals one process with ``--grad-accum 2`` over a resident base, `torch.equal` — with
LoRA and with DoRA, narrows-lmhead's loss in both."""

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

ROWS = [{"text": " ".join(f"w{(3 * i + j) % 40}" for j in range(8 + i % 5))} for i in range(12)]
ENV = child_env(OMP_NUM_THREADS="1")


@pytest.mark.parametrize("adapter", ["lora", "dora"])
def test_two_streamed_ranks_on_one_host_copy_equal_one_resident_process(tmp_path, adapter):
    """LoRA, and DoRA through narrows-dora's layers; narrows-lmhead's loss in both (the
    job's default where it is installed)."""
    if adapter == "dora":
        pytest.importorskip("narrows.dora")
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
        "--adapter",
        adapter,
    ]
    one_process(args, tmp_path / "one", ENV)
    two = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "narrows.core.app.cli",
            *args,
            "--gpu-budget",
            "min",  # every layer streamed
            "--cache",
            str(tmp_path / "cache"),
            "--out",
            str(tmp_path / "two"),
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("layers mapped from") == 2  # each rank maps the shared cache
    a, b = (
        load_file(tmp_path / "one" / "adapter_model.safetensors"),
        load_file(tmp_path / "two" / "adapter_model.safetensors"),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [
        [json.loads(line)["loss"] for line in (tmp_path / r / "metrics.jsonl").read_text().splitlines()]
        for r in ("one", "two")
    ]
    assert rows[0] == rows[1]
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["stream"]["resident_layers"] == 0 and summary["adapter"] == adapter
    if adapter == "dora":  # the magnitudes trained too
        assert any("lora_magnitude_vector" in k for k in a)


def test_two_nodes_each_with_its_own_host_copy_equal_one_process(tmp_path):
    """Two torchrun agents joined through a localhost rendezvous stand for two machines: one
    rank each (local rank 0 on both, global ranks 0 and 1), each with its own cache folder
    (its node's disk), so each builds its own host copy of the base. The run equals
    one process with ``--grad-accum 2`` over a resident base, `torch.equal`."""
    import socket

    model = tiny_model_folder(tmp_path / "model")
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    args = ["finetune", "--model", str(model), "--data", str(data), "--rank", "4", "--dropout", "0.1"]
    args += ["--batch", "2", "--seq-len", "32", "--lr", "1e-2", "--eval-rows", "0", "--steps", "2"]
    args += ["--no-progress"]
    one_process(args, tmp_path / "one", ENV)
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node-rank={node}",
                "--nproc-per-node=1",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                "-m",
                "narrows.core.app.cli",
                *args,
                "--gpu-budget",
                "min",  # every layer streamed
                "--out",
                str(tmp_path / "two"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**ENV, "NARROWS_CACHE": str(tmp_path / f"node{node}")},
        )
        for node in range(2)
    ]
    said = [p.communicate(timeout=600) for p in nodes]
    assert all(p.returncode == 0 for p in nodes), [err[-2000:] for _, err in said]
    for node in range(2):  # each node built its own copy of the base (one rank each: none shared)
        assert len(list((tmp_path / f"node{node}" / "slabs").glob("*.slabs"))) == 1
    a, b = (load_file(tmp_path / r / "adapter_model.safetensors") for r in ("one", "two"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
