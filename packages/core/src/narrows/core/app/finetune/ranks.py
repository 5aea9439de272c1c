"""Several ranks of one fine-tune (launched by torchrun): which rank this process is, the
process group, agreement between the ranks, and the data-parallel model.

Each micro-batch draws the dropout masks one process would; gradients are summed over
ranks in rank order (`rank_ordered_sum`). R ranks with ``--grad-accum 1`` equal one process
with ``--grad-accum R`` bit for bit; otherwise a run equals the same run on the same number
of ranks. Rank 0 alone writes the run folder.

why: docs/design.md#several-ranks
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from ...errors import NarrowsError

if TYPE_CHECKING:  # torch is imported where a rank uses it: the CLI reads the launch without it
    import torch
    from torch import nn

__all__ = ["Ranks", "data_parallel", "micro_seed"]

T = TypeVar("T")


def micro_seed(seed: int, index: int) -> int:
    """The generators' seed for micro-batch `index` of the run's stream: any rank (or a
    resumed process) that runs that micro-batch draws the same random numbers."""
    return (seed << 32) + index


@dataclass(frozen=True)
class Ranks:
    """This process's place among the ranks of the run (one rank when not launched)."""

    rank: int = 0
    world: int = 1
    local: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls) -> Ranks:
        """From the variables torchrun (or ``accelerate launch``) sets for each rank."""
        raw = {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
        if raw["WORLD_SIZE"] in (None, "", "1"):
            return cls()
        try:
            world, rank, local = (int(raw[k] or "") for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"))
        except ValueError:
            raise NarrowsError(
                f"launched as one of several ranks but WORLD_SIZE, RANK, LOCAL_RANK are {raw}; start the job with "
                "torchrun (e.g. torchrun --nproc-per-node 2 -m narrows.core.app.cli finetune ...)"
            ) from None
        if not (world > 1 and 0 <= rank < world and local >= 0):
            raise NarrowsError(f"rank {rank} of {world} (local {local}) is not a valid place among the ranks")
        return cls(rank, world, local)

    def device(self) -> torch.device:
        """This rank's device: its own GPU (``cuda:LOCAL_RANK``), or the CPU."""
        import torch

        if not torch.cuda.is_available():
            return torch.device("cpu")
        if self.world == 1:
            return torch.device("cuda")
        count = torch.cuda.device_count()
        if self.local >= count:
            raise NarrowsError(
                f"local rank {self.local} has no GPU of its own: this machine shows {count}; start "
                f"at most {count} ranks per machine (torchrun --nproc-per-node {count})"
            )
        return torch.device("cuda", self.local)

    @contextlib.contextmanager
    def joined(self, device: torch.device) -> Iterator[None]:
        """The process group for the run's collectives (NCCL on GPUs, gloo on the CPU)."""
        if self.world == 1:
            yield
            return
        import torch
        import torch.distributed as dist

        if device.type == "cuda":
            torch.cuda.set_device(device)  # before NCCL: its communicators bind to the current device
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        try:
            yield
            # leave together: a rank that tears its group down while rank 0 still writes the
            # run can abort at exit (gloo's worker threads outliving the interpreter)
            dist.barrier()
        finally:
            dist.destroy_process_group()

    def first(self, fn: Callable[[], T]) -> T:
        """`fn` on rank 0 only (claiming the run folder, reading its config); its result,
        or its error, reaches every rank — so all ranks go on, or all stop, together."""
        result, error = None, None
        if self.main:
            try:
                result = fn()
            except NarrowsError as e:
                error = str(e)
        if self.world > 1:
            import torch.distributed as dist

            box = [result, error]
            dist.broadcast_object_list(box, src=0)
            result, error = box
        if error is not None:
            raise NarrowsError(error)
        return result  # type: ignore[return-value]

    def agree(self, **facts: Any) -> None:
        """Stop every rank, naming the first that differs from rank 0, when the ranks were
        not given the same run (another config, other data, another narrows)."""
        if self.world == 1:
            return
        import torch.distributed as dist

        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, facts)
        for rank, theirs in enumerate(every):
            for key, value in theirs.items():
                if value != every[0][key]:
                    raise NarrowsError(
                        f"rank {rank} differs from rank 0 in its {key} ({value!r} against {every[0][key]!r}); every "
                        "rank must run the same narrows on the same model, data and flags: check what each machine "
                        "has at those paths and the environment each rank starts in"
                    )

    def total(self, value: float, device: torch.device, op: str = "sum") -> float:
        """`value` summed (or ``op="max"``) over the ranks."""
        if self.world == 1:
            return value
        import torch
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return float(t.item())


def data_parallel(model: nn.Module, ranks: Ranks, device: torch.device) -> nn.Module:
    """What each rank runs forward and backward through: `DistributedDataParallel` over the
    adapters (the frozen base is left out: every rank loaded the same one), the ranks'
    gradients summed in rank order, not averaged: the loss is already normalised over the
    whole step. One rank: the model itself."""
    if ranks.world == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    from ...protocol.determinism import rank_ordered_sum

    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        kwargs["device_ids"] = [device.index]
    if getattr(model, "narrows_stream", None) is not None:
        import narrows.stream

        # checks the ranks' stream plans agree too
        return narrows.stream.data_parallel(model, average=False, **kwargs)
    # every rank loaded the same base and built the same buffers: nothing of them to sync
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, frozen + [n for n, _ in model.named_buffers()]
    )
    net = DistributedDataParallel(model, **kwargs)
    net.register_comm_hook(None, rank_ordered_sum(average=False))
    return net
