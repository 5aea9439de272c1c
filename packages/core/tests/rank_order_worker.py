"""One of four torchrun ranks (gloo) for `test_rank_order.py`: a small model in DDP with
`rank_ordered_sum`, one micro-batch a rank, its gradients saved; and one bucket of values
whose sum depends on the order they are added in, summed by the hook and by an all-reduce."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from narrows.core import rank_ordered_sum

# the four ranks' values: added in rank order (1e8 + 1 rounds to 1e8 in float32) they give 1
ORDER_SENSITIVE = [1e8, 1.0, -1e8, 1.0]


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def micro_batch(k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(k)
    return torch.randn(8, 16, generator=g) * 10.0 ** (k - 2)  # magnitudes that round apart


class Bucket:
    def __init__(self, t: torch.Tensor):
        self.t = t

    def buffer(self) -> torch.Tensor:
        return self.t


def main(out: str, average: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = net()
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(None, rank_ordered_sum(average=average == "mean"))
    ddp(micro_batch(rank)).square().sum().backward()
    mine = torch.full((5,), ORDER_SENSITIVE[rank])
    hooked = rank_ordered_sum()(None, Bucket(mine.clone())).wait()
    reduced = mine.clone()
    dist.all_reduce(reduced)
    if rank == 0:
        torch.save(
            {
                "grads": [p.grad for p in model.parameters()],
                "hooked": hooked,
                "reduced": reduced,
                "world": world,
            },
            out,
        )
    # leave together: a rank that tears its group down while rank 0 still writes can abort at
    # exit (gloo's threads outliving the interpreter)
    # DDP's reducer and its hook's futures go before the process group: freed after it, at
    # exit, they would reach a group already destroyed (a rank aborting, under load)
    del ddp, hooked
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
