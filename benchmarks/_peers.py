"""The two offloading peers, set up as their users would on one GPU, over the same
random NF4 model and LoRA adapters as every other mode of `stream_qlora.py`:

- ``fsdp-offload``: answer.ai's FSDP+QLoRA recipe: the 4-bit weights stored as bf16
  (``bnb_4bit_quant_storage``) so FSDP can flatten them, FSDP1 with each decoder layer and
  each LoRA linear its own unit, parameters offloaded to CPU (``CPUOffload``), activation
  checkpointing of every decoder layer. The optimizer steps on the CPU, where FSDP keeps
  the gradients. At world size 1 FSDP1 switches itself to NO_SHARD (it says so): each unit
  is copied to the GPU and stays there until the step ends, so its peak holds the whole base.
- ``deepspeed-z3``: DeepSpeed ZeRO-3 with the parameters offloaded to (pinned) CPU memory,
  the LoRA optimizer on the GPU (torch's AdamW as the client optimizer). "-ckpt" adds HF
  gradient checkpointing, as a user short of memory would; "-lean" gathers less at a time.

Both run as one process of world size 1.
"""

from __future__ import annotations

import functools
import os
import socket

import torch


def _one_process_group(cuda: bool) -> None:
    """torch.distributed of one rank: both peers are built on it."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:  # a free port: modes run one after the other
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
    )
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)


def bf16_storage(model: torch.nn.Module) -> int:
    """Store every bnb 4-bit weight as bf16, as ``bnb_4bit_quant_storage=torch.bfloat16``
    does: the same bytes, so FSDP can flatten them with the bf16 norms. Returns how many."""
    import bitsandbytes as bnb

    n = 0
    for m in model.modules():
        if not isinstance(m, bnb.nn.Linear4bit):
            continue
        w = m.weight
        data = w.data.reshape(-1).view(torch.bfloat16).reshape(-1, 1)
        m.weight = bnb.nn.Params4bit(
            data,
            requires_grad=False,
            quant_state=w.quant_state,
            blocksize=w.blocksize,
            compress_statistics=w.compress_statistics,
            quant_type=w.quant_type,
            quant_storage=torch.bfloat16,
            module=m,
            bnb_quantized=True,
        )
        m.quant_state, m.quant_storage = w.quant_state, torch.bfloat16
        n += 1
    return n


def fsdp_offload(model: torch.nn.Module, layer_cls: type, cuda: bool) -> torch.nn.Module:
    """answer.ai's FSDP+QLoRA wrapping with CPU offload and checkpointing (train.py there:
    `--use_cpu_offload true --use_gradient_checkpointing true`)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from torch.distributed.fsdp import CPUOffload, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import _or_policy, lambda_auto_wrap_policy, transformer_auto_wrap_policy

    _one_process_group(cuda)
    bf16_storage(model)

    def trainable_leaf(m: torch.nn.Module) -> bool:  # each LoRA linear its own (fp32) unit
        w = getattr(m, "weight", None)
        return not list(m.children()) and w is not None and w.requires_grad

    policy = functools.partial(
        _or_policy,
        policies=[
            functools.partial(lambda_auto_wrap_policy, lambda_fn=trainable_leaf),
            functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={layer_cls}),
        ],
    )
    wrapped = FSDP(
        model,
        auto_wrap_policy=policy,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        cpu_offload=CPUOffload(offload_params=True),
        use_orig_params=False,
        limit_all_gathers=True,
        device_id=torch.cuda.current_device() if cuda else None,
        sync_module_states=False,
    )
    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    apply_activation_checkpointing(
        wrapped, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, layer_cls)
    )
    return wrapped


def deepspeed_zero3(
    model: torch.nn.Module, grad_accum: int, cuda: bool, *, lean: bool = False, lr: float = 1e-4
):
    """A ZeRO-3 engine with parameters offloaded to pinned CPU memory, configured as
    transformers' ZeRO-3 offload example (its "auto" buckets from the hidden size); returns
    it. Its `backward` divides by `grad_accum` and its `step` updates every `grad_accum` calls.
    `lean`: what a user short of memory would set instead: no prefetch, no gathered weight
    kept for reuse, at most 1e8 parameters gathered at once."""
    import deepspeed

    _one_process_group(cuda)
    hidden = model.config.hidden_size  # the buckets transformers' "auto" fills in
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": grad_accum,
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": hidden * hidden,
            "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "stage3_param_persistence_threshold": 10 * hidden,
            "stage3_max_live_parameters": int(1e9),
            "stage3_max_reuse_distance": int(1e9),
        },
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
    }
    if lean:
        config["zero_optimization"].update(
            stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0, stage3_max_live_parameters=int(1e8)
        )
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config, model_parameters=params)
    return engine
