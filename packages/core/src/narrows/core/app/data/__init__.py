"""Training data for the main job: a local dataset in the formats users already have,
tokenised with the prompt masked, checked row by row before training, cached, and batched
padded or packed.

Modules: `sources` (local paths only), `formats`, `encode` (labels -100 where nothing
trains), `store` (cached under ``$NARROWS_CACHE/data``), `batches` (the seeded
micro-batch stream a resume re-reads).

why: docs/design.md#training-data
"""

from typing import TYPE_CHECKING

from ...lazy import lazy_attributes as _lazy_attributes
from .encode import IGNORE, Example, encode_row
from .formats import FIELDS, DataError, parse_columns
from .sources import Source, open_source, read_jsonl

if TYPE_CHECKING:
    from .batches import TRAINING, Packed, check_packing, collate, micro_batches, pack_bins
    from .store import Tokenized, tokenize, tokenize_rows, tokenizer_digest

# the modules that need torch, imported on first use (PEP 562): the CLI's checks load without it
_LAZY = {
    **dict.fromkeys(
        ("TRAINING", "Packed", "check_packing", "collate", "micro_batches", "pack_bins"), "batches"
    ),
    **dict.fromkeys(("Tokenized", "tokenize", "tokenize_rows", "tokenizer_digest"), "store"),
}
__getattr__, __dir__ = _lazy_attributes(__name__, _LAZY)


__all__ = [
    "FIELDS",
    "IGNORE",
    "TRAINING",
    "DataError",
    "Example",
    "Packed",
    "Source",
    "Tokenized",
    "check_packing",
    "collate",
    "encode_row",
    "micro_batches",
    "open_source",
    "pack_bins",
    "parse_columns",
    "read_jsonl",
    "tokenize",
    "tokenize_rows",
    "tokenizer_digest",
]
