"""`narrows finetune` run folders for tests of what reads them (``narrows eval``, run
states): the real CLI in a subprocess, optionally stopped dead right after a checkpoint —
the state a run killed mid-way leaves, reached at a chosen step every time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from .processes import child_env

__all__ = ["finetune_cli"]

# `narrows finetune` that exits at once (no clean-up, as a kill) once checkpoint STOP is written
_STOP_AFTER = """
import os, sys
import narrows.core.app.cli
from narrows.core.app.finetune.run_folder import RunFolder
real, stop = RunFolder.save_checkpoint, int(os.environ["NARROWS_TEST_STOP_AFTER"])
def save(self, step, *args, **kwargs):
    path = real(self, step, *args, **kwargs)
    if step == stop:
        os._exit(9)
    return path
RunFolder.save_checkpoint = save
sys.exit(narrows.core.app.cli.main(sys.argv[1:]))
"""


def finetune_cli(
    *args: str | os.PathLike,
    stop_after: int | None = None,
    cwd: str | os.PathLike | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess:
    """``narrows finetune ARGS``; with `stop_after`, the process ends (exit 9) right after
    writing that step's checkpoint, leaving the folder as a kill would."""
    head = ["-c", _STOP_AFTER] if stop_after is not None else ["-m", "narrows.core.app.cli"]
    env = child_env(**({"NARROWS_TEST_STOP_AFTER": str(stop_after)} if stop_after is not None else {}))
    cmd = [sys.executable, *head, "finetune", *map(str, args)]
    return subprocess.run(
        cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=Path(cwd) if cwd else None
    )
