import json

import pytest


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    from narrows.core.testing import tiny_model_folder

    return tiny_model_folder(tmp_path_factory.mktemp("model"), max_position_embeddings=2048)


@pytest.fixture(scope="session")
def tiny_adapters(tiny_folder, tmp_path_factory):
    """A LoRA and a DoRA adapter of the tiny model, saved by PEFT (lora_B randomised)."""
    from transformers import AutoModelForCausalLM

    from narrows.core.testing import with_adapter

    out = {}
    for kind in ("lora", "dora"):
        model = with_adapter(AutoModelForCausalLM.from_pretrained(tiny_folder), kind)
        out[kind] = tmp_path_factory.mktemp(kind)
        model.save_pretrained(out[kind])
    return out


@pytest.fixture(scope="session")
def tiny_tasks(tmp_path_factory):
    """A local task folder: multiple choice, rolling loglikelihood and generation on 6 rows."""
    folder = tmp_path_factory.mktemp("tasks")
    rows = [
        {
            "question": f"What is {a} plus {b}?",
            "choices": [str(a + b), str(a + b + 1)],
            "label": 0,
            "text": f"The sum of {a} and {b} is {a + b}.",
        }
        for a, b in [(1, 2), (3, 4), (5, 6), (2, 2), (7, 1), (4, 4)]
    ]
    (folder / "tiny.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'tiny.jsonl'}\ntest_split: test\n"
    (folder / "tiny_mc.yaml").write_text(
        "task: tiny_mc\n" + common + "output_type: multiple_choice\ndoc_to_text: '{{question}} Answer:'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n"
    )
    (folder / "tiny_ppl.yaml").write_text(
        "task: tiny_ppl\n"
        + common
        + "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n"
    )
    (folder / "tiny_gen.yaml").write_text(
        "task: tiny_gen\n" + common + "output_type: generate_until\ndoc_to_text: '{{question}} Answer:'\n"
        "doc_to_target: '{{choices[0]}}'\ngeneration_kwargs:\n  until: ['.']\n  max_gen_toks: 4\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    return folder
