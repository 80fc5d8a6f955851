"""Quantized frozen base weights (bitsandbytes NF4/FP4 4-bit, LLM.int8 8-bit) and QLoRA: the settings, and the
bases the planner may try (``QUANT_BITS_LADDER``; the registry entry in :mod:`memopt.techniques.extras` offers
them, only under adapters).

==================== ========================================= ===========================================
setting              stored per weight of N x K values          the forward / backward pass
==================== ========================================= ===========================================
4-bit NF4, double q. N*K/2 bytes of codes + 1 byte per 64-value  the weight is dequantized (compute dtype)
                     block + fp32 per 256 blocks + a 256-entry   into a temporary for each GEMM (fused
                     code, a 16-entry code and an offset         kernel for very few rows); backward
                                                                 dequantizes again; no activation saved
4-bit, no double q.  N*K/2 + fp32 per 64-value block + code      same
8-bit (LLM.int8)     N*K int8 + fp32 per row                     input quantized per row, int8 GEMM (int32
                                                                 accumulator, fp16 result); the input is
                                                                 saved; backward dequantizes the weight
==================== ========================================= ===========================================

Quantized weights are frozen. Training the quantized model means training adapters on top (QLoRA:
4-bit base + LoRA + paged 8-bit AdamW for the adapters, :func:`qlora`). Both change the training method:
the planner proposes them only under the policy allowances ``"quantized_weights"`` and ``"adapters"``, and
the plan says so (:func:`method_change_note`).

Applying quantization to a model is :mod:`memopt.techniques.quantization_apply`; loading pretrained weights
quantized as they load, :mod:`memopt.techniques.quantized_load`; the storage, temporaries and time maths,
:mod:`memopt.techniques.quantized_bytes`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import torch

from memopt.strategy import Strategy
from memopt.techniques.adapters import AdapterSetting, ExtraSettings, setting_fields

__all__ = [
    "QUANT_BITS_LADDER",
    "QuantSetting",
    "extras_label",
    "extras_pins",
    "fidelity_needs",
    "method_change_note",
    "qlora",
    "with_extra",
]

QUANT_FIDELITY = "quantized_weights"  # the policy allowance quantization needs
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# the quantized bases the planner tries under adapters, highest fidelity first (8-bit LLM.int8, then 4-bit NF4 with
# double quantization); FP4 and other settings only when a strategy names them
QUANT_BITS_LADDER: tuple[int, ...] = (8, 4)


@dataclass(frozen=True, kw_only=True)
class QuantSetting:
    """Frozen base weights in ``bits`` bits. 4-bit: ``quant_type`` NF4 (or FP4) in blocks of ``blocksize``
    values, ``double_quant`` quantizing the block scales again; compute (dequantized) in ``compute_dtype``.
    8-bit: LLM.int8 without outlier decomposition (threshold 0: memory independent of the data)."""

    bits: Literal[4, 8] = 4
    double_quant: bool = True
    quant_type: Literal["nf4", "fp4"] = "nf4"
    compute_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    blocksize: int = 64

    def __post_init__(self) -> None:
        problems = []
        if self.bits not in (4, 8):
            problems.append(f"bits must be 4 or 8, got {self.bits!r}")
        if self.quant_type not in ("nf4", "fp4"):
            problems.append(f"quant_type must be 'nf4' or 'fp4', got {self.quant_type!r}")
        if self.compute_dtype not in _DTYPES:
            problems.append(f"compute_dtype must be one of {sorted(_DTYPES)}, got {self.compute_dtype!r}")
        if self.blocksize not in (32, 64, 128, 256, 512, 1024, 2048, 4096):
            problems.append(f"blocksize must be a power of two from 32 to 4096, got {self.blocksize!r}")
        if problems:
            raise ValueError("invalid quantization setting: " + "; ".join(problems))

    @property
    def torch_compute_dtype(self) -> torch.dtype:
        return _DTYPES[self.compute_dtype]

    @classmethod
    def parse(cls, value: Any) -> QuantSetting:
        """From a setting, a dict (``Strategy.extras`` after ``from_dict``), or a tuple of (key, value) pairs."""
        if isinstance(value, cls):
            return value
        return cls(**setting_fields(cls, value, "quantization"))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def as_extra(self) -> ExtraSettings:
        """The form ``Strategy.extras`` keeps ("quantization", this)."""
        return ExtraSettings(self.to_dict())

    def label(self) -> str:
        if self.bits == 8:
            return "int8"
        return f"{self.quant_type}{'+dq' if self.double_quant else ''}"


# --------------------------------------------------------------------------------------------------------
# strategy helpers
# --------------------------------------------------------------------------------------------------------

def with_extra(strategy: Strategy, name: str, setting: Any) -> Strategy:
    """``strategy`` with ``extras[name] = setting`` (None removes it), extras sorted by name. Quantization and
    adapter settings (objects or dicts) are validated and stored as read-only, hashable dicts."""
    extras = {k: v for k, v in strategy.extras if k != name}
    if setting is not None:
        if name == "quantization":
            setting = QuantSetting.parse(setting).as_extra()
        elif name == "adapters":
            setting = AdapterSetting.parse(setting).as_extra()
        extras[name] = setting
    return strategy.replace(extras=tuple(sorted(extras.items())))


def extras_label(strategy: Strategy) -> str:
    """A short label of the strategy's quantization and adapters ("" when none), for plan tables."""
    q, a = _settings(strategy)
    parts = ([a.label()] if a is not None else []) + ([q.label()] if q is not None else [])
    return " ".join(parts)


def qlora(strategy: Strategy | None = None, *, r: int = 16, alpha: int | None = None, bits: Literal[4, 8] = 4,
          kind: Literal["lora", "dora"] = "lora", optimizer: str = "paged_adamw8bit") -> Strategy:
    """QLoRA: 4-bit NF4 base with double quantization (bf16 compute), LoRA of rank ``r`` on every block linear,
    paged 8-bit AdamW for the adapters."""
    s = strategy or Strategy()
    s = with_extra(s, "quantization", QuantSetting(bits=bits))
    s = with_extra(s, "adapters", AdapterSetting(kind=kind, r=r, alpha=alpha if alpha is not None else 2 * r))
    return s.replace(optimizer=optimizer)


def _settings(strategy: Strategy) -> tuple[QuantSetting | None, AdapterSetting | None]:
    q, a = strategy.extra("quantization"), strategy.extra("adapters")
    return (QuantSetting.parse(q) if q is not None else None, AdapterSetting.parse(a) if a is not None else None)


def fidelity_needs(strategy: Strategy) -> set[str]:
    """The policy allowances the strategy's quantization and adapters need."""
    q, a = _settings(strategy)
    return ({QUANT_FIDELITY} if q is not None else set()) | ({"adapters"} if a is not None else set())


def method_change_note(strategy: Strategy) -> str | None:
    """A plain sentence for the plan when quantization or adapters change what training does, else None."""
    q, a = _settings(strategy)
    if q is None and a is None:
        return None
    parts = []
    if a is not None:
        what = "LoRA" if a.kind == "lora" else "DoRA (LoRA with a learned magnitude per output)"
        targets = "the linear layers of every block" if a.targets is None else f"{len(a.targets)} named layers"
        parts.append(f"only {what} adapters of rank {a.r} (alpha {a.alpha:g}) on {targets} are trained; "
                     "the base model is frozen, so the result is an adapter, not an updated model")
    if q is not None:
        if q.bits == 4:
            how = (f"4-bit {q.quant_type.upper()}" + (" with double-quantized scales" if q.double_quant else "")
                   + f", computed in {q.compute_dtype}")
            error = "about 9% output error per layer on random weights" if q.quant_type == "nf4" else \
                "about 12% output error per layer on random weights"
        else:
            how = "8-bit LLM.int8 (per-row int8 weights, int8 matmuls)"
            error = "about 1.5% output error on random weights"
        parts.append(f"the frozen base weights of the block linear layers are stored in {how}: lossy, the model "
                     f"computes with quantized weights ({error})")
        if a is None:
            parts.append("with no adapters the quantized layers do not train at all")
    return "Training method changed: " + "; ".join(parts) + "."


def extras_pins(strategy: Strategy) -> dict[str, int]:
    """Pins that keep the strategy's extras level in a re-plan (autotune, OOM recovery): switching the training
    method mid-run, or to win a timing, is not the planner's call."""
    q, a = _settings(strategy)
    return {"adapter_rank": a.r if a is not None else 0, "quant_bits": q.bits if q is not None else 0}
