"""bitsandbytes, imported once for every module that quantizes or stands in for quantized layers.

Its CPU backend logs a warning at import where the optional `kernels` package is missing (a faster CPU 4-bit GEMM
it would fetch from a hub). memopt never needs that kernel and never downloads, so the line is noise to a user
of the dry run; it is silenced for the import only."""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["bitsandbytes"]


def bitsandbytes(needed_for: str = "quantized weights") -> Any:
    """The ``bitsandbytes`` module, or a ValueError saying what ``needed_for`` it and the install that brings it."""
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        import bitsandbytes as bnb
    except Exception as exc:  # not installed, or its native library does not load here
        raise ValueError(f"{needed_for} needs bitsandbytes ({type(exc).__name__}: {exc}): "
                         "pip install 'memopt[bnb]'") from None
    finally:
        logger.setLevel(level)
    return bnb
