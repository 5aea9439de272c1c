"""`narrows finetune` on an architecture narrows does not announce: it checks the shrunk
twin (head hook, streamed vs resident, lmhead loss) and trains, or refuses with what differed."""

import pytest
import torch
import transformers as tf

import narrows.core.protocol.anatomy as anatomy_module
from narrows.core.app.cli import main
from narrows.core.protocol.verify import _PASSED
from narrows.core.testing import tiny_tokenizer, write_jsonl

ROWS = [{"prompt": f"{a}+{b}=", "response": f"{a + b}"} for a in range(4) for b in range(4)]


@pytest.fixture(autouse=True)
def forget_verified():
    yield
    anatomy_module._VERIFIED.clear()
    _PASSED.clear()


def folder(path, config):
    tok = tiny_tokenizer()
    config.vocab_size, config.pad_token_id, config.eos_token_id = 320, tok.pad_token_id, tok.eos_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        tf.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def run(tmp_path, model, *extra):
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    return main(
        [
            "finetune",
            "--model",
            model,
            "--data",
            str(data),
            "--eval-data",
            str(data),
            "--steps",
            "2",
            "--batch",
            "2",
            "--seq-len",
            "32",
            "--rank",
            "4",
            "--dropout",
            "0.1",
            "--eval-rows",
            "4",
            "--no-progress",
            "--out",
            str(tmp_path / "run"),
            *extra,
        ]
    )


def small(cls, **kw):
    return cls(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, **kw)


def test_an_unannounced_architecture_trains_after_its_twin_passes(tmp_path, caplog):
    model = folder(tmp_path / "olmo", small(tf.OlmoConfig))
    assert run(tmp_path, model, "--gpu-budget", "fit") == 0
    assert "model_type='olmo' is not announced" in caplog.text
    assert "passed head, stream on its twin" in caplog.text and "passed head, lmhead" in caplog.text
    assert (tmp_path / "run" / "adapter_model.safetensors").exists()


def test_an_unannounced_architecture_whose_twin_differs_is_refused(tmp_path, capsys, monkeypatch):
    """GraniteMoE divides its logits; with that arithmetic unknown, the head check refuses."""
    monkeypatch.setattr(anatomy_module, "KNOWN_LOGIT_OPS", ())
    model = folder(
        tmp_path / "granitemoe", small(tf.GraniteMoeConfig, num_local_experts=4, logits_scaling=8.0)
    )
    assert run(tmp_path, model) == 2
    err = capsys.readouterr().err
    assert "narrows: error:" in err and "'head' check" in err and "granitemoe" in err
    assert not (tmp_path / "run").exists()  # refused before anything was written
