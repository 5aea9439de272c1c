"""`narrows finetune --seq-tile`: the MLP tiled over the sequence, streamed or resident, and
what the run reports about its saved layer inputs; bad values refused before any loading."""

import json

import pytest

from narrows.core.app.cli import main
from narrows.core.testing import tiny_model_folder, write_jsonl

# long rows, so that a batch is many tiles long
ROWS = [{"text": " ".join(f"w{(7 * i + j) % 50}" for j in range(40))} for i in range(8)]


def run(tmp_path, *extra):
    model = tiny_model_folder(tmp_path / "model")
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    return main(
        [
            "finetune",
            "--model",
            str(model),
            "--data",
            str(data),
            "--eval-data",
            str(data),
            "--steps",
            "2",
            "--batch",
            "2",
            "--seq-len",
            "48",
            "--rank",
            "4",
            "--eval-rows",
            "2",
            "--no-progress",
            "--out",
            str(tmp_path / "run"),
            *extra,
        ]
    )


def summary(tmp_path) -> dict:
    return json.loads((tmp_path / "run" / "summary.json").read_text())


def test_streamed_run_with_tiles_reports_them_and_the_offloaded_inputs(tmp_path, capsys):
    assert run(tmp_path, "--gpu-budget", "fit", "--seq-tile", "16") == 0
    st = summary(tmp_path)["stream"]
    assert st["tile_tokens"] == 16
    assert st["offloaded_layers"] == 0  # "fit": every saved input stays on the device
    assert "MLP in sequence tiles of 16 tokens" in capsys.readouterr().out


def test_resident_run_with_tiles_trains(tmp_path):
    assert run(tmp_path, "--seq-tile", "16") == 0
    assert (tmp_path / "run" / "adapter_model.safetensors").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--seq-tile", "auto"], "--seq-tile auto lets the planner"),
        (["--seq-tile", "0"], "--seq-tile must be off, auto or a number"),
        (["--gpu-budget", "fit", "--seq-tile", "big"], "--seq-tile must be off, auto or a number"),
    ],
)
def test_bad_seq_tile_is_refused_before_loading(tmp_path, capsys, flags, message):
    assert run(tmp_path, *flags) == 2
    err = capsys.readouterr().err
    assert "narrows: error:" in err and message in err
    assert not (tmp_path / "run").exists()
