"""One rank of the pipeline parity test, launched by torchrun (`test_pipeline.py`): a tiny
model's decoder layers split into one contiguous block a rank, each block streamed at the
smallest budget, run by torch's GPipe or 1F1B schedule (``gpipe`` / ``1f1b``) over MICRO
micro-batches a step (the model built here, or loaded from a checkpoint folder by
`from_pretrained` into one host copy the ranks share); or, with
``reference``, the one process the stages must equal: the whole model resident,
accumulating the same micro-batches. With device ``cuda`` (`test_pipeline_gpu.py`) each
rank takes its local rank's GPU and NCCL, deterministic kernels; the reference one GPU.
Each writes its trainable parameters' gradients and final weights, by their
names in the whole model."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from helpers import build

import narrows.stream as ns
from narrows.core.testing import tiny_batch

STEPS, LAYERS, MICRO = 2, 4, 4


def batches(step: int) -> list[dict]:
    """A step's micro-batches: every row one whole sequence (a stage passes no mask on)."""
    out = []
    for m in range(MICRO):
        b = tiny_batch(seed=10 * step + m, pad_last=0)
        out.append({"input_ids": b["input_ids"], "labels": b["labels"]})
    return out


def named_trainable(model) -> dict[int, str]:
    """Each trainable parameter's name in the whole model, by identity (a stage renumbers
    its layers)."""
    return {id(p): n for n, p in model.named_parameters() if p.requires_grad}


def record(names, params, opt, grads) -> dict:
    return {
        "grad": [{names[id(p)]: g for p, g in zip(params, step)} for step in grads],
        "weight": {names[id(p)]: p.detach().clone() for p in params},
    }


def _device(device: str) -> torch.device:
    """Each process's device: on CUDA its local rank's GPU, deterministic kernels set first."""
    if device != "cuda":
        torch.set_num_threads(1)
        return torch.device("cpu")
    from narrows.core.protocol.determinism import deterministic

    deterministic()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(dev)
    return dev


def model(folder: str | None, **load) -> torch.nn.Module:
    """The tiny model with LoRA: built here, or loaded from `folder` by `from_pretrained`
    into host tiers (`load`: its cache and sharing), the adapters seeded."""
    if folder is None:
        return build(num_hidden_layers=LAYERS)
    from peft import LoraConfig, get_peft_model

    m = ns.from_pretrained(folder, dtype=torch.float32, host_budget="1TiB", **load)
    torch.manual_seed(0)
    return get_peft_model(m, LoraConfig(r=4, target_modules="all-linear")).train()


def reference(out: str, device: str, folder: str | None) -> None:
    dev = _device(device)
    m = model(folder, cache=False, share=False)
    names = named_trainable(m)
    ns.stream(m, None, device=dev)
    params = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    grads = []
    for step in range(STEPS):
        for b in batches(step):
            (m(**{k: v.to(dev) for k, v in b.items()}).loss * (1 / MICRO)).backward()
        grads.append([p.grad.clone() for p in params])
        opt.step()
        opt.zero_grad()
    torch.save(record(names, params, opt, grads), f"{out}.reference.pt")
    m.save_pretrained(f"{out}.reference.adapter")


def stage(out: str, kind: str, device: str, folder: str | None) -> None:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    dev = _device(device)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    rank = dist.get_rank()
    m = model(folder, cache=f"{out}.cache")  # the ranks share one host copy of the folder
    names = named_trainable(m)
    # every layer of the stage streamed; the plan prices the schedule's micro-batches in flight
    stage = ns.pipeline_stage(m, "min", device=dev, micro_batches=MICRO, schedule=kind)
    plan = m.narrows_stream.plan
    params = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    schedules = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    schedule = schedules[kind](stage, MICRO, loss_fn=ns.pipeline_loss(m, 1 / MICRO), scale_grads=False)
    grads = []
    for step in range(STEPS):
        bs = batches(step)
        ids = torch.cat([b["input_ids"] for b in bs]).to(dev)
        labels = torch.cat([b["labels"] for b in bs]).to(dev)
        if rank == 0:
            schedule.step(ids, return_outputs=False)
        else:  # the last stage computes the loss of the labels (target=: what torch's schedule asks)
            schedule.step(target=labels, labels=labels, return_outputs=False)
        grads.append([p.grad.clone() for p in params])
        opt.step()
        opt.zero_grad()
    layers = {int(names[id(p)].split(".layers.")[1].split(".")[0]) for p in params}
    result = record(names, params, opt, grads) | {
        "layers": sorted(layers),
        "planned": len(plan.layer_bytes),
        "head_streamed": plan.head_h2d_bytes > 0,
        "resident": len(plan.resident),
        "shared": list(m.narrows.tiers.shared) if m.narrows.tiers is not None else [],
    }
    torch.save(result, f"{out}.{kind}.stage{rank}.pt")
    ns.save_pipeline_adapter(m, f"{out}.{kind}.adapter")  # every stage's, by rank 0
    del schedule, stage  # their communication state goes before the process group
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    # MODE OUT [DEVICE [FOLDER]]: MODE reference, gpipe or 1f1b; FOLDER: load it with from_pretrained
    device = sys.argv[3] if len(sys.argv) > 3 else "cpu"
    folder = sys.argv[4] if len(sys.argv) > 4 else None
    if sys.argv[1] == "reference":
        reference(sys.argv[2], device, folder)
    else:
        stage(sys.argv[2], sys.argv[1], device, folder)
