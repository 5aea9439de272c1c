"""The run folder: owned by one process at a time, and never mixed with anything else.

An exclusive ``flock`` on ``.lock`` refuses a second run on the folder at once, naming the
first. A new run takes only a missing or empty folder; an existing run continues only
through ``--resume``. Checkpoint files are written whole under a temporary name and renamed.

why: docs/design.md#the-run-folder
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import random
import re
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import NarrowsError
from ...io.files import atomic_dir, atomic_write
from ...sizes import format_bytes
from .config import FinetuneConfig
from .configfile import FORMAT, RunFile, read_run_file

if TYPE_CHECKING:
    from torch import nn

__all__ = ["RunFolder"]

_STEP = re.compile(r"step-(\d+)")
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class RunFolder:
    """Paths of one run, its lock, its settings and its checkpoints."""

    def __init__(self, out: str | os.PathLike):
        self.root = Path(out).expanduser()
        self.checkpoints = self.root / "checkpoints"
        self.config = self.root / "config.json"
        self.metrics = self.root / "metrics.jsonl"
        self.lock_path = self.root / ".lock"
        self._fd: int | None = None
        self._created: list[Path] = []  # folders claim_new made (--out and missing parents)
        self.reporters: list = []  # where each row goes too (TensorBoard, W&B: `reporters`), closed on release

    # --- ownership ---------------------------------------------------------------------

    def claim_new(self) -> None:
        """Take the folder for a new run: it must not exist, or be empty."""
        self._refuse_unless_empty()
        try:
            self._created = [p for p in (self.root, *self.root.parents) if not p.exists()]
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise NarrowsError(
                f"--out {self.root}: cannot create it ({e.strerror}); pick a folder you can write to"
            ) from None
        self._lock()
        self._refuse_unless_empty()  # another run may have filled it before we held the lock

    def claim_existing(self) -> None:
        """Take the folder of an existing run to continue it."""
        if not self.config.is_file():
            raise NarrowsError(f"--resume {self.root}: no run there (no config.json); start one with --out")
        self._lock()

    def _refuse_unless_empty(self) -> None:
        if self.config.is_file():
            self.release()
            raise NarrowsError(
                f"{self.root} already holds a run; continue it with --resume {self.root} "
                "or pick another --out"
            )
        if self.root.exists() and not self.root.is_dir():
            raise NarrowsError(f"--out {self.root} is a file; give a folder for the run")
        if self.root.is_dir():
            others = sorted(p.name for p in self.root.iterdir() if p.name != ".lock")
            if others:
                self.release()
                shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
                raise NarrowsError(
                    f"--out {self.root} is not empty and is not a narrows run (it holds {shown}); "
                    "narrows writes a run only into a new or empty folder: pick another --out"
                )

    def _lock(self) -> None:
        import fcntl

        while True:
            try:
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise NarrowsError(
                    f"{self.root}: cannot write there ({e.strerror}); pick a folder you can write to"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = _holder(fd)
                os.close(fd)
                raise NarrowsError(
                    f"{self.root} is in use by another narrows run ({holder}); wait for it to end, "
                    "or give this run another --out"
                ) from None
            try:  # the holder before us may have removed the file as we opened it: lock the one in place
                if os.fstat(fd).st_ino == os.stat(self.lock_path).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        previous = _holder(fd, missing="")
        if previous:  # it left its name and the kernel released its lock: that process is gone
            print(
                f"narrows: {self.root}: taking over the lock left by {previous}, which is no longer running",
                file=sys.stderr,
                flush=True,
            )
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Let go of the folder (the lock file goes); a folder this run created and left
        without a run is removed."""
        while self.reporters:
            self.reporters.pop().close()
        if self._fd is None:
            return
        import fcntl

        self.lock_path.unlink(missing_ok=True)  # before unlocking: see _lock's inode check
        if self._created and not self.config.exists():
            shutil.rmtree(self.checkpoints, ignore_errors=True)
            with contextlib.suppress(OSError):  # the folders this run made, innermost first, while empty
                for folder in self._created:
                    folder.rmdir()
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def clean_leftovers(self) -> list[str]:
        """Remove the temporary files and folders a killed run left behind."""
        gone = []
        for folder in (self.root, self.checkpoints):
            for p in folder.glob(".*.tmp") if folder.is_dir() else ():
                shutil.rmtree(p) if p.is_dir() else p.unlink()
                gone.append(str(p.relative_to(self.root)))
        return gone

    # --- settings ------------------------------------------------------------------------

    def read_file(self) -> RunFile:
        """``config.json``, checked field by field: settings, history, inputs, and the
        settings the run last started with (`configfile.read_run_file`)."""
        return read_run_file(self.config)

    def write_config(self, cfg: FinetuneConfig, history: list[dict], inputs: dict | None = None) -> None:
        body = {"format": FORMAT, "config": cfg.settings(), "history": history}
        if inputs is not None:
            body["inputs"] = inputs
        self.guard(
            self.config, lambda: atomic_write(self.config, lambda p: p.write_text(json.dumps(body, indent=2)))
        )

    # --- checkpoints ---------------------------------------------------------------------

    def saved_steps(self) -> list[Path]:
        """Checkpoint folders, newest first."""
        found = [p for p in self.checkpoints.glob("step-*") if _STEP.fullmatch(p.name) and p.is_dir()]
        return sorted(found, key=_step_of, reverse=True)

    def newest_step(self) -> int:
        """The step of the newest checkpoint folder (0: none), from its name alone."""
        saved = self.saved_steps()
        return _step_of(saved[0]) if saved else 0

    def save_checkpoint(
        self, step: int, model: nn.Module, optimizer, scheduler, whole: tuple[dict, dict] | None = None
    ) -> Path:
        """`whole`: the whole model's adapter (as PEFT saves it) and optimizer state where
        this process holds part of the model (`stages.Stages.whole_state`)."""
        import torch
        from peft import get_peft_model_state_dict

        name = f"step-{step:06d}"
        path = self.checkpoints / name
        if path.exists():
            return path
        adapter, optimizer_state = whole if whole is not None else (get_peft_model_state_dict(model), None)
        state = {
            "step": step,
            "adapter": {k: v.detach().cpu() for k, v in adapter.items()},
            "optimizer": optimizer.state_dict() if optimizer_state is None else optimizer_state,
            "scheduler": scheduler.state_dict(),
            "rng": {
                "python": random.getstate(),
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            },
        }

        def write() -> None:
            with atomic_dir(path) as tmp:
                with open(tmp / "state.pt", "wb") as f:
                    out = _Hashing(f)
                    try:
                        torch.save(state, out)
                    except RuntimeError:
                        if out.error is not None:  # torch reports a full disk as "unexpected pos"
                            raise out.error from None
                        raise
                meta = {"step": step, "bytes": out.bytes, "sha256": out.digest.hexdigest()}
                (tmp / "meta.json").write_text(json.dumps(meta))
            # for people and tools; restore() scans the step folders themselves
            atomic_write(self.checkpoints / "latest", lambda p: p.write_text(name))

        self.guard(path, write, _tensor_bytes(state))
        for old in self.saved_steps()[2:]:  # keep the newest two
            shutil.rmtree(old, ignore_errors=True)
        return path

    def guard(self, target: Path, write, need: int | None = None) -> None:
        """Run `write`; a full disk becomes an error naming the path and the space needed."""
        try:
            write()
        except OSError as e:
            if e.errno not in _DISK_FULL:
                raise
            folder = target.parent
            needs = f"needs about {format_bytes(need)}, " if need else ""
            free = shutil.disk_usage(folder).free if folder.exists() else 0
            latest = self.saved_steps()
            kept = (
                f"the last checkpoint, {latest[0]}, is intact" if latest else "no checkpoint was written yet"
            )
            raise NarrowsError(
                f"no space left on the device of {folder} writing {target.name} ({needs}"
                f"{format_bytes(free)} free); {kept}: free some space and continue with "
                f"narrows finetune --resume {self.root}"
            ) from None

    def restore(self, model: nn.Module, optimizer, scheduler, local=None) -> int:
        """Load the newest intact checkpoint into the run; returns its step (0: none yet).
        `local`: what of a checkpoint's state this process restores (a pipeline stage's
        share, `stages.Stages.local_state`).

        A damaged checkpoint (a cut file, a changed byte) is named, set aside as
        ``step-N.damaged``, and the one before it is used.
        """
        import torch

        for path in self.saved_steps():
            why = _damage(path)
            if why is None:
                try:
                    state = torch.load(path / "state.pt", weights_only=False)
                except Exception as e:  # a checkpoint from before meta.json, cut short
                    why = f"it does not load ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
            if why is not None:
                aside = path.with_name(path.name + ".damaged")
                shutil.rmtree(aside, ignore_errors=True)
                path.rename(aside)
                print(
                    f"narrows: checkpoint {path} is damaged: {why}; set aside as {aside.name}, "
                    "using the one before it",
                    file=sys.stderr,
                    flush=True,
                )
                continue
            _load_state(state if local is None else local(state), model, optimizer, scheduler)
            return int(state["step"])
        if any(self.checkpoints.glob("step-*.damaged")):
            raise NarrowsError(
                f"every checkpoint of {self.root} is damaged (set aside as step-*.damaged); "
                "the run cannot continue: start it again with another --out"
            )
        return 0

    # --- metrics -------------------------------------------------------------------------

    def _rows(self) -> list[dict]:
        rows = []
        for line in self.metrics.read_text().splitlines() if self.metrics.exists() else []:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # the line a kill cut short
                continue
            if isinstance(row, dict) and isinstance(row.get("step", 0), int):
                rows.append(row)
        return rows

    def logged_step(self) -> int:
        """The last step ``metrics.jsonl`` holds (0: none)."""
        return max((r.get("step", 0) for r in self._rows()), default=0)

    def trim_metrics(self, step: int) -> list[dict]:
        """Drop metrics logged after `step` (a resumed run logs them again)."""
        rows = [r for r in self._rows() if r.get("step", 0) <= step]
        text = "".join(json.dumps(r) + "\n" for r in rows)
        self.guard(self.metrics, lambda: atomic_write(self.metrics, lambda p: p.write_text(text)))
        return rows

    def log(self, row: dict) -> None:
        line = json.dumps(row) + "\n"

        def write() -> None:
            with open(self.metrics, "a") as f:
                f.write(line)

        self.guard(self.metrics, write)
        self.report(row)

    def report(self, row: dict) -> None:
        """Pass a row to the reporters alone (the final summary's exact match)."""
        for reporter in self.reporters:
            reporter.log(row)


class _Hashing:
    """A file torch.save writes through: it hashes what is written and keeps the OSError a
    write raised (torch replaces it with a RuntimeError that has no errno)."""

    def __init__(self, f):
        self.f, self.error, self.digest, self.bytes = f, None, hashlib.sha256(), 0

    def write(self, b) -> int:
        try:
            n = self.f.write(b)
        except OSError as e:
            self.error = e
            raise
        self.digest.update(b)
        self.bytes += len(b)
        return n

    def flush(self) -> None:
        self.f.flush()


def _tensor_bytes(obj) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _step_of(path: Path) -> int:
    return int(_STEP.fullmatch(path.name)[1])


def _holder(fd: int, missing: str = "holder unknown") -> str:
    try:
        who = json.loads(os.pread(fd, 4096, 0) or b"null")
        return f"pid {who['pid']} on {who['host']}, started {who['since']}"
    except (OSError, ValueError, TypeError, KeyError):
        return missing


def _damage(path: Path) -> str | None:
    """Why a checkpoint folder cannot be trusted, or None."""
    state = path / "state.pt"
    if not state.is_file():
        return "state.pt is missing"
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        return None  # written before checkpoints carried a checksum: loading is the check
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError):
        return "meta.json is unreadable"
    if not (
        isinstance(meta, dict) and type(meta.get("bytes")) is int and isinstance(meta.get("sha256"), str)
    ):
        return "meta.json lacks its byte count and sha256"
    size = state.stat().st_size
    if size != meta["bytes"]:
        return f"state.pt has {size} bytes, {meta['bytes']} were written"
    from ...io.fingerprint import file_sha256

    if file_sha256(state) != meta["sha256"]:
        return "state.pt fails its sha256"
    return None


def _load_state(state: dict, model: nn.Module, optimizer, scheduler) -> None:
    import torch
    from peft import set_peft_model_state_dict

    set_peft_model_state_dict(model, state["adapter"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    random.setstate(state["rng"]["python"])
    torch.set_rng_state(state["rng"]["torch"])
    if state["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
