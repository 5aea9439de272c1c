"""The job's pipeline stages (``--pipeline-stages N``, launched by torchrun with N ranks):
each rank keeps one contiguous block of the model's decoder layers and streams it under
``--gpu-budget`` (narrows-stream's `pipeline_stage`); torch's 1F1B schedule runs a step's
``--grad-accum`` micro-batches through the stages, the packed rows' positions given to every
stage beside the hidden states. Each micro-batch's loss is the one a single process computes
(the sum over its tokens divided by the step's trainable tokens), so the adapters equal one
process accumulating the same micro-batches. The held-out loss runs forward only through
the stages, each sending a batch's hidden states to the next.

Checkpoints and the saved adapter hold the whole model's tensors, gathered to rank 0: the
files one process writes (the optimizer state in the whole model's parameter order). A
resumed stage takes its own share of them, so a run may resume on another number of stages,
or in one process.

why: docs/design.md#pipeline-stages
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from ...errors import NarrowsError
from ...protocol.anatomy import anatomy_of
from ...protocol.handle import state_of
from ..data import Example, collate
from .config import FinetuneConfig
from .evaluate import eval_row, to_device
from .ranks import Ranks

__all__ = ["Stages", "merge_optimizer_states", "slice_optimizer_state"]


class Stages:
    """This rank's stage of the run's model and the schedule that runs it."""

    def __init__(self, model: nn.Module, cfg: FinetuneConfig, ranks: Ranks, device: torch.device):
        from torch.distributed.pipelining import Schedule1F1B

        import narrows.stream

        from .build import stream_config

        self.model, self.ranks, self.device = model, ranks, device
        self.micro = cfg.training.grad_accum
        self.width = cfg.dataset.seq_len
        # the stage's plan: one micro-batch of --batch rows at a time, the schedule's in flight priced
        streaming = stream_config(cfg, device).replace(grad_accum=1, step_mode=False)
        self.stage = narrows.stream.pipeline_stage(
            model, streaming, micro_batches=self.micro, schedule="1f1b"
        )
        self.loss = narrows.stream.pipeline_loss(model)
        self.schedule = Schedule1F1B(self.stage, self.micro, loss_fn=self.loss, scale_grads=False)
        self._quiet = (
            {"return_outputs": False}
            if "return_outputs" in inspect.signature(self.schedule.step).parameters
            else {}
        )
        anat = anatomy_of(model)
        self.hidden, self.dtype = anat.config.hidden_size, anat.embed.weight.dtype  # what crosses
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        layers = [f"{path}." for path in anat.layer_paths]
        outside = [n for n in self.names if not any(path in n for path in layers)]
        if outside:  # every stage would hold one, one trained: not the whole model's order either
            raise NarrowsError(
                f"--pipeline-stages trains adapters inside the decoder layers; this run also trains "
                f"{outside[:3]}: leave them out of --targets"
            )
        # the stages' objects (counts, checkpoints' tensors) gather through host memory, not the GPUs
        self.host_group = torch.distributed.new_group(backend="gloo")
        counts: list[Any] = [None] * ranks.world
        torch.distributed.all_gather_object(counts, len(self.names), group=self.host_group)
        self.offset = sum(counts[: ranks.rank])  # this stage's first parameter in the whole model's order
        if cfg.base.kernels == "fast":  # what the run's summary says of them
            state_of(model).kernels = model.narrows_stream.kernels

    def step(self, micro: list[list[Example]], pad_id: int, n_items: int) -> float:
        """One step's forward and backward over its micro-batches; the sum of their losses
        (on the last stage; 0 on the others)."""
        batches = [to_device(collate(mb, pad_id, self.width), self.device) for mb in micro]
        ids, positions, labels = (
            torch.cat([b[key] for b in batches]) for key in ("input_ids", "position_ids", "labels")
        )
        self.loss.num_items_in_batch = n_items
        got: list = []
        first, last = self.stage.is_first, self.stage.is_last
        self.schedule.step(
            *((ids,) if first else ()),
            target=labels if last else None,
            losses=got if last else None,
            labels=labels,  # the last stage's loss (the others drop them)
            position_ids=positions,
            **self._quiet,
        )
        return sum(float(x) for x in got)  # in micro-batch order, as one process adds them

    def eval_row(self, examples: list[Example], batch: int, pad_id: int, show: bool | None = None) -> dict:
        """The held-out loss through the stages, forward only, batch after batch (the
        schedule trains; this sends each batch's hidden states on with point-to-point
        sends): `evaluate.eval_row`'s row on every rank, the loss the last stage computes,
        the largest rank's peak. A collective: every stage calls it."""
        module = self.stage.submod
        kept, module.loss_kwargs = module.loss_kwargs, {}  # the mean of each batch, as one process
        try:
            row = eval_row(self.model, examples, batch, pad_id, self.device, show, forward=self._forward)
        finally:
            module.loss_kwargs = kept
        row["eval_loss"] = self.ranks.total(row["eval_loss"], self.device)  # the last stage's; 0 elsewhere
        if "eval_peak_bytes" in row:
            row["eval_peak_bytes"] = int(self.ranks.total(row["eval_peak_bytes"], self.device, op="max"))
        return row

    def _forward(self, batch: dict) -> torch.Tensor | None:
        """One batch through this stage: received from the stage before, sent to the one
        after; the loss on the last stage."""
        import torch.distributed as dist

        module, index = self.stage.submod, self.stage.stage_index
        side = {"attention_mask": batch["attention_mask"]}
        if self.stage.is_first:
            x = batch["input_ids"]
        else:
            x = torch.empty((*batch["input_ids"].shape, self.hidden), dtype=self.dtype, device=self.device)
            dist.recv(x, src=index - 1)
        if self.stage.is_last:
            return module(x, labels=batch["labels"], **side)
        dist.send(module(x, **side).contiguous(), dst=index + 1)
        return None

    def whole_state(self, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict | None] | None:
        """The whole model's adapter as PEFT saves one (each stage's
        ``get_peft_model_state_dict``, its layers numbered as in the whole model) and (given
        `optimizer`) its optimizer state in the whole model's parameter order, gathered to
        rank 0 (None on the other ranks). A collective: every stage calls it."""
        import torch.distributed as dist
        from peft import get_peft_model_state_dict

        import narrows.stream

        saved = get_peft_model_state_dict(self.model, save_embedding_layers=False)  # as save_adapter saves
        adapter = {k: v.detach().cpu() for k, v in saved.items()}
        mine = narrows.stream.whole_names(self.model, adapter)
        opt = None if optimizer is None else _to_cpu(optimizer.state_dict())
        parts: list[Any] = [None] * self.ranks.world if self.ranks.main else None
        dist.gather_object((mine, opt), parts, dst=0, group=self.host_group)
        if not self.ranks.main:
            return None
        tensors = {k: v for adapter, _ in parts for k, v in adapter.items()}
        return tensors, None if optimizer is None else merge_optimizer_states([o for _, o in parts])

    def local_state(self, state: dict) -> dict:
        """A checkpoint's state (the whole model's) as this stage restores it: its adapter
        tensors renumbered, its share of the optimizer state."""
        from peft import get_peft_model_state_dict

        import narrows.stream

        adapter = narrows.stream.stage_names(self.model, state["adapter"])
        missing = set(get_peft_model_state_dict(self.model, save_embedding_layers=False)) ^ set(adapter)
        if missing:
            raise NarrowsError(
                f"the checkpoint's adapter does not match this stage's ({sorted(missing)[:3]} in one, not the other)"
            )
        return {
            **state,
            "adapter": adapter,
            "optimizer": slice_optimizer_state(state["optimizer"], self.offset, len(self.names)),
        }

    def facts(self) -> list[dict] | None:
        """Each stage's layers, trainable parameters and plan, on rank 0 (a collective)."""
        import torch.distributed as dist

        plan = self.model.narrows_stream.plan
        numel = dict(self.model.named_parameters())
        mine = {
            "layers": len(plan.layer_bytes),
            "trainable": sum(numel[n].numel() for n in self.names),
            "in_routed_experts": sum(numel[n].numel() for n in self.names if ".experts." in n),
            "resident_layers": len(plan.resident),
            "predicted_peak": plan.predicted_peak,
            "micro_batches_in_flight": self.model.narrows_stream.config.in_flight,
            "loss_kernels": sorted(getattr(state_of(self.model).lmhead, "kernels", None) or ()),
        }
        every: list[Any] = [None] * self.ranks.world if self.ranks.main else None
        dist.gather_object(mine, every, dst=0, group=self.host_group)
        return every


def merge_optimizer_states(parts: list[dict]) -> dict:
    """The stages' optimizer states (one parameter group each, the job's AdamW) as one
    optimizer over all their parameters, in stage order: what one process's optimizer over
    the whole model holds."""
    first = parts[0]["param_groups"]
    if any(len(p["param_groups"]) != 1 for p in parts):
        raise NarrowsError("pipeline checkpoints merge one parameter group a stage (the job's AdamW)")
    state, offset = {}, 0
    for part in parts:
        for index, values in part["state"].items():
            state[index + offset] = values
        offset += len(part["param_groups"][0]["params"])
    return {"state": state, "param_groups": [{**first[0], "params": list(range(offset))}]}


def slice_optimizer_state(whole: dict, offset: int, count: int) -> dict:
    """Parameters [offset, offset + count) of a one-group optimizer state, numbered from 0."""
    (group,) = whole["param_groups"]
    if offset + count > len(group["params"]):
        raise NarrowsError(
            f"the checkpoint's optimizer holds {len(group['params'])} parameters; this stage's are "
            f"{offset}..{offset + count - 1}"
        )
    state = {i - offset: v for i, v in whole["state"].items() if offset <= i < offset + count}
    return {"state": state, "param_groups": [{**group, "params": list(range(count))}]}


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj
