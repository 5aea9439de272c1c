"""``narrows finetune --resume``: the real CLI in subprocesses (`run_folder_cli`): a killed
run's temporary files removed, what a resumed run may change (and records), a shortened
run, an overridden learning rate, a hand-edited config, bad flag values refused before
torch is imported, and a run resumed without its checkpoints.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from run_folder_cli import (
    FAST,
    _env,
    assert_same_adapter,
    cli,
    cli_all,
    config,
    copy_run,
    make_finished,
    make_job,
    metrics,
    ok,
    refused,
    snapshot,
)
from safetensors.torch import load_file


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return make_job(tmp_path_factory)


@pytest.fixture(scope="module")
def finished(job):
    return make_finished(job)


# --- 1. what a killed run left ----------------------------------------------------------------------
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


# --- 2. what --resume may change ---------------------------------------------------------------------


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
