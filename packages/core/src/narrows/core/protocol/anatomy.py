"""Model anatomy: where a Hugging Face causal LM keeps its decoder layers, embedding,
final norm and LM head.

Found by structure; the architecture table records the announced ``model_type`` values.
Any other type is refused until checked on a shrunk twin in this process
(`narrows.core.verify_architecture`), never silently half-supported.

why: docs/design.md#anatomy
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

from torch import nn

from ..errors import UnsupportedArchitectureError
from .logits import KNOWN_LOGIT_OPS, LOGIT_OPS, LogitMath

__all__ = [
    "Anatomy",
    "ArchitectureSpec",
    "accepting_unannounced",
    "anatomy_of",
    "is_announced",
    "mark_verified",
    "register_architecture",
    "submodules",
    "supported_architectures",
    "unwrap_model",
]


@dataclass(frozen=True)
class ArchitectureSpec:
    """What narrows knows about one ``config.model_type``.

    Paths are dotted attribute paths from the causal-LM module (PEFT wrappers removed);
    ``None`` means "find it by structure", which is right for every HF decoder-only LM
    that follows the ``model.model.layers`` convention.
    """

    model_type: str
    layers: str | None = None
    embed: str | None = None
    norm: str | None = None
    head: str | None = None
    # what the model does to the head's output before the loss, as (operation, config key)
    # pairs applied in order: "multiply", "divide" or "softcap" (see head.LogitMath)
    logits: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for op, _ in self.logits:
            if op not in LOGIT_OPS:
                raise ValueError(f"ArchitectureSpec.logits: unknown operation {op!r}; use one of {LOGIT_OPS}")


_ARCHITECTURES: dict[str, ArchitectureSpec] = {}


def register_architecture(spec: ArchitectureSpec, *, replace: bool = False) -> None:
    """Declare a ``model_type`` supported. Third parties call this for a new architecture."""
    if spec.model_type in _ARCHITECTURES and not replace:
        raise ValueError(
            f"architecture {spec.model_type!r} is already registered; pass replace=True to override it"
        )
    _ARCHITECTURES[spec.model_type] = spec


def supported_architectures() -> tuple[str, ...]:
    return tuple(sorted(_ARCHITECTURES))


_SOFTCAP = (("softcap", "final_logit_softcapping"),)
for _spec in (
    ArchitectureSpec("llama"),
    ArchitectureSpec("mistral"),
    ArchitectureSpec("qwen2"),
    ArchitectureSpec("qwen3"),
    ArchitectureSpec("gemma2", logits=_SOFTCAP),
    ArchitectureSpec("gemma3_text", logits=_SOFTCAP),
    # the text tower of Gemma3ForConditionalGeneration: it applies no final softcapping
    # (only Gemma3ForCausalLM, model_type gemma3_text, does)
    ArchitectureSpec("gemma3"),
    ArchitectureSpec("phi3"),
    ArchitectureSpec("phi"),
    ArchitectureSpec("olmo2"),
    ArchitectureSpec("granite", logits=(("divide", "logits_scaling"),)),
    ArchitectureSpec("stablelm"),
    ArchitectureSpec("cohere", logits=(("multiply", "logit_scale"),)),
    ArchitectureSpec("cohere2", logits=(("multiply", "logit_scale"),)),
    ArchitectureSpec("starcoder2"),
    ArchitectureSpec("gpt_neox"),
    ArchitectureSpec("mixtral"),
    ArchitectureSpec("qwen2_moe"),
    ArchitectureSpec("qwen3_moe"),
    ArchitectureSpec("olmoe"),
    ArchitectureSpec("llama4_text"),
    ArchitectureSpec("gpt_oss"),
    ArchitectureSpec("glm4_moe"),
    ArchitectureSpec("deepseek_v3"),
):
    register_architecture(_spec)

_VERIFIED: set[str] = set()  # model types checked on a shrunk twin in this process
_ACCEPTING = ContextVar("narrows_accepting_unannounced", default=False)


def mark_verified(model_type: str) -> None:
    """Accept an unannounced ``model_type`` for the rest of the process (after its twin passed)."""
    _VERIFIED.add(model_type)


def is_announced(model_type: str) -> bool:
    return model_type in _ARCHITECTURES


@contextmanager
def accepting_unannounced() -> Iterator[None]:
    """Let `anatomy_of` describe any model whose structure it finds (the twin check runs
    inside this; so do tests that probe architectures)."""
    token = _ACCEPTING.set(True)
    try:
        yield
    finally:
        _ACCEPTING.reset(token)


@dataclass(frozen=True)
class Anatomy:
    """The parts of a causal LM that narrows moves, replaces or trains around."""

    model_type: str
    model: nn.Module  # the causal LM itself, PEFT wrappers removed
    decoder: nn.Module  # the backbone holding layers, embedding and final norm
    layers: nn.ModuleList
    embed: nn.Module
    norm: nn.Module
    head: nn.Module
    tied: bool  # head and embedding share one weight tensor
    layer_paths: tuple[str, ...]  # qualified names of the layers inside `model`
    logit_math: LogitMath = field(default_factory=LogitMath)
    announced: bool = True  # in the architecture table (False: accepted after its twin check)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def config(self):
        """The decoder's config (a multimodal model's text config): widths, vocabulary."""
        return self.model.config.get_text_config()


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip PEFT's ``PeftModel`` / tuner wrappers and return the transformers model."""
    seen = 0
    while seen < 4:
        seen += 1
        if hasattr(model, "get_base_model") and callable(model.get_base_model):
            model = model.get_base_model()
        elif type(model).__module__.startswith("peft.") and isinstance(
            getattr(model, "model", None), nn.Module
        ):
            model = model.model
        else:
            break
    return model


def _get(root: nn.Module, path: str) -> nn.Module:
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _base_weight(module: nn.Module):
    base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
    return getattr(base, "weight", None)


def _find_layers(decoder: nn.Module, n_layers: int | None) -> tuple[str, nn.ModuleList] | None:
    """The child ModuleList of `decoder` holding `n_layers` blocks of one class."""
    candidates = []
    for name, child in decoder.named_children():
        if not isinstance(child, nn.ModuleList) or len(child) == 0:
            continue
        if len({type(m) for m in child}) != 1:
            continue
        if n_layers is not None and len(child) != n_layers:
            continue
        candidates.append((name, child))
    if len(candidates) == 1:
        return candidates[0]
    named = [c for c in candidates if c[0] == "layers"]
    return named[0] if named else None


def _find_norm(decoder: nn.Module) -> nn.Module | None:
    if isinstance(getattr(decoder, "norm", None), nn.Module):
        return decoder.norm
    norms = [
        m for n, m in decoder.named_children() if "norm" in n.lower() and not isinstance(m, nn.ModuleList)
    ]
    return norms[-1] if len(norms) == 1 else None


def _layer_paths(lm: nn.Module, layers: nn.ModuleList) -> tuple[str, ...]:
    """Qualified names of `layers` in `lm`. The walk stops at the list, which comes early in
    the module tree: the head's per-step lookups made a full walk over a 7B PEFT model's
    modules twice a step."""
    for name, m in lm.named_modules():
        if m is layers:
            names = {id(c): n for n, c in layers.named_children()}
            if all(id(layer) in names for layer in layers):
                return tuple(f"{name}.{names[id(layer)]}" if name else names[id(layer)] for layer in layers)
            break
    prefix = {id(m): n for n, m in lm.named_modules()}
    return tuple(prefix[id(layer)] for layer in layers)


def anatomy_of(model: nn.Module) -> Anatomy:
    """Find the decoder layers, embedding, final norm and head of a causal LM.

    Accepts a transformers model or one wrapped by PEFT whose ``config.model_type`` is
    announced or has passed `narrows.core.verify_architecture` in this process.
    """
    lm = unwrap_model(model)
    config = getattr(lm, "config", None)
    model_type = getattr(config, "model_type", None)
    spec = _ARCHITECTURES.get(model_type) if model_type else None
    how_to_register = (
        "`narrows.core.verify_architecture(model)` checks it on a shrunk twin (same class, 2 layers, small "
        "widths) and accepts it when streamed, resident and the model's own loss agree exactly — "
        "narrows.stream.stream(), narrows.lmhead.apply() and `narrows finetune` run that check themselves. "
        "To announce it, register "
        f"`narrows.core.register_architecture(narrows.core.ArchitectureSpec({model_type!r}, ...))` "
        "with dotted paths for parts structure cannot find and its logit arithmetic."
    )
    announced = spec is not None
    if not announced and model_type not in _VERIFIED and not _ACCEPTING.get():
        raise UnsupportedArchitectureError(
            f"narrows does not announce model_type={model_type!r} ({type(lm).__name__}). "
            f"Announced: {', '.join(supported_architectures())}. {how_to_register}"
        )
    spec = spec or ArchitectureSpec(str(model_type), logits=KNOWN_LOGIT_OPS)

    missing: list[str] = []
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else getattr(lm, "model", None)
    if not isinstance(decoder, nn.Module) or decoder is lm:  # Llama4ForCausalLM returns itself
        decoder = getattr(lm, "model", None)
    if not isinstance(decoder, nn.Module):
        raise UnsupportedArchitectureError(
            f"{type(lm).__name__} has no decoder backbone: looked for `get_decoder()` and a `.model` "
            f"attribute. {how_to_register}"
        )

    n_layers = getattr(config, "num_hidden_layers", None)
    if spec.layers:
        layers = _get(lm, spec.layers)
    else:
        found = _find_layers(decoder, n_layers)
        layers = found[1] if found else None
        if layers is None:
            missing.append(
                f"a ModuleList of config.num_hidden_layers={n_layers} identical blocks in the decoder"
            )

    embed = _get(lm, spec.embed) if spec.embed else lm.get_input_embeddings()
    if embed is None:
        missing.append("input embeddings (`get_input_embeddings()`)")
    head = _get(lm, spec.head) if spec.head else lm.get_output_embeddings()
    if head is None:
        missing.append("an LM head (`get_output_embeddings()`)")
    norm = _get(lm, spec.norm) if spec.norm else _find_norm(decoder)
    if norm is None:
        missing.append("a final norm (`decoder.norm`)")
    if missing:
        raise UnsupportedArchitectureError(
            f"could not find the parts of {type(lm).__name__} (model_type={model_type!r}): missing "
            + "; ".join(missing)
            + ". Register an ArchitectureSpec with explicit dotted paths via "
            "`narrows.core.register_architecture(...)`."
        )

    layer_paths = _layer_paths(lm, layers)
    head_w, embed_w = _base_weight(head), _base_weight(embed)
    tied = head_w is not None and head_w is embed_w
    return Anatomy(
        model_type=str(model_type),
        model=lm,
        decoder=decoder,
        layers=layers,
        embed=embed,
        norm=norm,
        head=head,
        tied=tied,
        layer_paths=layer_paths,
        logit_math=LogitMath.of(spec.logits, config),
        announced=announced,
    )


def submodules(module: nn.Module) -> list[nn.Module]:
    """`module`'s submodules in ``modules()``' order, itself left out, walked without its
    names and memo (what runs at every layer call)."""
    out, stack = [], [m for m in reversed(module._modules.values()) if m is not None]
    while stack:
        child = stack.pop()
        out.append(child)
        stack.extend(m for m in reversed(child._modules.values()) if m is not None)
    return out
