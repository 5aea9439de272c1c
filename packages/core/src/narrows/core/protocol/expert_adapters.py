"""LoRA on fused expert stacks in PEFT's format: ``LoraConfig(target_parameters=[...])``
wraps each targeted stack (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``
[E, H, I]) in a ``lora.ParamWrapper``, one inside another, whose ``lora_A.weight`` is
(E·r, in) — expert e's A in rows e·r … e·r + r — and ``lora_B.weight`` (out, r·E), expert
e's B in columns j·E + e. Expert e's stack is then ``W_e + scaling · B_e A_e``.

`unwrap_experts` reads that nesting for the fast layer, which runs each adapter as
``(x · A_eᵀ) · B_eᵀ`` inside its grouped matmuls. `adopt_quantized_experts` makes PEFT's
wrappers over stacks `narrows.core.quant.experts` quantised run: PEFT folds the adapter
into the parameter itself (a parametrization in the parameter's dtype), which for packed
4-bit codes means nothing; the adopted wrapper hands its factors to the quantised module,
which adds them to the stack it dequantises for the call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import NarrowsError
from ..quant.experts import expert_shape, is_quantized_experts, under_wrappers

__all__ = ["ExpertAdapter", "adopt_quantized_experts", "expert_wrappers", "unwrap_experts"]


@dataclass(frozen=True)
class ExpertAdapter:
    """One stack's LoRA adapter: PEFT's masters, in PEFT's layout (see the module doc)."""

    a: nn.Parameter  # lora_A.weight, (E·r, in)
    b: nn.Parameter  # lora_B.weight, (out, r·E)
    scaling: float
    experts: int

    @property
    def rank(self) -> int:
        return self.a.shape[0] // self.experts

    def a_stack(self, dtype: torch.dtype) -> Tensor:
        """Every expert's A, [E, r, in] in `dtype` (a view where no cast is needed)."""
        return self.a.to(dtype).view(self.experts, self.rank, -1)

    def b_stack(self, dtype: torch.dtype) -> Tensor:
        """Every expert's B, [E, out, r] in `dtype`, contiguous."""
        b = self.b.view(self.b.shape[0], self.rank, self.experts).permute(2, 0, 1)
        return torch.empty(b.shape, dtype=dtype, device=b.device).copy_(b)

    def a_grad(self, g: Tensor) -> Tensor:
        """A's gradient in ``lora_A.weight``'s layout from one [E, r, in]."""
        return g.reshape(self.a.shape)

    def b_grad(self, g: Tensor) -> Tensor:
        """B's gradient in ``lora_B.weight``'s layout from one [E, out, r]."""
        return g.permute(1, 2, 0).reshape(self.b.shape)


def expert_wrappers(module: nn.Module) -> list[nn.Module]:
    """PEFT's ``ParamWrapper``s around an experts module, outermost first (none: [])."""
    out = []
    while under_wrappers(module) is not module:
        out.append(module)
        module = module.base_layer
    return out


def unwrap_experts(module: nn.Module) -> tuple[nn.Module, dict[str, ExpertAdapter]] | str:
    """The experts module under PEFT's wrappers and each wrapped stack's adapter by the
    stack's name; or why the fast layer does not compute them."""
    adapters: dict[str, ExpertAdapter] = {}
    wrappers = expert_wrappers(module)
    base = wrappers[-1].base_layer if wrappers else module
    for w in wrappers:
        name = w.parameter_name
        if w.merged or w.disable_adapters or len(w.active_adapters) != 1:
            return f"the LoRA on its experts' {name} is merged, disabled or has several active adapters"
        key = w.active_adapters[0]
        if key not in w.lora_A:
            continue
        a, b = w.lora_A[key], w.lora_B[key]
        if type(a) is not nn.Linear or type(b) is not nn.Linear or a.bias is not None or b.bias is not None:
            return f"the LoRA on its experts' {name} is not a plain pair of bias-free linears"
        if w._forward_hooks or w._forward_pre_hooks or a._forward_hooks or b._forward_hooks:
            return f"the LoRA on its experts' {name} has hooks"
        shape = expert_shape(base, name)
        # PEFT swaps in and out for [E, out, in] stacks, not for transposed [E, in, out] ones
        # (gpt-oss's); either way A is (E·r, in) and B (out, r·E), and x·ΔW_e = x·A_eᵀ·B_eᵀ
        transposed = bool(getattr(base, "is_transposed", False))
        if (
            len(shape) != 3
            or getattr(w, "num_experts", None) != shape[0]
            or w._did_swap_in_out_features == transposed
        ):
            layout = "[E, in, out]" if transposed else "[E, out, in]"
            return f"the LoRA on its experts' {name} does not match an {layout} stack {tuple(shape)}"
        adapters[name] = ExpertAdapter(a.weight, b.weight, float(w.scaling[key]), int(shape[0]))
    return base, adapters


def _quantized_wrapper_class() -> type:
    from peft.tuners.lora.layer import ParamWrapper

    class QuantizedStackLora(ParamWrapper):
        """PEFT's ``ParamWrapper`` over a stack narrows quantised: its factors go to the
        quantised module (``_lora_deltas``) for the call instead of into a parametrization."""

        def get_delta_factors(self, adapter_name: str) -> tuple[Tensor, Tensor, float]:
            dtype = _stack_dtype(self.get_base_layer(), self.parameter_name)
            a = self.lora_A[adapter_name].weight
            b = self.lora_B[adapter_name].weight
            a = a.reshape(self.num_experts, -1, a.shape[-1])  # (E, r, in)
            b = b.reshape(b.shape[0], -1, self.num_experts).permute(2, 0, 1)  # (E, out, r)
            return b.to(dtype), a.to(dtype), self.scaling[adapter_name]

        def _activate_lora(self, active_adapters: list[str]) -> Any:
            return _Deltas(self, [a for a in active_adapters if a in self.lora_A])

        def merge(self, *args: Any, **kwargs: Any) -> None:
            raise NarrowsError(
                f"the LoRA on quantised experts' {self.parameter_name} cannot be merged into their 4-bit codes; "
                "merge it into the unquantised model (load the base in bf16, then PeftModel.from_pretrained "
                "and merge_and_unload)"
            )

    return QuantizedStackLora


class _Deltas:
    """While a wrapper's forward runs: its adapter's factors on the quantised module."""

    def __init__(self, wrapper: nn.Module, adapters: list[str]):
        self.wrapper, self.adapters = wrapper, adapters

    def __enter__(self) -> None:
        if not self.adapters:
            return
        if len(self.adapters) > 1:
            raise NarrowsError("quantised experts run one active LoRA adapter at a time")
        base = self.wrapper.get_base_layer()
        deltas = dict(base._lora_deltas or {})
        deltas[self.wrapper.parameter_name] = self.wrapper.get_delta_factors(self.adapters[0])
        base._lora_deltas = deltas

    def __exit__(self, *exc: Any) -> None:
        base = self.wrapper.get_base_layer()
        if base._lora_deltas:
            base._lora_deltas.pop(self.wrapper.parameter_name, None)


def _stack_dtype(module: nn.Module, name: str) -> torch.dtype:
    """The dtype stack `name` of quantised `module` dequantises to."""
    from ..quant.experts import lowbit_stacks

    lowbit = lowbit_stacks(module)
    if name in lowbit:
        return lowbit[name].dtype
    return module._parameters[name].quant_state.dtype


_CLASS: list[type] = []


def adopt_quantized_experts(model: nn.Module) -> int:
    """Make PEFT's wrappers over quantised expert stacks in `model` run (see the module
    doc); returns how many were adopted. Idempotent; a model without any is left as it is."""
    adopted = 0
    for module in model.modules():
        wrappers = expert_wrappers(module)
        if not wrappers or not is_quantized_experts(wrappers[-1].base_layer):
            continue
        if not _CLASS:
            _CLASS.append(_quantized_wrapper_class())
        for w in wrappers:
            if type(w) is not _CLASS[0]:
                w.__class__ = _CLASS[0]
                adopted += 1
    return adopted
