"""`narrows finetune --packing` over a streamed base: each packed sequence holds several
examples (positions restarted, attention kept inside each), and the streamed run, plain or
block-major with CUDA graphs (emulated on the CPU), is `torch.equal` to the resident one:
adapter and every logged loss, with dropout and the LM-head savings on."""

import json

import torch
from safetensors.torch import load_file

from narrows.core.app.cli import main
from narrows.core.testing import tiny_model_folder, write_jsonl

ROWS = [{"prompt": f"q{i}: " + "x" * (3 + 5 * (i % 4)), "completion": " a" * (2 + i % 5)} for i in range(24)]
BUDGET = "1300KiB"  # every layer of the tiny model streamed (seq 48: the minimum is 1.09 MiB, dropout's masks priced)


def run(tmp_path, name, *extra):
    model = tiny_model_folder(tmp_path / "model")
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    return main(
        [
            "finetune",
            "--model",
            str(model),
            "--data",
            str(data),
            "--packing",
            "--steps",
            "3",
            "--batch",
            "2",
            "--seq-len",
            "48",
            "--rank",
            "4",
            "--eval-rows",
            "0",
            "--grad-accum",
            "2",
            "--dropout",
            "0.1",
            "--no-progress",
            "--out",
            str(tmp_path / name),
            *extra,
        ]
    )


def result(tmp_path, name):
    folder = tmp_path / name
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return load_file(folder / "adapter_model.safetensors"), [r["loss"] for r in rows]


def test_packed_streamed_training_equals_packed_resident(tmp_path, capsys):
    assert run(tmp_path, "resident") == 0
    err = capsys.readouterr().err
    assert "format prompt/completion" in err and "packing: 24 examples in" in err
    assert run(tmp_path, "streamed", "--gpu-budget", BUDGET) == 0
    assert run(tmp_path, "step", "--gpu-budget", BUDGET, "--step-mode", "--cuda-graphs") == 0
    (wa, la) = result(tmp_path, "resident")
    for name in ("streamed", "step"):
        wb, lb = result(tmp_path, name)
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), name
        assert la == lb, name
    summary = json.loads((tmp_path / "streamed" / "summary.json").read_text())
    assert summary["stream"]["resident_layers"] == 0
