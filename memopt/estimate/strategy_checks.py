"""``memopt.estimate``'s check of what it is given: a ``Strategy`` is a plain dataclass that anyone builds,
and the estimate reads its counts as they are (``grad_accum_steps=0`` trains no sample, a negative count makes
negative allocations), so every field the estimate computes with is checked first, each problem on its line of one
:class:`memopt.errors.InputError` of one line.

The profile is of one global batch (its sample's ``batch_size``), and the strategy says how that batch is split:
``micro_batch_size x grad_accum_steps`` (x the data-parallel ranks of a sharded strategy) must be that batch. The
estimate itself would scale the traces to any batch, so a strategy of another batch (``Strategy()`` is one sample)
gave the memory and time of a batch the user never asked for, and said nothing."""

from __future__ import annotations

import functools
import numbers
from typing import Any

from memopt.errors import InputError, as_input_errors
from memopt.estimate.estimator import Estimate, estimate_strategy
from memopt.hardware import load_hardware
from memopt.profile.profile import Profile
from memopt.strategy import PRECISIONS, Checkpointing, Strategy
from memopt.techniques.optimizers import OPTIMIZER_NAMES

__all__ = ["batch_problems", "checked_estimate", "strategy_problems"]

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
    if strategy.optimizer not in OPTIMIZER_NAMES:
        problems.append(f"Strategy.optimizer={strategy.optimizer!r} is not one of {', '.join(OPTIMIZER_NAMES)}")
    cp = strategy.checkpointing
    if not isinstance(cp, Checkpointing):
        problems.append(f"Strategy.checkpointing={cp!r} must be a memopt.Checkpointing, e.g. "
                        "memopt.Checkpointing(mode='full') (mode none, full or selective)")
        return problems
    if cp.mode not in _CHECKPOINT_MODES:
        problems.append(f"Strategy.checkpointing.mode={cp.mode!r} is not one of {', '.join(_CHECKPOINT_MODES)}")
    if cp.num_blocks is not None and not _count(cp.num_blocks, 0):
        problems.append(f"Strategy.checkpointing.num_blocks={cp.num_blocks!r} must be None (every block) or an "
                        "integer >= 0")
    return problems


def _ranks(strategy: Strategy) -> int:
    sharding = strategy.extra("sharding")
    world = sharding.get("world_size", 1) if isinstance(sharding, dict) else getattr(sharding, "world_size", 1)
    return world if _count(world, 1) else 1


def batch_problems(profile: Profile, strategy: Strategy) -> list[str]:
    """The line saying the strategy's batch is not the profile's (empty: it is), with the splits that would be."""
    batch = profile.sample.get("batch_size", 1)
    mb, acc, ranks = strategy.micro_batch_size, strategy.grad_accum_steps, _ranks(strategy)
    if not _count(batch, 1) or mb * acc * ranks == batch:
        return []
    per_rank = f" x {ranks} data-parallel ranks" if ranks > 1 else ""
    if batch % ranks:
        fix = f"the profile's batch does not split over {ranks} ranks: profile a multiple of {ranks} samples"
    else:
        share = batch // ranks
        splits = [f"{m} x {share // m}" for m in range(share, 0, -1) if share % m == 0][:4]
        fix = (f"use micro_batch_size x grad_accum_steps = {share} ({', '.join(splits)}), or profile a batch of "
               f"{mb * acc * ranks}")
    return [f"Strategy micro_batch_size {mb} x grad_accum_steps {acc}{per_rank} = {mb * acc * ranks} samples per "
            f"step, but the profile is of a batch of {batch} (its sample's batch_size): {fix}"]


@functools.wraps(estimate_strategy)
def checked_estimate(profile: Any, strategy: Strategy, **kwargs: Any) -> Estimate:
    if not isinstance(profile, Profile):
        raise InputError([f"profile must be a memopt.Profile, got {type(profile).__name__}: make one with "
                          "memopt.profile(model, sample, hardware=...) and pass it"])
    problems = strategy_problems(strategy)
    if not problems:
        problems = batch_problems(profile, strategy)
    if problems:
        raise InputError(["; ".join(problems)] if len(problems) == 1 else
                         [f"invalid strategy: {'; '.join(problems)}"], "strategy")
    if kwargs.get("hardware") is not None:
        with as_input_errors():
            kwargs["hardware"] = load_hardware(kwargs["hardware"])
    return estimate_strategy(profile, strategy, **kwargs)
