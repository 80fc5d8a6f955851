"""Running a model without leaving a trace: the checks memopt makes with real forwards (how the loss reduces over
samples, whether it is invariant to padding) and the planning it does inside a user's script (reading samples
whose transforms draw random augmentations, tracing) must leave the training run as it would have been without
them: every random generator, every module's train flag, every buffer.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["number_attributes", "preserved_random_state", "side_effects_undone"]


@contextlib.contextmanager
def preserved_random_state() -> Iterator[None]:
    """Every random generator a training script draws from (torch's on the CPU and each initialized GPU, numpy's,
    Python's), restored on exit."""
    py_state = random.getstate()
    try:
        import numpy as np

        np_state: Any = np.random.get_state()
    except ImportError:  # numpy is optional for memopt
        np, np_state = None, None
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(py_state)
        if np is not None:
            np.random.set_state(np_state)


# bitsandbytes' 4-bit linear repacks its weight in place, for good, on its first forward in eval mode without
# gradients on a CPU with AVX512-BF16 (a layout for inference): a check's forward would change the frozen base
_REPACKED_IN_EVAL = ("bitsandbytes.",)


@contextlib.contextmanager
def side_effects_undone(model: nn.Module, *, grad: bool = False) -> Iterator[None]:
    """Eval mode, no gradients; every module's training flag, every buffer, every public number attribute (a call
    counter) and the random generators restored. ``grad``: with gradients enabled instead, for a loss that needs
    them (a gradient penalty's ``torch.autograd.grad(..., create_graph=True)``); whatever gradient a forward leaves
    on the parameters is put back as it was."""
    flags = [(m, m.training) for m in model.modules()]
    buffers = [(m, name, b, b.detach().clone()) for m in model.modules() for name, b in m._buffers.items()
               if b is not None]
    numbers = [(m, attr, value) for _, m, attr, value in number_attributes(model)]
    grads = [(p, p.grad, None if p.grad is None else p.grad.clone()) for p in model.parameters()] if grad else []
    try:
        with preserved_random_state(), torch.set_grad_enabled(grad):
            model.eval()
            for m in model.modules():
                if type(m).__module__.startswith(_REPACKED_IN_EVAL):
                    m.training = True  # no dropout or statistics of their own: eval changes nothing else in them
            yield
    finally:
        for p, g, saved in grads:
            p.grad = g
            if g is not None:
                g.copy_(saved)  # a backward inside the step accumulates into it in place
        for m, training in flags:
            m.training = training
        for m, attr, value in numbers:
            setattr(m, attr, value)
        for m, name, b, saved in buffers:
            m._buffers[name] = b  # a forward may rebind a buffer rather than write into it
            b.copy_(saved)


def number_attributes(model: nn.Module) -> list[tuple[str, nn.Module, str, int | float]]:
    """(module name, module, attribute, value) for every module's public int or float attribute: state a forward may
    keep outside its buffers (a call counter, an annealed temperature)."""
    return [(name, m, attr, value) for name, m in model.named_modules() for attr, value in vars(m).items()
            if not attr.startswith("_") and attr != "training" and type(value) in (int, float)]
