"""narrows.core — the hallway every narrows package talks through.

Model anatomy, the adapter protocol, frozen slots and slabs, NF4 quantisation
(``narrows-core[nf4]``), PEFT's LoRA branches as one node, the fast layers
(`fuse_layers`), checkpoints read one decoder layer at a time, the LM-head hook, memory
and sizes, architecture checks on shrunk twins, deterministic kernels, optional
packages, and inference loading. Siblings import only this package, never each other.

why: docs/design.md#core
"""

from typing import TYPE_CHECKING

from .lazy import lazy_attributes as _lazy_attributes
from .notices import install as _install_notices
from .versions import installed_version as _installed_version

_install_notices()  # third-party messages a user cannot act on, silenced before anything imports them

if TYPE_CHECKING:
    # adapter protocol
    # a base plus an adapter, loaded for inference
    from .app.inference import AdapterChoice, InferenceModel, choose_adapter, load_base, load_for_inference

    # errors
    from .errors import MissingDependencyError, NarrowsError, SlotMismatchError, UnsupportedArchitectureError
    from .io.checkpoint import CheckpointFolder
    from .io.loader import load_blockwise

    # fast decoder layers (their own bits; the same resident and streamed)
    from .kernels.fastlayer import FastLayers, FuseReport, fuse_layers, unfuse_layers

    # LoRA branches as one autograd node each (same bits as PEFT)
    from .kernels.lora_branches import LoraBranch, fuse_lora, lora_branch_reference, unfuse_lora

    # memory
    from .memory import MemoryPeaks, format_bytes, measure_peaks, parse_bytes, read_peaks, reset_peaks

    # optional packages
    from .optional import distribution_version, is_available, require
    from .protocol.adapters import (
        AdapterType,
        AdapterView,
        PeftLoraAdapter,
        adapter_type_of,
        adapter_view,
        adapter_views,
        register_adapter_type,
        registered_adapter_types,
    )

    # checkpoints, read one decoder layer at a time
    from .protocol.ambient import Ambient, ambient_as, ambient_state

    # anatomy
    from .protocol.anatomy import (
        Anatomy,
        ArchitectureSpec,
        anatomy_of,
        is_announced,
        register_architecture,
        supported_architectures,
        unwrap_model,
    )

    # narrows' transforms of a model, each given as its config, in the one order that works
    from .protocol.compose import apply
    from .protocol.determinism import data_parallel_bytes, deterministic, rank_ordered_sum

    # default LoRA targets (a mixture of experts' routers and routed experts left frozen, and said)
    from .protocol.expert_adapters import ExpertAdapter, adopt_quantized_experts, unwrap_experts

    # LM-head hook
    from .protocol.head import (
        DEFAULT_HEAD_ROWS,
        HeadSource,
        HeadSweep,
        ResidentHead,
        attach_head_source,
        chunked_logits,
        head_source,
        head_sweep,
        loss_working_set,
        set_loss_working_set,
        sharing_head_pass,
    )
    from .protocol.logits import LogitMath

    # frozen storage
    from .protocol.slab import SLAB_ALIGNMENT, SlabEntry, SlabLayout
    from .protocol.slots import (
        FrozenSlot,
        assign,
        copies,
        frozen_slots,
        pointed_at,
        snapshot,
        trainable_parameters,
    )
    from .protocol.targets import LoraTargets, lora_targets

    # architecture checks
    from .protocol.twin import shrink_config, shrunk_twin, side_output_overrides
    from .protocol.verify import (
        ArchitectureCheckError,
        ensure_architecture,
        register_architecture_check,
        verify_architecture,
    )
    from .quant.dequantize import dequantize_nf4

    # NF4: linears and fused expert stacks (these in NF3 / NF2 too); what stays in float, and why
    from .quant.experts import (
        EXPERT_SCHEMES,
        MoEBlock,
        absmax_name,
        dequantized_expert_bytes,
        expert_names,
        expert_scheme,
        expert_shape,
        install_lowbit_experts,
        install_nf4_experts,
        is_nf4_experts,
        is_quantized_experts,
        lowbit_stacks,
        moe_blocks,
        quantize_experts,
    )
    from .quant.held import HeldWeights, dequantized_bytes, held_bytes, held_token, held_weight
    from .quant.lowbit import LowbitStack, normal_float_levels
    from .quant.nf4 import (
        NF4Rows,
        disable_cpu_repacking,
        is_nf4_linear,
        nf4_parameter,
        nf4_recipe,
        nf4_rows,
        nf4_state,
        quantize_layer_nf4,
        quantize_nf4,
    )
    from .quant.report import ExpertStacks, KeptInFloat, Precision, precision

# each module -> the public names it holds, imported on first use (PEP 562): `narrows --help`
# and the other light entry points never import torch
_MODULES = {
    "protocol.adapters": (
        "AdapterType",
        "AdapterView",
        "PeftLoraAdapter",
        "adapter_type_of",
        "adapter_view",
        "adapter_views",
        "register_adapter_type",
        "registered_adapter_types",
    ),
    "protocol.ambient": ("Ambient", "ambient_as", "ambient_state"),
    "protocol.anatomy": (
        "Anatomy",
        "ArchitectureSpec",
        "anatomy_of",
        "is_announced",
        "register_architecture",
        "supported_architectures",
        "unwrap_model",
    ),
    "io.checkpoint": ("CheckpointFolder",),
    "protocol.determinism": ("data_parallel_bytes", "deterministic", "rank_ordered_sum"),
    "errors": ("MissingDependencyError", "NarrowsError", "SlotMismatchError", "UnsupportedArchitectureError"),
    "protocol.head": (
        "DEFAULT_HEAD_ROWS",
        "HeadSource",
        "HeadSweep",
        "ResidentHead",
        "attach_head_source",
        "chunked_logits",
        "head_source",
        "head_sweep",
        "loss_working_set",
        "set_loss_working_set",
        "sharing_head_pass",
    ),
    "app.inference": ("AdapterChoice", "InferenceModel", "choose_adapter", "load_base", "load_for_inference"),
    "kernels.fastlayer": ("FastLayers", "FuseReport", "fuse_layers", "unfuse_layers"),
    "protocol.compose": ("apply",),
    "io.loader": ("load_blockwise",),
    "protocol.logits": ("LogitMath",),
    "kernels.lora_branches": ("LoraBranch", "fuse_lora", "lora_branch_reference", "unfuse_lora"),
    "memory": ("MemoryPeaks", "format_bytes", "measure_peaks", "parse_bytes", "read_peaks", "reset_peaks"),
    "quant.nf4": (
        "NF4Rows",
        "disable_cpu_repacking",
        "is_nf4_linear",
        "nf4_parameter",
        "nf4_recipe",
        "nf4_rows",
        "nf4_state",
        "quantize_layer_nf4",
        "quantize_nf4",
    ),
    "quant.experts": (
        "EXPERT_SCHEMES",
        "MoEBlock",
        "absmax_name",
        "dequantized_expert_bytes",
        "expert_names",
        "expert_scheme",
        "expert_shape",
        "install_lowbit_experts",
        "install_nf4_experts",
        "is_nf4_experts",
        "is_quantized_experts",
        "lowbit_stacks",
        "moe_blocks",
        "quantize_experts",
    ),
    "quant.lowbit": ("LowbitStack", "normal_float_levels"),
    "quant.dequantize": ("dequantize_nf4",),
    "quant.report": ("ExpertStacks", "KeptInFloat", "Precision", "precision"),
    "protocol.targets": ("LoraTargets", "lora_targets"),
    "protocol.expert_adapters": ("ExpertAdapter", "adopt_quantized_experts", "unwrap_experts"),
    "quant.held": ("HeldWeights", "dequantized_bytes", "held_bytes", "held_token", "held_weight"),
    "optional": ("distribution_version", "is_available", "require"),
    "protocol.slab": ("SLAB_ALIGNMENT", "SlabEntry", "SlabLayout"),
    "protocol.slots": (
        "FrozenSlot",
        "assign",
        "copies",
        "frozen_slots",
        "pointed_at",
        "snapshot",
        "trainable_parameters",
    ),
    "protocol.twin": ("shrink_config", "shrunk_twin", "side_output_overrides"),
    "protocol.verify": (
        "ArchitectureCheckError",
        "ensure_architecture",
        "register_architecture_check",
        "verify_architecture",
    ),
}
_LAZY = {name: module for module, names in _MODULES.items() for name in names}
__getattr__, __dir__ = _lazy_attributes(__name__, _LAZY)

__version__ = _installed_version("narrows-core")


__all__ = [
    "DEFAULT_HEAD_ROWS",
    "EXPERT_SCHEMES",
    "SLAB_ALIGNMENT",
    "AdapterChoice",
    "AdapterType",
    "AdapterView",
    "Ambient",
    "Anatomy",
    "ArchitectureCheckError",
    "ArchitectureSpec",
    "CheckpointFolder",
    "ExpertAdapter",
    "ExpertStacks",
    "FastLayers",
    "FrozenSlot",
    "FuseReport",
    "HeadSource",
    "HeadSweep",
    "HeldWeights",
    "InferenceModel",
    "KeptInFloat",
    "LogitMath",
    "LoraBranch",
    "LoraTargets",
    "LowbitStack",
    "MemoryPeaks",
    "MissingDependencyError",
    "MoEBlock",
    "NF4Rows",
    "NarrowsError",
    "PeftLoraAdapter",
    "Precision",
    "ResidentHead",
    "SlabEntry",
    "SlabLayout",
    "SlotMismatchError",
    "UnsupportedArchitectureError",
    "__version__",
    "absmax_name",
    "adapter_type_of",
    "adapter_view",
    "adapter_views",
    "adopt_quantized_experts",
    "ambient_as",
    "ambient_state",
    "anatomy_of",
    "apply",
    "assign",
    "attach_head_source",
    "choose_adapter",
    "chunked_logits",
    "copies",
    "data_parallel_bytes",
    "dequantize_nf4",
    "dequantized_bytes",
    "dequantized_expert_bytes",
    "deterministic",
    "disable_cpu_repacking",
    "distribution_version",
    "ensure_architecture",
    "expert_names",
    "expert_scheme",
    "expert_shape",
    "format_bytes",
    "frozen_slots",
    "fuse_layers",
    "fuse_lora",
    "head_source",
    "head_sweep",
    "held_bytes",
    "held_token",
    "held_weight",
    "install_lowbit_experts",
    "install_nf4_experts",
    "is_announced",
    "is_available",
    "is_nf4_experts",
    "is_nf4_linear",
    "is_quantized_experts",
    "load_base",
    "load_blockwise",
    "load_for_inference",
    "lora_branch_reference",
    "lora_targets",
    "loss_working_set",
    "lowbit_stacks",
    "measure_peaks",
    "moe_blocks",
    "nf4_parameter",
    "nf4_recipe",
    "nf4_rows",
    "nf4_state",
    "normal_float_levels",
    "parse_bytes",
    "pointed_at",
    "precision",
    "quantize_experts",
    "quantize_layer_nf4",
    "quantize_nf4",
    "rank_ordered_sum",
    "read_peaks",
    "register_adapter_type",
    "register_architecture",
    "register_architecture_check",
    "registered_adapter_types",
    "require",
    "reset_peaks",
    "set_loss_working_set",
    "sharing_head_pass",
    "shrink_config",
    "shrunk_twin",
    "side_output_overrides",
    "snapshot",
    "supported_architectures",
    "trainable_parameters",
    "unfuse_layers",
    "unfuse_lora",
    "unwrap_experts",
    "unwrap_model",
    "verify_architecture",
]
