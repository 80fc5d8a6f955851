"""What the adapters leave in the model when they are taken off (:func:`memopt.techniques.adapters.apply_adapters`'s
undo, which ``wrapped.unwrap()`` runs): the trained adapters folded into the weights they sit on, so the model given
back computes what the wrapped model learned; and the task heads that train beside the adapters.

On a full-precision base each LoRA or DoRA layer is merged by peft itself (``merge``: ``W + s B A``, DoRA's magnitude
included), exactly as the wrapped model computes it, up to float rounding. On a base memopt quantized, the layer it
gives back is the full-precision original that the quantization kept on the host: the LoRA product is added to it,
which is how QLoRA adapters are merged, but the wrapped model computed over the quantized weights, so the outputs
differ by the quantization error (a warning says so, and how to keep the adapters as trained). A quantized layer
with no original (the model came quantized) or a DoRA layer on a quantized base cannot be merged: its adapter is
dropped with a warning naming ``adapter_state_dict``, which saves the adapters before the unwrap.

Task heads: a Hugging Face classifier's head (every module beside the backbone: ``classifier``, ``score``,
``qa_outputs``, ``classification_head``, a pooler made for the head) is made fresh for the task when the model is
loaded, so peft's task types keep it trainable (``modules_to_save``); memopt keeps it trainable in place, where the
unwrapped model has it.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch
from torch import nn

from memopt.models.hf_task import hf_task, is_hf_model, peft_unwrapped

__all__ = ["merge_adapters", "task_heads"]

# the language-model heads are pretrained with the model: they stay frozen under adapters
_LM_TASKS = ("causal_lm", "masked_lm", "seq2seq_lm")


def task_heads(model: nn.Module) -> list[str]:
    """The names of ``model``'s task heads that train beside the adapters: a Hugging Face model's that is not a
    language model's, every direct child with parameters other than its backbone (``base_model``): a classifier
    (``classifier``, ``score``, ``qa_outputs``, BART's ``classification_head``, XLNet's ``sequence_summary`` and
    ``logits_proj``, DeBERTa's ``pooler``, an audio classifier's ``projector``), all made fresh for the task."""
    inner = peft_unwrapped(model)
    if not is_hf_model(inner) or hf_task(inner) in _LM_TASKS:
        return []
    backbone = getattr(inner, "base_model", inner)
    if backbone is inner:
        return []
    return [name for name, child in inner.named_children()
            if child is not backbone and any(True for _ in child.parameters())]


def _quantized(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return isinstance(weight, torch.Tensor) and not torch.is_floating_point(weight)


def merge_adapters(model: nn.Module, originals: Mapping[str, nn.Module], adapter: str = "default") -> None:
    """Fold every trained adapter of ``model`` (peft tuner layers, in place) into its base weight; ``originals``:
    the full-precision modules a quantized base stands in for, by name. peft's ``unload`` then takes the layers off.
    Warns once for the adapters that could only be merged approximately or not at all."""
    from peft.tuners.lora import LoraLayer  # lazy: peft is an optional extra, imported only with adapters on

    approximate, dropped = [], []
    with torch.no_grad():
        for name, layer in model.named_modules():
            if not isinstance(layer, LoraLayer) or adapter not in layer.lora_A:
                continue
            base = layer.get_base_layer()
            if not _quantized(base):
                layer.merge(adapter_names=[adapter])
                continue
            dora = adapter in getattr(layer, "lora_magnitude_vector", {})
            if not dora and not torch.any(layer.lora_B[adapter].weight):
                continue  # B starts at zero: an adapter that never stepped adds nothing (an autotune's candidate)
            original = originals.get(name)
            if original is None or dora:
                dropped.append(name)
                continue
            w = original.weight
            delta = layer.get_delta_weight(adapter).to(device=w.device, dtype=torch.float32)
            w.copy_((w.float() + delta).to(w.dtype))
            approximate.append(name)
    if approximate:
        warnings.warn(f"the adapters trained over {len(approximate)} quantized layers are merged into their "
                      "full-precision weights, which the unwrapped model gets back: its outputs differ from the "
                      "wrapped model's by the quantization error; to keep them as trained, save "
                      "memopt.techniques.adapters.adapter_state_dict(wrapped.model) before unwrap()", stacklevel=4)
    if dropped:
        warnings.warn(f"the adapters of {len(dropped)} quantized layers (e.g. {dropped[0]}) cannot be merged (no "
                      "full-precision weight to merge into, or DoRA) and are dropped by unwrap(): save "
                      "memopt.techniques.adapters.adapter_state_dict(wrapped.model) before unwrap()", stacklevel=4)
