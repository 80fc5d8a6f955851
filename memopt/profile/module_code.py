"""The part of a built model's cache key that its parameters do not show: the code of its module classes and the
plain settings its modules hold.

Two models with the same module classes and parameter shapes can still allocate differently: a ``forward`` edited
in a notebook (an extra activation kept, attention written another way), a helper function it calls changed, or a
module setting such as ``num_heads`` that reshapes activations without touching a parameter. A profile cached for
one must not be served for the other. So the key covers, for every module class of the model, the code of the
methods it and its base classes define (torch's own classes are covered by torch's version elsewhere in the key),
the functions of the same source module those methods call by name, each module's public attributes of plain
types, and a transformers model's configuration (its settings and the attention implementation it runs). Everything
here is hashed by content, never by ``id``, so the same model defined again in another process finds its cached
profile.
"""

from __future__ import annotations

import hashlib
import types
import weakref
from typing import Any

from torch import nn

__all__ = ["module_code_key"]

_PLAIN = (int, float, str, bool, type(None))
_MAX_DEPTH = 6  # helpers of helpers: deep enough for model code, bounded against long call chains
_class_keys: weakref.WeakKeyDictionary[type, str] = weakref.WeakKeyDictionary()


def module_code_key(model: nn.Module) -> str:
    """A hash of the code of ``model``'s module classes and of its modules' plain attributes."""
    h = hashlib.sha256()
    configs: dict[int, str] = {}  # one hash per configuration object (a transformers model's layers share it)
    for name, module in model.named_modules():
        h.update(f"{name}:{_class_key(type(module))};".encode())
        config = vars(module).get("config")
        if config is not None and hasattr(config, "to_diff_dict"):
            if id(config) not in configs:
                configs[id(config)] = _config_key(config)
            h.update(f"config={configs[id(config)]};".encode())
        for attr, value in sorted(vars(module).items()):
            if attr.startswith("_") or attr == "training":
                continue
            if isinstance(value, _PLAIN) or (isinstance(value, (tuple, list)) and all(
                    isinstance(v, _PLAIN) for v in value)):
                h.update(f"{attr}={value!r};".encode())
            elif isinstance(value, (types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
                # an activation kept as an attribute (self.act = F.gelu), or a forward replaced on the instance
                # (m.forward = MethodType(f, m)): its identity, by name and code
                h.update(f"{attr}:".encode())
                _feed_function(h, getattr(value, "__func__", value), 0, set())
        for hooks in _HOOKS:
            # a user's hook may keep or make tensors (features collected, a gradient rescaled): its code counts
            for hook in getattr(module, hooks, {}).values():
                h.update(f"{hooks}:".encode())
                _feed_function(h, _hook_function(hook), 0, set())
    return h.hexdigest()[:16]


# the hooks a training step runs; torch's global hooks are rare and left out
_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def _hook_function(hook: Any) -> Any:
    """The function behind a hook: a bound method's, a partial's, a callable object's ``__call__`` (torch wraps some
    hooks this way); else the hook itself (a builtin: named by its qualified name)."""
    if isinstance(hook, types.MethodType):
        return hook.__func__
    func = getattr(hook, "func", None)  # functools.partial
    if isinstance(func, types.FunctionType):
        return func
    if not isinstance(hook, types.FunctionType) and callable(hook):
        call = next((vars(k)["__call__"] for k in type(hook).__mro__ if "__call__" in vars(k)), None)
        if isinstance(call, types.FunctionType):
            return call
    return hook


def _config_key(config: Any) -> str:
    """A transformers configuration's settings and the attention implementation it chose: an eager-attention model
    keeps the attention probabilities an SDPA one does not, with the same classes and parameters."""
    try:
        settings = config.to_diff_dict()
    except Exception:  # a configuration that cannot say its settings: its attention choice still counts
        settings = {}
    attention = getattr(config, "_attn_implementation", None)
    text = repr(sorted((k, repr(v)) for k, v in settings.items())) + f"|attn={attention}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _class_key(cls: type) -> str:
    key = _class_keys.get(cls)
    if key is None:
        h = hashlib.sha256()
        for klass in cls.__mro__:
            if klass is object or klass.__module__.split(".")[0] == "torch":
                continue
            h.update(f"{klass.__module__}.{klass.__qualname__}:".encode())
            seen: set[int] = set()
            for attr, value in sorted(vars(klass).items()):
                function = _function_of(value)
                if function is not None:
                    h.update(f"{attr}:".encode())
                    _feed_function(h, function, 0, seen)
        key = _class_keys[cls] = h.hexdigest()[:16]
    return key


def _function_of(value: Any) -> types.FunctionType | None:
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    elif isinstance(value, property):
        value = value.fget
    return value if isinstance(value, types.FunctionType) else None


def _feed_function(h: Any, fn: Any, depth: int, seen: set[int]) -> None:
    if not isinstance(fn, types.FunctionType):  # a builtin or C function: its name says what it computes
        h.update(f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}".encode())
        return
    h.update(f"{fn.__module__}.{fn.__qualname__}".encode())
    if id(fn.__code__) in seen or depth > _MAX_DEPTH:
        return
    seen.add(id(fn.__code__))
    _feed_code(h, fn.__code__)
    for default in fn.__defaults__ or ():
        h.update(repr(default).encode() if isinstance(default, _PLAIN) else type(default).__qualname__.encode())
    for cell in fn.__closure__ or ():  # a decorator's wrapper holds the method it wraps
        try:
            content = cell.cell_contents
        except ValueError:
            continue
        if isinstance(content, types.FunctionType):
            _feed_function(h, content, depth + 1, seen)
        elif isinstance(content, _PLAIN):
            h.update(repr(content).encode())
    wrapped = getattr(fn, "__wrapped__", None)
    if isinstance(wrapped, types.FunctionType):
        _feed_function(h, wrapped, depth + 1, seen)
    for name in _names_read(fn.__code__):  # helpers of the same source file (apply_rotary_pos_emb, ...)
        helper = fn.__globals__.get(name)
        if isinstance(helper, types.FunctionType) and helper.__module__ == fn.__module__:
            _feed_function(h, helper, depth + 1, seen)


def _feed_code(h: Any, code: types.CodeType) -> None:
    h.update(code.co_code)
    h.update(repr(code.co_names).encode())
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _feed_code(h, const)
        elif isinstance(const, frozenset):  # `x in {"a", "b"}`: its repr's order changes with the hash seed
            h.update(repr(sorted(const, key=repr)).encode())
        elif isinstance(const, (*_PLAIN, tuple, bytes)):
            h.update(repr(const).encode())


def _names_read(code: types.CodeType) -> list[str]:
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):  # a nested function or comprehension reads names too
            names.extend(_names_read(const))
    return names
