"""Model profiles: ``memopt.profile(model, sample=..., hardware=...) -> Profile``.

The module is callable (see ``memopt._callable_module``): ``memopt.profile(...)`` calls
:func:`memopt.profile.api.profile_model`.
"""

from memopt._callable_module import make_callable
from memopt.profile.api import profile_model, resolve_model
from memopt.profile.cache_keys import SCHEMA_VERSION, cache_dir
from memopt.profile.profile import Profile

__all__ = ["SCHEMA_VERSION", "Profile", "cache_dir", "profile_model", "resolve_model"]

make_callable(__name__, profile_model)
