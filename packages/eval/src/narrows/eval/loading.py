"""Build the model an evaluation runs: a base (HF folder or GGUF, float or NF4) plus an
optional PEFT adapter, resident on the device or streamed from host memory.

The loading itself is core's (`narrows.core.app.inference`), the path the main job's base
loading shares: narrows-eval depends on core alone, and core composes narrows-stream and
narrows-dora where they are installed."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from narrows.core.app.inference import AdapterChoice, choose_adapter, load_for_inference

__all__ = ["AdapterChoice", "EvalModel", "choose_adapter", "load_for_eval", "resolve_adapter"]


@dataclass
class EvalModel:
    model: nn.Module
    tokenizer: object
    device: torch.device
    streamed: bool
    adapter: str | None
    choice: AdapterChoice | None = None  # what `adapter` is: a run's step, or a PEFT folder
    base_differs: list[str] | None = None  # how a base given explicitly differs from the run's own


def resolve_adapter(path: str | os.PathLike) -> Path:
    """The folder holding the adapter to score: a finished `narrows finetune` run, or any
    PEFT save; anything else (an unfinished run included) is a clear error."""
    return choose_adapter(path).folder


def load_for_eval(
    pretrained: str | os.PathLike | nn.Module | None,
    *,
    tokenizer: object | None = None,
    adapter: str | os.PathLike | AdapterChoice | None = None,
    checkpoint: int | str | None = None,
    dtype: str | torch.dtype = "auto",
    quant: str | None = None,
    gpu_budget: str | int | None = None,
    host_budget: str | int | None = None,
    device: str | torch.device | None = None,
    seq_len: int = 2048,
    batch_size: int = 1,
) -> EvalModel:
    """Load `pretrained` (+ `adapter`) for forward-only evaluation: core's
    `narrows.core.app.inference.load_for_inference` (which says what each argument does),
    returned as an `EvalModel` that names the adapter scored."""
    loaded = load_for_inference(
        pretrained,
        tokenizer=tokenizer,
        adapter=adapter,
        checkpoint=checkpoint,
        dtype=dtype,
        quant=quant,
        gpu_budget=gpu_budget,
        host_budget=host_budget,
        device=device,
        seq_len=seq_len,
        batch_size=batch_size,
        caller="load_for_eval",
    )
    choice = loaded.choice
    return EvalModel(
        loaded.model,
        loaded.tokenizer,
        loaded.device,
        loaded.streamed,
        str(choice.folder) if choice else None,
        choice,
        loaded.base_differs,
    )
