"""Validation rows: one (model, sample, strategy) measured on a GPU and predicted on a CPU.

A row is plain data so it can be written to JSON by the GPU script and replayed by CI: the current
estimator recomputes every committed row's prediction and compares it with the measured figures.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from memopt.strategy import Strategy

__all__ = ["MEASURED_KEYS", "Row"]

MEASURED_KEYS = (
    "measured_peak_allocated_bytes",
    "measured_peak_reserved_bytes",
    "measured_device_used_bytes",
    "measured_outside_allocator_bytes",
    "measured_step_s",
)


@dataclass(frozen=True, kw_only=True)
class Row:
    """What to run: a shipped model (with overrides), a global batch and a strategy."""

    id: str
    model: str
    batch_size: int
    seq_len: int | None = None
    image_size: int | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    strategy: Strategy = field(default_factory=Strategy)
    steps: int = 3
    hardware: str = "h200"
    cap_bytes: int | None = None  # run under set_per_process_memory_fraction for this many allocator bytes
    tags: tuple[str, ...] = ()

    def sample(self) -> dict[str, int]:
        out = {"batch_size": self.batch_size}
        if self.seq_len is not None:
            out["seq_len"] = self.seq_len
        if self.image_size is not None:
            out["image_size"] = self.image_size
        return out

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["strategy"] = self.strategy.to_dict()
        d["tags"] = list(self.tags)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Row:
        known = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in data.items() if k in known}
        d["strategy"] = Strategy.from_dict(d.get("strategy", {}))
        d["tags"] = tuple(d.get("tags", ()))
        return cls(**d)
