"""narrows.lmhead — LM-head memory savings — logits masking, chunked exact cross-entropy and a top-k softmax approximation."""

from importlib.metadata import version as _version

__version__ = _version("narrows-lmhead")
__all__ = ["__version__"]
