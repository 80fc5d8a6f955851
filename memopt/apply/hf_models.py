"""Which Hugging Face model a module is, from its class and transformers' own auto-model mappings.

A class name suffix is not enough: ``GPT2LMHeadModel`` is a causal LM, ``BertForSequenceClassification`` a
classifier. transformers lists, per task, the class of every architecture (``MODEL_FOR_*_MAPPING_NAMES``:
model_type -> class name); a module's task is the mapping its class (or a base class of it) appears in.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["TASKS", "hf_forward_kwargs", "hf_task", "is_causal_lm", "is_hf_model"]

# memopt's task name -> transformers' mapping (first match wins: a class listed under causal LM is a causal LM
# even when it also appears under pre-training)
TASKS: dict[str, str] = {
    "causal_lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "seq2seq_lm": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "masked_lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "sequence_classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "token_classification": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    "image_classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
}

# without transformers' mappings (or for a class they do not list): the naming transformers uses
_SUFFIXES = {"ForCausalLM": "causal_lm", "LMHeadModel": "causal_lm", "ForConditionalGeneration": "seq2seq_lm",
             "ForMaskedLM": "masked_lm", "ForSequenceClassification": "sequence_classification",
             "ForTokenClassification": "token_classification", "ForImageClassification": "image_classification"}


def is_hf_model(model: Any) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (through a peft wrapper too)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # transformers not installed: nothing is a Hugging Face model
        return False
    if isinstance(model, PreTrainedModel):
        return True
    base = getattr(getattr(model, "base_model", None), "model", None)  # peft's PeftModel -> LoraModel -> model
    return isinstance(base, PreTrainedModel)


@functools.lru_cache(maxsize=1)
def _class_tasks() -> dict[str, str]:
    try:
        from transformers.models.auto import modeling_auto
    except ImportError:
        return {}
    out: dict[str, str] = {}
    for task, mapping_name in TASKS.items():
        for names in getattr(modeling_auto, mapping_name, {}).values():
            for name in (names,) if isinstance(names, str) else names:
                out.setdefault(name, task)
    return out


def hf_task(model: Any) -> str | None:
    """The task of a Hugging Face model (a key of ``TASKS``), or None (not a Hugging Face model, or a base model
    without a task head)."""
    if not is_hf_model(model):
        return None
    from transformers import PreTrainedModel

    inner = model if isinstance(model, PreTrainedModel) else model.base_model.model  # peft: the wrapped model
    tasks = _class_tasks()
    for cls in type(inner).__mro__:
        if cls.__name__ in tasks:
            return tasks[cls.__name__]
    name = type(inner).__name__
    return next((task for suffix, task in _SUFFIXES.items() if name.endswith(suffix)), None)


def is_causal_lm(model: Any) -> bool:
    """Whether ``model`` is a Hugging Face causal LM (it shifts its labels by one inside)."""
    return hf_task(model) == "causal_lm"


@functools.lru_cache(maxsize=1)
def hf_forward_kwargs() -> frozenset[str]:
    """The keywords a transformers model takes through its ``**kwargs`` (``TransformersKwargs``)."""
    try:
        from transformers.utils import TransformersKwargs
    except ImportError:
        return frozenset()
    return frozenset(getattr(TransformersKwargs, "__annotations__", {}))
