"""`narrows finetune` interrupted and resumed, end to end on a tiny model folder: the real
CLI in a subprocess (`finetune_cli`), killed or Ctrl-C'd mid-run, then `--resume`d to the
adapter weights (`torch.equal`) and metrics of an uninterrupted run.
"""

from __future__ import annotations

import signal
import time

import pytest
from finetune_cli import assert_same_adapter, cli, losses, make_job


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return make_job(tmp_path_factory)


@pytest.mark.parametrize("how,packing", [("kill", True), ("ctrl-c", False)])
def test_an_interrupted_run_resumes_to_the_same_adapter(job, how, packing):
    """The killed run is packed: 20 examples in 10 sequences, 4 per step, so the cut falls
    mid-epoch and the resumed run must find the same packing and data position."""
    root, args = job
    steps = ["--steps", "120", *(["--packing"] if packing else [])]
    whole = root / f"whole-{how}-{packing}"
    done = cli(*args, *steps, "--out", str(whole))
    assert done.returncode == 0
    assert "format messages" in done.stderr
    assert ("packing: 20 examples in 10 sequences of 64 tokens" in done.stderr) == packing
    cut = root / f"cut-{how}-{packing}"
    proc = cli(*args, *steps, "--out", str(cut), wait=False)
    deadline = time.time() + 300
    while time.time() < deadline:  # interrupt once a checkpoint exists and training went past it
        if (cut / "checkpoints" / "latest").exists() and len(losses(cut)) >= 5:
            break
        time.sleep(0.005)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signal.SIGKILL if how == "kill" else signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    if how == "ctrl-c":
        assert proc.returncode == 130 and "Traceback" not in err, err
        assert "narrows: interrupted at step" in err and f"--resume {cut}" in err
    assert not (cut / "adapter_model.safetensors").exists()
    r = cli("--resume", str(cut), "--no-progress")
    assert r.returncode == 0, r.stderr
    assert_same_adapter(whole, cut)
    assert losses(whole) == losses(cut)
