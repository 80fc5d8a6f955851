"""Configuration of the CUDA caching-allocator model: ``PYTORCH_CUDA_ALLOC_CONF`` and the size rules.

Rules modelled (each mirrors the C++ function of ``c10/cuda/CUDACachingAllocator.cpp`` named in brackets):

* request rounding: < 512 B -> 512 B, else a multiple of 512 B, or the next power-of-two division
  when ``roundup_power2_divisions`` is set [``round_size``, ``roundup_power2_next_division``];
* segment sizes: 2 MiB for the small pool, 20 MiB for large requests < 10 MiB, else the request
  rounded up to 2 MiB [``get_allocation_size``].
"""

from __future__ import annotations

from dataclasses import dataclass

from memopt.units import MiB

__all__ = [
    "AllocatorConfig",
    "get_allocation_size",
    "round_size",
]


K_MIN_BLOCK_SIZE = 512  # every request is rounded to a multiple of this
K_SMALL_SIZE = 1 * MiB  # largest request served by the small pool
K_SMALL_BUFFER = 2 * MiB  # small-pool segment (and expandable page) size
K_LARGE_BUFFER = 20 * MiB  # segment for large requests < K_MIN_LARGE_ALLOC; large expandable page size
K_MIN_LARGE_ALLOC = 10 * MiB  # requests from here on get their own segment
K_ROUND_LARGE = 2 * MiB  # such segments are rounded up to this

NO_LIMIT = (1 << 64) - 1  # SIZE_MAX, the "unset" value of max_split_size
_N_DIVISION_INTERVALS = 16  # roundup_power2_divisions intervals: [1 MiB, 2 MiB), ..., [32 GiB, inf)


@dataclass(frozen=True)
class AllocatorConfig:
    """The ``PYTORCH_CUDA_ALLOC_CONF`` knobs the simulator honours.

    ``roundup_power2_divisions`` is one number of divisions for all sizes, or 16 numbers, one per
    power-of-two interval starting at [1 MiB, 2 MiB) (sizes below 1 MiB use the first, sizes from
    32 GiB on the last), as the bracketed form ``roundup_power2_divisions:[...]`` sets them.
    ``max_non_split_rounding_bytes`` (``max_non_split_rounding_mb``) and ``large_segment_size_bytes``
    (``large_segment_size_mb``, newer PyTorch only) keep their PyTorch defaults unless set.
    """

    expandable_segments: bool = False
    max_split_size_bytes: int | None = None
    garbage_collection_threshold: float | None = None
    roundup_power2_divisions: int | tuple[int, ...] | None = None
    max_non_split_rounding_bytes: int = K_LARGE_BUFFER
    large_segment_size_bytes: int = K_LARGE_BUFFER

    def __post_init__(self) -> None:
        if self.max_split_size_bytes is not None and self.max_split_size_bytes < K_LARGE_BUFFER:
            raise ValueError("max_split_size_bytes must be >= 20 MiB (PyTorch rejects smaller values)")
        if self.garbage_collection_threshold is not None and not 0.0 < self.garbage_collection_threshold < 1.0:
            raise ValueError("garbage_collection_threshold must be in (0, 1)")
        if self.max_non_split_rounding_bytes < K_LARGE_BUFFER:
            raise ValueError("max_non_split_rounding_bytes must be >= 20 MiB")
        if self.large_segment_size_bytes <= 0 or self.large_segment_size_bytes % K_ROUND_LARGE:
            raise ValueError("large_segment_size_bytes must be a positive multiple of 2 MiB")
        divs = self.roundup_power2_divisions
        if divs is not None:
            values = (divs,) if isinstance(divs, int) else tuple(divs)
            if not isinstance(divs, int) and len(values) != _N_DIVISION_INTERVALS:
                raise ValueError(f"roundup_power2_divisions needs 1 or {_N_DIVISION_INTERVALS} values")
            for v in values:
                if v < 0 or (v > 0 and v & (v - 1)):
                    raise ValueError("roundup_power2_divisions values must be 0 or powers of two")

    def division_table(self) -> tuple[int, ...] | None:
        """The 16 per-interval divisions, or None when rounding to powers of two is off."""
        divs = self.roundup_power2_divisions
        if divs is None:
            return None
        table = (divs,) * _N_DIVISION_INTERVALS if isinstance(divs, int) else tuple(divs)
        return table if any(d > 1 for d in table) else None

    def to_alloc_conf(self) -> str:
        """The ``PYTORCH_CUDA_ALLOC_CONF`` string with these settings ('' for the defaults)."""
        parts: list[str] = []
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        if self.max_split_size_bytes is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size_bytes // MiB}")
        if self.garbage_collection_threshold is not None:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold}")
        divs = self.roundup_power2_divisions
        if isinstance(divs, int):
            parts.append(f"roundup_power2_divisions:{divs}")
        elif divs is not None:
            items = [f"{1 << i}:{d}" for i, d in enumerate(divs[:-1])] + [f">:{divs[-1]}"]
            parts.append("roundup_power2_divisions:[" + ",".join(items) + "]")
        if self.max_non_split_rounding_bytes != K_LARGE_BUFFER:
            parts.append(f"max_non_split_rounding_mb:{self.max_non_split_rounding_bytes // MiB}")
        if self.large_segment_size_bytes != K_LARGE_BUFFER:
            parts.append(f"large_segment_size_mb:{self.large_segment_size_bytes // MiB}")
        return ",".join(parts)

    @classmethod
    def from_alloc_conf(cls, conf: str) -> AllocatorConfig:
        """Parse the subset of ``PYTORCH_CUDA_ALLOC_CONF`` that matters here (other keys are ignored)."""
        kwargs: dict[str, object] = {}
        for key, value in _split_conf(conf):
            if key == "expandable_segments":
                kwargs["expandable_segments"] = value == "True"
            elif key == "max_split_size_mb":
                kwargs["max_split_size_bytes"] = int(value) * MiB
            elif key == "garbage_collection_threshold":
                kwargs["garbage_collection_threshold"] = float(value)
            elif key == "max_non_split_rounding_mb":
                kwargs["max_non_split_rounding_bytes"] = int(value) * MiB
            elif key == "large_segment_size_mb":
                kwargs["large_segment_size_bytes"] = int(value) * MiB
            elif key == "roundup_power2_divisions":
                kwargs["roundup_power2_divisions"] = _parse_divisions(value)
        return cls(**kwargs)  # type: ignore[arg-type]


def _split_conf(conf: str) -> list[tuple[str, str]]:
    """'a:1,b:[x:1,>:2]' -> [('a', '1'), ('b', '[x:1,>:2]')]."""
    out: list[tuple[str, str]] = []
    depth, start = 0, 0
    conf = conf.replace(" ", "")
    for i, ch in enumerate(conf + ","):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            item = conf[start:i]
            start = i + 1
            if item:
                key, _, value = item.partition(":")
                out.append((key, value))
    return out


def _parse_divisions(value: str) -> int | tuple[int, ...]:
    if not value.startswith("["):
        return int(value)
    table = [0] * _N_DIVISION_INTERVALS
    first, last_index = True, 0
    for item in value.strip("[]").split(","):
        bound, _, div = item.partition(":")
        d = int(div)
        if bound == ">":
            for i in range(last_index, _N_DIVISION_INTERVALS):
                table[i] = d
            continue
        # PyTorch indexes the interval by log2 of the bound (given in MiB)
        index = min(max(int(bound).bit_length() - 1, 0), _N_DIVISION_INTERVALS - 1)
        if first:
            for i in range(index):
                table[i] = d
            first = False
        table[index] = d
        last_index = index
    return tuple(table)


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    if size & (size - 1) == 0:
        return size
    power2_floor = 1 << (size.bit_length() - 1)
    step = power2_floor >> (divisions.bit_length() - 1)
    if step == 0:
        return power2_floor << 1
    floor = size & ~(step - 1)
    return size if floor == size else floor + step


def round_size(size: int, config: AllocatorConfig | None = None) -> int:
    """Bytes the allocator reserves for a block answering a request of ``size`` bytes."""
    return round_size_by_table(size, config.division_table() if config is not None else None)


def round_size_by_table(size: int, table: tuple[int, ...] | None) -> int:
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    if table is not None:
        divisions = table[min(max(size.bit_length() - 21, 0), _N_DIVISION_INTERVALS - 1)]
        if divisions > 1 and size > K_MIN_BLOCK_SIZE * divisions:
            return _roundup_power2_next_division(size, divisions)
    return (size + K_MIN_BLOCK_SIZE - 1) & ~(K_MIN_BLOCK_SIZE - 1)


def get_allocation_size(rounded: int, config: AllocatorConfig | None = None) -> int:
    """Size of the segment cudaMalloc'ed for a (rounded) request that found no cached block."""
    if rounded <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if rounded < K_MIN_LARGE_ALLOC:
        return config.large_segment_size_bytes if config is not None else K_LARGE_BUFFER
    return (rounded + K_ROUND_LARGE - 1) // K_ROUND_LARGE * K_ROUND_LARGE
