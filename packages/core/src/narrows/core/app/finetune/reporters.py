"""Where a run shows up besides ``metrics.jsonl`` (``--report-to``, transformers'
``report_to``): TensorBoard event files in ``RUN/tensorboard/``, a Weights & Biases run
(files in ``RUN/wandb/``). Each backend is imported when a run opens it, never before:
``narrows --help`` does not pay for it. A resumed run continues the same curves: TensorBoard
drops what was logged after the checkpoint it resumes from, W&B continues the same run."""

from __future__ import annotations

import json
import math
import os
import secrets
import string
from pathlib import Path

from ...errors import NarrowsError
from ...optional import is_available, require

__all__ = ["REPORTERS", "open_reporters", "parse_report_to", "summary_row", "wandb_can_log"]

# --report-to name -> the module it imports
REPORTERS = {"tensorboard": "tensorboard", "wandb": "wandb"}

# metrics.jsonl field -> (the name it is shown under, the factor it is shown in)
SCALARS = {
    "loss": ("train/loss", 1.0),
    "lr": ("train/learning_rate", 1.0),
    "tokens_per_s": ("train/tokens_per_second", 1.0),
    "step_s": ("train/step_seconds", 1.0),
    "peak_bytes": ("train/peak_memory_gib", 2.0**-30),
    "eval_loss": ("eval/loss", 1.0),
    "eval_peak_bytes": ("eval/peak_memory_gib", 2.0**-30),
    "exact_match_after": ("eval/exact_match", 1.0),
    "exact_match_before": ("eval/exact_match_without_adapter", 1.0),
}


def parse_report_to(text: str) -> list[str]:
    """``--report-to`` as a list of backends; an unknown name, or one whose package is not
    installed, is a NarrowsError naming the install line. ``all``: every one installed."""
    names = [p.strip() for p in text.split(",") if p.strip()]
    if names in ([], ["none"]):
        return []
    if names == ["all"]:
        return [name for name, module in REPORTERS.items() if is_available(module)]
    unknown = [n for n in names if n not in REPORTERS]
    if unknown:
        raise NarrowsError(
            f"--report-to {text}: unknown {', '.join(map(repr, unknown))}; give "
            f"{', '.join(REPORTERS)} (comma-separated), all (every one installed) or none"
        )
    for name in names:
        if not is_available(REPORTERS[name]):  # found, not imported: the check stays light
            require(REPORTERS[name], f"--report-to {name}")
    if "wandb" in names:
        wandb_can_log()
    return list(dict.fromkeys(names))


def wandb_can_log() -> None:
    """Refuse ``--report-to wandb`` where W&B would refuse to start a run, before anything is
    loaded: it logs offline (``WANDB_MODE`` offline or disabled), or has credentials as
    wandb looks for them (``WANDB_API_KEY``, ``WANDB_IDENTITY_TOKEN_FILE``, or the netrc
    entry ``wandb login`` writes for the host of ``WANDB_BASE_URL``). Read without importing
    wandb; whether the key is valid only W&B's server can say."""
    import netrc
    from urllib.parse import urlsplit

    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "dryrun", "disabled"):
        return
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return
    host = urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").netloc
    if os.environ.get("NETRC"):
        files = [Path(os.environ["NETRC"]).expanduser()]
    else:
        files = [Path("~/.netrc").expanduser(), Path("~/_netrc").expanduser()]
    for file in files:
        try:
            entry = netrc.netrc(str(file)).authenticators(host)
        except (OSError, netrc.NetrcParseError):
            continue
        if entry and entry[2]:
            return
    raise NarrowsError(
        f"--report-to wandb: W&B has no credentials here (no WANDB_API_KEY, no entry for {host} in "
        f"{files[0]}), so it would stop the run once the model is loaded: run `wandb login`, set "
        "WANDB_API_KEY, or set WANDB_MODE=offline to log into RUN/wandb and `wandb sync` it later"
    )


def open_reporters(config: dict, root: Path, step: int) -> list:
    """The backends ``config["report_to"]`` names, open on run folder `root`, the run
    (re)starting after `step`."""
    kinds = {"tensorboard": TensorBoard, "wandb": WandB}
    opened = []
    try:
        for name in parse_report_to(config["report_to"]):
            opened.append(kinds[name](config, Path(root), step))
    except BaseException:
        for reporter in opened:
            reporter.close()
        raise
    return opened


def summary_row(summary: dict, step: int) -> dict:
    """The figures only the final summary has (exact match), as a row at the last step."""
    return {
        "step": step,
        **{k: summary[k] for k in ("exact_match_after", "exact_match_before") if k in summary},
    }


def scalars(row: dict) -> dict[str, float]:
    """A metrics row's numbers under the names the dashboards show."""
    out = {}
    for key, (name, factor) in SCALARS.items():
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[name] = value * factor
    return out


class TensorBoard:
    """Event files in ``RUN/tensorboard/``. Opened at `step`, its writer marks every event
    a killed run wrote after that step dropped (``purge_step``): the steps a resumed run
    trains again are not shown twice."""

    def __init__(self, config: dict, root: Path, step: int):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.writer = SummaryWriter(str(root / "tensorboard"), purge_step=step + 1)
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", step)
        plain = {k: v for k, v in config.items() if isinstance(v, (int, float, str, bool))}
        for summary in hparams(
            plain, {name: 0.0 for name in ("train/loss", "eval/loss", "eval/exact_match")}
        ):
            self.writer.file_writer.add_summary(summary, step)
        self.writer.flush()

    def log(self, row: dict) -> None:
        for name, value in scalars(row).items():
            self.writer.add_scalar(name, value, row["step"])
        self.writer.flush()  # a killed run keeps what metrics.jsonl keeps

    def close(self) -> None:
        self.writer.close()


class WandB:
    """A W&B run named for the run folder, project ``$WANDB_PROJECT`` (default narrows).
    W&B's own settings stand (``WANDB_MODE=offline`` among them); its id is kept in
    ``RUN/wandb-id``, so that a resumed run continues the same W&B run."""

    def __init__(self, config: dict, root: Path, step: int):
        import wandb

        path = root / "wandb-id"
        if path.is_file():
            run_id = path.read_text().strip()
        else:
            run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        try:
            self.run = wandb.init(
                project=os.environ.get("WANDB_PROJECT") or "narrows",
                name=root.resolve().name,
                id=run_id,
                resume="allow",
                dir=str(root),
                config=config,
                allow_val_change=True,
            )
        except Exception as e:  # a key W&B's server refuses, no network: said, not a traceback
            raise NarrowsError(
                f"--report-to wandb: W&B did not start a run ({type(e).__name__}: {e}); fix its "
                "login (wandb login), or set WANDB_MODE=offline to log into RUN/wandb and `wandb "
                "sync` it later"
            ) from None
        if not path.is_file():  # kept once W&B has the run, so that a resumed run continues it
            path.write_text(run_id + "\n")

    def log(self, row: dict) -> None:
        numbers = scalars(row)
        if numbers:
            self.run.log(numbers, step=row["step"])

    def close(self) -> None:
        import sys

        failed = sys.exc_info()[0] is not None  # closed while an error unwinds (RunFolder.release)
        self.run.finish(exit_code=1 if failed else 0)
