"""The step-time model that ranks plans: a layer's compute and copy time and a step's layer
time for a residency and its options.

A way to compare plans, not a prediction the report shows; a profile's measured rates
(`narrows.stream.Profile.rates`) replace the fitted ones. Work is counted in forwards
(`FAST_BACKWARD`, `recompute_share` for the fast layers).

why: docs/design.md#the-step-time-model
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .memory import Shapes

__all__ = [
    "MOE_HOST_SECONDS",
    "Rates",
    "dequant_seconds",
    "layer_seconds",
    "passes",
    "recompute_share",
    "step_seconds",
]

# The step-time model that ranks plans (not a prediction the report shows): fitted to the
# H100 (PCIe gen5, bitsandbytes-style NF4 dequantisation per forward) at the Qwen2.5 shapes.
H2D_RATE = 40e9  # bytes/s host→device from pinned memory (measured 35–55)
MATMUL_RATE = 400e12  # flop/s a layer's matmuls reach at a few thousand tokens
DEQUANT_RATE = 500e9  # parameters/s the device dequantises NF4 weights at, per use
HOST_RATE = 65e9  # parameters/s: an eager NF4 layer's forward on the host (its per-kernel
# launches; the batch-1 floor), which graph replays do not pay
# Fast layers, fitted to the H100 at the Qwen2.5 7B, 32B and 72B shapes (benchmarks/README.md,
# "The step-time model"): their matmuls run near the library GEMMs' rate (overlap.py: 800
# TFLOP/s), the rest of a forward (norms, rotary, attention, SwiGLU, the adapters) costs
# about as much as reading and writing each token's hidden and intermediate channels ten times
FAST_MATMUL_RATE = 800e12  # flop/s
FAST_CHANNEL_SECONDS = 6.5e-12  # seconds a token and channel (hidden + intermediate) a forward
FAST_BACKWARD = 1.2  # a fast layer's backward in forwards (fast_layer_time_7b.json)
FAST_HOST_RATE = 95e9  # parameters/s: an eager fast layer's forward on the host (peers_7b_1x512_g8.json)
# An eager fast MoE layer's forward on the host: its launches (routing, the sort, gathers, the
# grouped matmuls, each stack's dequantisation), about as many whatever its size. Fitted on one
# H200 at Qwen3-30B-A3B's shape, 6 layers, 8 × 512 tokens: the main job's eager step, every layer
# whole, 0.083 s, over 6 layers of 2.2 forwards each (graphed: 0.049 s)
MOE_HOST_SECONDS = 6.3e-3


@dataclass(frozen=True)
class Rates:
    """What the step-time model takes for the machine: the fitted defaults, or what a
    profile measured (`narrows.stream.Profile.rates`)."""

    h2d: float = H2D_RATE  # bytes/s host→device
    forward_s: float | None = None  # one layer's forward; None: from the matmul and dequantisation rates
    graphed: bool = False  # forward_s was measured on graph replays


def recompute_share(s: Shapes) -> float:
    """The share of a forward a layer's recompute runs: all of it under autograd, all but
    down_proj in a fast layer (its output is not needed by the backward)."""
    if not s.fast:
        return 1.0
    return (4 * s.hidden * s.hidden + 2 * s.hidden * _mlp_width(s)) / _params(s)


def passes(s: Shapes) -> tuple[float, float, float]:
    """A whole layer's work and a recomputed one's, in forwards, and how much of it (the
    recompute and the backward) hides the copy of the layer the backward reaches next."""
    backward = FAST_BACKWARD if s.fast else 2.0
    rest = recompute_share(s) + backward
    return 1.0 + backward, 1.0 + rest, rest


def _mlp_width(s: Shapes) -> int:
    """The MLP's intermediate channels a token goes through: a mixture of experts' chosen
    experts and its shared expert, or the dense MLP's."""
    return s.moe.top_k * s.moe.intermediate + s.moe.shared if s.moe is not None else s.intermediate


def _weights(s: Shapes, width: int) -> int:
    """A layer's weights with an MLP `width` channels wide: attention's, gate's, up's, down's."""
    return 4 * s.hidden * s.hidden + 3 * s.hidden * width


def _params(s: Shapes) -> int:
    """The weights a token is multiplied by in one layer's forward."""
    return _weights(s, _mlp_width(s))


def _stored(s: Shapes) -> int:
    """The weights one layer stores: every routed expert's, where it has them."""
    moe = s.moe
    return _weights(s, moe.experts * moe.intermediate + moe.shared if moe is not None else s.intermediate)


def layer_seconds(
    nbytes: int, s: Shapes, rates: Rates | None = None, graphed: bool = False
) -> tuple[float, float]:
    """One layer's forward compute time (eager, or replayed as a CUDA graph) and one
    host→device copy of it, predicted. A measured forward replaces the model's figure for
    the way it was measured; the other way is scaled by the model's ratio."""
    rates = rates or Rates()
    params, stored = _params(s), _stored(s)
    tokens = s.batch * s.seq
    if s.fast:
        matmul = 2 * tokens * params / FAST_MATMUL_RATE
        matmul += tokens * (s.hidden + _mlp_width(s)) * FAST_CHANNEL_SECONDS
        host = params / FAST_HOST_RATE
    else:
        matmul, host = 2 * tokens * params / MATMUL_RATE, params / HOST_RATE
    quantised = nbytes < stored  # below a byte per parameter: dequantised on every use
    graph = matmul + (stored / DEQUANT_RATE if quantised else 0.0)  # what the device does
    moe = s.fast and s.moe is not None  # launch-bound on the host, quantised or not
    if moe:
        host = max(host, MOE_HOST_SECONDS)
    eager = max(graph, host) if quantised or moe else graph  # or the host, if slower
    compute = graph if graphed else eager
    if rates.forward_s is not None:
        compute = rates.forward_s * compute / (graph if rates.graphed else eager)
    return compute, nbytes / rates.h2d


def dequant_seconds(nbytes: int, s: Shapes) -> float:
    """One dequantisation of a 4-bit layer's weights, every expert's included (0 for a
    float layer)."""
    stored = _stored(s)
    return stored / DEQUANT_RATE if nbytes < stored else 0.0


def step_seconds(
    layer_bytes: Sequence[int],
    s: Shapes,
    resident: int,
    whole: int,
    rates: Rates | None = None,
    graphs: bool = False,
    *,
    micro_batches: int = 1,
    block_major: bool = False,
    held: bool = False,
) -> float:
    """Predicted time of one step's layers with `resident` resident layers of which `whole`
    run without recompute, in seconds.

    Counts forward, backward, recompute and the copy time the neighbouring compute cannot
    hide, over `micro_batches`, sequential or `block_major`, with `graphs` and `held` weights.
    Whole fast layers replay as graphs too (`LayerGraphs.whole`); other whole layers run eagerly.

    why: docs/design.md#the-step-time-model
    """
    n = len(layer_bytes)
    whole = 0 if block_major else whole
    eager, c = layer_seconds(max(layer_bytes), s, rates)
    f = layer_seconds(max(layer_bytes), s, rates, graphed=True)[0] if graphs else eager
    behind = micro_batches if block_major else 1  # micro-batches' compute one copy hides behind
    whole_work, recomputed_work, hiding = passes(s)
    exposed = max(0.0, c - behind * f) + max(0.0, c - hiding * behind * f)
    copies = 1 if block_major else micro_batches
    kept = f if s.fast else eager  # a whole layer's work
    compute = micro_batches * (whole * whole_work * kept + (n - whole) * recomputed_work * f)
    if held:
        d = min(f, dequant_seconds(max(layer_bytes), s))
        if block_major:  # three per micro-batch (forward, recompute, input gradient) become two a step
            compute -= n * (3 * micro_batches - 2) * d
        else:  # a recomputed layer's backward dequantises once for its recompute and input gradient
            compute -= micro_batches * (n - whole) * d
    return compute + copies * (n - resident) * exposed
