"""The run folder of `narrows finetune`: the real CLI in subprocesses.

One run per folder at a time (the ``.lock`` flock, taken over after a kill), never into a
folder that holds something else, nothing left behind by a refused run, bad input refused
before loading, damaged checkpoints set aside, a full disk reported with the way back, a
killed run's temporary files removed, and what ``--resume`` may change.

Every refusal is exit code 2 with ``narrows: error:`` on stderr. Each process imports torch,
transformers and peft, which dominates its time: independent commands run two at a time,
and the children keep their bytecode in a cache outside the tree (this environment may set
PYTHONDONTWRITEBYTECODE, which makes every child compile everything again).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from narrows.core.app.finetune.run_folder import RunFolder, _Hashing
from narrows.core.errors import NarrowsError
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


@pytest.fixture(scope="module")
def job(tmp_path_factory):
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


@pytest.fixture(scope="module")
def finished(job):
    """Two finished runs, never modified by a test (copy them): `six` (6 steps, checkpoints
    step-000004 and step-000006) and `four` (4 steps)."""
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


# --- 1. one run per folder ------------------------------------------------------------------


def test_a_second_run_is_refused_while_the_first_holds_the_folder_and_a_killed_runs_lock_is_taken_over(
    job, tmp_path
):
    out = tmp_path / "run"
    first = cli(*job.args, "--steps", "200", "--warmup", "1", "--save-every", "2", "--out", out, wait=False)
    try:
        holder = wait_for(lambda: lock_holder(out), proc=first)
        assert holder["pid"] == first.pid
        first.send_signal(signal.SIGSTOP)  # it holds the lock, and stays where it is meanwhile
        try:
            second = cli(*job.args, "--steps", "4", "--out", out)
        finally:
            first.send_signal(signal.SIGCONT)
        err = refused(second)
        assert second.seconds < 15  # refused at once, before anything is loaded
        assert f"{out} is in use by another narrows run (pid {first.pid} on " in err
        assert "another --out" in err
        assert lock_holder(out)["pid"] == first.pid  # the refused run left the lock alone

        # let it checkpoint and train on, then kill it: the kernel drops its flock
        wait_for(lambda: (out / "checkpoints" / "latest").exists() and len(metrics(out)) >= 3, proc=first)
    finally:
        first.kill()
        first.communicate()
    assert first.returncode == -signal.SIGKILL
    assert lock_holder(out)["pid"] == first.pid  # its name stays in the file; its lock does not
    at = max(int(p.name[5:]) for p in RunFolder(out).saved_steps())
    steps = max(6, at + 2)
    err = ok(cli("--resume", out, "--steps", steps, "--no-progress"))
    assert f"taking over the lock left by pid {first.pid} on " in err
    assert [r["step"] for r in metrics(out)] == list(range(1, steps + 1))  # no step twice, none missing
    assert (out / "adapter_model.safetensors").is_file()
    assert not (out / ".lock").exists()  # a run that ended lets go of the folder


# --- 2. a folder that holds something else ----------------------------------------------------


def test_only_a_new_or_empty_folder_takes_a_new_run(job, finished, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "README.md").write_text("# my notes\n")
    (mine / "summary.json").write_text('{"mine": true}\n')
    (mine / "metrics.jsonl").write_text('{"step": 1, "accuracy": 0.5}\n')
    before = snapshot(mine)
    empty = tmp_path / "empty"
    empty.mkdir()
    done_before = snapshot(finished.four)

    r_mine, r_empty, r_done = cli_all(
        [*job.args, "--steps", "4", "--out", mine],
        [*job.args, "--steps", "4", "--out", empty],
        [*job.args, "--steps", "4", "--out", finished.four],
    )
    err = refused(r_mine)
    assert f"--out {mine} is not empty and is not a narrows run" in err
    assert "README.md, metrics.jsonl, summary.json" in err and "pick another --out" in err
    assert snapshot(mine) == before  # every file as it was
    assert sorted(p.name for p in mine.iterdir()) == [
        "README.md",
        "metrics.jsonl",
        "summary.json",
    ]  # no .lock

    ok(r_empty)
    assert [r["step"] for r in metrics(empty)] == [1, 2, 3, 4]
    assert (empty / "adapter_model.safetensors").is_file() and not (empty / ".lock").exists()

    err = refused(r_done)
    assert f"{finished.four} already holds a run" in err and f"--resume {finished.four}" in err
    assert snapshot(finished.four) == done_before
    assert not (finished.four / ".lock").exists()


# --- 3. a refused run leaves nothing --------------------------------------------------------------


def test_a_refused_run_leaves_no_folder_behind(job, tmp_path):
    targets, untrainable = tmp_path / "targets", tmp_path / "untrainable"
    r_targets, r_untrainable = cli_all(
        [*job.args, "--steps", "4", "--targets", "q_proj,wq", "--out", targets],
        [*job.args, "--steps", "4", "--seq-len", "8", "--out", untrainable],
    )
    assert "--targets 'q_proj,wq': no linear module named ['wq']" in refused(r_targets, notices=True)
    assert "no trainable token" in refused(r_untrainable)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_refused_run_leaves_no_parent_folder_behind(job, tmp_path):
    model = shutil.copytree(job.model, tmp_path / "model")
    cut_to_half(model / "model.safetensors")  # refused after the folder was claimed
    args = [a if a != job.model else model for a in job.args]
    refused(cli(*args, "--steps", "4", "--out", tmp_path / "new" / "deeper" / "run"))
    assert not (tmp_path / "new").exists()


# --- 4. bad input, refused before loading ------------------------------------------------------


def test_bad_input_is_refused_fast_before_loading(job, tmp_path):
    model = shutil.copytree(job.model, tmp_path / "model")
    cut_to_half(model / "model.safetensors")
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"PK\x03\x04 not a gguf at all" * 8)
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder\n")
    bad = write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], '{"messages": [}'])
    base = job.args[4:]  # everything but --model and --data
    data = ["--data", job.data]
    runs = tmp_path / "runs"  # made here: a refused run removes the --out it created, not its parents
    runs.mkdir()
    cases = {
        # with data that is bad too: the model's headers are checked first, before any row is read
        "truncated": (
            ["--model", model, "--data", bad, *base],
            [str(model / "model.safetensors"), "truncated"],
        ),
        "gguf": (["--model", gguf, *data, *base], [str(gguf), "is not a GGUF file"]),
        "gpu-budget": ([*job.args, "--gpu-budget", "lots"], ["--gpu-budget"]),
        "lr": ([*job.args, "--lr=-1e-3"], ["--lr must be a positive number"]),
        "warmup": (
            [*job.args, "--warmup", "50", "--steps", "4"],
            ["--warmup must be between 0 and --steps (4)"],
        ),
        "dropout": ([*job.args, "--dropout", "1.5"], ["--dropout must be in [0, 1)", "1.5"]),
    }
    commands = [[*args, "--steps", "4", "--out", runs / name] for name, (args, _) in cases.items()]
    commands.append([*job.args, "--steps", "4", "--out", a_file / "run"])
    expected = [*(said for _, said in cases.values()), [f"--out {a_file / 'run'}: cannot create it"]]
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        commands.append([*job.args, "--steps", "4", "--out", locked / "run"])
        expected.append([f"--out {locked / 'run'}: cannot create it"])
    try:
        results = cli_all(*commands)
    finally:
        if os.geteuid() != 0:
            locked.chmod(0o700)
    for command, r, said in zip(commands, results, expected, strict=True):
        err = refused(r)
        for part in said:
            assert part in err, (command, err)
        assert r.seconds < FAST, (command, r.seconds)
    assert list(runs.iterdir()) == []  # nothing was written for a refused run
    assert a_file.read_text() == "not a folder\n"


# --- 5. damaged checkpoints -----------------------------------------------------------------------


def test_a_damaged_checkpoint_is_set_aside_and_the_one_before_it_used(finished, tmp_path):
    flipped = copy_run(finished.six, tmp_path / "flipped")
    flip_middle_byte(flipped / "checkpoints" / "step-000006" / "state.pt")
    cut = copy_run(finished.six, tmp_path / "cut")
    cut_to_half(cut / "checkpoints" / "step-000006" / "state.pt")
    every = copy_run(finished.six, tmp_path / "every")
    for step in ("step-000004", "step-000006"):
        flip_middle_byte(every / "checkpoints" / step / "state.pt")

    r_flipped, r_cut, r_every = cli_all(
        *(["--resume", run, "--no-progress"] for run in (flipped, cut, every))
    )
    for run, r, why in ((flipped, r_flipped, "fails its sha256"), (cut, r_cut, "bytes")):
        err = ok(r)
        assert f"checkpoint {run / 'checkpoints' / 'step-000006'} is damaged" in err and why in err
        assert "step-000006.damaged" in err
        assert (run / "checkpoints" / "step-000006.damaged" / "state.pt").is_file()
        assert_same_adapter(finished.six, run)  # steps 5 and 6 trained again from step 4
        assert trajectory(run) == trajectory(finished.six)
    assert "state.pt fails its sha256" in r_flipped.stderr
    assert "state.pt has " in r_cut.stderr and " bytes, " in r_cut.stderr

    err = refused(r_every, notices=True)
    assert f"every checkpoint of {every} is damaged" in err and "--out" in err
    assert sorted(p.name for p in (every / "checkpoints").glob("step-*")) == [
        "step-000004.damaged",
        "step-000006.damaged",
    ]


@pytest.mark.parametrize(
    "meta", ["{}", "[]", '{"bytes": "12", "sha256": "x"}', '{"bytes": 12}', '{"sha256": "x"}', "null"]
)
def test_a_meta_json_without_its_size_and_checksum_is_damage(meta, tmp_path):
    """restore() sets aside whatever `_damage` names; a meta.json of the wrong shape is named."""
    from narrows.core.app.finetune.run_folder import _damage

    step = tmp_path / "step-000002"
    step.mkdir()
    (step / "state.pt").write_bytes(b"\0" * 12)
    (step / "meta.json").write_text(meta)
    assert _damage(step) == "meta.json lacks its byte count and sha256"


# --- 6. a full disk ---------------------------------------------------------------------------------


def test_a_full_disk_stops_the_run_with_the_way_back_and_resume_finishes_it(job, finished, tmp_path):
    out = tmp_path / "run"
    args = [*job.args, "--steps", "6", "--save-every", "2"]
    r = cli(*args, "--out", out, script=DISK_FULL)
    err = refused(r, notices=True)  # after transformers' warnings
    checkpoints = out / "checkpoints"
    assert f"no space left on the device of {checkpoints} writing step-000004" in err
    assert f"the last checkpoint, {checkpoints / 'step-000002'}, is intact" in err
    assert f"--resume {out}" in err
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step-000002"]  # no .step-*.tmp
    assert not (out / "adapter_model.safetensors").exists()

    ok(cli("--resume", out, "--no-progress"))
    assert_same_adapter(finished.six, out)
    assert trajectory(out) == trajectory(finished.six)


def test_a_full_disk_at_the_final_adapter_write_says_the_way_back_and_resume_finishes_it(
    job, finished, tmp_path
):
    out = tmp_path / "run"
    r = cli(*job.args, "--steps", "4", "--save-every", "2", "--out", out, script=ADAPTER_DISK_FULL)
    err = refused(r, notices=True)
    assert f"no space left on the device of {out} writing adapter_model.safetensors" in err
    assert f"the last checkpoint, {out / 'checkpoints' / 'step-000004'}, is intact" in err
    assert f"--resume {out}" in err
    assert not (out / "adapter_model.safetensors").exists()
    assert not list(out.glob(".adapter.*"))  # no temporary folder left

    ok(cli("--resume", out, "--no-progress"))
    assert_same_adapter(finished.four, out)


def test_ctrl_c_while_the_model_loads_is_one_line_and_exit_130(job, tmp_path):
    out = tmp_path / "run"
    proc = cli(*job.args, "--steps", "4", "--out", out, wait=False, script=SLOW_LOAD)
    lines = []
    for line in proc.stderr:  # warnings may come first
        lines.append(line)
        if line.strip() == "LOADING":
            break
    proc.send_signal(signal.SIGINT)
    _, rest = proc.communicate(timeout=120)
    err = "".join(lines) + rest
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    said = rest.strip().splitlines()
    assert len(said) == 1 and said[0].startswith("narrows: interrupted"), err
    assert "run the command again" in said[0]
    assert not out.exists()  # the run had written nothing: its folder goes


def test_a_full_disk_under_torch_save_keeps_its_errno_and_becomes_a_narrows_error(tmp_path):
    class Full:
        def __init__(self):
            self.written = 0

        def write(self, b):
            if self.written > 1000:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.written += len(b)
            return len(b)

        def flush(self):
            pass

    out = _Hashing(Full())
    with pytest.raises(RuntimeError):  # torch's own, which has no errno
        torch.save({"w": torch.zeros(10_000)}, out)
    assert out.error is not None and out.error.errno == errno.ENOSPC
    assert out.bytes > 1000

    run = RunFolder(tmp_path / "run")
    run.root.mkdir()

    def write():
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(NarrowsError) as e:
        run.guard(run.metrics, write, need=1234)
    said = str(e.value)
    assert f"no space left on the device of {run.root} writing metrics.jsonl" in said
    assert "needs about 1.21 KiB" in said and f"--resume {run.root}" in said

    def other():
        raise OSError(errno.EACCES, "Permission denied")

    with pytest.raises(PermissionError):  # any other error is not a full disk
        run.guard(run.metrics, other, need=1234)


# --- 7. what a killed run left ----------------------------------------------------------------------


def test_resume_removes_what_an_interrupted_run_left(finished, tmp_path):
    run = copy_run(finished.four, tmp_path / "run")
    half_checkpoint = run / "checkpoints" / ".step-000009.abc.tmp"
    half_checkpoint.mkdir()
    (half_checkpoint / "state.pt").write_bytes(b"\0" * 100)
    half_metrics = run / ".metrics.jsonl.xyz.tmp"
    half_metrics.write_text('{"step": 1')

    err = ok(cli("--resume", run, "--steps", "6", "--no-progress"))
    assert f"removed what an interrupted run left in {run}" in err
    assert "checkpoints/.step-000009.abc.tmp" in err and ".metrics.jsonl.xyz.tmp" in err
    assert not half_checkpoint.exists() and not half_metrics.exists()
    assert not list(run.rglob("*.tmp"))
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4, 5, 6]


# --- 8. what --resume may change ---------------------------------------------------------------------


def test_resume_changes_only_what_keeps_the_run_and_records_every_change(finished, tmp_path):
    run = copy_run(finished.four, tmp_path / "run")
    kept = {name: (run / name).read_bytes() for name in ("config.json", "metrics.jsonl")}
    six_before = snapshot(finished.six)
    r_lr, r_out, r_back = cli_all(
        ["--resume", run, "--steps", "6", "--lr", "1e-3", "--no-progress"],
        ["--resume", run, "--out", tmp_path / "other", "--no-progress"],
        ["--resume", finished.six, "--steps", "2", "--no-progress"],
    )
    err = refused(r_lr)
    assert f"--resume {run}: --lr 0.0005 → 0.001 would change what the run trains" in err
    assert "--override" in err and "--out" in err
    assert {name: (run / name).read_bytes() for name in kept} == kept
    err = refused(r_out)
    assert f"--resume {run}" in err and f"--out {tmp_path / 'other'}" in err and "drop --out" in err
    assert not (tmp_path / "other").exists()
    err = refused(r_back)
    assert "the run is at step 6 already" in err and "--steps 2" in err
    assert snapshot(finished.six) == six_before
    for r in (r_lr, r_out, r_back):
        assert r.seconds < FAST

    err = ok(cli("--resume", run, "--steps", "6", "--no-progress"))
    assert "--steps 4 → 6" in err
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4, 5, 6]
    saved = config(run)
    assert saved["config"]["steps"] == 6 and len(saved["history"]) == 2
    assert saved["history"][1]["changed"] == {"steps": [4, 6]} and saved["history"][1]["step"] == 4
    assert "override" not in saved["history"][1]

    err = ok(cli("--resume", run, "--lr", "1e-3", "--override", "--steps", "8", "--no-progress"))
    assert "--lr 0.0005 → 0.001: overridden" in err
    assert [r["step"] for r in metrics(run)] == list(range(1, 9))
    saved = config(run)
    assert saved["config"]["steps"] == 8 and saved["config"]["lr"] == 1e-3
    assert len(saved["history"]) == 3 and saved["history"][2]["override"] is True
    assert saved["history"][2]["changed"] == {"lr": [5e-4, 1e-3], "steps": [6, 8]}


def test_resume_may_shorten_a_run_below_its_default_warmup(finished, tmp_path):
    run = copy_run(finished.four, tmp_path / "run")
    saved = config(run)  # what a `--steps 200` run killed after its step-4 checkpoint holds
    saved["config"]["steps"] = saved["history"][-1]["config"]["steps"] = 200
    (run / "config.json").write_text(json.dumps(saved))
    ok(cli("--resume", run, "--steps", "6", "--no-progress"))
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4, 5, 6]


# `narrows finetune` whose optimizer writes the rate of every step it takes, as it takes it
# (what AdamW reads from its parameter groups), one JSON line per step, to $NARROWS_TEST_RATES
RECORD_RATES = """
import json, os, sys, torch
import narrows.core.app.cli
real = torch.optim.AdamW.step
def step(self, *args, **kwargs):
    with open(os.environ["NARROWS_TEST_RATES"], "a") as f:
        f.write(json.dumps([group["lr"] for group in self.param_groups]) + "\\n")
    return real(self, *args, **kwargs)
torch.optim.AdamW.step = step
sys.exit(narrows.core.app.cli.main(sys.argv[1:]))
"""


def rates_used(out: Path, *args) -> list[float]:
    """Resume `out` with ARGS; the rate the optimizer used at each step it took."""
    log = out.parent / f"{out.name}.rates"
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            RECORD_RATES,
            "finetune",
            "--resume",
            str(out),
            "--no-progress",
            *map(str, args),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**_env(), "NARROWS_TEST_RATES": str(log)},
    )
    ok(r)
    return [json.loads(line)[0] for line in log.read_text().splitlines()]


def schedule_rates(lr: float, warmup: int, steps: int) -> list[float]:
    """The rate of each step 1..steps of transformers' warmup-and-cosine schedule, from an
    optimizer of its own: the independent computation the run's rates are held to."""
    from transformers import get_cosine_schedule_with_warmup

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = get_cosine_schedule_with_warmup(opt, warmup, steps)
    rates = []
    for _ in range(steps):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return rates


def test_an_overridden_learning_rate_is_the_one_the_optimizer_uses_from_the_resumed_step_on(
    finished, tmp_path
):
    """`four` ran 4 steps at 5e-4 (warmup 1). Extended to 6, its steps 5 and 6 run at the rates
    of the 6-step schedule; with --lr 1e-3 --override, at that schedule's rates for the new
    peak, and metrics.jsonl's lr column follows. Fails if the checkpoint's scheduler state
    brings its own peak or its old schedule's rate back."""
    kept, raised = copy_run(finished.four, tmp_path / "kept"), copy_run(finished.four, tmp_path / "raised")
    assert rates_used(kept, "--steps", "6") == schedule_rates(5e-4, 1, 6)[4:]
    want = schedule_rates(1e-3, 1, 6)
    assert want[4] > 0 and want != schedule_rates(5e-4, 1, 6)
    assert rates_used(raised, "--steps", "6", "--lr", "1e-3", "--override") == want[4:]
    logged = {r["step"]: r["lr"] for r in metrics(raised)}
    assert [logged[5], logged[6]] == [want[5], 0.0]  # the rate of the step after each
    assert logged[4] == 0.0  # the 4-step schedule's end, logged before the run was extended
    history = config(raised)["history"]
    assert history[-1]["changed"] == {"steps": [4, 6], "lr": [5e-4, 1e-3]} and history[-1]["override"] is True
    assert history[-1]["config"]["lr"] == 1e-3 == config(raised)["config"]["lr"]
    a, b = load_file(kept / "adapter_model.safetensors"), load_file(raised / "adapter_model.safetensors")
    assert any(not torch.equal(a[k], b[k]) for k in a)


def edit(run: Path, **fields) -> None:
    saved = config(run)
    saved["config"].update(fields)
    (run / "config.json").write_text(json.dumps(saved, indent=2))


def test_a_hand_edited_config_is_applied_and_recorded_or_refused_naming_the_field(finished, tmp_path):
    longer, faster, wider = (copy_run(finished.four, tmp_path / n) for n in ("longer", "faster", "wider"))
    edit(longer, steps=6)
    edit(faster, lr=1e-3, steps=6)
    edit(wider, rank=8)
    before = snapshot(faster)
    r_faster, r_wider, r_wider_override = cli_all(
        ["--resume", faster, "--no-progress"],
        ["--resume", wider, "--no-progress"],
        ["--resume", wider, "--override", "--no-progress"],
    )
    err = refused(r_faster)
    assert f"lr (edited in {faster / 'config.json'}) 0.0005 → 0.001 would change what the run trains" in err
    assert "put lr back" in err and "lr = 0.0005" in err and "--override" in err
    assert snapshot(faster) == before and r_faster.seconds < FAST
    for r in (r_wider, r_wider_override):
        err = refused(r)
        assert f"rank (edited in {wider / 'config.json'}) 4 → 8 cannot change in a resumed run" in err
        assert f"narrows finetune --config {wider} --rank 8 --out NEW_FOLDER" in err

    err = ok(cli("--resume", longer, "--no-progress"))
    assert f"steps (edited in {longer / 'config.json'}) 4 → 6: the run ends at the new step count" in err
    assert [r["step"] for r in metrics(longer)] == [1, 2, 3, 4, 5, 6]
    last = config(longer)["history"][-1]
    assert last["changed"] == {"steps": [4, 6]} and last["edited"] == ["steps"] and "override" not in last

    assert rates_used(faster, "--override") == schedule_rates(1e-3, 1, 6)[4:]
    last = config(faster)["history"][-1]
    assert last["changed"] == {"lr": [5e-4, 1e-3], "steps": [4, 6]} and last["edited"] == ["lr", "steps"]
    assert last["override"] is True
    # what it ran with is now the reference: resuming again changes nothing
    err = ok(cli("--resume", faster, "--no-progress"))
    assert "finished at step 6; nothing to resume" in err


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (lambda c: {**c, "config": {**c["config"], "steps": "8"}}, "config: steps = '8' should be int"),
        (lambda c: {**c, "config": {**c["config"], "rank": None}}, "config: rank = None should be int"),
        (lambda c: [c], "expected a JSON object of settings"),
        (lambda c: {k: v for k, v in c.items() if k != "config"}, 'no "config" (the run\'s settings)'),
        (b"\xff\xfe{}", "not UTF-8"),
        (lambda c: {**c, "history": {"started": 1}}, "history should be a list"),
    ],
)
def test_a_malformed_run_config_is_refused_naming_the_file_and_field_before_torch(
    finished, tmp_path, content, said
):
    run = copy_run(finished.four, tmp_path / "run")
    file = run / "config.json"
    file.write_bytes(content if isinstance(content, bytes) else json.dumps(content(config(run))).encode())
    before = snapshot(run)
    script = (
        "import sys, narrows.core.app.cli as c; rc = c.main(sys.argv[1:]); "
        "sys.exit(rc + 100 * ('torch' in sys.modules))"
    )
    r = cli("--resume", run, "--steps", "6", script=script)
    err = refused(r)
    assert f"narrows: error: {file}" in err and said in err, err
    assert snapshot(run) == before


def test_bad_flag_values_are_refused_before_torch_is_imported(job, finished, tmp_path):
    script = (
        "import sys, narrows.core.app.cli as c; rc = c.main(sys.argv[1:]); "
        "sys.exit(rc + 100 * ('torch' in sys.modules))"
    )
    for args, said in (
        ([*job.args, "--rank", "0", "--out", tmp_path / "a"], "--rank must be at least 1"),
        ([*job.args, "--dropout", "1.5", "--out", tmp_path / "b"], "--dropout must be in [0, 1)"),
        (["--resume", finished.four, "--save-every", "0"], "--save-every must be at least 1"),
        (["--resume", finished.four, "--steps", "2"], "the run is at step 4 already"),
    ):
        err = refused(cli(*args, script=script))
        assert said in err, (args, err)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_resume_without_its_checkpoints_restarts_only_when_told_and_says_so(finished, tmp_path):
    run = copy_run(finished.four, tmp_path / "run")
    shutil.rmtree(run / "checkpoints")
    before = snapshot(run)
    err = refused(cli("--resume", run, "--no-progress"))
    assert f"no checkpoint is left in {run / 'checkpoints'}, though the run logged 4 steps" in err
    assert "--override" in err and snapshot(run) == before
    err = ok(cli("--resume", run, "--override", "--no-progress"))
    assert f"{run} has no checkpoint left: the run starts from step 0" in err
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4]
    assert_same_adapter(run, finished.four)  # trained again from the start: the same numbers
    last = config(run)["history"][-1]
    assert last["step"] == 0 and last["override"] is True and "restarted" in last
