"""Estimates: ``memopt.estimate(profile, strategy, hardware=...) -> Estimate``.

The module is callable (see ``memopt._callable_module``): ``memopt.estimate(...)`` checks the strategy
(:mod:`memopt.estimate.strategy_checks`) and calls :func:`memopt.estimate.estimator.estimate_strategy`.
"""

from memopt._callable_module import make_callable
from memopt.estimate.estimator import Estimate, estimate_strategy
from memopt.estimate.strategy_checks import checked_estimate

__all__ = ["Estimate", "estimate_strategy"]

make_callable(__name__, checked_estimate)
