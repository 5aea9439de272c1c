"""A base plus an adapter loaded for inference (`narrows.core.app.inference`), with core alone
installed: PEFT's numbers, frozen, and a GPU budget without narrows-stream refused with the
install line before any weight is read."""

from __future__ import annotations

import pytest
import torch

import narrows.core.optional as optional
from narrows.core import MissingDependencyError, NarrowsError
from narrows.core.app.inference import load_base, load_for_inference
from narrows.core.testing import tiny_batch, tiny_model_folder, with_adapter


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def lora(folder, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("lora")
    with_adapter(AutoModelForCausalLM.from_pretrained(folder), "lora").save_pretrained(out)
    return out


def test_a_peft_adapter_loads_frozen_with_peft_s_numbers(folder, lora):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    loaded = load_for_inference(folder, adapter=lora, device="cpu")
    assert not loaded.streamed and loaded.choice.folder == lora and loaded.device.type == "cpu"
    assert not loaded.model.training and not any(p.requires_grad for p in loaded.model.parameters())
    ids = tiny_batch()["input_ids"]
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), str(lora)).eval()
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, peft(ids).logits)


def test_the_base_loads_as_the_main_job_loads_it(folder):
    model, tokenizer = load_base(folder, dtype=torch.float32, quant=None, device=torch.device("cpu"))
    assert tokenizer is not None and next(model.parameters()).dtype == torch.float32


def test_a_gpu_budget_without_narrows_stream_says_what_to_install(folder, monkeypatch):
    real = optional.is_available
    monkeypatch.setattr(optional, "is_available", lambda m: m != "narrows.stream" and real(m))
    with pytest.raises(MissingDependencyError, match=r"narrows-stream.*pip install narrows-stream"):
        load_for_inference(folder, gpu_budget="min", device="cpu")
    with pytest.raises(MissingDependencyError, match=r"pip install narrows-stream"):
        load_base(folder, dtype=torch.float32, quant=None, device=torch.device("cpu"), streamed=True)


def test_bad_options_are_refused_before_loading(tmp_path):
    missing = tmp_path / "no-model"  # never read: each refusal comes first
    with pytest.raises(NarrowsError, match="quant must be"):
        load_for_inference(missing, quant="int3", device="cpu")
    with pytest.raises(NarrowsError, match="give gpu_budget too"):
        load_for_inference(missing, host_budget="1GiB", device="cpu")
    with pytest.raises(NarrowsError, match="give the run as the adapter too"):
        load_for_inference(missing, checkpoint=2, device="cpu")
    with pytest.raises(NarrowsError, match="no base model given"):
        load_for_inference(None, device="cpu")
    with pytest.raises(NarrowsError, match=r"load_for_inference\(model, tokenizer="):
        load_for_inference(torch.nn.Linear(2, 2), device="cpu")
