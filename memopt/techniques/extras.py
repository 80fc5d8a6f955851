"""The techniques that ride in ``Strategy.extras`` (adapters, quantized base weights, sharding), as registry
entries: each owns one extras key, names and renders it in the dry run, writes its part of the strategy's label
and names the policy allowance its setting needs; adapters and quantization change the model (``apply``).

Adapters and quantization are also the registry's ``LeveledTechnique``s (``LEVELED``): the planner searches them
as a ladder of fidelity levels, and :func:`extras_ladder` composes that ladder from what each entry says: the
values it offers (``levels``, highest fidelity first), the entry its values sit on (``under``: quantization only
under adapters, since a quantized frozen base with nothing to train trains nothing), the pin and forbid key naming
its value by one number (``adapter_rank``, ``quant_bits``), and how much memory a value saves (``saving``). Sharding
is not leveled: its entry (``SHARDING``) offers the engine settings for a number of GPUs (``options``) and names the
precision and optimizer every engine setting runs; ``memopt.plan.sharded`` plans over them, beside the search.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from memopt.strategy import Strategy
from memopt.techniques import adapters, quantization_apply
from memopt.techniques.adapters import ADAPTER_FIDELITY, DEFAULT_ADAPTER_RANK, AdapterSetting
from memopt.techniques.model_change import ModelChange, Undo
from memopt.techniques.protocol import SearchContext
from memopt.techniques.quantization import QUANT_BITS_LADDER, QUANT_FIDELITY, QuantSetting
from memopt.techniques.sharding import ENGINE_OPTIMIZER, PLAN_PRECISION, ShardingSetting, sharding_settings


class Policy(Protocol):
    """What the entries read of a ``memopt.plan.policy.Policy`` (the plan layer sits above the techniques, so they
    name only what they use of it)."""

    allow: frozenset[str] | set[str]
    pins: Mapping[str, Any]
    forbid: Mapping[str, tuple[Any, ...]]

    def allows(self, field_name: str, value: Any) -> bool: ...

__all__ = ["EXTRAS", "LEVELED", "SHARDING", "Level", "adapters_refusal", "extras_ladder"]


def adapters_refusal(model_class: str) -> str | None:
    """Why memopt's own adapters (and the quantized base under them) cannot go on a model of class ``model_class``
    (the profile's ``model_class``), None where they can: a peft model the user made trains what its peft
    config says, and a second set of adapters (or peft's unload of them) would change its layers under it."""
    if model_class.startswith(("PeftModel", "PeftMixedModel")):
        return (f"the model is a peft model already ({model_class}): memopt adds no adapters or quantization of "
                "its own to it, and trains what its peft config makes trainable")
    return None

# one rung of the ladder: the (extras key, setting) pairs of Strategy.extras, sorted by key
Level = tuple[tuple[str, Any], ...]


class _SettingExtra:
    """An extras technique whose value is a setting's serialized form (``AdapterSetting``, ``QuantSetting``)."""

    def __init__(self, name: str, title: str, setting: Any, needs: str,
                 apply: Callable[[ModelChange], Undo]) -> None:
        self.name, self.title, self.setting, self.needs = name, title, setting, needs
        self.apply = apply  # the technique module's change_model

    def render(self, value: Any, techniques: Mapping[str, Any]) -> str:
        try:
            return self.setting.parse(value).label()
        except (ValueError, TypeError):
            return str(value)

    def label(self, strategy: Strategy) -> str | None:
        value = strategy.extra(self.name)
        return None if value is None else self.setting.parse(value).label()

    def fidelity(self, value: Any) -> str:
        # a setting, or a pinned number (an adapter rank, quantization bits) where 0 means the technique is off
        return self.needs if value else "exact"


class _Adapters(_SettingExtra):
    pin = "adapter_rank"
    under = None
    package = "peft"

    def __init__(self) -> None:
        super().__init__("adapters", "adapters (method change)", AdapterSetting, ADAPTER_FIDELITY,
                         adapters.change_model)

    def installed(self, ctx: SearchContext) -> bool:
        return ctx.peft_available

    def levels(self, ctx: SearchContext, allow: frozenset[str], pinned: Any) -> list[Any]:
        # the pinned rank, else the default one: the planner does not choose among ranks
        if self.needs not in allow or not self.installed(ctx) or ctx.adapters_refusal is not None:
            return []
        r = pinned or DEFAULT_ADAPTER_RANK
        return [AdapterSetting(kind="lora", r=r, alpha=2 * r).as_extra()]

    def number(self, value: Any) -> int:
        return 0 if value is None else int(dict(value)["r"])

    def saving(self, value: Any) -> int:
        return 1


class _Quantization(_SettingExtra):
    pin = "quant_bits"
    under = "adapters"  # a quantized frozen base trains nothing in its linear layers without adapters on it
    package = "bitsandbytes"

    def __init__(self) -> None:
        super().__init__("quantization", "frozen base weights (method change)", QuantSetting, QUANT_FIDELITY,
                         quantization_apply.change_model)

    def installed(self, ctx: SearchContext) -> bool:
        return ctx.bnb_available

    def levels(self, ctx: SearchContext, allow: frozenset[str], pinned: Any) -> list[Any]:
        if self.needs not in allow or not self.installed(ctx):
            return []
        return [QuantSetting(bits=b).as_extra() for b in ((pinned,) if pinned else QUANT_BITS_LADDER)]

    def number(self, value: Any) -> int:
        return 0 if value is None else int(dict(value)["bits"])

    def saving(self, value: Any) -> int:
        return 3 if dict(value).get("bits", 4) == 4 else 2


class _Sharding:
    """How the model states are spread over GPUs and offloaded (``ShardingSetting``): the engine settings the sharded
    planner enumerates, and what every one of them runs (the strategy's ``precision`` and ``optimizer``)."""

    name = "sharding"
    title = "sharding"
    precision = PLAN_PRECISION  # the engines' bf16 mixed precision: the policy must allow it
    optimizer = ENGINE_OPTIMIZER

    def options(self, world_size: int, nodes: int, policy: Policy, *,
                nvme_path: str | None = None) -> list[ShardingSetting]:
        """The engine settings on ``world_size`` GPUs over ``nodes`` nodes (``sharding_settings``, in its order)
        that the policy's ``offload`` allowance admits; NVMe offload only with an ``nvme_path``."""
        return [s for s in sharding_settings(world_size, nodes, nvme_path=nvme_path)
                if policy.allows("offload", s.offloads)]

    def render(self, value: Any, techniques: Mapping[str, Any]) -> str:
        return str(value)  # the whole setting: the plan's notes and launch lines say what it means

    def label(self, strategy: Strategy) -> str | None:
        value = strategy.extra(self.name)
        return None if value is None else ShardingSetting.from_any(value).label()

    def fidelity(self, value: Any) -> str:
        return "exact"  # sharding and offloading model states change where they live, not what training computes


# in ladder order: each one's values are tried after the level they extend, before the next level of those before it
LEVELED: tuple[_Adapters | _Quantization, ...] = (_Adapters(), _Quantization())
SHARDING = _Sharding()
EXTRAS: tuple[_SettingExtra | _Sharding, ...] = (*LEVELED, SHARDING)


def extras_ladder(ctx: SearchContext, policy: Policy) -> list[Level]:
    """The ``Strategy.extras`` levels the policy admits, highest fidelity first: none (full fine-tuning), then each
    leveled technique's values on each level it may extend (LoRA, LoRA on an 8-bit base, LoRA on a 4-bit NF4
    base). A nonzero pin grants its technique's allowance (and that of the technique it sits on), chooses its
    value and drops the levels without it; a pin of 0 drops the levels with it; forbids drop the levels whose
    number they name. Raises ``ValueError`` when the pins leave nothing (naming what is not installed)."""
    pins = {t.name: policy.pins.get(t.pin) for t in LEVELED}
    by_name = {t.name: t for t in LEVELED}
    allow = set(policy.allow)
    for t in LEVELED:
        if pins[t.name]:
            allow.add(t.needs)
            if t.under is not None:
                allow.add(by_name[t.under].needs)
    levels: list[Level] = [()]
    for t in LEVELED:
        values = t.levels(ctx, frozenset(allow), pins[t.name])
        grown: list[Level] = []
        for level in levels:
            grown.append(level)
            if t.under is None or t.under in dict(level):
                grown += [tuple(sorted((*level, (t.name, v)), key=lambda kv: kv[0])) for v in values]
        levels = grown

    def admitted(level: Level) -> bool:
        d = dict(level)
        return all((pins[t.name] is None or t.number(d.get(t.name)) == pins[t.name])
                   and t.number(d.get(t.name)) not in policy.forbid.get(t.pin, ()) for t in LEVELED)

    levels = [lv for lv in levels if admitted(lv)]
    if not levels:
        missing = [t.package for t in LEVELED if not t.installed(ctx)]
        pinned = ', '.join(f'{t.pin}={pins[t.name]!r}' for t in LEVELED)
        if ctx.adapters_refusal is not None and any(pins.values()):
            raise ValueError(f"the pins {pinned} cannot be honoured: {ctx.adapters_refusal}; drop them")
        raise ValueError(f"the pins {pinned} leave nothing to plan"
                         + (f": {' and '.join(missing)} not installed (pip install 'memopt[bnb]' peft)"
                            if missing else ""))
    return levels


def extras_saving(strategy: Strategy) -> int:
    """How much memory a strategy's extras level saves, by rank: 3 for a 4-bit base, 2 for 8-bit, 1 for adapters
    on an unquantized base, 0 for full fine-tuning."""
    return max((t.saving(v) for t in LEVELED if (v := strategy.extra(t.name)) is not None), default=0)
