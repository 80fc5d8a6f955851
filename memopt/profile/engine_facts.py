"""The parameter counts a sharding engine's memory and work depend on (``ModelFacts``), from a model or a profile.

The profile records them when it traces a model (``Profile.engine_facts``), so that the sharded planner never
rebuilds the model from a cached profile; ``memopt.distributed`` reads them to size the engines' states, buffers
and per-tensor work. They live in the profile layer because counting them needs only the model and its block
stacks, and the profile, which must record them, sits below the engines' estimates.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from memopt.blocks import find_block_stacks
from memopt.models import build_model

__all__ = [
    "ModelFacts",
    "facts_of_module",
    "facts_of_profile",
    "model_facts",
]

#: DeepSpeed's parameter persistence threshold (``stage3_param_persistence_threshold`` default, elements)
PERSISTENCE_THRESHOLD = 100_000


@dataclass(frozen=True)
class ModelFacts:
    """Parameter counts the engines' memory depends on (from the model, built on the meta device if need be)."""

    num_params: int  # unique parameters (a tied embedding/head counted once)
    unit_params: tuple[int, ...]  # per block (FSDP2 unit), forward order
    root_params: int  # everything outside the blocks
    largest_param: int  # numel of the largest parameter
    largest_module_params: int  # direct parameters of the largest module (DeepSpeed ZeRO-3 gathers per module)
    tied_params: int  # numel of parameters shared between modules (tied embedding and head)
    small_params: int  # parameters under DeepSpeed's persistence threshold (kept whole on every GPU)
    num_tensors: int = 0  # unique parameter tensors (the engines' fixed work per micro-batch scales with them)


def facts_of_module(m: Any, persistence_threshold: int = PERSISTENCE_THRESHOLD) -> ModelFacts:
    """``ModelFacts`` of a module (real or on the meta device)."""
    params = list(m.parameters())  # unique
    if not params:
        raise ValueError(f"{type(m).__name__} has no parameters: there is nothing to shard")
    units = tuple(sum(p.numel() for p in b.parameters()) for s in find_block_stacks(m) for b in s.blocks)
    total = sum(p.numel() for p in params)
    owners: dict[int, int] = {}
    largest_module = 0
    for mod in m.modules():
        own = list(mod.parameters(recurse=False))
        largest_module = max(largest_module, sum(p.numel() for p in own))
        for p in own:
            owners[id(p)] = owners.get(id(p), 0) + 1
    tied = sum(p.numel() for p in params if owners.get(id(p), 0) > 1)
    return ModelFacts(num_params=total, unit_params=units, root_params=total - sum(units),
                      largest_param=max(p.numel() for p in params), largest_module_params=largest_module,
                      tied_params=tied,
                      small_params=sum(p.numel() for p in params if p.numel() < persistence_threshold),
                      num_tensors=len(params))


@functools.lru_cache(maxsize=8)
def model_facts(model: str, persistence_threshold: int = PERSISTENCE_THRESHOLD) -> ModelFacts:
    """``ModelFacts`` of a shipped model config, built on the meta device."""
    return facts_of_module(build_model(model, device="meta"), persistence_threshold)


def facts_of_profile(profile: Any) -> ModelFacts:
    """``ModelFacts`` of a profile's model: as recorded when it was profiled, else exact from the model when the
    profile can build it, else from the profile's per-parameter sizes and block stacks (no tied parameters known;
    the largest module taken as the largest parameter)."""
    recorded = getattr(profile, "engine_facts", None)
    if recorded:
        return ModelFacts(**{**recorded, "unit_params": tuple(recorded["unit_params"])})
    model = profile.model()
    if model is not None:
        return facts_of_module(model)
    sizes = [n for n, _dtype, _grad in profile.param_sizes]
    units = tuple(int(s["params_per_block"]) for s in profile.stacks for _ in range(int(s["num_blocks"])))
    total = sum(sizes)
    return ModelFacts(num_params=total, unit_params=units, root_params=max(0, total - sum(units)),
                      largest_param=max(sizes), largest_module_params=max(sizes), tied_params=0,
                      small_params=sum(n for n in sizes if n < PERSISTENCE_THRESHOLD), num_tensors=len(sizes))
