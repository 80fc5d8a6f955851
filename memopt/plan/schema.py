"""The ``Plan``: what the planner chose, why, and what it predicts; saved as JSON and loaded back unchanged."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memopt.errors import InputError, as_input_errors
from memopt.strategy import ATTENTION_BACKENDS, CE_KERNELS, PRECISIONS, Strategy
from memopt.techniques.optimizers import OPTIMIZER_NAMES

__all__ = ["PLAN_SCHEMA_VERSION", "Plan", "plan_problems"]

PLAN_SCHEMA_VERSION = 1


@dataclass
class Plan:
    """A chosen strategy with its predicted memory and time (``fits`` says whether it fits the budget)."""

    fits: bool
    strategy: Strategy
    budget_bytes: int
    margin_bytes: int
    prediction: dict[str, Any]  # the chosen strategy's estimate (Estimate.to_dict())
    model: dict[str, Any]
    hardware: str
    policy: dict[str, Any]
    global_batch: int
    runners_up: list[dict[str, Any]] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)  # technique -> why the other values lost
    savings: dict[str, dict[str, Any]] = field(default_factory=dict)  # technique -> memory saved, time cost
    infeasible: dict[str, Any] | None = None
    search: dict[str, Any] = field(default_factory=dict)  # candidates, evaluated, pruned, seconds
    notes: list[str] = field(default_factory=list)
    schema_version: int = PLAN_SCHEMA_VERSION
    # the fitting plans the clock cannot tell apart from this one, fastest first (``make_plan(alternatives_within=)``):
    # what the autotune measures on the GPU; not saved, a plan file is applied unchanged
    alternatives: list[Plan] = field(default_factory=list, repr=False, compare=False)

    # -- the figures every issue names ----------------------------------------------------------
    @property
    def peak_allocated_bytes(self) -> int:
        return int(self.prediction["peak_allocated_bytes"])

    @property
    def peak_reserved_bytes(self) -> int:
        return int(self.prediction["peak_reserved_bytes"])

    @property
    def total_bytes(self) -> int:
        return int(self.prediction["total_bytes"])

    @property
    def step_time_s(self) -> float:
        return float(self.prediction["step_time_s"])

    @property
    def techniques(self) -> dict[str, Any]:
        return self.strategy.to_dict()

    def to_dict(self) -> dict[str, Any]:
        throughput = {k: v for k, v in self.prediction.items() if k.endswith("_per_s")}
        return {
            "schema_version": self.schema_version,
            "fits": self.fits,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "runtime_bytes": int(self.prediction["runtime_bytes"]),
            "total_bytes": self.total_bytes,
            "budget_bytes": self.budget_bytes,
            "margin_bytes": self.margin_bytes,
            "step_time_s": self.step_time_s,
            **throughput,
            "techniques": self.techniques,
            "strategy_label": self.strategy.label(),
            "breakdown": self.prediction["breakdown"],
            "peak_at": self.prediction.get("peak_at"),
            "prediction": self.prediction,
            "model": self.model,
            "hardware": self.hardware,
            "policy": self.policy,
            "global_batch": self.global_batch,
            "runners_up": self.runners_up,
            "rejected": self.rejected,
            "savings": self.savings,
            "infeasible": self.infeasible,
            "search": self.search,
            "notes": self.notes,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        with as_input_errors():  # the plan's JSON is the user's input: every refusal of it is theirs to fix
            return cls._from_dict(data)

    @classmethod
    def _from_dict(cls, data: dict[str, Any]) -> Plan:
        version = data.get("schema_version")
        if version != PLAN_SCHEMA_VERSION:
            raise ValueError(f"plan schema version {version!r} is not the supported {PLAN_SCHEMA_VERSION}; "
                             "make the plan again with this memopt (python -m memopt.plan ...)")
        missing = [k for k in ("fits", "techniques", "budget_bytes", "prediction", "model", "hardware", "policy",
                               "global_batch") if k not in data]
        if missing:
            raise ValueError(f"not a memopt plan: missing {', '.join(missing)}")
        problems = plan_problems(data)
        if problems:
            raise InputError([f"plan: {p}" for p in problems], "plan")
        return cls(fits=data["fits"], strategy=Strategy.from_dict(data["techniques"]),
                   budget_bytes=data["budget_bytes"], margin_bytes=data.get("margin_bytes", 0),
                   prediction=data["prediction"], model=data["model"], hardware=data["hardware"],
                   policy=data["policy"], global_batch=data["global_batch"], runners_up=data.get("runners_up", []),
                   rejected=data.get("rejected", {}), savings=data.get("savings", {}),
                   infeasible=data.get("infeasible"), search=data.get("search", {}), notes=data.get("notes", []),
                   schema_version=version)

    def save(self, path: str | os.PathLike[str]) -> Path:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(self.to_dict(), indent=2, default=str))
        return out

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        with as_input_errors():  # the path and the file are the user's input
            return cls._load(path)

    @classmethod
    def _load(cls, path: str | os.PathLike[str]) -> Plan:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ValueError(f"no plan file at {path}") from None
        except IsADirectoryError:
            raise ValueError(f"{path} is a directory: pass the plan's JSON file (plan.save(path) writes one)") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path} is not valid JSON ({exc}); it is not a memopt plan") from exc
        if not isinstance(data, dict):
            raise ValueError(f"{path} holds a JSON {type(data).__name__}, not a memopt plan (an object with fits, "
                             "strategy, budget_bytes, ...): pass a file plan.save(path) wrote")
        return cls.from_dict(data)


_BYTES = ("peak_allocated_bytes", "peak_reserved_bytes", "runtime_bytes", "total_bytes")
_SECONDS = ("step_time_s", "forward_s", "backward_s", "optimizer_s")
# what Plan.to_dict copies from the prediction to the top level, for a reader; the prediction is what is applied
_COPIES = (*_BYTES, "step_time_s", "breakdown", "peak_at")


def _prediction_problems(data: dict[str, Any]) -> list[str]:
    """The prediction's figures: present, in range, adding up, agreeing with ``fits`` and with the top level's
    copies of them (a hand edit of either copy would otherwise be ignored or applied without a word)."""
    pred = data["prediction"]
    problems = []
    for key in _BYTES:
        if not _is_int(pred.get(key)):
            problems.append(f"prediction.{key}={pred.get(key)!r} must be a non-negative integer of bytes")
    for key in [k for k in _SECONDS if k in pred or k == "step_time_s"] + [k for k in pred if k.endswith("_per_s")]:
        if not _is_seconds(pred.get(key)):
            problems.append(f"prediction.{key}={pred.get(key)!r} must be a finite number >= 0")
    if problems:
        return problems
    reserved, runtime, total = pred["peak_reserved_bytes"], pred["runtime_bytes"], pred["total_bytes"]
    if total != reserved + runtime:
        problems.append(f"prediction.total_bytes={total} is not peak_reserved_bytes {reserved} + runtime_bytes "
                        f"{runtime} = {reserved + runtime}")
    budget = data.get("budget_bytes")
    if data.get("fits") is True and _is_int(budget, 1) and total > budget:
        problems.append(f"fits=true, but prediction.total_bytes={total} is over budget_bytes={budget}: a plan over "
                        "its budget does not fit")
    for key in _COPIES + tuple(k for k in pred if k.endswith("_per_s")):
        if key in data and data[key] != pred.get(key):
            problems.append(f"{key}={data[key]!r} disagrees with prediction.{key}={pred.get(key)!r} (the figure "
                            "applied): edit neither, or make the plan again")
    return problems


def _is_seconds(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _is_int(v: Any, low: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def plan_problems(data: dict[str, Any]) -> list[str]:
    """Every field of a plan's JSON that memopt could not apply as written (a hand edit such as
    ``"precision": "fp8"``), one line each with what would be valid."""
    problems: list[str] = []
    if not isinstance(data.get("fits"), bool):
        problems.append(f"fits={data.get('fits')!r} must be true or false")
    if not _is_int(data.get("budget_bytes"), 1):
        problems.append(f"budget_bytes={data.get('budget_bytes')!r} must be a positive integer of bytes")
    if not _is_int(data.get("margin_bytes", 0)):
        problems.append(f"margin_bytes={data.get('margin_bytes')!r} must be a non-negative integer of bytes")
    if not _is_int(data.get("global_batch"), 1):
        problems.append(f"global_batch={data.get('global_batch')!r} must be a positive integer")
    if not isinstance(data.get("hardware"), str) or not data.get("hardware"):
        problems.append(f"hardware={data.get('hardware')!r} must be a hardware name such as 'h100_80gb'")
    for key in ("prediction", "model", "policy"):
        if not isinstance(data.get(key), dict):
            problems.append(f"{key} must be a JSON object, got {type(data.get(key)).__name__}")
    if isinstance(data.get("prediction"), dict):
        problems += _prediction_problems(data)
    t = data.get("techniques")
    if not isinstance(t, dict):
        return [*problems, f"techniques must be a JSON object, got {type(t).__name__}"]
    choices = {"precision": PRECISIONS, "optimizer": OPTIMIZER_NAMES, "attention": ATTENTION_BACKENDS,
               "ce_kernel": CE_KERNELS}
    for key, valid in choices.items():
        if key in t and t[key] not in valid:
            problems.append(f"techniques.{key}={t[key]!r} is not one of {', '.join(valid)}")
    for key in ("activation_offload", "expandable_segments"):
        if key in t and not isinstance(t[key], bool):
            problems.append(f"techniques.{key}={t[key]!r} must be true or false")
    for key, low in (("micro_batch_size", 1), ("grad_accum_steps", 1), ("chunked_ce", 0)):
        if key in t and not _is_int(t[key], low):
            problems.append(f"techniques.{key}={t[key]!r} must be an integer >= {low}")
    cp = t.get("checkpointing", {})
    if not isinstance(cp, dict) or cp.get("mode", "none") not in ("none", "full", "selective") or \
            (cp.get("num_blocks") is not None and not _is_int(cp.get("num_blocks"))):
        problems.append(f"techniques.checkpointing={cp!r} must be {{mode: none|full|selective, num_blocks: null or "
                        "an integer >= 0}")
    mb, acc, gb = t.get("micro_batch_size", 1), t.get("grad_accum_steps", 1), data.get("global_batch")
    sharded = isinstance(t.get("extras"), dict) and t["extras"].get("sharding") is not None  # per-rank batches
    if _is_int(mb, 1) and _is_int(acc, 1) and _is_int(gb, 1) and mb * acc != gb and not sharded:
        problems.append(f"techniques: micro_batch_size {mb} x grad_accum_steps {acc} = {mb * acc} is not the "
                        f"global batch {gb}")
    return problems
