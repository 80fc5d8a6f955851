"""What a profile records of one traced variant: its key (:class:`VariantKey`: precision group, checkpointing
mode, attention backend, chunked cross-entropy, activation offload and the model-transforming extras, read off a
strategy by :func:`variant_key`) and its trace (:class:`VariantTrace`, phases of :class:`Segment` events with bytes at
two micro-batches), with their JSON forms. The records are kept apart from the tracing itself
(:mod:`memopt.profile.trace`) because the estimator and the search read them without ever running a trace.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from memopt.profile.costs import PhaseCost
from memopt.strategy import Checkpointing, Strategy
from memopt.techniques.adapters import AdapterSetting
from memopt.techniques.quantization import QuantSetting, with_extra

__all__ = ["PRECISION_GROUP", "Segment", "VariantKey", "VariantTrace", "variant_key"]

PRECISION_GROUP = {"fp32": "fp32", "bf16_autocast": "amp", "fp16_autocast": "amp", "bf16_master": "bf16w",
                   "bf16_pure": "bf16w"}
_GROUP_PRECISION = {"fp32": "fp32", "amp": "bf16_autocast", "bf16w": "bf16_pure"}


@dataclass(frozen=True, order=True)
class VariantKey:
    precision: str  # "fp32" | "amp" | "bf16w"
    checkpointing: str  # "none" | "full" | "selective"
    attention: str = "auto"
    chunked_ce: int = 0
    activation_offload: bool = False
    ce_kernel: str = "memopt"  # the fused head's kernel (named in the label only when not memopt's)
    micro_batch: int | None = None  # None: traced at two sizes, linear in the micro-batch; else one exact size
    # the strategy's extras that transform the model, as canonical JSON of their settings ("" when absent)
    quantization: str = ""
    adapters: str = ""

    def label(self) -> str:
        mb = "" if self.micro_batch is None else f"/mb={self.micro_batch}"
        ce = "liger" if self.ce_kernel == "liger" else self.chunked_ce
        return (f"{self.precision}/ac={self.checkpointing}/attn={self.attention}/ce={ce}"
                f"/offload={int(self.activation_offload)}{self._extras_label()}{mb}")

    def _extras_label(self) -> str:
        out = ""
        if self.quantization:
            q = QuantSetting.parse(json.loads(self.quantization))
            out += f"/q={q.label()}" + (f",{q.compute_dtype},bs={q.blocksize}" if q.bits == 4 else "")
        if self.adapters:
            a = AdapterSetting.parse(json.loads(self.adapters))
            targets = "" if a.targets is None else f",targets={'+'.join(a.targets)}"
            out += f"/adapters={a.label()}{targets}" + (f",dropout={a.dropout:g}" if a.dropout else "")
        return out

    @property
    def has_extras(self) -> bool:
        return bool(self.quantization or self.adapters)

    @property
    def extras_id(self) -> str:
        """What of the key decides the trained parameters beyond the precision ("" without extras)."""
        return json.dumps({"quantization": self.quantization, "adapters": self.adapters}) if self.has_extras else ""

    def at(self, micro_batch: int | None) -> VariantKey:
        return dataclasses.replace(self, micro_batch=micro_batch)

    def strategy(self) -> Strategy:
        """A strategy that makes a trace of this variant (one micro-batch, every block in this mode)."""
        s = Strategy(precision=_GROUP_PRECISION[self.precision],
                     checkpointing=Checkpointing(mode=self.checkpointing),
                     attention=self.attention, chunked_ce=self.chunked_ce, ce_kernel=self.ce_kernel,
                     activation_offload=self.activation_offload, optimizer="sgd")
        if self.has_extras:
            if self.quantization:
                s = with_extra(s, "quantization", json.loads(self.quantization))
            if self.adapters:
                s = with_extra(s, "adapters", json.loads(self.adapters))
        return s


def _extra_json(strategy: Strategy, name: str) -> str:
    value = strategy.extra(name)
    if value is None:
        return ""
    if name == "quantization":
        return json.dumps(QuantSetting.parse(value).to_dict(), sort_keys=True)
    return json.dumps(AdapterSetting.parse(value).to_dict(), sort_keys=True)


def variant_key(strategy: Strategy, checkpointing: str | None = None) -> VariantKey:
    return VariantKey(precision=PRECISION_GROUP[strategy.precision],
                      checkpointing=checkpointing or strategy.checkpointing.mode,
                      attention=strategy.attention, chunked_ce=strategy.chunked_ce,
                      activation_offload=strategy.activation_offload,
                      ce_kernel=strategy.ce_kernel if strategy.chunked_ce else "memopt",
                      quantization=_extra_json(strategy, "quantization"), adapters=_extra_json(strategy, "adapters"))


@dataclass
class Segment:
    """One phase of a trace: its events (bytes at micro-batch 1 and 2) and costs."""

    name: str
    events: list[tuple[int, int, int, int]]  # (kind, key, bytes at the trace's lo and hi micro-batch)
    cost1: PhaseCost = field(default_factory=PhaseCost)
    cost2: PhaseCost = field(default_factory=PhaseCost)
    offload: tuple[int, int] = (0, 0)  # bytes activation offload copied to the host, at b=1 and b=2

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "events": self.events, "cost1": self.cost1.to_dict(),
                "cost2": self.cost2.to_dict(), "offload": list(self.offload)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Segment:
        return cls(name=d["name"], events=[tuple(e) for e in d["events"]], cost1=PhaseCost.from_dict(d["cost1"]),
                   cost2=PhaseCost.from_dict(d["cost2"]), offload=tuple(d.get("offload", (0, 0))))


@dataclass
class VariantTrace:
    """Forward and backward of one micro-batch of the truncated model, in this variant."""

    key: VariantKey
    segments: list[Segment]
    grad_keys: set[int]
    persistent_keys: set[int]
    input_bytes: tuple[int, int]  # the batch's bytes at b=1 and b=2 (requested, summed over tensors)
    input_sizes: list[tuple[int, int]]  # per input tensor
    attention_backends: list[str]
    traced_blocks: list[int]  # per stack: blocks kept in the trace
    lo: int = 1  # the micro-batch sizes the two columns of every event were traced at
    hi: int = 2
    min_b: int = 1  # the smallest micro-batch the trace holds for
    # variants with extras: the transformed truncated model's state, {"params": [[shape, dtype, trainable, stack,
    # unit], ...], "buffers": [[shape, dtype, stack, unit], ...]} in the model's order (stack -1: outside blocks)
    model_state: dict[str, Any] | None = None
    # which module and op made each allocation (memopt.profile.attribution.trace_record); None in old profiles
    attribution: dict[str, Any] | None = None
    # ops whose output size depends on values, traced at their largest (memopt.profile.data_dependent)
    bounded_ops: list[str] = field(default_factory=list)
    # floating values the step read (``loss.item()``) that the trace could not know, read as a stand-in
    value_reads: int = 0

    def size(self, lo_bytes: int, hi_bytes: int, b: int) -> int:
        """Requested bytes at micro-batch ``b`` (linear between/beyond the traced sizes)."""
        if self.hi == self.lo:
            return lo_bytes
        return lo_bytes + (b - self.lo) * (hi_bytes - lo_bytes) // (self.hi - self.lo)

    def covers(self, b: int) -> bool:
        return (self.lo == self.hi == b) or (self.hi > self.lo and b >= self.min_b)

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key.__dict__, "segments": [s.to_dict() for s in self.segments],
                "grad_keys": sorted(self.grad_keys), "persistent_keys": sorted(self.persistent_keys),
                "input_bytes": list(self.input_bytes), "input_sizes": [list(x) for x in self.input_sizes],
                "attention_backends": self.attention_backends, "traced_blocks": self.traced_blocks,
                "lo": self.lo, "hi": self.hi, "min_b": self.min_b, "model_state": self.model_state,
                "attribution": self.attribution, "bounded_ops": self.bounded_ops, "value_reads": self.value_reads}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VariantTrace:
        return cls(key=VariantKey(**d["key"]), segments=[Segment.from_dict(s) for s in d["segments"]],
                   grad_keys=set(d["grad_keys"]), persistent_keys=set(d["persistent_keys"]),
                   input_bytes=tuple(d["input_bytes"]), input_sizes=[tuple(x) for x in d["input_sizes"]],
                   attention_backends=list(d["attention_backends"]), traced_blocks=list(d["traced_blocks"]),
                   lo=d.get("lo", 1), hi=d.get("hi", 2), min_b=d.get("min_b", 1), model_state=d.get("model_state"),
                   attribution=d.get("attribution"), bounded_ops=list(d.get("bounded_ops", [])),
                   value_reads=int(d.get("value_reads", 0)))

