"""bitsandbytes, imported once for every module that quantizes or stands in for quantized layers.

Its CPU backend logs a warning when it is imported where the optional `kernels` package is missing (a faster CPU
4-bit GEMM it would fetch from a hub). memopt never runs that kernel and never downloads, and bitsandbytes is also
imported by peft and transformers on memopt's behalf, so the line reached every dry run that traced an adapter.
A filter on that one logger drops that one message, whoever imports bitsandbytes; its other warnings still show."""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["bitsandbytes"]

_KERNELS_NOTICE = "Failed to load CPU gemm_4bit_forward from kernels-community"


def _not_the_kernels_notice(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_KERNELS_NOTICE)


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_not_the_kernels_notice)


def bitsandbytes(needed_for: str = "quantized weights") -> Any:
    """The ``bitsandbytes`` module, or a ValueError saying what ``needed_for`` it and the install that brings it."""
    try:
        import bitsandbytes as bnb
    except Exception as exc:  # not installed, or its native library does not load here
        raise ValueError(f"{needed_for} needs bitsandbytes ({type(exc).__name__}: {exc}): "
                         "pip install 'memopt[bnb]'") from None
    return bnb
