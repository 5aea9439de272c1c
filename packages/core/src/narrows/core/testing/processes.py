"""The environment of a test's Python child processes (the CLI, torchrun ranks, Triton's
interpreter) and its caches."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def child_env(**extra: str) -> dict[str, str]:
    """``os.environ`` for a test's child process: offline, unbuffered, and one bytecode cache
    shared by every child, outside the source tree. This environment may set
    PYTHONDONTWRITEBYTECODE, which would make each child compile transformers and torch's
    Python again (about 20 s on two cores)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    cache = Path(tempfile.gettempdir()) / f"narrows-test-pycache-{os.getuid()}"
    env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", PYTHONPYCACHEPREFIX=str(cache))
    env.update(extra)
    return env


def under_triton_interpreter(script: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Python `script` run in a child process with Triton's CPU interpreter on
    (``TRITON_INTERPRET=1``): a kernel's indexing checked where there is no GPU."""
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=child_env(TRITON_INTERPRET="1"),
        timeout=timeout,
    )


def interruptible() -> None:
    """`preexec_fn` of a child a test sends SIGINT: Ctrl-C's default action restored before
    exec. A shell running the tests in the background starts them with SIGINT ignored, an
    ignored signal stays ignored across exec, and Python then never raises
    KeyboardInterrupt."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextmanager
def private_cache(folder: str | os.PathLike) -> Iterator[None]:
    """``$NARROWS_CACHE`` set to `folder` while the block runs, for this process and the
    children it starts: what tests cache (tokenised data above all) stays out of the
    user's ~/.cache/narrows."""
    old = os.environ.get("NARROWS_CACHE")
    os.environ["NARROWS_CACHE"] = str(folder)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("NARROWS_CACHE", None)
        else:
            os.environ["NARROWS_CACHE"] = old
