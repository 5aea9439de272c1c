"""What a model's decoder layers hold quantised (NF4 linears; expert stacks in NF4, NF3, NF2
or a release's MXFP4) and what they keep in float, with why.

A quantised base never keeps a tensor in float without saying so: `precision(model)`
walks the decoder layers and sorts every frozen float tensor that is not quantised into
the kinds narrows keeps on purpose (routers, per-channel vectors, expert biases) or, for
anything else, by name: a tensor narrows did not know how to quantise.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..memory import format_bytes
from ..protocol.anatomy import anatomy_of
from .experts import absmax_name, expert_scheme, is_quantized_experts, lowbit_stacks, moe_blocks
from .nf4 import is_nf4_linear

__all__ = ["ExpertStacks", "KeptInFloat", "Precision", "precision"]

_WHY = {
    "routers": "each token's choice of experts; small, and left as transformers builds it",
    "expert biases": "one per expert and channel, as a 4-bit linear keeps its bias",
    "vectors": "one value per channel (norm scales, biases, attention sinks), as bitsandbytes keeps them",
    "linears": "the base is float (--quant nf4 / quantize_nf4 would quantise them)",
}


@dataclass(frozen=True)
class KeptInFloat:
    """Tensors of one kind the decoder layers keep in float: how many, their bytes, why."""

    kind: str  # "linears" (of a float base), "routers", "expert biases", "vectors", or "other"
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
class ExpertStacks:
    """The expert stacks held in one scheme: how many, their bytes as stored (codes and
    scales)."""

    scheme: str  # "nf4", "nf3", "nf2", "mxfp4"
    count: int
    nbytes: int


@dataclass(frozen=True)
class Precision:
    """The decoder layers' precision: NF4 linears, expert stacks by scheme (count, bytes as
    stored) and what stays in float."""

    linears: int
    linear_bytes: int
    experts: tuple[ExpertStacks, ...]  # one per scheme, NF4 first
    kept: tuple[KeptInFloat, ...]

    @property
    def expert_stacks(self) -> int:
        """Quantised expert stacks, all schemes."""
        return sum(e.count for e in self.experts)

    @property
    def expert_bytes(self) -> int:
        return sum(e.nbytes for e in self.experts)

    def stacks(self, scheme: str) -> ExpertStacks:
        """The stacks held in `scheme` (a count of 0 where there are none)."""
        return next((e for e in self.experts if e.scheme == scheme), ExpertStacks(scheme, 0, 0))

    @property
    def unexplained(self) -> tuple[KeptInFloat, ...]:
        """The kept tensors narrows has no reason for (kind "other")."""
        return tuple(k for k in self.kept if k.kind == "other")

    def as_dict(self) -> dict:
        return {
            "nf4_linears": self.linears,
            "nf4_linear_bytes": self.linear_bytes,
            "nf4_expert_stacks": self.stacks("nf4").count,
            "nf4_expert_bytes": self.stacks("nf4").nbytes,
            "expert_stacks": {e.scheme: {"count": e.count, "bytes": e.nbytes} for e in self.experts},
            "kept_in_float": [
                {"kind": k.kind, "count": len(k.names), "bytes": k.nbytes, "dtype": k.dtype, "why": k.why}
                | ({"names": list(k.names)} if k.kind == "other" else {})
                for k in self.kept
            ],
        }

    def __str__(self) -> str:
        held: dict[str, list[str]] = {}  # scheme -> what it holds
        if self.linears:
            held["nf4"] = [f"{self.linears} linears ({format_bytes(self.linear_bytes)})"]
        for e in self.experts:
            held.setdefault(e.scheme, []).append(f"{e.count} expert stacks ({format_bytes(e.nbytes)})")
        head = (
            "; ".join(f"{s.upper()}: {', '.join(parts)}" for s, parts in held.items()) or "quantised: nothing"
        )
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
    float_base = not getattr(anat.model, "is_loaded_in_4bit", False)
    linears = linear_bytes = 0
    schemes: dict[str, list[int]] = {}  # scheme -> [count, bytes]
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
            if is_quantized_experts(module):
                stack = _stack_of(module, pname)
                if stack is not None:
                    scheme = expert_scheme(module, stack)
                    counts = schemes.setdefault(scheme, [0, 0])
                    counts[0] += pname == stack
                    counts[1] += _stored_bytes(p) if scheme == "nf4" else p.numel() * p.element_size()
                    continue
            if not p.is_floating_point():
                continue
            if id(p) in routers:
                kind = "routers"
            elif is_quantized_experts(module) and p.dim() == 2:
                kind = "expert biases"
            elif p.dim() <= 1:
                kind = "vectors"
            elif float_base and isinstance(module, nn.Linear) and pname == "weight":
                kind = "linears"
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
            kinds.items(),
            key=lambda kv: ["other", "linears", "routers", "expert biases", "vectors"].index(kv[0]),
        )
    )
    experts = tuple(
        ExpertStacks(scheme, *schemes[scheme])
        for scheme in ("nf4", "nf3", "nf2", "mxfp4")
        if scheme in schemes
    )
    return Precision(linears, linear_bytes, experts, kept)


def _stack_of(module: nn.Module, pname: str) -> str | None:
    """The quantised stack parameter `pname` of an experts module holds part of (its NF4
    weight, an NF3/NF2/MXFP4 stack's codes or absmax), or None."""
    if pname in module._nf4_stacks:
        return pname
    for name in lowbit_stacks(module):
        if pname in (name, absmax_name(name)):
            return name
    return None
