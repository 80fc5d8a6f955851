"""A model spec's ``hf_config`` checked against its transformers config class before anything is built: every key a
field of the class (transformers would keep a typo as an unused attribute and build the default-sized model), and
the sizes and counts positive."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

from memopt.models.build import EXTRA_CONFIG_KWARGS, config_class
from memopt.plan.checks import closest

__all__ = ["check_model_keys"]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _config_keys(cls: type) -> set[str]:
    from transformers import PretrainedConfig  # lazy: transformers loads only when a spec names a config

    keys: set[str] = set()
    for c in (cls, PretrainedConfig):
        if dataclasses.is_dataclass(c):
            keys |= {f.name for f in dataclasses.fields(c)}
        try:
            keys |= {p for p in inspect.signature(c.__init__).parameters if p not in ("self", "kwargs")}
        except (TypeError, ValueError):
            pass
    try:  # what a default config of the class carries (attributes its __init__ sets for every config)
        keys |= set(cls().to_dict())
    except Exception:  # a config class that needs arguments: its fields and signature suffice
        pass
    attribute_map = dict(getattr(cls, "attribute_map", {}) or {})
    return keys | set(attribute_map) | set(attribute_map.values())


#: transformers config fields that are sizes or counts: positive where given
_SIZES = frozenset({"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "vocab_size", "max_position_embeddings", "head_dim", "n_embd", "n_layer",
                    "n_head", "n_positions", "d_model", "d_ff", "d_kv", "num_layers", "num_heads", "image_size",
                    "patch_size", "num_channels", "num_labels"})


def check_model_keys(spec: Any, problems: list[str], *, key: str = "model.hf_config") -> None:
    """Every ``hf_config`` key of a model spec is a field of its family's transformers config class
    (transformers itself would keep a typo such as ``hiden_size`` as an unused attribute and build the
    default-sized model)."""
    hf = getattr(spec, "hf_config", None)
    if not isinstance(hf, Mapping) or "model_type" not in hf:
        return
    try:
        cls = config_class(str(hf["model_type"]))
    except ValueError as exc:
        problems.append(f"{key}.model_type: {exc}")
        return
    known = _config_keys(cls) | set(EXTRA_CONFIG_KWARGS) | {"model_type"}
    for name in sorted(set(hf) - known):
        problems.append(f"{key}.{name} is not a field of {cls.__name__}{closest(name, sorted(known))}; remove it or "
                        "use one of the config's fields")
    for name in sorted(set(hf) & _SIZES):  # transformers builds a negative one into a tensor of negative shape
        value = hf[name]
        if value is not None and (not _is_int(value) or value < 1):
            problems.append(f"{key}.{name}={value!r} must be a positive integer (a size or a count)")
