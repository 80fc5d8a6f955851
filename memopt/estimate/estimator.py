"""``memopt.estimate``: per-GPU peak memory (allocated, reserved, outside the allocator) and step time of
one strategy, composed from a profile."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from memopt.categories import MemoryCategory
from memopt.errors import InputError
from memopt.estimate.allocator import simulate_allocator
from memopt.estimate.allocator_config import AllocatorConfig
from memopt.estimate.compose import pass_layout
from memopt.estimate.compose_peak import allocated_peak
from memopt.estimate.compose_stream import event_stream
from memopt.estimate.timing import TimingModel, segment_terms, step_time, timing_for
from memopt.hardware import HardwareSpec, load_hardware
from memopt.profile.cuda_semantics import kernel_policy_for
from memopt.profile.profile import Profile
from memopt.profile.tracker import ALLOC
from memopt.profile.variant_trace import VariantKey, VariantTrace, variant_key
from memopt.strategy import Strategy
from memopt.techniques.precision import stored_dtype, weight_dtype
from memopt.units import MiB, allocator_size

__all__ = ["Estimate", "StepPlan", "TotalAbove", "estimate_strategy"]

Cat = MemoryCategory

# measured on an H200: a process that offloads activations holds 128 MiB more outside the allocator
OFFLOAD_RUNTIME_BYTES = 128 * MiB


@dataclass
class Estimate:
    """Predicted per-GPU memory and time of one training step under one strategy."""

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    runtime_bytes: int  # outside PyTorch's allocator (CUDA context, handles, paged optimizer state)
    step_time_s: float
    breakdown: dict[MemoryCategory, int]  # at the peak; sums to total_bytes
    peak_at: str
    reserved_exact: bool  # True when the caching allocator was simulated over the composed run
    items_per_step: int = 0  # tokens (or samples) of the global batch
    item_unit: str = "tokens"
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return self.peak_reserved_bytes + self.runtime_bytes

    @property
    def throughput(self) -> float:
        return self.items_per_step / self.step_time_s if self.step_time_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "peak_allocated_bytes": self.peak_allocated_bytes, "peak_reserved_bytes": self.peak_reserved_bytes,
            "runtime_bytes": self.runtime_bytes, "total_bytes": self.total_bytes, "step_time_s": self.step_time_s,
            f"{self.item_unit}_per_s": self.throughput, "breakdown": {str(k): v for k, v in self.breakdown.items()},
            "peak_at": self.peak_at, "reserved_exact": self.reserved_exact, **self.detail,
        }


@dataclass
class StepPlan:
    """How a strategy maps onto the profile's traces."""

    block_modes: list[list[VariantKey]]
    base: VariantKey
    variants: set[VariantKey]


def step_plan(profile: Profile, strategy: Strategy) -> StepPlan:
    plain = variant_key(strategy, checkpointing="none")
    ckpt = variant_key(strategy)
    modes: list[list[VariantKey]] = []
    used = set()
    for n in profile.full_block_counts:
        chosen = set(strategy.checkpointing.blocks(n))
        row = [ckpt if p in chosen else plain for p in range(n)]
        modes.append(row)
        used.update(row)
    all_ckpt = all(m == ckpt for row in modes for m in row) and strategy.checkpointing.mode != "none"
    base = ckpt if all_ckpt else plain
    used.add(base)
    return StepPlan(block_modes=modes, base=base, variants=used)


def static_bytes(profile: Profile, strategy: Strategy, traces: dict, base: VariantKey, global_batch: int,
            optimizer_master: int) -> tuple[dict[MemoryCategory, int], list[tuple[int, int, int]]]:
    trace = traces[base]
    if trace.model_state is not None:
        return _static_transformed(profile, trace, global_batch, optimizer_master)
    wd = weight_dtype(strategy.precision)
    params = profile.param_bytes(wd) + profile.buffer_bytes(wd)
    inputs = sum(allocator_size(input_size_bytes(trace, b1, b2, global_batch)) for b1, b2 in trace.input_sizes)
    persistent, persistent_events = _persistent(trace)
    static = {Cat.PARAMETERS: params, Cat.OPTIMIZER_STATES: optimizer_master, Cat.ACTIVATIONS: inputs,
              Cat.TEMPORARIES: persistent}
    # the events the allocator sees before the first step: each parameter, buffer, master copy, input
    events: list[tuple[int, int, int]] = []
    k = 1
    for numel, dtype in [(n, d) for n, d, _ in profile.param_sizes] + list(profile.buffer_sizes):
        events.append((ALLOC, -(10**9) - k, numel * stored_dtype(wd, getattr(torch, dtype)).itemsize))
        k += 1
    if optimizer_master:
        for numel, dtype, grad in profile.param_sizes:
            if grad and getattr(torch, dtype).is_floating_point:
                events.append((ALLOC, -(10**9) - k, numel * 4))
                k += 1
    for b1, b2 in trace.input_sizes:
        events.append((ALLOC, -(10**9) - k, input_size_bytes(trace, b1, b2, global_batch)))
        k += 1
    return static, events + persistent_events


def _persistent(trace: VariantTrace) -> tuple[int, list[tuple[int, int, int]]]:
    persistent = 0
    events = []
    for seg in trace.segments:
        for kind, key, b1, _ in seg.events:
            if kind == ALLOC and key in trace.persistent_keys:
                persistent += allocator_size(b1)
                events.append((ALLOC, -len(events) - 1, b1))
    return persistent, events


def _static_transformed(profile: Profile, trace: VariantTrace, global_batch: int, optimizer_master: int
                        ) -> tuple[dict[MemoryCategory, int], list[tuple[int, int, int]]]:
    """The static part of a variant that transforms the model (quantization, adapters): the transformed model's
    own parameters and buffers (quantized storage and its scales, frozen full-precision ones, adapters), each
    traced block standing for the blocks it represents, in the dtypes the trace left them in."""
    params, buffers = profile.model_state(trace)
    sizes = [_numel(shape) * _itemsize(dtype) for shape, dtype, _ in params]
    sizes += [_numel(shape) * _itemsize(dtype) for shape, dtype in buffers]
    inputs = [input_size_bytes(trace, b1, b2, global_batch) for b1, b2 in trace.input_sizes]
    persistent, persistent_events = _persistent(trace)
    static = {Cat.PARAMETERS: sum(allocator_size(n) for n in sizes), Cat.OPTIMIZER_STATES: optimizer_master,
              Cat.ACTIVATIONS: sum(allocator_size(n) for n in inputs), Cat.TEMPORARIES: persistent}
    masters = [_numel(shape) * 4 for shape, dtype, grad in params
               if grad and dtype in ("float32", "bfloat16", "float16")] if optimizer_master else []
    events = [(ALLOC, -(10**9) - k - 1, size) for k, size in enumerate([*sizes, *masters, *inputs])]
    return static, events + persistent_events


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def input_size_bytes(trace: Any, lo_bytes: int, hi_bytes: int, global_batch: int) -> int:
    """Inputs are linear in the batch even when a trace was taken at a single size."""
    if trace.hi == trace.lo:
        return lo_bytes * global_batch // trace.lo
    return trace.size(lo_bytes, hi_bytes, global_batch)


class TotalAbove(Exception):
    """``estimate_strategy(stop_above=...)``: the total is above ``stop_above``; it is at least ``total_bytes``
    (where the replay stopped)."""

    def __init__(self, total_bytes: int) -> None:
        super().__init__(total_bytes)
        self.total_bytes = total_bytes


def estimate_strategy(profile: Profile, strategy: Strategy, *, hardware: str | HardwareSpec | None = None,
                      exact_reserved: bool = True, timing: TimingModel | None = None,
                      num_steps: int = 3, stop_above: int | None = None, cap_bytes: int | None = None) -> Estimate:
    """Predict the peak memory and step time of ``strategy`` from ``profile``.

    ``stop_above`` (with ``exact_reserved``): raise :class:`TotalAbove` as soon as the allocator replay shows
    that the total exceeds it (a caller looking for the smallest total needs no more of a loser).

    ``cap_bytes`` (with ``exact_reserved``): the replay runs under the hard cap that ``memopt.wrap`` sets (what the
    allocator may reserve), so the caching allocator flushes its cache and retries instead of growing past it, as
    PyTorch's does; reserved bytes are then those of the capped run, ``detail["capped"]`` says how many retries
    it took (each costs ``TimingModel.alloc_retry_s``), and an allocation the cap cannot serve raises
    :class:`CappedOOM`."""
    hw = load_hardware(hardware or profile.hardware)
    policy = kernel_policy_for(hw).cache_key
    if hardware is not None and profile.kernel_policy and policy != profile.kernel_policy:
        # another GPU generation picks other attention kernels and workspaces: the traces are not its step's
        raise InputError([f"the profile was traced for {profile.hardware} ({profile.kernel_policy.split('-')[0]}), "
                          f"not for {hw.name} ({policy.split('-')[0]}): its kernels and workspaces differ; profile "
                          f"the model for {hw.name} (memopt.profile(model, sample, hardware={hw.name!r}))"])
    timing = timing or timing_for(hw)
    sp = step_plan(profile, strategy)
    traces = {k: profile.variant(k, strategy.micro_batch_size) for k in sp.variants}
    layout = pass_layout(traces, sp.base, sp.block_modes, profile.full_block_counts)
    opt = profile.optimizer(strategy.precision, strategy.optimizer, traces[sp.base])
    b, m = strategy.micro_batch_size, strategy.grad_accum_steps
    static, static_events = static_bytes(profile, strategy, traces, sp.base, b * m, opt.master_bytes)
    peak = allocated_peak(traces, layout, b, m, opt, static)
    runtime = hw.runtime_overhead_bytes + opt.host_state_bytes
    if strategy.activation_offload:
        runtime += OFFLOAD_RUNTIME_BYTES
    if stop_above is not None and peak.peak_bytes + runtime > stop_above:
        raise TotalAbove(peak.peak_bytes + runtime)
    reserved_exact = False
    reserved = peak.peak_bytes
    if exact_reserved:
        def build() -> tuple[list[tuple[int, int, int]], int, list[tuple[int, int]]]:
            passes: list[tuple[int, int]] = []
            events, start = event_stream(traces, layout, b, m, opt, static_events, num_steps=num_steps,
                                         passes=passes)
            return events, start, [(lo - start, hi - start) for lo, hi in passes]

        events, start, passes = _stream(profile, strategy, num_steps, build)
        result = simulate_allocator(events[start:],
                                    config=AllocatorConfig(expandable_segments=strategy.expandable_segments),
                                    initial_events=events[:start], cap_bytes=cap_bytes,
                                    stop_above=None if stop_above is None else stop_above - runtime,
                                    passes=passes)
        if result.stopped_at is not None:
            raise TotalAbove(result.peak_reserved_bytes + runtime)
        if result.oom:
            raise CappedOOM(f"{strategy.label()} does not train under a cap of {cap_bytes} reserved bytes")
        reserved = max(result.peak_reserved_bytes, peak.peak_bytes)
        reserved_exact = True
    else:
        reserved = _approx_reserved(peak.peak_bytes)
    breakdown = dict(peak.breakdown)
    breakdown[Cat.ALLOCATOR_OVERHEAD] = reserved - peak.peak_bytes
    breakdown[Cat.RUNTIME] = runtime
    step_s, detail = _step_time(profile, traces, layout, b, m, opt, hw, timing, strategy, peak)
    if exact_reserved and cap_bytes is not None:
        retries = -(-result.num_alloc_retries // num_steps)  # per step (the first step's included)
        step_s += retries * timing.alloc_retry_s
        detail["capped"] = {"cap_bytes": cap_bytes, "alloc_retries_per_step": retries}
    tokens = profile.tokens_per_sample
    items = b * m * (tokens if tokens else 1)
    detail.update({"variants": sorted(k.label() for k in sp.variants), "gradient_bytes": peak.grad_bytes,
                   "attention_backends": sorted({a for k in sp.variants for a in traces[k].attention_backends})})
    return Estimate(peak_allocated_bytes=peak.peak_bytes, peak_reserved_bytes=reserved, runtime_bytes=runtime,
                    step_time_s=step_s, breakdown=breakdown, peak_at=peak.where, reserved_exact=reserved_exact,
                    items_per_step=items, item_unit="tokens" if tokens else "samples", detail=detail)


_STREAMS_KEPT = 2
_Stream = tuple[list[tuple[int, int, int]], int, list[tuple[int, int]]]


def _stream(profile: Profile, strategy: Strategy, num_steps: int, build: Callable[[], _Stream]) -> _Stream:
    """The run's event stream, built once for the candidates that differ only in what the replay is given: the
    search replays a candidate uncapped, then again under the hard cap when only the cap lets it fit, and the
    allocator mode changes the replay, not the events. Building the stream costs as much as replaying it.
    Returns the events, where the steps begin, and the repeating micro-batches (relative to the steps)."""
    cache: OrderedDict = profile.derived.setdefault("event_streams", OrderedDict())
    key = (strategy.replace(expandable_segments=False), num_steps)
    found = cache.get(key)
    if found is None:
        found = cache[key] = build()
        while len(cache) > _STREAMS_KEPT:
            cache.popitem(last=False)
    else:
        cache.move_to_end(key)
    return found


class CappedOOM(ValueError):
    """The allocator replay under ``cap_bytes`` ran out of memory: the strategy does not train under that cap."""


def _approx_reserved(allocated: int) -> int:
    """Without simulating the allocator: at least the allocated peak, rounded up to a 2 MiB page."""
    return -(-allocated // (2 * MiB)) * (2 * MiB)


def _step_time(profile: Profile, traces: dict, layout: Any, b: int, m: int, opt: Any, hw: HardwareSpec,
               tm: TimingModel, strategy: Strategy, peak: Any) -> tuple[float, dict[str, Any]]:
    fwd: dict[str, float] = dict.fromkeys(("matmul", "attention", "memory", "launches", "bnb4_calls",
                                                 "library_kernels", "library_matmul"), 0.0)
    bwd = dict(fwd)
    fwd["sac_ops"] = 0.0
    fwd["ckpt_ops"] = 0.0
    for insts, acc in ((layout.forward, fwd), (layout.backward, bwd)):
        for i in insts:
            t = traces[i.variant]
            seg = t.segments[i.segment]
            seg_terms = segment_terms(seg.cost1, seg.cost2, b, hw, lo=t.lo, hi=t.hi)
            for k, v in seg_terms.items():
                acc[k] += v
            if acc is fwd and _selective_block_forward(i, seg.name):
                # selective checkpointing's dispatch mode sees every op of the block twice: in the forward, and
                # again in the recompute (saved outputs are returned from its cache, the others run again)
                fwd["sac_ops"] += 2 * seg_terms["launches"]
            if acc is fwd and _full_block_forward(i, seg.name):
                # non-reentrant checkpointing packs every tensor the block saves through Python hooks, and the
                # recompute unpacks them under another hook context: host time per op of the block's forward
                fwd["ckpt_ops"] += seg_terms["launches"]
    opt_terms = segment_terms(opt.cost, opt.cost, 1, hw)
    # each micro-batch after the first adds its gradients into the ones kept: one op per gradient, reading both
    # and writing one
    accumulate = {"launches": float(peak.grad_tensors), "memory": 3.0 * peak.grad_bytes / hw.hbm_bandwidth}
    terms: dict[str, Any] = {"forward": fwd, "backward": bwd, "optimizer": opt_terms, "micro_batches": m,
                             "accumulate": accumulate}
    detail: dict[str, Any] = {}
    if strategy.activation_offload:
        # device-to-host copies overlap the forward pass; host-to-device copies happen as backward unpacks
        moved = _offloaded_bytes(profile, traces, layout, b)
        terms["offload_s"] = moved / hw.host_link_bandwidth
        detail["offloaded_bytes"] = moved * m
    step_s, parts = step_time(terms, tm)
    detail.update(parts)
    detail["time_terms"] = terms
    return step_s, detail


def _full_block_forward(inst: Any, name: str) -> bool:
    """A block's own forward segment under full checkpointing."""
    return inst.block is not None and inst.variant.checkpointing == "full" and not name.endswith(".x")


def _selective_block_forward(inst: Any, name: str) -> bool:
    """A block's own forward segment (not the code between it and the next) under selective checkpointing."""
    return inst.block is not None and inst.variant.checkpointing == "selective" and not name.endswith(".x")


def _offloaded_bytes(profile: Profile, traces: dict, layout: Any, b: int) -> float:
    """Bytes activation offload moves each way per micro-batch (traced counters, blocks repeated)."""
    total = 0.0
    for i in layout.forward:
        seg = traces[i.variant].segments[i.segment]
        o1, o2 = seg.offload
        total += traces[i.variant].size(o1, o2, b)
    return total
