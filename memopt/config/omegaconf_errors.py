"""OmegaConf's errors (an unknown key, a wrong type, a bad interpolation) as one message each that names what
would be valid. Apart from the Hydra composition errors (:mod:`memopt.config.errors`) because validating a composed
config needs these, and diagnosing composition runs the validation."""

from __future__ import annotations

import dataclasses
from typing import Any

from memopt.plan.checks import closest
from memopt.plan.policy import PINNABLE

__all__ = ["explain_omegaconf_error", "first_line"]


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _valid_keys(object_type: Any, parent_node: Any) -> list[str]:
    if isinstance(object_type, type) and dataclasses.is_dataclass(object_type):
        return [f.name for f in dataclasses.fields(object_type)]
    if parent_node is not None and hasattr(parent_node, "keys"):
        return [str(k) for k in parent_node]
    return []


def _unknown_key(full_key: str, object_type: Any, parent_node: Any, value: Any = None) -> str:
    parent, _, name = full_key.rpartition(".")
    valid = _valid_keys(object_type, parent_node)
    hint = closest(name, valid)
    if parent == "policy.pins":
        return (f"cannot pin unknown technique {name!r}{hint}; pinnable: {', '.join(PINNABLE)} "
                f"(e.g. policy.pins.checkpointing=full)")
    if parent == "policy.forbid":
        return (f"cannot forbid unknown technique {name!r}{hint}; techniques: {', '.join(valid)} "
                f"(e.g. policy.forbid.precision=[fp16_autocast])")
    if parent.endswith("hf_config"):
        return (f"{parent} has no field {name!r}{hint} (it has: {', '.join(valid)}); to add a config field write "
                f"+{full_key}={'<value>' if value is None else value}")
    if not parent:
        return (f"unknown key {name!r}{hint}; valid top-level keys: {', '.join(valid)} (choose configs with "
                "model=, hardware=, policy=, training=)")
    return f"unknown key {full_key!r}{hint}; valid keys of {parent}: {', '.join(valid)}"


def explain_omegaconf_error(exc: BaseException) -> list[str]:
    """An OmegaConf error (unknown key, wrong type, bad interpolation) as messages."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    full_key = getattr(exc, "full_key", None)
    if isinstance(exc, (ConfigAttributeError, ConfigKeyError)) and full_key:
        return [_unknown_key(str(full_key), getattr(exc, "object_type", None), getattr(exc, "parent_node", None))]
    if isinstance(exc, ValidationError) and full_key:
        return [f"{full_key}: {first_line(exc)}"]
    where = f"{full_key}: " if full_key else ""
    return [where + first_line(exc)]
