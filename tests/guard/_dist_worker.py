"""Runs in each of the gloo processes of test_distributed.py (spawned: importable by module name)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

# each scenario: (failing rank, step attempt, phase, ops into the phase, transaction)
SCENARIOS = {
    "forward_on_rank1": (1, 1, "forward", 30, "auto"),
    "optimizer_on_rank0": (0, 2, "optimizer", 12, "always"),
}


def run_scenario(rank: int, name: str) -> dict:
    from memopt.guard.faults import FaultInjector
    from memopt.guard.recovery import OOMGuard

    from ._helpers import batches, params_of
    from .test_recovery import _setup

    fail_rank, at, phase, after_ops, transaction = SCENARIOS[name]
    model, prepared, plan, replanner = _setup()
    torch.manual_seed(1)
    guard = OOMGuard(prepared.step, plan, replanner=replanner, transaction=transaction)
    injector = FaultInjector(at_attempt=at, phase=phase, after_ops=after_ops, enabled=rank == fail_rank)
    guard.phase_listeners.append(injector.on_phase)
    with injector:
        losses = [guard.run(b) for b in batches(4)]
    return {"params": params_of(model), "losses": losses, "steps": guard.steps,
            "steps_done": guard.step.steps_done, "strategy": guard.step.strategy.label(),
            "failures": [(f.phase, f.location, f.failed_ranks) for f in guard.report.failures],
            "fired": len(injector.fired)}


def worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = {name: run_scenario(rank, name) for name in SCENARIOS}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
