"""The techniques that ride in ``Strategy.extras`` (adapters, quantized base weights, sharding), as registry
entries: each owns one extras key, names and renders it in the dry run, writes its part of the strategy's label
and names the policy allowance its setting needs; adapters and quantization change the model (``apply``). The
planner still chooses them as a ladder of extras values (``memopt.techniques.quantization.planner_extras``,
``memopt.plan.sharded``), not through ``options``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from memopt.strategy import Strategy
from memopt.techniques import adapters, quantization_apply
from memopt.techniques.adapters import AdapterSetting
from memopt.techniques.model_change import ModelChange, Undo
from memopt.techniques.quantization import QUANT_FIDELITY, QuantSetting
from memopt.techniques.sharding import ShardingSetting

__all__ = ["EXTRAS"]


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


EXTRAS: tuple[_SettingExtra | _Sharding, ...] = (
    _SettingExtra("adapters", "adapters (method change)", AdapterSetting, "adapters", adapters.change_model),
    _SettingExtra("quantization", "frozen base weights (method change)", QuantSetting, QUANT_FIDELITY,
                  quantization_apply.change_model),
    _Sharding(),
)
