"""Byte quantities: parsing budgets and sizes, rounding like the CUDA caching allocator, display.

Bytes are plain ``int`` everywhere in memopt; they become GiB/GB only when shown to a person.

Budget grammar (DEVELOPERS.md):
    "40GB"  -> 40 * 10**9        (SI units: KB, MB, GB, TB)
    "40GiB" -> 40 * 2**30        (binary units: KiB, MiB, GiB, TiB)
    "40G"   -> 40 * 2**30        (a bare letter means binary, as nvidia-smi and most tools use it)
    "80%"   -> 80% of the device's total memory (needs ``device_total_bytes``)
    40000000000 or "40000000000" -> a plain byte count (a float with a fraction is rounded to the nearest byte)

Units are read case-insensitively ("8 gib", "40gb"), except a lowercase "b" after an uppercase prefix ("40Gb",
"512Mib"): that spelling means bits, so it is refused rather than read as bytes eight times too large.
"""

from __future__ import annotations

import math
import re

__all__ = [
    "GiB",
    "KiB",
    "MiB",
    "allocator_size",
    "format_bytes",
    "parse_budget",
    "parse_bytes",
    "round_up",
]

KiB = 1024
MiB = 1024**2
GiB = 1024**3

_SI = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_BINARY = {
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_UNITS = {**_SI, **_BINARY}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z%]*)\s*$")

_GRAMMAR_HELP = (
    "write it as a number with a unit: '40GB' (10^9 bytes), '40GiB' or '40G' (2^30 bytes), "
    "'512MiB', '80%' (of the device's memory), or a plain byte count such as 40000000000"
)


def round_up(value: int, multiple: int) -> int:
    """Round ``value`` up to a multiple of ``multiple`` (both non-negative ints)."""
    return -(-value // multiple) * multiple


ALLOCATOR_MIN_BLOCK = 512  # the CUDA caching allocator rounds every request up to a multiple of 512 bytes


def allocator_size(nbytes: int) -> int:
    """Bytes the CUDA caching allocator hands out for a request of ``nbytes`` (0 stays 0)."""
    if nbytes <= 0:
        return 0
    return -(-nbytes // ALLOCATOR_MIN_BLOCK) * ALLOCATOR_MIN_BLOCK  # inline: called for every traced allocation


def parse_bytes(text: str | int | float, *, what: str = "size") -> int:
    """Parse a byte quantity such as '40GB', '40GiB', '1.5G', '512MiB' or 1234 into an int.

    Raises ``ValueError`` naming the accepted forms when the text cannot be read.
    """
    if isinstance(text, bool):
        raise ValueError(f"{what} must be a byte quantity, got a boolean ({text!r}); {_GRAMMAR_HELP}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"{what} must not be negative, got {text}; {_GRAMMAR_HELP}")
        return text
    if isinstance(text, float):
        if math.isinf(text) and text > 0:
            raise ValueError(f"{what} {text!r} is too large to be a number of bytes; {_GRAMMAR_HELP}")
        if not math.isfinite(text) or text < 0:
            raise ValueError(f"{what} must be a finite, non-negative number, got {text!r}; {_GRAMMAR_HELP}")
        return round(text)
    if not isinstance(text, str):
        raise ValueError(f"{what} must be a string or a number, got {type(text).__name__}; {_GRAMMAR_HELP}")
    match = _PATTERN.match(text)
    if not match and text.strip().startswith("-"):
        raise ValueError(f"{what} must not be negative, got {text!r}; {_GRAMMAR_HELP}")
    if not match:
        raise ValueError(f"cannot read {what} {text!r}: {_GRAMMAR_HELP}")
    number, unit = float(match.group(1)), match.group(2).lower()
    if _means_bits(match.group(2)):
        raise ValueError(
            f"{what} {text!r}: a lowercase 'b' after an uppercase prefix means bits; "
            f"for bytes write '{match.group(1)}{match.group(2)[:-1]}B'"
        )
    if not math.isfinite(number):
        raise ValueError(f"{what} {text!r} is too large to be a number of bytes; {_GRAMMAR_HELP}")
    if unit == "%":
        raise ValueError(f"{what} {text!r} is a percentage, which needs the device's total memory; {_GRAMMAR_HELP}")
    if unit not in _UNITS:
        raise ValueError(f"unknown unit {match.group(2)!r} in {what} {text!r}: {_GRAMMAR_HELP}")
    return round(number * _UNITS[unit])


def parse_budget(text: str | int | float, *, device_total_bytes: int | None = None) -> int:
    """Parse a memory budget per DEVELOPERS.md. A percentage needs ``device_total_bytes``."""
    if isinstance(text, str):
        match = _PATTERN.match(text)
        if match and match.group(2) == "%":
            pct = float(match.group(1))
            if not math.isfinite(pct) or not 0 < pct <= 100:
                raise ValueError(f"budget {text!r}: a percentage must be in (0, 100]; {_GRAMMAR_HELP}")
            if device_total_bytes is None:
                raise ValueError(
                    f"budget {text!r} is a percentage of the device's memory, but no device is known: "
                    "name the hardware (hardware=h100_80gb) or give an absolute budget such as '40GB'"
                )
            share = int(device_total_bytes * pct / 100)
            if share == 0:
                raise ValueError(
                    f"budget {text!r} is zero bytes of the device's {format_bytes(device_total_bytes)}; {_GRAMMAR_HELP}"
                )
            return share
    number = _unitless_number(text)
    if number is not None and 0 < number < 1024 and not float(number).is_integer():
        # a fraction meant as a share of the device ("0.8") would otherwise plan for one byte
        hint = (f"for a share of the device's memory write '{number * 100:g}%'" if number <= 1
                else f"give it a unit ('{number:g}GB')")
        raise ValueError(f"budget {text!r} is not a whole number of bytes: {hint}; {_GRAMMAR_HELP}")
    value = parse_bytes(text, what="budget")
    if value == 0:
        raise ValueError(f"budget {text!r} is zero bytes; {_GRAMMAR_HELP}")
    return value


def _means_bits(unit: str) -> bool:
    """Whether a unit is spelled as bits ("Gb", "Mib"): an uppercase prefix before a lowercase final 'b'."""
    return len(unit) >= 2 and unit.endswith("b") and any(ch.isupper() for ch in unit[:-1])


def _unitless_number(text: str | int | float) -> float | None:
    """The number of a budget written without a unit (a float, or a string of digits alone), else None."""
    if isinstance(text, float):
        return text
    if isinstance(text, str):
        match = _PATTERN.match(text)
        if match and not match.group(2):
            return float(match.group(1))
    return None


def format_bytes(num_bytes: int | float, *, binary: bool = True, precision: int = 2) -> str:
    """Human-readable size: 1.50 GiB (binary) or 1.61 GB (SI)."""
    sign = "-" if num_bytes < 0 else ""
    value = float(abs(num_bytes))
    base, units = (1024.0, ["B", "KiB", "MiB", "GiB", "TiB"]) if binary else (1000.0, ["B", "KB", "MB", "GB", "TB"])
    for unit in units:
        if value < base or unit == units[-1]:
            return f"{sign}{value:.{precision}f} {unit}" if unit != "B" else f"{sign}{int(value)} B"
        value /= base
    raise AssertionError("unreachable")
