"""`apply(model, ...)`: one call that replaces a causal LM's loss computation.

Training with labels: the output carries ``loss`` with ``logits=None`` (inside core's
`sharing_head_pass`, a streamed head's loss is filed with the sweep and the output's loss is
None). Eval mode or no labels: the original forward runs. The head weight is read through
core's head hook, in whichever order this and narrows-stream were applied.

why: docs/design.md#the-wrapped-forward
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from narrows.core import anatomy_of, ensure_architecture, head_source, head_sweep, set_loss_working_set
from narrows.core.protocol import compose
from narrows.core.protocol.handle import state_of

from .aux import router_aux_loss
from .loss import LossOptions, loss_rows, rows_loss, rows_losses, shares_head_pass
from .topk import neighbour_table

__all__ = ["HeadSavings", "LMHeadHandle", "apply", "remove"]

log = logging.getLogger("narrows.lmhead")

_LOSS_ONLY = ("labels", "num_items_in_batch", "shift_labels", "logits_to_keep", "return_dict")


@dataclass
class LMHeadHandle:
    """What `apply` leaves on the model as ``model.narrows_lmhead``."""

    options: LossOptions
    neighbours: Tensor | None
    eval_logits: bool
    original_forward: Any
    subset_sizes: list[int] = field(default_factory=list)  # top-k: vocabulary rows per training batch
    kernels: set[str] = field(default_factory=set)  # what computed a training loss ("liger", "tiles", ...)


def apply(
    model: nn.Module,
    *,
    mask: bool = True,
    chunked: bool = True,
    topk: int | None = None,
    neighbour_cache: str | Path | None = None,
    eval_logits: bool = True,
    head_rows: int | None = None,
    fused: str = "auto",
) -> nn.Module:
    """Replace the loss of `model` (a causal LM, PEFT-wrapped or not); returns the same model.

    `mask`: the head only where labels are not -100; `chunked`: no [tokens, vocab] logits,
    exact up to summation order; `topk=K`: the union of the targets' K nearest tokens, an
    approximation (table cached in `neighbour_cache`); `eval_logits=False`: eval through the
    exact chunked loss, no logits; `fused`: "auto" uses Cut Cross-Entropy where installed and
    applicable, "off" keeps the tiles. An unannounced architecture is first checked on its
    shrunk twin (`narrows.core.verify_architecture`).

    why: docs/design.md#fused-kernels
    """
    ensure_architecture(model, "head", "lmhead")
    anat = anatomy_of(model)
    lm = anat.model
    if state_of(model).lmhead is not None:
        raise ValueError(
            "narrows.lmhead is already applied to this model; narrows.lmhead.remove(model) first"
        )
    options = LossOptions(mask=mask, chunked=chunked, topk=topk, head_rows=head_rows, fused=fused)
    neighbours = None
    if topk is not None:
        weight = anat.head.weight  # resident, or the host copy a streamed head reads from
        if weight.requires_grad:
            raise ValueError("topk needs a frozen LM head: the neighbour table is built from its weight once")
        neighbours = neighbour_table(weight, topk, cache_dir=neighbour_cache)
        log.warning(
            "narrows.lmhead: top-%d softmax is an APPROXIMATION of the training loss "
            "(evaluation uses the full softmax)",
            topk,
        )
    original = lm.forward
    exact = replace(options, topk=None)

    def forward(input_ids: Tensor | None = None, **kwargs: Any) -> Any:
        labels, shift_labels = kwargs.get("labels"), kwargs.get("shift_labels")
        training = lm.training
        if (labels is None and shift_labels is None) or (not training and eval_logits):
            return original(input_ids=input_ids, **kwargs)
        num_items = kwargs.get("num_items_in_batch")
        decoder_kwargs = {k: v for k, v in kwargs.items() if k not in _LOSS_ONLY}
        out = anat.decoder(input_ids=input_ids, **decoder_kwargs)
        used = options if training else exact
        rows = loss_rows(
            out.last_hidden_state,
            labels,
            head_source(model),
            used,
            num_items_in_batch=num_items,
            shift_labels=shift_labels,
            neighbours=neighbours if training else None,
            stats=handle.subset_sizes if training else None,
        )
        aux = router_aux_loss(lm, out, kwargs.get("output_router_logits"), kwargs.get("attention_mask"))

        def finish(loss: Tensor) -> Tensor:  # as the model's own forward adds the aux loss
            return loss if aux is None else loss + lm.router_aux_loss_coef * aux.to(loss.device)

        sweep = head_sweep(model)
        if sweep is not None and shares_head_pass(rows, used):  # computed with other forwards' losses
            if training:
                handle.kernels.add("tiles")  # the shared pass runs the tiles
            sweep.file((rows.source, used), rows, partial(rows_losses, options=used), finish)
            return _output(None, out, aux)
        return _output(finish(rows_loss(rows, used, handle.kernels if training else None)), out, aux)

    forward.__wrapped__ = original  # type: ignore[attr-defined]
    lm.forward = forward
    state_of(model).lmhead = handle = LMHeadHandle(options, neighbours, eval_logits, original)
    set_loss_working_set(model, lambda tokens: _working_set(anat, options, tokens))
    return model


def remove(model: nn.Module) -> nn.Module:
    """Undo `apply`: the model computes its own loss again."""
    lm = anatomy_of(model).model
    state = state_of(model)
    if state.lmhead is not None:
        lm.forward = state.lmhead.original_forward
        state.lmhead = None
        set_loss_working_set(model, None)
    return model


def _working_set(anat, options: LossOptions, tokens: int) -> int:
    """Bytes the loss holds at once: the hidden-state gradient, a gathered copy of the
    trainable rows (and its gradient), an fp32 gradient accumulator, and one tile; the
    full logits only when the loss is not chunked."""
    hidden = anat.config.hidden_size
    act = anat.head.weight.element_size()
    rows = tokens * hidden * (3 * act + 4)
    if not options.chunked:
        return rows + tokens * anat.config.vocab_size * (2 * act + 10)
    tile = min(options.tile_bytes, tokens * anat.config.vocab_size * 4)
    return rows + 2 * tile  # an fp32 tile and the matmul output it is cast from


def _output(loss: Tensor | None, out: Any, aux: Tensor | None = None) -> Any:
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    common = dict(
        loss=loss,
        logits=None,
        past_key_values=getattr(out, "past_key_values", None),
        hidden_states=getattr(out, "hidden_states", None),
        attentions=getattr(out, "attentions", None),
    )
    if getattr(out, "router_logits", None) is not None:
        return MoeCausalLMOutputWithPast(**common, aux_loss=aux, router_logits=out.router_logits)
    return CausalLMOutputWithPast(**common)


@dataclass(frozen=True)
class HeadSavings:
    """`apply`'s settings as a config for `narrows.core.apply` (stage ``"loss"``)."""

    loss: LossOptions = field(default_factory=LossOptions)
    eval_logits: bool = True
    neighbour_cache: str | Path | None = None


def _apply_savings(model: nn.Module, config: HeadSavings) -> nn.Module:
    o = config.loss
    return apply(
        model,
        mask=o.mask,
        chunked=o.chunked,
        topk=o.topk,
        neighbour_cache=config.neighbour_cache,
        eval_logits=config.eval_logits,
        head_rows=o.head_rows,
        fused=o.fused,
    )


compose.register(HeadSavings, "loss", _apply_savings)
