"""What the planner may do: fidelity (which changes to training semantics are allowed), pins, forbids
and the safety margin.

Fidelity is a set of allowances. The default allows exact techniques and bf16 autocast where the GPU
supports bf16, never more:

================== ===================================================================
allowance          what it admits
================== ===================================================================
exact              fp32; checkpointing, offload, attention kernels, chunked loss,
                   micro-batching, allocator settings, fused/foreach/plain AdamW, SGD
bf16_autocast      bf16 autocast over fp32 weights (default where the GPU has bf16)
mixed_precision    also fp16 autocast with loss scaling, bf16 weights + fp32 masters
8bit_optimizer     8-bit AdamW states (bitsandbytes, plain and paged; torchao)
lossy              pure bf16 (bf16 optimizer states), torchao's 4-bit AdamW states
adapters           train LoRA adapters on a frozen base instead of the whole model
quantized_weights  store the frozen base's block linears in 8-bit or 4-bit NF4 (with
                   adapters: QLoRA); needs ``adapters`` too
================== ===================================================================

Presets: "exact", "default", "mixed", "8bit", "lossy" (each includes the ones before it); "lora" is "8bit"
plus adapters, "qlora" is "lora" plus quantized weights.

Adapters and quantized weights change what training produces, so the planner climbs them as a ladder: it
uses them only when nothing of higher fidelity fits (full fine-tuning, then LoRA on the unquantized base,
then LoRA on an 8-bit base, then on a 4-bit base), and the plan says that the training method changed.
Pins choose a rung: ``adapter_rank`` (0: full fine-tuning; default rank 16 when adapters are used) and
``quant_bits`` (0: unquantized base, 4 or 8).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from memopt.strategy import ATTENTION_BACKENDS, CE_KERNELS, PRECISIONS
from memopt.techniques.adapters import DEFAULT_ADAPTER_RANK
from memopt.techniques.attention import SDPA_BACKENDS
from memopt.techniques.optimizers import OPTIMIZER_NAMES
from memopt.techniques.registry import BY_NAME, LEVELED
from memopt.units import GiB, MiB, parse_bytes

__all__ = ["ALLOWANCES", "DEFAULT_ADAPTER_RANK", "FIDELITY_PRESETS", "PINNABLE", "Policy", "attention_backends",
           "fidelity_of"]

ALLOWANCES = ("exact", "bf16_autocast", "mixed_precision", "8bit_optimizer", "lossy", "adapters",
              "quantized_weights")
_8BIT = ("exact", "bf16_autocast", "mixed_precision", "8bit_optimizer")
FIDELITY_PRESETS: dict[str, tuple[str, ...]] = {
    "exact": ("exact",),
    "default": ("exact", "bf16_autocast"),
    "mixed": ("exact", "bf16_autocast", "mixed_precision"),
    "8bit": _8BIT,
    "lossy": (*_8BIT, "lossy"),
    "lora": (*_8BIT, "adapters"),
    "qlora": (*_8BIT, "adapters", "quantized_weights"),
}

# pins that choose an extras technique's setting by one number (the rank, the bits): the leveled techniques' pins
_PIN_OWNERS = {t.pin: t.name for t in LEVELED}

PINNABLE = {
    "precision": PRECISIONS,
    "checkpointing": ("none", "full", "selective"),
    "checkpoint_blocks": None,  # an int
    "activation_offload": (True, False),
    "attention": ATTENTION_BACKENDS,
    "chunked_ce": None,  # an int >= 0
    "ce_kernel": CE_KERNELS,
    "optimizer": OPTIMIZER_NAMES,
    "micro_batch_size": None,  # an int >= 1
    "expandable_segments": (True, False),
    "adapter_rank": None,  # an int >= 0: LoRA rank, 0 = full fine-tuning (no adapters)
    "quant_bits": (0, 4, 8),  # frozen base in 4 or 8 bits; 0 = unquantized
    "offload": (True, False),  # model states on the host / NVMe where nothing fits on the GPUs (false: never)
}


def fidelity_of(field_name: str, value: Any) -> str:
    """The allowance a choice needs: its technique's fidelity class ("exact" for a pin no technique owns)."""
    technique = BY_NAME.get(_PIN_OWNERS.get(field_name, field_name))
    return "exact" if technique is None else technique.fidelity(value)


@dataclass(frozen=True)
class Policy:
    """The user's rules for the search. ``margin_bytes`` + ``margin_fraction`` x budget is kept free."""

    allow: frozenset[str] = frozenset(FIDELITY_PRESETS["default"])
    pins: dict[str, Any] = field(default_factory=dict)
    forbid: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    # The safety margin: what a prediction may miss by without an OOM. Measured errors on the H200 were
    # within 1% (allocated) and 1.3% (reserved) for most rows; 2% of the budget plus 256 MiB covers them.
    margin_fraction: float = 0.02
    margin_bytes: int = 256 * MiB
    max_micro_batch: int | None = None

    @classmethod
    def build(cls, *, fidelity: str | list[str] | tuple[str, ...] = "default", pins: dict[str, Any] | None = None,
              forbid: dict[str, Any] | None = None, margin: str | float | int | None = None,
              max_micro_batch: int | None = None) -> Policy:
        """Validate everything and report every problem at once (``ValueError``)."""
        problems: list[str] = []
        allow: set[str] = set()
        if isinstance(fidelity, str):
            names: list[Any] = [fidelity]
        elif isinstance(fidelity, (list, tuple, set, frozenset)) and all(isinstance(n, str) for n in fidelity):
            names = list(fidelity)
        else:
            names = []
            problems.append(f"fidelity must be a preset ({', '.join(FIDELITY_PRESETS)}) or a list of allowances "
                            f"({', '.join(ALLOWANCES)}), got {fidelity!r}")
        for name in names:
            if name in FIDELITY_PRESETS:
                allow.update(FIDELITY_PRESETS[name])
            elif name in ALLOWANCES:
                allow.add(name)
            else:
                problems.append(f"unknown fidelity {name!r}: use a preset ({', '.join(FIDELITY_PRESETS)}) "
                                f"or allowances ({', '.join(ALLOWANCES)})")
        allow.add("exact")
        pins = dict(pins or {})
        forbid_out: dict[str, tuple[Any, ...]] = {}
        for key, value in pins.items():
            problems.extend(_check_choice("pin", key, value))
        for key, values in (forbid or {}).items():
            vals = tuple(values) if isinstance(values, (list, tuple, set)) else (values,)
            for v in vals:
                problems.extend(_check_choice("forbid", key, v))
            forbid_out[key] = vals
        for key, value in pins.items():
            if key in forbid_out and value in forbid_out[key]:
                problems.append(f"{key}={value!r} is both pinned and forbidden; drop one of them")
            if ((key in ("precision", "optimizer", "quant_bits") and value in PINNABLE.get(key, ()))
                    or (key == "adapter_rank" and isinstance(value, int))) and fidelity_of(key, value) not in allow:
                problems.append(f"pinning {key}={value!r} needs fidelity allowance {fidelity_of(key, value)!r}, "
                                f"which the policy does not allow (allowed: {', '.join(sorted(allow))})")
        blocks, mode = pins.get("checkpoint_blocks"), pins.get("checkpointing")
        if isinstance(blocks, int) and not isinstance(blocks, bool) and blocks >= 1 and mode == "none":
            problems.append(f"pins checkpointing='none' and checkpoint_blocks={blocks} contradict: checkpointing "
                            f"none checkpoints no block; drop checkpoint_blocks, or pin checkpointing='full' to "
                            f"checkpoint {blocks} block(s) of each stack")
        if blocks == 0 and mode in ("full", "selective"):
            problems.append(f"pins checkpointing={mode!r} and checkpoint_blocks=0 contradict: pin "
                            "checkpointing='none' to checkpoint no block, or checkpoint_blocks >= 1")
        if "quantized_weights" in allow and "adapters" not in allow:
            problems.append("fidelity allowance 'quantized_weights' needs 'adapters' too: a quantized frozen base "
                            "trains nothing without adapters on it; use the preset 'qlora'")
        if pins.get("ce_kernel") == "liger" and pins.get("chunked_ce") == 0:
            problems.append("pins ce_kernel='liger' and chunked_ce=0 contradict: the kernel runs the fused loss that "
                            "chunked_ce=0 switches off; pin chunked_ce >= 1 or drop ce_kernel")
        if pins.get("quant_bits") in (4, 8) and pins.get("adapter_rank") == 0:
            problems.append("pins quant_bits and adapter_rank=0 contradict: a quantized base needs adapters; pin "
                            "an adapter_rank >= 1 or quant_bits=0")
        if pins.get("precision") == "fp16_autocast" and "grad_scaler" in {str(v) for v in forbid_out.get(
                "loss_scaling", ())}:
            problems.append("precision=fp16_autocast needs loss scaling, which is forbidden")
        if "loss_scaling" in forbid_out and pins.get("precision") == "fp16_autocast":
            problems.append("pinning precision=fp16_autocast contradicts forbidding loss_scaling: fp16 training "
                            "needs a gradient scaler; pin bf16_autocast instead")
        margin_fraction, margin_bytes = 0.02, 256 * MiB
        if margin is not None:
            if isinstance(margin, float) and 0 <= margin < 1:
                margin_fraction, margin_bytes = margin, 0
            elif isinstance(margin, str) and margin.strip().endswith("%"):
                try:
                    margin_fraction, margin_bytes = float(margin.strip()[:-1]) / 100, 0
                except ValueError:
                    problems.append(f"cannot read margin {margin!r}; write '3%' or a size such as '1GiB'")
            else:
                try:
                    margin_fraction, margin_bytes = 0.0, parse_bytes(margin, what="margin")
                except ValueError as exc:
                    problems.append(str(exc))
        if max_micro_batch is not None and (not isinstance(max_micro_batch, int) or max_micro_batch < 1):
            problems.append(f"max_micro_batch must be a positive integer, got {max_micro_batch!r}")
        if problems:
            raise ValueError("invalid policy:\n  - " + "\n  - ".join(problems))
        return cls(allow=frozenset(allow), pins=pins, forbid=forbid_out, margin_fraction=margin_fraction,
                   margin_bytes=margin_bytes, max_micro_batch=max_micro_batch)

    def margin(self, budget_bytes: int) -> int:
        return int(self.margin_bytes + self.margin_fraction * budget_bytes)

    def allows(self, field_name: str, value: Any) -> bool:
        if field_name in self.pins and self.pins[field_name] != value:
            return False
        if value in self.forbid.get(field_name, ()):
            return False
        if field_name in self.pins:
            return True  # a valid pin was checked against the fidelity when the policy was built
        return fidelity_of(field_name, value) in self.allow

    def relaxed(self, allowance: str) -> Policy:
        return dataclasses.replace(self, allow=self.allow | {allowance})

    def to_dict(self) -> dict[str, Any]:
        return {"allow": sorted(self.allow), "pins": self.pins, "forbid": {k: list(v) for k, v in self.forbid.items()},
                "margin_fraction": self.margin_fraction, "margin_bytes": self.margin_bytes,
                "max_micro_batch": self.max_micro_batch}


def attention_backends(policy: Policy) -> tuple[str, ...]:
    """The attention backends the search weighs. PyTorch's own choice ("auto"), a named backend only when pinned: on
    the GPUs modelled the other kernels allocate at least as much and run no faster than the one SDPA picks. Where
    the policy forbids "auto", SDPA's named backends it leaves are the choice instead (each restricts SDPA to one
    kernel), so a forbid narrows the search rather than emptying it."""
    if "attention" in policy.pins:
        return (policy.pins["attention"],)
    if policy.allows("attention", "auto"):
        return ("auto",)
    return tuple(b for b in SDPA_BACKENDS if policy.allows("attention", b))


def _check_choice(kind: str, key: str, value: Any) -> list[str]:
    if key == "loss_scaling":
        return []
    if key not in PINNABLE:
        return [f"cannot {kind} unknown choice {key!r}; choices: {', '.join(PINNABLE)}"]
    valid = PINNABLE[key]
    if valid is None:
        if not isinstance(value, int) or isinstance(value, bool) or value < (1 if key == "micro_batch_size" else 0):
            return [f"{kind} {key}={value!r}: expected a {'positive' if key == 'micro_batch_size' else 'non-negative'}"
                    " integer" + (" (0: full fine-tuning, no adapters)" if key == "adapter_rank" else "")]
        return []
    if value not in valid:
        return [f"{kind} {key}={value!r}: valid values are {', '.join(map(repr, valid))}"]
    return []


_ = GiB
