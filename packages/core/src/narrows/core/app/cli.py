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

from ..errors import Interrupted, NarrowsError

__all__ = ["build_parser", "main"]

# files are written under a temporary name and renamed, so a stop anywhere leaves none half-written
_INTERRUPTED = (
    "narrows: interrupted; nothing half-written was kept (every file is renamed into place whole): "
    "run the command again, or continue a run that has a checkpoint with narrows finetune --resume RUN"
)


def _doctor(args: argparse.Namespace) -> int:
    from .doctor import collect, render

    report = collect()
    print(json.dumps(report.as_dict(), indent=2) if args.json else render(report))
    core_ok = all(v is not None for v in report.dependencies.values())
    return 0 if core_ok else 1


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="narrows", description="Fine-tune large language models through a narrow GPU."
    )
    parser.add_argument("--version", action="version", version=f"narrows-core {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    doctor = sub.add_parser("doctor", help="versions, devices and usable backends (attach to bug reports)")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.set_defaults(func=_doctor)
    from .finetune.command import add_parser as add_finetune

    add_finetune(sub)
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
    except Interrupted as e:  # Ctrl-C in training: where the run stands and how to continue it
        print(f"narrows: {e}", file=sys.stderr)
        return e.exit_code
    except NarrowsError as e:  # bad input: say what is wrong, no traceback
        print(f"narrows: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:  # Ctrl-C anywhere else (reading data, loading the model)
        print(_INTERRUPTED, file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
