"""Fast decoder layers: the Llama family's layer (and the MoE families', DeepSeek-V3's
latent attention among them) as one autograd node with a written-out
backward, LoRA in the activation dtype on tensor cores (float32 masters and gradients),
library kernels for the element-wise ops, and a recompute that skips what the backward
does not need. One object a layer (`FastLayer`) is the door both take: `fuse_layers(model)`
makes it a resident layer's forward; `narrows.stream` runs its entry points for a streamed
one, so the two train the same bits."""

from . import compute
from .adapter_math import mm_f32
from .fuse import FastLayers, FuseReport, coverage, fuse_layers, is_fused, unfuse_layers
from .layer import FastCall, FastLayer, FastLayerFunction, parts_of, parts_or_none, read_call, why_not
from .lora import Linear, LinearGroup
from .ops import kernels_in_use
from .parts import FAST_LAYER_TYPES, LayerParts
from .stacking import side_by_side

__all__ = [
    "FAST_LAYER_TYPES",
    "FastCall",
    "FastLayer",
    "FastLayerFunction",
    "FastLayers",
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
    "read_call",
    "side_by_side",
    "unfuse_layers",
    "why_not",
]
