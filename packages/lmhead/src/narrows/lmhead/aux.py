"""The auxiliary losses a causal LM adds to its cross-entropy, reproduced when
narrows-lmhead replaces the model's loss.

transformers' MoE causal LMs (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss, …) add
``router_aux_loss_coef * load_balancing_loss_func(router_logits, num_experts, top_k,
attention_mask)`` to the loss when router logits are output. narrows-lmhead computes the
cross-entropy itself, so it calls the model's own function from the model's own module
with the model's own attributes — the same tensors in the same order — and adds it the
same way. A model that outputs router logits but whose module has no such function adds
nothing in its own forward either (Llama 4); the twin check (`twincheck`) holds both to
the model's own loss.
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
