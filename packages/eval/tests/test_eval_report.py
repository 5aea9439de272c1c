"""`narrows eval` end to end on a tiny model and tiny local tasks, and the report's 2-SE flag."""

import json

from narrows.core.app.cli import main
from narrows.eval import Row


def test_two_standard_error_flag():
    assert Row("t", "acc", 0.50, 0.01, 0.60, 0.01, True).significant  # 0.10 > 2·0.0141
    assert not Row("t", "acc", 0.50, 0.05, 0.60, 0.05, True).significant  # 0.10 < 2·0.0707
    assert not Row("t", "acc", 0.50, None, 0.90, 0.01, True).significant  # unknown stderr: never flagged


def test_narrows_eval_writes_the_report(tiny_folder, tiny_adapters, tiny_tasks, tmp_path, capsys):
    out = tmp_path / "report"
    rc = main(
        [
            "eval",
            "--model",
            str(tiny_folder),
            "--adapter",
            str(tiny_adapters["dora"]),
            "--tasks",
            "tiny_mc,tiny_ppl,tiny_gen",
            "--include-path",
            str(tiny_tasks),
            "--device",
            "cpu",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    metrics = {(r["task"], r["metric"]) for r in report["rows"]}
    assert {("tiny_mc", "acc"), ("tiny_ppl", "word_perplexity"), ("tiny_gen", "exact_match")} <= metrics
    for r in report["rows"]:
        assert abs(r["difference"] - (r["adapted"] - r["base"])) < 1e-12
    assert "| tiny_mc | acc ↑ |" in (out / "report.md").read_text()
    assert (out / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert "report:" in capsys.readouterr().out


def test_narrows_eval_refuses_a_missing_adapter_before_loading(tiny_folder, tmp_path, capsys):
    rc = main(
        ["eval", "--model", str(tiny_folder), "--adapter", str(tmp_path / "missing"), "--tasks", "arc_easy"]
    )
    assert rc == 2 and "does not exist" in capsys.readouterr().err


def test_narrows_eval_on_an_unfinished_run_says_how_to_finish_it(tiny_folder, tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints" / "step-000004").mkdir(parents=True)
    (run / "checkpoints" / "step-000002").mkdir()
    (run / "config.json").write_text("{}")
    rc = main(["eval", "--model", str(tiny_folder), "--adapter", str(run), "--tasks", "arc_easy"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("narrows: error:"), err
    assert "no final adapter yet, newest checkpoint step 4 of 40" in err  # a run of the default 40 steps
    assert f"narrows finetune --resume {run}" in err and "--checkpoint 4" in err
