"""An on-disk memo of estimates, next to the cached profile they were computed from.

The planner estimates the same candidates every time it plans a model (the infeasibility report alone replays
the caching allocator over the whole run of a dozen or more of them: ~0.4 s each for a 70B model). An estimate
depends only on the profile's traces (named by the profile key), the strategy, the hardware and memopt's
estimator code, so it is kept in ``<cache_dir>/estimates/<profile key>.json`` under a key of the strategy and the
hardware, and the file is dropped as a whole when the code that computes estimates changes (a digest of its
sources). A profile used without the cache (``use_cache=False``), with a user loss or optimizer (which the
profile key does not name), is never memoized.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from memopt.categories import MemoryCategory
from memopt.estimate.estimator import Estimate
from memopt.hardware import HardwareSpec
from memopt.profile.cache_keys import cache_dir
from memopt.profile.profile import Profile
from memopt.strategy import Strategy

__all__ = ["EstimateStore", "code_digest", "estimate_from_json", "estimate_to_json"]

_ROOT = Path(__file__).resolve().parent.parent
# the sources whose code decides an estimate from a profile's traces (traces themselves are keyed by the profile)
_SOURCES = ("estimate", "techniques", "strategy.py", "hardware.py", "categories.py", "units.py",
            "profile/profile.py", "profile/tracker.py", "profile/trace.py", "profile/variant_trace.py",
            "profile/model_state.py")
_DIGEST: list[str] = []
STORE_VERSION = 1


def code_digest() -> str:
    """A digest of memopt's estimator sources (computed once per process)."""
    if not _DIGEST:
        h = hashlib.sha256(f"v{STORE_VERSION}".encode())
        for name in _SOURCES:
            path = _ROOT / name
            files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
            for f in files:
                h.update(str(f.relative_to(_ROOT)).encode())
                h.update(f.read_bytes())
        _DIGEST.append(h.hexdigest()[:24])
    return _DIGEST[0]


def estimate_to_json(e: Estimate) -> dict[str, Any]:
    d = dataclasses.asdict(e)
    d["breakdown"] = [[k.value, v] for k, v in e.breakdown.items()]
    return d


def estimate_from_json(d: dict[str, Any]) -> Estimate:
    d = dict(d)
    d["breakdown"] = {MemoryCategory(k): v for k, v in d["breakdown"]}
    return Estimate(**d)


def _hardware_id(hw: HardwareSpec) -> str:
    return hashlib.sha256(json.dumps(dataclasses.asdict(hw), sort_keys=True, default=str).encode()).hexdigest()[:16]


class EstimateStore:
    """Quick (allocated bytes) and exact (allocator simulated) estimates of one profile, and totals that exact
    ones are known to reach (replays stopped early), read from and written to the cache. ``get``/``put`` are
    no-ops (None / nothing) when the profile is not memoizable."""

    def __init__(self, profile: Profile) -> None:
        self.enabled = (profile._cache_path is not None and profile._loss_fn is None
                        and profile._optimizer_spec is None and not os.environ.get("MEMOPT_NO_ESTIMATE_CACHE"))
        self.path = cache_dir() / "estimates" / f"{profile.key}.json"
        self.entries: dict[str, dict[str, Any]] = {}
        self.dirty = False
        self._hw_ids: dict[int, str] = {}
        if self.enabled and self.path.exists():
            try:
                data = json.loads(self.path.read_text())
                if data.get("code") == code_digest() and data.get("profile") == profile.key:
                    self.entries = data["entries"]
            except (OSError, ValueError, KeyError, TypeError):
                self.entries = {}

    def _key(self, s: Strategy, hw: HardwareSpec, kind: str) -> str:
        hw_id = self._hw_ids.get(id(hw))
        if hw_id is None:  # hashed once per spec object, not once per lookup
            hw_id = self._hw_ids[id(hw)] = _hardware_id(hw)
        return f"{kind}|{hw_id}|{s!r}"

    def _usable(self, s: Strategy) -> bool:
        return self.enabled and s.optimizer != "user"

    def get(self, s: Strategy, hw: HardwareSpec, exact: bool) -> Estimate | None:
        if not self._usable(s):
            return None
        d = self.entries.get(self._key(s, hw, "exact" if exact else "quick"))
        if d is None:
            return None
        try:
            return estimate_from_json(d)
        except (TypeError, ValueError, KeyError):
            return None

    def put(self, s: Strategy, hw: HardwareSpec, exact: bool, e: Estimate) -> None:
        if not self._usable(s):
            return
        key = self._key(s, hw, "exact" if exact else "quick")
        if key not in self.entries:
            self.entries[key] = estimate_to_json(e)
            self.dirty = True

    def get_bound(self, s: Strategy, hw: HardwareSpec) -> int | None:
        """A total that ``s``'s exact total is known to reach (an allocator replay stopped there), or None."""
        d = self.entries.get(self._key(s, hw, "above")) if self._usable(s) else None
        return d if isinstance(d, int) else None

    def put_bound(self, s: Strategy, hw: HardwareSpec, total_bytes: int) -> None:
        if self._usable(s) and total_bytes > (self.get_bound(s, hw) or -1):
            self.entries[self._key(s, hw, "above")] = total_bytes
            self.dirty = True

    def save(self) -> None:
        if not (self.enabled and self.dirty):
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(f"{self.path}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"code": code_digest(), "profile": self.path.stem, "entries": self.entries}))
            tmp.replace(self.path)
            self.dirty = False
        except OSError:
            pass  # a read-only cache is no reason to fail a plan
