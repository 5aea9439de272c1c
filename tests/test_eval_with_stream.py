"""narrows-eval with narrows-stream: a streamed base scores every request exactly as the
resident one (per-request loglikelihoods, `torch.equal`), with and without adapters."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from narrows.core.testing import tiny_model_folder, with_adapter


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("model"), max_position_embeddings=2048)


def requests():
    from lm_eval.api.instance import Instance

    ll = [
        Instance("loglikelihood", {}, ("The sum of 2 and 3 is", " 5."), 0),
        Instance("loglikelihood", {}, ("Hello", " world, how are you today?"), 1),
    ]
    rolling = [Instance("loglikelihood_rolling", {}, ("A longer text to score token by token. " * 3,), 0)]
    return ll, rolling


def scores(lm) -> torch.Tensor:
    ll, rolling = requests()
    got = [x[0] for x in lm.loglikelihood(ll, disable_tqdm=True)] + lm.loglikelihood_rolling(
        rolling, disable_tqdm=True
    )
    return torch.tensor(got, dtype=torch.float64)


@pytest.mark.parametrize("kind", [None, "lora", "dora"])
def test_streamed_evaluation_equals_resident_per_request(folder, tmp_path, kind):
    from narrows.eval import NarrowsLM

    adapter = None
    if kind:
        adapter = str(tmp_path / kind)
        with_adapter(AutoModelForCausalLM.from_pretrained(folder), kind).save_pretrained(adapter)
    resident = scores(NarrowsLM(pretrained=str(folder), adapter=adapter, device="cpu"))
    lm = NarrowsLM(pretrained=str(folder), adapter=adapter, device="cpu", gpu_budget="min")
    handle = lm.narrows.model.narrows_stream
    assert lm.narrows.streamed and handle.plan.resident == ()
    # the resident path runs the layers' own modules, so the streamed one does too: the fast
    # layers sum the adapter and the base in another order (bits differ on some CPUs)
    assert handle.config.kernels == "peft"
    assert torch.equal(scores(lm), resident)
