"""One rank of the data-parallel parity test, launched by torchrun (`test_distributed.py`):
a streamed tiny model wrapped in DDP over gloo, each rank one micro-batch of the global
batch, dropout seeded per (step, micro-batch) — the loop `sequential` runs in one process.
Then the shared host copy: both ranks load one checkpoint folder with `from_pretrained`
(sharing by default under torchrun) and report where their slabs live.

With device "cuda" (`test_distributed_gpu.py`) each rank takes its own GPU and NCCL, with
deterministic kernels; ``ddp_worker.py reference OUT FOLDER`` is the one process the
ranks must equal, run apart so that it too sets the kernels up before CUDA starts."""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from narrows.core import rank_ordered_sum
from narrows.core.testing import mapped_file, mapping_memory, tiny_batch

sys.path.insert(0, os.path.dirname(__file__))
from helpers import build

import narrows.stream as ns

STEPS, LAYERS, DROPOUT = 2, 3, 0.1


def model():
    return build(num_hidden_layers=LAYERS, dropout=DROPOUT)


def micro_step(
    forward, step: int, micro: int, scale: float, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """One micro-batch: its own data and its own dropout seed, so any process can run it."""
    torch.manual_seed(1000 + 100 * step + micro)
    loss = forward(**{k: v.to(device) for k, v in tiny_batch(seed=10 * step + micro).items()}).loss
    (loss * scale).backward()
    return loss.detach().clone()


def record(params, opt, losses, grads) -> dict:
    return {
        "loss": losses,
        "grad": grads,
        "weight": [p.detach().clone() for p in params],
        "adam": [v.clone() for st in opt.state.values() for v in st.values() if torch.is_tensor(v)],
    }


def sequential(m, world: int, device: torch.device | str = "cpu") -> dict:
    """The reference: one process, gradient accumulation over `world` micro-batches."""
    params = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    losses, grads = [], []
    for step in range(STEPS):
        losses += [micro_step(m, step, micro, 1 / world, device) for micro in range(world)]
        grads += [p.grad.clone() for p in params]
        opt.step()
        opt.zero_grad()
    return record(params, opt, losses, grads)


def train_rank(mode: str, rank: int, world: int, device: torch.device) -> dict:
    m = model()
    ns.stream(m, None, device=device)
    # "ddp": narrows' wrapper (its gradients summed in rank order); "plain": torch's own DDP,
    # as accelerate and Trainer build it (an all-reduce); "hooked": torch's own DDP given
    # narrows' rank-ordered sum; "local": no gradient all-reduce at all (the fault twin)
    ids = {"device_ids": [device.index]} if device.type == "cuda" else {}
    wrap = {"ddp": ns.data_parallel, "plain": DistributedDataParallel, "hooked": DistributedDataParallel}
    forward = wrap[mode](m, **ids) if mode in wrap else m
    if mode == "hooked":
        forward.register_comm_hook(None, rank_ordered_sum(average=True))
    if mode != "local":  # the frozen base is outside DDP: nothing of it broadcast, bucketed or all-reduced
        frozen = {n for n, p in m.named_parameters() if not p.requires_grad}
        assert frozen and forward.parameters_to_ignore == frozen | {n for n, _ in m.named_buffers()}
        assert all(p.requires_grad for p in forward._module_parameters)
    params = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    losses, grads = [], []
    for step in range(STEPS):
        # DDP averages the ranks' gradients; a micro-batch's loss is not scaled here
        losses.append(micro_step(forward, step, rank, 1 / world if mode == "local" else 1.0, device))
        grads += [p.grad.clone() for p in params]
        opt.step()
        opt.zero_grad()
    return record(params, opt, losses, grads)


def adapted(folder: str, **load) -> tuple[torch.nn.Module, object]:
    """The checkpoint loaded by `from_pretrained` (its tiers), LoRA added with seeded weights."""
    from peft import LoraConfig, get_peft_model

    m = ns.from_pretrained(folder, dtype=torch.float32, host_budget="1TiB", **load)
    tiers = m.narrows.tiers
    torch.manual_seed(0)  # the adapters' initialisation
    return get_peft_model(m, LoraConfig(r=4, target_modules="all-linear", lora_dropout=DROPOUT)), tiers


def private_copy(folder: str, world: int, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """What the ranks on the shared copy must equal: one process, a private copy of the
    checkpoint (no cache at all), accumulating the ranks' micro-batches."""
    m, tiers = adapted(folder, cache=False, share=False)
    assert tiers.shared == ()
    ns.stream(m, None, device=device)
    params = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    for step in range(STEPS):
        for micro in range(world):
            micro_step(m, step, micro, 1 / world, device)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in params]


def registered(home: torch.Tensor) -> bool:
    """Whether this process page-locked `home` for CUDA: registering it again is refused as
    already registered (`Tensor.is_pinned` does not see a read-only registered file map). On
    a thread of its own: the refusal is also that thread's CUDA error, which the next kernel
    launched on it would raise."""

    def probe() -> int:
        cudart = torch.cuda.cudart()
        err = int(cudart.cudaHostRegister(home.data_ptr(), home.numel(), 1 | 8))  # portable, read-only
        if err == 0:  # it was not: undo this probe's own registration
            cudart.cudaHostUnregister(home.data_ptr())
        return err

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(probe).result() == 712  # cudaErrorHostMemoryAlreadyRegistered


def shared_copy(folder: str, cache: str, world: int, device: torch.device) -> dict:
    """Both ranks load `folder` (sharing, by default under torchrun), then train two DDP
    steps on it, each rank one seeded micro-batch."""
    m, tiers = adapted(folder, cache=cache)
    homes = sorted({mapped_file(h.data_ptr()) for h in tiers.homes})
    embedding = mapped_file(m.get_input_embeddings().weight.data_ptr())
    dist.barrier()  # both ranks hold their maps
    memory = mapping_memory(str(tiers.cache.path))
    dist.barrier()
    ns.stream(m, None, device=device)
    ddp = ns.data_parallel(m, **({"device_ids": [device.index]} if device.type == "cuda" else {}))
    params = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    for step in range(STEPS):
        micro_step(ddp, step, dist.get_rank(), 1.0, device)
        opt.step()
        opt.zero_grad()
    return {
        "shared": tiers.shared,
        "layers": len(tiers.homes),
        "homes": homes,
        "cache": str(tiers.cache.path),
        "slab_bytes": sum(lay.nbytes for lay in tiers.layouts),
        "memory": memory,
        "notes": tiers.notes,
        "embedding": embedding,
        "registered": [registered(h) for h in tiers.homes] if device.type == "cuda" else [],
        "weight": [p.detach().clone() for p in params],
    }


def main(out: str, folder: str, cache: str, device: str = "cpu") -> None:
    if device == "cuda":  # each rank its own GPU, before NCCL binds to the current one
        from narrows.core.protocol.determinism import deterministic

        deterministic()
        dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for mode in ("ddp", "plain", "hooked", "local"):
        torch.save(train_rank(mode, rank, world, dev), f"{out}.{mode}.rank{rank}.pt")
    if dev.type == "cuda":  # the refusals below are the CPU test's
        torch.save(shared_copy(folder, cache, world, dev), f"{out}.shared.rank{rank}.pt")
        dist.destroy_process_group()
        return
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
    torch.save(shared_copy(folder, cache, world, dev), f"{out}.shared.rank{rank}.pt")
    dist.destroy_process_group()


def reference(out: str, folder: str, world: int = 2) -> None:
    """The GPU test's one process: both references on cuda:0, deterministic kernels,
    accumulating `world` micro-batches a step."""
    from narrows.core.protocol.determinism import deterministic

    deterministic()
    seq = sequential(model().to("cuda"), world, "cuda")
    torch.save({"sequential": seq, "private": private_copy(folder, world, "cuda")}, f"{out}.reference.pt")


if __name__ == "__main__":
    if sys.argv[1] == "reference":
        reference(sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 2)
    else:
        main(*sys.argv[1:5])
