"""The auxiliary losses a causal LM adds to its cross-entropy, reproduced when
narrows-lmhead replaces the model's loss.

A MoE model's router load-balancing loss is computed by the model's own function from its
own module with its own attributes and added as the model adds it; a model whose module
has no such function adds nothing. The twin check (`twincheck`) holds both to the model's loss.

why: docs/design.md#auxiliary-losses
"""

from __future__ import annotations

import sys
from typing import Any

from torch import Tensor, nn

from narrows.core import NarrowsError

__all__ = ["router_aux_loss"]


def router_aux_loss(
    lm: nn.Module, out: Any, output_router_logits: bool | None, attention_mask: Tensor | None
) -> Tensor | None:
    """The load-balancing loss `lm`'s own forward would compute for decoder output `out`
    (unweighted), or None when it would compute none."""
    wanted = (
        output_router_logits
        if output_router_logits is not None
        else getattr(lm.config, "output_router_logits", False)
    )
    balance = getattr(sys.modules.get(type(lm).__module__), "load_balancing_loss_func", None)
    if not wanted or balance is None:
        return None
    router_logits = getattr(out, "router_logits", None)
    missing = [
        a for a in ("num_experts", "num_experts_per_tok", "router_aux_loss_coef") if not hasattr(lm, a)
    ]
    if router_logits is None or missing:
        raise NarrowsError(
            f"{type(lm).__name__} adds a router auxiliary loss that narrows-lmhead cannot reproduce "
            f"(no router logits in the decoder output, or missing {missing}); pass output_router_logits=False "
            "or train without narrows.lmhead"
        )
    return balance(router_logits, lm.num_experts, lm.num_experts_per_tok, attention_mask)
