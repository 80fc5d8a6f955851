"""Predicting a validation row on the CPU, as a user's dry run would: no GPU, fake tensors only."""

from __future__ import annotations

import time
from typing import Any

from harness.rows import Row
from memopt.estimate.allocator import simulate_allocator
from memopt.estimate.allocator_config import AllocatorConfig
from memopt.hardware import load_hardware
from memopt.profile.cuda_semantics import kernel_policy_for
from memopt.profile.simulate import simulate_step

__all__ = ["simulate_row"]


def simulate_row(row: Row) -> dict[str, Any]:
    """The fake-tensor simulation of the whole row (all its steps) and the allocator replay of its events."""
    from memopt.models import SampleSpec, build_model, make_batch, with_overrides

    hardware = load_hardware(row.hardware)
    policy = kernel_policy_for(hardware)
    spec = with_overrides(row.model, row.overrides)
    model = build_model(spec, device="meta")
    sample = SampleSpec.parse(row.sample(), spec)
    t = time.perf_counter()
    sim = simulate_step(model, lambda device: make_batch(spec, sample, device=device), row.strategy, policy=policy,
                        num_steps=row.steps)
    events = sim.run.events
    first_step = next(i for i, e in enumerate(events) if sim.run.phases[e[3]] != "setup")
    setup = [(k, key, size) for k, key, size, _, _ in events[:first_step]]
    rest = [(k, key, size) for k, key, size, _, _ in events[first_step:]]
    alloc = simulate_allocator(rest, config=AllocatorConfig(expandable_segments=row.strategy.expandable_segments),
                               initial_events=setup)
    return {
        "predicted_peak_allocated_bytes": sim.peak_allocated_bytes,
        "predicted_peak_reserved_bytes": alloc.peak_reserved_bytes,
        "predicted_runtime_bytes": hardware.runtime_overhead_bytes,
        "attention_backends": sorted(set(sim.attention_backends)),
        "simulate_s": time.perf_counter() - t,
        "allocator_peak_allocated_bytes": alloc.peak_allocated_bytes,
    }


def estimate_row(row: Row, *, exact_reserved: bool = True, use_cache: bool = True) -> dict[str, Any]:
    """The composed estimate of a row, as ``memopt.plan`` makes it (profile once, compose per strategy)."""
    import memopt
    from memopt.models import with_overrides

    spec = with_overrides(row.model, row.overrides)
    t = time.perf_counter()
    prof = memopt.profile(spec, sample=row.sample(), hardware=row.hardware, use_cache=use_cache)
    est = memopt.estimate(prof, row.strategy, exact_reserved=exact_reserved, num_steps=row.steps)
    return {
        "predicted_peak_allocated_bytes": est.peak_allocated_bytes,
        "predicted_peak_reserved_bytes": est.peak_reserved_bytes,
        "predicted_runtime_bytes": est.runtime_bytes,
        "predicted_total_bytes": est.total_bytes,
        "predicted_step_s": est.step_time_s,
        "predicted_breakdown": {str(k): v for k, v in est.breakdown.items()},
        "predicted_peak_at": est.peak_at,
        "time_terms": est.detail.get("time_terms"),
        "estimate_s": time.perf_counter() - t,
    }
