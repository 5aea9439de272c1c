"""Test helpers that ship with narrows-core: tiny random models of every supported
architecture and the adapter-layer protocol's contract suite. Imported only by tests."""

from .adapters import ADAPTER_KINDS, with_adapter
from .contract import (
    check_adapter_views,
    check_gradients_flow,
    check_layer_swap_roundtrip,
    check_partition,
    check_slots_cover_forward,
    forward_backward,
    reachable_tensors,
    run_contract,
)
from .folders import CHATML, mxfp4_folder, tiny_model_folder, tiny_tokenizer, write_jsonl
from .maps import mapped_file, mapping_memory
from .processes import child_env, interruptible, private_cache, under_triton_interpreter
from .runs import finetune_cli
from .stacks import StackWatch, watch_expert_stacks
from .tiny import TINY_ARCHITECTURES, tiny_batch, tiny_config, tiny_model

__all__ = [
    "ADAPTER_KINDS",
    "CHATML",
    "TINY_ARCHITECTURES",
    "StackWatch",
    "check_adapter_views",
    "check_gradients_flow",
    "check_layer_swap_roundtrip",
    "check_partition",
    "check_slots_cover_forward",
    "child_env",
    "finetune_cli",
    "forward_backward",
    "interruptible",
    "mapped_file",
    "mapping_memory",
    "mxfp4_folder",
    "private_cache",
    "reachable_tensors",
    "run_contract",
    "tiny_batch",
    "tiny_config",
    "tiny_model",
    "tiny_model_folder",
    "tiny_tokenizer",
    "under_triton_interpreter",
    "watch_expert_stacks",
    "with_adapter",
    "write_jsonl",
]
