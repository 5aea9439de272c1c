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
    if not (args.model and args.adapter and args.tasks):
        raise NarrowsError("narrows eval needs --model, --adapter and --tasks (or --print-task-dir)")

    out = args.out or str(Path(args.adapter) / "eval")
    report = evaluate(args.model, args.adapter, [t for t in args.tasks.split(",") if t], out,
                      gpu_budget=args.gpu_budget, host_budget=args.host_budget, quant=args.quant, dtype=args.dtype, device=args.device,
                      batch_size=args.batch_size, limit=args.limit, num_fewshot=args.num_fewshot,
                      include_path=args.include_path)  # fmt: skip
    print(report["paths"]["markdown"].read_text())
    print("report: " + ", ".join(str(p) for p in report["paths"].values()))
    return 0


def _limit(text: str) -> int | float:
    value = float(text)
    return int(value) if value >= 1 else value


def register(sub) -> None:
    p = sub.add_parser("eval", help="evaluate base and base+adapter with lm-evaluation-harness, one report",
                       description="Evaluate a base model and the same model with a PEFT adapter on lm-eval tasks "
                       "(local files only) and write report.json / report.md / report.png.")  # fmt: skip
    p.add_argument("--model", help="HF model folder or .gguf file")
    p.add_argument("--adapter", help="PEFT adapter folder (e.g. a `narrows finetune` run folder)")
    p.add_argument(
        "--tasks", help="comma-separated: arc_easy, piqa, hellaswag, mmlu, lambada, gsm8k, or your own"
    )
    p.add_argument("--gpu-budget", help="stream the base within this much GPU memory (8GiB, fit, min)")
    p.add_argument(
        "--host-budget", help="host RAM the streamed base may hold (e.g. 24GiB); the rest is read from disk"
    )
    p.add_argument("--quant", choices=["nf4"], help="quantise the base's decoder linears to NF4")
    p.add_argument(
        "--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), bfloat16, float16, float32"
    )
    p.add_argument("--device", help="cuda or cpu (default: cuda when present)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--limit", type=_limit, help="documents per task (a fraction below 1)")
    p.add_argument("--num-fewshot", type=int)
    p.add_argument("--include-path", action="append", help="more task folders (repeatable)")
    p.add_argument("--out", help="report folder (default: ADAPTER/eval)")
    p.add_argument(
        "--print-task-dir", action="store_true", help="print the folder of narrows' task files and exit"
    )
    p.set_defaults(func=_run)
