"""Loading a causal LM and its tokenizer from a local HF folder or a GGUF file.

Nothing here reaches a hub: a path that does not exist is an error, not a repo id. A GGUF
file (llama.cpp) is dequantised to float by transformers once, which takes tens of
seconds; the float model is then cached as an HF folder under ``$NARROWS_CACHE/gguf/``
keyed by the file's sha256, so later runs load it in about a second.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..errors import NarrowsError
from ..optional import require
from ..protocol.verify import ensure_architecture
from .files import atomic_dir, cache_dir
from .fingerprint import file_sha256  # one hash per file and process: the run's fingerprint reuses it
from .loader import LayerCallback, load_blockwise

__all__ = ["file_sha256", "gguf_as_folder", "load_causal_lm", "resolve_model_path"]


def gguf_as_folder(path: str | os.PathLike) -> Path:
    """An HF folder (config, fp32 safetensors, tokenizer) holding the GGUF file's model."""
    path = Path(path)
    folder = cache_dir("gguf") / file_sha256(path)[:24]
    if (folder / "config.json").is_file():
        return folder
    require("gguf", "loading a GGUF model file")
    _check_gguf(path)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with atomic_dir(folder) as tmp:
        kw = {"gguf_file": path.name}
        try:
            tokenizer = AutoTokenizer.from_pretrained(path.parent, **kw)
            model = AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **kw)
        except (ValueError, KeyError, IndexError) as e:  # UnicodeDecodeError is a ValueError
            raise NarrowsError(
                f"{path}: transformers cannot read this GGUF file ({type(e).__name__}: "
                f"{_first_line(e)}); re-export it, or give the model's HF folder"
            ) from None
        # transformers refuses to save a GGUF-loaded model while it is marked quantised;
        # the weights are plain float tensors by now
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return folder


def _first_line(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:200] if lines else ""


def _check_gguf(path: Path) -> None:
    """Refuse a file that starts with GGUF's magic but whose header does not parse, or that
    names no architecture or tensor, before transformers spends time on it."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as e:  # the reader raises whatever its parse meets first
        raise NarrowsError(
            f"{path} starts like a GGUF file but its header does not parse ({type(e).__name__}: "
            f"{_first_line(e)}); the file is damaged or not GGUF: re-download or re-export it"
        ) from None
    if "general.architecture" not in reader.fields or not reader.tensors:
        raise NarrowsError(
            f"{path} is a GGUF file without a model (no general.architecture or no tensors); "
            "give the GGUF file of a model"
        )


def resolve_model_path(path: str | os.PathLike) -> Path:
    """The HF folder behind `path`: the folder itself, or a ``.gguf`` file's cached float folder."""
    path = Path(path).expanduser()
    if not path.exists():
        raise NarrowsError(
            f"model path {str(path)!r} does not exist. Give a local folder with config.json and "
            "*.safetensors, or a .gguf file (narrows never downloads from a model hub)."
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise NarrowsError(
                f"{str(path)!r} is a file but not a .gguf; give a model folder or a GGUF file."
            )
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise NarrowsError(
                f"{str(path)!r} is named .gguf but is not a GGUF file (it starts with {magic!r}, "
                "not b'GGUF'); re-download or re-export it"
            )
        path = gguf_as_folder(path)
    elif not (path / "config.json").is_file():
        raise NarrowsError(f"{str(path)!r} has no config.json; it is not a Hugging Face model folder.")
    return path


def load_causal_lm(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    quant: str | None = None,
    device: torch.device | str | None = None,
    on_layer: LayerCallback | None = None,
    load: Callable[[Path], nn.Module] | None = None,
    experts: str | None = None,
) -> tuple[nn.Module, object]:
    """(model, tokenizer) from a local HF folder or a ``.gguf`` file, checked for support.

    The model is built one decoder layer at a time (`load_blockwise`): `quant="nf4"`
    quantises each layer on `device` as it arrives, and a pre-quantised bitsandbytes NF4
    folder loads as stored, so host memory peaks near the final footprint, never at the
    float model. The model is on the CPU in `dtype`, in eval mode; callers move it.
    `load(folder)` replaces that build (narrows-stream's ``from_pretrained``, which also
    places each layer in a host tier); the checks and the tokenizer stay the same.
    `experts`: a mixture of experts' routed experts' scheme with `quant="nf4"` (`load_blockwise`).
    """
    path = resolve_model_path(path)
    from transformers import AutoTokenizer

    if load is None:
        model = load_blockwise(
            path, dtype=dtype, quant=quant, device=device, on_layer=on_layer, experts=experts
        )
    else:
        model = load(path)
    ensure_architecture(model, "head")  # an unannounced architecture is checked on its twin first
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer
