"""`evaluate`: the base model and base + adapter on the same tasks, one report."""

from __future__ import annotations

import gc
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from narrows.core import NarrowsError
from narrows.core.app.finetune import run_base
from narrows.core.app.inference import check_run_base

from .loading import AdapterChoice, choose_adapter
from .report import compare, write_report

__all__ = ["TASK_DIR", "EvalPlan", "evaluate", "plan_evaluation", "resolve_tasks", "run_tasks"]

TASK_DIR = Path(__file__).parent / "tasks"  # narrows' task files (lm-eval's --include_path)


def resolve_tasks(names: list[str], include_path: list[str] | None = None):
    """(TaskManager, task names): our task files plus `include_path`; ``arc_easy`` also
    finds ``narrows_arc_easy``. Unknown names are an error that lists what exists."""
    from lm_eval.tasks import TaskManager

    paths = [str(TASK_DIR), *(include_path or [])]
    manager = TaskManager(include_path=paths, include_defaults=False)
    known = set(manager.all_tasks)
    out = []
    for name in names:
        if name in known:
            out.append(name)
        elif f"narrows_{name}" in known:
            out.append(f"narrows_{name}")
        else:
            ours = sorted(t for t in known if t.startswith("narrows_") and not t.startswith("narrows_mmlu_"))
            raise NarrowsError(
                f"no task named {name!r}; narrows ships {', '.join(ours)} (and each narrows_mmlu_"
                "<subject>); add your own task files with --include-path"
            )
    return manager, out


def run_tasks(
    lm,
    tasks: list[str],
    manager,
    *,
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    seed: int = 1234,
) -> dict:
    from lm_eval import simple_evaluate

    return simple_evaluate(
        model=lm,
        tasks=tasks,
        task_manager=manager,
        limit=limit,
        num_fewshot=num_fewshot,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
        log_samples=False,
    )


@dataclass(frozen=True)
class EvalPlan:
    """What an evaluation runs, every default filled in (from the run, where the adapter is
    one), and what to tell the user about it (`said`)."""

    choice: AdapterChoice
    model: Path
    tasks: list[str]
    out: Path
    quant: str | None
    dtype: str
    said: list[str]
    base_differs: list[str] | None = None  # how a base given with --model differs from the run's own


def plan_evaluation(
    model: str | os.PathLike | None,
    adapter: str | os.PathLike,
    tasks: list[str] | None = None,
    out: str | os.PathLike | None = None,
    *,
    checkpoint: int | str | None = None,
    quant: str | None = None,
    dtype: str | None = None,
    how: str = "--checkpoint {}",
) -> EvalPlan:
    """The settings of `evaluate`, checked before anything slow (see there)."""
    choice = choose_adapter(adapter, checkpoint, how=how)  # a wrong path or an unfinished run fails first
    run = choice.run
    base = run_base(run.config) if run is not None else None
    said = []
    explicit = model is not None
    if model is None:
        if base is None:
            raise NarrowsError(
                f"{choice.folder} is not a `narrows finetune` run (no config.json), so its base model "
                "is unknown: give --model (the HF folder or .gguf file it was trained on)"
            )
        model = base.path
        said.append(f"base: {model} ({base.origin})")
    differs = check_run_base(run, model, explicit=explicit) if run is not None else None
    if run is not None:
        quant = quant or run.config.base.quant
        dtype = dtype or run.config.base.dtype
    if not tasks:
        if run is None or run.config.base.model is not None:
            of = (
                f"the data of {choice.folder} (--data {run.config.dataset.data})"
                if run
                else "a PEFT folder's training"
            )
            raise NarrowsError(
                f"--tasks is needed: narrows has no task that matches {of}; give e.g. --tasks "
                "arc_easy,hellaswag (narrows eval --print-task-dir lists them), or your own task files "
                "with --include-path"
            )
        tasks = ["gsm8k"]
        said.append("tasks: gsm8k (the GSM8K problems the embedded default held out of its training)")
    if out is None:
        out = choice.folder / ("eval" if choice.checkpoint is None else f"eval-step-{choice.checkpoint}")
    said.append(f"scoring {choice.describe()}")
    return EvalPlan(
        choice,
        Path(model),
        list(tasks),
        Path(out),
        None if quant in (None, "none") else quant,
        dtype or "auto",
        said,
        differs or None,
    )


def evaluate(
    model: str | os.PathLike | None,
    adapter: str | os.PathLike,
    tasks: list[str] | None = None,
    out: str | os.PathLike | None = None,
    *,
    checkpoint: int | str | None = None,
    gpu_budget: str | None = None,
    host_budget: str | None = None,
    quant: str | None = None,
    dtype: str | None = None,
    device: str | None = None,
    batch_size: int = 8,
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    include_path: list[str] | None = None,
    how: str = "--checkpoint {}",
) -> dict:
    """Evaluate `model` alone and with `adapter` on `tasks`; write the report into `out`.
    Returns the report's paths and both lm-eval result dicts.

    `adapter` may be a `narrows finetune` run folder: it is scored at its final adapter (an
    unfinished run is refused, unless `checkpoint` — a step or "latest" — picks a checkpoint),
    and what is not given comes from the run: the base (`model` None), its quantisation and
    dtype, the tasks (the embedded default's GSM8K held-out problems) and `out` (RUN/eval, or
    RUN/eval-step-N for a checkpoint). The step scored is printed and recorded in the report."""
    from .lm import NarrowsLM

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    plan = plan_evaluation(
        model, adapter, tasks, out, checkpoint=checkpoint, quant=quant, dtype=dtype, how=how
    )
    choice, model, quant, dtype = plan.choice, plan.model, plan.quant, plan.dtype
    for line in plan.said:
        print(f"narrows: {line}", file=sys.stderr, flush=True)
    manager, names = resolve_tasks(plan.tasks, include_path)
    results, runs = {}, {}
    for which, adp in (("base", None), ("adapted", str(choice.folder))):
        start = time.perf_counter()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        lm = NarrowsLM(
            pretrained=str(model),
            adapter=choice if adp else None,
            gpu_budget=gpu_budget,
            host_budget=host_budget,
            quant=quant,
            dtype=dtype,
            device=device,
            batch_size=batch_size,
        )
        results[which] = run_tasks(lm, names, manager, limit=limit, num_fewshot=num_fewshot)
        runs[which] = {
            "seconds": round(time.perf_counter() - start, 1),
            "peak_gpu_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
        }
        del lm
        gc.collect()
    rows = compare(results["base"], results["adapted"])
    meta = {
        "model": str(model),
        "adapter": str(choice.folder),
        "adapter_step": choice.step,
        "checkpoint": choice.checkpoint,
        "scored": choice.describe(),
        "tasks": names,
        "limit": limit,
        "gpu_budget": gpu_budget,
        "quant": quant,
        "dtype": dtype,
        "runs": runs,
        "base_differs": plan.base_differs,
    }
    step = f" (step {choice.step})" if choice.step is not None else ""
    title = f"{Path(model).name}: base vs {choice.folder.name}{step}"
    return {
        "paths": write_report(rows, plan.out, title=title, meta=meta),
        "rows": rows,
        "results": results,
        "choice": choice,
    }
