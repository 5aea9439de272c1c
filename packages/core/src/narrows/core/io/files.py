"""Files narrows writes: the cache folder, and writes that never leave a half-written file.

Every checkpoint, report and cache entry goes through `atomic_write` / `atomic_dir`: the
content is written beside its destination under a temporary name and renamed into place
(`os.replace` is atomic on one filesystem), so an interrupted run leaves either the old
file or the new one, never a torn one.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["atomic_dir", "atomic_write", "build_lock", "cache_dir"]


def cache_dir(*parts: str) -> Path:
    """``$NARROWS_CACHE`` (default ``~/.cache/narrows``) joined with `parts`, created."""
    root = Path(os.environ.get("NARROWS_CACHE") or Path.home() / ".cache" / "narrows")
    path = root.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """Call ``write(tmp_path)`` then rename the temporary file onto `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it private; give it the usual mode
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


@contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Fill a temporary folder that is renamed to `path` when the block succeeds.

    `path` must not exist yet (a new checkpoint, a new cache entry); if another process
    created it meanwhile, theirs is kept and ours discarded.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        yield tmp
        try:
            os.rename(tmp, path)
        except OSError:
            if not path.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def build_lock(target: str | os.PathLike) -> Iterator[None]:
    """Held while one process checks or builds `target` (a cache entry): another rank, or
    another run, of the same input waits here, then finds it built."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(f"{target}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            print(f"narrows: waiting for another process building {target}", flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock
