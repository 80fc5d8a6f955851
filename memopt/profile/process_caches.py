"""What a fake-tensor trace of the model's code must not leave behind in the process: fake tensors in its caches.

``fake_copy`` gives the trace its own module tree, but the model's code also keeps state outside its modules: a
``functools.lru_cache``'d function (transformers' BEiT builds its relative-position index that way), a module-level
or class-level dict filled on first use (rotary tables, masks keyed by length). When the first call is the traced
forward, the cache keeps a fake tensor and every real forward after it reads that (the H100 zoo's BEiT row trained
on NaN losses; on the CPU the forward raises). ``caches_kept_real`` looks only at the modules that define the model's
module classes (a library's shared helpers cache flags and once-only warnings): after the trace it empties each
``lru_cache`` there that gained an entry (nothing but recomputation is lost) and removes from each dict there the
entries the trace added that hold fake tensors.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import sys
from collections.abc import Iterator
from typing import Any

from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["caches_kept_real"]

# per set of modules a model's classes are defined in: the functools caches defined there
_LRU: dict[frozenset[str], list[functools._lru_cache_wrapper]] = {}


def _code_modules(model: nn.Module) -> frozenset[str]:
    return frozenset(type(m).__module__ for m in model.modules() if not type(m).__module__.startswith("torch."))


def _lru_caches(modules: frozenset[str]) -> list[functools._lru_cache_wrapper]:
    if modules not in _LRU:
        # type(), not isinstance: isinstance reads __class__, which some deprecated proxies answer with a warning
        _LRU[modules] = [o for o in gc.get_objects() if type(o) is functools._lru_cache_wrapper
                         and getattr(o, "__module__", None) in modules]
    return _LRU[modules]


def _dict_caches(model: nn.Module, modules: frozenset[str]) -> list[dict]:
    """The dicts among the globals of those modules and the attributes of the model's classes defined there."""
    spaces: list[Any] = [vars(sys.modules[name]) for name in modules if name in sys.modules]
    classes = {cls for m in model.modules() for cls in type(m).__mro__ if cls.__module__ in modules}
    spaces += [vars(cls) for cls in classes]
    found: dict[int, dict] = {}
    for space in spaces:
        for value in list(space.values()):
            if type(value) is dict:
                found[id(value)] = value
    return list(found.values())


def _holds_fake(value: Any) -> bool:
    if isinstance(value, FakeTensor):
        return True
    if isinstance(value, (tuple, list)):
        return any(_holds_fake(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_fake(v) for v in value.values())
    return False


@contextlib.contextmanager
def caches_kept_real(model: nn.Module) -> Iterator[None]:
    """Around a fake-tensor trace of ``model``'s code (see the module doc)."""
    modules = _code_modules(model)
    lru = _lru_caches(modules)
    misses = [c.cache_info().misses for c in lru]
    dicts = _dict_caches(model, modules)
    keys = [set(d) for d in dicts]
    try:
        yield
    finally:
        for cache, before in zip(lru, misses):
            if cache.cache_info().misses != before:
                cache.cache_clear()
        for d, before_keys in zip(dicts, keys):
            for key in [k for k in d if k not in before_keys and _holds_fake(d[k])]:
                del d[key]
