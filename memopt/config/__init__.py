"""Configs of the dry run ``python -m memopt.plan``: the typed schema (:mod:`memopt.config.schema`), its
registration in Hydra's ConfigStore (:mod:`memopt.config.store`), validation that reports every problem at
once (:mod:`memopt.config.validate`) and readable composition errors (:mod:`memopt.config.errors`).

>>> cfg = compose_plan_config(["model=llama3_8b", "budget=40GB", "policy=8bit"])
>>> validate(cfg)            # [] when it can be planned; otherwise one message per problem
>>> plan = resolve(cfg).plan()
"""

from memopt.config.compose import compose_plan_config
from memopt.config.errors import diagnose, explain_hydra_error
from memopt.config.schema import (
    ForbidConfig,
    HardwareConfig,
    ModelConfig,
    OptimizerKwargs,
    PinsConfig,
    PlanConfig,
    PolicyConfig,
    TrainingConfig,
)
from memopt.config.store import register
from memopt.config.validate import ConfigError, PlanRequest, resolve, validate

__all__ = [
    "ConfigError",
    "ForbidConfig",
    "HardwareConfig",
    "ModelConfig",
    "OptimizerKwargs",
    "PinsConfig",
    "PlanConfig",
    "PlanRequest",
    "PolicyConfig",
    "TrainingConfig",
    "compose_plan_config",
    "diagnose",
    "explain_hydra_error",
    "register",
    "resolve",
    "validate",
]
