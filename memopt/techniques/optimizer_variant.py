"""What memopt knows of one optimizer: the record every optimizer family module fills in.

An ``OptimizerVariant`` holds everything about one optimizer name: the policy allowance it needs, how to build it,
the stand-in a fake-tensor trace steps instead (where the real one needs real values), the bytes of state it keeps
(exactly, and at the least for the planner's floors), whether the sharding engines can shard its states, and the
name the Hugging Face Trainer gives it. A family is one module (``optim_torch``, ``optim_bnb``, ``optim_torchao``)
whose ``VARIANTS`` ``memopt.techniques.optimizers`` registers; the planner, the configs' checks, the traces, the
Trainer integration and the byte models read that registry, never a list of names of their own.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from memopt.units import allocator_size

#: the real floating-point dtypes (what torch's fused AdamW kernels step)
REAL_FLOATS = frozenset({"float16", "bfloat16", "float32", "float64"})
#: what the 8-bit and 4-bit optimizer kernels step
HALF_AND_SINGLE = frozenset({"float16", "bfloat16", "float32"})

__all__ = ["HALF_AND_SINGLE", "REAL_FLOATS", "OptimizerVariant", "StandInOptimizer", "StateBytes", "per_tensor_floor",
           "per_tensor_states"]

# (numels of the trained tensors, the stepped parameters' dtype, round to the allocator's blocks) -> (bytes on the
# device, bytes in paged memory outside the allocator)
StateBytes = Callable[[Sequence[int], torch.dtype, bool], tuple[int, int]]


@dataclass(frozen=True)
class OptimizerVariant:
    name: str
    summary: str  # what it is, in a few words (the docs' table, error messages)
    fidelity: str  # the policy allowance a run with it needs (``memopt.plan.policy.ALLOWANCES``)
    build: Callable[..., torch.optim.Optimizer]  # (trainable parameters, **optimizer kwargs)
    state_bytes: StateBytes
    # (numels of the trained tensors, bytes per element of the stepped dtype) -> the state bytes at the least,
    # paged ones included (the planner's floors, which must never exceed the truth)
    floor_bytes: Callable[[Sequence[int], int], int]
    # state bytes per trained parameter per byte of its dtype, roughly: the order of memory saving
    states_per_item: float
    requires: str | None = None  # the package it imports (None: torch alone)
    install: str = ""  # what to run when that package is missing
    # the planner proposes it without a pin: its memory and time are validated on a GPU (benchmarks/validation)
    offered: bool = False
    # what a fake-tensor trace steps in its place: (params, state_device=, **optimizer kwargs), where the real
    # optimizer reads values (a constructor's .tolist(), a compiled kernel); None: the real one traces
    trace_stand_in: Callable[..., torch.optim.Optimizer] | None = None
    # states per parameter in the state dtype, for the sharding engines' byte model; None: they cannot shard it
    sharded_states: int | None = None
    trainer_optim: str | None = None  # ``TrainingArguments.optim`` (None: the Trainer path cannot run it)
    paged: bool = False  # some states live in paged memory, outside the allocator
    # the dtypes of the parameters it can step (None: any); a parameter of another dtype fails its kernel or,
    # worse, is stepped wrong without a word (bitsandbytes casts a complex gradient to float, dropping its
    # imaginary part)
    param_dtypes: frozenset[str] | None = None
    # the variant planned in its place where it is refused for a model (the same update, another kernel)
    instead: str | None = None
    # the update rule it runs: variants of one algorithm differ only in kernel or state storage, so a user's
    # optimizer of that algorithm can be rebuilt as any of them with its groups and hyper-parameters
    algorithm: str = "adamw"

    def installed(self) -> bool:
        """Whether its package is installed, without importing it (bitsandbytes' import compiles kernels)."""
        return self.requires is None or importlib.util.find_spec(self.requires) is not None

    def require(self) -> None:
        """ValueError naming the install when its package is missing."""
        if not self.installed():
            install = self.install or f"pip install {self.requires}"
            raise ValueError(f"optimizer {self.name!r} needs {self.requires}: {install}")

    def refusal(self, trainable_dtypes: Iterable[str], model: str = "the model") -> str | None:
        """Why it cannot step the trainable parameters of these dtypes (torch dtype names), or None."""
        if self.param_dtypes is None:
            return None
        other = sorted(set(trainable_dtypes) - self.param_dtypes)
        if not other:
            return None
        return (f"it ({self.summary}) steps {'/'.join(sorted(self.param_dtypes))} parameters only, and {model} "
                f"trains {'/'.join(other)} ones")

    def trace_optimizer(self, params: list[torch.nn.Parameter], state_device: str, **kwargs: Any
                        ) -> torch.optim.Optimizer:
        """What a fake-tensor trace steps: the stand-in where there is one, else the optimizer itself."""
        if self.trace_stand_in is not None:
            return self.trace_stand_in(params, state_device=state_device, **kwargs)
        return self.build(params, **kwargs)


def per_tensor_states(count: int, *, step_bytes: int = 0) -> StateBytes:
    """``count`` full-size states in the parameter dtype per tensor (plus a ``step_bytes`` step tensor on the
    device): torch's AdamW (2) and SGD with momentum (1)."""

    def state_bytes(numels: Sequence[int], dtype: torch.dtype, rounded: bool) -> tuple[int, int]:
        r = allocator_size if rounded else (lambda n: n)
        size = torch.empty((), dtype=dtype).element_size()
        return sum(count * r(n * size) + (r(step_bytes) if step_bytes else 0) for n in numels), 0

    return state_bytes


def per_tensor_floor(count: int) -> Callable[[Sequence[int], int], int]:
    """The floor of ``count`` full-size states in the stepped dtype per tensor."""
    return lambda numels, item: count * sum(allocator_size(n * item) for n in numels)


class StandInOptimizer(torch.optim.Optimizer):
    """What every trace stand-in shares: a parameter's states are allocated on its first step (``init_state``), and
    each step is an in-place op over the weight and over each state tensor ``stepped`` names, the memory traffic of
    one fused update with nothing allocated and no math."""

    stepped: tuple[str, ...] = ()

    def __init__(self, params: Any, **defaults: Any) -> None:
        super().__init__(params, {"lr": defaults.get("lr", 1e-3)})

    def init_state(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    self.init_state(p, state)
                torch.ops.aten.add_.Tensor(p, p.grad, alpha=0.0)
                for name in self.stepped:
                    torch.ops.aten.add_.Tensor(state[name], state[name])
        return None
