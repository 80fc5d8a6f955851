"""The optimizer step traced on its own: the states it creates and what a later step allocates."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from memopt.categories import MemoryCategory
from memopt.profile.costs import CostRecorder, PhaseCost
from memopt.profile.cuda_semantics import KernelPolicy
from memopt.profile.simulate import trace_device
from memopt.profile.stand_ins import FakeGradScaler
from memopt.profile.tracker import ALLOC, FREE, MemoryTracker
from memopt.step.train_step import TrainStep
from memopt.strategy import Strategy
from memopt.techniques.optimizer_instance import user_optimizer
from memopt.techniques.optimizers import build_optimizer
from memopt.techniques.precision import MasterWeights, stored_dtype, weight_dtype
from memopt.units import allocator_size

__all__ = ["OptimizerTrace", "trace_optimizer"]


@dataclass
class OptimizerTrace:
    """The optimizer step over the full model: first step (states appear) and a later one."""

    precision: str
    optimizer: str
    first: list[tuple[int, int, int]]  # (kind, key, bytes)
    steady: list[tuple[int, int, int]]
    state_bytes: int  # rounded bytes of optimizer state alive after the first step (master weights excluded)
    master_bytes: int  # fp32 master copies (bf16_master), allocated when the plan is applied
    cost: PhaseCost = field(default_factory=PhaseCost)
    host_state_bytes: int = 0  # paged optimizer state living outside the allocator
    state_keys: set[int] = field(default_factory=set)  # keys (in ``first``) of the states the step creates
    extras: str = ""  # the variant extras (``VariantKey.extras_id``) whose trainable parameters it steps

    def to_dict(self) -> dict[str, Any]:
        return {"precision": self.precision, "optimizer": self.optimizer, "first": self.first,
                "steady": self.steady, "state_bytes": self.state_bytes, "master_bytes": self.master_bytes,
                "cost": self.cost.to_dict(), "host_state_bytes": self.host_state_bytes,
                "state_keys": sorted(self.state_keys), "extras": self.extras}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OptimizerTrace:
        return cls(precision=d["precision"], optimizer=d["optimizer"], first=[tuple(e) for e in d["first"]],
                   steady=[tuple(e) for e in d["steady"]], state_bytes=d["state_bytes"],
                   master_bytes=d["master_bytes"], cost=PhaseCost.from_dict(d["cost"]),
                   host_state_bytes=d.get("host_state_bytes", 0), state_keys=set(d.get("state_keys", ())),
                   extras=d.get("extras", ""))


class _ParamHolder(nn.Module):
    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__()
        self.params = nn.ParameterList(params)


def trace_optimizer(model: nn.Module | None, precision: str, optimizer: str, policy: KernelPolicy,
                    optimizer_spec: Any = None, optimizer_kwargs: dict[str, Any] | None = None, *,
                    params: Sequence[tuple[tuple[int, ...], str]] | None = None) -> OptimizerTrace:
    """Trace two optimizer steps over fake parameters (with gradients) shaped like ``model``'s trainable ones
    (floating ones in the precision's weight dtype), or, with ``params``, of exactly these (shape, dtype) (the
    trainable parameters of a transformed model, already in their final dtypes; ``model`` is not used)."""
    device, emulate = trace_device(policy)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    wdtype = weight_dtype(precision)
    tracker = MemoryTracker(device)
    costs = CostRecorder(lambda: tracker._phase)
    host = "meta" if emulate else "cpu"
    seen: set[int] = set()
    with fake_mode:
        fakes = []
        if params is not None:
            for shape, dtype_name in params:
                fakes.append(nn.Parameter(torch.empty(shape, dtype=getattr(torch, dtype_name), device=device)))
        else:
            assert model is not None
            for p in model.parameters():
                if id(p) in seen or not p.requires_grad:
                    continue
                seen.add(id(p))
                dtype = stored_dtype(wdtype, p.dtype)
                fakes.append(nn.Parameter(torch.empty(p.shape, dtype=dtype, device=device)))
        holder = _ParamHolder(fakes)
        strategy = Strategy(precision=precision, optimizer=optimizer)
        master = MasterWeights(list(holder.parameters())) if precision == "bf16_master" else None
        opt_params = master.masters if master is not None else list(holder.parameters())
        if optimizer == "user":
            opt = user_optimizer(optimizer_spec, opt_params)
        else:
            opt = build_optimizer(optimizer, opt_params, trace_on=host, **(optimizer_kwargs or {}))
        scaler = None
        if precision == "fp16_autocast":
            scaler = FakeGradScaler(device)
        step = TrainStep(model=holder, optimizer=opt, strategy=strategy, device_type=device, scaler=scaler,
                         master=master)
        tracker.op_hooks.append(costs)
        with tracker:
            # parameters and master copies exist before the step: tracked so in-place writes are not new bytes
            for p in holder.parameters():
                tracker.track(p, MemoryCategory.PARAMETERS, "parameter")
            for m in master.masters if master is not None else []:
                tracker.track(m, MemoryCategory.OPTIMIZER_STATES, "master_weight")
            phase_first = None
            for i in range(2):
                for p in holder.parameters():
                    p.grad = torch.empty_like(p)
                tracker.set_phase(f"opt{i}")
                if phase_first is None:
                    phase_first = len(tracker.run.phases) - 1
                step.optimizer_step()
            tracker.set_phase("end")
            state_keys = set()
            for state in opt.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor) and v.device.type == device:
                        state_keys.add(tracker.key_of(v))
            host_state = sum(v.untyped_storage().nbytes() for state in opt.state.values() for v in state.values()
                             if isinstance(v, torch.Tensor) and v.device.type != device)
    phases = tracker.run.phases
    first_ph, second_ph = phases.index("opt0"), phases.index("opt1")
    # gradients are created outside the step (they are the backward's); zero_grad frees them: drop both
    grad_keys: set[int] = set()
    first: list[tuple[int, int, int]] = []
    steady: list[tuple[int, int, int]] = []
    for kind, key, size, ph, _label in tracker.run.events:
        target = first if first_ph <= ph < second_ph else steady if ph >= second_ph else None
        if target is None:
            continue
        target.append((kind, key, size))
    # gradients belong to the backward pass, not to the step: the fake ones made here (before each step) and
    # their frees by zero_grad are dropped (a key freed in a phase that did not allocate it is a gradient)
    for events in (first, steady):
        allocated = {key for kind, key, _ in events if kind == ALLOC}
        freed = {key for kind, key, _ in events if kind == FREE}
        grad_keys |= {key for key in freed if key not in allocated}
    state_bytes = 0
    live: dict[int, int] = {}
    for kind, key, size in first:
        if kind == ALLOC:
            live[key] = size
        else:
            live.pop(key, None)
    state_bytes = sum(allocator_size(size) for key, size in live.items() if key in state_keys)
    master_bytes = 0
    if master is not None:
        master_bytes = sum(allocator_size(m.untyped_storage().nbytes()) for m in master.masters)
    cost = costs.costs.get(second_ph, PhaseCost())
    return OptimizerTrace(precision=precision, optimizer=optimizer, first=_drop_grads(first, grad_keys),
                          steady=_drop_grads(steady, grad_keys), state_bytes=state_bytes, master_bytes=master_bytes,
                          cost=cost, host_state_bytes=host_state, state_keys=state_keys - {None})


def _drop_grads(events: list[tuple[int, int, int]], grad_keys: set[int]) -> list[tuple[int, int, int]]:
    return [e for e in events if e[1] not in grad_keys]
