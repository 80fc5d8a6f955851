"""Estimates: ``memopt.estimate(profile, strategy, hardware=...) -> Estimate``.

The module is callable (see ``memopt._callable_module``): ``memopt.estimate(...)`` calls
:func:`memopt.estimate.estimator.estimate_strategy`.
"""

from memopt._callable_module import make_callable
from memopt.estimate.estimator import Estimate, estimate_strategy

__all__ = ["Estimate", "estimate_strategy"]

make_callable(__name__, estimate_strategy)
