"""Building transformers models from a :class:`~memopt.models.spec.ModelSpec`: config only, never weights.

``build_model(spec)`` defaults to the ``meta`` device, where parameters have shapes and dtypes but no storage:
building even ``llama3_405b`` takes a second or two and no memory. Pass ``device="cpu"``/``"cuda"`` for a real,
randomly initialised model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import inspect
from typing import Any

import torch
from torch import nn

from memopt.models.spec import FAMILIES, ModelSpec, load_model_spec

__all__ = ["ATTN_IMPLEMENTATIONS", "build_model", "fixes_resolution", "hf_config"]


#: attn_implementation values accepted by :func:`build_model` (flash kernels need their packages at run time).
ATTN_IMPLEMENTATIONS: tuple[str, ...] = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")

# Config kwargs that transformers accepts although they are not dataclass fields of the config class.
EXTRA_CONFIG_KWARGS = frozenset(
    {"num_labels", "decoder_start_token_id", "sep_token_id", "output_attentions", "rope_theta", "rope_scaling"}
)

# family -> the transformers auto-mapping (model_type -> class name) its architecture must come from.
_FAMILY_MAPPINGS = {
    "causal_lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked_lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "seq2seq_lm": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "sequence_classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "token_classification": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    "image_classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
}


def config_class(model_type: str) -> type:
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise ValueError(
            f"unknown transformers model_type {model_type!r}"
            + (
                f" (did you mean {m[0]!r}?)"
                if (m := difflib.get_close_matches(model_type, list(CONFIG_MAPPING)))
                else ""
            )
        )
    return CONFIG_MAPPING[model_type]


def _canonical(kwargs: dict[str, Any], attribute_map: dict[str, str]) -> dict[str, Any]:
    """Rename aliases (``num_hidden_layers`` -> GPT-2's ``n_layer``) so one field is never given twice."""
    return {attribute_map.get(k, k): v for k, v in kwargs.items()}


def hf_config(spec: ModelSpec | str | dict[str, Any], **overrides: Any):
    """The spec's ``transformers.PretrainedConfig`` (a fresh object each call), with ``overrides`` applied.

    Overrides use config field names or their standard aliases (``num_hidden_layers=2`` works for GPT-2's
    ``n_layer`` and T5's ``num_layers``). Shrinking an encoder-decoder's ``num_layers`` without giving
    ``num_decoder_layers`` shrinks the decoder to match. An override that the config class does not know
    raises ``ValueError`` (transformers itself would silently store a typo as an extra attribute).
    """
    from transformers import AutoConfig

    spec = load_model_spec(spec)
    cls = config_class(spec.model_type)
    attribute_map: dict[str, str] = dict(getattr(cls, "attribute_map", {}) or {})
    base = _canonical({k: v for k, v in spec.hf_config.items() if k != "model_type"}, attribute_map)
    extra = _canonical(dict(overrides), attribute_map)
    if "model_type" in extra:
        raise ValueError("hf_config overrides cannot change model_type; write a new model spec instead")
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    known = fields | set(attribute_map.values()) | set(base) | EXTRA_CONFIG_KWARGS
    unknown = sorted(set(extra) - known)
    if unknown:
        hints = []
        for key in unknown:
            match = difflib.get_close_matches(key, sorted(known | set(attribute_map)), n=1)
            hints.append(f"{key!r}" + (f" (did you mean {match[0]!r}?)" if match else ""))
        raise ValueError(
            f"unknown {cls.__name__} override(s) {', '.join(hints)} for model {spec.name!r}; "
            f"valid fields: {', '.join(sorted(fields | set(attribute_map)))}"
        )
    if "num_layers" in extra and "num_decoder_layers" in fields and "num_decoder_layers" not in extra:
        extra["num_decoder_layers"] = extra["num_layers"]
    return AutoConfig.for_model(spec.model_type, **{**base, **extra})


def _architecture_class(spec: ModelSpec) -> type[nn.Module]:
    import transformers
    from transformers.models.auto import modeling_auto

    mapping: dict[str, str] = getattr(modeling_auto, _FAMILY_MAPPINGS[spec.family])
    expected = mapping.get(spec.model_type)
    cls = getattr(transformers, spec.architecture, None)
    if cls is None or not isinstance(cls, type) or not issubclass(cls, nn.Module):
        hint = f"; for family {spec.family!r} and model_type {spec.model_type!r} it is {expected!r}" if expected else ""
        raise ValueError(f"model {spec.name!r}: {spec.architecture!r} is not a transformers model class{hint}")
    family_classes = set(mapping.values())
    if spec.architecture not in family_classes:
        raise ValueError(
            f"model {spec.name!r}: architecture {spec.architecture!r} is not a {spec.family} model in transformers"
            + (f" (for model_type {spec.model_type!r} use {expected!r})" if expected else "")
            + f"; families: {list(FAMILIES)}"
        )
    return cls


def fixes_resolution(spec: ModelSpec) -> bool:
    """Whether an image model trains only at its config's ``image_size``: position embeddings sized from it, which
    its forward resizes only when asked (``interpolate_pos_encoding``: ViT, DeiT, BEiT), unless the config turns them
    off (Swin's ``use_absolute_embeddings=False``: its windows take any size). A model without such embeddings
    (ConvNeXt, ResNet) takes any size; one that interpolates them always (DINOv2) too. A class transformers does not
    export (a subclass of the user's) is taken as fixed."""
    import transformers

    cls = getattr(transformers, spec.architecture, None)
    if not isinstance(cls, type):
        return True
    try:
        asks = "interpolate_pos_encoding" in inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):  # no signature to read
        return True
    return asks and getattr(hf_config(spec), "use_absolute_embeddings", True) is not False


def build_model(
    spec: ModelSpec | str | dict[str, Any],
    *,
    device: str | torch.device = "meta",
    dtype: torch.dtype = torch.float32,
    overrides: dict[str, Any] | None = None,
    attn_implementation: str = "sdpa",
    experts_implementation: str | None = None,
) -> nn.Module:
    """Build the spec's transformers model from its config, in ``train()`` mode. Nothing is downloaded.

    Args:
        spec: a :class:`ModelSpec`, a shipped model name, a YAML path, or a spec dict.
        device: where parameters are created (``"meta"``: shapes only, no storage; fast at any size).
        dtype: parameter dtype (a floating dtype).
        overrides: config overrides, e.g. ``{"num_hidden_layers": 2}`` (see :func:`hf_config`).
        attn_implementation: one of :data:`ATTN_IMPLEMENTATIONS`.
        experts_implementation: for MoE models, transformers' experts kernel (``"grouped_mm"``, its default,
            ``"batched_mm"`` or ``"eager"``); ``None`` keeps the transformers default. Ignored for dense models.
    """
    spec = load_model_spec(spec)
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation {attn_implementation!r} is not one of {list(ATTN_IMPLEMENTATIONS)}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype (e.g. torch.float32, torch.bfloat16), got {dtype!r}")
    config = hf_config(spec, **(overrides or {}))
    cls = _architecture_class(spec)
    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": attn_implementation}
    if experts_implementation is not None:
        kwargs["experts_implementation"] = experts_implementation
    fake = _fake_mode_active()
    with torch.device(device), _skip_weight_init() if fake else contextlib.nullcontext():
        # _from_config is what AutoModelFor*.from_config calls once it has resolved the class; calling it on
        # the spec's own class keeps the exact architecture (e.g. BertForMaskedLM) without the auto lookup.
        model = cls._from_config(config, **kwargs)
    if fake:
        model.tie_weights()  # init_weights, skipped above, is also where transformers ties the embeddings
    model.train()
    return model


def _fake_mode_active() -> bool:
    from torch._guards import detect_fake_mode

    return detect_fake_mode() is not None


def _skip_weight_init():
    """Skip random initialisation, as transformers itself does on meta. Under FakeTensorMode values do not exist,
    and some initialisers (ViT's trunc_normal_) make data-dependent checks that fake tensors cannot answer."""
    from transformers.initialization import no_init_weights

    return no_init_weights()


def with_overrides(spec: ModelSpec | str | dict[str, Any], overrides: dict[str, Any] | None) -> ModelSpec:
    """The spec with ``overrides`` folded into its ``hf_config`` (canonical field names), checked as
    :func:`hf_config` checks them. Samples and batches made from the result see the overridden model
    (e.g. a longer ``max_position_embeddings``)."""
    spec = load_model_spec(spec)
    if not overrides:
        return spec
    config = hf_config(spec, **overrides)  # validates
    cls = config_class(spec.model_type)
    attribute_map: dict[str, str] = dict(getattr(cls, "attribute_map", {}) or {})
    extra = _canonical(dict(overrides), attribute_map)
    if "num_layers" in extra and hasattr(config, "num_decoder_layers") and "num_decoder_layers" not in extra:
        extra["num_decoder_layers"] = extra["num_layers"]
    merged = {**_canonical(dict(spec.hf_config), attribute_map), **extra}
    return dataclasses.replace(spec, hf_config=merged)
