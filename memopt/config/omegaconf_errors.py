"""OmegaConf's errors (an unknown key, a wrong type, a bad interpolation) as one message each that names what
would be valid. Apart from the Hydra composition errors (:mod:`memopt.config.errors`) because validating a composed
config needs these, and diagnosing composition runs the validation."""

from __future__ import annotations

import dataclasses
from typing import Any

from memopt.config.schema import PlanConfig
from memopt.plan.checks import closest
from memopt.plan.policy import PINNABLE

__all__ = ["explain_omegaconf_error", "first_line", "one_line", "root_cause", "with_root_cause"]


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def one_line(exc: BaseException, limit: int = 300) -> str:
    """The whole message of ``exc`` on one line (at most ``limit`` characters), or its type's name."""
    text = " ".join(str(exc).split())
    if len(text) > limit:
        text = text[:limit - 3].rstrip() + "..."
    return text or type(exc).__name__


def root_cause(exc: BaseException) -> BaseException:
    """The exception at the bottom of ``exc``'s chain: wrappers such as Hydra's ``InstantiationException`` or
    huggingface_hub's strict-dataclass errors say where it failed, the innermost one says why."""
    seen = {id(exc)}
    while True:
        inner = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
        if inner is None or id(inner) in seen:
            return exc
        seen.add(id(inner))
        exc = inner


def with_root_cause(exc: BaseException) -> str:
    """``Type: message`` of ``exc`` on one line, followed by its root cause's when another exception caused it."""
    root = root_cause(exc)
    reason = one_line(root)
    if root is exc or reason in one_line(exc):  # a re-raise that already says why
        return f"{type(exc).__name__}: {one_line(exc)}"
    return f"{type(exc).__name__}: {first_line(exc).rstrip(':').rstrip()}: {type(root).__name__}: {reason}"


def _valid_keys(object_type: Any, parent_node: Any) -> list[str]:
    if isinstance(object_type, type) and dataclasses.is_dataclass(object_type):
        return [f.name for f in dataclasses.fields(object_type)]
    if parent_node is not None and hasattr(parent_node, "keys"):
        return [str(k) for k in parent_node]
    return []


def _schema_keys(node: Any = None, prefix: str = "") -> list[str]:
    """Every key of the schema, dotted (``policy.pins.micro_batch_size``)."""
    node = PlanConfig() if node is None else node
    keys: list[str] = []
    for f in dataclasses.fields(node):
        key = f"{prefix}{f.name}"
        keys.append(key)
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            keys.extend(_schema_keys(value, f"{key}."))
    return keys


def _elsewhere(full_key: str) -> str:
    """`` (did you mean 'policy.fidelity'?)`` for a key the schema has under another parent (``fidelity``,
    ``training.lr``, ``pins.micro_batch_size``), or ''."""
    parts = full_key.split(".")
    for start in range(len(parts)):  # the longest tail that a schema key ends with
        tail = ".".join(parts[start:])
        found = [k for k in _schema_keys() if k != full_key and (k == tail or k.endswith(f".{tail}"))]
        if found:
            return " (did you mean " + " or ".join(repr(k) for k in found) + "?)"
    return ""


def _unknown_key(full_key: str, object_type: Any, parent_node: Any, value: Any = None) -> str:
    parent, _, name = full_key.rpartition(".")
    valid = _valid_keys(object_type, parent_node)
    # a key of a schema node may belong under another one (fidelity -> policy.fidelity); a free-form node's
    # (hf_config) keys are not the schema's
    schema_node = isinstance(object_type, type) and dataclasses.is_dataclass(object_type)
    hint = (_elsewhere(full_key) if schema_node else "") or closest(name, valid)
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
