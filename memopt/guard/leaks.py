"""Leak detection from the per-step memory series.

A leak is *sustained growth of allocated memory at the same point of the step*: memory at the start of a
step (or after its optimizer step, or at its end) should come back to the same level every step, whatever
the batch; what keeps rising is being kept across steps. The rule, per point (defaults: 32 MiB, 5 steps):

1. it grew by at least ``threshold_bytes`` per step over the last ``window`` steps, on average over all
   but the largest single step (a one-off jump, such as the optimizer states the first step creates, is
   not a rate),
2. in at least ``window - 1`` of those steps by at least half the threshold (sustained, not one jump such as
   the optimizer states created by the first step or a workspace allocated once), and
3. it is now above everything seen before the window by at least half the window's growth (a new high:
   memory that varies with the inputs goes up and down around a level, a leak does not come back).

The end-of-step series starts from the first start-of-step reading, so a leak that begins with the first
step is reported at the end of the fifth. A leak is reported once, with its category and most likely cause,
told apart by evidence observed over the same window (see ``memopt.guard.census``):

* saved tensors alive that backward never used grow as fast as memory: a forward pass whose output is kept
  but never backpropagated (evaluation without ``no_grad`` whose loss is stored);
* saved tensors alive that backward already used grow: ``retain_graph=True`` with the graph still referenced;
* without the census (hooks unavailable), growth of about a whole forward's saved activations: a kept graph;
* growth of about the model's outputs per step: outputs/logits appended to a list;
* parameters, gradients or optimizer states that grow: those categories.

At an out-of-memory error (``diagnose_oom``)
--------------------------------------------
A leak fast enough to fill the budget before the 5-step window (an evaluation pass without ``no_grad`` that
keeps 1 GiB a step) ends in an OOM first. ``OOMGuard`` then asks ``diagnose_oom`` before it re-plans, since a
smaller plan cannot help a leak (the leak fills any plan). Its rule (``fast_growth``), on the start-of-step
series from the second step on (the first step creates the optimizer states and gradients once: its growth
is left out):

1. the last ``min_steps`` (default 2) step-to-step changes all grew by at least ``threshold_bytes``,
2. steadily: the smallest of them is at least a third of the largest,
3. to a new high: above every earlier reading by at least half of that growth (memory that varies with the
   inputs goes up and down around a level), and
4. the growth explains the failure: it is at least what the failed step lacked (the allocation it tried, or
   its measured need beyond the budget), so a plan that is simply too big is still re-planned.

The diagnosis carries the same cause classification and fix as a report from the window rule.
"""

from __future__ import annotations

import itertools
import logging
import statistics
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from memopt.categories import MemoryCategory
from memopt.units import MiB, format_bytes

__all__ = ["LeakDetector", "LeakReport", "MemoryLeakWarning", "fast_growth", "sustained_growth"]

log = logging.getLogger(__name__)
Cat = MemoryCategory


class MemoryLeakWarning(ResourceWarning):
    """Emitted once when memory keeps growing step after step."""


@dataclass
class LeakReport:
    step: int
    point: str
    growth_bytes_per_step: int
    window: int
    category: MemoryCategory
    cause: str  # graph_not_backpropagated | retain_graph | graph_kept | outputs_kept | parameters | gradients |
    # optimizer_states | unknown
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)

    @property
    def fix(self) -> str:
        """What usually causes this kind of leak and how to fix it."""
        return _FIXES[self.cause]

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "point": self.point, "growth_bytes_per_step": self.growth_bytes_per_step,
                "window": self.window, "category": str(self.category), "cause": self.cause, "message": self.message,
                "fix": self.fix, "evidence": self.evidence}


def sustained_growth(values: list[int], window: int, threshold: int) -> float | None:
    """Growth per step over the last ``window`` steps when it is a leak by the module's rule, else None.

    The rate leaves out the window's largest single step, so a one-off jump (the optimizer states the first
    step creates) neither makes a leak nor inflates one.
    """
    if len(values) < window + 1 or threshold <= 0:
        return None
    w = values[-(window + 1):]
    deltas = [b - a for a, b in itertools.pairwise(w)]
    rate = (w[-1] - w[0] - max(deltas)) / (window - 1)
    if rate < threshold:
        return None
    if sum(d >= threshold / 2 for d in deltas) < window - 1:
        return None
    before = values[:len(values) - window]
    if w[-1] - max(before) < window * threshold / 2:
        return None
    return rate


def fast_growth(values: list[int], min_steps: int, threshold: int, *,
                steady_ratio: float = 1 / 3) -> tuple[float, int] | None:
    """(growth per step, steps) of the steady growth that ends ``values``, by ``diagnose_oom``'s rule, or None.

    The run is the longest tail of changes that all grew by at least ``threshold`` with the smallest at least
    ``steady_ratio`` of the largest; it must span ``min_steps`` changes and end at a new high (above every
    reading before it by at least half its growth).
    """
    if min_steps < 1 or threshold <= 0 or len(values) < min_steps + 1:
        return None
    deltas = [b - a for a, b in itertools.pairwise(values)]
    n = 0
    while n < len(deltas) and deltas[-(n + 1)] >= threshold:
        n += 1
    while n >= min_steps and min(deltas[-n:]) < steady_ratio * max(deltas[-n:]):
        n -= 1  # the oldest change of the run is out of line with the rest: drop it
    if n < min_steps:
        return None
    growth = values[-1] - values[-(n + 1)]
    before = values[:-(n + 1)]
    if before and values[-1] - max(before) < growth / 2:
        return None
    return growth / n, n


_FIXES = {
    "graph_not_backpropagated": (
        "a forward pass whose result is kept but never backpropagated: every step leaves an autograd graph "
        "alive with the activations it saved. Typical cause: evaluation or logging without torch.no_grad() "
        "whose loss or outputs are stored. Fix: run it under torch.no_grad() (or torch.inference_mode()) "
        "and keep loss.item() or outputs.detach()"),
    "retain_graph": (
        "backward(retain_graph=True) on graphs that stay referenced: backward already used these saved tensors "
        "but they stay alive, and every step adds its graph. Typical causes: retain_graph=True left on while "
        "something keeps the graph (total_loss += loss, a recurrent state carried across steps without "
        ".detach()). Fix: drop retain_graph=True, detach carried state, accumulate loss.item()"),
    "graph_kept": (
        "about the activations of a whole forward pass per step: an autograd graph is kept every step (a "
        "forward whose output is stored but never backpropagated, or retain_graph=True with the graph still "
        "referenced). Fix: torch.no_grad() for evaluation, store loss.item(), detach carried state"),
    "outputs_kept": (
        "about the size of the model's outputs per step: outputs or logits appended to a list each step. "
        "Fix: keep reduced metrics, or outputs.detach().cpu()"),
    "parameters": "the parameters grow: modules or parameters are created every step",
    "gradients": "the gradients grow: new parameters get gradients every step, or gradients are kept",
    "optimizer_states": ("the optimizer states grow: parameters are added to the optimizer every step, or "
                         "a new optimizer is built per step while the old one is still referenced"),
    "unknown": ("tensors are kept across steps (metrics accumulated as tensors, caches, lists of batches); "
                "the largest live tensors are listed in the evidence"),
}
_CATEGORY = {"graph_not_backpropagated": Cat.ACTIVATIONS, "retain_graph": Cat.ACTIVATIONS,
             "graph_kept": Cat.ACTIVATIONS, "outputs_kept": Cat.ACTIVATIONS, "parameters": Cat.PARAMETERS,
             "gradients": Cat.GRADIENTS, "optimizer_states": Cat.OPTIMIZER_STATES, "unknown": Cat.TEMPORARIES}


class LeakDetector:
    """Feed it allocated bytes at named points of each step (``observe``); it reports a leak once.

    ``expected_activation_bytes``: the saved activations of one step's forward passes (from the profile or the
    plan); without it the census's count of bytes saved per step is used. ``census_fn`` (optional) lists the
    largest live tensors when a leak is reported. ``on_leak`` is called with the report.
    """

    def __init__(self, *, threshold_bytes: int = 32 * MiB, window: int = 5,
                 expected_activation_bytes: int | None = None, warn: bool = True,
                 on_leak: Callable[[LeakReport], None] | None = None,
                 census_fn: Callable[[], list[dict[str, Any]]] | None = None,
                 baselines: Mapping[str, str] | None = None) -> None:
        if window < 2:
            raise ValueError(f"leak window must be at least 2 steps, got {window}")
        self.threshold_bytes = int(threshold_bytes)
        self.window = window
        self.expected_activation_bytes = expected_activation_bytes
        self.warn = warn
        self.on_leak = on_leak
        self.census_fn = census_fn
        # a series that starts from another point's first reading (the state before the first step)
        self.baselines = dict(baselines if baselines is not None else {"step_end": "step_start"})
        self.series: dict[str, list[tuple[int, int, dict[str, int]]]] = {}
        self.report: LeakReport | None = None

    def observe(self, step: int, point: str, allocated_bytes: int,
                evidence: Mapping[str, Any] | None = None) -> LeakReport | None:
        """Record allocated bytes at ``point`` of ``step``; returns the report the first time a leak is seen."""
        series = self.series.get(point)
        if series is None:
            series = self.series[point] = []
            base = self.baselines.get(point)
            if base is not None and self.series.get(base):
                series.append(self.series[base][0])
        series.append((step, int(allocated_bytes), dict(evidence or {})))
        if self.report is not None:
            return None
        values = [v for _, v, _ in series]
        rate = sustained_growth(values, self.window, self.threshold_bytes)
        if rate is None:
            return None
        self.report = self._classify(step, point, rate, series[-(self.window + 1):])
        self._emit(self.report)
        return self.report

    def diagnose_oom(self, shortfall_bytes: int = 0, *, point: str = "step_start", skip_steps: int = 1,
                     min_steps: int = 2) -> LeakReport | None:
        """At an out-of-memory error: a ``LeakReport`` when memory at ``point`` grew fast and steadily enough
        over the steps before it to be the likely cause (see the module docstring), else None.

        ``shortfall_bytes``: what the failed step lacked (the allocation that failed, or its need beyond the
        budget); growth smaller than that cannot explain the failure. Readings of the first ``skip_steps``
        steps are left out (the first step creates the optimizer states). Records nothing and warns nothing:
        the caller reports the result.
        """
        series = [e for e in self.series.get(point, []) if e[0] >= skip_steps]
        values = [v for _, v, _ in series]
        found = fast_growth(values, min_steps, self.threshold_bytes)
        if found is None:
            return None
        rate, n = found
        if rate * n < shortfall_bytes:
            return None
        return self._classify(series[-1][0], point, rate, series[-(n + 1):])

    # -- telling causes apart ------------------------------------------------------------------------
    def _classify(self, step: int, point: str, rate: float, window: list[tuple[int, int, dict]]) -> LeakReport:
        last = window[-1][2]
        n = len(window) - 1

        def growth(key: str) -> float | None:
            """The median step's growth of an evidence figure (one-off jumps do not count), over the window's
            trailing steps that carry it (the graph census is switched on when growth starts)."""
            vals: list[Any] = []
            for _, _, e in reversed(window):
                if e.get(key) is None:
                    break
                vals.insert(0, e[key])
            if len(vals) < 2:
                return None
            return statistics.median(b - a for a, b in itertools.pairwise(vals))

        def recent_max(key: str) -> int | None:
            vals = [e[key] for _, _, e in window if e.get(key)]
            return max(vals) if vals else None

        ev: dict[str, Any] = {"growth_bytes_per_step": int(rate), "series_bytes": [v for _, v, _ in window]}
        deltas = {k: growth(k) for k in ("parameters_bytes", "gradients_bytes", "optimizer_states_bytes",
                                          "saved_unused_bytes", "saved_retained_bytes", "graph_outputs")}
        ev.update({f"growth_{k}": int(v) for k, v in deltas.items() if v is not None})
        census = bool(last.get("census"))
        activations = self.expected_activation_bytes or recent_max("saved_packed_bytes")
        outputs = recent_max("output_bytes")
        if activations:
            ev["activation_bytes_per_step"] = int(activations)
        if outputs:
            ev["output_bytes_per_step"] = int(outputs)
        half = rate / 2
        cause = "unknown"
        for key, name in (("optimizer_states_bytes", "optimizer_states"), ("parameters_bytes", "parameters"),
                          ("gradients_bytes", "gradients")):
            if (deltas[key] or 0) >= half:
                cause = name
                break
        else:
            if census and (deltas["saved_retained_bytes"] or 0) >= half:
                cause = "retain_graph"
            elif census and (deltas["saved_unused_bytes"] or 0) >= half:
                cause = "graph_not_backpropagated"
            elif outputs and 0.5 <= rate / outputs <= 2.0:
                cause = "outputs_kept"
            elif not census and activations and rate >= 0.5 * activations:
                cause = "graph_kept"
        if self.census_fn is not None:
            try:
                ev["live_tensors"] = self.census_fn()
            except Exception as exc:  # evidence only: never fail the step for it
                ev["live_tensors_error"] = str(exc)
        ev["census"] = census
        message = (f"memory leak: allocated memory at {point.replace('_', ' ')} grew by {format_bytes(rate)} per "
                   f"step over the last {n} steps (step {step}); likely {_FIXES[cause]}")
        return LeakReport(step=step, point=point, growth_bytes_per_step=int(rate), window=n,
                          category=_CATEGORY[cause], cause=cause, message=message, evidence=ev)

    def _emit(self, report: LeakReport) -> None:
        log.warning(report.message)
        if self.warn:
            warnings.warn(report.message, MemoryLeakWarning, stacklevel=3)
        if self.on_leak is not None:
            self.on_leak(report)
