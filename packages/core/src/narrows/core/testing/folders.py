"""A tiny model *folder* (config, safetensors, tokenizer with a chat template) for tests
that run the real CLI: what a user's local HF folder looks like, built offline in a second."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .tiny import tiny_model

__all__ = ["CHATML", "tiny_model_folder", "tiny_tokenizer", "write_jsonl"]

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer():
    """A byte-level tokenizer (256 byte tokens, no merges) with ChatML specials and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    specials = ["<|im_start|>", "<|im_end|>", "<pad>"]
    for s in specials:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>")
    fast.chat_template = CHATML
    return fast


def tiny_model_folder(path: str | os.PathLike, arch: str = "llama", **overrides) -> Path:
    """Save a seeded tiny `arch` model and `tiny_tokenizer()` as an HF folder at `path`."""
    path = Path(path)
    tok = tiny_tokenizer()
    kw = dict(vocab_size=320, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    kw.update(overrides)
    model = tiny_model(arch, **kw)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def write_jsonl(path: str | os.PathLike, rows: list) -> Path:
    path = Path(path)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path
