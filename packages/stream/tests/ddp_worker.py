"""One rank of the data-parallel parity test, launched by torchrun (`test_distributed.py`):
a streamed tiny model wrapped in DDP over gloo, each rank one micro-batch of the global
batch, dropout seeded per (step, micro-batch) — the loop `sequential` runs in one process.
Then the shared host copy: both ranks load one checkpoint folder with `from_pretrained`
(sharing by default under torchrun) and report where their slabs live."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from narrows.core.testing import mapped_file, mapping_memory, tiny_batch

sys.path.insert(0, os.path.dirname(__file__))
from helpers import build

import narrows.stream as ns

STEPS, LAYERS, DROPOUT = 2, 3, 0.1


def model():
    return build(num_hidden_layers=LAYERS, dropout=DROPOUT)


def micro_step(forward, step: int, micro: int, scale: float) -> torch.Tensor:
    """One micro-batch: its own data and its own dropout seed, so any process can run it."""
    torch.manual_seed(1000 + 100 * step + micro)
    loss = forward(**tiny_batch(seed=10 * step + micro)).loss
    (loss * scale).backward()
    return loss.detach().clone()


def record(params, opt, losses, grads) -> dict:
    return {"loss": losses, "grad": grads, "weight": [p.detach().clone() for p in params],
            "adam": [v.clone() for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]}  # fmt: skip


def sequential(m, world: int) -> dict:
    """The reference: one process, gradient accumulation over `world` micro-batches."""
    params = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    losses, grads = [], []
    for step in range(STEPS):
        losses += [micro_step(m, step, micro, 1 / world) for micro in range(world)]
        grads += [p.grad.clone() for p in params]
        opt.step()
        opt.zero_grad()
    return record(params, opt, losses, grads)


def train_rank(mode: str, rank: int, world: int) -> dict:
    m = model()
    ns.stream(m, None, device="cpu")
    # "ddp": narrows' wrapper; "plain": torch's own DDP, as accelerate and Trainer build it;
    # "local": the same loop with no gradient all-reduce (the fault twin)
    forward = {"ddp": ns.data_parallel, "plain": DistributedDataParallel}.get(mode, lambda m: m)(m)
    if mode != "local":  # the frozen base is outside DDP: nothing of it broadcast, bucketed or all-reduced
        frozen = {n for n, p in m.named_parameters() if not p.requires_grad}
        assert frozen and forward.parameters_to_ignore == frozen | {n for n, _ in m.named_buffers()}
        assert all(p.requires_grad for p in forward._module_parameters)
    params = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    losses, grads = [], []
    for step in range(STEPS):
        # DDP averages the ranks' gradients; a micro-batch's loss is not scaled here
        losses.append(micro_step(forward, step, rank, 1 / world if mode == "local" else 1.0))
        grads += [p.grad.clone() for p in params]
        opt.step()
        opt.zero_grad()
    return record(params, opt, losses, grads)


def shared_copy(folder: str, cache: str, world: int) -> dict:
    """Both ranks load `folder` (sharing, by default under torchrun), then train two DDP
    steps on it, each rank one seeded micro-batch."""
    from peft import LoraConfig, get_peft_model

    m = ns.from_pretrained(folder, dtype=torch.float32, cache=cache, host_budget="1TiB")
    tiers = m.narrows_tiers
    homes = sorted({mapped_file(h.data_ptr()) for h in tiers.homes})
    embedding = mapped_file(m.get_input_embeddings().weight.data_ptr())
    dist.barrier()  # both ranks hold their maps
    memory = mapping_memory(str(tiers.cache.path))
    dist.barrier()
    torch.manual_seed(0)  # the adapters' initialisation
    m = get_peft_model(m, LoraConfig(r=4, target_modules="all-linear", lora_dropout=DROPOUT))
    ns.stream(m, None, device="cpu")
    ddp = ns.data_parallel(m)
    params = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    for step in range(STEPS):
        micro_step(ddp, step, dist.get_rank(), 1.0)
        opt.step()
        opt.zero_grad()
    return {"shared": tiers.shared, "layers": len(tiers.homes), "homes": homes, "cache": str(tiers.cache.path),
            "slab_bytes": sum(lay.nbytes for lay in tiers.layouts), "memory": memory, "notes": tiers.notes,
            "embedding": embedding,
            "weight": [p.detach().clone() for p in params]}  # fmt: skip


def main(out: str, folder: str, cache: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for mode in ("ddp", "plain", "local"):
        torch.save(train_rank(mode, rank, world), f"{out}.{mode}.rank{rank}.pt")
    # a rank that diverges: rank 1 was given another model
    m = build(num_hidden_layers=LAYERS + rank, dropout=DROPOUT)
    ns.stream(m, None, device="cpu")
    try:
        ns.data_parallel(m)
        said = "not refused"
    except ns.StreamSetupError as e:
        said = str(e)
    solo = dist.new_group([0])  # a collective: every rank creates it
    if rank == 0:  # step mode would bypass DDP's all-reduce: refused
        m = model()
        ns.stream(m, None, device="cpu")
        ns.data_parallel(m, process_group=solo)
        try:
            ns.StepTrainer(m, None, grad_accum=2)
            said += "\nstep mode not refused"
        except ns.StreamSetupError as e:
            said += "\n" + str(e)
    with open(f"{out}.diverged.rank{rank}.txt", "w") as f:
        f.write(said)
    torch.save(shared_copy(folder, cache, world), f"{out}.shared.rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
