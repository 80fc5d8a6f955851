"""Per-GPU estimate of a sharded training step (FSDP2, DeepSpeed ZeRO, offload): memory along the step, and time.

memopt's single-GPU estimator (``memopt.estimate``) composes a step's activations from the profile but knows no
sharding; ``memopt.distributed.memory`` knows the sharded model states and engine buffers but no activations.
This module joins them at the peak's *time*, not as a sum of separate peaks:

* the activation timeline (``memopt.distributed.timeline.activation_timeline``): one steady-state micro-batch
  (forward, backward) folded over the profile's composed pass, in the engines' compute precision;
* the engine's bytes at each point of that timeline (``memopt.distributed.engine_bytes.engine_bytes_at``), and
  which of them live in the pools of the engine's own streams (``side_pool_bytes``);
* the allocator: with expandable segments each stream's pool grows to its own peak and keeps it, so the reserved
  peak is the sum of the pools' peaks (``pooled_reserved``: the default stream's pool being the rest), each
  rounded to the segment granularity -- not the allocated peak rounded.

The predicted allocated peak is the maximum over the timeline of activations + engine bytes (and, for engines that
step on the GPU, the optimizer step's own point). The step time adds to memopt's single-GPU compute per
micro-batch the engine's collectives, host copies, CPU optimizer and fixed work (``memopt.distributed.timing``).

The sharded planner (``memopt.plan.sharded``) carries a candidate's prediction as a :class:`ShardedEstimate`: the
per-GPU peaks and tiers from :func:`predict_sharded` (``ShardedEstimate.of``), capped where only the hard cap makes
it fit (``memopt.plan.sharded_cap``), then timed; ``to_dict`` is the form ``Plan.prediction`` records.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from memopt.distributed.engine_bytes import EngineRun, engine_bytes_at, side_pool_bytes, side_pool_growth
from memopt.distributed.memory import sharded_memory
from memopt.distributed.model_states import state_bytes
from memopt.distributed.timeline import TimelinePoint, activation_timeline, timeline_grads
from memopt.distributed.timing import sharded_step_time
from memopt.estimate.estimator import estimate_strategy, step_plan
from memopt.estimate.timing import timing_for
from memopt.profile.engine_facts import ModelFacts
from memopt.profile.tracker import ALLOC
from memopt.strategy import Strategy
from memopt.techniques.sharding import ENGINE_PRECISION, PLAN_PRECISION, ShardingSetting
from memopt.units import MiB, allocator_size

__all__ = [
    "ENGINE_PRECISION",
    "CapRetries",
    "ShardedEstimate",
    "compute_estimate",
    "pooled_reserved",
    "predict_sharded",
    "sharded_time",
]

#: the allocator's page: small-pool segments and the granularity the allocated figures are rounded to
PAGE = 2 * MiB
#: an expandable segment of the large pool grows in steps of this size (c10/cuda/CUDACachingAllocator.cpp)
LARGE_SEGMENT = 20 * MiB


def _round(n: int, granule: int) -> int:
    return -(-n // granule) * granule


def pooled_reserved(points: Sequence[tuple[int, dict[str, int]]], growth: dict[str, int] | None = None,
                    default_slack: int = 0) -> int:
    """Reserved bytes with expandable segments: each stream's pool grows to its own peak (in 20 MiB steps) and
    keeps it. ``points``: (allocated total, side pools' bytes within it) at each point of the step; ``growth``:
    what a side pool holds briefly beyond its peak there; ``default_slack``: what the default stream's pool
    reserves beyond its allocated peak (fragmentation, see ``default_pool_slack``)."""
    side_peaks: dict[str, int] = {}
    default_peak = default_slack
    for total, side in points:
        default_peak = max(default_peak, total - sum(side.values()) + default_slack)
        for pool, n in side.items():
            side_peaks[pool] = max(side_peaks.get(pool, 0), n)
    for pool, n in (growth or {}).items():
        side_peaks[pool] = side_peaks.get(pool, 0) + n
    return _round(default_peak, LARGE_SEGMENT) + sum(_round(n, LARGE_SEGMENT) for n in side_peaks.values() if n)


def default_pool_slack(profile: Any, strategy: Strategy) -> int:
    """What the default stream's pool reserves beyond its allocated peak in a sharded run: half the largest
    activation tensor of one micro-batch (for a language model the fp32 logits of the loss: half is their bf16
    source), a hole that stays reserved once the pool has grown around it. The single-GPU allocator replay is not
    run for sharded settings; this is its measured stand-in. On the H200 (Llama-3.2-3B, FSDP2; largest tensor 3.91
    GiB at 4 x 2048, 1.96 GiB at 2 x 2048) the default pool's reserved exceeded its predicted allocated peak by 2.02
    and 2.38 GiB (one GPU, 4 x 1), 1.12 GiB (one GPU, 2 x 2) and 2.14 GiB (two GPUs, 4 x 1): 0.52 to 0.61 of the
    largest tensor (raw/session6_x1, raw/session8_x2)."""
    b = strategy.micro_batch_size
    base = step_plan(profile, strategy).base
    memo = profile.derived
    if ("pool_slack", base, b) in memo:
        return memo["pool_slack", base, b]
    trace = profile.variant(base, b)
    largest = 0
    for seg in trace.segments:
        for kind, key, lo, hi in seg.events:
            if kind == ALLOC and key not in trace.persistent_keys and key not in trace.grad_keys:
                largest = max(largest, allocator_size(trace.size(lo, hi, b)))
    memo["pool_slack", base, b] = largest // 2
    return largest // 2


def predict_sharded(profile: Any, strategy: Strategy, run: EngineRun, facts: ModelFacts,
                    timeline: Sequence[TimelinePoint] | None = None) -> dict[str, Any]:
    """Per-GPU prediction of one sharded setting: allocated and reserved peaks, where, their parts, host RAM per
    rank. ``strategy``: the per-rank micro-batch and checkpointing (its precision is the engines' own);
    ``timeline``: its ``activation_timeline`` with ``timeline_grads(run.setting)``, when the caller has it."""
    s = run.setting
    if timeline is None:
        timeline = activation_timeline(profile, strategy.replace(precision=ENGINE_PRECISION),
                                       grads=timeline_grads(s))
    best: dict[str, Any] = {"total": -1}
    pooled: list[tuple[int, dict[str, int]]] = []
    for pt in timeline:
        eb = engine_bytes_at(run, facts, pt)
        total = pt.peak + eb["states"] + eb["buffers"]
        pooled.append((total, side_pool_bytes(run, facts, pt)))
        if total > best["total"]:
            where = f"{pt.part}: {pt.name}" + (f" (block {pt.block})" if pt.block is not None else "")
            best = {"total": total, "where": where, "activations": pt.peak, **eb}
    step = engine_bytes_at(run, facts, None)
    pooled.append((step["states"] + step["buffers"], side_pool_bytes(run, facts, None)))
    if step["states"] + step["buffers"] > best["total"]:
        best = {"total": step["states"] + step["buffers"], "where": "optimizer step", "activations": 0, **step}
    sb = state_bytes(s.engine if s.engine != "ddp" else "fsdp2", PLAN_PRECISION)
    sm = sharded_memory(facts.num_params, engine=s.engine, stage=s.stage, world_size=s.world_size, sb=sb,
                        nodes=s.nodes, replicate_size=s.replicate_size, offload_optimizer=s.offload_optimizer,
                        offload_params=s.offload_params, largest_module_params=facts.largest_module_params)
    host = sm.host_bytes // max(1, s.gpus_per_node)  # per rank
    if s.engine == "deepspeed" and s.stage in (1, 2) and s.offload_optimizer != "none" and run.grad_accum > 1:
        host += facts.num_params * 2  # accumulated_grads_in_cpu: a 16-bit copy of every gradient (pinned)
    allocated = int(best["total"])
    # the pools are per stream with the default allocator too (measured within 1.5% of expandable segments' on
    # FSDP2); its extra fragmentation between segments is not modelled
    reserved = pooled_reserved(pooled, side_pool_growth(run, facts),
                               default_pool_slack(profile, strategy.replace(precision=ENGINE_PRECISION)))
    return {
        "predicted_peak_allocated_bytes": allocated,
        "predicted_peak_reserved_bytes": max(reserved, _round(allocated, PAGE)),
        "predicted_peak_at": best["where"],
        "predicted_parts": {"activations": int(best["activations"]), "model_states": int(best["states"]),
                            "engine_buffers": int(best["buffers"])},
        "predicted_host_bytes_per_rank": int(host),
        "predicted_nvme_bytes_per_node": int(sm.nvme_bytes),
        "predicted_nccl_bytes": int(sm.nccl),
        "num_params": facts.num_params,
    }


@dataclass(frozen=True)
class CapRetries:
    """How a candidate runs under the hard cap (``memopt.plan.sharded_cap.under_cap``): the reserved peak it would
    reach without the cap, and the allocator retries (per step, and the seconds they add to it) that keep it there."""

    uncapped_reserved_bytes: int
    retries_per_step: int
    retry_s: float

    def to_dict(self) -> dict[str, Any]:
        return {"uncapped_reserved_bytes": self.uncapped_reserved_bytes, "retries_per_step": self.retries_per_step,
                "retry_s": self.retry_s}


@dataclass(frozen=True)
class ShardedEstimate:
    """The sharded planner's prediction of one candidate, per GPU: allocated and reserved peaks (reserved at the cap
    when ``capped``), the memory outside the allocator (``runtime_bytes``: the CUDA runtime and NCCL), where the peak
    is and its parts, the host RAM and NVMe per node, and -- once timed -- the step time and throughput.

    ``total_bytes`` is reserved + runtime; the breakdown's allocator overhead is reserved - allocated. ``to_dict`` is
    the prediction a ``Plan`` records (and the planner's dicts before this type): its keys and values stay as they
    are, since recorded plans are compared byte for byte."""

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    runtime_bytes: int
    peak_at: str
    model_states_bytes: int
    engine_buffers_bytes: int
    activations_bytes: int
    host_bytes_per_node: int
    nvme_bytes_per_node: int
    world_size: int
    capped: CapRetries | None = None
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    samples_per_s: float | None = None

    @classmethod
    def of(cls, pred: dict[str, Any], setting: ShardingSetting, runtime_overhead_bytes: int) -> ShardedEstimate:
        """From :func:`predict_sharded`'s per-rank dict: the runtime adds NCCL's bytes to the hardware's overhead,
        and the host RAM is the node's (its ranks together)."""
        parts = pred["predicted_parts"]
        return cls(peak_allocated_bytes=pred["predicted_peak_allocated_bytes"],
                   peak_reserved_bytes=pred["predicted_peak_reserved_bytes"],
                   runtime_bytes=runtime_overhead_bytes + pred["predicted_nccl_bytes"],
                   peak_at=pred["predicted_peak_at"], model_states_bytes=parts["model_states"],
                   engine_buffers_bytes=parts["engine_buffers"], activations_bytes=parts["activations"],
                   host_bytes_per_node=pred["predicted_host_bytes_per_rank"] * setting.gpus_per_node,
                   nvme_bytes_per_node=pred["predicted_nvme_bytes_per_node"], world_size=setting.world_size)

    @property
    def total_bytes(self) -> int:
        return self.peak_reserved_bytes + self.runtime_bytes

    def replace(self, **changes: Any) -> ShardedEstimate:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """As ``Plan.prediction``: the keys in this order, ``capped``, ``step_time_s`` and the throughput only when
        set (``tokens_per_s`` for a model with tokens, else ``samples_per_s``)."""
        allocated, reserved, runtime = self.peak_allocated_bytes, self.peak_reserved_bytes, self.runtime_bytes
        out: dict[str, Any] = {
            "peak_allocated_bytes": allocated, "peak_reserved_bytes": reserved, "runtime_bytes": runtime,
            "total_bytes": self.total_bytes, "peak_at": self.peak_at,
            "breakdown": {"model_states": self.model_states_bytes, "engine_buffers": self.engine_buffers_bytes,
                          "activations": self.activations_bytes, "allocator_overhead": reserved - allocated,
                          "runtime": runtime},
            "host_bytes_per_node": self.host_bytes_per_node, "nvme_bytes_per_node": self.nvme_bytes_per_node,
            "world_size": self.world_size, "reserved_exact": False,
        }
        if self.capped is not None:
            out["capped"] = self.capped.to_dict()
        for key in ("step_time_s", "tokens_per_s", "samples_per_s"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


def compute_estimate(profile: Any, strategy: Strategy, hw: Any) -> Any:
    """memopt's single-GPU estimate of ``strategy`` in the engines' precision: the compute ``sharded_time`` adds the
    engine's work to (the same for every engine at one micro-batch and checkpointing)."""
    return estimate_strategy(profile, strategy.replace(precision=ENGINE_PRECISION), hardware=hw, exact_reserved=False,
                             num_steps=2)


def sharded_time(profile: Any, strategy: Strategy, run: EngineRun, facts: ModelFacts, hw: Any,
                 compute: Any = None) -> Any:
    """The step's ``memopt.distributed.timing.ShardedTime``: memopt's single-GPU compute per micro-batch (forward,
    backward with recomputation; ``compute``: ``compute_estimate``'s result, when the caller has it) with the
    engine's collectives, host copies, CPU optimizer and fixed work. Each rank's host issues its own micro-batches'
    kernels as on one GPU: a host-bound pass is no faster for the GPUs beside it."""
    s = run.setting
    est = compute if compute is not None else compute_estimate(profile, strategy, hw)
    m = run.grad_accum
    fwd = est.detail["forward_s"] / m
    bwd = est.detail["backward_s"] / m
    units = list(facts.unit_params)
    n = len(units) + 1
    fsdp = s.engine == "fsdp2"
    return sharded_step_time(engine=s.engine, stage=s.stage, world_size=s.world_size, nodes=s.nodes, hw=hw,
                             unit_params=units, forward_s=[fwd / n] * len(units), backward_s=[bwd / n] * len(units),
                             optimizer_s=est.detail["optimizer_s"], compute_bytes=2, param_bytes=4 if fsdp else 2,
                             reduce_bytes=4 if fsdp else 2, root_params=facts.root_params, root_forward_s=fwd / n,
                             root_backward_s=bwd / n, micro_batches=m, replicate_size=s.replicate_size,
                             offload_optimizer=s.offload_optimizer, offload_params=s.offload_params,
                             param_tensors=facts.num_tensors, host_issue_s=est.detail.get("host_s", 0.0) / m,
                             tm=timing_for(hw))
