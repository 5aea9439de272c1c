"""The old name of `narrows.core.optional`, kept only for core's own modules that still
import it (finetune/config.py); everything else imports `narrows.core.optional`."""

from .optional import NARROWS_PACKAGES, OPTIONAL, distribution_version, is_available, require

__all__ = ["NARROWS_PACKAGES", "OPTIONAL", "distribution_version", "is_available", "require"]
