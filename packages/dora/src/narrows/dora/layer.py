"""narrows' own DoRA layer, `DoraLinear`, and the DoRA delta it shares with the PEFT path.

`use_narrows_dora`'s PEFT layers and `DoraLinear` call `dora_delta` with the same arguments
in the same order, so both give bit-identical outputs and gradients for the same adapter
weights. `DoraLinear` keeps PEFT's initialisation, dtype rules and tensor names on disk.

why: docs/design.md#one-dora-step-two-front-doors
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable

import torch
from torch import Tensor, nn

from narrows.core import dequantize_nf4, is_nf4_linear, nf4_rows

from .compose import compose, magnitude_scale
from .norm import Weight, base_row_norm_sq, factored_row_norm, sqrt_rn

__all__ = ["DoraLinear", "dora_delta"]

# ||W||²_row per DoRA layer, outside the module: a derived value, not state (it is neither
# trained nor a frozen tensor the forward reads, so it must not be a slot or in a state dict)
_BASE_SQ: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, Tensor]] = weakref.WeakKeyDictionary()


def _base_sq(owner: nn.Module, base_layer: nn.Module, weight: Weight) -> Tensor:
    """||W||²_row, computed once per frozen weight.

    The key is the stored base weight's identity: its storage address, version counter,
    shape, dtype and device. Re-quantising or editing the base, or narrows-stream pointing
    it at another buffer, changes the key, so the cache never serves a stale norm (a
    streamed base is recomputed whenever its storage moves).
    """
    stored = base_layer.weight
    key = (stored.data_ptr(), stored._version, tuple(stored.shape), stored.dtype, stored.device)
    cached = _BASE_SQ.get(owner)
    if cached is None or cached[0] != key:
        cached = (key, base_row_norm_sq(weight))
        _BASE_SQ[owner] = cached
    return cached[1]


def _rows_of(base_layer: nn.Module) -> Weight | None:
    """A 4-bit base as row slices (the norm then never holds its full float copy), or None:
    a float base is used as it is, and a 4-bit one whose width is not a whole number of
    quantisation blocks is dequantised in full."""
    if not is_nf4_linear(base_layer):
        return None
    try:
        return nf4_rows(base_layer)
    except ValueError:
        return None


def dora_delta(
    owner: nn.Module,
    x: Tensor,
    *,
    lora_A: nn.Module,
    lora_B: nn.Module,
    scaling: float,
    magnitude: Tensor,
    base_layer: nn.Module,
    base_result: Tensor | None,
    full_weight: Callable[[], Tensor],
) -> Tensor:
    """What DoRA adds to the base output: (g - 1)·(W x) + g·s·B A x, g = m / ||W + sBA||_row.

    `base_result` is the base layer's output for `x` (bias included), or None when `x` is
    not the base layer's input (LoRA dropout on): W x is then recomputed from
    `full_weight()`. `owner` keys the ||W||² cache.
    """
    weight = _rows_of(base_layer) if base_result is not None else None
    if weight is None:
        weight = full_weight()
    base_sq = _base_sq(owner, base_layer, weight)
    norm = factored_row_norm(weight, lora_A.weight, lora_B.weight, scaling, base_sq=base_sq)
    g = magnitude_scale(magnitude, norm, x.dtype)
    lora_result = lora_B(lora_A(x))
    if base_result is not None:
        if base_layer.bias is not None:
            base_result = base_result - base_layer.bias
    else:
        base_result = nn.functional.linear(x, weight.to(x.dtype))
    return compose(base_result, lora_result, g, scaling)


def _dequantized(base_layer: nn.Module) -> Tensor:
    if is_nf4_linear(base_layer):
        return dequantize_nf4(base_layer.weight.data, base_layer.weight.quant_state)
    return base_layer.weight


class DoraLinear(nn.Module):
    """A frozen linear layer (float or bitsandbytes 4-bit) with one DoRA adapter.

    Parameters: ``lora_A.weight`` [r, d_in], ``lora_B.weight`` [d_out, r] and ``magnitude``
    [d_out]; the base layer's own parameters are frozen. ``scaling`` is alpha / r (alpha / √r
    with `use_rslora`). `adapter_dtype` defaults to fp32, as PEFT's does for half-precision
    and 4-bit bases.
    """

    def __init__(
        self,
        base_layer: nn.Module,
        *,
        r: int,
        alpha: float,
        dropout: float = 0.0,
        use_rslora: bool = False,
        adapter_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if not (isinstance(base_layer, nn.Linear) or is_nf4_linear(base_layer)):
            raise TypeError(
                f"DoraLinear wraps nn.Linear or a bitsandbytes Linear4bit, not {type(base_layer).__name__}; "
                "leave that module out of target_modules"
            )
        if r <= 0:
            raise ValueError(f"the DoRA rank must be positive, got r={r}")
        self.base_layer = base_layer
        self.in_features, self.out_features = base_layer.in_features, base_layer.out_features
        self.r, self.alpha, self.use_rslora = r, alpha, use_rslora
        self.scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
        device = base_layer.weight.device
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.lora_A = nn.Linear(self.in_features, r, bias=False, device=device, dtype=adapter_dtype)
        self.lora_B = nn.Linear(r, self.out_features, bias=False, device=device, dtype=adapter_dtype)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        weight = _rows_of(base_layer)
        # the root `assemble_norm` takes, so a fresh adapter (B = 0) has g = m / ||W|| = 1 exactly
        norm = sqrt_rn(base_row_norm_sq(weight if weight is not None else _dequantized(base_layer)))
        self.magnitude = nn.Parameter(norm.to(adapter_dtype))
        for p in base_layer.parameters():
            p.requires_grad_(False)
        self.disabled = False

    @property
    def weight(self) -> Tensor:
        """The base layer's weight (code that reads ``proj.weight.dtype`` keeps working)."""
        return self.base_layer.weight

    @property
    def bias(self) -> Tensor | None:
        return self.base_layer.bias

    def forward(self, x: Tensor) -> Tensor:
        result = self.base_layer(x)
        if self.disabled:
            return result
        dtype = result.dtype
        # PEFT's rules: a float base casts the input to the adapter dtype always, a 4-bit one
        # only outside autocast; the output returns to the base output's dtype the same way
        cast = not (is_nf4_linear(self.base_layer) and torch.is_autocast_enabled())
        if cast and x.dtype != self.lora_A.weight.dtype:
            x = x.to(self.lora_A.weight.dtype)
        if isinstance(self.lora_dropout, nn.Identity) or not self.training:
            base_result = result
        else:
            x = self.lora_dropout(x)
            base_result = None
        result = result + dora_delta(
            self,
            x,
            lora_A=self.lora_A,
            lora_B=self.lora_B,
            scaling=self.scaling,
            magnitude=self.magnitude,
            base_layer=self.base_layer,
            base_result=base_result,
            full_weight=lambda: _dequantized(self.base_layer),
        )
        return result.to(dtype) if cast else result

    def extra_repr(self) -> str:
        return f"r={self.r}, alpha={self.alpha}, scaling={self.scaling:g}, dropout={getattr(self.lora_dropout, 'p', 0.0)}"
