"""Step mode: one optimizer step over G micro-batches with every streamed layer loaded
once for the forward of all G and once for their backward (block-major accumulation),
`torch.equal` to sequential accumulation. `StepTrainer` (`trainer`) composes three
parts, each in its own module and given what it needs in its arguments: the block-major
step and the head passes it shares (`blockmajor`), the order a step runs in with its RNG
prediction (`order`), and the host state (`host_state`)."""

from .trainer import StepStats, StepTrainer

__all__ = ["StepStats", "StepTrainer"]
