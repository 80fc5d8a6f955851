"""GPU validation cases for sharding and offload (issue 5), and their per-GPU predictions made on the CPU.

A ``ShardedCase`` is plain data (JSON round trip) naming a model, a global batch, an engine setting
(DeepSpeed ZeRO-2/3 or FSDP2, CPU offload), checkpointing, a micro-batch and a hard per-GPU cap. The
GPU side (``memopt.validation.measure_sharded``) runs it; ``predict_case`` says what memopt expects.

Why a prediction lives here. memopt's single-GPU estimator (``memopt.estimate``) composes activations
from the profile but knows no sharding; ``memopt.distributed.memory`` knows the sharded model states
and engine buffers but no activations, and the planner does not join them yet. This module joins them
with the smallest addition that is correct at the peak's *time*, not just as a sum of separate peaks:

* the activation timeline: one steady-state micro-batch (forward, backward) folded over the profile's
  composed pass (``memopt.estimate.compose``), in the engine's compute precision (``bf16_pure``: both
  engines run the blocks in bf16 weights without autocast). Gradients are *transient* for DeepSpeed
  (autograd's gradient is copied into a bucket and freed) and *left out* for FSDP2 (its unsharded
  gradients are buffers counted by the engine model below);
* the engine's bytes at each point of that timeline (``engine_bytes_at``): DeepSpeed ZeRO-1/2: the bf16
  parameters, the gradient-offload staging buffer and the reduce buckets in backward; ZeRO-3:
  ``memopt.distributed.memory``'s sharded states and gathered-parameter bound; FSDP2: the root and the
  current unit gathered, the prefetched unit, and in backward the unit's unsharded gradients and
  reduce-scatter buffers (``fsdp2_buffer_bytes``' terms, per unit instead of at their maximum).

The predicted allocated peak is the maximum over the timeline of activations + engine bytes (and, for
engines that step on the GPU, the optimizer step's own point). Reserved is predicted as the allocated
peak rounded up to the allocator's 2 MiB pages (``expandable_segments``; an approximation for the
default allocator, which the hand-written baselines use).

Byte facts of DeepSpeed 0.19.8 used (``deepspeed/runtime/zero/stage_1_and_2.py``): with
``offload_optimizer`` ``__init__`` allocates ``temp_grad_buffer_for_gpu_offload`` of the largest
parameter's numel in the 16-bit dtype on the GPU (kept for the run); ``setup_buckets`` allocates one
``reduce_bucket_size`` buffer per gradient dtype, two with ``overlap_comm``, at the start of each
backward; parameters larger than the bucket bypass it.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from memopt.distributed import memory as dmem
from memopt.strategy import Checkpointing, Strategy
from memopt.units import GiB, MiB

__all__ = [
    "ENGINE_PRECISION",
    "ModelFacts",
    "ShardedCase",
    "TimelinePoint",
    "activation_timeline",
    "case_deepspeed_config",
    "choose_memopt_setting",
    "engine_bytes_at",
    "model_facts",
    "predict_case",
    "report_rows",
    "single_gpu_cases",
    "two_gpu_cases",
]

#: the precision memopt's profile is traced in for the engines' compute (bf16 weights, no autocast)
ENGINE_PRECISION = "bf16_pure"
#: memopt's DeepSpeed bucket default (memopt.distributed.sharding.DEFAULT_BUCKET_BYTES), in bf16 elements
MEMOPT_BUCKET_ELEMENTS = 100_000_000
#: the fraction of the cap memopt plans to (the rest: allocator rounding, NCCL/engine allocations not modelled)
PLAN_HEADROOM = 0.95
PAGE = 2 * MiB


@dataclass(frozen=True, kw_only=True)
class ShardedCase:
    """One measured configuration.

    ``role``: "memopt" (memopt chose checkpointing and micro-batch) or "baseline" (a hand-written
    configuration as users write it). ``ckpt_impl``: "memopt" (``apply_checkpointing`` on the blocks) or
    "hf" (``model.gradient_checkpointing_enable``). ``ds_defaults``: leave DeepSpeed's bucket, prefetch
    and overlap settings at their defaults (the baseline) instead of memopt's ``deepspeed_config``.
    ``micro_batch_candidates``: for a baseline, the micro-batches tried largest first, each in a fresh
    process, until one fits (``micro_batch`` is then the first candidate).
    """

    id: str
    model: str = "llama32_3b"
    engine: str = "deepspeed"  # "deepspeed" or "fsdp2"
    stage: int = 3
    offload_optimizer: str = "none"
    offload_params: str = "none"
    world_size: int = 1
    cap_bytes: int = 16 * GiB
    global_batch: int = 8
    seq_len: int = 2048
    micro_batch: int = 1
    checkpointing: Checkpointing = field(default_factory=lambda: Checkpointing(mode="full"))
    ckpt_impl: str = "memopt"
    expandable_segments: bool = True
    role: str = "memopt"
    ds_defaults: bool = False
    steps: int = 3
    hardware: str = "h200"
    micro_batch_candidates: tuple[int, ...] = ()
    fsdp_optimizer: str = "fused"  # torch AdamW on the CPU shards: "fused" or "foreach"
    compare_to: str = ""  # the baseline id a memopt case's speed is compared with

    def __post_init__(self) -> None:
        problems = []
        if self.engine not in ("deepspeed", "fsdp2"):
            problems.append(f"engine must be 'deepspeed' or 'fsdp2', got {self.engine!r}")
        if self.engine == "fsdp2" and self.stage != 3:
            problems.append("FSDP2 is stage 3")
        if self.global_batch % (self.world_size * self.micro_batch):
            problems.append(f"global batch {self.global_batch} is not a multiple of world_size x micro_batch "
                            f"({self.world_size} x {self.micro_batch})")
        if self.ckpt_impl not in ("memopt", "hf"):
            problems.append(f"ckpt_impl must be 'memopt' or 'hf', got {self.ckpt_impl!r}")
        if self.role not in ("memopt", "baseline"):
            problems.append(f"role must be 'memopt' or 'baseline', got {self.role!r}")
        if self.fsdp_optimizer not in ("fused", "foreach"):
            problems.append(f"fsdp_optimizer must be 'fused' or 'foreach', got {self.fsdp_optimizer!r}")
        if problems:
            raise ValueError(f"invalid case {self.id!r}: " + "; ".join(problems))
        self.setting()  # ShardingSetting's own checks

    @property
    def grad_accum(self) -> int:
        return self.global_batch // (self.world_size * self.micro_batch)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def setting(self) -> Any:
        from memopt.distributed.sharding import ShardingSetting

        return ShardingSetting(engine=self.engine, stage=self.stage, world_size=self.world_size,  # type: ignore[arg-type]
                               offload_optimizer=self.offload_optimizer,  # type: ignore[arg-type]
                               offload_params=self.offload_params,  # type: ignore[arg-type]
                               bucket_bytes=None)

    def strategy(self) -> Strategy:
        """The single-GPU strategy whose profile gives this case's activations (per rank)."""
        return Strategy(precision=ENGINE_PRECISION, checkpointing=self.checkpointing,
                        micro_batch_size=self.micro_batch, grad_accum_steps=self.grad_accum,
                        expandable_segments=self.expandable_segments)

    def replace(self, **changes: Any) -> ShardedCase:
        return dataclasses.replace(self, **changes)

    def label(self) -> str:
        return (f"{self.setting().label()} ac={self.checkpointing.label()} ({self.ckpt_impl}) "
                f"mb={self.micro_batch}x{self.grad_accum} cap={self.cap_bytes / GiB:g}GiB")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["checkpointing"] = dataclasses.asdict(self.checkpointing)
        d["micro_batch_candidates"] = list(self.micro_batch_candidates)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShardedCase:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown case keys {unknown}; valid keys: {sorted(known)}")
        d = dict(data)
        if isinstance(d.get("checkpointing"), dict):
            d["checkpointing"] = Checkpointing(**d["checkpointing"])
        d["micro_batch_candidates"] = tuple(d.get("micro_batch_candidates", ()))
        return cls(**d)


# -- model facts ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelFacts:
    """Parameter counts the engines' memory depends on (from the model built on the meta device)."""

    num_params: int  # unique parameters (a tied embedding/head counted once)
    unit_params: tuple[int, ...]  # per block (FSDP2 unit), forward order
    root_params: int  # everything outside the blocks
    largest_param: int  # numel of the largest parameter
    largest_module_params: int  # direct parameters of the largest module (DeepSpeed ZeRO-3 gathers per module)
    tied_params: int  # numel of parameters shared between modules (tied embedding and head)
    small_params: int  # parameters under DeepSpeed's persistence threshold (kept whole on every GPU)
    num_tensors: int = 0  # unique parameter tensors (the engines' fixed work per micro-batch scales with them)


@functools.lru_cache(maxsize=8)
def model_facts(model: str, persistence_threshold: int = 100_000) -> ModelFacts:
    from memopt.blocks import find_block_stacks
    from memopt.models import build_model

    m = build_model(model, device="meta")
    params = list(m.parameters())  # unique
    stacks = find_block_stacks(m)
    units = tuple(sum(p.numel() for p in b.parameters()) for s in stacks for b in s.blocks)
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


# -- the activation timeline ----------------------------------------------------------------------------
@dataclass(frozen=True)
class TimelinePoint:
    """The highest allocated activation bytes within one segment instance of a micro-batch's pass."""

    part: str  # "forward" or "backward"
    block: int | None  # block position (None: embeddings, head, loss)
    name: str
    base: int  # bytes allocated when the segment starts
    peak: int  # highest point within it (>= base)
    after_blocks: bool = False  # a non-block segment after the blocks of its pass (embedding backward)


@functools.lru_cache(maxsize=4)
def _profile(model: str, batch: int, seq_len: int, hardware: str) -> Any:
    import memopt

    return memopt.profile(model, sample={"batch_size": batch, "seq_len": seq_len}, hardware=hardware)


def _fold(trace: Any, idx: Any, events: Sequence[tuple[int, int, int, int]], b: int, grads: str,
          inserted: Sequence[tuple[int, int]] = ()) -> tuple[int, int]:
    """(net, peak above start) of a segment's events at micro-batch ``b``; gradient allocations are
    ``"transient"`` (allocated and freed at once) or ``"skip"``."""
    from memopt.profile.tracker import ALLOC, allocator_size

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


def activation_timeline(model: str, strategy: Strategy, *, seq_len: int, hardware: str = "h200",
                        grads: str = "transient", profile: Any = None) -> list[TimelinePoint]:
    """One steady-state micro-batch of ``strategy`` (forward then backward), as segment instances with the
    activation bytes allocated at their start and their highest point; starts from the micro-batch's inputs.

    Uses the composition of ``memopt.estimate.compose`` (the traced 4-block model with the middle block
    repeated, per-block checkpointing modes); parameters, gradients kept across micro-batches and
    optimizer states are not included (the engine model adds them).
    """
    from memopt.estimate.compose import _deferred_for, _index, pass_layout
    from memopt.estimate.estimator import _input_size, step_plan
    from memopt.profile.tracker import allocator_size

    if grads not in ("transient", "skip"):
        raise ValueError(f"grads must be 'transient' or 'skip', got {grads!r}")
    b = strategy.micro_batch_size
    prof = profile if profile is not None else _profile(model, b, seq_len, hardware)
    sp = step_plan(prof, strategy)
    traces = {k: prof.variant(k, b) for k in sp.variants}
    layout = pass_layout(traces, sp.base, sp.block_modes, prof.full_block_counts)
    base_trace = traces[sp.base]
    level = sum(allocator_size(_input_size(base_trace, b1, b2, b)) for b1, b2 in base_trace.input_sizes)
    out: list[TimelinePoint] = []
    for part, insts in (("forward", layout.forward), ("backward", layout.backward)):
        seen_block = False
        for inst in insts:
            trace = traces[inst.variant]
            idx = _index(trace)
            if inst.block is not None:
                net, peak = _fold(trace, idx, trace.segments[inst.segment].events, b, grads)
            else:
                inserted = []
                for pos, _s, _p, _role, _ai, lo, hi, mode, key in _deferred_for(traces, layout, inst):
                    t = traces[mode]
                    if key in t.grad_keys and grads == "skip":
                        continue
                    inserted.append((pos, allocator_size(t.size(lo, hi, b))))
                net, peak = _fold(trace, idx, idx.core[inst.segment], b, grads, inserted)
            name = trace.segments[inst.segment].name
            seen_block = seen_block or inst.block is not None
            out.append(TimelinePoint(part=part, block=inst.block[1] if inst.block else None, name=name,
                                     base=level, peak=level + peak,
                                     after_blocks=inst.block is None and seen_block))
            level += net
    return out


# -- the engines' bytes along the timeline -------------------------------------------------------------
def _bucket_elements(case: ShardedCase) -> tuple[int, int, bool]:
    """(reduce bucket, ZeRO-3 prefetch bucket, overlap_comm) in elements, as the generated config says."""
    if case.ds_defaults:
        # DeepSpeed 0.19.8 defaults: reduce_bucket_size 5e8, stage3_prefetch_bucket_size 5e7, overlap_comm
        # True at stage 3 (False at 1/2)
        return dmem.DS_DEFAULT_REDUCE_BUCKET, dmem.DS_DEFAULT_PREFETCH_BUCKET, case.stage == 3
    return MEMOPT_BUCKET_ELEMENTS, MEMOPT_BUCKET_ELEMENTS, True


def engine_bytes_at(case: ShardedCase, facts: ModelFacts, point: TimelinePoint | None) -> dict[str, int]:
    """The engine's device bytes (model states and buffers) while ``point`` runs; ``None``: the optimizer step.

    Returns ``{"states": ..., "buffers": ...}`` in allocator bytes (per GPU).
    """
    w = case.world_size
    p = facts.num_params
    shard = -(-p // w)
    rb, prefetch_b, overlap = _bucket_elements(case)
    backward = point is not None and point.part == "backward"
    if case.engine == "deepspeed" and case.stage in (1, 2):
        if case.offload_optimizer != "cpu":
            raise NotImplementedError("ZeRO-1/2 cases are modelled with offload_optimizer='cpu' only")
        states = p * 2  # the bf16 parameters (flat buffer), whole on every rank at stage 1/2
        staging = facts.largest_param * 2  # temp_grad_buffer_for_gpu_offload (persistent)
        ipg = (2 if overlap else 1) * min(rb, p) * 2 if backward else 0
        return {"states": states, "buffers": staging + ipg}
    if case.engine == "deepspeed":  # stage 3
        sb = dmem.state_bytes("deepspeed", "bf16_autocast")
        m = dmem.sharded_memory(p, engine="deepspeed", stage=3, world_size=w, sb=sb,
                                largest_module_params=facts.largest_module_params,
                                offload_optimizer=case.offload_optimizer, offload_params=case.offload_params,
                                bucket_elements=rb, overlap_comm=overlap)
        buf = m.detail["buffers"]
        persistent_small = facts.small_params * 2 if case.offload_params != "none" else 0
        if point is None:
            return {"states": m.model_states + persistent_small, "buffers": buf["step_grad"]}
        live = min(dmem.DS_DEFAULT_MAX_LIVE + prefetch_b, p)
        gathered = max(live, facts.largest_module_params) * 2
        return {"states": m.model_states + persistent_small,
                "buffers": gathered + (buf["buckets"] if backward else 0)}
    # FSDP2, MixedPrecisionPolicy(bf16, fp32): fp32 shards; CPUOffloadPolicy puts them on the host
    c, r = 2, 4
    param_and_optim, grad = 4 + 8, 4  # per shard element: fp32 parameter and Adam's two states; fp32 gradient
    offload = case.offload_params == "cpu"
    states = 0 if offload else shard * (param_and_optim + grad)
    if point is None:
        return {"states": states, "buffers": 0}
    units = list(facts.unit_params)
    if not offload and case.grad_accum == 1:
        # the train step clears gradients with zero_grad(set_to_none=True): with one micro-batch per step the fp32
        # sharded gradients (4 B per shard element) exist only for the units backward has reduce-scattered (the
        # blocks after ``point``'s; the root's come last); with more, every micro-batch after the first has them all
        states = shard * param_and_optim + grad * sum(-(-u // w) for u in _reduced_units(units, point))
    # a tied weight's gradient is an autograd temporary in the activation timeline (the head's grad_weight
    # waits for the embedding's): it is not counted again as the root's unsharded gradient
    root_grads = max(0, facts.root_params - facts.tied_params) * c
    root = facts.root_params * c  # the root is gathered from its forward to the end of backward
    if point.block is None:
        if point.part == "forward":
            return {"states": states, "buffers": root}
        if not point.after_blocks:  # head and loss backward: the last block's all-gather is prefetched (its output)
            return {"states": states, "buffers": root + root_grads + (units[-1] * c if units else 0)}
        # embedding backward: block 0's reduce-scatter input may still be in flight
        return {"states": states, "buffers": root + root_grads + (units[0] * r if units else 0)}
    k = point.block
    u = units[k] if k < len(units) else max(units)
    # gathering a unit: the flat all-gather output (u*c) is held until the next unit's gather, besides the
    # unsharded parameters (u*c); with CPUOffloadPolicy the copy-in first brings each fp32 shard to the GPU
    # and casts it (u*4 + u*c, transient; torch/distributed/fsdp/_fully_shard/_fsdp_param.py all_gather_inputs)
    copy_in = u * (4 + c) if offload else 0
    gathered = 2 * u * c + copy_in
    if point.part == "forward":
        return {"states": states, "buffers": root + gathered}
    inflight = units[k + 1] * r if k + 1 < len(units) else 0  # the previous unit's reduce-scatter on its stream
    return {"states": states, "buffers": root + root_grads + gathered + u * c + u * r + inflight}


def _reduced_units(units: Sequence[int], point: TimelinePoint) -> Sequence[int]:
    """The FSDP2 units whose gradients backward has reduce-scattered when ``point`` runs (one micro-batch)."""
    if point.part == "forward" or (point.block is None and not point.after_blocks):
        return ()
    if point.block is None:  # embedding backward: every block is done
        return units
    return units[point.block + 1:]


def _round_pages(n: int) -> int:
    return -(-n // PAGE) * PAGE


def predict_case(case: ShardedCase, *, with_time: bool = True, profile: Any = None) -> dict[str, Any]:
    """memopt's prediction for ``case`` (per GPU): allocated and reserved peaks, where, their parts, host RAM,
    bytes outside the allocator and (``with_time``) the step time."""
    from memopt.hardware import load_hardware

    facts = model_facts(case.model)
    strategy = case.strategy()
    grads = "skip" if case.engine == "fsdp2" else "transient"
    timeline = activation_timeline(case.model, strategy, seq_len=case.seq_len, hardware=case.hardware,
                                   grads=grads, profile=profile)
    best: dict[str, Any] = {"total": -1}
    for pt in timeline:
        eb = engine_bytes_at(case, facts, pt)
        total = pt.peak + eb["states"] + eb["buffers"]
        if total > best["total"]:
            best = {"total": total, "where": f"{pt.part}: {pt.name}" + (f" (block {pt.block})" if pt.block is not None
                                                                        else ""),
                    "activations": pt.peak, **eb}
    step = engine_bytes_at(case, facts, None)
    if step["states"] + step["buffers"] > best["total"]:
        best = {"total": step["states"] + step["buffers"], "where": "optimizer step", "activations": 0, **step}
    hw = load_hardware(case.hardware)
    sb = dmem.state_bytes(case.engine, "bf16_autocast")
    sm = dmem.sharded_memory(facts.num_params, engine=case.engine, stage=case.stage, world_size=case.world_size,
                             sb=sb, offload_optimizer=case.offload_optimizer, offload_params=case.offload_params)
    host = sm.host_bytes // max(1, case.world_size)  # per rank (one node)
    if case.engine == "deepspeed" and case.stage in (1, 2) and case.offload_optimizer == "cpu" and case.grad_accum > 1:
        host += facts.num_params * 2  # accumulated_grads_in_cpu: a 16-bit copy of every gradient (pinned)
    allocated = int(best["total"])
    out: dict[str, Any] = {
        "predicted_peak_allocated_bytes": allocated,
        "predicted_peak_reserved_bytes": _round_pages(allocated),
        "predicted_runtime_bytes": hw.runtime_overhead_bytes + dmem.nccl_bytes(case.world_size),
        "predicted_peak_at": best["where"],
        "predicted_parts": {"activations": int(best["activations"]), "model_states": int(best["states"]),
                            "engine_buffers": int(best["buffers"])},
        "predicted_host_bytes_per_rank": int(host),
        "predicted_fits_cap": _round_pages(allocated) <= case.cap_bytes,
        "num_params": facts.num_params,
    }
    if with_time:
        out["predicted_step_s"] = predict_step_time(case, facts)
    return out


def predict_step_time(case: ShardedCase, facts: ModelFacts | None = None) -> float:
    """Step time: memopt's single-GPU compute per micro-batch (forward, backward with recomputation), with the
    sharded engine's collectives, host copies, CPU optimizer and fixed work per micro-batch
    (``memopt.distributed.timing``)."""
    return float(predict_step_breakdown(case, facts).step_s)


def predict_step_breakdown(case: ShardedCase, facts: ModelFacts | None = None) -> Any:
    """``predict_step_time``'s ``memopt.distributed.timing.ShardedTime`` (the step and its terms)."""
    import memopt
    from memopt.distributed.timing import sharded_step_time
    from memopt.hardware import load_hardware

    facts = facts or model_facts(case.model)
    strategy = case.strategy()
    prof = _profile(case.model, case.micro_batch, case.seq_len, case.hardware)
    est = memopt.estimate(prof, strategy, exact_reserved=False, num_steps=2)
    m = case.grad_accum
    fwd = est.detail["forward_s"] / m
    bwd = est.detail["backward_s"] / m
    units = list(facts.unit_params)
    n = len(units) + 1
    hw = load_hardware(case.hardware)
    t = sharded_step_time(engine=case.engine, stage=case.stage, world_size=case.world_size, nodes=1, hw=hw,
                          unit_params=units, forward_s=[fwd / n] * len(units), backward_s=[bwd / n] * len(units),
                          optimizer_s=est.detail["optimizer_s"], compute_bytes=2,
                          param_bytes=4 if case.engine == "fsdp2" else 2, reduce_bytes=4 if case.engine == "fsdp2"
                          else 2, root_params=facts.root_params, root_forward_s=fwd / n, root_backward_s=bwd / n,
                          micro_batches=m, offload_optimizer=case.offload_optimizer,
                          offload_params=case.offload_params, param_tensors=facts.num_tensors)
    return t


# -- memopt's choice of checkpointing and micro-batch ----------------------------------------------------
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def choose_memopt_setting(case: ShardedCase, *, block_options: Sequence[int | None] | None = None,
                          headroom: float = PLAN_HEADROOM, max_timed: int | None = None
                          ) -> tuple[ShardedCase, dict[str, Any]]:
    """The fastest predicted (checkpointing, micro-batch) of ``case``'s engine setting that fits its cap.

    Candidates: every micro-batch dividing the per-rank batch; no checkpointing, or full checkpointing of
    ``block_options`` blocks (default: all, 3/4, 1/2, 1/4 of them). Memory (cheap) is predicted for all;
    the fitting candidates are timed (``max_timed``: only that many, those with the fewest recomputed blocks per
    micro-batch first). All by default: the engines' fixed costs per micro-batch can make fewer, larger
    micro-batches with more recomputation the faster choice (FSDP2 on two H200s: full checkpointing at 4 x 1 ran
    0.564 s/step, no checkpointing at 2 x 2 0.584 s), which a cut at the least recomputation never times.
    Raises ``ValueError`` (with the smallest predicted peak) when nothing fits.
    """
    facts = model_facts(case.model)
    n_blocks = len(facts.unit_params)
    if block_options is None:
        block_options = sorted({n_blocks, (3 * n_blocks) // 4, n_blocks // 2, n_blocks // 4, 0}, reverse=True)
    per_rank = case.global_batch // case.world_size
    fitting: list[tuple[ShardedCase, dict[str, Any]]] = []
    smallest: tuple[int, str] | None = None
    for mb in sorted(_divisors(per_rank), reverse=True):
        for nb in block_options:
            ck = Checkpointing(mode="none") if nb == 0 else Checkpointing(
                mode="full", num_blocks=None if nb == n_blocks else nb)
            cand = case.replace(micro_batch=mb, checkpointing=ck, ckpt_impl="memopt")
            pred = predict_case(cand, with_time=False)
            peak = pred["predicted_peak_reserved_bytes"]
            if smallest is None or peak < smallest[0]:
                smallest = (peak, cand.label())
            if peak <= headroom * case.cap_bytes:
                fitting.append((cand, pred))
    if not fitting:
        raise ValueError(f"case {case.id!r}: no micro-batch / checkpointing fits {headroom:.0%} of the "
                         f"{case.cap_bytes / GiB:g} GiB cap; the smallest predicted peak is "
                         f"{(smallest or (0, ''))[0] / GiB:.2f} GiB ({(smallest or (0, ''))[1]})")

    def recompute(c: ShardedCase) -> tuple[float, int]:
        nb = len(c.checkpointing.blocks(n_blocks))
        return (nb / n_blocks, -c.micro_batch)

    fitting.sort(key=lambda cp: recompute(cp[0]))
    timed = []
    for cand, pred in fitting[:max_timed] if max_timed is not None else fitting:
        pred["predicted_step_s"] = predict_step_time(cand, facts)
        timed.append((pred["predicted_step_s"], cand, pred))
    timed.sort(key=lambda t: t[0])
    _, cand, pred = timed[0]
    pred["considered"] = len(fitting)
    return cand, pred


# -- the cases ------------------------------------------------------------------------------------------
def single_gpu_cases(model: str = "llama32_3b", *, cap_bytes: int = 16 * GiB, global_batch: int = 8,
                     seq_len: int = 2048, steps: int = 3) -> list[ShardedCase]:
    """The one-H200 cases of issue 5 (world size 1): memopt's three offload settings and the two baselines.

    memopt's cases carry full checkpointing at micro-batch 1 as a placeholder: the script replaces them by
    ``choose_memopt_setting`` before running. Baselines: DeepSpeed ZeRO-3 + offload_optimizer + offload_param
    (pinned), bf16, DeepSpeed's default buckets, Hugging Face gradient checkpointing, the largest micro-batch
    that fits (tried largest first); FSDP2 ``fully_shard`` per block and root with
    ``MixedPrecisionPolicy(bf16, fp32)`` and ``CPUOffloadPolicy``, HF checkpointing, likewise.
    """
    common: dict[str, Any] = {"model": model, "cap_bytes": cap_bytes, "global_batch": global_batch,
                              "seq_len": seq_len, "steps": steps, "world_size": 1}
    mbs = tuple(sorted(_divisors(global_batch), reverse=True))
    hf_full = Checkpointing(mode="full")
    return [
        ShardedCase(id="memopt_zero2_offload_opt", engine="deepspeed", stage=2, offload_optimizer="cpu",
                    compare_to="baseline_zero3_offload", **common),
        ShardedCase(id="memopt_zero3_offload_all", engine="deepspeed", stage=3, offload_optimizer="cpu",
                    offload_params="cpu", compare_to="baseline_zero3_offload", **common),
        ShardedCase(id="memopt_fsdp2_offload", engine="fsdp2", stage=3, offload_optimizer="cpu",
                    offload_params="cpu", compare_to="baseline_fsdp2_offload", **common),
        ShardedCase(id="baseline_zero3_offload", engine="deepspeed", stage=3, offload_optimizer="cpu",
                    offload_params="cpu", role="baseline", ds_defaults=True, ckpt_impl="hf", checkpointing=hf_full,
                    expandable_segments=False, micro_batch=mbs[0], micro_batch_candidates=mbs, **common),
        ShardedCase(id="baseline_fsdp2_offload", engine="fsdp2", stage=3, offload_optimizer="cpu",
                    offload_params="cpu", role="baseline", ckpt_impl="hf", checkpointing=hf_full,
                    expandable_segments=False, micro_batch=mbs[0], micro_batch_candidates=mbs, **common),
    ]


def two_gpu_cases(model: str = "llama32_3b", *, cap_bytes: int = 48 * GiB, global_batch: int = 8,
                  seq_len: int = 2048, steps: int = 3) -> list[ShardedCase]:
    """Two H200s (``torchrun --nproc-per-node 2``): FSDP2 full shard and ZeRO-3 without offload, per-GPU cap,
    and the hand-written baselines of issue 5 at the same cap and global batch.

    llama32_3b's states are 16 B/param = 51 GB, 25.7 GB per GPU over two: a 48 GiB cap leaves room for
    activations and the gathered units; memopt chooses checkpointing and micro-batch as on one GPU. Baselines:
    FSDP2 ``fully_shard`` per block and root with ``MixedPrecisionPolicy(bf16, fp32)`` (the states fit, so no
    ``CPUOffloadPolicy``), and DeepSpeed ZeRO-3 with ``offload_optimizer`` and ``offload_param`` to pinned CPU
    memory and its default buckets; both with Hugging Face checkpointing and the largest micro-batch that fits.
    """
    common: dict[str, Any] = {"model": model, "cap_bytes": cap_bytes, "global_batch": global_batch,
                              "seq_len": seq_len, "steps": steps, "world_size": 2}
    mbs = tuple(sorted(_divisors(global_batch // 2), reverse=True))  # per rank
    hf_full = Checkpointing(mode="full")
    return [
        ShardedCase(id="memopt_fsdp2_x2", engine="fsdp2", stage=3, compare_to="baseline_fsdp2_x2", **common),
        ShardedCase(id="memopt_zero3_x2", engine="deepspeed", stage=3, compare_to="baseline_zero3_offload_x2",
                    **common),
        ShardedCase(id="baseline_fsdp2_x2", engine="fsdp2", stage=3, role="baseline", ckpt_impl="hf",
                    checkpointing=hf_full, expandable_segments=False, micro_batch=mbs[0], micro_batch_candidates=mbs,
                    **common),
        ShardedCase(id="baseline_zero3_offload_x2", engine="deepspeed", stage=3, offload_optimizer="cpu",
                    offload_params="cpu", role="baseline", ds_defaults=True, ckpt_impl="hf", checkpointing=hf_full,
                    expandable_segments=False, micro_batch=mbs[0], micro_batch_candidates=mbs, **common),
    ]


# -- DeepSpeed config of a case -------------------------------------------------------------------------
def case_deepspeed_config(case: ShardedCase) -> dict[str, Any]:
    """The DeepSpeed config dict the GPU run passes to ``deepspeed.initialize``.

    memopt's cases: ``memopt.distributed.sharding.deepspeed_config`` (the config ``memopt.wrap`` and
    ``export_deepspeed_json`` produce). Baselines: only what a user writes — the stage, bf16, the offload
    devices with ``pin_memory``, batch sizes and AdamW; buckets, prefetch and overlap stay DeepSpeed's.
    """
    if case.engine != "deepspeed":
        raise ValueError(f"case {case.id!r} runs FSDP2, not DeepSpeed")
    optimizer = {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0}}
    if not case.ds_defaults:
        from memopt.distributed.sharding import deepspeed_config

        cfg = deepspeed_config(case.setting(), precision="bf16_autocast", micro_batch=case.micro_batch,
                               grad_accum=case.grad_accum, optimizer=optimizer)
        return cfg
    zero: dict[str, Any] = {"stage": case.stage}
    if case.offload_optimizer == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if case.offload_params == "cpu":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {"train_micro_batch_size_per_gpu": case.micro_batch, "gradient_accumulation_steps": case.grad_accum,
            "train_batch_size": case.global_batch, "bf16": {"enabled": True}, "zero_optimization": zero,
            "optimizer": optimizer, "steps_per_print": 10**9, "wall_clock_breakdown": False}


# -- the report -----------------------------------------------------------------------------------------
def _rel(measured: float | None, predicted: float | None) -> float | None:
    if not measured or predicted is None:
        return None
    return (predicted - measured) / measured


def report_rows(rows: Sequence[dict[str, Any]], *, median_target: float = 0.03, max_target: float = 0.06
                ) -> dict[str, Any]:
    """Predicted vs measured per case (rank 0 and every rank), relative errors, OOMs, speed against baselines.

    A row is what ``measure_sharded.run_case`` writes (one per case and rank; for a baseline, the
    micro-batch that fitted). Errors are ``(predicted - measured) / measured`` of the peak allocated and
    reserved bytes; the summary takes rows that ran (``ok``) and fitted.
    """
    table: list[dict[str, Any]] = []
    for r in rows:
        case = r.get("case", {})
        entry = {"id": case.get("id", r.get("id", "?")), "rank": r.get("rank", 0), "role": case.get("role"),
                 "label": r.get("label", ""), "ok": bool(r.get("ok")), "oom": bool(r.get("oom")),
                 "fits_under_cap": r.get("fits_under_cap"), "cap_bytes": case.get("cap_bytes"),
                 "micro_batch": case.get("micro_batch"), "grad_accum": r.get("grad_accum"),
                 "predicted_peak_allocated_bytes": r.get("predicted_peak_allocated_bytes"),
                 "measured_peak_allocated_bytes": r.get("measured_peak_allocated_bytes"),
                 "predicted_peak_reserved_bytes": r.get("predicted_peak_reserved_bytes"),
                 "measured_peak_reserved_bytes": r.get("measured_peak_reserved_bytes"),
                 "measured_step_s": r.get("measured_step_s"), "predicted_step_s": r.get("predicted_step_s"),
                 "tokens_per_s": r.get("tokens_per_s"), "host_rss_peak_bytes": r.get("host_rss_peak_bytes"),
                 "predicted_host_bytes_per_rank": r.get("predicted_host_bytes_per_rank"),
                 "compare_to": case.get("compare_to") or None, "error": r.get("error")}
        entry["err_allocated"] = _rel(entry["measured_peak_allocated_bytes"], entry["predicted_peak_allocated_bytes"])
        entry["err_reserved"] = _rel(entry["measured_peak_reserved_bytes"], entry["predicted_peak_reserved_bytes"])
        table.append(entry)
    good = [e for e in table if e["ok"] and e["fits_under_cap"] and e["err_allocated"] is not None]
    ooms = [e["id"] for e in table if e["oom"] and e["role"] == "memopt"]

    def stats(key: str) -> dict[str, float | None]:
        vals = [abs(e[key]) for e in good if e[key] is not None]
        return {"median": statistics.median(vals) if vals else None, "max": max(vals) if vals else None,
                "n": len(vals)}

    speed = []
    by_id = {e["id"]: e for e in table if e["rank"] == 0}
    for e in table:
        base = by_id.get(e["compare_to"] or "")
        if e["rank"] == 0 and base and e.get("measured_step_s") and base.get("measured_step_s") and base["ok"] \
                and base["fits_under_cap"]:
            speed.append({"id": e["id"], "baseline": base["id"],
                          "speedup": base["measured_step_s"] / e["measured_step_s"]})
    alloc, res = stats("err_allocated"), stats("err_reserved")

    def within(s: dict[str, Any]) -> bool | None:
        if s["median"] is None:
            return None
        return bool(s["median"] <= median_target and s["max"] <= max_target)

    summary = {"allocated": alloc, "reserved": res, "targets": {"median": median_target, "max": max_target},
               "allocated_within_targets": within(alloc), "reserved_within_targets": within(res),
               "memopt_ooms_under_cap": ooms, "speed": speed,
               "speed_target_met": all(s["speedup"] >= 1.0 for s in speed) if speed else None}
    return {"rows": table, "summary": summary}


def _gib(v: Any) -> str:
    return "" if v is None else f"{v / GiB:.2f}"


def _pct(v: Any) -> str:
    return "" if v is None else f"{100 * v:+.1f}%"


def report_markdown(report: dict[str, Any], title: str = "Sharding and offload on the H200") -> str:
    """The report as Markdown tables (GiB = 2^30 bytes)."""
    lines = [f"# {title}", "", "Per GPU; errors are (predicted - measured) / measured. GiB = 2^30 bytes.", "",
             "| case | rank | setting | fits cap | pred alloc | meas alloc | err | pred res | meas res | err | "
             "step s | tokens/s | host RSS GiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for e in report["rows"]:
        fits = "error" if not e["ok"] else ("OOM" if e["oom"] or e["fits_under_cap"] is False else "yes")
        step = "" if e["measured_step_s"] is None else f"{e['measured_step_s']:.2f}"
        tps = "" if e["tokens_per_s"] is None else f"{e['tokens_per_s']:.0f}"
        lines.append(f"| {e['id']} | {e['rank']} | {e['label']} | {fits} | "
                     f"{_gib(e['predicted_peak_allocated_bytes'])} | {_gib(e['measured_peak_allocated_bytes'])} | "
                     f"{_pct(e['err_allocated'])} | {_gib(e['predicted_peak_reserved_bytes'])} | "
                     f"{_gib(e['measured_peak_reserved_bytes'])} | {_pct(e['err_reserved'])} | {step} | {tps} | "
                     f"{_gib(e['host_rss_peak_bytes'])} |")
    s = report["summary"]
    lines += ["", "## Summary", ""]
    for key in ("allocated", "reserved"):
        st = s[key]
        verdict = {True: "met", False: "not met", None: "no data"}[s[f"{key}_within_targets"]]
        lines.append(f"- peak {key}: median |error| {_pct(st['median'])}, max {_pct(st['max'])} over {st['n']} rows "
                     f"(targets {100 * s['targets']['median']:.0f}% / {100 * s['targets']['max']:.0f}%): {verdict}")
    lines.append(f"- memopt cases out of memory under the cap: {s['memopt_ooms_under_cap'] or 'none'}")
    for sp in s["speed"]:
        lines.append(f"- speed: {sp['id']} vs {sp['baseline']}: {sp['speedup']:.2f}x")
    errors = [e for e in report["rows"] if not e["ok"]]
    if errors:
        lines += ["", "## Errors", ""]
        lines += [f"- {e['id']} (rank {e['rank']}): {str(e['error'])[:300]}" for e in errors]
    return "\n".join(lines) + "\n"


