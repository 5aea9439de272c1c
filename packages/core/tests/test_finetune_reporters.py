"""`narrows finetune --report-to`: TensorBoard and W&B show what metrics.jsonl holds.

TensorBoard: a real run (the CLI in a subprocess), its event files read back with
TensorBoard's own reader and compared row by row with the run's metrics.jsonl; a run
killed after its last checkpoint and resumed shows the curves of the uninterrupted run, no
step twice. W&B: a stub ``wandb`` module in this process (no network, no real wandb), runs
started and resumed in-process. A missing or unknown logger is refused before loading.
"""

from __future__ import annotations

import importlib.machinery
import json
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from test_finetune_run_folder import ROWS, cli, metrics, ok

from narrows.core.app.cli import main
from narrows.core.app.finetune import job as job_module
from narrows.core.app.finetune.config import FinetuneConfig
from narrows.core.app.finetune.reporters import WandB, parse_report_to
from narrows.core.optional import is_available
from narrows.core.testing import tiny_model_folder, write_jsonl

pytest.importorskip("tensorboard")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("reporters")
    model = tiny_model_folder(root / "model")
    data = write_jsonl(root / "train.jsonl", ROWS[:20])
    evals = write_jsonl(root / "eval.jsonl", ROWS[20:])
    settings = dict(
        model=str(model),
        data=str(data),
        eval_data=str(evals),
        rank=4,
        batch=2,
        seq_len=64,
        lmhead="off",
        save_every=2,
    )
    args = [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()] + ["--no-progress"]
    return types.SimpleNamespace(root=root, args=args, settings=settings)


@pytest.fixture(scope="module")
def board(job) -> Path:
    """A finished 4-step run with --report-to tensorboard; never modified (copy it)."""
    out = job.root / "board"
    ok(cli(*job.args, "--steps", "4", "--report-to", "tensorboard", "--out", out))
    return out


def scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard shows for `run`, as (step, value) per tag."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def expected(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """What TensorBoard should show for metrics.jsonl's rows: each number as the float32 it stores."""
    shown = {
        "train/loss": ("loss", 1),
        "train/learning_rate": ("lr", 1),
        "eval/loss": ("eval_loss", 1),
        "train/tokens_per_second": ("tokens_per_s", 1),
        "train/step_seconds": ("step_s", 1),
        "train/peak_memory_gib": ("peak_bytes", 1024**3),
    }
    return {
        tag: [(r["step"], float(np.float32(r[key] / div))) for r in rows if key in r]
        for tag, (key, div) in shown.items()
    }


def test_tensorboard_shows_every_row_of_metrics_jsonl_and_the_config(board):
    rows = metrics(board)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4] and "eval_loss" in rows[0] and "eval_loss" in rows[-1]
    assert scalars(board) == expected(rows)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(board / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    saved = json.loads((board / "config.json").read_text())["config"]
    assert json.loads(text.strip("`\n")) == saved and saved["report_to"] == "tensorboard"
    assert not {"wandb", "wandb-id"} & {p.name for p in board.iterdir()}


def test_a_run_killed_after_its_checkpoint_and_resumed_shows_the_uninterrupted_curves(board, tmp_path):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.compat.proto.event_pb2 import SessionLog

    # killed after step 4's row was logged (metrics.jsonl, TensorBoard), before its checkpoint
    run = shutil.copytree(board, tmp_path / "run")
    shutil.rmtree(run / "checkpoints" / "step-000004")
    ok(cli("--resume", run, "--no-progress"))
    rows = metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    shown, uninterrupted = scalars(run), scalars(board)
    for tag in ("train/loss", "train/learning_rate", "eval/loss"):  # what the run computes
        assert shown[tag] == uninterrupted[tag], tag
    assert shown == expected(rows)  # timings too: the resumed run's, each step once
    # the resumed writer tells every reader to drop the killed run's steps after the checkpoint
    files = sorted((run / "tensorboard").iterdir())
    assert len(files) == 2
    starts = [
        e.step
        for e in EventFileLoader(str(files[1])).Load()
        if e.HasField("session_log") and e.session_log.status == SessionLog.START
    ]
    assert starts == [3]


class StubWandb:
    """What narrows asks of wandb, recorded."""

    def __init__(self):
        self.inits, self.logs, self.finished = [], [], []
        self.module = types.ModuleType("wandb")
        self.module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
        self.module.init = self.init

    def init(self, **kwargs):
        import os

        self.inits.append({**kwargs, "env_mode": os.environ.get("WANDB_MODE")})
        stub = self

        class Run:
            def log(self, data, step):
                stub.logs.append((step, data))

            def finish(self, exit_code=0):
                stub.finished.append(exit_code)

        return Run()


@pytest.fixture
def wandb(monkeypatch):
    stub = StubWandb()
    monkeypatch.setitem(sys.modules, "wandb", stub.module)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    is_available.cache_clear()
    yield stub
    is_available.cache_clear()


def test_wandb_gets_the_config_and_every_row_and_a_resumed_run_continues_the_same_wandb_run(
    job, wandb, tmp_path, monkeypatch
):
    from narrows.core.app.finetune.job import finetune, resume

    out = tmp_path / "run"
    finetune(FinetuneConfig.of(**job.settings, steps=2, out=str(out)), progress=False)  # --report-to none
    assert not wandb.inits
    assert not {"tensorboard", "wandb", "wandb-id"} & {p.name for p in out.iterdir()}

    summarize = job_module.summarize

    def with_exact_match(*args, **kwargs):  # what the embedded GSM8K default adds
        return {**summarize(*args, **kwargs), "exact_match_after": 0.75, "exact_match_before": 0.25}

    monkeypatch.setattr(job_module, "summarize", with_exact_match)
    resume(str(out), {"steps": 3, "report_to": "wandb"}, progress=False)
    monkeypatch.setenv("WANDB_PROJECT", "mine")
    resume(str(out), {"steps": 4}, progress=False)

    run_id = (out / "wandb-id").read_text().strip()
    saved = json.loads((out / "config.json").read_text())["config"]
    first, second = wandb.inits
    for init, project, steps in ((first, "narrows", 3), (second, "mine", 4)):
        assert "mode" not in init and init["env_mode"] == "offline"  # W&B's own setting stands
        assert (init["project"], init["name"], init["dir"]) == (project, "run", str(out))
        assert (init["id"], init["resume"]) == (run_id, "allow")
        assert init["config"] == {**saved, "steps": steps}
    rows = {r["step"]: r for r in metrics(out)}
    em = {"eval/exact_match": 0.75, "eval/exact_match_without_adapter": 0.25}
    assert wandb.logs == [(3, board_row(rows[3])), (3, em), (4, board_row(rows[4])), (4, em)]
    assert wandb.finished == [0, 0]


def board_row(row: dict) -> dict:
    names = {
        "loss": "train/loss",
        "lr": "train/learning_rate",
        "tokens_per_s": "train/tokens_per_second",
        "step_s": "train/step_seconds",
        "eval_loss": "eval/loss",
    }
    return {
        **{names[k]: row[k] for k in names if k in row},
        "train/peak_memory_gib": row["peak_bytes"] / 1024**3,
    }


def test_a_wandb_run_left_by_an_error_is_finished_as_failed(wandb, tmp_path):
    failed, done = WandB({"report_to": "wandb"}, tmp_path, 0), WandB({"report_to": "wandb"}, tmp_path, 0)
    with pytest.raises(RuntimeError):
        try:
            raise RuntimeError("out of memory")
        finally:
            failed.close()
    done.close()
    assert wandb.finished == [1, 0]
    assert wandb.inits[0]["id"] == wandb.inits[1]["id"]  # one run folder, one W&B run
    assert parse_report_to("all") == ["tensorboard", "wandb"]  # every one installed
    assert parse_report_to(" wandb, tensorboard ,wandb") == ["wandb", "tensorboard"]


def test_a_missing_or_unknown_logger_is_refused_before_loading(job, monkeypatch, capsys, tmp_path):
    for name in ("tensorboard", "wandb"):
        monkeypatch.setitem(sys.modules, name, None)  # not importable
    is_available.cache_clear()
    try:
        for given, said in (
            ("wandb", "pip install 'narrows-core[wandb]'"),
            ("tensorboard", "pip install 'narrows-core[tensorboard]'"),
            ("none,wandb", "unknown 'none'"),
            ("tensorbord", "unknown 'tensorbord'"),
        ):
            out = tmp_path / given
            assert main(["finetune", *job.args, "--report-to", given, "--out", str(out)]) == 2
            err = capsys.readouterr().err
            assert err.startswith("narrows: error: ") and f"--report-to {given}" in err and said in err, err
            assert not out.exists()
        assert parse_report_to("all") == [] and parse_report_to("none") == []
    finally:
        is_available.cache_clear()


def test_wandb_without_credentials_is_refused_before_anything_is_loaded_or_written(
    job, wandb, monkeypatch, capsys, tmp_path
):
    """W&B would stop a run that has no key once the model is loaded: narrows asks first,
    as wandb looks (WANDB_API_KEY, the netrc entry `wandb login` writes, WANDB_MODE)."""
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    netrc = tmp_path / "netrc"
    netrc.write_text("machine example.com login me password elsewhere\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    out = tmp_path / "run"
    assert main(["finetune", *job.args, "--report-to", "wandb", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("narrows: error: --report-to wandb: W&B has no credentials here")
        and "api.wandb.ai" in err
    )
    assert "wandb login" in err and "WANDB_MODE=offline" in err
    assert not out.exists() and not wandb.inits

    netrc.write_text(netrc.read_text() + "machine api.wandb.ai login user password k3y\n")
    assert parse_report_to("wandb") == ["wandb"]  # logged in, as `wandb login` leaves it
    netrc.write_text("")
    for name, value in (("WANDB_API_KEY", "k3y"), ("WANDB_MODE", "offline"), ("WANDB_MODE", "disabled")):
        with monkeypatch.context() as m:
            m.setenv(name, value)
            assert parse_report_to("wandb") == ["wandb"]


def test_a_wandb_run_that_fails_to_start_leaves_the_run_folder_as_it_found_it(job, wandb, tmp_path):
    """W&B refusing after the model has loaded (a key its server rejects, no network): one
    `narrows: error:` line, and neither config.json nor wandb-id nor wandb/ is left behind,
    so the same command runs once W&B works."""
    from narrows.core import NarrowsError
    from narrows.core.app.finetune.job import finetune

    def refusing(**kwargs):
        (Path(kwargs["dir"]) / "wandb").mkdir()  # what wandb writes before it gives up
        raise RuntimeError("api_key not configured (no-tty)")

    working, wandb.module.init = wandb.module.init, refusing
    out = tmp_path / "run"
    settings = {**job.settings, "steps": 2, "report_to": "tensorboard,wandb", "out": str(out)}
    with pytest.raises(
        NarrowsError, match=r"--report-to wandb: W&B did not start a run \(RuntimeError: api_key"
    ):
        finetune(FinetuneConfig.of(**settings), progress=False)
    assert not out.exists()
    wandb.module.init = working
    finetune(FinetuneConfig.of(**settings), progress=False)
    assert {"config.json", "wandb-id", "tensorboard"} <= {p.name for p in out.iterdir()}
