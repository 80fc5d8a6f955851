"""The sharding engine's device bytes at each point of the activation timeline, and which stream's pool holds them.

``engine_bytes_at`` gives the engine's bytes while a ``TimelinePoint`` runs: DeepSpeed ZeRO-1/2: the bf16
parameters, the optimizer's states (or, offloaded, the gradient-offload staging buffer) and the reduce buckets in
backward; ZeRO-3: ``memopt.distributed.memory``'s sharded states and gathered-parameter bound; FSDP2: the root and
the current unit gathered, the prefetched unit, and in backward the unit's unsharded gradients and reduce-scatter
buffers, per unit. ``side_pool_bytes`` and ``side_pool_growth`` say which of them the allocator keeps apart:
PyTorch's caching allocator keeps one pool per CUDA stream, and a block freed in one stream's pool is never handed
to another stream. The engines allocate on their own streams what lives longest: FSDP2 the all-gather outputs (its
all-gather copy-in stream) and the reduce-scatter outputs, which *are* the sharded gradients (its reduce-scatter
stream, ``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``, ``foreach_reduce``); DeepSpeed ZeRO-3 the
gathered parameters (its all-gather stream). Both are kept in one module because they read the same per-engine
layout of a step; the estimate (``memopt.distributed.estimate``) sums them with the activations.

Byte facts of DeepSpeed 0.19.8 used (``deepspeed/runtime/zero/stage_1_and_2.py``): with ``offload_optimizer``
``__init__`` allocates ``temp_grad_buffer_for_gpu_offload`` of the largest parameter's numel in the 16-bit dtype on
the GPU (kept for the run); ``setup_buckets`` allocates one ``reduce_bucket_size`` buffer per gradient dtype, two
with ``overlap_comm``, at the start of each backward; parameters larger than the bucket bypass it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from memopt.distributed.engine_buffers import DS_DEFAULT_MAX_LIVE, DS_DEFAULT_PREFETCH_BUCKET, DS_DEFAULT_REDUCE_BUCKET
from memopt.distributed.memory import sharded_memory
from memopt.distributed.model_states import model_state_bytes, state_bytes
from memopt.distributed.timeline import TimelinePoint
from memopt.profile.engine_facts import ModelFacts
from memopt.techniques.sharding import ShardingSetting

__all__ = [
    "EngineRun",
    "engine_bytes_at",
    "side_pool_bytes",
    "side_pool_growth",
]

#: memopt's DeepSpeed bucket default (``memopt.distributed.deepspeed_engine``'s 200 MB), in bf16 elements
MEMOPT_BUCKET_ELEMENTS = 100_000_000
#: DeepSpeed ZeRO-3's gradient-norm chunk (``_constant_buffered_norm2``'s buffer_size, elements, taken in float64)
DS_NORM_CHUNK = 250_000_000


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
        """The run as ``memopt.distributed.deepspeed_engine.deepspeed_config`` configures it, or
        (``deepspeed_defaults``) with DeepSpeed 0.19.8's own buckets: reduce 5e8, ZeRO-3 prefetch 5e7,
        ``overlap_comm`` on at stage 3 only."""
        if deepspeed_defaults:
            return cls(setting=setting, grad_accum=grad_accum, reduce_bucket=DS_DEFAULT_REDUCE_BUCKET,
                       prefetch_bucket=DS_DEFAULT_PREFETCH_BUCKET, overlap_comm=setting.stage == 3)
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
        sb = state_bytes("deepspeed", "bf16_autocast")
        states = sum(model_state_bytes(p, stage=s.stage, shard_size=w, sb=sb).values())
        return {"states": states, "buffers": ipg}
    if s.engine == "deepspeed":  # stage 3
        sb = state_bytes("deepspeed", "bf16_autocast")
        m = sharded_memory(p, engine="deepspeed", stage=3, world_size=s.world_size, sb=sb,
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
    live = min(DS_DEFAULT_MAX_LIVE + run.prefetch_bucket, facts.num_params)
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
    live = DS_DEFAULT_MAX_LIVE + run.prefetch_bucket
    pool = min(facts.num_params, facts.largest_param + live) * 2
    out = {"all_gather": max(0, pool - _zero3_gathered(run, facts))}
    if run.setting.offload_optimizer != "none":
        part = -(-facts.largest_param // run.setting.shard_size)
        out["reduce"] = part * 2 + min(part, DS_NORM_CHUNK) * 8
    else:
        out["reduce"] = 3 * min(run.reduce_bucket, facts.num_params) * 2 // 2
    return out
