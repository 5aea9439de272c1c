"""The residency planner: given a device budget, which decoder layers stay on the device
for good, how many device slabs to prefetch into, and what peak and transfer to expect.

Costs the budget must hold whatever the plan (the "fixed" part): non-layer frozen tensors
placed on the device (final norm, head, a tied embedding), the trainable parameters with
their gradients and AdamW state, the saved layer inputs (one hidden-state tensor per
layer), the transient working set of one layer's recompute, and the logits of the loss.
What is left buys device slabs: one to compute in, one more per prefetched layer, then
resident layers — spread evenly through the stack, so every streamed layer's copy can hide
behind the compute of its neighbours (seed 004's partial residency).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from narrows.core import format_bytes

from .errors import BudgetTooSmallError


@dataclass(frozen=True)
class Shapes:
    """What the activation estimate needs from the model config and the batch."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    vocab: int
    act_bytes: int  # bytes per activation element (2 for bf16)
    batch: int
    seq: int
    eager_attention: bool
    loss_bytes: int | None = None  # what a replaced loss says it holds (narrows.core.loss_working_set)


@dataclass(frozen=True)
class Plan:
    device: str
    budget: int | None
    layer_bytes: tuple[int, ...]
    resident: tuple[int, ...]
    pool_slabs: int
    prefetch: int
    fixed_bytes: int
    activation_bytes: int
    work_bytes: int
    predicted_peak: int
    h2d_bytes_per_step: int
    disk: tuple[int, ...] = ()  # layers whose host copy is on disk (the prepared cache)
    disk_bytes_per_step: int = 0
    predicted_host_bytes: int | None = None  # host RSS with the base in its tiers
    host_budget: int | None = None

    @property
    def streamed(self) -> tuple[int, ...]:
        return tuple(i for i in range(len(self.layer_bytes)) if i not in set(self.resident))

    def as_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["streamed"] = list(self.streamed)
        return d

    def __str__(self) -> str:
        n = len(self.layer_bytes)
        rows = [
            ("device", self.device),
            ("budget", "none (smallest footprint)" if self.budget is None else format_bytes(self.budget)),
            ("layers", f"{n} ({format_bytes(sum(self.layer_bytes))} frozen, largest {format_bytes(max(self.layer_bytes))})"),
            ("resident layers", f"{len(self.resident)} of {n}" + (f": {list(self.resident)}" if 0 < len(self.resident) < n else "")),
            ("device slabs", f"{self.pool_slabs} (prefetch depth {self.prefetch})"),
            ("fixed on device", format_bytes(self.fixed_bytes)),
            ("saved activations", format_bytes(self.activation_bytes)),
            ("layer + loss working set", format_bytes(self.work_bytes)),
            ("predicted peak", format_bytes(self.predicted_peak)),
            ("host→device per step", format_bytes(self.h2d_bytes_per_step)),
        ]  # fmt: skip
        if self.predicted_host_bytes is not None:
            budget = "" if self.host_budget is None else f" (budget {format_bytes(self.host_budget)})"
            rows.append(("predicted host RSS", format_bytes(self.predicted_host_bytes) + budget))
            rows.append(("disk tier", f"{len(self.disk)} of {n} layers, {format_bytes(self.disk_bytes_per_step)} read per step"
                         if self.disk else "none: every layer pinned in host RAM"))  # fmt: skip
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def activation_bytes(s: Shapes) -> int:
    """Saved layer inputs: one [batch, seq, hidden] tensor per layer."""
    return s.layers * s.batch * s.seq * s.hidden * s.act_bytes


def work_bytes(s: Shapes) -> int:
    """Transient working set: the larger of one layer's recompute graph and the loss.

    A layer's graph holds about ten hidden-sized and four intermediate-sized activations
    (norms, q/k/v/o, residuals; gate, up, act, product), plus the attention probabilities
    when attention is eager. The loss holds logits in the activation dtype, their fp32
    upcast, the log-softmax and the gradient (fp32), and the gradient cast back. (Measured
    on the H100: 10 bytes per logit under-predicted a 32B seq-4096 run by 3%.) A loss that
    never builds the logits (narrows-lmhead) reports its own figure instead.
    """
    tokens = s.batch * s.seq
    layer = tokens * (10 * s.hidden + 4 * s.intermediate) * s.act_bytes
    if s.eager_attention:
        layer += 2 * s.batch * s.heads * s.seq * s.seq * s.act_bytes
    loss = s.loss_bytes if s.loss_bytes is not None else tokens * s.vocab * (2 * s.act_bytes + 4 + 4 + 2)
    return max(layer, loss)


def spread(count: int, total: int) -> tuple[int, ...]:
    """`count` indices spread evenly over range(total)."""
    if count <= 0:
        return ()
    if count >= total:
        return tuple(range(total))
    return tuple(sorted({int((i + 0.5) * total / count) for i in range(count)}))


def make_plan(
    layer_bytes: Sequence[int],
    *,
    fixed_bytes: int,
    shapes: Shapes,
    budget: int | None,
    device: str,
    prefetch: int = 1,
    head_h2d_bytes: int = 0,
    disk: Sequence[int] = (),
    host_bytes: int | None = None,
    host_budget: int | None = None,
) -> Plan:
    """Decide residency for `budget` bytes of device memory (None: the smallest footprint).

    `head_h2d_bytes`: what a streamed LM head adds to the transfer per step. `disk`: the
    layers whose host copy is on disk; they are the first made resident, since a resident
    layer is read once instead of twice a step. `host_bytes`/`host_budget`: the host tiers'
    predicted footprint and its budget, for the report."""
    layer_bytes = tuple(layer_bytes)
    n = len(layer_bytes)
    slab = max(layer_bytes)
    act, work = activation_bytes(shapes), work_bytes(shapes)
    base = fixed_bytes + act + work

    def footprint(resident: tuple[int, ...], slabs: int) -> int:
        return base + slabs * slab + sum(layer_bytes[i] for i in resident)

    if budget is None:
        resident, prefetch = (), max(prefetch, 0)
    else:
        minimum = footprint((), 1)
        if budget < minimum:
            raise BudgetTooSmallError(
                f"a GPU budget of {format_bytes(budget)} cannot hold the minimum of {format_bytes(minimum)}: "
                f"one streamed layer ({format_bytes(slab)}), fixed costs ({format_bytes(fixed_bytes)}: head, norm, "
                f"adapters with gradients and optimizer state), saved activations ({format_bytes(act)}) and the "
                f"working set ({format_bytes(work)}). Give at least {format_bytes(minimum)}, or shorten "
                f"the sequence / batch (activations scale with both)."
            )
        if footprint(tuple(range(n)), 0) <= budget:
            resident, prefetch = tuple(range(n)), 0
        else:
            while prefetch > 0 and footprint((), prefetch + 1) > budget:
                prefetch -= 1
            count = min(n - 1, (budget - footprint((), prefetch + 1)) // slab)
            resident = _choose(count, n, disk)
            while resident and footprint(resident, prefetch + 1) > budget:
                resident = _choose(len(resident) - 1, n, disk)
    streamed = [i for i in range(n) if i not in set(resident)]
    slabs = prefetch + 1 if streamed else 0
    # each streamed layer is loaded for forward and again for backward, except the ones the
    # pool still holds at the turns: the last layers at forward→backward, the first layers
    # at backward→next forward (steady state of a training loop)
    held = min(slabs, len(streamed))
    kept = streamed[-held:] + streamed[:held] if held else []
    h2d = 2 * sum(layer_bytes[i] for i in streamed) - sum(layer_bytes[i] for i in kept) + head_h2d_bytes
    on_disk = set(disk)
    disk_read = 2 * sum(layer_bytes[i] for i in streamed if i in on_disk) - sum(
        layer_bytes[i] for i in kept if i in on_disk
    )
    return Plan(
        device=device,
        budget=budget,
        layer_bytes=layer_bytes,
        resident=resident,
        pool_slabs=slabs,
        prefetch=prefetch if streamed else 0,
        fixed_bytes=fixed_bytes,
        activation_bytes=act,
        work_bytes=work,
        predicted_peak=footprint(resident, slabs),
        h2d_bytes_per_step=h2d,
        disk=tuple(sorted(on_disk)),
        disk_bytes_per_step=disk_read,
        predicted_host_bytes=host_bytes,
        host_budget=host_budget,
    )


def _choose(count: int, n: int, disk: Sequence[int]) -> tuple[int, ...]:
    """`count` resident layers: disk-tier layers first (spread among them), then the rest."""
    disk = sorted(disk)
    if count <= len(disk):
        return tuple(sorted(disk[i] for i in spread(count, len(disk))))
    others = [i for i in range(n) if i not in set(disk)]
    return tuple(sorted(disk + [others[i] for i in spread(count - len(disk), len(others))]))
