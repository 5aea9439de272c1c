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


def mxfp4_folder(path: str | os.PathLike, seed: int = 0) -> dict:
    """A tiny gpt-oss folder as OpenAI released the real ones: every expert stack ``X``
    [E, in, out] stored as ``X_blocks`` [E, out, in/32, 16] (two E2M1 codes a byte, the even
    input in the low nibble) and ``X_scales`` [E, out, in/32] (E8M0: 2^(s - 127)), and
    quantization_config ``mxfp4``. Returns the bf16 stacks those codes stand for, computed
    here from the E2M1 table (each such value is a bf16 value: the stacks are exact)."""
    import torch
    from safetensors.torch import load_file, save_file

    from ..quant.lowbit import FP4_E2M1  # the format's table (checked against its definition in test_lowbit)

    path = Path(path)
    tiny_model_folder(path, "gpt_oss")
    tensors = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    want = {}
    for key in [k for k in tensors if k.endswith(("gate_up_proj", "down_proj"))]:
        experts, cols, rows = tensors.pop(key).shape  # [E, in, out]
        codes = torch.randint(0, 16, (experts, rows, cols), generator=gen)
        exps = torch.randint(120, 131, (experts, rows, cols // 32), generator=gen)
        scale = 2.0 ** (exps.double() - 127).repeat_interleave(32, -1)
        values = torch.tensor(FP4_E2M1, dtype=torch.float64)[codes] * scale
        want[key] = values.to(torch.bfloat16).transpose(1, 2).contiguous()
        pairs = codes.view(experts, rows, cols // 32, 16, 2)
        tensors[f"{key}_blocks"] = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
        tensors[f"{key}_scales"] = exps.to(torch.uint8)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return want
