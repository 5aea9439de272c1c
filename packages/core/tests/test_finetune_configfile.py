"""``narrows finetune --config FILE``: settings from a JSON file (or a run folder's own
config.json) train what the same flags train; flags on the command line win; a bad file
is refused naming the file and the field. ``--help`` shows the common flags, and
``--help-advanced`` the planner overrides besides."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from narrows.core.app.cli import main
from narrows.core.app.finetune.command import ADVANCED
from narrows.core.testing import child_env, tiny_model_folder, write_jsonl

ROWS = [
    {"messages": [{"role": "user", "content": f"{a}*{b}?"}, {"role": "assistant", "content": f"{a * b}"}]}
    for a in range(5)
    for b in range(4)
]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("configfile")
    settings = {
        "model": str(tiny_model_folder(root / "model")),
        "data": str(write_jsonl(root / "train.jsonl", ROWS[:16])),
        "eval_data": str(write_jsonl(root / "eval.jsonl", ROWS[16:])),
        "rank": 4,
        "batch": 2,
        "seq_len": 64,
        "lr": 1e-2,
        "steps": 2,
        "eval_rows": 2,
        "exact_match": 0,
    }
    return root, settings


def _flags(settings: dict) -> list[str]:
    return [a for k, v in settings.items() for a in (f"--{k.replace('_', '-')}", str(v))]


def _finetune(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "narrows.core.app.cli", "finetune", "--no-progress", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=child_env(), timeout=600)


def _adapter(run) -> dict[str, torch.Tensor]:
    return load_file(run / "adapter_model.safetensors")


def _config(run) -> dict:
    return json.loads((run / "config.json").read_text())["config"]


def test_a_config_file_and_a_run_folder_train_what_the_flags_train(inputs):
    root, settings = inputs
    by_flags = _finetune(*_flags(settings), "--out", str(root / "flags"))
    assert by_flags.returncode == 0, by_flags.stderr
    file = root / "settings.json"
    file.write_text(json.dumps(settings))
    by_file = _finetune("--config", str(file), "--out", str(root / "file"))
    assert by_file.returncode == 0, by_file.stderr
    # the first run's folder as the next run's settings (its out is replaced by the flag)
    by_run = _finetune("--config", str(root / "flags"), "--out", str(root / "again"))
    assert by_run.returncode == 0, by_run.stderr
    want = _adapter(root / "flags")
    for run in ("file", "again"):
        got = _adapter(root / run)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), run
        assert {k: v for k, v in _config(root / run).items() if k != "out"} == {
            k: v for k, v in _config(root / "flags").items() if k != "out"
        }
    # a flag on the command line wins over the file, and is what the run records
    longer = _finetune("--config", str(file), "--steps", "3", "--out", str(root / "longer"))
    assert longer.returncode == 0, longer.stderr
    assert _config(root / "longer")["steps"] == 3 and _config(root / "longer")["rank"] == 4


@pytest.mark.parametrize(
    ("content", "said"),
    [
        ({"stepz": 3}, "unknown settings ['stepz']"),
        ({"seq-len": 64}, "write 'seq_len': field names, not flags"),
        ({"steps": "40"}, "steps = '40' should be int"),
        ({"packing": 1}, "packing = 1 should be bool"),
        ({"rank": True}, "rank = True should be int"),
        ({"training": {"steps": "40"}}, "training.steps = '40' should be int"),
        ({"training": {"rank": 4}}, "unknown settings ['training.rank']"),
        ({"steps": 3, "training": {"steps": 4}}, "steps is given twice (steps and training.steps)"),
        ([1, 2], "expected a JSON object of settings"),
        ("{not json", "not readable as JSON"),
    ],
)
def test_a_bad_config_file_is_refused_naming_the_file_and_field(tmp_path, capsys, content, said):
    file = tmp_path / "run.json"
    file.write_text(content if isinstance(content, str) else json.dumps(content))
    code = main(["finetune", "--config", str(file), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("narrows: error:") and str(file) in err and said in err, err
    assert not (tmp_path / "out").exists()


def test_a_grouped_config_file_reads_as_the_flat_one(inputs, tmp_path):
    """Settings in their groups (``{"training": {"steps": 2}}``) are the same settings as
    each under its own name, which is how config.json writes them."""
    from narrows.core.app.finetune.config import SETTINGS
    from narrows.core.app.finetune.configfile import read_config_file

    _, settings = inputs
    grouped: dict = {}
    for name, value in settings.items():
        grouped.setdefault(SETTINGS[name], {})[name] = value
    (tmp_path / "flat.json").write_text(json.dumps(settings))
    (tmp_path / "grouped.json").write_text(json.dumps(grouped))
    flat = read_config_file(str(tmp_path / "flat.json"))
    assert read_config_file(str(tmp_path / "grouped.json")) == flat == settings


def test_config_with_resume_or_a_missing_file_is_refused(tmp_path, capsys):
    assert main(["finetune", "--config", str(tmp_path / "none.json")]) == 2
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "s.json").write_text("{}")
    assert main(["finetune", "--config", str(tmp_path / "s.json"), "--resume", str(tmp_path)]) == 2
    assert "starts a new run" in capsys.readouterr().err


def test_help_shows_the_common_flags_and_help_advanced_the_rest():
    def helped(flag: str) -> str:
        r = subprocess.run(
            [sys.executable, "-m", "narrows.core.app.cli", "finetune", flag],
            capture_output=True,
            text=True,
            env={**child_env(), "COLUMNS": "100"},
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        return r.stdout

    short, full = helped("--help"), helped("--help-advanced")
    assert len(short.splitlines()) <= 60
    for flag in ("--model", "--data", "--gpu-budget", "--steps", "--config", "--resume"):
        assert flag in short and flag in full

    def listed(flag: str, text: str) -> bool:  # an option's own line (help text wraps deeper)
        return re.search(rf"^  {re.escape(flag)}\b", text, re.M) is not None

    for flag in ADVANCED:
        assert not listed(flag, short) and listed(flag, full), flag
    assert "--step-mode" in ADVANCED and "--help-advanced" in short


def test_every_flag_is_built_from_its_setting():
    """One flag per setting (world_size excepted: the launch sets it), its default None so
    that a flag given is told apart from one left out, its help ending in the field's
    default, its choices the field's."""
    import argparse

    from narrows.core.app.finetune.command import add_parser
    from narrows.core.app.finetune.config import FinetuneConfig, leaves

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    finetune = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[
        "finetune"
    ]
    actions = {a.dest: a for a in finetune._actions}
    defaults = FinetuneConfig().settings()
    for _, f in leaves():
        if f.name == "world_size":
            assert f.name not in actions
            continue
        action = actions[f.name]
        assert action.default is None, f.name
        said = getattr(action, "narrows_help", action.help)
        if isinstance(defaults[f.name], (int, float, str)) and not isinstance(defaults[f.name], bool):
            assert said.endswith(f"(default: {defaults[f.name]})"), (f.name, said)
        if f.metadata["choices"] is not None:
            assert tuple(action.choices) == tuple(f.metadata["choices"]), f.name
    assert vars(finetune.parse_args([])).keys() >= set(defaults) - {"world_size"}
    assert finetune.parse_args(["--step-mode"]).step_mode is True
    assert finetune.parse_args(["--no-step-mode"]).step_mode is False
    assert finetune.parse_args(["--lr", "1e-3", "--rank", "8"]).lr == 1e-3


def resume_rows() -> list[str]:
    """README's table of what a resume may change, from the three tables in the code."""
    from narrows.core.app.finetune.config import FIXED, OVERRIDABLE, RESUMABLE

    def flag(name: str) -> str:
        return "the ranks (torchrun)" if name == "world_size" else f"`--{name.replace('_', '-')}`"

    return [
        f"| {flag(name)} | {when} | {how} |"
        for table, when in ((RESUMABLE, "freely"), (OVERRIDABLE, "`--override`"), (FIXED, "never"))
        for name, how in table.items()
    ]


def test_every_setting_says_what_a_resume_does_with_it_and_the_readme_lists_them():
    """Each FinetuneConfig setting is in exactly one of RESUMABLE, OVERRIDABLE and FIXED, and
    README's "What a resume may change" table is theirs, row for row."""
    from pathlib import Path

    from narrows.core.app.finetune.config import FIXED, OVERRIDABLE, RESUMABLE, SETTINGS

    fields = list(SETTINGS)
    tables = [*RESUMABLE, *OVERRIDABLE, *FIXED]
    assert sorted(tables) == sorted(fields), set(tables) ^ set(fields)
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    head = "| setting | with `--resume` | how it takes effect |\n|---|---|---|\n"
    assert head in readme
    table = readme.split(head, 1)[1].split("\n\n", 1)[0].splitlines()
    assert table == resume_rows()
