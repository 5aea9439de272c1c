"""narrows.lmhead — stop the LM head from being the memory peak.

``narrows.lmhead.apply(model, mask=True, chunked=True, topk=None)`` replaces a causal LM's
training loss: exact up to summation order unless `topk` is set (an approximation;
evaluation keeps the full softmax). The pieces are usable alone: `causal_lm_loss`,
`linear_cross_entropy`, `linear_cross_entropies`, `neighbour_table`.

why: docs/design.md#lmhead
"""

from narrows.core import register_architecture_check as _register_check
from narrows.core.versions import installed_version as _installed_version

from .api import HeadSavings, LMHeadHandle, apply, remove
from .chunked import (
    cross_entropy_from_logits,
    linear_cross_entropies,
    linear_cross_entropy,
    reference_cross_entropy,
)
from .fused import FUSED_CHOICES, fused_reason
from .loss import LossOptions, NoTrainableTokensError, causal_lm_loss, shift_targets
from .topk import neighbour_table, subset_head, vocabulary_subset
from .twincheck import check_lmhead as _check_lmhead

_register_check("lmhead", _check_lmhead)

__version__ = _installed_version("narrows-lmhead")
__all__ = [
    "FUSED_CHOICES",
    "HeadSavings",
    "LMHeadHandle",
    "LossOptions",
    "NoTrainableTokensError",
    "__version__",
    "apply",
    "causal_lm_loss",
    "cross_entropy_from_logits",
    "fused_reason",
    "linear_cross_entropies",
    "linear_cross_entropy",
    "neighbour_table",
    "reference_cross_entropy",
    "remove",
    "shift_targets",
    "subset_head",
    "vocabulary_subset",
]
