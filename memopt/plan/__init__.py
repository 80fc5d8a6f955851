"""Planning: ``memopt.plan(model, sample=..., budget="40GB") -> Plan`` and the dry run ``python -m memopt.plan``.

The module is callable (see ``memopt._callable_module``): ``memopt.plan(...)`` calls
:func:`memopt.plan.planner.make_plan`, also importable as ``memopt.make_plan``.
"""

from memopt._callable_module import make_callable
from memopt.plan.planner import make_plan
from memopt.plan.policy import FIDELITY_PRESETS, Policy
from memopt.plan.schema import PLAN_SCHEMA_VERSION, Plan

__all__ = ["FIDELITY_PRESETS", "PLAN_SCHEMA_VERSION", "Plan", "Policy", "make_plan"]

make_callable(__name__, make_plan)
