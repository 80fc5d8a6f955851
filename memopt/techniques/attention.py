"""Attention backend: which fused kernel ``scaled_dot_product_attention`` may use.

"auto" leaves PyTorch's own choice (flash, then memory-efficient, then math on most GPUs). A named backend
restricts SDPA to it only while memopt runs the model: ``sdpa_restricted`` is entered around each forward pass
and each backward pass of memopt's step (so checkpointed blocks recompute with the kernel their forward used) and
around a hand-written forward under ``Wrapped.autocast``. SDPA's flags are process-wide: set for as long as a
model stayed wrapped, they would also restrict every other model in the process (an evaluation model, a teacher,
a second wrapped model with its own plan). "flash_attn" switches a Hugging Face model to the flash-attn package
(``attn_implementation="flash_attention_2"``) when it is installed: a change of the model, undone with the plan.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator

import torch
from torch import nn

from memopt.techniques.model_change import ModelChange, Undo, no_change

__all__ = ["ATTENTION_FIDELITY", "SDPA_BACKENDS", "change_model", "check_backend", "flash_attn_available",
           "sdpa_restricted"]

ATTENTION_FIDELITY = {"auto": "exact", "flash": "exact", "efficient": "exact", "cudnn": "exact", "math": "exact",
                      "flash_attn": "exact"}

_FLAGS = {
    "flash": (torch.backends.cuda.flash_sdp_enabled, torch.backends.cuda.enable_flash_sdp),
    "efficient": (torch.backends.cuda.mem_efficient_sdp_enabled, torch.backends.cuda.enable_mem_efficient_sdp),
    "cudnn": (torch.backends.cuda.cudnn_sdp_enabled, torch.backends.cuda.enable_cudnn_sdp),
    "math": (torch.backends.cuda.math_sdp_enabled, torch.backends.cuda.enable_math_sdp),
}

#: the backends that restrict PyTorch's own SDPA (the others: "auto", "flash_attn")
SDPA_BACKENDS: tuple[str, ...] = tuple(_FLAGS)


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def check_backend(backend: str) -> None:
    """Raise the one-line error for a backend name memopt does not know."""
    if backend != "auto" and backend != "flash_attn" and backend not in _FLAGS:
        raise ValueError(f"unknown attention backend {backend!r}; choose auto, flash, efficient, cudnn, math "
                         "or flash_attn")


def change_model(change: ModelChange) -> Undo:
    """The attention backend's change of the model: flash-attn on a Hugging Face model's config. SDPA backends
    change nothing here; the step restricts SDPA around its own passes (``sdpa_restricted``)."""
    backend = change.strategy.attention
    check_backend(backend)
    if backend != "flash_attn":
        return no_change
    if not flash_attn_available():
        raise ValueError("attention='flash_attn' needs the flash-attn package: pip install 'memopt[flash]'; "
                         "or use attention='flash' (PyTorch's built-in flash kernel)")
    model: nn.Module = change.model
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        raise ValueError("attention='flash_attn' works on Hugging Face models only; use attention='flash'")
    previous = config._attn_implementation
    model.set_attn_implementation("flash_attention_2")
    return lambda: model.set_attn_implementation(previous)


@contextlib.contextmanager
def sdpa_restricted(backend: str) -> Iterator[None]:
    """SDPA limited to ``backend`` inside the block, the flags as they were after it (whatever the block raised).
    Any backend that is not one of SDPA's own ("auto", "flash_attn") leaves the flags alone."""
    if backend not in _FLAGS:
        yield
        return
    before = {name: get() for name, (get, _) in _FLAGS.items()}
    for name, (_, set_) in _FLAGS.items():
        set_(name == backend)
    try:
        yield
    finally:
        for name, (_, set_) in _FLAGS.items():
            set_(before[name])
