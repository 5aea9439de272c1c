"""DoRA on a plain transformers model without PEFT: `add_dora`, `save_dora`, `load_dora`,
and the core adapter type that lets narrows-stream, narrows-lmhead and narrows-eval see
`DoraLinear` layers.

A saved adapter is a PEFT adapter folder (``adapter_config.json`` with ``use_dora: true``,
``adapter_model.safetensors`` with PEFT's tensor names), so
``PeftModel.from_pretrained(base, folder)`` loads it, and `load_dora` loads one PEFT saved.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor, nn

from narrows.core import NarrowsError, is_nf4_linear, register_adapter_type, registered_adapter_types
from narrows.core.io.files import atomic_write

from .layer import DoraLinear

__all__ = ["DEFAULT_TARGETS", "NarrowsDoraAdapter", "add_dora", "dora_layers", "load_dora", "save_dora"]

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

_PREFIX = "base_model.model."  # PEFT's key prefix for a PeftModel's wrapped model
_WEIGHTS, _CONFIG = "adapter_model.safetensors", "adapter_config.json"


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_nf4_linear(module)


def _targets(model: nn.Module, target_modules: str | Iterable[str]) -> list[str]:
    """Module names PEFT would pick for `target_modules`: ``"all-linear"`` (every linear but
    the output head), a regex that must match the whole name, or names matched as the last
    components of a module's path."""
    inside = {n for n, m in model.named_modules() if isinstance(m, DoraLinear)}
    linears = [
        n
        for n, m in model.named_modules()
        if _is_linear(m) and not any(n.startswith(d + ".") for d in inside)
    ]
    if target_modules == "all-linear":
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        return [n for n in linears if model.get_submodule(n) is not head]
    if isinstance(target_modules, str):
        return [n for n in linears if re.fullmatch(target_modules, n)]
    wanted = list(target_modules)
    return [n for n in linears if any(n == t or n.endswith("." + t) for t in wanted)]


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _freeze_base(model: nn.Module) -> None:
    """Freeze every parameter but the adapter weights of DoRA layers already there."""
    adapter = {
        id(p)
        for m in model.modules()
        if isinstance(m, DoraLinear)
        for p in (m.lora_A.weight, m.lora_B.weight, m.magnitude)
    }
    for p in model.parameters():
        if id(p) not in adapter:
            p.requires_grad_(False)


def dora_layers(model: nn.Module) -> dict[str, DoraLinear]:
    """Every `DoraLinear` in `model`, by module name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, DoraLinear)}


def add_dora(
    model: nn.Module,
    *,
    r: int = 8,
    alpha: float = 16,
    dropout: float = 0.0,
    target_modules: str | Iterable[str] = DEFAULT_TARGETS,
    use_rslora: bool = False,
    adapter_dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """Wrap the targeted linear layers of `model` in `DoraLinear` (in place) and freeze
    everything else but DoRA layers already there; returns `model`. Targets follow PEFT's
    ``target_modules`` rules."""
    names = _targets(model, target_modules)
    if not names:
        sample = [n for n, m in model.named_modules() if _is_linear(m)][:6]
        raise ValueError(
            f"target_modules={target_modules!r} matches no linear layer of {type(model).__name__}; "
            f"its linear layers are named like {sample}"
        )
    _freeze_base(model)
    for name in names:
        layer = DoraLinear(
            model.get_submodule(name),
            r=r,
            alpha=alpha,
            dropout=dropout,
            use_rslora=use_rslora,
            adapter_dtype=adapter_dtype,
        )
        _replace(model, name, layer)
    return model


def _config(layers: dict[str, DoraLinear], base_model_name_or_path: str | None) -> dict:
    first = next(iter(layers.values()))
    ranks = {n: m.r for n, m in layers.items()}
    alphas = {n: m.alpha for n, m in layers.items()}
    dropouts = {getattr(m.lora_dropout, "p", 0.0) for m in layers.values()}
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": first.r,
        "lora_alpha": first.alpha,
        "rank_pattern": {n: v for n, v in ranks.items() if v != first.r},
        "alpha_pattern": {n: v for n, v in alphas.items() if v != first.alpha},
        "lora_dropout": max(dropouts),
        "use_dora": True,
        "use_rslora": first.use_rslora,
        # the exact module names: PEFT matches a listed name against the end of each path
        "target_modules": sorted(layers),
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def save_dora(model: nn.Module, path: str | Path, *, base_model_name_or_path: str | None = None) -> Path:
    """Save every `DoraLinear` of `model` as a PEFT adapter folder (each file replaced
    atomically; the weights before the config, as PEFT does)."""
    from safetensors.torch import save_file

    layers = dora_layers(model)
    if not layers:
        raise ValueError(
            "no DoraLinear layer in this model: call add_dora(model, ...) or load_dora(...) first"
        )
    if len({m.use_rslora for m in layers.values()}) > 1:
        raise ValueError("layers mix use_rslora=True and False; PEFT's adapter_config.json holds one value")
    tensors: dict[str, Tensor] = {}
    for name, m in layers.items():
        key = _PREFIX + name
        tensors[f"{key}.lora_A.weight"] = m.lora_A.weight.detach().contiguous().cpu()
        tensors[f"{key}.lora_B.weight"] = m.lora_B.weight.detach().contiguous().cpu()
        tensors[f"{key}.lora_magnitude_vector"] = m.magnitude.detach().contiguous().cpu()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    atomic_write(path / _WEIGHTS, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
    config = json.dumps(_config(layers, base_model_name_or_path), indent=2)
    atomic_write(path / _CONFIG, lambda tmp: tmp.write_text(config + "\n"))
    return path


def _read(path: Path) -> tuple[dict, dict[str, dict[str, Tensor]]]:
    from safetensors.torch import load_file

    config_file, weights_file = path / _CONFIG, path / _WEIGHTS
    if not config_file.is_file() or not weights_file.is_file():
        raise NarrowsError(
            f"{path} is not a PEFT adapter folder: it needs {_CONFIG} and {_WEIGHTS} "
            "(what save_dora or PEFT's save_pretrained write)"
        )
    config = json.loads(config_file.read_text())
    if config.get("peft_type") != "LORA" or not config.get("use_dora"):
        raise NarrowsError(
            f"{path} holds a {config.get('peft_type')} adapter without use_dora: load it with "
            "peft.PeftModel.from_pretrained (load_dora reads DoRA adapters only)"
        )
    if config.get("fan_in_fan_out") or config.get("alpha_pattern"):
        raise NarrowsError(
            f"{path}: fan_in_fan_out / alpha_pattern are not supported by load_dora; load it with "
            "peft.PeftModel.from_pretrained and call narrows.dora.use_narrows_dora on the result"
        )
    modules: dict[str, dict[str, Tensor]] = {}
    roles = {".lora_A.weight": "A", ".lora_B.weight": "B", ".lora_magnitude_vector": "m"}
    for key, t in load_file(str(weights_file)).items():
        suffix = next((s for s in roles if key.endswith(s)), None)
        if suffix is None or not key.startswith(_PREFIX):
            raise NarrowsError(
                f"{path}: tensor {key!r} is not a DoRA linear weight (embedding, bias or modules_to_save "
                "tensors are not supported by load_dora; use PEFT for this adapter)"
            )
        modules.setdefault(key[len(_PREFIX) : -len(suffix)], {})[roles[suffix]] = t
    return config, modules


def load_dora(
    model: nn.Module, path: str | Path, *, trainable: bool = False, dropout: float | None = None
) -> nn.Module:
    """Load a PEFT DoRA adapter folder (from `save_dora` or PEFT) into `model`: each adapted
    linear becomes a `DoraLinear` holding the saved weights (frozen unless `trainable`);
    everything else but DoRA layers already there is frozen, as PEFT does. Returns `model`."""
    path = Path(path)
    config, modules = _read(path)
    missing = [n for n in modules if not _has(model, n)]
    if missing:
        raise NarrowsError(
            f"{path} adapts {missing[:3]}, which {type(model).__name__} does not have: "
            "load it into the base model it was trained on"
        )
    alpha, rslora = config["lora_alpha"], config.get("use_rslora", False)
    p = config.get("lora_dropout", 0.0) if dropout is None else dropout
    _freeze_base(model)
    for name, t in modules.items():
        if set(t) != {"A", "B", "m"}:
            raise NarrowsError(f"{path}: {name} lacks {sorted({'A', 'B', 'm'} - set(t))} of its DoRA tensors")
        target = model.get_submodule(name)
        if not isinstance(target, DoraLinear):
            target = DoraLinear(
                target,
                r=t["A"].shape[0],
                alpha=alpha,
                dropout=p,
                use_rslora=rslora,
                adapter_dtype=t["A"].dtype,
            )
            _replace(model, name, target)
        with torch.no_grad():
            for param, saved in (
                (target.lora_A.weight, t["A"]),
                (target.lora_B.weight, t["B"]),
                (target.magnitude, t["m"]),
            ):
                if param.shape != saved.shape:
                    raise NarrowsError(
                        f"{path}: {name} holds {tuple(saved.shape)}, the layer {tuple(param.shape)}"
                    )
                param.copy_(saved)
        for param in (target.lora_A.weight, target.lora_B.weight, target.magnitude):
            param.requires_grad_(trainable)
    return model


def _has(model: nn.Module, name: str) -> bool:
    try:
        module = model.get_submodule(name)
    except AttributeError:
        return False
    return _is_linear(module) or isinstance(module, DoraLinear)


class NarrowsDoraAdapter:
    """`DoraLinear` as the core adapter protocol sees it."""

    name = "narrows-dora"

    def matches(self, module: nn.Module) -> bool:
        return isinstance(module, DoraLinear)

    def base_layer(self, module: nn.Module) -> nn.Module:
        return module.base_layer

    def trainable(self, module: nn.Module) -> dict[str, tuple[str, nn.Parameter]]:
        roles = {"lora_A.weight": "lora_A", "lora_B.weight": "lora_B", "magnitude": "magnitude"}
        return {n: (roles[n], p) for n, p in module.named_parameters() if n in roles and p.requires_grad}

    def variant(self, module: nn.Module) -> str:
        return "dora"


if not any(t.name == NarrowsDoraAdapter.name for t in registered_adapter_types()):
    register_adapter_type(NarrowsDoraAdapter(), first=True)
