"""The planner's view of techniques: one small protocol, one entry per technique.

Each technique owns one field of ``Strategy`` and tells the planner (a) which values it may take in a
given search context, and (b) a cheap lower bound on what a value adds to the step time, so whole
families of candidates can be ruled out before they are traced. Estimating a value exactly is the
profile's job (the value selects which trace the composition uses, or which optimizer is traced);
applying it is the technique module's ``apply_*`` function, called by ``memopt.step.prepare`` in a
fixed order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from memopt.strategy import EIGHT_BIT_OPTIMIZERS, Checkpointing

__all__ = ["TECHNIQUES", "BaseTimes", "SearchContext", "Technique"]


@dataclass(frozen=True)
class SearchContext:
    """What the options depend on: the model, the hardware, the global batch, what is installed."""

    global_batch: int
    block_counts: tuple[int, ...]
    supports_bf16: bool
    causal_lm: bool
    vocab_size: int | None
    bnb_available: bool
    flash_attn_available: bool
    user_optimizer: bool
    attention_backends: tuple[str, ...] = ("auto",)
    max_micro_batch: int | None = None
    peft_available: bool = False  # adapters (memopt.techniques.adapters) can be planned


@dataclass(frozen=True)
class BaseTimes:
    """Seconds per micro-batch pass of the plain variant (no checkpointing, default kernels) at one size:
    the reference every lower bound starts from."""

    forward_s: float
    backward_s: float
    block_forward_s: float  # forward of all blocks (what full recomputation repeats)
    block_forward_matmul_s: float  # the matmul part of it (what selective recomputation keeps)
    attention_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


class Technique(Protocol):
    name: str  # the Strategy field it owns

    def options(self, ctx: SearchContext) -> list[Any]: ...

    def time_lower_bound(self, value: Any, base: BaseTimes) -> float:
        """Seconds this value adds to one micro-batch pass, at least (0 when it may add nothing)."""
        ...


class _Precision:
    name = "precision"

    def options(self, ctx: SearchContext) -> list[Any]:
        values = ["fp32", "fp16_autocast"]
        if ctx.supports_bf16:
            values += ["bf16_autocast", "bf16_master", "bf16_pure"]
        return values

    def time_lower_bound(self, value: Any, base: BaseTimes) -> float:
        return 0.0  # each precision group has its own base pass


class _Checkpointing:
    name = "checkpointing"

    def options(self, ctx: SearchContext) -> list[Any]:
        total = max(ctx.block_counts, default=0)
        if total == 0:
            return [Checkpointing()]
        counts = sorted({max(1, round(total * f)) for f in (0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875)} - {total})
        return ([Checkpointing()] + [Checkpointing(mode="full", num_blocks=n) for n in counts]
                + [Checkpointing(mode="full"), Checkpointing(mode="selective")])

    def time_lower_bound(self, value: Checkpointing, base: BaseTimes) -> float:
        total = max(1, base.extra.get("blocks", 1))
        if value.mode == "none":
            return 0.0
        share = (value.num_blocks if value.num_blocks is not None else total) / total
        if value.mode == "full":
            return base.block_forward_s * share
        return max(0.0, base.block_forward_s - base.block_forward_matmul_s) * share


class _Offload:
    name = "activation_offload"

    def options(self, ctx: SearchContext) -> list[Any]:
        return [False, True]

    def time_lower_bound(self, value: bool, base: BaseTimes) -> float:
        # copies back to the GPU in backward are not overlapped: at least the saved bytes over the link
        return base.extra.get("offload_copy_s", 0.0) if value else 0.0


class _Attention:
    name = "attention"

    def options(self, ctx: SearchContext) -> list[Any]:
        values = list(ctx.attention_backends)
        if ctx.flash_attn_available and "flash_attn" not in values:
            values.append("flash_attn")
        return values

    def time_lower_bound(self, value: str, base: BaseTimes) -> float:
        return 0.0 if value == "auto" else -base.attention_s  # another kernel may at best remove attention time


class _ChunkedCE:
    name = "chunked_ce"

    def options(self, ctx: SearchContext) -> list[Any]:
        if not ctx.causal_lm or not ctx.vocab_size or ctx.vocab_size < 32_000:
            return [0]
        return [0, 8]

    def time_lower_bound(self, value: int, base: BaseTimes) -> float:
        return 0.0


class _Optimizer:
    name = "optimizer"

    def options(self, ctx: SearchContext) -> list[Any]:
        # what the planner chooses by itself: the optimizers whose memory and time are validated on a GPU
        # (benchmarks/validation). adamw_foreach, adamw and sgd train and are estimated, but only when pinned
        # (or passed by the user): the foreach variant's temporaries are not GPU-validated yet.
        values = ["adamw_fused"]
        if ctx.bnb_available:
            values += list(EIGHT_BIT_OPTIMIZERS)
        if ctx.user_optimizer:
            values = ["user"]
        return values

    def time_lower_bound(self, value: str, base: BaseTimes) -> float:
        return 0.0


class _MicroBatch:
    name = "micro_batch_size"

    def options(self, ctx: SearchContext) -> list[Any]:
        sizes = [b for b in range(1, ctx.global_batch + 1) if ctx.global_batch % b == 0]
        if ctx.max_micro_batch is not None:
            sizes = [b for b in sizes if b <= ctx.max_micro_batch]
        return sizes

    def time_lower_bound(self, value: int, base: BaseTimes) -> float:
        return 0.0


class _Allocator:
    name = "expandable_segments"

    def options(self, ctx: SearchContext) -> list[Any]:
        return [True, False]

    def time_lower_bound(self, value: bool, base: BaseTimes) -> float:
        return 0.0


# the order the planner enumerates (and reports) them in
TECHNIQUES: tuple[Technique, ...] = (_Precision(), _Checkpointing(), _Offload(), _Attention(), _ChunkedCE(),
                                     _Optimizer(), _MicroBatch(), _Allocator())

_ = Callable
