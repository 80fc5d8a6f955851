"""Measured choice among the planner's best candidates (``memopt.wrap(..., autotune=True)``).

The step-time model ranks candidates from FLOPs, bytes and kernel counts; on a fast GPU two candidates
within ~10% of each other can swap places (host-side overhead per micro-batch pass and per checkpointed
block is hard to predict). When ``wrap`` makes the plan itself on a GPU, its search also keeps every fitting plan
of the same optimizer, allocator mode, precision and method predicted within ``ALTERNATIVES_WITHIN`` of its choice
(``Plan.alternatives``: other block counts, micro-batch sizes, checkpointing modes; no re-plan is made for them), and
measures them on the first real batch, keeping the fastest:

* each candidate is applied with ``prepare`` and undone afterwards, so the user's module is untouched;
* a candidate runs the forward and backward passes of every micro-batch of the global batch three times
  (the first warms kernels and the allocator; the faster of the other two counts); gradients are dropped, no optimizer
  step runs, so weights, optimizer state, step count and data position are exactly as before, and the
  RNG state is restored afterwards;
* its score is the measured passes plus the *predicted* optimizer time of its plan (every candidate keeps
  the chosen plan's optimizer and allocator settings, so those do not differ between them);
* a candidate that runs out of memory is dropped (its plan said it fits: the note says so).

A saved plan (``plan=``) is applied unchanged: nothing re-plans silently.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memopt import progress
from memopt.plan.evaluated import ALTERNATIVES_WITHIN
from memopt.plan.schema import Plan
from memopt.step.batch import to_device
from memopt.step.prepare import Prepared, prepare
from memopt.step.train_step import count_loss_items, discard_accumulation, split_batch

__all__ = ["Trial", "autotune", "frontier", "time_passes"]


@dataclass
class Trial:
    """One measured candidate."""

    plan: Plan
    passes_s: float | None  # the timed forward+backward passes over the global batch; None: it failed
    score_s: float | None  # passes + the plan's predicted optimizer time
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": self.plan.strategy.label(), "predicted_step_s": self.plan.step_time_s,
                "measured_passes_s": self.passes_s, "score_s": self.score_s, "error": self.error}


def frontier(chosen: Plan, others: Iterable[Plan], *, tolerance: float = ALTERNATIVES_WITHIN) -> list[Plan]:
    """The candidates worth measuring: the chosen plan, then the distinct fitting plans the clock cannot tell
    apart from it (predicted within ``tolerance`` of its step time), fastest predicted first. Measuring a plan the
    clock puts 30% behind costs seconds at the start of training and almost never wins. Only plans of the chosen
    plan's engine are kept: a ZeRO/FSDP or offload plan measured through the one-GPU step keeps on the GPU what its
    engine would shard or offload, so it runs out of memory, or is timed as another configuration than it is."""
    limit = chosen.step_time_s * (1.0 + tolerance)
    engine = chosen.strategy.extra("sharding")
    seen = {chosen.strategy.label()}
    close = []
    for plan in sorted(others, key=lambda p: p.step_time_s):
        label = plan.strategy.label()
        same_engine = plan.strategy.extra("sharding") == engine
        if plan.fits and same_engine and label not in seen and plan.step_time_s <= limit:
            seen.add(label)
            close.append(plan)
    return [chosen, *close]


def time_passes(model: nn.Module, prepared: Prepared, batch: Any, *, repeats: int = 3,
                sync: Callable[[], None] | None = None, max_micro_batches: int | None = 4) -> float:
    """Seconds of the fastest forward+backward sweep over the micro-batches of ``batch`` after the first
    (which warms kernels and the allocator): the minimum is the least noisy estimate of what a configuration
    can do when runs on one GPU vary by 10-20% from one process to the next. A sweep runs at most
    ``max_micro_batches`` of the batch's (equal) micro-batches and is scaled to all of them: with gradients
    accumulating from the first, the later ones repeat the same work, and 16 micro-batches three times over
    made the autotune take most of a minute."""
    step = prepared.step
    sync = sync or (torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None))
    micro = split_batch(batch, step.strategy.micro_batch_size)
    counts = [count_loss_items(mb, causal=step.causal_lm) for mb in micro]
    total = max(1, sum(counts))
    swept = micro if max_micro_batches is None else micro[:max(1, max_micro_batches)]
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for mb, n in zip(swept, counts):
            loss = step.loss(to_device(mb, step.device))
            step.backward(loss * (n / total))
            del loss
        sync()
        times.append(time.perf_counter() - start)
        discard_accumulation(prepared.step)
    best = min(times[1:]) if len(times) > 1 else times[0]
    return best * len(micro) / len(swept)


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    return torch.get_rng_state(), (torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None)


def _restore_rng(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def autotune(model: nn.Module, plans: Iterable[Plan], batch: Any, prepare_kwargs: dict[str, Any], *,
             timer: Callable[[nn.Module, Prepared, Any], float] = time_passes,
             time_budget_s: float | None = 20.0, clock: Callable[[], float] = time.perf_counter,
             ) -> tuple[Plan, list[Trial]]:
    """Measure each distinct plan on ``batch`` and return the fastest (ties: the earlier, i.e. the planner's
    choice) with every trial. ``model`` must have no strategy applied. Once ``time_budget_s`` has passed, the
    plans not yet measured are not (the first always is): training waits for the autotune."""
    seen: set[str] = set()
    trials: list[Trial] = []
    rng = _rng_state()
    start = clock()
    try:
        for plan in plans:
            label = plan.strategy.label()
            if label in seen or not plan.fits:
                continue
            seen.add(label)
            if trials and time_budget_s is not None and clock() - start > time_budget_s:
                trials.append(Trial(plan, None, None, error=f"not measured: the autotune's {time_budget_s:.0f} s "
                                                              "were spent"))
                continue
            prepared = None
            try:
                prepared = prepare(model, plan.strategy, **prepare_kwargs)
                passes = timer(model, prepared, batch)
                opt_s = float(plan.prediction.get("optimizer_s", 0.0) or 0.0)
                trials.append(Trial(plan, passes, passes + opt_s))
                progress.report(f"autotune: {label}: {passes + opt_s:.3f} s/step measured, "
                                f"{plan.step_time_s:.3f} predicted")
            except torch.cuda.OutOfMemoryError as exc:
                trials.append(Trial(plan, None, None, error=f"out of memory: {str(exc).splitlines()[0]}"))
                progress.report(f"autotune: {label}: out of memory")
            finally:
                if prepared is not None:
                    discard_accumulation(prepared.step)
                    prepared.undo()
                del prepared
                _free()
    finally:
        _restore_rng(rng)
    measured = [t for t in trials if t.score_s is not None]
    if not measured:
        raise ValueError("autotune could not run any candidate plan on this batch (each ran out of memory); "
                         "pass autotune=False to apply the planner's choice, or a larger budget")
    best = min(measured, key=lambda t: t.score_s)  # min keeps the first of equal scores
    return best.plan, trials


def describe(trials: list[Trial], chosen: Plan) -> str:
    """One line for the plan's notes."""
    parts = [f"{t.plan.strategy.label()}: " + (f"{t.score_s:.3f} s (predicted {t.plan.step_time_s:.3f} s)"
                                               if t.score_s is not None else t.error or "failed") for t in trials]
    return f"autotune measured {len(trials)} candidates on the first batch and chose " \
           f"{chosen.strategy.label()}: " + "; ".join(parts)
