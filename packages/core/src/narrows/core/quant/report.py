"""What a model's decoder layers hold in 4 bits and what they keep in float, with why.

A quantised base never keeps a tensor in float without saying so: `precision(model)`
walks the decoder layers and sorts every frozen float tensor that is not NF4 into the
kinds narrows keeps on purpose (routers, per-channel vectors, expert biases) or, for
anything else, by name: a tensor narrows did not know how to quantise.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..memory import format_bytes
from ..protocol.anatomy import anatomy_of
from .experts import is_nf4_experts, moe_blocks
from .nf4 import is_nf4_linear

__all__ = ["KeptInFloat", "Precision", "precision"]

_WHY = {
    "routers": "each token's choice of experts; small, and left as transformers builds it",
    "expert biases": "one per expert and channel, as a 4-bit linear keeps its bias",
    "vectors": "one value per channel (norm scales, biases, attention sinks), as bitsandbytes keeps them",
}


@dataclass(frozen=True)
class KeptInFloat:
    """Tensors of one kind the decoder layers keep in float: how many, their bytes, why."""

    kind: str  # "routers", "expert biases", "vectors", or "other"
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    nbytes: int
    dtype: str

    @property
    def why(self) -> str:
        return _WHY.get(self.kind, "not an nn.Linear nor fused experts: narrows does not quantise it")

    def __str__(self) -> str:
        shapes = sorted(set(self.shapes))
        shape = f" {list(shapes[0])}" if len(shapes) == 1 else ""
        what = (
            self.kind
            if self.kind != "other"
            else ", ".join(self.names[:3]) + ("…" if len(self.names) > 3 else "")
        )
        n = len(self.names)
        return f"{what} ({n} tensor{'s' * (n > 1)}{shape}, {format_bytes(self.nbytes)}, {self.dtype}: {self.why})"


@dataclass(frozen=True)
class Precision:
    """The decoder layers' precision: NF4 linears and expert stacks (count, bytes as
    stored) and what stays in float."""

    linears: int
    linear_bytes: int
    expert_stacks: int
    expert_bytes: int
    kept: tuple[KeptInFloat, ...]

    @property
    def unexplained(self) -> tuple[KeptInFloat, ...]:
        """The kept tensors narrows has no reason for (kind "other")."""
        return tuple(k for k in self.kept if k.kind == "other")

    def as_dict(self) -> dict:
        return {
            "nf4_linears": self.linears,
            "nf4_linear_bytes": self.linear_bytes,
            "nf4_expert_stacks": self.expert_stacks,
            "nf4_expert_bytes": self.expert_bytes,
            "kept_in_float": [
                {"kind": k.kind, "count": len(k.names), "bytes": k.nbytes, "dtype": k.dtype, "why": k.why}
                | ({"names": list(k.names)} if k.kind == "other" else {})
                for k in self.kept
            ],
        }

    def __str__(self) -> str:
        four = []
        if self.linears:
            four.append(f"{self.linears} linears ({format_bytes(self.linear_bytes)})")
        if self.expert_stacks:
            four.append(f"{self.expert_stacks} expert stacks ({format_bytes(self.expert_bytes)})")
        head = "4-bit: " + (", ".join(four) if four else "nothing")
        if not self.kept:
            return head
        return head + "; kept in float: " + "; ".join(map(str, self.kept))


def _stored_bytes(p) -> int:
    qs = p.quant_state
    n = p.numel() * p.element_size()
    for t in (qs.absmax, getattr(getattr(qs, "state2", None), "absmax", None)):
        if t is not None:
            n += t.numel() * t.element_size()
    return n


def precision(model: nn.Module) -> Precision:
    """`model`'s decoder layers sorted by precision (adapters, which train, are left out)."""
    anat = anatomy_of(model)
    linears = linear_bytes = stacks = stack_bytes = 0
    kinds: dict[str, list[tuple[str, tuple[int, ...], int, str]]] = {}
    for lpath, layer in zip(anat.layer_paths, anat.layers):
        routers = set()
        for block in moe_blocks(layer):
            for router in block.routers.values():
                routers.update(id(p) for p in router.parameters())
        owner = {}
        for mname, module in layer.named_modules():
            for pname, p in module.named_parameters(recurse=False):
                owner[id(p)] = (mname, module, pname)
        for name, p in layer.named_parameters():
            mname, module, pname = owner[id(p)]
            if ".lora_" in f".{name}":  # an adapter's: it trains
                continue
            if is_nf4_linear(module) and pname == "weight":
                linears += 1
                linear_bytes += _stored_bytes(p)
                continue
            if is_nf4_experts(module) and pname in module._nf4_stacks:
                stacks += 1
                stack_bytes += _stored_bytes(p)
                continue
            if not p.is_floating_point():
                continue
            if id(p) in routers:
                kind = "routers"
            elif is_nf4_experts(module) and p.dim() == 2:
                kind = "expert biases"
            elif p.dim() <= 1:
                kind = "vectors"
            else:
                kind = "other"
            dtype = str(p.dtype).removeprefix("torch.")
            kinds.setdefault(kind, []).append(
                (f"{lpath}.{name}", tuple(p.shape), p.numel() * p.element_size(), dtype)
            )
    kept = tuple(
        KeptInFloat(
            kind,
            tuple(n for n, *_ in rows),
            tuple(s for _, s, *_ in rows),
            sum(b for *_, b, _ in rows),
            "/".join(sorted({d for *_, d in rows})),
        )
        for kind, rows in sorted(
            kinds.items(), key=lambda kv: ["other", "routers", "expert biases", "vectors"].index(kv[0])
        )
    )
    return Precision(linears, linear_bytes, stacks, stack_bytes, kept)
