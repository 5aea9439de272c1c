"""Helpers of the run-folder tests (`test_finetune_run_folder.py`, `test_finetune_resume.py`):
the real `narrows finetune` CLI in subprocesses, what it leaves in a run folder, and one
finished run both files resume from (module fixtures `job` and `finished`).

Each process imports torch, transformers and peft, which dominates its time: independent
commands run two at a time, and the children keep their bytecode in a cache outside the
tree (this environment may set PYTHONDONTWRITEBYTECODE, which makes every child compile
everything again).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file

from narrows.core.testing import child_env, interruptible, tiny_model_folder, write_jsonl

ROWS = [
    {"messages": [{"role": "user", "content": f"{a}+{b}?"}, {"role": "assistant", "content": f"{a + b}"}]}
    for a in range(6)
    for b in range(4)
]
FAST = 30  # seconds a refusal before loading may take

# `narrows finetune` in a process whose torch.save fails from its second call on, as on a
# full disk: the first checkpoint is written, the second is not
DISK_FULL = """
import errno, sys, torch
import narrows.core.app.cli
real, calls = torch.save, []
def save(*args, **kwargs):
    calls.append(1)
    if len(calls) >= 2:
        raise OSError(errno.ENOSPC, "No space left on device")
    return real(*args, **kwargs)
torch.save = save
sys.exit(narrows.core.app.cli.main(sys.argv[1:]))
"""

# the same with the adapter's safetensors file at the end of the run: safetensors raises its
# own SafetensorError (no errno, not an OSError) with the OS error in its text
ADAPTER_DISK_FULL = """
import sys, safetensors, safetensors.torch
import narrows.core.app.cli
def serialize_file(*args, **kwargs):
    raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
safetensors.torch.serialize_file = serialize_file
sys.exit(narrows.core.app.cli.main(sys.argv[1:]))
"""

# `narrows finetune` whose model load says so on stderr, then waits to be interrupted
SLOW_LOAD = """
import sys, time
import narrows.core.app.cli, narrows.core.app.finetune.job as job
real = job.load_model
def load_model(*args, **kwargs):
    print("LOADING", file=sys.stderr, flush=True)
    time.sleep(300)
    return real(*args, **kwargs)
job.load_model = load_model
sys.exit(narrows.core.app.cli.main(sys.argv[1:]))
"""


def _env() -> dict:
    return child_env()


def cli(*args, wait=True, script=None):
    """`narrows finetune ARGS` in a subprocess; the result carries `.seconds`."""
    head = ["-c", script] if script else ["-m", "narrows.core.app.cli"]
    cmd = [sys.executable, *head, "finetune", *map(str, args)]
    if not wait:
        return subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
            preexec_fn=interruptible,
        )
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    r.seconds = time.perf_counter() - t0
    return r


def cli_all(*commands):
    """Independent commands, two at a time (each is mostly single-threaded imports)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(lambda args: cli(*args), commands))


def refused(r, *, notices=False) -> str:
    """The stderr of a refusal: exit 2, one `narrows: error:` line, last, and no traceback;
    before it only the run's own `narrows:` stage lines. With `notices`, other lines
    (warnings) may come before it too."""
    err = r.stderr
    assert r.returncode == 2, (r.stdout, err)
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("narrows: error: "), err
    if not notices:
        assert all(line.startswith("narrows: ") for line in lines), err
    assert err.count("narrows: error:") == 1, err
    return err


def ok(r) -> str:
    assert r.returncode == 0, (r.stdout, r.stderr)
    return r.stderr


def wait_for(what, timeout=300, proc=None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = what()
        if found:
            return found
        assert proc is None or proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def lock_holder(out: Path):
    try:
        return json.loads((out / ".lock").read_text())
    except (OSError, ValueError):
        return None


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def trajectory(out: Path) -> list[tuple]:
    """(step, loss, lr) of each row: what a run computed, without its timings."""
    return [(r["step"], r.get("loss"), r.get("lr")) for r in metrics(out)]


def config(out: Path) -> dict:
    return json.loads((out / "config.json").read_text())


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_same_adapter(a: Path, b: Path) -> None:
    wa, wb = load_file(a / "adapter_model.safetensors"), load_file(b / "adapter_model.safetensors")
    assert wa.keys() == wb.keys() and wa
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def flip_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def cut_to_half(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def make_job(tmp_path_factory) -> SimpleNamespace:
    """A tiny model folder, its data and the CLI arguments every run of the tests shares
    (each test file's module fixture `job`)."""
    root = tmp_path_factory.mktemp("run-folder")
    model = tiny_model_folder(root / "model")
    data = write_jsonl(root / "train.jsonl", ROWS[:20])
    args = [
        "--model",
        model,
        "--data",
        data,
        "--rank",
        "4",
        "--batch",
        "2",
        "--seq-len",
        "64",
        "--no-progress",
        "--lmhead",
        "off",
    ]
    return SimpleNamespace(root=root, model=model, data=data, args=args)


def make_finished(job: SimpleNamespace) -> SimpleNamespace:
    """Two finished runs, never modified by a test (copy them): `six` (6 steps, checkpoints
    step-000004 and step-000006) and `four` (4 steps) (each test file's module fixture
    `finished`)."""
    six, four = job.root / "six", job.root / "four"
    for r in cli_all(
        [*job.args, "--steps", "6", "--save-every", "2", "--out", six],
        [*job.args, "--steps", "4", "--save-every", "2", "--out", four],
    ):
        ok(r)
    assert sorted(p.name for p in (six / "checkpoints").iterdir()) == ["latest", "step-000004", "step-000006"]
    return SimpleNamespace(six=six, four=four)


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst
