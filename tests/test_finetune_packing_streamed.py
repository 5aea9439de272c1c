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
    return load_file(folder / "adapter_model.safetensors"), [r["loss"] for r in rows if "loss" in r]


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


def test_evaluations_between_graphed_steps_release_the_graphs_and_change_nothing(tmp_path, monkeypatch):
    """A packed job that evaluates every step runs each evaluation with the CUDA graphs
    released (emulated on the CPU: every graph dropped, captured again at the next step),
    as its plan counts on (no room for a layer run eagerly beside their pool); the adapter,
    the losses and the held-out losses equal the resident run's."""
    held_out = write_jsonl(tmp_path / "eval.jsonl", ROWS[:6])
    every = ("--eval-data", str(held_out), "--eval-rows", "6", "--eval-every", "1")
    assert run(tmp_path, "resident", *every) == 0
    from narrows.stream.execution.graphs import LayerGraphs

    released, release = [], LayerGraphs.released

    def counted(self):
        released.append(len(self._graphs))  # the graphs held as the evaluation starts
        return release(self)

    monkeypatch.setattr(LayerGraphs, "released", counted)
    assert run(tmp_path, "graphed", "--gpu-budget", BUDGET, "--cuda-graphs", *every) == 0
    (wa, la), (wb, lb) = result(tmp_path, "resident"), result(tmp_path, "graphed")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert la == lb
    evals = [
        [
            r["eval_loss"]
            for r in map(json.loads, (tmp_path / n / "metrics.jsonl").read_text().splitlines())
            if "eval_loss" in r
        ]
        for n in ("resident", "graphed")
    ]
    assert len(evals[0]) >= 3 and evals[0] == evals[1]
    # every evaluation ran with the graphs released, and the steps between captured them again
    assert len(released) == len(evals[1]) and max(released) > 0
    summary = json.loads((tmp_path / "graphed" / "summary.json").read_text())
    assert summary["stream"]["cuda_graphs"] is True
