"""narrows.dora — DoRA with a factored row norm and fused Triton compose kernels, drop-in for PEFT."""

from importlib.metadata import version as _version

__version__ = _version("narrows-dora")
__all__ = ["__version__"]
