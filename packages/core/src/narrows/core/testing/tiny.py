"""Tiny random causal LMs of every supported architecture, for tests.

Seeded and built from transformers configs (no hub). Dimensions are small but keep the
features that matter to narrows: grouped-query attention, untied and tied heads,
Qwen2's attention bias, Qwen3's q/k norms, Gemma's logit softcapping and alternating
sliding/global attention. Widths are multiples of 64 so NF4 blocks divide them.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["TINY_ARCHITECTURES", "tiny_batch", "tiny_config", "tiny_model"]

TINY_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text")

_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_config(arch: str, **overrides):
    """A transformers config of `arch` with tiny dimensions (override any field)."""
    import transformers as tf

    kw = dict(_COMMON)
    if arch == "llama":
        cfg_cls = tf.LlamaConfig
        kw.update(tie_word_embeddings=False)
    elif arch == "mistral":
        cfg_cls = tf.MistralConfig
        kw.update(sliding_window=16, tie_word_embeddings=False)
    elif arch == "qwen2":
        cfg_cls = tf.Qwen2Config
        kw.update(tie_word_embeddings=True)
    elif arch == "qwen3":
        cfg_cls = tf.Qwen3Config
        kw.update(head_dim=16, tie_word_embeddings=False)
    elif arch == "gemma2":
        cfg_cls = tf.Gemma2Config
        kw.update(head_dim=16, sliding_window=8, final_logit_softcapping=30.0, attn_logit_softcapping=50.0)
    elif arch == "gemma3_text":
        cfg_cls = tf.Gemma3TextConfig
        kw.update(head_dim=16, sliding_window=8, final_logit_softcapping=30.0)
    else:
        raise ValueError(f"no tiny config for {arch!r}; choose one of {', '.join(TINY_ARCHITECTURES)}")
    kw.update(overrides)
    if arch == "gemma3_text" and "layer_types" not in overrides:  # two sliding layers, then a global one
        kw["layer_types"] = [
            "full_attention" if i % 3 == 2 else "sliding_attention" for i in range(kw["num_hidden_layers"])
        ]
    return cfg_cls(**kw)


def tiny_model(
    arch: str = "llama", *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides
) -> nn.Module:
    """A seeded random causal LM of `arch` in eval mode, with eager attention (the
    reference kernel on every device, so results do not depend on SDPA backends)."""
    import transformers as tf

    config = tiny_config(arch, **overrides)
    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    return model.eval()


def tiny_batch(
    batch: int = 2, seq: int = 12, *, vocab: int = 256, seed: int = 1, pad_last: int = 3
) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask (the last row left-padded by `pad_last`) and labels
    (-100 on padding and on the first two tokens: a prompt that does not train)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    if batch > 1 and pad_last:
        mask[-1, :pad_last] = 0
        ids[-1, :pad_last] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :2] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
