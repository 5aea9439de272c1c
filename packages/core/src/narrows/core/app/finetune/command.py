"""``narrows finetune``: its flags, built from `FinetuneConfig`'s fields (each setting's
help, choices and default written once, in `config`), and the dispatch to a new run or a
resumed one."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from ...errors import NarrowsError
from .config import FIXED, RESUMABLE, SETTINGS, FinetuneConfig, flag_of, leaves
from .configfile import read_config_file
from .ranks import Ranks
from .resuming import plan_resume
from .run_folder import RunFolder

__all__ = ["add_parser"]


def _run(args: argparse.Namespace) -> int:
    given = {k: v for k, v in vars(args).items() if k in SETTINGS and v is not None}
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
        FinetuneConfig.of(**given).replace(world_size=world).checked()

    from .job import finetune, resume
    from .report import format_summary

    if args.resume:
        summary = resume(args.resume, given, override=args.override, progress=not args.no_progress)
        out = args.resume
    else:
        cfg = FinetuneConfig.of(**given)
        summary = finetune(cfg, progress=not args.no_progress)
        out = cfg.reporting.out
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
    for _, f in leaves():
        if f.metadata["flag"]:
            a(f"--{flag_of(f.name)}", **_argument(f))
    a(
        "--resume",
        metavar="RUN",
        help="continue the run in this folder from its newest intact checkpoint; "
        f"flags given with it may change {', '.join('--' + flag_of(k) for k in RESUMABLE)}, "
        "any other is refused (see --override)",
    )
    a(
        "--override",
        action="store_true",
        help="with --resume: apply settings that change what the run trains (e.g. "
        "--lr; each says how it takes effect from the resumed step on), recorded in the run's config.json history; "
        f"{_and(['--' + flag_of(k) for k in FIXED if k != 'out'])} never change",
    )
    a("--no-progress", action="store_true", help="one line per step instead of a progress bar")
    a(
        "--help-advanced",
        action=_AdvancedHelp,
        help="show the advanced flags too (planner overrides and more)",
    )
    _hide_advanced(p)
    p.set_defaults(func=_run)


def _and(items: list[str]) -> str:
    return ", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else "".join(items)


def _argument(f: dataclasses.Field) -> dict[str, Any]:
    """argparse's keywords for a setting's flag, from its field: every flag defaults to None,
    so the settings given on the command line are told apart from those left out."""
    meta, kind = f.metadata, str(f.type)
    out: dict[str, Any] = {"default": None, "help": _help(f)}
    if kind == "bool":
        out["action"] = "store_true"
    elif kind == "bool | None":
        out["action"] = argparse.BooleanOptionalAction
    else:
        parse = {"int": int, "float": float}.get(kind.removesuffix(" | None"))
        if parse is not None:
            out["type"] = parse
        if meta["choices"] is not None:
            out["choices"] = tuple(meta["choices"])
        if meta["metavar"] is not None:
            out["metavar"] = meta["metavar"]
    return out


def _help(f: dataclasses.Field) -> str:
    """The field's help, with its default: a None default as `default_help` says it, a switch's
    (off) left unsaid."""
    meta = f.metadata
    shown = f.default is not None and not isinstance(f.default, bool)
    default = meta["default_help"] or (f.default if shown else None)
    text = meta["help"] if default is None else f"{meta['help']} (default: {default})"
    return text.replace("%", "%%")  # argparse formats help with %


# flags a newcomer does not need: they override a choice the planner makes (and the run
# says what it chose), or tune evaluation, data columns and the adapter's shape
ADVANCED = (
    *(f"--{flag_of(f.name)}" for _, f in leaves() if f.metadata["flag"] and f.metadata["advanced"]),
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
