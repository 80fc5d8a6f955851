"""What part of a cached profile's key the user's loss is. A profile traces the training step, and the loss is part
of that step: a loss that upcasts the logits or keeps a copy of them allocates memory another loss does not. Two
plans of one model and sample with different losses must not share traces.

A callable is identified by its code, not by its identity, so that the same loss defined again in another process
finds the cache: the function's module, name and bytecode with its constants (nested functions and lambdas
included), the names it reads, and the values its closure and defaults hold where they are plain (numbers, strings,
and callables identified the same way); a module it closes over (a distillation teacher) by its classes' code and
its parameters' and buffers' shapes. A callable that cannot be read so (a builtin, an object of a C type) is
identified by ``id``: it is cached for the process that defined it only, which is safe.
"""

from __future__ import annotations

import functools
import hashlib
import types
from typing import Any

from torch import nn

from memopt.profile.module_code import module_code_key
from memopt.step.batch import TrainingStep

__all__ = ["loss_key", "modules_in"]

_PLAIN = (int, float, str, bool, bytes, type(None))


def loss_key(loss: Any) -> str:
    """A short hash of ``loss`` (a ``loss_fn``, a wrapped ``training_step``, or None for the model's own loss)."""
    if loss is None:
        return "model"
    h = hashlib.sha256()
    _feed(h, loss, depth=0)
    return h.hexdigest()[:16]


def _feed(h: Any, obj: Any, depth: int) -> None:
    if depth > 6:  # deep enough to tell losses apart; bounded against cycles
        h.update(b"...")
        return
    if isinstance(obj, _PLAIN):
        h.update(repr(obj).encode())
    elif isinstance(obj, (tuple, list, frozenset, set)):
        h.update(type(obj).__name__.encode())
        for item in (sorted(obj, key=repr) if isinstance(obj, (set, frozenset)) else obj):
            _feed(h, item, depth + 1)
    elif isinstance(obj, types.CodeType):
        h.update(obj.co_code)
        h.update(repr(obj.co_names).encode())
        for const in obj.co_consts:
            _feed(h, const, depth + 1)
    elif isinstance(obj, functools.partial):
        h.update(b"partial")
        _feed(h, obj.func, depth + 1)
        _feed(h, obj.args, depth + 1)
        _feed(h, sorted(obj.keywords.items()), depth + 1)
    elif isinstance(obj, types.MethodType):
        _feed(h, obj.__func__, depth + 1)
        _feed(h, obj.__self__, depth + 1)
    elif isinstance(obj, types.FunctionType):
        h.update(f"{obj.__module__}.{obj.__qualname__}".encode())
        _feed(h, obj.__code__, depth + 1)
        _feed(h, obj.__defaults__ or (), depth + 1)
        for cell in obj.__closure__ or ():
            try:
                _feed(h, cell.cell_contents, depth + 1)
            except ValueError:  # an empty cell
                h.update(b"<empty>")
        for module in _global_modules(obj):  # a teacher the loss reads as a global of its script
            _feed(h, module, depth + 1)
    elif isinstance(obj, TrainingStep):
        h.update(b"training_step")
        _feed(h, obj.fn, depth + 1)
    elif isinstance(obj, type):
        h.update(f"{obj.__module__}.{obj.__qualname__}".encode())
    elif isinstance(obj, nn.Module):
        # a module the loss runs (a distillation teacher, a perceptual network): its activations are the step's
        h.update(f"module:{type(obj).__module__}.{type(obj).__qualname__}".encode())
        for name, t in [*obj.named_parameters(), *obj.named_buffers()]:
            h.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{t.requires_grad};".encode())
        h.update(module_code_key(obj).encode())
    elif callable(obj) and hasattr(obj, "__dict__"):
        # an object with __call__ (an nn.Module loss): its class, and its plain settings (label_smoothing, ...)
        cls = type(obj)
        h.update(f"{cls.__module__}.{cls.__qualname__}".encode())
        for method in ("__call__", "forward"):
            if method in vars(cls):
                _feed(h, vars(cls)[method], depth + 1)
        plain = sorted((k, v) for k, v in vars(obj).items() if isinstance(v, _PLAIN))
        _feed(h, plain, depth + 1)
    else:
        h.update(f"{type(obj).__qualname__}@{id(obj)}".encode())


def _names(code: types.CodeType) -> set[str]:
    """The global names ``code`` and the functions defined in it read."""
    found = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found |= _names(const)
    return found


def _global_modules(fn: types.FunctionType) -> list[nn.Module]:
    return [v for name in sorted(_names(fn.__code__)) if isinstance(v := fn.__globals__.get(name), nn.Module)]


def modules_in(loss: Any, depth: int = 0) -> list[nn.Module]:
    """The modules a loss or training step runs besides the model (a distillation teacher, a discriminator): those
    its closure, defaults, bound object or globals hold, the way :func:`loss_key` reaches them."""
    if depth > 6 or loss is None:
        return []
    if isinstance(loss, nn.Module):
        return [loss]
    if isinstance(loss, TrainingStep):
        return modules_in(loss.fn, depth + 1)
    if isinstance(loss, functools.partial):
        return [m for part in (loss.func, *loss.args, *loss.keywords.values()) for m in modules_in(part, depth + 1)]
    if isinstance(loss, types.MethodType):
        return modules_in(loss.__func__, depth + 1) + modules_in(loss.__self__, depth + 1)
    if isinstance(loss, (tuple, list)):
        return [m for item in loss for m in modules_in(item, depth + 1)]
    if isinstance(loss, types.FunctionType):
        held = [*(loss.__defaults__ or ())]
        for cell in loss.__closure__ or ():
            try:
                held.append(cell.cell_contents)
            except ValueError:
                continue
        return [m for item in held for m in modules_in(item, depth + 1)] + _global_modules(loss)
    return []
