"""`narrows finetune` on CUDA, killed and resumed: the adapter ends `torch.equal` to an
uninterrupted run. Dropout draws from the CUDA generator, so this fails if a checkpoint
stops restoring the CUDA RNG state (the CPU tests cannot see that)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from narrows.core.testing import child_env, tiny_model_folder, write_jsonl

pytestmark = pytest.mark.gpu

ROWS = [{"prompt": f"{a}+{b}=", "response": f"{a + b}"} for a in range(8) for b in range(4)]


def _cli(*args: str, wait: bool = True):
    cmd = [sys.executable, "-m", "narrows.core.app.cli", "finetune", *args]
    env = child_env()
    if wait:
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("stream", [False, True])
def test_killed_and_resumed_on_cuda_ends_equal(tmp_path, stream):
    assert torch.cuda.is_available()
    model = tiny_model_folder(tmp_path / "model")
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    args = [
        "--model",
        str(model),
        "--data",
        str(data),
        "--rank",
        "4",
        "--dropout",
        "0.2",
        "--batch",
        "2",
        "--seq-len",
        "32",
        "--lr",
        "1e-2",
        "--save-every",
        "3",
        "--steps",
        "300",
        "--deterministic",
        "--lmhead",
        "off",
        "--no-progress",
    ]
    if stream:
        pytest.importorskip("narrows.stream")
        args += ["--gpu-budget", "fit"]
    whole = tmp_path / "whole"
    r = _cli(*args, "--out", str(whole))
    assert r.returncode == 0, r.stderr
    assert json.loads((whole / "summary.json").read_text())["device"].startswith("cuda")

    cut = tmp_path / "cut"
    proc = _cli(*args, "--out", str(cut), wait=False)
    deadline = time.time() + 600
    while time.time() < deadline:  # kill once a checkpoint exists and training went past it
        if (
            (cut / "checkpoints" / "latest").exists()
            and (cut / "metrics.jsonl").exists()
            and len(_metrics(cut)) >= 8
        ):
            break
        time.sleep(0.002)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=120)
    assert not (cut / "adapter_model.safetensors").exists()
    r = _cli("--resume", str(cut), "--no-progress")
    assert r.returncode == 0, r.stderr

    a, b = load_file(whole / "adapter_model.safetensors"), load_file(cut / "adapter_model.safetensors")
    assert a.keys() == b.keys() and a
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert [(m["step"], m.get("loss")) for m in _metrics(whole)] == [
        (m["step"], m.get("loss")) for m in _metrics(cut)
    ]
