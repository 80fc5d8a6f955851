"""Registers the structured configs of :mod:`memopt.config.schema` in Hydra's ConfigStore.

``configs/base.yaml`` starts its defaults list with ``plan_schema``, so every primary config built on it (the
bundled ``configs/plan.yaml`` and the ``recipes/``) is typed by :class:`~memopt.config.schema.PlanConfig`:
a misspelt key fails at composition, before anything is planned. Call :func:`register` before composing
(``python -m memopt.plan`` does; so does :func:`memopt.config.compose_plan_config`).
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from memopt.config.schema import HardwareConfig, PlanConfig

__all__ = ["SCHEMA_NAME", "register"]

#: the ConfigStore name of the top-level schema
SCHEMA_NAME = "plan_schema"


def register() -> None:
    """Store the schema and ``hardware=auto`` (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name=SCHEMA_NAME, node=PlanConfig)
    # the local GPU; not a YAML under configs/hardware/, which lists complete specs only (detect_hardware
    # matches the local GPU against them)
    cs.store(group="hardware", name="auto", node=HardwareConfig(name="auto"))
