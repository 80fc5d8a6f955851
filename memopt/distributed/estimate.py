"""Per-GPU estimate of a sharded training step (FSDP2, DeepSpeed ZeRO, offload): memory along the step, and time.

memopt's single-GPU estimator (``memopt.estimate``) composes a step's activations from the profile but knows no
sharding; ``memopt.distributed.memory`` knows the sharded model states and engine buffers but no activations.
This module joins them at the peak's *time*, not as a sum of separate peaks:

* the activation timeline (``activation_timeline``): one steady-state micro-batch (forward, backward) folded over
  the profile's composed pass (``memopt.estimate.compose``), in the engines' compute precision (``bf16_pure``:
  both engines run the blocks in bf16 weights without autocast). Gradients are *transient* for DeepSpeed
  (autograd's gradient is copied into a bucket and freed) and *left out* for FSDP2 (its unsharded gradients are
  buffers counted by the engine model);
* the engine's bytes at each point of that timeline (``engine_bytes_at``): DeepSpeed ZeRO-1/2: the bf16
  parameters, the optimizer's states (or, offloaded, the gradient-offload staging buffer) and the reduce buckets
  in backward; ZeRO-3: ``memopt.distributed.memory``'s sharded states and gathered-parameter bound; FSDP2: the
  root and the current unit gathered, the prefetched unit, and in backward the unit's unsharded gradients and
  reduce-scatter buffers, per unit;
* the allocator: PyTorch's caching allocator keeps one pool per CUDA stream, and a block freed in one stream's
  pool is never handed to another stream. The engines allocate on their own streams what lives longest: FSDP2
  the all-gather outputs (its all-gather copy-in stream) and the reduce-scatter outputs, which *are* the sharded
  gradients (its reduce-scatter stream, ``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``,
  ``foreach_reduce``); DeepSpeed ZeRO-3 the gathered parameters (its all-gather stream). With expandable segments
  each pool grows to its own peak and keeps it, so the reserved peak is the sum of the pools' peaks
  (``side_pool_bytes`` at each point, the default stream's pool being the rest), each rounded to the segment
  granularity -- not the allocated peak rounded.

The predicted allocated peak is the maximum over the timeline of activations + engine bytes (and, for engines that
step on the GPU, the optimizer step's own point). The step time adds to memopt's single-GPU compute per
micro-batch the engine's collectives, host copies, CPU optimizer and fixed work (``memopt.distributed.timing``).

Byte facts of DeepSpeed 0.19.8 used (``deepspeed/runtime/zero/stage_1_and_2.py``): with ``offload_optimizer``
``__init__`` allocates ``temp_grad_buffer_for_gpu_offload`` of the largest parameter's numel in the 16-bit dtype on
the GPU (kept for the run); ``setup_buckets`` allocates one ``reduce_bucket_size`` buffer per gradient dtype, two
with ``overlap_comm``, at the start of each backward; parameters larger than the bucket bypass it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from memopt.distributed import memory as dmem
from memopt.distributed.sharding import ShardingSetting
from memopt.strategy import Strategy
from memopt.units import MiB

__all__ = [
    "ENGINE_PRECISION",
    "EngineRun",
    "ModelFacts",
    "TimelinePoint",
    "activation_timeline",
    "compute_estimate",
    "engine_bytes_at",
    "facts_of_module",
    "facts_of_profile",
    "model_facts",
    "pooled_reserved",
    "predict_sharded",
    "sharded_time",
    "side_pool_bytes",
    "side_pool_growth",
    "timeline_grads",
]

#: the precision memopt's profile is traced in for the engines' compute (bf16 weights, no autocast)
ENGINE_PRECISION = "bf16_pure"
#: memopt's DeepSpeed bucket default (``memopt.distributed.sharding``'s 200 MB), in bf16 elements
MEMOPT_BUCKET_ELEMENTS = 100_000_000
#: the allocator's page: small-pool segments and the granularity the allocated figures are rounded to
PAGE = 2 * MiB
#: an expandable segment of the large pool grows in steps of this size (c10/cuda/CUDACachingAllocator.cpp)
LARGE_SEGMENT = 20 * MiB
#: DeepSpeed ZeRO-3's gradient-norm chunk (``_constant_buffered_norm2``'s buffer_size, elements, taken in float64)
DS_NORM_CHUNK = 250_000_000
#: DeepSpeed's parameter persistence threshold (``stage3_param_persistence_threshold`` default, elements)
PERSISTENCE_THRESHOLD = 100_000


# -- model facts --------------------------------------------------------------------------------------------
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
    from memopt.blocks import find_block_stacks

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
    from memopt.models import build_model

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


# -- the activation timeline --------------------------------------------------------------------------------
@dataclass(frozen=True)
class TimelinePoint:
    """The highest allocated activation bytes within one segment instance of a micro-batch's pass."""

    part: str  # "forward" or "backward"
    block: int | None  # block position (None: embeddings, head, loss)
    name: str
    base: int  # bytes allocated when the segment starts
    peak: int  # highest point within it (>= base)
    after_blocks: bool = False  # a non-block segment after the blocks of its pass (embedding backward)


def _fold(trace: Any, events: Sequence[tuple[int, int, int, int]], b: int, grads: str,
          inserted: Sequence[tuple[int, int]] = ()) -> tuple[int, int]:
    """(net, peak above start) of a segment's events at micro-batch ``b``; gradient allocations are
    ``"transient"`` (allocated and freed at once) or ``"skip"``."""
    from memopt.profile.tracker import ALLOC
    from memopt.units import allocator_size

    cur = peak = 0
    j = 0
    for pos, (kind, key, lo, hi) in enumerate(events):
        while j < len(inserted) and inserted[j][0] <= pos:
            cur -= inserted[j][1]
            j += 1
        if key in trace.persistent_keys:
            continue
        is_grad = key in trace.grad_keys
        if is_grad and grads == "skip":
            continue
        size = allocator_size(trace.size(lo, hi, b))
        if kind == ALLOC:
            cur += size
            peak = max(peak, cur)
            if is_grad:
                cur -= size
        else:
            cur -= size
    for _, size in inserted[j:]:
        cur -= size
    return cur, peak


def activation_timeline(profile: Any, strategy: Strategy, *, grads: str = "transient") -> list[TimelinePoint]:
    """One steady-state micro-batch of ``strategy`` (forward then backward), as segment instances with the
    activation bytes allocated at their start and their highest point; starts from the micro-batch's inputs.

    Uses the composition of ``memopt.estimate.compose`` (the traced model with the middle block repeated,
    per-block checkpointing modes); parameters, gradients kept across micro-batches and optimizer states are not
    included (the engine model adds them).
    """
    from memopt.estimate.compose import deferred_for, pass_layout, trace_index
    from memopt.estimate.estimator import input_size_bytes, step_plan
    from memopt.units import allocator_size

    if grads not in ("transient", "skip"):
        raise ValueError(f"grads must be 'transient' or 'skip', got {grads!r}")
    b = strategy.micro_batch_size
    sp = step_plan(profile, strategy)
    traces = {k: profile.variant(k, b) for k in sp.variants}
    layout = pass_layout(traces, sp.base, sp.block_modes, profile.full_block_counts)
    base_trace = traces[sp.base]
    level = sum(allocator_size(input_size_bytes(base_trace, b1, b2, b)) for b1, b2 in base_trace.input_sizes)
    out: list[TimelinePoint] = []
    folded: dict[tuple[Any, int], tuple[int, int]] = {}  # a block segment folds the same at every position
    for part, insts in (("forward", layout.forward), ("backward", layout.backward)):
        seen_block = False
        for inst in insts:
            trace = traces[inst.variant]
            idx = trace_index(trace)
            if inst.block is not None:
                if (inst.variant, inst.segment) not in folded:
                    folded[inst.variant, inst.segment] = _fold(trace, trace.segments[inst.segment].events, b, grads)
                net, peak = folded[inst.variant, inst.segment]
            else:
                inserted = []
                for pos, _s, _p, _role, _ai, lo, hi, mode, key in deferred_for(traces, layout, inst):
                    t = traces[mode]
                    if key in t.grad_keys and grads == "skip":
                        continue
                    inserted.append((pos, allocator_size(t.size(lo, hi, b))))
                net, peak = _fold(trace, idx.core[inst.segment], b, grads, inserted)
            name = trace.segments[inst.segment].name
            seen_block = seen_block or inst.block is not None
            out.append(TimelinePoint(part=part, block=inst.block[1] if inst.block else None, name=name,
                                     base=level, peak=level + peak,
                                     after_blocks=inst.block is None and seen_block))
            level += net
    return out


# -- the engine's bytes along the timeline ------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class EngineRun:
    """What an engine's bytes depend on besides the model: its setting, micro-batches per step, DeepSpeed's
    buckets (elements) and whether gradients are reduced while backward runs."""

    setting: ShardingSetting
    grad_accum: int = 1
    reduce_bucket: int = MEMOPT_BUCKET_ELEMENTS
    prefetch_bucket: int = MEMOPT_BUCKET_ELEMENTS
    overlap_comm: bool = True

    @classmethod
    def of(cls, setting: ShardingSetting, grad_accum: int = 1, *, deepspeed_defaults: bool = False) -> EngineRun:
        """The run as ``memopt.distributed.sharding.deepspeed_config`` configures it, or (``deepspeed_defaults``)
        with DeepSpeed 0.19.8's own buckets: reduce 5e8, ZeRO-3 prefetch 5e7, ``overlap_comm`` on at stage 3 only."""
        if deepspeed_defaults:
            return cls(setting=setting, grad_accum=grad_accum, reduce_bucket=dmem.DS_DEFAULT_REDUCE_BUCKET,
                       prefetch_bucket=dmem.DS_DEFAULT_PREFETCH_BUCKET, overlap_comm=setting.stage == 3)
        return cls(setting=setting, grad_accum=grad_accum)


def engine_bytes_at(run: EngineRun, facts: ModelFacts, point: TimelinePoint | None) -> dict[str, int]:
    """The engine's device bytes (model states and buffers) while ``point`` runs; ``None``: the optimizer step.

    Returns ``{"states": ..., "buffers": ...}`` in allocator bytes (per GPU).
    """
    s = run.setting
    w = s.shard_size
    p = facts.num_params
    rb, overlap = run.reduce_bucket, run.overlap_comm
    backward = point is not None and point.part == "backward"
    if s.engine == "ddp":  # replicated fp32 weights, gradients and Adam; DDP's buckets are views of the gradients
        return {"states": p * (4 + 4 + 8), "buffers": 0}
    if s.engine == "deepspeed" and s.stage in (1, 2):
        # the reduce buckets are allocated at the first gradient hook (DeepSpeed's setup_buckets), after the loss
        # backward's fp32 temporaries are gone: not at the head and loss backward (allocator history on the H200,
        # raw/session8_call2: no bucket among the live allocations at that peak)
        ipg = (2 if overlap else 1) * min(rb, p) * 2 if backward and not _loss_backward(point) else 0
        if s.offload_optimizer != "none":
            states = p * 2  # the bf16 parameters (flat buffer), whole on every rank at stage 1/2
            staging = facts.largest_param * 2  # temp_grad_buffer_for_gpu_offload (persistent)
            return {"states": states, "buffers": staging + ipg}
        sb = dmem.state_bytes("deepspeed", "bf16_autocast")
        states = sum(dmem.model_state_bytes(p, stage=s.stage, shard_size=w, sb=sb).values())
        return {"states": states, "buffers": ipg}
    if s.engine == "deepspeed":  # stage 3
        sb = dmem.state_bytes("deepspeed", "bf16_autocast")
        m = dmem.sharded_memory(p, engine="deepspeed", stage=3, world_size=s.world_size, sb=sb,
                                largest_module_params=facts.largest_module_params,
                                offload_optimizer=s.offload_optimizer, offload_params=s.offload_params,
                                bucket_elements=rb, overlap_comm=overlap)
        buf = m.detail["buffers"]
        persistent_small = facts.small_params * 2 if s.offload_params != "none" else 0
        if point is None:
            return {"states": m.model_states + persistent_small, "buffers": buf["step_grad"]}
        # at the head and loss backward only ZeRO-3's flat reduce bucket exists (one bucket of 16-bit elements):
        # its second, overlapping bucket comes with the first reduction. Measured on one H200 with the output
        # released before backward (raw/session8_call5, wrap/raw/session8/base_z3): 10.96 GB with memopt's 1e8
        # buckets (predicted 11.05), 9.52 GiB with DeepSpeed's 5e8 (9.51)
        buckets = min(rb, p) * 2 if _loss_backward(point) else (buf["buckets"] if backward else 0)
        return {"states": m.model_states + persistent_small, "buffers": _zero3_gathered(run, facts) + buckets}
    return _fsdp2_bytes_at(run, facts, point)


def _loss_backward(point: TimelinePoint | None) -> bool:
    """``point`` is the head and loss backward (the first segment of backward, before any block's)."""
    return point is not None and point.part == "backward" and point.block is None and not point.after_blocks


def _zero3_gathered(run: EngineRun, facts: ModelFacts) -> int:
    """ZeRO-3's gathered 16-bit parameters: the live bound plus the prefetch bucket, or the largest module."""
    live = min(dmem.DS_DEFAULT_MAX_LIVE + run.prefetch_bucket, facts.num_params)
    return max(live, facts.largest_module_params) * 2


#: FSDP2 with ``MixedPrecisionPolicy(bf16, fp32)``: bytes per element gathered (compute) and reduced
_C, _R = 2, 4
#: per shard element: the fp32 parameter and Adam's two states; the fp32 gradient
_PARAM_AND_OPTIM, _GRAD = 4 + 8, 4


def _fsdp2_bytes_at(run: EngineRun, facts: ModelFacts, point: TimelinePoint | None) -> dict[str, int]:
    s = run.setting
    w = s.shard_size
    shard = -(-facts.num_params // w)
    offload = s.offload_params == "cpu"
    states = 0 if offload else shard * (_PARAM_AND_OPTIM + _GRAD)
    if point is None:
        return {"states": states, "buffers": 0}
    units = list(facts.unit_params)
    if not offload and run.grad_accum == 1:
        # the train step clears gradients with zero_grad(set_to_none=True): with one micro-batch per step the fp32
        # sharded gradients exist only for the units backward has reduce-scattered (the blocks after ``point``'s;
        # the root's come last); with more, every micro-batch after the first has them all
        states = shard * _PARAM_AND_OPTIM + _GRAD * sum(-(-u // w) for u in _reduced_units(units, point))
    # a tied weight's gradient is an autograd temporary in the activation timeline (the head's grad_weight
    # waits for the embedding's): it is not counted again as the root's unsharded gradient
    root_grads = max(0, facts.root_params - facts.tied_params) * _C
    root = facts.root_params * _C  # the root is gathered from its forward to the end of backward
    if point.block is None:
        if point.part == "forward":
            return {"states": states, "buffers": root}
        if not point.after_blocks:  # head and loss backward: the last block's all-gather is prefetched (its output)
            return {"states": states, "buffers": root + root_grads + (units[-1] * _C if units else 0)}
        # embedding backward: block 0's reduce-scatter input may still be in flight
        return {"states": states, "buffers": root + root_grads + (units[0] * _R if units else 0)}
    u = _unit(units, point.block)
    # gathering a unit: the flat all-gather output (u*c) is held until the next unit's gather, besides the
    # unsharded parameters (u*c); with CPUOffloadPolicy the copy-in first brings each fp32 shard to the GPU
    # and casts it (u*4 + u*c, transient; torch/distributed/fsdp/_fully_shard/_fsdp_param.py all_gather_inputs)
    gathered = 2 * u * _C + _copy_in(u, offload)
    if point.part == "forward":
        return {"states": states, "buffers": root + gathered}
    k = point.block
    inflight = units[k + 1] * _R if k + 1 < len(units) else 0  # the previous unit's reduce-scatter on its stream
    return {"states": states, "buffers": root + root_grads + gathered + u * _C + u * _R + inflight}


def _unit(units: Sequence[int], block: int) -> int:
    return units[block] if block < len(units) else max(units)


def _copy_in(u: int, offload: bool) -> int:
    return u * (4 + _C) if offload else 0


def _reduced_units(units: Sequence[int], point: TimelinePoint) -> Sequence[int]:
    """The FSDP2 units whose gradients backward has reduce-scattered when ``point`` runs (one micro-batch)."""
    if point.part == "forward" or _loss_backward(point):
        return ()
    if point.block is None:  # embedding backward: every block is done
        return units
    return units[point.block + 1:]


def side_pool_bytes(run: EngineRun, facts: ModelFacts, point: TimelinePoint | None) -> dict[str, int]:
    """Of ``engine_bytes_at``'s bytes at ``point`` (``None``: the optimizer step), those in the allocator pools of
    the engine's own streams; everything else is in the default stream's pool.

    FSDP2: the reduce-scatter stream holds the sharded gradients (the reduce-scatter outputs *are* the gradients:
    all of them at the optimizer step; with accumulation, also the new output of the unit being reduced before it
    is added, at most the largest shard); over two or more ranks the all-gather copy-in stream holds the unit's
    flat all-gather output (and, with CPU offload, the shard's copy to the GPU and its cast), at the root's
    forward the root's (``side_pool_growth`` adds what the pools hold briefly beyond these). Measured on one H200
    with ``torch.cuda.memory._snapshot`` (FSDP2 on one GPU, Llama-3.2-3B):
    one side pool of 11.97 GiB (every fp32 gradient) at one micro-batch per step, 13.44 GiB at two (+ the root's
    1.47 GiB shard).
    """
    s = run.setting
    if s.engine == "deepspeed" and s.stage == 3:
        # the gathered 16-bit parameters are allocated on ZeRO-3's all-gather stream (what the timeline holds of
        # them; ``side_pool_growth`` adds how far the pool grows beyond it)
        return {"all_gather": _zero3_gathered(run, facts)} if point is not None else {}
    if s.engine != "fsdp2":  # DeepSpeed ZeRO-1/2's pools: side_pool_growth
        return {}
    w = s.shard_size
    units = list(facts.unit_params)
    offload = s.offload_params == "cpu"
    root_shard = -(-facts.root_params // w)
    grads = 0
    if not offload:
        every = point is None or run.grad_accum > 1
        reduced = units if every else _reduced_units(units, point)
        grads = _GRAD * (sum(-(-u // w) for u in reduced) + (root_shard if every else 0))
    gathered = 0
    if point is not None and s.world_size > 1:
        if point.block is None:
            if point.part == "forward":
                gathered = facts.root_params * _C
            elif not point.after_blocks and units:
                gathered = units[-1] * _C
        else:
            u = _unit(units, point.block)
            gathered = u * _C + _copy_in(u, offload)
    return {"all_gather": gathered, "reduce_scatter": grads}


def side_pool_growth(run: EngineRun, facts: ModelFacts) -> dict[str, int]:
    """What the engine's side pools hold beyond ``side_pool_bytes``' figures (not part of the allocated timeline):
    with FSDP2 gradient accumulation, a unit's new reduce-scatter output before it is added to the gradient, at
    most the largest shard (the root's, for a large vocabulary); over two or more ranks, FSDP2's all-gather pool's
    blocks in flight; DeepSpeed ZeRO-3's all-gather and reduce pools; DeepSpeed ZeRO-1/2's reduction pool."""
    s = run.setting
    if s.engine == "deepspeed" and s.stage == 3:
        return _zero3_pool_growth(run, facts)
    if s.engine == "deepspeed" and s.stage in (1, 2):
        # the reduction stream's pool: 4 x the largest parameter's 16-bit gradient (a parameter over the bucket
        # size is cloned and reduced on its own). Measured on one H200 with CPU offload: 2.12 GB for
        # Llama-3.2-1B (262.7M-element tied embedding, 4 x 0.525 GB), 1.09 GB for Qwen2.5-0.5B (4 x 0.272 GB);
        # raw/session8_call2. Not measured with every parameter under the bucket size.
        return {"reduce": 4 * facts.largest_param * 2}
    if s.engine != "fsdp2":
        return {}
    out: dict[str, int] = {}
    if s.world_size > 1 and facts.unit_params:
        # the all-gather stream runs ahead of compute: while the root's output waits for its copy-out, the current
        # and the prefetched block's outputs are allocated too. Measured on two H200s (Llama-3.2-3B, FSDP2, 4 x 1,
        # raw/session8_x2): all-gather pool 1.195 GB = the root's 0.788 GB + 2 blocks' 0.201 GB (1.189 GB)
        out["all_gather"] = 2 * max(facts.unit_params) * _C
    if s.offload_params != "cpu" and run.grad_accum > 1:
        w = s.shard_size
        out["reduce_scatter"] = _GRAD * max(-(-u // w) for u in (facts.root_params, *facts.unit_params))
    return out


def _zero3_pool_growth(run: EngineRun, facts: ModelFacts) -> dict[str, int]:
    """How far ZeRO-3's two side pools grow beyond the timeline's figures (none on the all-gather pool's timeline
    share, all of the reduce pool's). Measured with the allocator's history on one H200 (optimizer and parameters
    on the CPU, memopt's 1e8 buckets; benchmarks/sharding/raw/session9):

    * all-gather stream: the largest parameter (a tied embedding stays gathered from the head's forward to its own
      backward) plus the live bound and one prefetch bucket, at most the whole model: Llama-3.2-3B 2.952 GB
      (predicted 2.988), Llama-3.2-1B 2.472 GB (the whole model, 2.472); out of sample, Qwen2-1.5B 2.460 GB
      (2.667: its overshoot of the live bound was smaller than the bucket);
    * reduce stream, with the optimizer offloaded: at the accumulation boundary each gradient partition is copied
      to the GPU (16-bit) and its norm taken in float64 chunks of at most 250M elements
      (``_constant_buffered_norm2``): the largest partition x 2 B plus min(it, 250M) x 8 B: 2.788 GB measured
      (2.788 predicted), 2.525 GB (2.525) and, out of sample, 2.334 GB (2.334). Without offload the pool holds
      the bucket's reduce-scatter: ~1.5 buckets of 16-bit elements (not measured alone)."""
    live = dmem.DS_DEFAULT_MAX_LIVE + run.prefetch_bucket
    pool = min(facts.num_params, facts.largest_param + live) * 2
    out = {"all_gather": max(0, pool - _zero3_gathered(run, facts))}
    if run.setting.offload_optimizer != "none":
        part = -(-facts.largest_param // run.setting.shard_size)
        out["reduce"] = part * 2 + min(part, DS_NORM_CHUNK) * 8
    else:
        out["reduce"] = 3 * min(run.reduce_bucket, facts.num_params) * 2 // 2
    return out


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
    from memopt.estimate.estimator import step_plan
    from memopt.profile.tracker import ALLOC
    from memopt.units import allocator_size

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


def timeline_grads(setting: ShardingSetting) -> str:
    """How the activation timeline counts autograd's gradients under ``setting``'s engine (see the module doc)."""
    return "skip" if setting.engine == "fsdp2" else "transient"


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
    sb = dmem.state_bytes(s.engine if s.engine != "ddp" else "fsdp2", "bf16_autocast")
    sm = dmem.sharded_memory(facts.num_params, engine=s.engine, stage=s.stage, world_size=s.world_size, sb=sb,
                             nodes=s.nodes, replicate_size=s.replicate_size, offload_optimizer=s.offload_optimizer,
                             offload_params=s.offload_params)
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


def compute_estimate(profile: Any, strategy: Strategy, hw: Any) -> Any:
    """memopt's single-GPU estimate of ``strategy`` in the engines' precision: the compute ``sharded_time`` adds the
    engine's work to (the same for every engine at one micro-batch and checkpointing)."""
    import memopt

    return memopt.estimate(profile, strategy.replace(precision=ENGINE_PRECISION), hardware=hw, exact_reserved=False,
                           num_steps=2)


def sharded_time(profile: Any, strategy: Strategy, run: EngineRun, facts: ModelFacts, hw: Any,
                 compute: Any = None) -> Any:
    """The step's ``memopt.distributed.timing.ShardedTime``: memopt's single-GPU compute per micro-batch (forward,
    backward with recomputation; ``compute``: ``compute_estimate``'s result, when the caller has it) with the
    engine's collectives, host copies, CPU optimizer and fixed work."""
    from memopt.distributed.timing import sharded_step_time

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
                             param_tensors=facts.num_tensors)
