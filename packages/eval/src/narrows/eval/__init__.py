"""narrows.eval — lm-evaluation-harness backend that evaluates a base model plus adapter, streamed when it does not fit."""

from importlib.metadata import version as _version

__version__ = _version("narrows-eval")
__all__ = ["__version__"]
