"""The `narrows` command. Subcommands come from core (``doctor``) and from installed
narrows packages, which contribute them through the ``narrows.cli`` entry-point group:
each entry point names a function ``register(subparsers)`` that adds its parser and sets
``func`` on it. A missing package therefore means a missing subcommand, never a crash."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from pathlib import Path

from .errors import NarrowsError

__all__ = ["build_parser", "main"]


def _doctor(args: argparse.Namespace) -> int:
    from .doctor import collect, render

    report = collect()
    print(json.dumps(report.as_dict(), indent=2) if args.json else render(report))
    core_ok = all(v is not None for v in report.dependencies.values())
    return 0 if core_ok else 1


def _finetune(args: argparse.Namespace) -> int:
    import dataclasses

    from .finetune import FinetuneConfig, finetune, format_summary

    if args.resume:
        path = Path(args.resume) / "config.json"
        if not path.is_file():
            raise NarrowsError(f"--resume {args.resume}: no run there (no config.json); start one with --out")
        cfg = FinetuneConfig(**json.loads(path.read_text()))
        cfg.out = args.resume
    else:
        names = {f.name for f in dataclasses.fields(FinetuneConfig)}
        cfg = FinetuneConfig(**{k: v for k, v in vars(args).items() if k in names and v is not None})
    summary = finetune(cfg, resume=bool(args.resume), progress=not args.no_progress)
    print(format_summary(summary))
    plot = "loss.png" if summary.get("loss_png") else "(no loss.png: pip install 'narrows-core[plot]')"
    print(f"adapter (PEFT format), metrics.jsonl, summary.json, {plot} in {cfg.out}")
    return 0


def _add_finetune(sub) -> None:
    p = sub.add_parser(
        "finetune",
        help="fine-tune a LoRA/DoRA adapter (no arguments: SmolLM2-135M-Instruct on GSM8K, runs on a laptop CPU)",
        description="Fine-tune a LoRA or DoRA adapter with the narrows packages that are installed. With no "
        "arguments: SmolLM2-135M-Instruct on GSM8K worked answers (both bundled through narrows-core[default]).",
    )
    a = p.add_argument
    a("--model", help="local HF model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    a("--data", help="training JSONL: messages, prompt/response or text rows")
    a("--eval-data", help="held-out JSONL for the eval loss")
    a("--adapter", choices=["lora", "dora"], help="lora (default) or dora (needs narrows-dora)")
    a("--rank", type=int, help="adapter rank (default 16)")
    a("--alpha", type=float, help="LoRA alpha (default 2 x rank)")
    a("--dropout", type=float, help="adapter dropout (default 0)")
    a("--targets", help="all-linear (default) or module names, e.g. q_proj,v_proj")
    a("--quant", choices=["none", "nf4"], help="nf4: QLoRA/QDoRA base (needs narrows-core[nf4])")
    a("--gpu-budget", help="off (default), fit, or a size like 12GiB: stream the base (needs narrows-stream)")
    a("--host-budget", help="host RAM the streamed base may hold, e.g. 24GiB (default: 85%% of available); "
      "layers beyond it are read from disk (the prepared cache)")  # fmt: skip
    a("--cache", help="folder of the prepared-slab cache of a streamed base (default: $NARROWS_CACHE/slabs; "
      "off: none, everything must fit --host-budget)")  # fmt: skip
    a(
        "--lmhead",
        help="auto (default: mask,chunked when narrows-lmhead is installed), off, or e.g. "
        "mask,chunked,topk=1000 (needs narrows-lmhead)",
    )
    a("--steps", type=int, help="optimizer steps (default 40)")
    a("--batch", type=int, help="sequences per micro-batch (default 4)")
    a("--grad-accum", type=int, help="micro-batches per step (default 1)")
    a("--seq-len", type=int, help="tokens per sequence, longer rows are truncated (default 512)")
    a("--lr", type=float, help="peak learning rate (default 5e-4), cosine decay after warmup")
    a("--warmup", type=int, help="warmup steps (default 5%% of --steps)")
    a("--seed", type=int, help="seed for the adapter init, data order and dropout (default 0)")
    a("--save-every", type=int, help="checkpoint every N steps (default 10)")
    a("--eval-rows", type=int, help="held-out rows for the eval loss (default 32)")
    a("--exact-match", type=int, help="held-out GSM8K problems generated and scored (default 8; 0: off)")
    a("--deterministic", action="store_true", default=None,
      help="deterministic kernels (torch.use_deterministic_algorithms, cuBLAS workspace): on CUDA the "
      "condition for streamed == resident bit for bit; the CPU is deterministic anyway")  # fmt: skip
    a("--dtype", choices=["auto", "float32", "bfloat16", "float16"], help="auto: bf16 on CUDA, fp32 on CPU")
    a("--out", help="run folder (default runs/default)")
    a(
        "--resume",
        metavar="RUN",
        help="continue the run in this folder exactly where its last checkpoint left it",
    )
    a("--no-progress", action="store_true", help="one line per step instead of a progress bar")
    p.set_defaults(func=_finetune)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="narrows", description="Fine-tune large language models through a narrow GPU."
    )
    parser.add_argument("--version", action="version", version=f"narrows-core {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    doctor = sub.add_parser("doctor", help="versions, devices and usable backends (attach to bug reports)")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.set_defaults(func=_doctor)
    _add_finetune(sub)
    for ep in entry_points(group="narrows.cli"):
        ep.load()(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except NarrowsError as e:  # bad input or an interrupted run: say what is wrong, no traceback
        print(f"narrows: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
