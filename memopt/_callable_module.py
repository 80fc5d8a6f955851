"""Modules that are also functions: ``memopt.profile(...)``, ``memopt.estimate(...)``, ``memopt.plan(...)``.

``memopt.plan`` must be a module (``python -m memopt.plan`` is the dry run) and the planning call
that users write as ``memopt.plan(model, budget=...)``. Importing a submodule sets the package
attribute to the module, which would shadow a function of the same name; making the module itself
callable keeps both true whatever is imported, in any order.
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Callable
from typing import Any

__all__ = ["make_callable"]


def make_callable(module_name: str, function: Callable[..., Any]) -> None:
    module = sys.modules[module_name]

    class _CallableModule(types.ModuleType):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs)

    _CallableModule.__call__.__doc__ = function.__doc__
    # help() and inspect.signature(memopt.plan) show the function's parameters and its typed return (Plan, ...)
    try:
        signature = inspect.signature(function, eval_str=True)
    except NameError:  # an annotation named only for type checkers: shown as written
        signature = inspect.signature(function)
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
    _CallableModule.__call__.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[self_param, *signature.parameters.values()])
    module.__class__ = _CallableModule
