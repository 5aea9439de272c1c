"""narrows.stream — blockwise residency — train adapters on a frozen base that lives in host RAM and is streamed to the GPU, bit-identical to resident training."""

from importlib.metadata import version as _version

__version__ = _version("narrows-stream")
__all__ = ["__version__"]
