"""The planner's view of techniques: one entry per technique, in the order the search and the label take them.

Each entry answers the protocol of ``memopt.techniques.protocol`` for one field of ``Strategy``: the values it may
take in a search context, a cheap lower bound on what a value adds to the step time (estimating a value exactly is
the profile's job: the value selects which trace the composition uses, or which optimizer is traced), how the dry
run names and renders it, its part of a strategy's label, and the policy allowance a value needs. A technique that
changes the model is a ``ModelTechnique``: its ``apply(change)`` (the technique module's ``change_model``) returns
the undo, and ``memopt.step.prepare`` calls them in one documented order (``APPLY_ORDER`` there); the others change
how the step runs, read from the strategy. The extras (adapters, quantization, sharding) have their entries in
``memopt.techniques.extras``, joined here in ``BY_NAME``. Adapters and quantization are ``LeveledTechnique``s
(``LEVELED``), searched as a ladder of ``Strategy.extras`` levels, highest fidelity first, that ``extras_ladder``
composes from them. ``memopt.plan.sharded`` draws from them too. Importing this module registers
``strategy_label`` as ``Strategy.label()``'s labeller.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from memopt.strategy import Checkpointing, Strategy, register_labeller
from memopt.techniques import attention, checkpointing, precision
from memopt.techniques.extras import EXTRAS, LEVELED, extras_ladder, extras_saving
from memopt.techniques.optimizers import USER, VARIANTS, optimizer_fidelity
from memopt.techniques.protocol import BaseTimes, ModelTechnique, SearchContext, SearchedTechnique, Technique

__all__ = ["BY_NAME", "LABEL_ORDER", "LEVELED", "TECHNIQUES", "extras_ladder", "extras_saving", "model_technique",
           "strategy_label"]


# what each precision needs
_PRECISION_NEEDS = {"fp32": "exact", "bf16_autocast": "bf16_autocast", "fp16_autocast": "mixed_precision",
                    "bf16_master": "mixed_precision", "bf16_pure": "lossy"}


def _on_off(value: Any, techniques: Mapping[str, Any]) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


class _Independent:
    """A technique whose every value goes with every choice of the others."""

    name: str
    off: Any
    adds_work = False

    def admits(self, strategy: Strategy, ctx: SearchContext) -> bool:
        return True

    def engaged(self, strategy: Strategy) -> int:
        return int(getattr(strategy, self.name) != self.off)

    def host_lower_bound(self, value: Any, base: BaseTimes) -> float:
        return 0.0


class _Precision(_Independent):
    name = "precision"
    title = "precision"
    off = "fp32"
    render = staticmethod(_on_off)
    apply = staticmethod(precision.change_model)

    def options(self, ctx: SearchContext) -> list[Any]:
        values = ["fp32", "fp16_autocast"]
        if ctx.supports_bf16:
            values += ["bf16_autocast", "bf16_master", "bf16_pure"]
        return values

    def time_lower_bound(self, value: Any, base: BaseTimes) -> float:
        return 0.0  # each precision group has its own base pass

    def label(self, strategy: Strategy) -> str | None:
        return strategy.precision

    def fidelity(self, value: Any) -> str:
        return _PRECISION_NEEDS[value]


class _Checkpointing(_Independent):
    name = "checkpointing"
    title = "activation checkpointing"
    off = Checkpointing()
    adds_work = True
    apply = staticmethod(checkpointing.change_model)
    coarse = staticmethod(checkpointing.coarse_options)  # the sharded planner's grid: it bisects from there

    def render(self, value: Any, techniques: Mapping[str, Any]) -> str:
        mode, blocks = value.get("mode", "none"), value.get("num_blocks")
        if mode == "none" or blocks == 0:
            return "none"
        return f"{mode}, every block" if blocks is None else f"{mode}, {blocks} blocks per stack"

    def options(self, ctx: SearchContext) -> list[Any]:
        total = max(ctx.block_counts, default=0)
        if total == 0:
            return [Checkpointing()]
        counts = sorted({max(1, round(total * f)) for f in (0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875)} - {total})
        return ([Checkpointing()] + [Checkpointing(mode="full", num_blocks=n) for n in counts]
                + [Checkpointing(mode="full"), Checkpointing(mode="selective")])

    @staticmethod
    def _share(value: Checkpointing, base: BaseTimes) -> float:
        """The fraction of the blocks ``value`` checkpoints."""
        total = max(1, base.extra.get("blocks", 1))
        return (value.num_blocks if value.num_blocks is not None else total) / total

    def time_lower_bound(self, value: Checkpointing, base: BaseTimes) -> float:
        if value.mode == "none":
            return 0.0
        share = self._share(value, base)
        if value.mode == "full":
            return base.block_forward_s * share
        return max(0.0, base.block_forward_s - base.block_forward_matmul_s) * share

    def host_lower_bound(self, value: Checkpointing, base: BaseTimes) -> float:
        # the recompute is not counted: non-reentrant checkpointing may stop it early
        if value.mode == "none":
            return 0.0
        ops = base.block_forward_ops * self._share(value, base)
        if value.mode == "full":
            return ops * base.host_op_s.get("ckpt", 0.0)
        return 2 * ops * base.host_op_s.get("sac", 0.0)

    def label(self, strategy: Strategy) -> str | None:
        return f"ac={strategy.checkpointing.label()}"

    def fidelity(self, value: Any) -> str:
        return "exact"


    def engaged(self, strategy: Strategy) -> int:
        return int(strategy.checkpointing.mode != "none")

class _Offload(_Independent):
    name = "activation_offload"
    title = "activation offload"
    off = False
    adds_work = True
    render = staticmethod(_on_off)

    def options(self, ctx: SearchContext) -> list[Any]:
        return [False, True]

    def time_lower_bound(self, value: bool, base: BaseTimes) -> float:
        # copies back to the GPU in backward are not overlapped: at least the saved bytes over the link
        return base.extra.get("offload_copy_s", 0.0) if value else 0.0

    def label(self, strategy: Strategy) -> str | None:
        return "act-offload" if strategy.activation_offload else None

    def fidelity(self, value: Any) -> str:
        return "exact"


class _Attention(_Independent):
    name = "attention"
    title = "attention kernel"
    off = "auto"
    render = staticmethod(_on_off)
    apply = staticmethod(attention.change_model)

    def options(self, ctx: SearchContext) -> list[Any]:
        values = list(ctx.attention_backends)
        if ctx.flash_attn_available and "flash_attn" not in values:
            values.append("flash_attn")
        return values

    def time_lower_bound(self, value: str, base: BaseTimes) -> float:
        return 0.0 if value == "auto" else -base.attention_s  # another kernel may at best remove attention time

    def label(self, strategy: Strategy) -> str | None:
        return None if strategy.attention == "auto" else f"attn={strategy.attention}"

    def fidelity(self, value: Any) -> str:
        return "exact"


class _ChunkedCE(_Independent):
    name = "chunked_ce"
    title = "chunked loss (linear + CE)"
    off = 0

    def render(self, value: Any, techniques: Mapping[str, Any]) -> str:
        return f"{value} chunks" if value else "off"

    def options(self, ctx: SearchContext) -> list[Any]:
        if not (ctx.causal_lm or ctx.liger_ce) or not ctx.vocab_size or ctx.vocab_size < 32_000:
            return [0]
        return [0, 8]

    def time_lower_bound(self, value: int, base: BaseTimes) -> float:
        return 0.0

    def label(self, strategy: Strategy) -> str | None:
        if not strategy.chunked_ce:
            return None
        return "chunked-ce=liger" if strategy.ce_kernel == "liger" else f"chunked-ce={strategy.chunked_ce}"

    def fidelity(self, value: Any) -> str:
        return "exact"


class _CEKernel:
    """Which kernel runs the fused head + loss: memopt's chunked loss, or Liger-kernel's fused linear
    cross-entropy (``memopt.techniques.liger_ce``: smaller chunks, one Triton pass per chunk, CUDA only)."""

    name = "ce_kernel"
    title = "fused loss kernel"
    off = "memopt"
    adds_work = False
    render = staticmethod(_on_off)

    def options(self, ctx: SearchContext) -> list[Any]:
        return ["memopt", "liger"] if ctx.liger_ce else ["memopt"]

    def admits(self, strategy: Strategy, ctx: SearchContext) -> bool:
        if strategy.ce_kernel == "liger":
            return strategy.chunked_ce > 0 and ctx.liger_ce
        return strategy.chunked_ce == 0 or ctx.causal_lm  # memopt's chunked loss where it is exact

    def time_lower_bound(self, value: str, base: BaseTimes) -> float:
        return 0.0

    def host_lower_bound(self, value: str, base: BaseTimes) -> float:
        return 0.0

    def label(self, strategy: Strategy) -> str | None:
        return None  # the chunked loss's part of the label names the kernel

    def fidelity(self, value: Any) -> str:
        return "exact"


    def engaged(self, strategy: Strategy) -> int:
        return 0  # a kernel of the chunked loss, which counts itself

class _Optimizer(_Independent):
    name = "optimizer"
    title = "optimizer"
    off = "adamw_fused"
    render = staticmethod(_on_off)

    def options(self, ctx: SearchContext) -> list[Any]:
        # what the planner chooses by itself: the variants it is offered, whose memory and time are validated on
        # a GPU (benchmarks/validation); the others train and are estimated, but only when pinned (or named)
        if ctx.user_optimizer:
            return [USER]
        refused = dict(ctx.optimizer_refusals)
        names: list[str] = []
        for v in VARIANTS.values():
            name = v.instead if v.name in refused else v.name
            if v.offered and ctx.has(v.requires) and name is not None and name not in refused and name not in names:
                names.append(name)
        return names

    def time_lower_bound(self, value: str, base: BaseTimes) -> float:
        return 0.0

    def label(self, strategy: Strategy) -> str | None:
        return strategy.optimizer

    def fidelity(self, value: Any) -> str:
        return optimizer_fidelity(value)


    def engaged(self, strategy: Strategy) -> int:
        return int(optimizer_fidelity(strategy.optimizer) != "exact")  # another exact variant is no technique

class _MicroBatch(_Independent):
    name = "micro_batch_size"
    title = "micro-batching"
    off = None

    def render(self, value: Any, techniques: Mapping[str, Any]) -> str:
        accum = techniques.get("grad_accum_steps", 1)
        return f"{value} x {accum} accumulation steps" if accum > 1 else f"{value} (no accumulation)"

    def options(self, ctx: SearchContext) -> list[Any]:
        if ctx.micro_batch_refusal:  # the whole batch at once; a pinned micro-batch is still the user's to choose
            return [ctx.global_batch]
        sizes = [b for b in range(1, ctx.global_batch + 1) if ctx.global_batch % b == 0]
        if ctx.max_micro_batch is not None:
            sizes = [b for b in sizes if b <= ctx.max_micro_batch]
        return sizes

    def time_lower_bound(self, value: int, base: BaseTimes) -> float:
        return 0.0

    def label(self, strategy: Strategy) -> str | None:
        return f"mb={strategy.micro_batch_size}x{strategy.grad_accum_steps}"

    def fidelity(self, value: Any) -> str:
        return "exact"


    def engaged(self, strategy: Strategy) -> int:
        return int(strategy.grad_accum_steps > 1)

class _Allocator(_Independent):
    name = "expandable_segments"
    title = "expandable segments"
    off = False  # the allocator's default, not memopt's
    render = staticmethod(_on_off)

    def options(self, ctx: SearchContext) -> list[Any]:
        return [True, False]

    def time_lower_bound(self, value: bool, base: BaseTimes) -> float:
        return 0.0

    def label(self, strategy: Strategy) -> str | None:
        return "expandable" if strategy.expandable_segments else "default-alloc"

    def fidelity(self, value: Any) -> str:
        return "exact"

    def engaged(self, strategy: Strategy) -> int:
        return 0  # an allocator setting, not a technique of the step


# the order the planner enumerates (and reports) them in
TECHNIQUES: tuple[SearchedTechnique, ...] = (_Precision(), _Checkpointing(), _Offload(), _Attention(), _ChunkedCE(),
                                             _CEKernel(), _Optimizer(), _MicroBatch(), _Allocator())
BY_NAME: dict[str, Technique] = {t.name: t for t in (*TECHNIQUES, *EXTRAS)}
# the order a strategy's label names them in: recorded plans and logs carry labels, so it stays as it is
LABEL_ORDER: tuple[str, ...] = ("precision", "checkpointing", "micro_batch_size", "optimizer", "activation_offload",
                                "attention", "chunked_ce", "ce_kernel", "expandable_segments", "adapters",
                                "quantization", "sharding")


def model_technique(name: str) -> ModelTechnique:
    """The registered technique ``name`` that changes the model; ValueError for one that does not."""
    technique = BY_NAME.get(name)
    if technique is None or not callable(getattr(technique, "apply", None)):
        raise ValueError(f"{name!r} is not a technique that changes the model; those are: "
                         f"{', '.join(n for n, t in BY_NAME.items() if callable(getattr(t, 'apply', None)))}")
    return technique  # type: ignore[return-value]


def strategy_label(strategy: Strategy) -> str:
    """Each technique's part of the label, in ``LABEL_ORDER``, space-separated (``Strategy.label()``)."""
    parts = (BY_NAME[name].label(strategy) for name in LABEL_ORDER)
    return " ".join(part for part in parts if part is not None)


register_labeller(strategy_label)
