"""What kind of Hugging Face model a module is, from transformers' own auto-model mappings.

Class-name suffixes miss whole families (``GPT2LMHeadModel`` is a causal LM, ``XLMWithLMHeadModel`` a masked
LM, ``BartForConditionalGeneration`` a seq2seq LM), so the task is looked up in the mappings that
``AutoModelFor*`` use, for the module's class or any of its base classes (a user's subclass of a transformers
model keeps its task). Everything in memopt that asks "is this a causal LM?" asks here.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

__all__ = ["HF_TASKS", "hf_forward_kwargs", "hf_task", "is_causal_lm", "is_hf_model"]

#: task -> the transformers auto-mapping (model_type -> class name) that lists its classes; a class listed under
#: two tasks takes the first (Bart's head is in the masked-LM mapping too, but it is trained as seq2seq; XLM's
#: head is in the causal-LM mapping too, but its loss is unshifted, masked-LM style).
HF_TASKS: dict[str, str] = {
    "seq2seq_lm": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "masked_lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "causal_lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "sequence_classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "token_classification": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    "image_classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
}


@functools.cache
def _task_of_class_name() -> dict[str, str]:
    try:
        from transformers.models.auto import modeling_auto
    except ImportError:
        return {}
    out: dict[str, str] = {}
    for task, mapping_name in HF_TASKS.items():
        for names in getattr(modeling_auto, mapping_name, {}).values():
            for name in names if isinstance(names, (tuple, list)) else (names,):
                out.setdefault(name, task)
    return out


def _peft_inner(model: Any) -> Any:
    """The transformers model inside a peft wrapper, else ``model``. A ``PeftModel`` says which itself
    (``get_base_model``): under LoRA and the other tuners it is ``base_model.model``, under prompt learning (prefix or
    prompt tuning) ``base_model`` is the transformers model itself and ``base_model.model`` only its trunk, which has
    no task head."""
    unwrapped = peft_unwrapped(model)
    if unwrapped is not model:
        return unwrapped
    inner = getattr(getattr(model, "base_model", None), "model", None)
    return inner if inner is not None and inner is not model else model


def peft_unwrapped(model: Any) -> Any:
    """The transformers model inside a peft wrapper the user made (``get_peft_model``: its adapters live in that
    model's layers), else ``model`` itself: what the head and its loss are read from."""
    if type(model).__module__.startswith("peft.") and callable(getattr(model, "get_base_model", None)):
        return model.get_base_model()
    return model


def is_hf_model(model: Any) -> bool:
    """A ``transformers.PreTrainedModel``, through a peft wrapper too (without importing transformers when the user
    never did)."""
    import sys

    if "transformers" not in sys.modules:
        return False
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel) or isinstance(_peft_inner(model), PreTrainedModel)


def hf_task(model: nn.Module | type) -> str | None:
    """The task of a Hugging Face model (a key of :data:`HF_TASKS`), or None for anything else."""
    if not isinstance(model, type):
        if not is_hf_model(model):
            return None
        from transformers import PreTrainedModel

        model = model if isinstance(model, PreTrainedModel) else _peft_inner(model)
    cls = model if isinstance(model, type) else type(model)
    table = _task_of_class_name()
    for klass in cls.__mro__:
        task = table.get(klass.__name__)
        if task is not None and klass.__module__.startswith("transformers."):
            return task
    # a model whose code ships with its checkpoint (trust_remote_code) is in no mapping; its causal LM head follows
    # transformers' naming and its convention of shifting the labels inside
    if not cls.__module__.startswith("transformers.") and cls.__name__.endswith(_REMOTE_CAUSAL_SUFFIXES):
        return "causal_lm"
    return None


_REMOTE_CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def is_causal_lm(model: nn.Module) -> bool:
    """A Hugging Face causal LM, which as a rule shifts its labels inside, so the first label of each row carries no
    loss. Only the rule: some heads in the mapping do not shift (XLNet's) and some outside it do (BLIP's captioning),
    so a training step measures the shift on its first batch that can tell (``memopt.step.loss_items``). Under
    peft's prompt or p-tuning the virtual tokens are put before each row (their labels -100), so the first label is
    predicted from the last of them and carries a loss like the others: the labels count unshifted there."""
    return hf_task(model) == "causal_lm" and not _virtual_tokens_first(model)


#: the prompt-learning methods whose virtual tokens reach the model as keys and values (``past_key_values``), not as
#: positions of the input: the labels stay as the user gave them
_PREFIX_METHODS = ("PREFIX_TUNING", "CARTRIDGE")


def _virtual_tokens_first(model: Any) -> bool:
    """A peft prompt-learning model that prepends its virtual tokens to every row (prompt tuning, p-tuning)."""
    if not type(model).__module__.startswith("peft."):
        return False
    config = getattr(model, "active_peft_config", None)
    kind = str(getattr(getattr(config, "peft_type", None), "value", getattr(config, "peft_type", "")))
    return bool(getattr(config, "is_prompt_learning", False)) and kind not in _PREFIX_METHODS


@functools.cache
def hf_forward_kwargs() -> frozenset[str]:
    """The keywords a transformers model takes through its ``**kwargs`` (``TransformersKwargs``)."""
    try:
        from transformers.utils import TransformersKwargs
    except ImportError:
        return frozenset()
    return frozenset(getattr(TransformersKwargs, "__annotations__", {}))
