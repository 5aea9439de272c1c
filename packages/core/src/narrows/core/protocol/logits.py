"""What an architecture does to its LM head's output before the loss.

Most causal LMs compute ``logits = h @ W.T (+ b)`` and hand them to cross-entropy. Some
do more: Cohere multiplies by ``config.logit_scale``, Granite divides by
``config.logits_scaling``, Gemma 2/3 softcap with ``final_logit_softcapping``. A loss that
reads the head through core's hook (narrows-lmhead's tiles, a streamed head) must apply
the same arithmetic, or training silently optimises a different objective from the one
the model evaluates. Architectures declare it in `ArchitectureSpec.logits`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["KNOWN_LOGIT_OPS", "LOGIT_OPS", "LogitMath"]

LOGIT_OPS = ("multiply", "divide", "softcap")
# the config keys transformers' causal LMs use for them: the guess for an architecture
# that is not announced (verified on its shrunk twin before training)
KNOWN_LOGIT_OPS = (
    ("multiply", "logit_scale"),
    ("divide", "logits_scaling"),
    ("softcap", "final_logit_softcapping"),
)


@dataclass(frozen=True)
class LogitMath:
    """The model's arithmetic between ``h @ W.T + b`` and the loss, in this order:
    ``z * multiply``, ``z / divide``, ``softcap * tanh(z / softcap)`` (each when set).

    Losses apply it in fp32 after upcasting the head's output; the model's own forward
    applies it in the head dtype, so the two agree up to that rounding.
    """

    multiply: float | None = None  # Cohere: logits * config.logit_scale
    divide: float | None = None  # Granite: logits / config.logits_scaling
    softcap: float | None = None  # Gemma 2/3: final_logit_softcapping

    @property
    def identity(self) -> bool:
        return self.multiply is None and self.divide is None and self.softcap is None

    @property
    def scale(self) -> float:
        """The linear part alone (multiply / divide)."""
        return (self.multiply or 1.0) / (self.divide or 1.0)

    def apply_(self, z: Tensor) -> Tensor:
        """Apply to raw logits in place (pass a fresh tensor) and return them."""
        if self.multiply is not None:
            z.mul_(self.multiply)
        if self.divide is not None:
            z.div_(self.divide)
        if self.softcap is not None:
            z.div_(self.softcap).tanh_().mul_(self.softcap)
        return z

    def __call__(self, z: Tensor) -> Tensor:
        """Out of place, differentiable: what a plain full-logits loss applies."""
        if self.multiply is not None:
            z = z * self.multiply
        if self.divide is not None:
            z = z / self.divide
        if self.softcap is not None:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z

    def derivative(self, z: Tensor) -> Tensor | float | None:
        """d(final logit) / d(raw logit) given the FINAL logits `z`; None when 1."""
        if self.identity:
            return None
        if self.softcap is None:
            return self.scale
        d = 1.0 - (z / self.softcap) ** 2
        return d if self.scale == 1.0 else d.mul_(self.scale)

    @classmethod
    def of(cls, ops: tuple[tuple[str, str], ...], config: object) -> LogitMath:
        """From an architecture's declared ``(operation, config key)`` pairs and its config."""
        values: dict[str, float] = {}
        for op, key in ops:
            v = getattr(config, key, None)
            if v is not None and not (op == "softcap" and not v):
                values[op] = float(v)
        return cls(**values)
