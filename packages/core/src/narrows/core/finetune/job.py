"""One fine-tune from start to end, or resumed: the folder claimed first, every input
checked before the model is loaded, then load, build, train, report. Launched by torchrun,
every rank runs it; rank 0 claims and writes the folder (see `ranks`)."""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import torch

from ..data import check_packing
from ..errors import NarrowsError
from ..files import atomic_write
from .build import build_model, check_model_files, choose_accumulation, load_data, load_model, run_dtype
from .config import RESUMABLE, FinetuneConfig, resume_changes
from .evaluate import eval_row, say
from .inputs import INPUTS, absolute_inputs, check_inputs, record_inputs
from .loop import Progress, train
from .ranks import Ranks, data_parallel
from .report import plot_losses, save_adapter, summarize
from .reporters import open_reporters, summary_row
from .rundir import RunFolder, _damage
from .runstate import run_base

__all__ = ["finetune", "resume"]


def finetune(cfg: FinetuneConfig, *, progress: bool = True) -> dict | None:
    """Run one new fine-tune into ``cfg.out``; returns the summary also saved as summary.json
    (None on ranks other than 0)."""
    ranks = Ranks.from_env()
    cfg.world_size = ranks.world
    cfg.check()
    absolute_inputs(cfg)  # config.json names the same files wherever the run is resumed from
    device = ranks.device()
    run = RunFolder(cfg.out)
    with ranks.joined(device):
        ranks.first(run.claim_new)
        try:
            return _run(cfg, run, ranks, device, resuming=False, entry={"started": _now()}, progress=progress)
        finally:
            run.release()


def resume(
    folder: str, changes: dict | None = None, *, override: bool = False, progress: bool = True
) -> dict | None:
    """Continue the run in `folder` from its newest intact checkpoint.

    `changes` maps settings to new values. Those in `RESUMABLE` (e.g. ``steps`` to extend)
    are applied; any other would train a different model than the checkpoints hold and is
    refused, unless `override`. Either way the change is recorded in the run's history.
    """
    ranks = Ranks.from_env()
    device = ranks.device()
    run = RunFolder(folder)
    with ranks.joined(device):
        saved, history = ranks.first(lambda: (run.claim_existing(), run.read_config())[1])
        try:
            done = _finished(run, saved, changes or {})
            if done is not None:
                return done if ranks.main else None
            return _resume(run, ranks, device, saved, history, changes or {}, override, progress,
                           run.read_inputs())  # fmt: skip
        finally:
            run.release()


def _resume(run: RunFolder, ranks: Ranks, device: torch.device, saved: FinetuneConfig, history: list[dict],
            changes: dict, override: bool, progress: bool, recorded: dict | None) -> dict | None:  # fmt: skip
    folder = run.root
    given = {k: v for k, v in changes.items() if k != "out"}
    places = {k: given.pop(k) for k in INPUTS if given.get(k) is not None}  # compared by content, below
    if saved.world_size != ranks.world:  # how each step's micro-batches spread and sum
        given["world_size"] = ranks.world
    allowed, refused = resume_changes(saved, given)
    if "world_size" in refused and not override:
        old, new = refused["world_size"]
        raise NarrowsError(
            f"--resume {folder}: the run trained on {old} rank{'s' if old > 1 else ''}, this launch has {new}; "
            "the ranks share out each step's micro-batches and sum their gradients, so another number would not "
            f"continue the same run. Launch it as it started ({_launch(old)}), or add --override to continue on "
            f"{new} (recorded in the run's history)"
        )
    if refused and not override:
        listed = ", ".join(f"--{k.replace('_', '-')} {old} → {new}" for k, (old, new) in refused.items())
        raise NarrowsError(
            f"--resume {folder}: {listed} would change what the run trains, so it would no longer continue "
            f"the run it resumes; drop {'it' if len(refused) == 1 else 'them'}, start a new run with --out, "
            f"or add --override to apply and record the change (only {', '.join(RESUMABLE)} may change freely)"
        )
    cfg = dataclasses.replace(saved, out=str(run.root))
    if "steps" in allowed and saved.warmup is None:
        # the warmup stays what it was (a shorter run ends it early); only the decay stretches
        cfg.warmup = min(saved.warmup_steps, int(allowed["steps"][1]))
    for k, (_, new) in {**allowed, **refused}.items():
        setattr(cfg, k, new)
    found = check_inputs(folder, cfg, recorded, places, override)
    cfg.check()
    newest = run.newest_step()
    if newest > cfg.steps:
        raise NarrowsError(f"--resume {folder}: the run is at step {newest} already; "
                           f"--steps {cfg.steps} would end it before that")  # fmt: skip
    entry = {"resumed": _now(), "changed": {k: list(v) for k, v in {**allowed, **refused}.items()}}
    if found.moved:
        entry["moved"] = found.moved
    if found.changed:
        entry["inputs_changed"] = found.changed
    if refused or found.changed:
        entry["override"] = True
    if ranks.main:
        for line in found.notes:
            print(f"narrows: {line}", file=sys.stderr, flush=True)
    for k, (old, new) in {**allowed, **refused}.items():
        why = RESUMABLE.get(k, "overridden: the run no longer continues the trajectory it started")
        if ranks.main:
            print(f"narrows: --{k.replace('_', '-')} {old} → {new}: {why}", file=sys.stderr, flush=True)
    return _run(cfg, run, ranks, device, resuming=True, entry=entry, progress=progress, history=history,
                inputs=found.inputs)  # fmt: skip


def _finished(run: RunFolder, saved: FinetuneConfig, changes: dict) -> dict | None:
    """The summary of a run that already ended, said at once (nothing loaded), when
    ``--resume`` changes nothing: None where there is something left to do."""
    allowed, refused = resume_changes(saved, {k: v for k, v in changes.items() if k != "out"})
    summary_path = run.root / "summary.json"
    if allowed or refused or not summary_path.is_file() or run.newest_step() < saved.steps:
        return None
    if _damage(run.saved_steps()[0]) is not None:  # the resumed run sets it aside and trains again
        return None
    try:
        summary = json.loads(summary_path.read_text())
    except (OSError, ValueError):
        return None  # damaged: the resumed run writes it again
    say(f"{run.root} finished at step {saved.steps}; nothing to resume. To train further, extend it: "
        f"narrows finetune --resume {run.root} --steps {2 * saved.steps}")  # fmt: skip
    return summary


def _steps(n: int) -> str:
    return "step" if n == 1 else f"{n} steps"


def _launch(world: int) -> str:
    return "without torchrun" if world == 1 else f"torchrun with {world} ranks in all"


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


def _run(cfg: FinetuneConfig, run: RunFolder, ranks: Ranks, device: torch.device, *, resuming: bool, entry: dict,
         progress: bool, history: list[dict] | None = None, inputs: dict | None = None) -> dict | None:  # fmt: skip
    """`inputs`: what a resumed run found (`check_inputs`); a new run records its own."""
    from .. import __version__

    gone = run.clean_leftovers() if ranks.main else []
    if gone:
        print(
            f"narrows: removed what an interrupted run left in {run.root}: {', '.join(gone)}", file=sys.stderr
        )
    if cfg.deterministic:  # before the first GPU kernel, so cuBLAS starts with its fixed workspace
        from ..determinism import deterministic

        deterministic()
    dtype = run_dtype(cfg, device)
    t_setup = time.perf_counter()

    def stage(message: str) -> None:  # a line before each stage that may take a while
        if ranks.main:
            say(message)

    if inputs is None:  # the model and data by content, before either is read
        inputs = record_inputs(cfg, loud=ranks.main)
    stage("model: checking its files (the embedded default: its GGUF converted to a float folder once, "
          "cached under $NARROWS_CACHE/gguf)" if cfg.model is None else f"model {cfg.model}: checking its files")  # fmt: skip
    folder = check_model_files(cfg)  # headers, before any weight
    stage("loading the tokenizer")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
    stage("reading and tokenising the data (cached under $NARROWS_CACHE/data after the first run)")
    train_set, evals, em_rows, said = load_data(cfg, tokenizer)  # every row, before the model
    if ranks.main:
        for line in said:
            print(f"narrows: {line}", file=sys.stderr, flush=True)
    if ranks.world > 1:
        ranks.agree(
            narrows=__version__, config=dataclasses.asdict(cfg), data=train_set.digest()
        )  # the tokenised (or packed) data
    stage(f"loading the model on {device} ({str(dtype).removeprefix('torch.')}"
          + (", streamed within --gpu-budget" if cfg.gpu_budget != "off" else "") + ")")  # fmt: skip
    loaded = load_model(cfg, folder, dtype, device)
    stage(f"building the {cfg.adapter} adapter (rank {cfg.rank}, {cfg.targets})")
    model = build_model(cfg, loaded, device, dtype, ranks.world)
    step_mode, accumulation = choose_accumulation(cfg, model)
    if ranks.main and accumulation:
        print(f"narrows: accumulation: {accumulation}", file=sys.stderr, flush=True)
    if cfg.packing:  # the attention this model runs keeps packed examples apart, or the run stops here
        check_packing(model, device, len(tokenizer))
    net = data_parallel(model, ranks, device)  # several ranks: gradients summed over them
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.0
    )
    from transformers import get_cosine_schedule_with_warmup

    scheduler = get_cosine_schedule_with_warmup(optimizer, cfg.warmup_steps, cfg.steps)

    step, rows = 0, []
    if resuming:
        step = run.restore(model, optimizer, scheduler)  # at most the newest step, checked in resume()
        rows = run.trim_metrics(step)
    entry.update(step=step, narrows=__version__, argv=sys.argv[1:])
    if ranks.main:
        run.write_config(cfg, [*(history or []), entry], inputs)
        run.reporters = open_reporters(dataclasses.asdict(cfg), run.root, step)  # --report-to
    setup_s = time.perf_counter() - t_setup

    state = Progress(step=step, history=rows)
    if ranks.main and evals and not any(r.get("step") == 0 and "eval_loss" in r for r in rows):
        stage(
            f"held-out loss before training ({len(evals)} rows; again every {_steps(cfg.eval_interval)} and at the end)"
        )
        row = {"step": 0, **eval_row(model, evals, cfg.batch, pad_id, device, show=progress)}
        run.log(row)
        state.history.append(row)
    bar = None
    if progress and ranks.main:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.steps, initial=step, desc="finetune", unit="step", dynamic_ncols=True)
    train(cfg, run, model, optimizer, scheduler, train_set, evals, pad_id, device, state, bar, ranks, net,
          step_mode=step_mode)  # fmt: skip
    if not ranks.main:
        return None

    summary = summarize(cfg, model, tokenizer, state.history, em_rows, device, dtype, state.tokens, setup_s,
                        state.seconds, show=progress)  # fmt: skip
    summary["eval_rows"] = len(evals)  # what was evaluated: --eval-rows, or fewer held-out rows
    say("saving the adapter, summary.json and loss.png")
    if accumulation and "stream" in summary:
        summary["stream"]["accumulation"] = accumulation
    base = run_base(cfg)
    summary.update(adapter_step=state.step, base_model=base.name, base_origin=base.origin)  # read by runstate
    run.guard(run.root / "adapter_model.safetensors", lambda: save_adapter(model, run.root, base))
    summary["loss_png"] = plot_losses(state.history, run.root / "loss.png")
    run.report(summary_row(summary, cfg.steps))
    text = json.dumps(summary, indent=2)
    run.guard(
        run.root / "summary.json",
        lambda: atomic_write(run.root / "summary.json", lambda p: p.write_text(text)),
    )
    return summary
