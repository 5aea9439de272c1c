"""`evaluate`: the base model and base + adapter on the same tasks, one report."""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path

import torch

from narrows.core import NarrowsError

from .loading import resolve_adapter
from .report import compare, write_report

__all__ = ["TASK_DIR", "evaluate", "resolve_tasks", "run_tasks"]

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
            raise NarrowsError(f"no task named {name!r}; narrows ships {', '.join(ours)} (and each narrows_mmlu_"
                               "<subject>); add your own task files with --include-path")  # fmt: skip
    return manager, out


def run_tasks(lm, tasks: list[str], manager, *, limit: int | float | None = None, num_fewshot: int | None = None,
              seed: int = 1234) -> dict:  # fmt: skip
    from lm_eval import simple_evaluate

    return simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit, num_fewshot=num_fewshot,
                           random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                           fewshot_random_seed=seed, log_samples=False)  # fmt: skip


def evaluate(
    model: str | os.PathLike,
    adapter: str | os.PathLike,
    tasks: list[str],
    out: str | os.PathLike,
    *,
    gpu_budget: str | None = None,
    host_budget: str | None = None,
    quant: str | None = None,
    dtype: str = "auto",
    device: str | None = None,
    batch_size: int = 8,
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    include_path: list[str] | None = None,
) -> dict:
    """Evaluate `model` alone and with `adapter` on `tasks`; write the report into `out`.
    Returns the report's paths and both lm-eval result dicts."""
    from .lm import NarrowsLM

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    adapter_dir = resolve_adapter(adapter)  # a wrong path fails before the first (slow) run
    manager, names = resolve_tasks(tasks, include_path)
    results, runs = {}, {}
    for which, adp in (("base", None), ("adapted", str(adapter_dir))):
        start = time.perf_counter()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        lm = NarrowsLM(pretrained=str(model), adapter=adp, gpu_budget=gpu_budget, host_budget=host_budget,
                       quant=quant, dtype=dtype,
                       device=device, batch_size=batch_size)  # fmt: skip
        results[which] = run_tasks(lm, names, manager, limit=limit, num_fewshot=num_fewshot)
        runs[which] = {"seconds": round(time.perf_counter() - start, 1),
                       "peak_gpu_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None}  # fmt: skip
        del lm
        gc.collect()
    rows = compare(results["base"], results["adapted"])
    meta = {"model": str(model), "adapter": str(adapter_dir), "tasks": names, "limit": limit,
            "gpu_budget": gpu_budget, "quant": quant, "runs": runs}  # fmt: skip
    title = f"{Path(model).name}: base vs {adapter_dir.name}"
    return {"paths": write_report(rows, out, title=title, meta=meta), "rows": rows, "results": results}
