"""``narrows finetune``: its flags, and the dispatch to a new run or a resumed one."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from ...errors import NarrowsError
from .config import RESUMABLE, FinetuneConfig
from .configfile import read_config_file
from .ranks import Ranks
from .resuming import plan_resume
from .run_folder import RunFolder

__all__ = ["add_parser"]


def _run(args: argparse.Namespace) -> int:
    names = {f.name for f in dataclasses.fields(FinetuneConfig)}
    given = {k: v for k, v in vars(args).items() if k in names and v is not None}
    if args.config is not None:
        if args.resume:
            raise NarrowsError(
                f"--config {args.config} starts a new run; --resume {args.resume} continues one with "
                "its own config.json: give one of them"
            )
        given = {**read_config_file(args.config), **given}  # a flag on the command line wins over the file
    # every setting checked before torch is imported (seconds): a bad value is refused at once
    world = Ranks.from_env().world
    if args.resume:
        if (
            args.out is not None
            and Path(args.out).expanduser().resolve() != Path(args.resume).expanduser().resolve()
        ):
            raise NarrowsError(
                f"--resume {args.resume} continues that folder; --out {args.out} names another: drop --out"
            )
        run = RunFolder(args.resume)
        if run.config.is_file():  # (no run there: claiming it says so)
            plan_resume(
                run.root,
                run.read_file(),
                given,
                world,
                args.override,
                newest=run.newest_step(),
                logged=run.logged_step(),
                summarized=(run.root / "summary.json").is_file(),
            )
    else:
        if args.override:
            raise NarrowsError("--override applies to --resume only")
        dataclasses.replace(FinetuneConfig(**given), world_size=world).checked()

    from .job import finetune, resume
    from .report import format_summary

    if args.resume:
        summary = resume(args.resume, given, override=args.override, progress=not args.no_progress)
        out = args.resume
    else:
        summary = finetune(FinetuneConfig(**given), progress=not args.no_progress)
        out = given.get("out", FinetuneConfig.out)
    if summary is None:  # a rank other than 0: rank 0 reports
        return 0
    print(format_summary(summary))
    plot = "loss.png" if summary.get("loss_png") else "(no loss.png: pip install 'narrows-core[plot]')"
    print(f"adapter (PEFT format), metrics.jsonl, summary.json, {plot} in {out}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "finetune",
        help="fine-tune a LoRA/DoRA adapter (no arguments: SmolLM2-135M-Instruct on GSM8K, runs on a laptop CPU)",
        description="Fine-tune a LoRA or DoRA adapter with the narrows packages that are installed. With no "
        "arguments: SmolLM2-135M-Instruct on GSM8K worked answers (both bundled through narrows-core[default]).",
    )
    a = p.add_argument
    a(
        "--config",
        metavar="FILE",
        help="settings from a JSON file (field names as config.json writes them, e.g. "
        '{"model": "...", "steps": 200}; a run folder\'s own config.json works); flags given too win over it',
    )
    a("--model", help="local HF model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    a(
        "--data",
        help="training data, a local file (.jsonl, .parquet, .arrow, .csv, .json) or a save_to_disk folder: "
        "messages, ShareGPT conversations, prompt/response or prompt/completion, Alpaca or text rows",
    )
    a("--eval-data", help="held-out data for the eval loss, as --data")
    a("--data-split", help="the split of a save_to_disk folder that holds several, e.g. train")
    a("--eval-split", help="the split of --eval-data, e.g. test")
    a(
        "--columns",
        help="rename your columns to the fields narrows reads, e.g. prompt=question,response=answer",
    )
    a(
        "--packing",
        action="store_true",
        default=None,
        help="pack several examples into each --seq-len sequence (no padding); positions restart and attention "
        "stays inside each example",
    )
    a("--adapter", choices=["lora", "dora"], help="lora (default) or dora (needs narrows-dora)")
    a("--rank", type=int, help="adapter rank (default 16)")
    a("--alpha", type=float, help="LoRA alpha (default 2 x rank)")
    a("--dropout", type=float, help="adapter dropout (default 0)")
    a("--targets", help="all-linear (default) or module names, e.g. q_proj,v_proj")
    a("--quant", choices=["none", "nf4"], help="nf4: QLoRA/QDoRA base (needs narrows-core[nf4])")
    a(
        "--gpu-budget",
        help="off (default), fit (what the GPU has free), min (the smallest footprint) or a size like "
        "12GiB: stream the base (needs narrows-stream)",
    )
    a(
        "--host-budget",
        help="host RAM the streamed base may hold, e.g. 24GiB (default: 85%% of available); "
        "layers beyond it are read from disk (the prepared cache)",
    )
    a(
        "--cache",
        help="folder of the prepared-slab cache of a streamed base (default: $NARROWS_CACHE/slabs; "
        "off: none, everything must fit --host-budget)",
    )
    a(
        "--lmhead",
        help="auto (default: mask,chunked when narrows-lmhead is installed), off, or e.g. "
        "mask,chunked,topk=1000 (needs narrows-lmhead)",
    )
    a("--steps", type=int, help="optimizer steps (default 40); with --resume: where the run now ends")
    a("--batch", type=int, help="sequences per micro-batch (default 4)")
    a("--grad-accum", type=int, help="micro-batches per step (default 1)")
    a("--seq-len", type=int, help="tokens per sequence, longer rows are truncated (default 512)")
    a(
        "--seq-tile",
        help="off (default), auto (the planner tiles the MLP over the sequence only when --gpu-budget "
        "needs it) or tokens per tile, e.g. 2048; equal to untiled training up to summation order (needs narrows-stream)",
    )
    a(
        "--step-mode",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --gpu-budget and --grad-accum N: each streamed layer loaded once for the forward of all N "
        "micro-batches and once for their backward (narrows.stream.StepTrainer); the same numbers as sequential "
        "accumulation. Not given: used where narrows-stream predicts it faster (the run says which and why)",
    )
    a(
        "--offload-optimizer",
        action="store_true",
        default=None,
        help="in step mode (implies it): the optimizer state waits in host memory, each layer updated on the GPU "
        "when its gradients are complete; the same numbers",
    )
    a(
        "--offload-adapters",
        action="store_true",
        default=None,
        help="with --offload-optimizer (implies it): the adapters wait in host memory too, each layer's on the GPU "
        "only for its forward and its backward and update (one device slot, so CUDA graphs still replay); the same "
        "numbers, less GPU memory",
    )
    a(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --gpu-budget: replay the layers narrows-stream runs as CUDA graphs, the same numbers, the plan "
        "counting their memory (faster at short sequences). Not given: the planner uses them where it predicts them "
        "faster. A batch width is captured when it comes round again, and the four most recent are kept (unpacked, "
        "each batch is as wide as its longest row; with --packing every batch is --seq-len wide)",
    )
    a(
        "--kernels",
        choices=("fast", "peft"),
        help="the decoder layers' kernels: fast (default: narrows' fast layers — one autograd node a layer, LoRA in "
        "bf16 on tensor cores with float32 masters and gradients — where they cover the model; the run says which "
        "layers and why not the others) or peft (PEFT's modules: PEFT's bits)",
    )
    a(
        "--lora-dtype",
        choices=("auto", "float32"),
        help="the fast layers' adapter arithmetic: auto (default: the activations' dtype, bf16 on tensor cores, with "
        "float32 masters and gradients) or float32 (PEFT's: the adapters' matmuls and their sum with the base in "
        "float32; slower, and more memory: the plan counts its float32 temporaries)",
    )
    a("--lr", type=float, help="peak learning rate (default 5e-4), cosine decay after warmup")
    a("--warmup", type=int, help="warmup steps (default 5%% of --steps)")
    a("--seed", type=int, help="seed for the adapter init, data order and dropout (default 0)")
    a("--save-every", type=int, help="checkpoint every N steps (default 10)")
    a("--eval-rows", type=int, help="held-out rows for the eval loss (default 32)")
    a(
        "--eval-every",
        type=int,
        help="held-out loss every N steps, plus step 0 and the last (default: a quarter of "
        "--steps, 5 points in loss.png for the default 40)",
    )
    a("--exact-match", type=int, help="held-out GSM8K problems generated and scored (default 8; 0: off)")
    a(
        "--deterministic",
        action="store_true",
        default=None,
        help="deterministic kernels (torch.use_deterministic_algorithms, cuBLAS workspace): on CUDA the "
        "condition for streamed == resident bit for bit; the CPU is deterministic anyway",
    )
    a("--dtype", choices=["auto", "float32", "bfloat16", "float16"], help="auto: bf16 on CUDA, fp32 on CPU")
    a("--out", help="run folder, new or empty (default runs/default)")
    a(
        "--resume",
        metavar="RUN",
        help="continue the run in this folder from its newest intact checkpoint; "
        f"flags given with it may change {', '.join('--' + k.replace('_', '-') for k in RESUMABLE)}, "
        "any other is refused (see --override)",
    )
    a(
        "--override",
        action="store_true",
        help="with --resume: apply settings that change what the run trains (e.g. "
        "--lr; each says how it takes effect from the resumed step on), recorded in the run's config.json history; "
        "--adapter, --rank and --targets never change",
    )
    a(
        "--report-to",
        help="where the run shows up besides metrics.jsonl, as transformers' report_to: "
        "tensorboard (event files in RUN/tensorboard, needs narrows-core[tensorboard]), wandb (honours WANDB_MODE, "
        "WANDB_PROJECT; default project narrows; needs narrows-core[wandb]), comma-separated, all (those installed) "
        "or none (default, as transformers 5's TrainingArguments)",
    )
    a("--no-progress", action="store_true", help="one line per step instead of a progress bar")
    a(
        "--help-advanced",
        action=_AdvancedHelp,
        help="show the advanced flags too (planner overrides and more)",
    )
    _hide_advanced(p)
    p.set_defaults(func=_run)


# flags a newcomer does not need: they override a choice the planner makes (and the run
# says what it chose), or tune evaluation, data columns and the adapter's shape
ADVANCED = (
    "--data-split",
    "--eval-split",
    "--columns",
    "--alpha",
    "--dropout",
    "--targets",
    "--host-budget",
    "--cache",
    "--lmhead",
    "--seq-tile",
    "--step-mode",
    "--offload-optimizer",
    "--offload-adapters",
    "--cuda-graphs",
    "--kernels",
    "--lora-dtype",
    "--warmup",
    "--seed",
    "--save-every",
    "--eval-rows",
    "--eval-every",
    "--exact-match",
    "--dtype",
    "--no-progress",
)


def _hide_advanced(p: argparse.ArgumentParser) -> None:
    """Move the advanced flags into their own group, their help shown by --help-advanced only."""
    group = p.add_argument_group(
        "advanced",
        f"{len(ADVANCED)} more flags override the planner's choices (each run says what it chose and why) or tune "
        "evaluation, data columns and the adapter's shape: narrows finetune --help-advanced",
    )
    for action in p._actions:
        if any(flag in ADVANCED for flag in action.option_strings):
            p._optionals._group_actions.remove(action)
            group._group_actions.append(action)
            action.narrows_help = action.help  # type: ignore[attr-defined]
            action.help = argparse.SUPPRESS


class _AdvancedHelp(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        for action in parser._actions:
            if hasattr(action, "narrows_help"):
                action.help = action.narrows_help
        parser.print_help()
        parser.exit()
