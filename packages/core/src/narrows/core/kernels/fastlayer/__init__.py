"""Fast decoder layers: the Llama family's layer as one autograd node with a written-out
backward, LoRA in the activation dtype on tensor cores (float32 masters and gradients),
library kernels for the element-wise ops, and a recompute that skips what the backward
does not need. `fuse_layers(model)` for a resident model; `narrows.stream` runs the same
entry points (`compute`) for a streamed one, so the two train the same bits."""

from . import compute
from .adapter_math import mm_f32
from .fuse import FastLayerFunction, FuseReport, coverage, fuse_layers, is_fused, unfuse_layers
from .lora import Linear, LinearGroup
from .ops import kernels_in_use
from .parts import FAST_LAYER_TYPES, LayerParts, parts_of, parts_or_none, why_not
from .stacking import side_by_side

__all__ = [
    "FAST_LAYER_TYPES",
    "FastLayerFunction",
    "FuseReport",
    "LayerParts",
    "Linear",
    "LinearGroup",
    "compute",
    "coverage",
    "fuse_layers",
    "is_fused",
    "kernels_in_use",
    "mm_f32",
    "parts_of",
    "parts_or_none",
    "side_by_side",
    "unfuse_layers",
    "why_not",
]
