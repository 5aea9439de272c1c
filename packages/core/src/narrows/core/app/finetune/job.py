"""One fine-tune from start to end, or resumed: the folder claimed first, every input
checked before the model is loaded, then load, build, train, report. Launched by torchrun,
every rank runs it; rank 0 claims and writes the folder (see `ranks`)."""

from __future__ import annotations

import json
import shutil
import sys
import time

import torch

from ...io.files import atomic_write
from ...protocol.handle import state_of
from ...quant.report import precision
from ..data import check_packing
from .build import (
    build_model,
    check_budget_before_loading,
    check_model_files,
    choose_accumulation,
    load_data,
    load_model,
    run_dtype,
)
from .config import FinetuneConfig
from .configfile import RunFile
from .evaluate import eval_row, say
from .inputs import absolute_inputs, check_inputs, record_inputs
from .loop import Progress, follow_schedule, schedule, settled_heap, train
from .ranks import Ranks, data_parallel
from .report import plot_losses, save_adapter, summarize
from .reporters import open_reporters, summary_row
from .resuming import Resumption, plan_resume
from .run_folder import RunFolder, _damage
from .stages import Stages
from .state import run_base

__all__ = ["finetune", "resume"]


def finetune(cfg: FinetuneConfig, *, progress: bool = True) -> dict | None:
    """Run one new fine-tune into ``cfg.reporting.out``; returns the summary also saved as summary.json
    (None on ranks other than 0)."""
    ranks = Ranks.from_env()
    cfg = absolute_inputs(cfg.replace(world_size=ranks.world).checked())  # the same files wherever it resumes
    device = ranks.device()
    run = RunFolder(cfg.reporting.out)
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

    `changes` maps settings to new values; so does a hand edit of the run's config.json
    (told apart from the settings the run last started with, which its history keeps).
    Those in `RESUMABLE` (e.g. ``steps`` to extend) are applied; those in `OVERRIDABLE`
    would train something else than the checkpoints continue and are refused, unless
    `override`; those in `FIXED` are refused (`resuming.plan_resume`). Every change is
    recorded in the run's history and said, with how it takes effect.
    """
    ranks = Ranks.from_env()
    device = ranks.device()
    run = RunFolder(folder)
    with ranks.joined(device):
        file = ranks.first(lambda: (run.claim_existing(), run.read_file())[1])
        try:
            settled = ranks.first(
                lambda: plan_resume(
                    run.root,
                    file,
                    changes or {},
                    ranks.world,
                    override,
                    newest=run.newest_step(),
                    logged=run.logged_step(),
                    summarized=(run.root / "summary.json").is_file(),
                )
            )
            done = _finished(run, settled)
            if done is not None:
                return done if ranks.main else None
            return _resume(run, ranks, device, settled, file, override, progress)
        finally:
            run.release()


def _resume(
    run: RunFolder,
    ranks: Ranks,
    device: torch.device,
    settled: Resumption,
    file: RunFile,
    override: bool,
    progress: bool,
) -> dict | None:
    found = check_inputs(run.root, settled.cfg, file.inputs, override)  # a moved input said first
    cfg = settled.cfg.checked()  # settled already, unless the run had ended (nothing was left to check)
    entry = {"resumed": _now(), **settled.entry()}
    if found.moved:
        entry["moved"] = found.moved
    if found.changed:
        entry["inputs_changed"] = found.changed
        entry["override"] = True
    first = cfg.training.save_every
    if ranks.main:
        for line in [*found.notes, *settled.said(run.root)]:
            print(f"narrows: {line}", file=sys.stderr, flush=True)
        if run.newest_step() == 0:
            print(
                f"narrows: {run.root} has no checkpoint"
                + (" left" if settled.restart else f" yet (the first is written at step {first})")
                + ": the run starts from step 0",
                file=sys.stderr,
                flush=True,
            )
    return _run(
        cfg,
        run,
        ranks,
        device,
        resuming=True,
        entry=entry,
        progress=progress,
        history=file.history,
        inputs=found.inputs,
    )


def _finished(run: RunFolder, settled: Resumption) -> dict | None:
    """The summary of a run that already ended, said at once (nothing loaded), when
    ``--resume`` changes nothing: None where there is something left to do."""
    summary_path = run.root / "summary.json"
    steps = settled.cfg.training.steps
    if settled.changes.all or not summary_path.is_file() or run.newest_step() < steps:
        return None
    if _damage(run.saved_steps()[0]) is not None:  # the resumed run sets it aside and trains again
        return None
    try:
        summary = json.loads(summary_path.read_text())
    except (OSError, ValueError):
        return None  # damaged: the resumed run writes it again
    say(
        f"{run.root} finished at step {steps}; nothing to resume. To train further, extend it: "
        f"narrows finetune --resume {run.root} --steps {2 * steps}"
    )
    return summary


def _open_reporters(cfg: FinetuneConfig, run: RunFolder, step: int) -> list:
    """The run's reporters, opened before its config.json is written; where one fails, what
    the others wrote into the run folder is removed, so the same command can run again."""
    before = set(run.root.iterdir())
    try:
        return open_reporters(cfg.settings(), run.root, step)
    except BaseException:
        for path in set(run.root.iterdir()) - before:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        raise


def _steps(n: int) -> str:
    return "step" if n == 1 else f"{n} steps"


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


def _run(
    cfg: FinetuneConfig,
    run: RunFolder,
    ranks: Ranks,
    device: torch.device,
    *,
    resuming: bool,
    entry: dict,
    progress: bool,
    history: list[dict] | None = None,
    inputs: dict | None = None,
) -> dict | None:
    """`inputs`: what a resumed run found (`check_inputs`); a new run records its own."""
    from ... import __version__

    gone = run.clean_leftovers() if ranks.main else []
    if gone:
        print(
            f"narrows: removed what an interrupted run left in {run.root}: {', '.join(gone)}", file=sys.stderr
        )
    if cfg.training.deterministic:  # before the first GPU kernel, so cuBLAS starts with its fixed workspace
        from ...protocol.determinism import deterministic

        deterministic()
    dtype = run_dtype(cfg, device)
    t_setup = time.perf_counter()

    def stage(message: str) -> None:  # a line before each stage that may take a while
        if ranks.main:
            say(message)

    if inputs is None:  # the model and data by content, before either is read
        inputs = record_inputs(cfg, loud=ranks.main)
    stage(
        "model: checking its files (the embedded default: its GGUF converted to a float folder once, "
        "cached under $NARROWS_CACHE/gguf)"
        if cfg.base.model is None
        else f"model {cfg.base.model}: checking its files"
    )
    folder = check_model_files(cfg)  # headers, before any weight
    piped = cfg.training.pipeline_stages > 1
    # the adapters alone, on the model's skeleton (pipeline stages: no DDP buckets)
    check_budget_before_loading(cfg, folder, 1 if piped else ranks.world)
    stage("loading the tokenizer")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
    stage("reading and tokenising the data (cached under $NARROWS_CACHE/data after the first run)")
    train_set, evals, em_rows, said = load_data(cfg, tokenizer)  # every row, before the model
    if piped and em_rows:
        said.append(
            "--pipeline-stages: the exact-match answers are not generated (each rank holds a block of the "
            "layers); score the saved adapter with narrows eval"
        )
        em_rows = []
    if ranks.main:
        for line in said:
            print(f"narrows: {line}", file=sys.stderr, flush=True)
    if ranks.world > 1:
        ranks.agree(
            narrows=__version__, config=cfg.settings(), data=train_set.digest()
        )  # the tokenised (or packed) data
    stage(
        f"loading the model on {device} ({str(dtype).removeprefix('torch.')}"
        + (", streamed within --gpu-budget" if cfg.memory.gpu_budget != "off" else "")
        + ")"
    )
    loaded = load_model(cfg, folder, dtype, device)
    stage(f"building the {cfg.lora.adapter} adapter (rank {cfg.lora.rank}, {cfg.lora.targets})")
    model = build_model(cfg, loaded, device, dtype, ranks.world)
    stages = Stages(model, cfg, ranks, device) if piped else None  # this rank's block, streamed
    if ranks.main and stages:
        print(
            f"narrows: pipeline stages: {ranks.world} blocks of layers, one a rank, {cfg.training.grad_accum} "
            "micro-batches a step in flight (1F1B); the last stage computes the loss",
            file=sys.stderr,
            flush=True,
        )
    if ranks.main:
        print(f"narrows: adapted: {state_of(model).targets}", file=sys.stderr, flush=True)
        held = precision(model)
        if held.linears or held.expert_stacks:
            print(f"narrows: base precision: {held}", file=sys.stderr, flush=True)
    step_mode, accumulation = choose_accumulation(cfg, model)
    if ranks.main and accumulation:
        print(f"narrows: accumulation: {accumulation}", file=sys.stderr, flush=True)
    # the attention this model runs keeps packed examples apart, or the run stops here
    if cfg.dataset.packing:
        check_packing(model, device, len(tokenizer))
    # several ranks: gradients summed over them (pipeline stages: each its own adapters)
    net = model if piped else data_parallel(model, ranks, device)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=cfg.training.lr, weight_decay=0.0
    )
    scheduler = schedule(optimizer, cfg)

    step, rows = 0, []
    if resuming:
        # at most the newest step, checked in resume(); a stage takes its share
        step = run.restore(model, optimizer, scheduler, local=stages.local_state if stages else None)
        follow_schedule(optimizer, scheduler, cfg)  # the rates of these settings, not the checkpoint's
        rows = run.trim_metrics(step)
    # the settings this start runs with: a later hand edit of config.json is told apart from them
    entry.update(step=step, narrows=__version__, argv=sys.argv[1:], config=cfg.settings())
    if ranks.main:
        run.reporters = _open_reporters(cfg, run, step)  # --report-to; a refusal leaves the folder as it was
        run.write_config(cfg, [*(history or []), entry], inputs)
    setup_s = time.perf_counter() - t_setup

    state = Progress(step=step, history=rows)
    # (pipeline stages: every rank, each running its block)
    if (ranks.main or stages) and evals and not any(r.get("step") == 0 and "eval_loss" in r for r in rows):
        stage(
            f"held-out loss before training ({len(evals)} rows; again every {_steps(cfg.eval_interval)} and at the end)"
        )
        held = (
            stages.eval_row(evals, cfg.training.batch, pad_id, show=progress if ranks.main else None)
            if stages
            else eval_row(model, evals, cfg.training.batch, pad_id, device, show=progress)
        )
        if ranks.main:
            run.log({"step": 0, **held})
            state.history.append({"step": 0, **held})
    bar = None
    if progress and ranks.main:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.training.steps, initial=step, desc="finetune", unit="step", dynamic_ncols=True)
    with settled_heap():
        train(
            cfg,
            run,
            model,
            optimizer,
            scheduler,
            train_set,
            evals,
            pad_id,
            device,
            state,
            bar,
            ranks,
            net,
            step_mode=step_mode,
            stages=stages,
        )
    # the stages' facts and the whole adapter, gathered to rank 0 (collectives: every rank)
    staged = stages.facts() if stages else None
    whole = stages.whole_state(None) if stages else None
    if not ranks.main:
        return None

    summary = summarize(
        cfg,
        model,
        tokenizer,
        state.history,
        em_rows,
        device,
        dtype,
        state.tokens,
        setup_s,
        state.seconds,
        show=progress,
    )
    summary["eval_rows"] = len(evals)  # what was evaluated: --eval-rows, or fewer held-out rows
    if staged:  # each stage's share; the summary's trainable counts are the whole model's
        summary["pipeline_stages"] = staged
        if staged[-1]["loss_kernels"]:  # the last stage computed the loss
            summary["loss_kernels"] = staged[-1]["loss_kernels"]
        summary["trainable"] = {
            "parameters": sum(s["trainable"] for s in staged),
            "in_routed_experts": sum(s["in_routed_experts"] for s in staged),
        }
    say("saving the adapter, summary.json and loss.png")
    if accumulation and "stream" in summary:
        summary["stream"]["accumulation"] = accumulation
    base = run_base(cfg)
    summary.update(
        adapter_step=state.step, base_model=base.name, base_origin=base.origin
    )  # read by state.run_state
    tensors = whole[0] if whole else None
    run.guard(run.root / "adapter_model.safetensors", lambda: save_adapter(model, run.root, base, tensors))
    summary["loss_png"] = plot_losses(state.history, run.root / "loss.png")
    run.report(summary_row(summary, cfg.training.steps))
    text = json.dumps(summary, indent=2)
    run.guard(
        run.root / "summary.json",
        lambda: atomic_write(run.root / "summary.json", lambda p: p.write_text(text)),
    )
    return summary
