"""The activation timeline of one sharded micro-batch: the profile's composed pass as segment points.

``activation_timeline`` folds one steady-state micro-batch (forward, backward) over the profile's composed pass
(``memopt.estimate.compose``), in the engines' compute precision (``bf16_pure``: both engines run the blocks in
bf16 weights without autocast). Gradients are *transient* for DeepSpeed (autograd's gradient is copied into a
bucket and freed) and *left out* for FSDP2 (its unsharded gradients are buffers counted by the engine model):
``timeline_grads`` says which. It is kept apart from the engines' bytes (``memopt.distributed.engine_bytes``)
because it knows the profile and no engine; the sharded estimate (``memopt.distributed.estimate``) joins the two
at each point.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from memopt.estimate.compose import deferred_for, pass_layout, trace_index
from memopt.estimate.estimator import input_size_bytes, step_plan
from memopt.profile.tracker import ALLOC
from memopt.strategy import Strategy
from memopt.techniques.sharding import ShardingSetting
from memopt.units import allocator_size

__all__ = [
    "TimelinePoint",
    "activation_timeline",
    "timeline_grads",
]


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


def timeline_grads(setting: ShardingSetting) -> str:
    """How the activation timeline counts autograd's gradients under ``setting``'s engine (see the module doc)."""
    return "skip" if setting.engine == "fsdp2" else "transient"
