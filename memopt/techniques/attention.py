"""Attention backend: which fused kernel ``scaled_dot_product_attention`` may use.

"auto" leaves PyTorch's own choice (flash, then memory-efficient, then math on most GPUs); a named
backend restricts SDPA to it for forward and backward (recomputation included) by setting the global
SDPA flags, and the undo restores them. "flash_attn" switches a Hugging Face model to the flash-attn
package (``attn_implementation="flash_attention_2"``) when it is installed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch
from torch import nn

from memopt.techniques.model_change import ModelChange, Undo

__all__ = ["ATTENTION_FIDELITY", "apply_attention_backend", "change_model", "flash_attn_available"]

ATTENTION_FIDELITY = {"auto": "exact", "flash": "exact", "efficient": "exact", "cudnn": "exact", "math": "exact",
                      "flash_attn": "exact"}

_FLAGS = {
    "flash": (torch.backends.cuda.flash_sdp_enabled, torch.backends.cuda.enable_flash_sdp),
    "efficient": (torch.backends.cuda.mem_efficient_sdp_enabled, torch.backends.cuda.enable_mem_efficient_sdp),
    "cudnn": (torch.backends.cuda.cudnn_sdp_enabled, torch.backends.cuda.enable_cudnn_sdp),
    "math": (torch.backends.cuda.math_sdp_enabled, torch.backends.cuda.enable_math_sdp),
}


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def change_model(change: ModelChange) -> Undo:
    """The attention backend's change: a global switch (SDPA's kernels, or flash-attn on the model's config)."""
    return apply_attention_backend(change.model, change.strategy.attention)


def apply_attention_backend(model: nn.Module, backend: str) -> Callable[[], None]:
    """Restrict SDPA to ``backend`` (or switch to flash-attn); returns the undo."""
    if backend == "auto":
        return lambda: None
    if backend == "flash_attn":
        if not flash_attn_available():
            raise ValueError("attention='flash_attn' needs the flash-attn package: pip install 'memopt[flash]'; "
                             "or use attention='flash' (PyTorch's built-in flash kernel)")
        config = getattr(model, "config", None)
        if config is None or not hasattr(config, "_attn_implementation"):
            raise ValueError("attention='flash_attn' works on Hugging Face models only; use attention='flash'")
        previous = config._attn_implementation
        model.set_attn_implementation("flash_attention_2")
        return lambda: model.set_attn_implementation(previous)
    if backend not in _FLAGS:
        raise ValueError(f"unknown attention backend {backend!r}; choose auto, flash, efficient, cudnn, math "
                         "or flash_attn")
    before = {name: get() for name, (get, _) in _FLAGS.items()}
    for name, (_, set_) in _FLAGS.items():
        set_(name == backend)

    def undo() -> None:
        for name, (_, set_) in _FLAGS.items():
            set_(before[name])

    return undo
