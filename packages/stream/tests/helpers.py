"""Resident-vs-streamed training runs on tiny models, recording everything that must match."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import narrows.stream as ns
from narrows.core import ResidentHead, anatomy_of, chunked_logits, quantize_nf4
from narrows.core.testing import tiny_batch, tiny_model, with_adapter


def build(
    arch="llama",
    *,
    base="float",
    kind="lora",
    dropout=0.0,
    dtype=torch.float32,
    experts="nf4",
    **config_overrides,
):
    """A tiny `arch` with an adapter; `base="nf4"` quantises its linears to NF4 and its
    fused expert stacks to `experts`."""
    model = tiny_model(arch, dtype=dtype, **config_overrides)
    if base == "nf4":
        quantize_nf4(model, experts=experts)
    model = with_adapter(model, kind, dropout=dropout)
    return model.train()


def train(
    model,
    *,
    steps: int = 3,
    grad_accum: int = 1,
    stream_kwargs: dict | None = None,
    device: str = "cpu",
    widths: tuple[int, ...] = (12,),
):
    """Seeded AdamW loop. Returns per-micro-step losses, gradients before each step, final
    adapter weights and optimizer state — the tensors a parity gate compares. The
    micro-batches take their sequence lengths from `widths` in turn."""
    torch.manual_seed(0)
    if stream_kwargs is not None:
        ns.stream(model, device=device, **stream_kwargs)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    record: dict[str, list[torch.Tensor]] = {"loss": [], "grad": [], "weight": [], "adam": []}
    for step in range(steps):
        for micro in range(grad_accum):
            seq = widths[(step * grad_accum + micro) % len(widths)]
            batch = {k: v.to(device) for k, v in tiny_batch(seq=seq, seed=100 * step + micro).items()}
            loss = model(**batch, use_cache=False).loss / grad_accum  # as the main job trains
            loss.backward()
            record["loss"].append(loss.detach().clone())
        record["grad"] += [
            p.grad.detach().clone() for p in params if p.grad is not None
        ]  # None: vision tower
        opt.step()
        opt.zero_grad()
    record["weight"] = [p.detach().clone() for p in params]
    record["adam"] = [v.clone() for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    return record


def assert_identical(resident: dict, streamed: dict) -> None:
    for key in resident:
        a, b = resident[key], streamed[key]
        assert len(a) == len(b) and len(a) > 0, key
        for i, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x.cpu(), y.cpu()), (
                f"{key}[{i}] differs: max {(x.float() - y.float()).abs().max().item()}"
            )


def chunked_resident(model, rows: int):
    """The resident reference with the same chunked head: what a streamed head must equal bitwise."""
    head = anatomy_of(model).head
    source = ResidentHead.of(head)
    head.forward = lambda hidden: chunked_logits(hidden, source, rows)
    return model


class Dequantizations(TorchDispatchMode):
    """Counts 4-bit dequantisations: bitsandbytes' matmul's (``gemm_4bit``, which
    dequantises inside, out of the mode's sight), its other ops', and narrows' Triton
    kernel's (`narrows.core.quant.nf4_kernel`, a launch no dispatch mode sees)."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self._kernel = None

    def __enter__(self):
        from narrows.core.quant import dequantize

        module = dequantize._kernel()
        if module is not None:
            real = self._kernel = module.dequantize_nf4_triton

            def counted(*args, **kwargs):
                self.count += 1
                return real(*args, **kwargs)

            module.dequantize_nf4_triton = counted
        return super().__enter__()

    def __exit__(self, *exc):
        if self._kernel is not None:
            from narrows.core.quant import dequantize

            dequantize._kernel().dequantize_nf4_triton = self._kernel
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func._schema.name in ("bitsandbytes::dequantize_4bit", "bitsandbytes::gemm_4bit")
        return func(*args, **(kwargs or {}))


def kept_bytes(saved, *besides) -> int:
    """Bytes of the distinct storages a fast layer's `Saved` holds, other than `besides`'s."""
    seen = {t.untyped_storage().data_ptr() for t in besides}
    total = 0
    stack = [getattr(saved, f) for f in saved.__dataclass_fields__]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            ptr = v.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                total += v.untyped_storage().nbytes()
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif hasattr(v, "__dataclass_fields__"):
            stack.extend(getattr(v, f) for f in v.__dataclass_fields__)
    return total
