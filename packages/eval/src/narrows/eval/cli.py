"""``narrows eval``: contributed to the `narrows` command through the ``narrows.cli`` entry point."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["register"]


def _run(args: argparse.Namespace) -> int:
    from narrows.core import NarrowsError

    from .run import TASK_DIR, evaluate

    if args.print_task_dir:
        print(TASK_DIR)
        return 0
    adapter = args.run or args.adapter
    if args.run and args.adapter and Path(args.run) != Path(args.adapter):
        raise NarrowsError(f"two adapters given: RUN {args.run} and --adapter {args.adapter}; give one")
    if not adapter:
        raise NarrowsError(
            "narrows eval needs a run folder (narrows eval runs/NAME) or --model and --adapter, "
            "or --print-task-dir"
        )
    report = evaluate(
        args.model,
        adapter,
        [t for t in (args.tasks or "").split(",") if t],
        args.out,
        checkpoint=args.checkpoint,
        gpu_budget=args.gpu_budget,
        host_budget=args.host_budget,
        quant=args.quant,
        dtype=args.dtype,
        device=args.device,
        batch_size=args.batch_size,
        limit=args.limit,
        num_fewshot=args.num_fewshot,
        include_path=args.include_path,
    )
    print(report["paths"]["markdown"].read_text())
    print(f"scored: {report['choice'].describe()}")
    print("report: " + ", ".join(str(p) for p in report["paths"].values()))
    return 0


def _limit(text: str) -> int | float:
    value = float(text)
    return int(value) if value >= 1 else value


def register(sub) -> None:
    p = sub.add_parser(
        "eval",
        help="evaluate base and base+adapter with lm-evaluation-harness, one report",
        description="Evaluate a base model and the same model with a PEFT adapter on lm-eval tasks "
        "(local files only) and write report.json / report.md / report.png. `narrows eval runs/NAME` "
        "scores a fine-tune run on the base it trained on; an unfinished run is refused unless "
        "--checkpoint picks one of its checkpoints.",
    )
    p.add_argument(
        "run",
        nargs="?",
        metavar="RUN",
        help="a `narrows finetune` run folder: its final adapter on the base it trained on",
    )
    p.add_argument("--model", help="HF model folder or .gguf file (default: the run's base)")
    p.add_argument("--adapter", help="PEFT adapter folder, or a run folder (as RUN)")
    p.add_argument(
        "--checkpoint",
        metavar="N|latest",
        help="score the run's checkpoint of step N (or the newest) instead of its final adapter",
    )
    p.add_argument(
        "--tasks",
        help="comma-separated: arc_easy, piqa, hellaswag, mmlu, lambada, gsm8k, or your own "
        "(default for a run of the embedded default: gsm8k, the problems it held out)",
    )
    p.add_argument("--gpu-budget", help="stream the base within this much GPU memory (8GiB, fit, min)")
    p.add_argument(
        "--host-budget", help="host RAM the streamed base may hold (e.g. 24GiB); the rest is read from disk"
    )
    p.add_argument(
        "--quant",
        choices=["nf4", "none"],
        help="quantise the base's decoder linears to NF4 (default: as the run trained, else none)",
    )
    p.add_argument(
        "--dtype",
        help="auto (bf16 on CUDA, fp32 on CPU), bfloat16, float16, float32 (default: the run's, else auto)",
    )
    p.add_argument("--device", help="cuda or cpu (default: cuda when present)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--limit", type=_limit, help="documents per task (a fraction below 1)")
    p.add_argument("--num-fewshot", type=int)
    p.add_argument("--include-path", action="append", help="more task folders (repeatable)")
    p.add_argument("--out", help="report folder (default: RUN/eval, RUN/eval-step-N for a checkpoint)")
    p.add_argument(
        "--print-task-dir", action="store_true", help="print the folder of narrows' task files and exit"
    )
    p.set_defaults(func=_run)
