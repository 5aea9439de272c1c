"""The environment of a Python child process a test starts (the CLI, torchrun ranks)."""

from __future__ import annotations

import os
import tempfile
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
