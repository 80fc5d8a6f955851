"""memopt: the fastest combination of memory-saving techniques that fits your GPU memory budget.

    >>> import memopt
    >>> prof = memopt.profile("llama3_8b", sample={"batch_size": 8, "seq_len": 4096}, hardware="h100_80gb")
    >>> est = memopt.estimate(prof, memopt.Strategy(precision="bf16_autocast", micro_batch_size=4, grad_accum_steps=2))

A profile is of its sample's global batch; a ``Strategy`` says how that batch is split (``micro_batch_size x
grad_accum_steps`` must be it: ``memopt.estimate`` refuses any other split in one line).

Every entry point (``memopt.plan``, ``memopt.profile``, ``memopt.wrap``, ``python -m memopt.plan``) checks its
input with one validation layer (``memopt.plan.checks``) and raises ``InputError`` (a ``ValueError``), one line
per problem. ``hardware`` left out means the local GPU, or ``h100_80gb`` where none is visible (the plan's notes
say so); ``hardware="auto"`` insists on the local GPU.
"""

from memopt import estimate, plan, profile
from memopt.apply.wrap import wrap
from memopt.apply.wrapped import Wrapped
from memopt.categories import MemoryCategory
from memopt.errors import InputError
from memopt.estimate import Estimate
from memopt.guard.oom import MemoptLeakError, MemoptOOMError
from memopt.hardware import HardwareSpec, load_hardware
from memopt.plan import Plan, Policy, make_plan
from memopt.profile import Profile
from memopt.profile.tracing_flag import is_tracing
from memopt.strategy import Checkpointing, Strategy
from memopt.units import format_bytes, parse_budget, parse_bytes

__version__ = "0.1.0"

__all__ = [
    "Checkpointing",
    "Estimate",
    "HardwareSpec",
    "InputError",
    "MemoptLeakError",
    "MemoptOOMError",
    "MemoryCategory",
    "Plan",
    "Policy",
    "Profile",
    "Strategy",
    "Wrapped",
    "estimate",
    "format_bytes",
    "is_tracing",
    "load_hardware",
    "make_plan",
    "parse_budget",
    "parse_bytes",
    "plan",
    "profile",
    "wrap",
]
