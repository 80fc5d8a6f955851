"""``memopt.estimate``'s check of the strategy it is given: a ``Strategy`` is a plain dataclass that anyone builds,
and the estimate reads its counts as they are (``grad_accum_steps=0`` trains no sample, a negative count makes
negative allocations), so every field the estimate computes with is checked first, each problem on its line of one
:class:`memopt.errors.InputError` of one line."""

from __future__ import annotations

import functools
import numbers
from typing import Any

from memopt.errors import InputError
from memopt.estimate.estimator import Estimate, estimate_strategy
from memopt.strategy import PRECISIONS, Strategy

__all__ = ["checked_estimate", "strategy_problems"]

_CHECKPOINT_MODES = ("none", "full", "selective")


def _count(value: Any, low: int) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= low


def strategy_problems(strategy: Any) -> list[str]:
    """One line per field of ``strategy`` that no estimate can be made for (empty: it can be estimated)."""
    if not isinstance(strategy, Strategy):
        return [f"strategy must be a memopt.Strategy, got {type(strategy).__name__}: e.g. "
                "memopt.Strategy(precision='bf16_autocast', micro_batch_size=4, grad_accum_steps=2)"]
    problems = []
    for key, low, meaning in (("micro_batch_size", 1, "samples per micro-batch"),
                              ("grad_accum_steps", 1, "micro-batches per optimizer step"),
                              ("chunked_ce", 0, "chunks of the fused loss; 0 is off")):
        value = getattr(strategy, key)
        if not _count(value, low):
            problems.append(f"Strategy.{key}={value!r} must be an integer >= {low} ({meaning})")
    if strategy.precision not in PRECISIONS:
        problems.append(f"Strategy.precision={strategy.precision!r} is not one of {', '.join(PRECISIONS)}")
    cp = strategy.checkpointing
    if cp.mode not in _CHECKPOINT_MODES:
        problems.append(f"Strategy.checkpointing.mode={cp.mode!r} is not one of {', '.join(_CHECKPOINT_MODES)}")
    if cp.num_blocks is not None and not _count(cp.num_blocks, 0):
        problems.append(f"Strategy.checkpointing.num_blocks={cp.num_blocks!r} must be None (every block) or an "
                        "integer >= 0")
    return problems


@functools.wraps(estimate_strategy)
def checked_estimate(profile: Any, strategy: Strategy, **kwargs: Any) -> Estimate:
    problems = strategy_problems(strategy)
    if problems:
        raise InputError(["; ".join(problems)] if len(problems) == 1 else
                         [f"invalid strategy: {'; '.join(problems)}"], "strategy")
    return estimate_strategy(profile, strategy, **kwargs)
