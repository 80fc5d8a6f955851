"""torch's own optimizers: AdamW (fused, multi-tensor, one tensor at a time) and SGD with momentum.

Exact by definition: they are the update the unwrapped loop runs. The fused AdamW is the one the planner proposes
(its memory and time are validated on the H200); the others train and are estimated when pinned or named.
"""

from __future__ import annotations

from typing import Any

import torch

from memopt.techniques.optimizer_variant import REAL_FLOATS, OptimizerVariant, per_tensor_floor, per_tensor_states

__all__ = ["VARIANTS"]


def _adamw(**flags: Any) -> Any:
    return lambda params, **options: torch.optim.AdamW(params, **flags, **options)


def _sgd(params: Any, **options: Any) -> torch.optim.Optimizer:
    options.setdefault("momentum", 0.9)
    return torch.optim.SGD(params, **options)


VARIANTS = (
    OptimizerVariant("adamw_fused", "torch AdamW, fused CUDA kernel", "exact", _adamw(fused=True),
                     per_tensor_states(2, step_bytes=4), per_tensor_floor(2), 2.0, offered=True,
                     sharded_states=2, trainer_optim="adamw_torch_fused", param_dtypes=REAL_FLOATS,
                     instead="adamw_foreach"),
    OptimizerVariant("adamw_foreach", "torch AdamW, multi-tensor (torch's default)", "exact", _adamw(foreach=True),
                     per_tensor_states(2), per_tensor_floor(2), 2.0, sharded_states=2, trainer_optim="adamw_torch"),
    OptimizerVariant("adamw", "torch AdamW, one tensor at a time", "exact", _adamw(foreach=False),
                     per_tensor_states(2), per_tensor_floor(2), 2.0, sharded_states=2, trainer_optim="adamw_torch"),
    OptimizerVariant("sgd", "torch SGD with momentum", "exact", _sgd, per_tensor_states(1), per_tensor_floor(1), 1.0,
                     sharded_states=1, trainer_optim="sgd", algorithm="sgd"),
)
