"""Tiny random causal LMs of every supported architecture, for tests.

Seeded and built from transformers configs (no hub); widths are multiples of 64 so NF4
blocks divide them; each keeps the features of its architecture a trainer must get
right. MoE router logits stay off until a test asks for them.

why: docs/design.md#test-models
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["TINY_ARCHITECTURES", "tiny_batch", "tiny_config", "tiny_model"]

TINY_ARCHITECTURES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3_text",
    # dense, other layouts
    "phi3",
    "olmo2",
    "granite",
    "stablelm",
    "cohere",
    "cohere2",
    "starcoder2",
    "gpt_neox",
    "phi",
    # mixture of experts
    "qwen2_moe",
    "qwen3_moe",
    "mixtral",
    "olmoe",
    "llama4_text",
    "gpt_oss",
    "glm4_moe",
    "deepseek_v3",
    # multimodal: the text decoder inside Gemma3ForConditionalGeneration
    "gemma3",
)

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

# transformers initialises these architectures' biases to zero; tiny_model draws them at random
# so that a bias lost on the way (Phi's LM-head bias, Starcoder2's, gpt-oss's expert biases) shows
_RANDOM_BIASES = frozenset(TINY_ARCHITECTURES[6:])

# mixture of experts: a few experts, top-2, an auxiliary loss that counts once it is asked for
_MOE = dict(num_experts_per_tok=2, router_aux_loss_coef=0.02)

# Gemma3Config's own fields; every other override goes to its text config
_GEMMA3_TOP = frozenset(
    {
        "text_config",
        "vision_config",
        "mm_tokens_per_image",
        "boi_token_index",
        "eoi_token_index",
        "image_token_index",
        "tie_word_embeddings",
        "initializer_range",
    }
)

# gpt-oss's YaRN, its context extension scaled down to max_position_embeddings (4 x 32 = 128)
_GPT_OSS_YARN = dict(
    rope_type="yarn",
    rope_theta=150000.0,
    factor=4.0,
    beta_fast=32.0,
    beta_slow=1.0,
    truncate=False,
    original_max_position_embeddings=32,
)


def tiny_config(arch: str, **overrides):
    """A transformers config of `arch` with tiny dimensions (override any field)."""
    import transformers as tf

    kw = dict(_COMMON)
    full_every = None  # sliding layers, then a full-attention one every `full_every` layers
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
        full_every = 3
    elif arch == "phi3":  # fused qkv_proj and gate_up_proj
        cfg_cls = tf.Phi3Config
        kw.update(tie_word_embeddings=False)
    elif arch == "olmo2":  # post-norms (after attention and MLP), q/k norms over all heads
        cfg_cls = tf.Olmo2Config
        kw.update(tie_word_embeddings=False)
    elif arch == "granite":  # logits / logits_scaling; scaled embedding, residual and attention
        cfg_cls = tf.GraniteConfig
        kw.update(
            tie_word_embeddings=True,
            logits_scaling=8.0,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.125,
        )
    elif arch == "stablelm":  # LayerNorm with bias, qkv bias, per-head q/k LayerNorm, parallel residual
        cfg_cls = tf.StableLmConfig
        kw.update(tie_word_embeddings=False, use_qkv_bias=True, qk_layernorm=True, use_parallel_residual=True)
    elif arch == "cohere":  # logits * logit_scale, tied head, parallel attention + MLP, LayerNorm q/k norms
        cfg_cls = tf.CohereConfig
        kw.update(tie_word_embeddings=True, logit_scale=0.25, use_qk_norm=True)
    elif arch == "cohere2":  # as cohere, with sliding layers and NoPE global ones
        cfg_cls = tf.Cohere2Config
        kw.update(tie_word_embeddings=True, logit_scale=0.25, sliding_window=8)
        full_every = 3
    elif arch == "starcoder2":  # biases everywhere, LayerNorm, a plain GELU MLP (c_fc, c_proj)
        cfg_cls = tf.Starcoder2Config
        kw.update(tie_word_embeddings=True, use_bias=True)
    elif arch == "gpt_neox":  # gpt_neox.layers, fused query_key_value, parallel residual, embed_out head
        cfg_cls = tf.GPTNeoXConfig
        del kw["num_key_value_heads"]  # multi-head attention only
        kw.update(intermediate_size=256, tie_word_embeddings=False, use_parallel_residual=True)
        kw.update(rotary_pct=0.25)
    elif arch == "phi":  # parallel attention + MLP, dense/fc1/fc2 with biases, lm_head bias, partial rotary
        cfg_cls = tf.PhiConfig
        kw.update(intermediate_size=256, tie_word_embeddings=False, partial_rotary_factor=0.5)
    elif arch == "qwen2_moe":  # routed experts plus a sigmoid-gated shared expert
        cfg_cls = tf.Qwen2MoeConfig
        kw.update(_MOE, num_experts=4, moe_intermediate_size=64, shared_expert_intermediate_size=128)
        kw.update(tie_word_embeddings=False)
    elif arch == "qwen3_moe":
        cfg_cls = tf.Qwen3MoeConfig
        kw.update(_MOE, num_experts=4, moe_intermediate_size=64, norm_topk_prob=True, head_dim=16)
        kw.update(tie_word_embeddings=False)
    elif arch == "mixtral":
        cfg_cls = tf.MixtralConfig
        kw.update(_MOE, num_local_experts=4, tie_word_embeddings=False)
    elif arch == "olmoe":  # Q/K norms over all heads, before they split
        cfg_cls = tf.OlmoeConfig
        kw.update(_MOE, num_experts=4, intermediate_size=64, tie_word_embeddings=False)
    elif arch == "llama4_text":  # layers: dense+RoPE (chunked), MoE+RoPE (chunked), dense+NoPE (global)
        cfg_cls = tf.Llama4TextConfig
        kw.update(
            _MOE,
            num_local_experts=4,
            head_dim=16,
            intermediate_size=64,  # per expert (and the shared expert)
            intermediate_size_mlp=128,  # the dense layers
            interleave_moe_layer_step=2,
            no_rope_layer_interval=3,
            attention_chunk_size=8,
            floor_scale=8,  # NoPE attention temperature tuning shows within a 12-token batch
            tie_word_embeddings=False,
        )
    elif arch == "gpt_oss":  # attention sinks, biased experts with clamped SwiGLU, sliding/full layers
        cfg_cls = tf.GptOssConfig
        kw.update(_MOE, num_local_experts=4, head_dim=16, intermediate_size=64, sliding_window=8)
        kw.update(tie_word_embeddings=False, rope_parameters=dict(_GPT_OSS_YARN))
        full_every = 2
    elif arch == "glm4_moe":  # sigmoid routing over expert groups with a bias, an ungated shared expert,
        # a dense first layer, partial rotary embeddings, Q/K/V biases, per-head Q/K norms
        cfg_cls = tf.Glm4MoeConfig
        kw.update(num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=64)
        kw.update(n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5)
        kw.update(norm_topk_prob=True, use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5)
        kw.update(head_dim=16, tie_word_embeddings=False)
    elif arch == "deepseek_v3":  # latent attention (rotary pairs interleaved), grouped sigmoid routing,
        # an ungated shared expert, a dense first layer
        cfg_cls = tf.DeepseekV3Config
        kw.update(num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1)
        kw.update(moe_intermediate_size=32, first_k_dense_replace=1, n_group=2, topk_group=1)
        kw.update(q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=32, qk_nope_head_dim=16, v_head_dim=16)
        kw.update(tie_word_embeddings=False)
    elif arch == "gemma3":
        return _gemma3_config(overrides)
    else:
        raise ValueError(f"no tiny config for {arch!r}; choose one of {', '.join(TINY_ARCHITECTURES)}")
    kw.update(overrides)
    if full_every is not None and "layer_types" not in overrides:
        kw["layer_types"] = [
            "full_attention" if i % full_every == full_every - 1 else "sliding_attention"
            for i in range(kw["num_hidden_layers"])
        ]
    return cfg_cls(**kw)


def _gemma3_config(overrides: dict):
    """Gemma3Config: a tiny SigLIP vision tower and the gemma3_text decoder of `tiny_config`.
    Overrides of Gemma3Config's own fields apply to it, any other to the text config."""
    import transformers as tf

    top = {k: v for k, v in overrides.items() if k in _GEMMA3_TOP}
    text_over = {k: v for k, v in overrides.items() if k not in _GEMMA3_TOP}
    # the real checkpoints have no final softcapping, and Gemma3ForConditionalGeneration ignores it
    text_over.setdefault("final_logit_softcapping", None)
    text = tiny_config("gemma3_text", **text_over)
    vision = tf.SiglipVisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,  # 4 x 4 patches, pooled to mm_tokens_per_image = 2 x 2
        vision_use_head=False,  # as in the released checkpoints
    )
    args = dict(text_config=text, vision_config=vision, mm_tokens_per_image=4, tie_word_embeddings=True)
    args.update(top)
    return tf.Gemma3Config(**args)


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
        if arch in _RANDOM_BIASES:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name.endswith("bias") and not p.any():
                        p.normal_(0.0, 0.1)
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
