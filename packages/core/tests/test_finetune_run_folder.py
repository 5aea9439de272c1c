"""The run folder of `narrows finetune`: the real CLI in subprocesses (`run_folder_cli`).

One run per folder at a time (the ``.lock`` flock, taken over after a kill), never into a
folder that holds something else, nothing left behind by a refused run, bad input refused
before loading, damaged checkpoints set aside, a full disk reported with the way back.
Every refusal is exit code 2 with ``narrows: error:`` on stderr. What ``--resume`` may
change: `test_finetune_resume.py`.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal

import pytest
import torch
from run_folder_cli import (
    ADAPTER_DISK_FULL,
    DISK_FULL,
    FAST,
    ROWS,
    SLOW_LOAD,
    assert_same_adapter,
    cli,
    cli_all,
    copy_run,
    cut_to_half,
    flip_middle_byte,
    lock_holder,
    make_finished,
    make_job,
    metrics,
    ok,
    refused,
    snapshot,
    trajectory,
    wait_for,
)

from narrows.core.app.finetune.run_folder import RunFolder, _Hashing
from narrows.core.errors import NarrowsError
from narrows.core.testing import write_jsonl


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return make_job(tmp_path_factory)


@pytest.fixture(scope="module")
def finished(job):
    return make_finished(job)


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
