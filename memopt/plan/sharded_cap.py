"""A sharded candidate under the hard cap: when its uncapped reserved total passes the budget less the margin but its
allocated peak fits, the allocator (with expandable segments) frees its cache and retries instead of growing, so the
reserved bytes stay at the cap and each micro-batch pays a retry (:func:`under_cap`, with the retry's fitted costs).
:mod:`memopt.plan.sharded` predicts every candidate through :func:`capped_if_needed`; the prediction is a
``memopt.distributed.estimate.ShardedEstimate``, whose ``capped`` (a ``CapRetries``) says what the cap costs.
"""

from __future__ import annotations

from memopt.distributed.estimate import CapRetries, ShardedEstimate
from memopt.strategy import Strategy

__all__ = ["REMAP_BYTES_PER_S", "RETRY_FIXED_S", "capped_if_needed", "under_cap"]

#: an allocator retry at the cap: a synchronization and the cache's release (PyTorch's alloc_retry cost) ...
RETRY_FIXED_S = 5e-3
#: ... then the pools re-map what was released as they regrow. Fitted to two H200s (Llama-3.2-3B, FSDP2, 4 x 1,
#: 48 GiB, raw/session8_x2): about one retry a step, 0.080 s over the uncapped prediction, for 9.5 GB that the
#: uncapped pools hold beyond the allocated peak
REMAP_BYTES_PER_S = 1.0e11


def under_cap(pred: ShardedEstimate, limit: int, micro_batches: int) -> ShardedEstimate | None:
    """``pred`` run under the hard cap when its uncapped reserved total exceeds ``limit`` (budget less margin) but
    its allocated peak fits: with expandable segments the allocator frees its cache and retries instead of growing,
    so reserved stays at the cap (and the allocator overhead shrinks with it). Counts one retry per micro-batch,
    each re-mapping what the pools held beyond the allocated peak. ``None`` when even the allocated peak does not
    fit."""
    room = limit - pred.runtime_bytes
    allocated, reserved = pred.peak_allocated_bytes, pred.peak_reserved_bytes
    if allocated > room:
        return None
    retry_s = micro_batches * (RETRY_FIXED_S + max(0, reserved - allocated) / REMAP_BYTES_PER_S)
    return pred.replace(peak_reserved_bytes=room, capped=CapRetries(uncapped_reserved_bytes=reserved,
                                                                    retries_per_step=micro_batches, retry_s=retry_s))


def capped_if_needed(pred: ShardedEstimate, strategy: Strategy, budget_bytes: int, margin: int) -> ShardedEstimate:
    """``pred`` as it runs under the hard cap when its uncapped total passes the budget less the margin but its
    allocated peak fits (``under_cap``, with expandable segments); else ``pred`` unchanged."""
    if pred.total_bytes + margin > budget_bytes and strategy.expandable_segments:
        return under_cap(pred, budget_bytes - margin, strategy.grad_accum_steps) or pred
    return pred
