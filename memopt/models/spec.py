"""Model specs: the shipped ``configs/model/*.yaml`` files (and user YAMLs or dicts) as :class:`ModelSpec`.

A spec names a Hugging Face ``transformers`` architecture and the config kwargs that define it, plus a typical
training sample. No weights are involved anywhere: models are always built from the config
(:func:`memopt.models.build.build_model`).

YAML schema (exactly these top-level keys)::

    name: llama3_8b
    family: causal_lm                 # causal_lm | masked_lm | seq2seq_lm | sequence_classification |
                                      # token_classification | image_classification
    architecture: LlamaForCausalLM    # a transformers class name
    hf_config: {model_type: llama, hidden_size: 4096, ...}   # kwargs of AutoConfig.for_model
    sample: {batch_size: 1, seq_len: 4096}                   # a typical training sample
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from memopt.resources import config_names, configs_dir

__all__ = ["FAMILIES", "LABEL_KINDS", "SAMPLE_KEYS", "ModelSpec", "load_model_spec", "model_names"]

#: Model families memopt knows how to feed (see :func:`memopt.models.sample.make_batch`).
FAMILIES: tuple[str, ...] = ("causal_lm", "masked_lm", "seq2seq_lm", "sequence_classification", "token_classification",
                             "image_classification")

#: Keys of a sample-shape dict (``sample:`` in a model YAML, or a ``SampleSpec.parse`` dict).
SAMPLE_KEYS: tuple[str, ...] = ("batch_size", "seq_len", "image_size", "decoder_seq_len", "variable_length",
                                "label_kind")

#: What a classifier's ``labels`` hold besides class ids (``label_kind``): ``multi_label``, a float 0/1 per class
#: (``(batch, num_labels)``); ``regression``, float targets (``(batch,)``, or ``(batch, num_labels)``).
LABEL_KINDS: tuple[str, ...] = ("multi_label", "regression")

_SPEC_KEYS: tuple[str, ...] = ("name", "family", "architecture", "hf_config", "sample")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """One model architecture: which transformers class, its config kwargs, and a typical training sample.

    ``hf_config`` and ``sample`` are plain dicts; treat them as read-only (use ``overrides=`` of
    :func:`~memopt.models.build.hf_config` / :func:`~memopt.models.build.build_model` to change a model).
    """

    name: str
    family: str
    architecture: str
    hf_config: dict[str, Any] = field(hash=False)
    sample: dict[str, Any] = field(default_factory=dict, hash=False)
    path: Path | None = field(default=None, compare=False)

    @property
    def model_type(self) -> str:
        """The transformers ``model_type`` (``llama``, ``gpt2``, ``t5`` ...)."""
        return str(self.hf_config["model_type"])

    @property
    def is_token_model(self) -> bool:
        """True for models fed token ids (every family except image classification)."""
        return self.family != "image_classification"


def _is_pos_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def model_names() -> list[str]:
    """Names of the shipped model specs (the stems of ``configs/model/*.yaml``), sorted."""
    return config_names("model")


def _closest(name: str, choices: list[str]) -> str:
    match = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _from_dict(data: dict[str, Any], *, path: Path | None = None) -> ModelSpec:
    """Validate a spec mapping and build the spec; every problem is reported in one ValueError."""
    where = f" in {path}" if path else ""
    if not isinstance(data, dict):
        raise ValueError(
            f"a model spec must be a mapping with keys {list(_SPEC_KEYS)}; got {type(data).__name__}{where}"
        )
    data = dict(data)
    if "name" not in data and path is not None:
        data["name"] = path.stem
    problems: list[str] = []
    unknown = sorted(set(data) - set(_SPEC_KEYS))
    if unknown:
        problems.append(f"unknown keys {unknown} (valid keys: {list(_SPEC_KEYS)})")
    missing = [k for k in ("name", "family", "architecture", "hf_config") if k not in data]
    if missing:
        problems.append(f"missing keys {missing}")
    if "name" in data and (not isinstance(data["name"], str) or not data["name"]):
        problems.append(f"name must be a non-empty string, got {data['name']!r}")
    if "family" in data and data["family"] not in FAMILIES:
        problems.append(f"family {data['family']!r} is not one of {list(FAMILIES)}")
    if "architecture" in data and (not isinstance(data["architecture"], str) or not data["architecture"]):
        problems.append(f"architecture must be a transformers class name, got {data['architecture']!r}")
    hf = data.get("hf_config")
    if "hf_config" in data:
        if not isinstance(hf, dict):
            problems.append(f"hf_config must be a mapping, got {type(hf).__name__}")
        elif not isinstance(hf.get("model_type"), str):
            problems.append("hf_config must contain model_type (a transformers model type such as 'llama')")
    sample = data.get("sample") or {}
    if not isinstance(sample, dict):
        problems.append(f"sample must be a mapping of sample shapes, got {type(sample).__name__}")
        sample = {}
    bad_sample = sorted(set(sample) - set(SAMPLE_KEYS))
    if bad_sample:
        problems.append(f"unknown sample keys {bad_sample} (valid keys: {list(SAMPLE_KEYS)})")
    for key, value in sample.items():
        if key in SAMPLE_KEYS and key not in ("variable_length", "label_kind") and value is not None \
                and not _is_pos_int(value):
            problems.append(f"sample.{key} must be a positive int, got {value!r}")
    if problems:
        label = data.get("name", "<unnamed>")
        raise ValueError(f"invalid model spec {label!r}{where}: " + "; ".join(problems))
    return ModelSpec(
        name=data["name"],
        family=data["family"],
        architecture=data["architecture"],
        hf_config=dict(hf),
        sample=dict(sample),
        path=path,
    )


def _looks_like_path(text: str) -> bool:
    return text.endswith((".yaml", ".yml")) or os.sep in text or "/" in text or Path(text).is_file()


def load_model_spec(name_or_path: str | os.PathLike[str] | dict[str, Any] | ModelSpec) -> ModelSpec:
    """A model spec by shipped name (``"llama3_8b"``), from a YAML path, from a dict, or passed through.

    Raises ``ValueError`` for an unknown name (listing the shipped names and suggesting the closest one)
    or an invalid spec (listing every problem at once).
    """
    if isinstance(name_or_path, ModelSpec):
        return name_or_path
    if isinstance(name_or_path, dict):
        return _from_dict(name_or_path)
    if isinstance(name_or_path, os.PathLike) or _looks_like_path(str(name_or_path)):
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise ValueError(f"model spec file {str(path)!r} does not exist")
    else:
        name = str(name_or_path)
        path = configs_dir() / "model" / f"{name}.yaml"
        if not path.is_file():
            names = model_names()
            raise ValueError(
                f"unknown model {name!r}{_closest(name, names)}; shipped models: {', '.join(names)} "
                "(or pass a path to a model YAML, or a dict)"
            )
    with path.open() as f:
        data = yaml.safe_load(f)
    return _from_dict(data, path=path.resolve())
