"""The techniques that ride in ``Strategy.extras`` (adapters, quantized base weights, sharding), as registry
entries: each owns one extras key, names and renders it in the dry run, writes its part of the strategy's label
and names the policy allowance its setting needs. The planner still chooses them as a ladder of extras values
(``memopt.techniques.quantization.planner_extras``, ``memopt.plan.sharded``), not through ``options``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from memopt.strategy import Strategy
from memopt.techniques.adapters import AdapterSetting
from memopt.techniques.quantization import QUANT_FIDELITY, QuantSetting
from memopt.techniques.sharding import ShardingSetting

__all__ = ["EXTRAS"]


class _Adapters:
    name = "adapters"
    title = "adapters (method change)"

    def render(self, value: Any, techniques: Mapping[str, Any]) -> str:
        try:
            return AdapterSetting.parse(value).label()
        except (ValueError, TypeError):
            return str(value)

    def label(self, strategy: Strategy) -> str | None:
        value = strategy.extra(self.name)
        return None if value is None else AdapterSetting.parse(value).label()

    def fidelity(self, value: Any) -> str:
        # a setting, or a pinned rank (0: full fine-tuning)
        return "adapters" if value else "exact"


class _Quantization:
    name = "quantization"
    title = "frozen base weights (method change)"

    def render(self, value: Any, techniques: Mapping[str, Any]) -> str:
        try:
            return QuantSetting.parse(value).label()
        except (ValueError, TypeError):
            return str(value)

    def label(self, strategy: Strategy) -> str | None:
        value = strategy.extra(self.name)
        return None if value is None else QuantSetting.parse(value).label()

    def fidelity(self, value: Any) -> str:
        # a setting, or pinned bits (0: an unquantized base)
        return QUANT_FIDELITY if value else "exact"


class _Sharding:
    name = "sharding"
    title = "sharding"

    def render(self, value: Any, techniques: Mapping[str, Any]) -> str:
        return str(value)  # the whole setting: the plan's notes and launch lines say what it means

    def label(self, strategy: Strategy) -> str | None:
        value = strategy.extra(self.name)
        return None if value is None else ShardingSetting.from_any(value).label()

    def fidelity(self, value: Any) -> str:
        return "exact"  # sharding and offloading model states change where they live, not what training computes


EXTRAS: tuple[_Adapters | _Quantization | _Sharding, ...] = (_Adapters(), _Quantization(), _Sharding())
