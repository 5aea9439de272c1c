"""Fused mixture-of-experts weights quantised: NF4 through bitsandbytes, or NF3 / NF2 codes
of our own (`lowbit.py`).

Since transformers 5 every MoE model keeps its routed experts as 3-D parameters of one
module (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]) and runs them
with grouped matmuls, not as ``nn.Linear``s, so bitsandbytes' 4-bit conversion, which
replaces linears, leaves them in float. Here each such stack is quantised in the same
place, every block inside one expert, and the module's class becomes a subclass whose
``forward`` dequantises the stacks (into the dtype they had) and runs the model's own
experts code on them: the same routing, grouped matmul and activation, on the values the
dequantisation gives.

* NF4: the stack becomes a bitsandbytes ``Params4bit`` (blockwise NF4, double-quantised)
  with a ``quant_state``, like a ``Linear4bit``'s weight.
* NF3 / NF2: the stack's place holds its packed codes (a frozen uint8 parameter [E, bytes])
  and ``{name}_absmax`` beside it its block scales (a frozen float32 parameter [E, blocks]);
  what turns them back into the stack (bits, shape, dtype) is the module's, by name
  (`lowbit_stacks`).
* MXFP4, as gpt-oss's release stores its experts (not made here: the loader keeps a
  release's codes): held the same way, its E8M0 scales as uint8 in ``{name}_absmax``.

Either way the quantised stacks are frozen parameters (and quantisation state), so the
protocol's slots, slabs and streaming move them with no code of their own. Each carries the
shape the model's code sees as ``ds_shape`` — the attribute PEFT reads for a parameter whose
storage is not its shape (DeepSpeed's partitions) — so PEFT's ``target_parameters`` LoRA
gets its adapters' shapes right; `narrows.core.protocol.expert_adapters` then runs them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .dequantize import dequantize_nf4
from .lowbit import BLOCK, SCHEMES, LowbitStack, dequantize, quantize

__all__ = [
    "EXPERT_SCHEMES",
    "HELD_SCHEMES",
    "MoEBlock",
    "absmax_name",
    "dequantized_expert_bytes",
    "expert_names",
    "expert_scheme",
    "expert_shape",
    "expert_stacks",
    "guard_saving",
    "install_lowbit_experts",
    "install_nf4_experts",
    "is_nf4_experts",
    "is_quantized_experts",
    "lowbit_stacks",
    "moe_blocks",
    "quantize_experts",
    "under_wrappers",
]

EXPERT_SCHEMES = ("nf4", "nf3", "nf2")  # nf4: bitsandbytes'; nf3, nf2: `lowbit.py`'s codes
HELD_SCHEMES = (*EXPERT_SCHEMES, "mxfp4")  # and a release's MXFP4 codes, kept as stored


def absmax_name(stack: str) -> str:
    """The parameter beside an NF3/NF2 stack's codes that holds its block scales."""
    return f"{stack}_absmax"


def expert_names(module: nn.Module) -> list[str]:
    """The fused expert stacks `module` holds itself: its 3-D parameters (float, or already
    NF4), and its NF3/NF2 stacks' codes, by attribute name."""
    lowbit = lowbit_stacks(module)
    return [
        name
        for name, p in module.named_parameters(recurse=False)
        if name in lowbit
        or (len(expert_shape(module, name)) == 3 and (_is_quantized(module, name) or p.is_floating_point()))
    ]


def is_quantized_experts(module: nn.Module) -> bool:
    """Whether `module` is an experts module narrows quantised (any scheme)."""
    return isinstance(module, _QuantizedExperts)


def is_nf4_experts(module: nn.Module) -> bool:
    """Whether `module` holds expert stacks in bitsandbytes' NF4."""
    return isinstance(module, _QuantizedExperts) and bool(module._nf4_stacks)


def lowbit_stacks(module: nn.Module) -> dict[str, LowbitStack]:
    """`module`'s NF3/NF2/MXFP4 stacks by name: what dequantises each one's codes and absmax."""
    return dict(getattr(module, "_lowbit_stacks", None) or {})


def expert_scheme(module: nn.Module, name: str) -> str:
    """How stack `name` of `module` is held: "nf4", "nf3", "nf2", "mxfp4", or its float dtype's name."""
    lowbit = lowbit_stacks(module)
    if name in lowbit:
        return lowbit[name].scheme
    p = module._parameters[name]
    if getattr(p, "quant_state", None) is not None:
        return "nf4"
    return str(p.dtype).removeprefix("torch.")


def expert_shape(module: nn.Module, name: str) -> torch.Size:
    """Stack `name`'s shape as the model's code sees it ([E, 2I, H] …), whatever holds it."""
    lowbit = lowbit_stacks(module)
    if name in lowbit:
        return torch.Size(lowbit[name].shape)
    p = module._parameters[name]
    qs = getattr(p, "quant_state", None)
    return torch.Size(qs.shape) if qs is not None else p.shape


def expert_stacks(module: nn.Module, names: tuple[str, ...]) -> list[Tensor]:
    """Stacks `names` of `module` as the model's code computes with them: quantised ones
    dequantised (a new tensor each call; only those named), float ones as they are."""
    dequantized = module._dequantized(names) if isinstance(module, _QuantizedExperts) else {}
    return [dequantized[n] if n in dequantized else module._parameters[n] for n in names]


@dataclass(frozen=True)
class MoEBlock:
    """One mixture-of-experts block of a decoder layer: the module whose direct child holds
    the fused expert stacks. Its other direct children are routers when they are leaves
    (the router, a shared expert's gate) and shared experts when they hold modules."""

    name: str
    block: nn.Module
    experts_name: str
    experts: nn.Module

    @property
    def routers(self) -> dict[str, nn.Module]:
        return {
            n: c
            for n, c in self.block.named_children()
            if n != self.experts_name and next(c.children(), None) is None
        }


def under_wrappers(module: nn.Module) -> nn.Module:
    """`module` under PEFT's ``ParamWrapper``s (LoRA on its stacks, one wrapper each), if any."""
    while hasattr(module, "parameter_name") and "base_layer" in module._modules:
        module = module._modules["base_layer"]
    return module


def moe_blocks(layer: nn.Module) -> Iterator[MoEBlock]:
    """Each mixture-of-experts block of a decoder layer (see `MoEBlock`; its experts as
    they are under PEFT's wrappers)."""
    for name, module in layer.named_modules():
        if under_wrappers(module) is not module:
            continue
        for child_name, child in module.named_children():
            base = under_wrappers(child)
            if expert_names(base):
                yield MoEBlock(name, module, child_name, base)


class _QuantizedExperts(nn.Module):
    """Mixed into a model's experts class: its stacks quantised, dequantised for each call
    (plus ``scaling · lhs @ rhs`` for a stack in ``_lora_deltas``: a LoRA adapter on it
    while its wrapper's forward runs)."""

    _nf4_stacks: tuple[str, ...] = ()
    _lowbit_stacks: dict[str, LowbitStack] | None = None
    _lora_deltas: dict[str, tuple[Tensor, Tensor, float]] | None = None

    def _dequantized(self, names: tuple[str, ...] | None = None) -> dict[str, Tensor]:
        """The quantised stacks among `names` (None: all of them), dequantised."""
        out = {}
        nf4 = [n for n in self._nf4_stacks if names is None or n in names]
        for name in nf4:  # NF3/NF2 stacks alone need no bitsandbytes
            p = self._parameters.get(name)
            if p is not None:
                out[name] = dequantize_nf4(p.data, p.quant_state)
        for name, stack in (self._lowbit_stacks or {}).items():
            codes = self._parameters.get(name)
            if codes is not None and (names is None or name in names):
                out[name] = dequantize(codes.data, self._parameters[absmax_name(name)].data, stack)
        return out

    def forward(self, *args, **kwargs):
        stacks = self._dequantized()
        for name, (lhs, rhs, scaling) in (self._lora_deltas or {}).items():
            stacks[name] = torch.baddbmm(stacks[name], lhs, rhs, alpha=scaling)
        # the instance's own attribute shadows the parameter for the model's code: it reads
        # `self.gate_up_proj` and gets the dequantised stack, for this call only
        self.__dict__.update(stacks)
        try:
            return super().forward(*args, **kwargs)
        finally:
            for name in stacks:
                self.__dict__.pop(name, None)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name in self._nf4_stacks:  # as a Linear4bit saves its weight: packed codes + state
            p = self._parameters[name]
            for key, value in p.quant_state.as_dict(packed=True).items():
                destination[f"{prefix}{name}.{key}"] = value if keep_vars else value.detach()

    def extra_repr(self) -> str:
        stacks = [f"{n}=nf4 {list(expert_shape(self, n))}" for n in self._nf4_stacks]
        stacks += [f"{n}={s.scheme} {list(s.shape)}" for n, s in (self._lowbit_stacks or {}).items()]
        return ", ".join(stacks)


_CLASSES: dict[type, type] = {}


def _quantized_class(cls: type) -> type:
    if issubclass(cls, _QuantizedExperts):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (_QuantizedExperts, cls), {"__module__": cls.__module__})
    return _CLASSES[cls]


def quantize_experts(
    module: nn.Module,
    *,
    scheme: str = "nf4",
    double_quant: bool = True,
    blocksize: int = BLOCK,
    device: torch.device | str | None = None,
    names: list[str] | None = None,
) -> int:
    """Quantise `module`'s fused expert stacks (`names`, default all of `expert_names`) in
    place to `scheme` — "nf4" (bitsandbytes, `double_quant` applies), "nf3" or "nf2"
    (`lowbit.py`, float32 block scales) — on `device` (default: where each stack is);
    dequantised, they come back in the dtype they had. Stacks already quantised are left
    as they are. Returns how many were quantised. Each expert's weights start on a block
    boundary (a stack whose per-expert size is not a multiple of `blocksize` is refused),
    so an expert is dequantised from its own blocks alone."""
    from ..errors import NarrowsError

    if scheme not in EXPERT_SCHEMES:
        raise ValueError(f"scheme={scheme!r}: expert stacks are quantised to one of {EXPERT_SCHEMES}")
    todo = [n for n in (expert_names(module) if names is None else names) if not _is_quantized(module, n)]
    for name in todo:
        p = module._parameters[name]
        per_expert = p[0].numel()
        if per_expert % blocksize:
            raise NarrowsError(
                f"{type(module).__name__}.{name} {list(p.shape)}: one expert's {per_expert} weights are not a "
                f"multiple of the {scheme.upper()} block size {blocksize}, so its blocks would straddle two experts"
            )
        dev = torch.device(device) if device is not None else p.device
        if scheme == "nf4":
            import bitsandbytes as bnb

            q = bnb.nn.Params4bit(
                p.data,
                requires_grad=False,
                blocksize=blocksize,
                compress_statistics=double_quant,
                quant_type="nf4",
            ).to(dev)
            install_nf4_experts(module, {name: q})
            continue
        stack = LowbitStack(SCHEMES[scheme], tuple(p.shape), p.dtype, blocksize)
        codes, absmax = quantize(p.data.to(dev), stack.bits, block=blocksize)
        install_lowbit_experts(module, {name: (codes, absmax, stack)})
    return len(todo)


def install_nf4_experts(module: nn.Module, stacks: dict[str, nn.Parameter]) -> None:
    """Put NF4 stacks (bitsandbytes ``Params4bit``, quantised) in `module`'s places of those
    names and make it run them (a prepared cache rebuilds a layer this way)."""
    for name, p in stacks.items():
        p.ds_shape = p.quant_state.shape
        module._parameters[name] = p
    module.__class__ = _quantized_class(type(module))
    kept = module._nf4_stacks
    module._nf4_stacks = kept + tuple(n for n in stacks if n not in kept)


def install_lowbit_experts(module: nn.Module, stacks: dict[str, tuple[Tensor, Tensor, LowbitStack]]) -> None:
    """Put NF3/NF2 stacks — (codes, absmax, `LowbitStack`) by name, as `lowbit.quantize`
    makes them, or MXFP4 ones as a release stores them — in `module` as frozen parameters (the codes in the stack's place, the
    absmax as ``{name}_absmax``) and make it run them (a prepared cache rebuilds a layer
    this way, over views of its slab)."""
    for name, (codes, absmax, stack) in stacks.items():
        stack.check(codes, absmax)
        module._parameters[name] = nn.Parameter(codes, requires_grad=False)
        module._parameters[name].ds_shape = torch.Size(stack.shape)
        module._parameters[absmax_name(name)] = nn.Parameter(absmax, requires_grad=False)
    module.__class__ = _quantized_class(type(module))
    module._lowbit_stacks = {**(module._lowbit_stacks or {}), **{n: s for n, (*_, s) in stacks.items()}}


def _is_quantized(module: nn.Module, name: str) -> bool:
    return expert_scheme(module, name) in HELD_SCHEMES


def dequantized_expert_bytes(layer: nn.Module, *, largest: bool = False) -> int:
    """Device bytes `layer`'s quantised expert stacks take dequantised: what one call of its
    experts holds at once (all stacks, dequantised before the model's code runs); with
    `largest`, the largest stack alone (narrows' fast layer dequantises one at a time)."""
    sizes = [0]
    for module in layer.modules():
        if is_quantized_experts(module):
            lowbit = lowbit_stacks(module)
            for name in (*module._nf4_stacks, *lowbit):
                dtype = lowbit[name].dtype if name in lowbit else module._parameters[name].quant_state.dtype
                sizes.append(expert_shape(module, name).numel() * dtype.itemsize)
    return max(sizes) if largest else sum(sizes)


class _UnsavableStacks:
    """A weight conversion that transformers' ``save_pretrained`` reverses first (it reverses
    every conversion of ``model._weight_conversions``), refusing: a quantised stack's codes
    cannot be turned back into the per-expert float weights a checkpoint of the family holds."""

    def __init__(self, names: list[str]):
        self.names = names

    def reverse_transform(self):
        from ..errors import NarrowsError

        raise NarrowsError(
            f"this model's routed experts are held quantised ({', '.join(self.names[:2])}"
            + (f" and {len(self.names) - 2} more" if len(self.names) > 2 else "")
            + "), and transformers' save_pretrained would write them back as per-expert float weights, "
            "which their codes are not. Save the float model instead (narrows quantises it again as it loads, "
            "a layer at a time; a streamed base keeps its quantised layers in the prepared cache, "
            "$NARROWS_CACHE/slabs), and the adapter with PeftModel.save_pretrained"
        )


def guard_saving(model: nn.Module) -> None:
    """Make transformers' ``save_pretrained`` of `model` refuse, by name, where its routed
    experts are held quantised (NF4, NF3, NF2 or a release's MXFP4 codes): it would fail
    inside transformers (turning fused stacks back into per-expert weights), or write
    stacks no loader reads. PEFT's adapter saving does not read these conversions."""
    held = [
        f"{path}.{n}"
        for path, module in model.named_modules()
        if is_quantized_experts(module)
        for n in expert_names(module)
        if _is_quantized(module, n)
    ]
    if not held:
        return
    base = getattr(model, "get_base_model", lambda: model)()
    conversions = [
        c for c in getattr(base, "_weight_conversions", None) or [] if not isinstance(c, _UnsavableStacks)
    ]
    base._weight_conversions = [_UnsavableStacks(held), *conversions]
