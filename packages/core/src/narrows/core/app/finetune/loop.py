"""The training loop a transformers + PEFT user writes: AdamW steps of `grad_accum`
micro-batches, the loss normalised over the whole step's trainable tokens, a metrics row
per step (timed after the device has finished the step's work) and a checkpoint every
``save_every`` steps. The data order, and the generators' seed at the start of each
micro-batch, depend only on (seed, micro-batch index), so a resumed run continues
bit-identically and any rank can run any micro-batch (`ranks`). In step mode (asked for,
or narrows-stream's choice: `build.choose_accumulation`) its StepTrainer runs the same
step block-major (the same numbers, each streamed layer loaded once per pass)."""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from ...errors import Interrupted
from ...memory import format_bytes
from ..data import TRAINING, Example, collate, micro_batches
from .config import FinetuneConfig
from .evaluate import eval_row, measured_peak, reset_step_peaks, say, to_device
from .ranks import Ranks, micro_seed
from .run_folder import RunFolder
from .stages import Stages

__all__ = ["Progress", "follow_schedule", "schedule", "train"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def schedule(optimizer: torch.optim.Optimizer, cfg: FinetuneConfig):
    """The learning rate of every step: linear warmup to the peak ``--lr``, then cosine decay
    to 0 at ``--steps`` (transformers' ``get_cosine_schedule_with_warmup``)."""
    from transformers import get_cosine_schedule_with_warmup

    return get_cosine_schedule_with_warmup(optimizer, cfg.warmup_steps, cfg.training.steps)


def follow_schedule(optimizer: torch.optim.Optimizer, scheduler, cfg: FinetuneConfig) -> None:
    """After a checkpoint's optimizer and scheduler state are loaded, set the rates this
    run's settings give at the restored step. The loaded state carries the rates of the
    settings the checkpoint trained with (the scheduler's peak, each group's current and
    initial rate); the schedule's shape (warmup, steps) is the new scheduler's own. With
    the same settings this recomputes the loaded numbers bit for bit (the scheduler's own
    expression); with a changed ``--lr``, ``--warmup`` or ``--steps`` the next step runs
    at the new schedule's rate."""
    for group in optimizer.param_groups:
        group["initial_lr"] = cfg.training.lr
    scheduler.base_lrs = [cfg.training.lr for _ in optimizer.param_groups]
    rates = [
        base * rate(scheduler.last_epoch) for rate, base in zip(scheduler.lr_lambdas, scheduler.base_lrs)
    ]
    for group, lr in zip(optimizer.param_groups, rates):
        group["lr"] = lr
    scheduler._last_lr = rates


@dataclass
class Progress:
    step: int
    history: list[dict]
    tokens: int = 0
    seconds: float = 0.0


@contextmanager
def settled_heap() -> Iterator[None]:
    """The objects loading made (the model's modules and tensors, configs, the data: about
    600,000 for a tiny model's run) kept out of the cyclic garbage collector's walks while
    the steps run, and handed back after. Each full collection walks every tracked object:
    on two CPU cores a pause of 0.75 s in the middle of a run, and a step's own objects
    collected young cost more when the old ones are walked too. Garbage is collected
    first, so nothing unreachable is kept."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def train(
    cfg: FinetuneConfig,
    run: RunFolder,
    model: nn.Module,
    optimizer,
    scheduler,
    train_set: list[Example],
    evals: list[Example],
    pad_id: int,
    device: torch.device,
    progress: Progress,
    bar,
    ranks: Ranks | None = None,
    net: nn.Module | None = None,
    step_mode: bool = False,
    stages: Stages | None = None,
) -> None:
    """Train from `progress.step` to ``--steps``, logging and checkpointing as it goes
    (rank 0 only, on several ranks). `net`: what the forward runs through (the
    data-parallel model; default `model`). `step_mode`: block-major accumulation
    (`build.choose_accumulation`). `stages`: this rank's pipeline stage, which runs every
    micro-batch of a step with the other stages (checkpoints gathered from all)."""
    t = cfg.training
    model.train()
    ranks = ranks or Ranks()
    net = net or model
    g = t.grad_accum
    per_step = g * t.data_ranks  # micro-batches of one optimizer step, all ranks together
    batches = micro_batches(train_set, t.batch, t.seed, start=progress.step * per_step)
    width = cfg.dataset.seq_len if cfg.dataset.packing else None  # packed batches: one width, every step
    stepper = None
    if step_mode:
        import narrows.stream

        try:  # the loss is already normalised over the step's tokens (num_items_in_batch)
            stepper = narrows.stream.StepTrainer(
                model, optimizer, grad_accum=t.grad_accum, scheduler=scheduler, scale_loss=False
            )  # host state and held weights: the plan's
        except narrows.stream.StreamSetupError as e:
            stepper = _sequential_instead(cfg, model, e)
        else:
            if ranks.main:
                hosted = (
                    "; adapters and optimizer state in host memory between uses" if stepper.adapters else ""
                )
                print(
                    f"narrows: step mode: held 4-bit weights {stepper.held_choice}{hosted}",
                    file=sys.stderr,
                    flush=True,
                )
    if ranks.main and progress.step < t.steps:
        first = (
            f"step {progress.step + 1} of {t.steps}: the first step takes longer (memory allocated, "
            "kernels chosen and cached)"
        )
        if bar is not None:  # above the bar, which stays the last line
            bar.write(f"narrows: {first}", file=sys.stderr)
        else:
            say(first)
    t_train = time.perf_counter()
    try:
        while progress.step < t.steps:
            reset_step_peaks(model, device)
            _sync(device)
            t0 = time.perf_counter()
            place = ranks.rank // t.pipeline_stages  # among the data-parallel ranks
            first = progress.step * per_step + place * g  # this rank's first micro-batch
            every = [next(batches) for _ in range(per_step)]
            micro = every[place * g : (place + 1) * g]
            seeds = [micro_seed(t.seed, first + k) for k in range(g)]
            # the loss is normalised over the whole step's trainable tokens, every rank's
            n_items = sum(e.trainable for mb in every for e in mb)
            loss_sum = 0.0
            losses = []  # the micro-batches' losses, read after the step's sync (a read mid-step stalls the host)
            stats = None
            if stepper is not None:
                try:
                    stats = stepper.step(
                        [
                            {
                                **to_device(collate(mb, pad_id, width), device),
                                **TRAINING,
                                "num_items_in_batch": n_items,
                            }
                            for mb in micro
                        ],
                        seeds=seeds,
                    )
                except narrows.stream.StreamSetupError as e:
                    stepper = _sequential_instead(cfg, model, e)  # refused before any gradient: in sequence
            if stats is not None:
                for value in stats.losses:
                    loss_sum += value
            elif stages is not None:
                loss_sum = stages.step(micro, pad_id, n_items)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            else:
                for k, mb in enumerate(micro):
                    torch.manual_seed(seeds[k])
                    # several ranks: one all-reduce per step, after the last micro-batch
                    with net.no_sync() if ranks.world > 1 and k < g - 1 else nullcontext():
                        out = net(
                            **to_device(collate(mb, pad_id, width), device),
                            **TRAINING,
                            num_items_in_batch=n_items,
                        )
                        out.loss.backward()
                    losses.append(out.loss.detach())
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            _sync(device)  # the step's asynchronous work counts in this step's time
            for value in losses:
                loss_sum += float(value)
            dt = time.perf_counter() - t0
            progress.step += 1
            step = progress.step
            tokens = sum(len(e.input_ids) for mb in every for e in mb)
            progress.tokens += tokens
            peak = measured_peak(model, device)
            loss_sum = ranks.total(loss_sum, device)  # the step's loss over every rank's micro-batches
            peak = int(ranks.total(peak, device, op="max"))  # the largest rank's
            saving = step % t.save_every == 0 or step == t.steps
            whole = stages.whole_state(optimizer) if stages is not None and saving else None
            evaluating = bool(evals) and (step == t.steps or step % cfg.eval_interval == 0)
            held = None  # pipeline stages: every rank runs its block of the held-out loss
            if stages is not None and evaluating:
                held = stages.eval_row(evals, t.batch, pad_id, show=(bar is not None) if ranks.main else None)
            if not ranks.main:  # rank 0 writes the run folder
                continue
            row = {
                "step": step,
                "loss": loss_sum,
                "lr": scheduler.get_last_lr()[0],
                "tokens_per_s": tokens / dt,
                "step_s": dt,
                "peak_bytes": peak,
            }
            if stats is not None:
                row["accumulation"] = stats.mode  # block-major, or sequential and why
            if evaluating:
                row.update(held or eval_row(model, evals, t.batch, pad_id, device, show=bar is not None))
            run.log(row)  # before the checkpoint: a resume drops rows past its checkpoint
            progress.history.append(row)
            if saving:
                run.save_checkpoint(step, model, optimizer, scheduler, whole=whole)
            if bar is not None:
                bar.set_postfix(loss=f"{loss_sum:.4f}", tok_s=f"{tokens / dt:.0f}", peak=format_bytes(peak))
                bar.update(1)
            else:
                held = f" eval loss {row['eval_loss']:.4f}" if "eval_loss" in row else ""
                print(
                    f"step {step}/{t.steps} loss {loss_sum:.4f}{held} tok/s {tokens / dt:.0f} peak {format_bytes(peak)}",
                    flush=True,
                )
    except KeyboardInterrupt:
        if bar is not None:
            bar.close()
        last = run.saved_steps()
        raise Interrupted(
            f"interrupted at step {progress.step}; the last checkpoint ({last[0].name if last else 'none yet'}) "
            f"is intact: continue with: narrows finetune --resume {run.root}"
        ) from None
    finally:
        progress.seconds += time.perf_counter() - t_train
    if bar is not None:
        bar.close()


def _sequential_instead(cfg: FinetuneConfig, model: nn.Module, refusal: Exception) -> None:
    """Step mode refused this model. Asked for, the refusal stands; chosen by the
    prediction, the run goes on in sequence (the same numbers) and says why. Returns the
    stepper to use: none."""
    if cfg.memory.step_mode is not None or any(p.grad is not None for p in model.parameters()):
        raise refusal
    print(
        f"narrows: accumulation: sequential, step mode refused this model ({refusal})",
        file=sys.stderr,
        flush=True,
    )
    return None
