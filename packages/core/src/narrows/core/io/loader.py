"""The block-streamed loader: a causal LM built from its checkpoint folder one decoder
layer at a time, so the full float model never exists in memory.

1. The model is built from config.json with its parameters on the meta device (buffers
   such as RoPE frequencies are computed for real, as in a normal construction).
2. Every checkpoint tensor is assigned to the decoder layer it lands in, through
   transformers' own key renamings and converters (fused MoE experts, multimodal
   prefixes), and checked against the model's shapes from the headers alone.
3. The parts outside the layers (embedding, final norm, head) are read first; then each
   layer's tensors are read with plain file reads (no memory map, so host RSS counts
   only what is held), loaded through transformers' converters, quantised to NF4 (a
   mixture of experts' routed experts to NF4, NF3 or NF2) on `device` (the GPU when there is one) with the very code of `quantize_nf4`, moved to
   the CPU and handed to ``on_layer`` — which may pack it into a slab, write it to a
   cache or a disk tier — before the next layer is read.

A pre-quantised bitsandbytes 4-bit checkpoint loads its packed weights and quantisation
state as they are (never dequantised); so does a release's MXFP4 expert stacks (gpt-oss's),
as `LowbitStack.of_mxfp4` codes, unless a scheme is asked for (they are then decoded to bf16,
exactly, and quantised again). Peak host memory: the final footprint plus one
layer's source tensors and its quantised copy, plus the largest non-layer tensor.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from ..errors import NarrowsError
from ..optional import require
from ..protocol.anatomy import Anatomy, accepting_unannounced, anatomy_of
from ..protocol.handle import state_of
from ..protocol.verify import ensure_architecture
from ..quant.experts import EXPERT_SCHEMES, guard_saving, install_lowbit_experts
from ..quant.lowbit import LowbitStack
from ..quant.nf4 import quantize_layer_nf4, say_precision
from .checkpoint import BNB_STATS, CheckpointFolder

log = logging.getLogger("narrows.core")

__all__ = ["LayerCallback", "load_blockwise", "map_tensor", "read_tensor"]

LayerCallback = Callable[[int, str, nn.Module], None]

_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
}


def read_tensor(folder: CheckpointFolder, name: str) -> torch.Tensor:
    """One tensor, read with a plain file read into memory narrows owns. An MXFP4 stack
    (`CheckpointFolder.packed`) is decoded to bf16 by transformers' own gpt-oss decoder:
    exactly, every FP4 value times a power of two being a bf16 value."""
    if name in folder.packed:
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        blocks, scales = (_read(info, name) for info in folder.packed[name])
        return convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    return _read(folder.tensors[name], name)


def read_mxfp4(folder: CheckpointFolder, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """An MXFP4 stack's codes and scales as stored, flattened per expert: uint8 [E, n/2] (two
    E2M1 codes a byte) and [E, n/32] (E8M0 exponents), n the weights of one expert — the
    `LowbitStack.of_mxfp4` layout."""
    blocks, scales = (_read(info, name) for info in folder.packed[name])
    experts = blocks.shape[0]
    return blocks.reshape(experts, -1), scales.reshape(experts, -1)


def _read(info, name: str) -> torch.Tensor:
    if info.dtype not in _DTYPES:
        raise NarrowsError(f"{info.file}: tensor {name!r} has dtype {info.dtype}, which narrows cannot load")
    buf = torch.empty(info.nbytes, dtype=torch.uint8)
    with open(info.file, "rb") as f:
        f.seek(info.offset)
        if f.readinto(memoryview(buf.numpy())) != info.nbytes:
            raise NarrowsError(
                f"{info.file} ended while reading {name!r}; the file is truncated, re-download it"
            )
    return buf.view(_DTYPES[info.dtype]).reshape(info.shape)


def map_tensor(folder: CheckpointFolder, name: str) -> torch.Tensor | None:
    """One tensor as a read-only memory map of the checkpoint file where it lies (None
    when its dtype cannot be viewed there): the kernel's page cache holds its bytes, once
    for every process that maps the file. Nothing may write to it."""
    import warnings

    import numpy as np

    info = folder.tensors[name]
    dtype = _DTYPES.get(info.dtype)
    if dtype is None or name in folder.packed or info.offset % dtype.itemsize:
        return None
    area = np.memmap(info.file, dtype=np.uint8, mode="r", offset=info.offset, shape=(info.nbytes,))
    with warnings.catch_warnings():  # a read-only array as a tensor: nothing writes it
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(area).view(dtype).reshape(info.shape)


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Build modules with their parameters on the meta device and their buffers for real."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _structure(model: nn.Module) -> Anatomy:
    """Where the layers are. An unannounced architecture is loaded too: the caller checks it
    on its shrunk twin before anything trains (``load_causal_lm`` does)."""
    with accepting_unannounced():
        return anatomy_of(model)


def skeleton(folder: CheckpointFolder, dtype: torch.dtype) -> nn.Module:
    """The folder's model with every parameter on the meta device: its modules and shapes,
    no weight read and no memory taken."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder.path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # narrows places the 4-bit layers itself
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model


class _Mapping:
    """Checkpoint key -> model key, through the model's own renamings and converters."""

    def __init__(self, model: nn.Module):
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        self.transforms = get_model_conversion_mapping(model)
        self.renamings = [t for t in self.transforms if isinstance(t, WeightRenaming)]
        self.converters = [t for t in self.transforms if isinstance(t, WeightConverter)]
        self.prefix = model.base_model_prefix
        self.meta = model.state_dict()

    def target(self, key: str) -> tuple[str, bool]:
        """(model key, whether a converter reshapes it); the key itself when nothing maps."""
        from transformers.core_model_loading import rename_source_key

        renamed, pattern = rename_source_key(key, self.renamings, self.converters, self.prefix, self.meta)
        if renamed not in self.meta and key in self.meta:
            return key, False
        return renamed, pattern is not None


def _plan_groups(model: nn.Module, folder: CheckpointFolder, mapping: _Mapping):
    """Checkpoint keys grouped by destination: [outside, layer 0, layer 1, ...], with the
    pre-quantised weights of each group apart; shapes checked against the model."""
    anat = _structure(model)
    prefixes = [p + "." for p in anat.layer_paths]
    groups: list[dict[str, str]] = [{} for _ in range(len(prefixes) + 1)]  # ckpt key -> model key
    quant: list[dict[str, str]] = [{} for _ in range(len(prefixes) + 1)]
    stats = {f"{w}.{s}" for w in folder.prequantized for s in BNB_STATS} | set(folder.prequantized.values())
    covered: set[str] = set()
    fused: dict[str, list[str]] = {}  # a converter's target -> the checkpoint tensors it is built from
    for key, info in folder.tensors.items():
        if key in stats:
            continue
        target, converted = mapping.target(key)
        if target not in mapping.meta:
            log.warning("narrows: checkpoint tensor %r is not used by %s", key, type(model).__name__)
            continue
        covered.add(target)
        if converted:
            fused.setdefault(target, []).append(key)
        shape = tuple(_bnb_state(folder, key)["shape"]) if key in folder.prequantized else info.shape
        expect = tuple(mapping.meta[target].shape)
        if not converted and shape != expect:
            raise NarrowsError(
                f"{info.file}: tensor {key!r} has shape {list(shape)}, but config.json makes {target!r} "
                f"{list(expect)}. The weights and config.json are from different models; re-download the folder."
            )
        g = next((i + 1 for i, p in enumerate(prefixes) if target.startswith(p)), 0)
        (quant if key in folder.prequantized else groups)[g][key] = target
    experts = _config_int(model.config, "num_local_experts", "num_experts", "n_routed_experts")
    for target, keys in fused.items():
        gap = _missing_sibling(keys, experts)
        if gap is not None:
            raise NarrowsError(
                f"{folder.path}: tensor {gap!r} is missing (the checkpoint has its siblings, "
                f"which together make {target!r}); the folder is incomplete: fetch it again."
            )
    for weight in folder.prequantized:
        state = _bnb_state(folder, weight)
        for stat in ("nested_absmax", "nested_quant_map"):
            if "nested_blocksize" in state and f"{weight}.{stat}" not in folder.tensors:
                raise NarrowsError(
                    f"{folder.path}: 4-bit tensor {weight!r} is double-quantised but has no "
                    f"{stat!r} beside it; the checkpoint is incomplete"
                )
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    buffers = {n for n, b in model.named_buffers() if b.device.type != "meta"}
    missing = sorted(set(mapping.meta) - covered - tied - buffers)
    if missing:
        raise NarrowsError(
            f"{folder.path}: {len(missing)} weight(s) of {type(model).__name__} are not in the checkpoint "
            f"(first: {missing[0]!r}); the folder is incomplete or holds another model."
        )
    return groups, quant


def _config_int(config: object, *names: str) -> int | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return next((int(getattr(text, n)) for n in names if isinstance(getattr(text, n, None), int)), None)


def _missing_sibling(keys: list[str], count: int | None) -> str | None:
    """A checkpoint tensor missing from a numbered family (expert 0..n-1) that a converter
    fuses: the families are the keys with one number replaced, `count` their expected size."""
    families: dict[tuple[str, str], set[int]] = {}
    for key in keys:
        parts = key.split(".")
        for i, p in enumerate(parts):
            if p.isdigit() and i > 0 and parts[i - 1] != "layers":
                families.setdefault((".".join(parts[:i]), ".".join(parts[i + 1 :])), set()).add(int(p))
    for (head, tail), present in families.items():
        expected = max(count or 0, max(present) + 1)
        missing = sorted(set(range(expected)) - present)
        if missing and len(present) > 1:
            return f"{head}.{missing[0]}.{tail}"
    return None


def _bnb_state(folder: CheckpointFolder, weight: str) -> dict:
    raw = read_tensor(folder, folder.prequantized[weight])
    return json.loads(bytes(raw.numpy()).decode())


def _load_float(
    model: nn.Module,
    folder: CheckpointFolder,
    keys: dict[str, str],
    mapping: _Mapping,
    dtype: torch.dtype,
    read: Callable[[str], torch.Tensor],
) -> None:
    if not keys:
        return
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig
    from transformers.utils import logging as hf_logging

    state = {k: read(k) for k in keys}
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    # transformers asks the model for its state dict on every call; with 4-bit layers that
    # serialises every quantisation state each time (quadratic in depth). The skeleton's
    # names and shapes are all it needs.
    model.state_dict = lambda *a, **k: mapping.meta
    try:
        # the tensors the model keeps in float32 whatever its dtype (DeepSeek-V3's routing bias)
        plan = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
        config = LoadStateDictConfig(
            device_map={"": "cpu"}, dtype=dtype, dtype_plan=plan, weight_mapping=mapping.transforms
        )
        info, _ = convert_and_load_state_dict_in_model(model, state, config)
    finally:
        del model.state_dict
        if bar:
            hf_logging.enable_progress_bar()
    problems = list(info.mismatched_keys) + list(info.conversion_errors.items())
    if problems:
        raise NarrowsError(
            f"{folder.path}: could not load {problems[0]!r}; the weights do not fit config.json"
        )


def _bnb_keys(folder: CheckpointFolder, weight: str) -> list[str]:
    extra = [f"{weight}.{s}" for s in BNB_STATS if f"{weight}.{s}" in folder.tensors]
    return [weight, *extra, folder.prequantized[weight]]


def _load_prequantized(
    model: nn.Module,
    folder: CheckpointFolder,
    keys: dict[str, str],
    compute_dtype: torch.dtype,
    read: Callable[[str], torch.Tensor],
) -> None:
    """Linear4bit modules built from the packed weights and their stored quantisation state."""
    if not keys:
        return
    bnb = require("bitsandbytes", "loading a bitsandbytes 4-bit checkpoint")
    for key, target in keys.items():
        state = _bnb_state(folder, key)
        data = read(key)
        d_out, d_in = state["shape"]
        blocksize = int(state["blocksize"])
        absmax = folder.tensors.get(f"{key}.absmax")
        if data.numel() * 2 != d_out * d_in or absmax is None or absmax.shape[0] * blocksize < d_out * d_in:
            raise NarrowsError(
                f"{folder.path}: 4-bit tensor {key!r} does not match its quantisation state (shape {state['shape']}, "
                f"blocksize {blocksize}, {data.numel()} packed bytes); the checkpoint is damaged or was written "
                "by another tool. narrows loads NF4 checkpoints saved by transformers + bitsandbytes."
            )
        stats = {s: read(f"{key}.{s}") for s in BNB_STATS if f"{key}.{s}" in folder.tensors}
        stats["quant_state.bitsandbytes__nf4"] = read(folder.prequantized[key])
        module_path = target.rpartition(".")[0]
        parent_path, _, attr = module_path.rpartition(".")
        parent = model.get_submodule(parent_path)
        old = getattr(parent, attr)
        q = bnb.nn.Linear4bit(
            d_in,
            d_out,
            bias=old.bias is not None,
            compute_dtype=compute_dtype,
            compress_statistics="nested_absmax" in stats,
            quant_type="nf4",
            device="meta",
        )
        q.weight = bnb.nn.Params4bit.from_prequantized(
            data, stats, requires_grad=False, device="cpu", module=q
        )
        if old.bias is not None:
            q.bias = old.bias  # still meta: the float loader fills it
        q.support_avx512bf16_for_cpu = False
        q.train(old.training)
        setattr(parent, attr, q)


def load_blockwise(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.bfloat16,
    quant: str | None = None,
    experts: str | None = None,
    device: torch.device | str | None = None,
    on_layer: LayerCallback | None = None,
    fill_layer: Callable[[int, str, nn.Module], bool] | None = None,
) -> nn.Module:
    """A causal LM from the checkpoint folder at `path`, built one decoder layer at a time.

    `dtype`: the float dtype of the model (and the NF4 compute dtype). `quant="nf4"`
    quantises each decoder layer's linears as `quantize_nf4` does (double quantisation,
    block size 64) on `device` (default: CUDA when available) and brings them back to the
    CPU, and a mixture of experts' fused stacks to `experts` ("nf4", the default; "nf3" or
    "nf2": see `quantize_nf4`); a release's MXFP4 stacks stay MXFP4 (``experts`` None or
    "mxfp4"; dequantised per pass, exactly) whatever `quant` says, and a pre-quantised
    bitsandbytes NF4 checkpoint is loaded as it is whatever `quant` says. ``on_layer(index, path, layer)`` is called once each layer is complete, before
    the next is read (a pre-quantised layer carries ``narrows_file_sources``: the file
    and offset of each tensor it holds verbatim, by address, so a disk tier can read
    them in place). ``fill_layer(index, path, layer)`` is asked first: when it returns
    True it has filled the skeleton layer itself (from a prepared cache) and the
    checkpoint's tensors for that layer are not read. The model is returned on the CPU in eval mode, checked for support.
    """
    folder = CheckpointFolder(path)
    folder.check_model_type()
    stored = folder.check_quantization()
    if quant not in (None, "none", "nf4"):
        raise NarrowsError(f"quant={quant!r}: narrows quantises to 'nf4' or loads float ('none')")
    # float weights whose config.json asks for NF4 are quantised, as transformers would
    quantise = stored is None and (quant == "nf4" or folder.asks_nf4)
    if experts not in (None, "mxfp4", *EXPERT_SCHEMES):
        raise NarrowsError(
            f"experts={experts!r}: narrows quantises expert stacks to one of {EXPERT_SCHEMES}, or keeps a "
            "release's MXFP4 ones ('mxfp4')"
        )
    if experts == "mxfp4" and not folder.packed:
        raise NarrowsError(
            f"experts='mxfp4' keeps the MXFP4 expert stacks a release stores (gpt-oss's); {folder.path} has none"
        )
    # a release's MXFP4 stacks stay MXFP4 unless a scheme is asked for: their codes are kept
    # and dequantised per pass (exactly), not decoded to bf16 as they load
    keep_mxfp4 = bool(folder.packed) and experts in (None, "mxfp4")
    if experts not in (None, "nf4", "mxfp4") and not quantise:
        raise NarrowsError(
            f"experts={experts!r} sets how the routed experts are quantised along with the linears: "
            + (
                f"{folder.path} is already quantised, and loads as stored"
                if stored
                else "load with quant='nf4'"
            )
        )
    if quantise or stored:
        require("bitsandbytes", "NF4 quantisation")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model = skeleton(folder, dtype)
    ensure_architecture(model, "head")  # an unannounced one is checked on its twin before anything is read
    mapping = _Mapping(model)
    groups, quant_groups = _plan_groups(model, folder, mapping)
    anat = _structure(model)

    def keys_of(g: int) -> list[str]:
        return list(groups[g]) + [k for w in quant_groups[g] for k in _bnb_keys(folder, w)]

    def fetch(k: str):
        return read_mxfp4(folder, k) if keep_mxfp4 and k in folder.packed else read_tensor(folder, k)

    def read_all(g: int) -> dict[str, torch.Tensor]:
        return {k: fetch(k) for k in keys_of(g)}

    def load(g: int, state: dict[str, torch.Tensor]) -> dict[int, tuple[str, int, int]]:
        """Load group `g`; returns where each tensor read lies in the checkpoint, by address."""
        sources = {}

        def read(k: str) -> torch.Tensor:
            t = state.pop(k) if k in state else read_tensor(folder, k)
            info = folder.tensors[k]
            if k not in folder.packed:  # a decoded stack lies nowhere in the files as it is
                sources[t.data_ptr()] = (str(info.file), info.offset, info.nbytes)
            return t

        kept = {k: m for k, m in groups[g].items() if keep_mxfp4 and k in folder.packed}
        _load_prequantized(model, folder, quant_groups[g], dtype, read)
        _load_float(
            model, folder, {k: m for k, m in groups[g].items() if k not in kept}, mapping, dtype, read
        )
        for k, target in kept.items():
            codes, scales = state.pop(k) if k in state else read_mxfp4(folder, k)
            parent, _, attr = target.rpartition(".")
            stack = LowbitStack.of_mxfp4(tuple(mapping.meta[target].shape), dtype)
            install_lowbit_experts(model.get_submodule(parent), {attr: (codes, scales, stack)})
        return sources

    load(0, {})
    n = len(anat.layers)
    # the next layer is read from disk while this one is quantised (not when a cache fills layers)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="narrows-read") as pool:
        ahead = pool.submit(read_all, 1) if fill_layer is None and n else None
        for i, (lpath, layer) in enumerate(zip(anat.layer_paths, anat.layers)):
            if fill_layer is not None and fill_layer(i, lpath, layer):
                if on_layer is not None:
                    on_layer(i, lpath, layer)
                continue
            state = ahead.result() if ahead is not None else {}
            ahead = pool.submit(read_all, i + 2) if ahead is not None and i + 1 < n else None
            sources = load(i + 1, state)
            del state
            if stored:  # a pre-quantised layer's tensors are the checkpoint's bytes: say where they lie
                layer.narrows_file_sources = sources
            if quantise:
                quantize_layer_nf4(
                    layer,
                    lpath,
                    compute_dtype=dtype,
                    device=device,
                    park="cpu",
                    experts=experts if experts in EXPERT_SCHEMES else "nf4",  # kept MXFP4 stacks stay
                )
            if on_layer is not None:
                on_layer(i, lpath, layer)
            layer.__dict__.pop("narrows_file_sources", None)  # only the callback reads it
    model.tie_weights()
    left = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if left:
        raise NarrowsError(f"{folder.path}: {left[0]!r} was not loaded; the checkpoint is incomplete")
    if quantise or stored:
        model.is_loaded_in_4bit = True
    if quantise or keep_mxfp4:
        say_precision(model)  # a float base's linears are named as such
        guard_saving(model)  # quantised expert stacks: save_pretrained refuses, by name
    model.eval()
    state_of(model).checkpoint = Path(folder.path)  # where it came from
    return model
