"""NF4 quantisation of a causal LM's decoder layers through bitsandbytes, on CPU or CUDA:
their linears, and their fused mixture-of-experts stacks (`experts.py`: NF4 too, or NF3 /
NF2 codes of our own for the routed experts alone).

The result is what ``from_pretrained(..., quantization_config=BitsAndBytesConfig(
load_in_4bit=True, bnb_4bit_quant_type="nf4"))`` would build, done on a model already in
memory — so tests and benchmarks can make QLoRA bases from random weights without a hub.

The CPU trap: on CPUs with AVX512-BF16, bitsandbytes repacks a 4-bit weight *in place*
the first time it runs an eval-mode forward without grad (``generate``, any inference
pass). A repacked bias-free layer then passes no gradient to its input, so every LoRA
below it silently stops learning, and the storage that any snapshot holds goes stale.
Every Linear4bit that passes through narrows gets that repacking turned off.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import NarrowsError
from ..optional import require
from ..protocol.anatomy import anatomy_of
from .experts import EXPERT_SCHEMES, expert_names, guard_saving, quantize_experts

__all__ = [
    "NF4Rows",
    "disable_cpu_repacking",
    "is_nf4_linear",
    "nf4_parameter",
    "nf4_recipe",
    "nf4_rows",
    "nf4_state",
    "quantize_layer_nf4",
    "quantize_nf4",
]

log = logging.getLogger("narrows.core")


def is_nf4_linear(module: nn.Module) -> bool:
    import sys

    if "bitsandbytes" not in sys.modules:
        return False
    import bitsandbytes as bnb

    return isinstance(module, bnb.nn.Linear4bit)


def disable_cpu_repacking(model: nn.Module) -> int:
    """Turn off bitsandbytes' in-place CPU repacking on every Linear4bit in `model`.
    Returns how many layers were switched off.

    Raises NarrowsError if a layer was already repacked: the repacked state keeps its
    scales in bf16, so no inverse restores the original bits, and training on it would
    give wrong gradients. Call this (or quantise with `quantize_nf4`) before any inference.
    """
    touched, repacked = 0, []
    for name, m in model.named_modules():
        if not is_nf4_linear(m):
            continue
        if getattr(m, "support_avx512bf16_for_cpu", False):
            m.support_avx512bf16_for_cpu = False
            touched += 1
        if getattr(getattr(m.weight, "quant_state", None), "packing_format_for_cpu", False):
            repacked.append(name)
    if repacked:
        raise NarrowsError(
            f"{len(repacked)} 4-bit layers (first: {repacked[0]!r}) were repacked in place by bitsandbytes' CPU "
            "inference path: an eval-mode forward without grad (generate, evaluation) ran on a CPU with "
            "AVX512-BF16 before narrows saw the model. The repacking cannot be undone exactly, and training "
            "through it gives wrong gradients. Reload or re-quantise the model, and call "
            "narrows.core.disable_cpu_repacking(model) before any inference (narrows.core.quantize_nf4 does it)."
        )
    return touched


def _default_filter(name: str, module: nn.Module) -> bool:
    return True


def quantize_nf4(
    model: nn.Module,
    *,
    compute_dtype: torch.dtype | None = None,
    double_quant: bool = True,
    blocksize: int = 64,
    filter_fn: Callable[[str, nn.Module], bool] = _default_filter,
    device: torch.device | str | None = None,
    park: torch.device | str | None = None,
    experts: str = "nf4",
) -> nn.Module:
    """Replace every ``nn.Linear`` inside the decoder layers with a bitsandbytes NF4
    ``Linear4bit`` and every fused expert stack with `experts` codes (`quantize_experts`:
    "nf4", bitsandbytes' like the linears; "nf3" or "nf2", blockwise codes of our own with
    float32 block scales), in place, and return the model. A mixture of experts' shared
    experts and attention are linears, so they stay NF4 whatever `experts` says.

    Only decoder layers are quantised (as ``BitsAndBytesConfig`` does, the embedding and the
    LM head stay in float); what they keep in float is logged, each kind with why
    (`narrows.core.precision(model)` returns it; a tensor of no known kind is a warning).
    ``filter_fn(qualified_name, module)`` can exclude linears (by their name) and expert
    stacks (by the stack's name, ``….experts.gate_up_proj``). The
    quantisation runs on `device` (default: where each weight is) one layer at a time, so
    peak memory is one float layer above the quantised model. `park` moves each layer there
    once its linears are quantised (quantise on the GPU, keep a streamed base in host memory: the
    device never holds more than one layer). The model is flagged
    ``is_loaded_in_4bit`` so PEFT picks its 4-bit LoRA layer, as for a hub-loaded QLoRA base.
    """
    require("bitsandbytes", "NF4 quantisation")
    anat = anatomy_of(model)
    if compute_dtype is None:
        compute_dtype = next(p.dtype for p in anat.layers.parameters() if p.is_floating_point())
    n = 0
    for lpath, layer in zip(anat.layer_paths, anat.layers):
        n += quantize_layer_nf4(
            layer,
            lpath,
            compute_dtype=compute_dtype,
            double_quant=double_quant,
            blocksize=blocksize,
            filter_fn=filter_fn,
            device=device,
            park=park,
            experts=experts,
        )
    if n == 0:
        raise ValueError("quantize_nf4 found no nn.Linear inside the decoder layers to quantise")
    anat.model.is_loaded_in_4bit = True
    say_precision(model)
    guard_saving(anat.model)  # quantised expert stacks: save_pretrained refuses, by name
    return model


def say_precision(model: nn.Module) -> None:
    """Log what `model`'s decoder layers hold in 4 bits and keep in float: a warning when
    something is kept for no known reason, else at info level."""
    from .report import precision

    report = precision(model)
    (log.warning if report.unexplained else log.info)("narrows: %s", report)


def quantize_layer_nf4(
    layer: nn.Module,
    prefix: str,
    *,
    compute_dtype: torch.dtype,
    double_quant: bool = True,
    blocksize: int = 64,
    filter_fn: Callable[[str, nn.Module], bool] = _default_filter,
    device: torch.device | str | None = None,
    park: torch.device | str | None = None,
    experts: str = "nf4",
) -> int:
    """Quantise the ``nn.Linear`` modules and fused expert stacks (to `experts`) of one
    decoder layer (see `quantize_nf4`; the block-streamed loader calls this as each layer
    arrives). Returns how many."""
    if experts not in EXPERT_SCHEMES:
        raise ValueError(f"experts={experts!r}: routed experts are quantised to one of {EXPERT_SCHEMES}")
    bnb = require("bitsandbytes", "NF4 quantisation")
    n = 0
    for name, child in list(layer.named_modules()):
        if type(child) is not nn.Linear or not filter_fn(f"{prefix}.{name}", child):
            continue
        dev = torch.device(device) if device is not None else child.weight.device
        q = bnb.nn.Linear4bit(
            child.in_features,
            child.out_features,
            bias=child.bias is not None,
            compute_dtype=compute_dtype,
            compress_statistics=double_quant,
            quant_type="nf4",
            device="meta",
        )
        q.weight = bnb.nn.Params4bit(
            child.weight.data,
            requires_grad=False,
            blocksize=blocksize,
            compress_statistics=double_quant,
            quant_type="nf4",
            module=q,
        ).to(dev)
        if child.bias is not None:
            # same dtype as the compute: Linear4bit otherwise re-casts the bias storage
            # inside forward, which would move it out from under a frozen slot
            q.bias = nn.Parameter(child.bias.data.to(device=dev, dtype=compute_dtype), requires_grad=False)
        q.support_avx512bf16_for_cpu = False
        q.train(child.training)
        parent_name, _, attr = name.rpartition(".")
        setattr(layer.get_submodule(parent_name) if parent_name else layer, attr, q)
        n += 1
    for name, module in list(layer.named_modules()):
        stacks = [
            s for s in expert_names(module) if filter_fn(".".join(filter(None, (prefix, name, s))), module)
        ]
        if stacks:  # dequantised into their own dtype, the one the model's experts code computes in
            n += quantize_experts(
                module,
                scheme=experts,
                double_quant=double_quant,
                blocksize=blocksize,
                device=device,
                names=stacks,
            )
    if park is not None and n:
        layer.to(park)
    return n


@dataclass(frozen=True)
class NF4Rows:
    """Row slices of a 4-bit weight, dequantised on demand: a consumer that needs W only a
    few rows at a time (DoRA's row norm, for one) never holds the full-size float copy.

    ``rows(start, stop)`` returns rows [start, stop) of the [d_out, d_in] weight in its
    compute dtype, equal to the same rows of the full dequantisation.
    """

    shape: tuple[int, int]
    packed: torch.Tensor  # the flat packed 4-bit codes (two per byte)
    absmax: torch.Tensor  # fp32 per-block scales, already un-nested
    blocksize: int
    quant_type: str
    dtype: torch.dtype

    def rows(self, start: int, stop: int) -> torch.Tensor:
        d_in = self.shape[1]
        stop = min(stop, self.shape[0])
        first, last = start * d_in, stop * d_in
        return torch.ops.bitsandbytes.dequantize_4bit.default(
            self.packed[first // 2 : last // 2],
            self.absmax[first // self.blocksize : last // self.blocksize],
            self.blocksize,
            self.quant_type,
            [stop - start, d_in],
            self.dtype,
        )


def nf4_rows(module: nn.Module) -> NF4Rows:
    """The `NF4Rows` reader of a bitsandbytes ``Linear4bit``'s weight (its nested absmax
    dequantised once: one float per block). Needs in_features to be a multiple of the
    quantisation block size (true of every real model: rows then start on a block), and
    raises ValueError otherwise, so the caller can fall back to the full dequantisation."""
    if not is_nf4_linear(module):
        raise TypeError(f"nf4_rows needs a bitsandbytes Linear4bit, got {type(module).__name__}")
    from bitsandbytes.functional import dequantize_blockwise

    weight = module.weight
    qs = weight.quant_state
    if qs is None:
        raise NarrowsError("this Linear4bit holds no quantisation state yet: move it to its device first")
    if getattr(qs, "packing_format_for_cpu", False):
        raise NarrowsError(
            "this Linear4bit was repacked in place by bitsandbytes' CPU inference path; call "
            "narrows.core.disable_cpu_repacking(model) before any inference (see its docstring)"
        )
    absmax = qs.absmax
    if qs.nested:  # double quantisation: the block scales are themselves 8-bit blockwise
        absmax = (dequantize_blockwise(qs.absmax, qs.state2) + qs.offset).float()
    d_out, d_in = (int(x) for x in qs.shape)
    if d_in % qs.blocksize:
        raise ValueError(
            f"row slices need in_features ({d_in}) to be a multiple of the block size ({qs.blocksize})"
        )
    return NF4Rows(
        (d_out, d_in), weight.data.reshape(-1), absmax.float(), qs.blocksize, qs.quant_type, qs.dtype
    )


def nf4_recipe(quant_state) -> dict:
    """What rebuilds a bitsandbytes NF4 ``QuantState`` from its tensors alone (`nf4_state`):
    shape, block sizes, dtypes, nesting — JSON-ready."""
    qs = quant_state

    def name(dtype: torch.dtype) -> str:
        return str(dtype).removeprefix("torch.")

    return {
        "shape": list(qs.shape),
        "blocksize": qs.blocksize,
        "quant_type": qs.quant_type,
        "dtype": name(qs.dtype),
        "nested": bool(qs.nested),
        "nested_blocksize": qs.state2.blocksize if qs.nested else None,
        "nested_dtype": name(qs.state2.dtype) if qs.nested else None,
    }


def nf4_state(recipe: dict, tensors: dict[str, torch.Tensor], weight: str):
    """The ``QuantState`` of `recipe` over `tensors`, keyed as `frozen_slots` names a 4-bit
    parameter's state (``{weight}.quant_state.absmax``, ``….state2.absmax``, …)."""
    from bitsandbytes.functional import QuantState

    r, pre = recipe, f"{weight}.quant_state"
    state2 = None
    if r["nested"]:
        state2 = QuantState(
            absmax=tensors[f"{pre}.state2.absmax"],
            blocksize=r["nested_blocksize"],
            code=tensors[f"{pre}.state2.code"],
            dtype=getattr(torch, r["nested_dtype"]),
        )
    return QuantState(
        absmax=tensors[f"{pre}.absmax"],
        shape=torch.Size(r["shape"]),
        code=tensors[f"{pre}.code"],
        blocksize=r["blocksize"],
        quant_type=r["quant_type"],
        dtype=getattr(torch, r["dtype"]),
        offset=tensors.get(f"{pre}.offset"),
        state2=state2,
    )


def nf4_parameter(packed: torch.Tensor, quant_state):
    """A frozen bitsandbytes ``Params4bit`` over `packed` codes already quantised with
    `quant_state` (nothing is quantised again)."""
    import bitsandbytes as bnb

    return bnb.nn.Params4bit(
        packed,
        requires_grad=False,
        quant_state=quant_state,
        blocksize=quant_state.blocksize,
        compress_statistics=quant_state.nested,
        quant_type=quant_state.quant_type,
        quant_storage=packed.dtype,
        bnb_quantized=True,
    )
