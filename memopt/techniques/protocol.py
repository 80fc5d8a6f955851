"""The protocol every technique's registry entry answers, and the search context and base times it answers from.

A technique owns one field of ``Strategy`` (or one ``Strategy.extras`` key) and tells the planner (a) which values it
may take in a given search context (``SearchContext``), and (b) a cheap lower bound on what a value adds to the step
time over the plain pass (``BaseTimes``), so whole families of candidates can be ruled out before they are traced.
Every entry (``Technique``) names and renders its value for the dry run, writes its part of a strategy's label and
names the policy allowance a value needs; a ``SearchedTechnique`` is enumerated by the search; a ``ModelTechnique``
changes the model (``apply(change)`` returns the undo); a ``LeveledTechnique`` is searched as a ladder of fidelity
levels. These types sit apart from the entries (``memopt.techniques.registry``, ``memopt.techniques.extras``) so that
the entries, the planner and the search context's builder all read them without importing the registry itself.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from memopt.strategy import Strategy
from memopt.techniques.model_change import ModelChange, Undo

__all__ = ["BaseTimes", "LeveledTechnique", "ModelTechnique", "SearchContext", "SearchedTechnique", "Technique"]


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
    adapters_refusal: str | None = None  # why memopt's adapters cannot go on this model (None: they can)
    liger_ce: bool = False  # Liger's fused linear cross-entropy is installed, runs on the GPU and is exact here
    micro_batch_refusal: str | None = None  # why micro-batches would not be exact (the global batch only)
    # (optimizer, why it cannot step this model's trainable parameters): refused ones are never candidates
    optimizer_refusals: tuple[tuple[str, str], ...] = ()

    def has(self, package: str | None) -> bool:
        """Whether a technique needing ``package`` can be planned: bitsandbytes as ``bnb_available`` says (a plan
        made for another machine, or a test, sets it), any other package as installed here."""
        if package is None:
            return True
        if package == "bitsandbytes":
            return self.bnb_available
        return importlib.util.find_spec(package) is not None


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
    block_forward_ops: float = 0.0  # ops the blocks' forward issues, each dispatched by the host
    # host seconds per op of what a technique adds: "ckpt" (a fully checkpointed block's forward packs what it
    # saves through Python hooks), "sac" (selective checkpointing's dispatch mode, forward and recompute)
    host_op_s: Mapping[str, float] = field(default_factory=dict)


class Technique(Protocol):
    name: str  # the Strategy field (or Strategy.extras key) it owns
    title: str  # how the dry run's tables name it

    def render(self, value: Any, techniques: Mapping[str, Any]) -> str:
        """The value as the dry run's table shows it; ``techniques`` is the plan's serialized strategy, for a value
        that reads another field (the micro-batch reads the accumulation steps)."""
        ...

    def label(self, strategy: Strategy) -> str | None:
        """Its part of ``strategy.label()``, or None when the strategy's value is not worth naming."""
        ...

    def fidelity(self, value: Any) -> str:
        """The policy allowance (``memopt.plan.policy.ALLOWANCES``) a value needs; "exact" when it changes nothing."""
        ...


class ModelTechnique(Technique, Protocol):
    """A technique that changes the model itself (weights, kernels, modules), not only how the step runs."""

    def apply(self, change: ModelChange) -> Undo:
        """Apply the strategy's value to ``change.model`` in place; returns the undo (weights keep their values)."""
        ...


class SearchedTechnique(Technique, Protocol):
    """A technique whose values the search enumerates (``TECHNIQUES``)."""

    # the value without this technique, the plan's savings of a choice are measured against (None: no such value)
    off: Any
    # its values other than ``off`` run the same step with work added (a recompute, copies): a plan with one takes
    # at least the time of the same plan with ``off``, so an estimated twin bounds it
    adds_work: bool

    def options(self, ctx: SearchContext) -> list[Any]: ...

    def admits(self, strategy: Strategy, ctx: SearchContext) -> bool:
        """Whether its value makes sense with the strategy's other choices (a kernel of a technique left off
        does not); the search drops the combinations some technique does not admit."""
        ...

    def time_lower_bound(self, value: Any, base: BaseTimes) -> float:
        """GPU seconds this value adds to one micro-batch pass, at least (0 when it may add nothing)."""
        ...

    def host_lower_bound(self, value: Any, base: BaseTimes) -> float:
        """Host seconds this value adds to issuing one micro-batch pass, at least (a pass takes the longer of its
        GPU and host times: small models are bound by the host)."""
        ...

    def engaged(self, strategy: Strategy) -> int:
        """1 when the strategy switches this technique on, else 0: between plans the clock cannot tell apart the
        search prefers the one with fewer techniques on (``memopt.plan.search.complexity``)."""
        ...


class LeveledTechnique(Technique, Protocol):
    """An extras technique searched as fidelity levels (``LEVELED``, composed by ``extras_ladder``)."""

    needs: str  # the policy allowance its values need
    pin: str  # the pin and forbid key naming its value by one number, 0 for off ("adapter_rank", "quant_bits")
    under: str | None  # the leveled technique whose levels its values extend (None: the level without extras)
    package: str  # what must be installed to plan it; installed(ctx) says whether it is

    def installed(self, ctx: SearchContext) -> bool: ...
    # its values under the allowances and its pin (None: not pinned), highest fidelity first
    def levels(self, ctx: SearchContext, allow: frozenset[str], pinned: Any) -> list[Any]: ...

    def number(self, value: Any) -> int: ...  # what its pin and forbids name a value by (None, off: 0)

    def saving(self, value: Any) -> int: ...  # how much memory a value saves, ranked across the leveled techniques
