"""What a resumed run trains with: the settings its last start ran with, changed by the
flags given with ``--resume`` and by hand edits of its ``config.json``, every change sorted
(`config.RESUMABLE`, `config.OVERRIDABLE`, `config.FIXED`) and either applied and recorded
or refused naming the field. Imports no torch: the CLI settles a resume before anything
heavy is loaded, and the job settles it again under the run folder's lock."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ...errors import NarrowsError
from .config import FIXED, OVERRIDABLE, RESUMABLE, Changes, FinetuneConfig, resume_changes
from .configfile import RunFile
from .inputs import INPUTS, absolute, require_inputs

__all__ = ["Resumption", "plan_resume"]


@dataclass(frozen=True)
class Resumption:
    """A resume settled: `cfg` (checked) is what the run trains with from here on; `changes`
    of the settings it last started with; `edited` names the fields that changed in
    config.json by hand; `places` the inputs named anew (their content is compared when
    the job resumes); `restart` says the run starts again from step 0 with no checkpoint
    left (only with --override)."""

    cfg: FinetuneConfig
    changes: Changes
    edited: frozenset[str]
    places: dict[str, str]
    restart: bool = False

    def said(self, folder: Path) -> list[str]:
        """A line for each change: what it is, where it came from and how it takes effect."""
        lines = []
        for name, (old, new) in self.changes.all.items():
            how = RESUMABLE.get(name) or (
                SAME_SPLIT if name in self.changes.free else f"overridden: {OVERRIDABLE[name]}"
            )
            lines.append(f"{_named(name, self.edited, folder)} {old} → {new}: {how}")
        return lines

    def entry(self) -> dict:
        """What the run's history records of the changes."""
        out: dict = {"changed": {k: list(v) for k, v in self.changes.all.items()}}
        edited = sorted(self.edited & set(self.changes.all))
        if edited:
            out["edited"] = edited  # changed in config.json by hand, not by a flag
        if self.changes.overridden:
            out["override"] = True
        if self.restart:
            out["restarted"] = "no checkpoint was left: trained again from step 0"
            out["override"] = True
        return out


def _named(name: str, edited: frozenset[str], folder: Path) -> str:
    flag = "ranks" if name == "world_size" else "--" + name.replace("_", "-")
    return f"{name} (edited in {folder / 'config.json'})" if name in edited else flag


def plan_resume(
    folder: Path,
    file: RunFile,
    given: dict,
    world: int,
    override: bool,
    *,
    newest: int,
    logged: int,
    summarized: bool = False,
) -> Resumption:
    """Settle the resume of the run in `folder` (its config.json read as `file`): `given`
    the settings asked for (flags; None: not given), `world` the ranks of this launch,
    `newest` the newest checkpoint's step (0: none), `logged` the last step metrics.jsonl
    holds, `summarized` whether the run wrote its summary.json (a run that ended, resumed
    with no change, is not checked further: there is nothing to train). Refuses (`NarrowsError`) what cannot continue the run: a FIXED change; an
    OVERRIDABLE one without `override`; steps below the newest checkpoint; a run whose
    checkpoints are gone after it logged steps past its first one, without `override`."""
    started = file.started_with or file.config  # before narrows kept it, the file is all there is
    now, before = file.config.settings(), started.settings()
    edited = frozenset(n for n in now if now[n] != before[n])
    wanted = {n: now[n] for n in edited}
    wanted.update({k: v for k, v in given.items() if v is not None and k != "out"})
    wanted.pop("out", None)  # the run folder's own name, edited: nothing a run trains
    places = {}
    for name in INPUTS:  # a new place for an input: its content is compared, not its path
        if wanted.get(name) is not None:
            value = wanted.pop(name)
            if absolute(value) != before[name]:
                places[name] = absolute(value)
    wanted["world_size"] = world  # the launch says how each step's micro-batches spread and sum, not the file
    changes = resume_changes(started, wanted)
    # what shares out each step's micro-batches is the data-parallel width: the ranks over the stages
    stages = (before["pipeline_stages"], int(wanted.get("pipeline_stages") or before["pipeline_stages"]))
    width = (started.training.data_ranks, world // stages[1])
    if width[0] == width[1] and "world_size" in changes.overridden:
        changes.free["world_size"] = changes.overridden.pop("world_size")  # other stages, the same split
    elif width[0] != width[1] and "world_size" not in changes.overridden:
        changes.overridden["world_size"] = (before["world_size"], world)  # as many ranks, split otherwise
    shown = {k: _named(k, edited, folder) for k in changes.all}
    if changes.fixed:
        name, (old, new) = next(iter(changes.fixed.items()))
        raise NarrowsError(
            f"--resume {folder}: {shown[name]} {old} → {new} cannot change in a resumed run: {FIXED[name]}. "
            + _edited_back(name, edited, folder)
            + f"Start a new run with these settings instead: narrows finetune --config {folder} "
            f"--{name.replace('_', '-')} {new} --out NEW_FOLDER"
        )
    if "world_size" in changes.overridden and not override:
        old, new = changes.overridden["world_size"]
        raise NarrowsError(
            f"--resume {folder}: the run shared each step's micro-batches over {_width(width[0])} "
            f"({_launch(old, stages[0])}), this launch over {_width(width[1])} ({_launch(new, stages[1])}); the "
            "data-parallel ranks share out each step's micro-batches and sum their gradients, so another number "
            f"would not continue the same run. Launch it as it started, or add --override to continue this way "
            "(recorded in the run's history)"
        )
    if changes.overridden and not override:
        listed = ", ".join(f"{shown[k]} {old} → {new}" for k, (old, new) in changes.overridden.items())
        hand = [k for k in changes.overridden if k in edited]
        back = (
            f"put {', '.join(hand)} back in {folder / 'config.json'} (its last start ran with "
            f"{', '.join(f'{k} = {json.dumps(before[k])}' for k in hand)}), "
            if hand
            else ""
        )
        raise NarrowsError(
            f"--resume {folder}: {listed} would change what the run trains, so it would no longer continue "
            f"the run it resumes; {back or ('drop it, ' if len(changes.overridden) == 1 else 'drop them, ')}"
            "start a new run with --out, or add --override to apply and record the change (only "
            f"{', '.join(RESUMABLE)} may change freely)"
        )
    settings: dict = {"out": str(folder)}
    if "steps" in changes.all and started.training.warmup is None and "warmup" not in changes.all:
        # the warmup stays what it was (a shorter run ends it early); only the decay stretches
        settings["warmup"] = min(started.warmup_steps, int(changes.all["steps"][1]))
    settings.update({name: new for name, (_, new) in changes.all.items()})
    for name, path in places.items():
        if before[name] is None:
            flag = INPUTS[name][0]
            was = "the embedded default" if started.base.model is None and name != "eval_data" else "none"
            raise NarrowsError(
                f"--resume {folder}: the run started without {flag} ({was}); giving it now "
                "would change what it trains on. Start a new run with --out instead"
            )
        settings[name] = path
    cfg = started.replace(**settings)
    if summarized and newest >= cfg.training.steps and not changes.all and not places:
        return Resumption(cfg, changes, edited, places)  # it ended: the job says so
    require_inputs(folder, cfg)  # a moved input: the way to name its new place, before any other check
    try:
        cfg = cfg.checked()
    except NarrowsError as e:
        if not edited:
            raise
        raise NarrowsError(
            f"{e} (with {', '.join(sorted(edited))} as edited in {folder / 'config.json'})"
        ) from None
    if newest > cfg.training.steps:
        raise NarrowsError(
            f"--resume {folder}: the run is at step {newest} already; "
            f"--steps {cfg.training.steps} would end it before that"
        )
    # it wrote a checkpoint once: they were removed
    restart = newest == 0 and logged >= started.training.save_every
    if restart and not override:
        raise NarrowsError(
            f"--resume {folder}: no checkpoint is left in {folder / 'checkpoints'}, though the run logged {logged} "
            f"steps and saved every {started.training.save_every}: it would train again from step 0. Put the checkpoints "
            "back, or add --override to start it again from step 0 (recorded in the run's history)"
        )
    return Resumption(cfg, changes, edited, places, restart)


def _edited_back(name: str, edited: frozenset[str], folder: Path) -> str:
    if name not in edited:
        return ""
    return f"Put {name} back in {folder / 'config.json'} to resume the run as it is. "


def _launch(world: int, stages: int = 1) -> str:
    ranks = "without torchrun" if world == 1 else f"torchrun with {world} ranks in all"
    return ranks + (f", --pipeline-stages {stages}" if stages > 1 else "")


def _width(ranks: int) -> str:
    return f"{ranks} data-parallel rank{'s' if ranks > 1 else ''}"


# a launch whose ranks hold the layers in other pipeline stages, each step's micro-batches shared as before
SAME_SPLIT = (
    "the ranks hold the model's layers in other pipeline stages; each step's micro-batches are shared over as "
    "many data-parallel ranks as before, so the numbers trained are the same"
)
