"""Quantized frozen base weights (bitsandbytes NF4/FP4 4-bit, LLM.int8 8-bit), QLoRA, and loading
pretrained weights quantized as they load.

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

Targets are the linears inside the repeated blocks (:func:`quantization_targets`): the embeddings, the LM head
and the modules a model keeps in fp32 (T5's ``wo``) stay in full precision, as Hugging Face's bitsandbytes
loader leaves them.

A weight is quantized from its value cast to the compute dtype, so the dequantized weight (and bitsandbytes'
``quant_state.dtype``) is in the compute dtype: what Hugging Face's loader produces with
``torch_dtype=<compute dtype>``.

The pure functions at the end (storage bytes with block scales and double quantization, dequantization
temporaries, bytes moved and time) are the estimator's pieces; ``memopt.profile.quant_stand_ins`` holds the
fake-tensor stand-ins the profiler traces, with the bitsandbytes code paths they mirror.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from memopt.profile.tracker import allocator_size
from memopt.strategy import Strategy
from memopt.techniques.adapters import AdapterSetting, ExtraSettings, find_target_linears, setting_fields

__all__ = [
    "ADAPTER_RANK_OPTIONS",
    "QUANT_BITS_OPTIONS",
    "QuantSetting",
    "QuantizedBytes",
    "apply_qlora",
    "apply_quantization",
    "dequant_temporaries",
    "dequant_time_s",
    "dequant_traffic_bytes",
    "extras_label",
    "extras_pins",
    "fidelity_needs",
    "is_quantized",
    "load_peak_bytes",
    "load_quantized",
    "method_change_note",
    "model_skeleton",
    "planner_extras",
    "qlora",
    "quantization_targets",
    "quantized_storage_bytes",
    "quantized_weight_bytes",
    "with_extra",
]

QUANT_FIDELITY = "quantized_weights"  # the policy allowance quantization needs
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NESTED_BLOCKSIZE = 256
NESTED_CODE_BYTES = 256 * 4  # each layer's state2 keeps its own copy of the 256-entry fp32 dynamic code
CODE4_BYTES = 16 * 4  # each layer's 16-entry fp32 4-bit code (get_4bit_type, a fresh tensor per layer)
OFFSET_BYTES = 4  # the 0-dim fp32 mean of the block absmax values (double quantization)

# what the planner may choose (see planner_extras)
ADAPTER_RANK_OPTIONS: tuple[int, ...] = (8, 16, 64)
QUANT_BITS_OPTIONS: tuple[int, ...] = (4, 8)


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


def planner_extras(allow: Iterable[str], *, bnb_available: bool, peft_available: bool,
                   ranks: Sequence[int] = ADAPTER_RANK_OPTIONS,
                   bits: Sequence[int] = QUANT_BITS_OPTIONS) -> list[tuple[tuple[str, Any], ...]]:
    """The ``Strategy.extras`` values the planner may try under the allowances ``allow``.

    No extras; with "adapters" (and peft), LoRA of each rank in ``ranks`` (alpha = 2 r, dropout 0, targets
    found automatically); with "quantized_weights" too (and bitsandbytes), each of those over each base in
    ``bits`` (4: NF4 + double quantization, bf16 compute; 8: LLM.int8). Quantization alone is never proposed:
    a quantized frozen base trains nothing in its linear layers. DoRA and FP4 only when pinned."""
    allow = set(allow)
    out: list[tuple[tuple[str, Any], ...]] = [()]
    if "adapters" not in allow or not peft_available:
        return out
    for r in ranks:
        adapters = AdapterSetting(kind="lora", r=r, alpha=2 * r).as_extra()
        out.append((("adapters", adapters),))
        if QUANT_FIDELITY in allow and bnb_available:
            for b in bits:
                out.append((("adapters", adapters), ("quantization", QuantSetting(bits=b).as_extra())))
    return out


# --------------------------------------------------------------------------------------------------------
# applying
# --------------------------------------------------------------------------------------------------------

def _bnb() -> Any:
    try:
        import bitsandbytes as bnb
    except Exception as exc:  # pragma: no cover - depends on the environment
        raise ValueError("quantized weights need bitsandbytes: pip install 'memopt[bnb]'") from exc
    return bnb


def quantize_linear(linear: nn.Linear, setting: QuantSetting, *, weight: torch.Tensor | None = None,
                    device: torch.device | str | None = None) -> nn.Module:
    """A bitsandbytes layer holding ``linear``'s weight (or ``weight``) quantized on ``device`` (default: where
    the weight is). The bias parameter is shared with ``linear``."""
    bnb = _bnb()
    w = linear.weight if weight is None else weight
    device = torch.device(device) if device is not None else w.device
    if device.type == "meta" or w.device.type == "meta":
        raise ValueError("cannot quantize weights on the meta device: load them first (load_quantized), or use "
                         "fake=True to trace")
    with torch.no_grad():
        if setting.bits == 4:
            module = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=False,
                                       compute_dtype=setting.torch_compute_dtype,
                                       compress_statistics=setting.double_quant, quant_type=setting.quant_type,
                                       device="meta")
            source = w.detach().to(device=device, dtype=setting.torch_compute_dtype)
            param = bnb.nn.Params4bit(source, requires_grad=False, blocksize=setting.blocksize,
                                      compress_statistics=setting.double_quant, quant_type=setting.quant_type,
                                      module=module)
            module.weight = param._quantize(device)
        else:
            module = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=False, has_fp16_weights=False,
                                         threshold=0.0, device="meta")
            param = bnb.nn.Int8Params(w.detach(), requires_grad=False, has_fp16_weights=False)
            module.weight = param._quantize(device)
    module.bias = linear.bias
    # a new module starts in training mode; the replaced layer's mode must carry over, since bitsandbytes picks
    # its kernel by it (on CPUs with AVX512-BF16, eval + no_grad repacks the weight for a kernel that rounds
    # differently)
    module.train(linear.training)
    return module


def quantization_targets(model: nn.Module) -> list[str]:
    """The linears inside the blocks that get quantized: :func:`find_target_linears` minus the modules the model
    keeps in fp32 (Hugging Face's ``_keep_in_fp32_modules``, e.g. T5's ``wo``, which its loader never quantizes:
    the T5 feed-forward casts its input to ``wo``'s weight dtype)."""
    keep: set[str] = set()
    for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
        keep.update(getattr(model, attr, None) or ())
    return [n for n in find_target_linears(model) if not keep.intersection(n.split("."))]


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, module)


def _flag_name(setting: QuantSetting) -> str:
    return "is_loaded_in_4bit" if setting.bits == 4 else "is_loaded_in_8bit"


def _set_flag(model: nn.Module, setting: QuantSetting) -> Callable[[], None]:
    """peft picks its bitsandbytes LoRA layers when the model says it was loaded quantized."""
    name = _flag_name(setting)
    had = name in vars(model)
    before = vars(model).get(name)
    setattr(model, name, True)

    def undo() -> None:
        if had:
            setattr(model, name, before)
        elif name in vars(model):
            delattr(model, name)

    return undo


def is_quantized(model: nn.Module) -> bool:
    """Whether the model's linears are bitsandbytes-quantized already (``load_quantized``, Hugging Face's loader)."""
    return any(type(m).__name__ in ("Linear4bit", "Linear8bitLt", "FakeLinear4bit", "FakeLinear8bitLt")
               for m in model.modules())


def extras_pins(strategy: Strategy) -> dict[str, int]:
    """Pins that keep the strategy's extras level in a re-plan (autotune, OOM recovery): switching the training
    method mid-run, or to win a timing, is not the planner's call."""
    q, a = _settings(strategy)
    return {"adapter_rank": a.r if a is not None else 0, "quant_bits": q.bits if q is not None else 0}


def apply_quantization(model: nn.Module, setting: QuantSetting | dict[str, Any], *, fake: bool = False,
                       targets: Sequence[str] | None = None,
                       device: torch.device | str | None = None) -> Callable[[], None]:
    """Replace the target linears by frozen quantized layers (bitsandbytes; stand-ins when ``fake``).

    ``device``: where the quantized weights go (default: where each weight is). Quantizing a model still on
    the host straight onto the GPU, layer by layer, keeps its full-precision weights off the GPU.

    Returns the undo, which puts the original modules back with their weights bitwise unchanged. While the
    model is quantized the original weights are kept on the host (a weight on an accelerator is moved to CPU
    memory and back by the undo), so device memory holds only the quantized weights."""
    setting = QuantSetting.parse(setting)
    names = list(targets) if targets is not None else quantization_targets(model)
    if not names:
        raise ValueError("found no nn.Linear layers inside repeated blocks to quantize (GPT-2 style Conv1D "
                         "projections are not quantized by bitsandbytes)")
    if fake:
        from memopt.profile import quant_stand_ins

        if setting.bits == 4:
            cls = quant_stand_ins.FakeLinear4bit

            def make(linear: nn.Linear) -> nn.Module:
                return cls.from_linear(linear, compute_dtype=setting.torch_compute_dtype,
                                       double_quant=setting.double_quant, quant_type=setting.quant_type,
                                       blocksize=setting.blocksize)
        else:
            cls8 = quant_stand_ins.FakeLinear8bitLt

            def make(linear: nn.Linear) -> nn.Module:
                return cls8.from_linear(linear)
    else:
        def make(linear: nn.Linear) -> nn.Module:
            return quantize_linear(linear, setting, device=device)

    replaced: list[tuple[str, nn.Module, torch.device | None, torch.dtype | None]] = []
    try:
        for name in names:
            original = model.get_submodule(name)
            if not isinstance(original, nn.Linear):
                raise ValueError(f"quantization target {name!r} is a {type(original).__name__}, not an nn.Linear")
            new = make(original)
            bias_dtype = original.bias.dtype if original.bias is not None else None
            moved_from = None
            w = original.weight
            if not fake and w.device.type not in ("cpu", "meta"):
                moved_from = w.device
                w.data = w.data.to("cpu")
            _set_module(model, name, new)
            replaced.append((name, original, moved_from, bias_dtype))
    except Exception:
        for name, original, moved_from, _ in reversed(replaced):
            if moved_from is not None:
                original.weight.data = original.weight.data.to(moved_from)
            _set_module(model, name, original)
        raise
    unflag = _set_flag(model, setting)

    def undo() -> None:
        unflag()
        for name, original, moved_from, bias_dtype in reversed(replaced):
            if moved_from is not None:
                original.weight.data = original.weight.data.to(moved_from)
            if bias_dtype is not None and original.bias.dtype != bias_dtype:
                original.bias.data = original.bias.data.to(bias_dtype)  # bitsandbytes casts the bias in forward
            _set_module(model, name, original)

    return undo


def apply_qlora(model: nn.Module, quantization: QuantSetting | dict[str, Any] | None = None,
                adapters: AdapterSetting | dict[str, Any] | None = None, *, optimizer: str = "paged_adamw8bit",
                **optimizer_kwargs: Any) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    """QLoRA outside a strategy: quantize the block linears (default 4-bit NF4 + double quantization, bf16
    compute), put adapters on them (default LoRA r=16, alpha 32), and build the optimizer over the adapters
    (default paged 8-bit AdamW, ``memopt.techniques.optimizers.build_optimizer``).

    Returns (the peft model, the optimizer, undo); the undo removes the adapters, then the quantization."""
    from memopt.techniques.adapters import apply_adapters
    from memopt.techniques.optimizers import build_optimizer

    undo_quant = apply_quantization(model, quantization if quantization is not None else QuantSetting())
    try:
        peft_model, undo_adapters = apply_adapters(model, adapters if adapters is not None else AdapterSetting())
    except Exception:
        undo_quant()
        raise

    def undo() -> None:
        undo_adapters()
        undo_quant()

    try:
        opt = build_optimizer(optimizer, [p for p in model.parameters() if p.requires_grad], **optimizer_kwargs)
    except Exception:
        undo()
        raise
    return peft_model, opt, undo


# --------------------------------------------------------------------------------------------------------
# loading quantized
# --------------------------------------------------------------------------------------------------------

def model_skeleton(spec: Any) -> nn.Module:
    """The model of ``spec`` with parameters on meta and buffers real (non-persistent buffers such as rotary
    ``inv_freq`` are not in checkpoints): what ``load_quantized`` fills."""
    from accelerate import init_empty_weights

    from memopt.models import build_model

    with init_empty_weights(include_buffers=False):
        model = build_model(spec, device="cpu")
    # init_empty_weights re-registers every parameter, which unties tied ones (an LM head sharing the input
    # embedding): tie them again, or the head loads as a second copy -- found on the H200 as +544 MB on a
    # Qwen2.5-0.5B LoRA run whose plan (built with the tie) was right
    if callable(getattr(model, "tie_weights", None)):
        model.tie_weights()
    return model


def load_quantized(model: Any, checkpoint: str | Path | Sequence[str | Path], setting: QuantSetting | dict[str, Any],
                   device: torch.device | str, *, dtype: torch.dtype | None = None,
                   targets: Sequence[str] | None = None) -> nn.Module:
    """Build ``model`` from safetensors files layer by layer, the target linears quantized as they load.

    ``model``: a model spec (name, ``ModelSpec``, dict: built from config with parameters on meta) or a module
    whose parameters are on the meta device. Each target weight is read from the checkpoint (memory-mapped),
    cast to the compute dtype on ``device`` and quantized there, and dropped before the next one: device
    memory never holds more than the quantized model, the full-precision non-quantized parameters and one
    layer's weight. Other parameters and buffers are copied in ``dtype`` (default: the checkpoint's).
    Tied parameters stay tied. Raises ``ValueError`` naming anything the checkpoint lacks."""
    from safetensors import safe_open

    from memopt.profile.fake_model import tied_parameter_groups

    setting = QuantSetting.parse(setting)
    device = torch.device(device)
    if not isinstance(model, nn.Module):
        model = model_skeleton(model)
    paths = [checkpoint] if isinstance(checkpoint, (str, Path)) else list(checkpoint)
    names = list(targets) if targets is not None else quantization_targets(model)
    groups = {n: g for g in tied_parameter_groups(model) for n in g}
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(safe_open(str(p), framework="pt", device="cpu")) for p in paths]
        where = {key: f for f in files for key in f.keys()}  # noqa: SIM118 - safe_open is not a mapping

        def read(name: str) -> torch.Tensor | None:
            for alias in groups.get(name, [name]):
                if alias in where:
                    return where[alias].get_tensor(alias)
            return None

        missing: list[str] = []
        for name in names:
            linear = model.get_submodule(name)
            w = read(f"{name}.weight")
            if w is None:
                missing.append(f"{name}.weight")
                continue
            if tuple(w.shape) != (linear.out_features, linear.in_features):
                raise ValueError(f"{name}.weight has shape {tuple(w.shape)} in the checkpoint, the model expects "
                                 f"{(linear.out_features, linear.in_features)}")
            if linear.bias is not None:
                b = read(f"{name}.bias")
                if b is None:
                    missing.append(f"{name}.bias")
                    continue
                linear.bias = nn.Parameter(b.to(device=device, dtype=dtype or b.dtype, copy=True),
                                           requires_grad=linear.bias.requires_grad)
            if setting.bits == 4:
                source = w.to(device=device, dtype=setting.torch_compute_dtype)
            else:
                source = w.to(device=device)
            del w
            _set_module(model, name, quantize_linear(linear, setting, weight=source, device=device))
            del source
        done: dict[str, nn.Parameter] = {}
        for name, p in list(model.named_parameters(remove_duplicate=False)):  # every name of a tied tensor
            if p.device.type != "meta":
                continue
            owner_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_name) if owner_name else model
            first = next((done[a] for a in groups.get(name, []) if a in done), None)
            if first is None:
                t = read(name)
                if t is None:
                    missing.append(name)
                    continue
                first = nn.Parameter(t.to(device=device, dtype=dtype or t.dtype, copy=True),
                                     requires_grad=p.requires_grad)
            setattr(owner, attr, first)
            done[name] = first
        meta_buffers = []
        for name, b in list(model.named_buffers()):
            owner_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_name) if owner_name else model
            t = read(name) if b.device.type == "meta" else b
            if t is None:
                missing.append(name)
                meta_buffers.append(name)
                continue
            owner._buffers[attr] = t.to(device=device, copy=t is not b)
        if missing:
            hint = (" Buffers that checkpoints do not store (such as rotary inv_freq) must be real: pass the model "
                    "spec, or build the module under accelerate.init_empty_weights(include_buffers=False)."
                    if meta_buffers else "")
            raise ValueError(f"the checkpoint lacks {len(missing)} tensor(s) the model needs: {missing[:8]}.{hint}")
    if names:  # peft reads the flag to pick its bitsandbytes layers: only a quantized model carries it
        setattr(model, _flag_name(setting), True)
    return model


def load_peak_bytes(model: nn.Module, setting: QuantSetting | dict[str, Any] | None, *,
                    dtype: torch.dtype = torch.bfloat16, checkpoint_dtype: torch.dtype = torch.bfloat16,
                    targets: Sequence[str] | None = None) -> int:
    """Peak bytes allocated on the device while :func:`load_quantized` fills ``model`` (on meta or real: only
    shapes are read), allocator-rounded.

    The targets load first: the quantized weights so far, plus for the one being quantized its weight in the
    compute dtype (the checkpoint's when 8-bit) and the 4-bit quantizer's temporaries (the fp32 block absmax,
    and with double quantization the absmax minus its mean); then the other parameters and buffers, in
    ``dtype``. Without ``setting`` nothing is quantized: everything loads in ``dtype``."""
    r = allocator_size
    q = QuantSetting.parse(setting) if setting is not None else None
    names = (list(targets) if targets is not None else quantization_targets(model)) if q is not None else []
    seen: set[int] = set()
    quantized = transient = 0
    for name in names:
        linear = model.get_submodule(name)
        o, i = linear.out_features, linear.in_features
        assert q is not None
        seen.add(id(linear.weight))
        if linear.bias is not None:
            seen.add(id(linear.bias))
            quantized += r(linear.bias.numel() * torch.empty((), dtype=dtype).element_size())
        n = o * i
        if q.bits == 4:
            blocks = -(-n // q.blocksize)
            source = r(n * torch.empty((), dtype=q.torch_compute_dtype).element_size())
            temps = r(blocks * 4) * (2 if q.double_quant else 1)
        else:
            source = r(n * torch.empty((), dtype=checkpoint_dtype).element_size())
            temps = r(n)  # int8 codes before the row scales settle
        transient = max(transient, quantized + source + temps)
        quantized += quantized_weight_bytes(o, i, q).total
    rest = 0
    for p in model.parameters():  # each distinct tensor once (tied weights load once)
        if id(p) not in seen:
            seen.add(id(p))
            rest += r(p.numel() * torch.empty((), dtype=dtype if p.is_floating_point() else p.dtype).element_size())
    rest += sum(r(b.numel() * b.element_size()) for b in model.buffers())
    return max(transient, quantized + rest)


# --------------------------------------------------------------------------------------------------------
# estimator pieces
# --------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class QuantizedBytes:
    """Storage of quantized weights, by part (bytes; each tensor rounded like the CUDA allocator if asked)."""

    codes: int  # packed 4-bit codes, or int8 weights
    scales: int  # block absmax (fp32, or uint8 with double quantization), or 8-bit row scales
    nested: int  # double quantization: fp32 absmax per 256 blocks, the 256-entry code copy, the offset
    constants: int  # the 16-entry 4-bit code of each layer
    tensors: int  # number of allocations

    @property
    def total(self) -> int:
        return self.codes + self.scales + self.nested + self.constants


def quantized_weight_bytes(out_features: int, in_features: int, setting: QuantSetting, *,
                           rounded: bool = True) -> QuantizedBytes:
    """Bytes bitsandbytes stores for one quantized weight of ``out_features x in_features``.

    4-bit: (n + 1) // 2 code bytes; ceil(n / blocksize) blocks with an fp32 absmax each, or with double
    quantization a uint8 each plus fp32 per 256 blocks, a private 256-entry fp32 code and a 0-dim fp32 offset;
    a 16-entry fp32 code. 8-bit: n int8 + one fp32 scale per row."""
    r = allocator_size if rounded else (lambda n: n)
    n = out_features * in_features
    if setting.bits == 8:
        return QuantizedBytes(codes=r(n), scales=r(out_features * 4), nested=0, constants=0, tensors=2)
    blocks = -(-n // setting.blocksize)
    if setting.double_quant:
        nested_blocks = -(-blocks // NESTED_BLOCKSIZE)
        return QuantizedBytes(codes=r((n + 1) // 2), scales=r(blocks),
                              nested=r(nested_blocks * 4) + r(NESTED_CODE_BYTES) + r(OFFSET_BYTES),
                              constants=r(CODE4_BYTES), tensors=6)
    return QuantizedBytes(codes=r((n + 1) // 2), scales=r(blocks * 4), nested=0, constants=r(CODE4_BYTES), tensors=3)


def quantized_storage_bytes(shapes: Iterable[tuple[int, int]], setting: QuantSetting, *, rounded: bool = True) -> int:
    """Total storage of quantized weights of these (out_features, in_features) shapes."""
    return sum(quantized_weight_bytes(o, i, setting, rounded=rounded).total for o, i in shapes)


@dataclass(frozen=True)
class DequantTemporaries:
    """Bytes one quantized linear briefly holds beyond its inputs and outputs (allocator-rounded)."""

    forward: int
    backward: int


def dequant_temporaries(out_features: int, in_features: int, setting: QuantSetting, *, tokens: int,
                        input_dtype: torch.dtype = torch.float32, gpu: tuple[int, int, int] = (9, 0, 132)
                        ) -> DequantTemporaries:
    """Peak transient bytes of one quantized linear's forward and backward (bitsandbytes 0.50.2 on CUDA).

    4-bit forward (unfused GEMM: more than 1536 rows, or as the dispatch decides for the GPU ``gpu`` = (major,
    minor, SMs)): two fp32 absmax vectors (double quantization) + the weight in the compute dtype; fused: none.
    4-bit backward: one fp32 absmax vector (double quantization) + the weight in the compute dtype.
    8-bit forward: the larger of (fp16 input copy + int8 input + fp32 row scales) and (int8 input + row scales
    + int32 and fp16 results); 8-bit backward: the weight in the input dtype + the fp32 row-scale factor.
    Input casts to the compute dtype and output casts back are the layer's activations, not counted here."""
    from memopt.profile.quant_stand_ins import gemm_4bit_uses_fused_kernel

    r = allocator_size
    n = out_features * in_features
    if setting.bits == 4:
        cd = setting.torch_compute_dtype
        cb = torch.empty((), dtype=cd).element_size()
        blocks = -(-n // setting.blocksize)
        absmax = r(blocks * 4) if setting.double_quant else 0
        fused = gemm_4bit_uses_fused_kernel(tokens, out_features, in_features, cd, setting.blocksize,
                                            major=gpu[0], minor=gpu[1], num_sms=gpu[2])
        forward = 0 if fused else 2 * absmax + r(n * cb)
        return DequantTemporaries(forward=forward, backward=absmax + r(n * cb))
    ab = torch.empty((), dtype=input_dtype).element_size()
    m, k, o = tokens, in_features, out_features
    quant = r(m * k) + r(m * 4)
    fp16_copy = r(m * k * 2) if input_dtype != torch.float16 else 0
    forward = max(fp16_copy + quant, quant + r(m * o * 4) + r(m * o * 2))
    return DequantTemporaries(forward=forward, backward=r(n * ab) + r(out_features * 4))


def dequant_traffic_bytes(out_features: int, in_features: int, setting: QuantSetting, *, tokens: int = 0,
                          input_dtype: torch.dtype = torch.float32) -> tuple[int, int]:
    """(forward, backward) bytes the quantization kernels move for one linear, beyond the GEMMs themselves.

    4-bit, each pass: read the codes (n/2) and scales, write the dequantized weight (n x compute bytes); double
    quantization adds the absmax dequantization (read blocks + nested, write and re-read fp32 blocks). The GEMM
    then reads the dequantized weight as it would read a full-precision one. 8-bit forward: cast the input to
    fp16, quantize it per row, write and re-read the int32 and fp16 results, cast to the input dtype; backward:
    read the int8 weight and write/re-read it in the input dtype."""
    n = out_features * in_features
    if setting.bits == 4:
        cb = torch.empty((), dtype=setting.torch_compute_dtype).element_size()
        blocks = -(-n // setting.blocksize)
        if setting.double_quant:
            # dequantize_blockwise reads the uint8 scales, nested absmax and code and writes fp32 scales; "+ offset"
            # reads and writes them again; dequantize_4bit reads them once more
            scales = blocks + (-(-blocks // NESTED_BLOCKSIZE)) * 4 + NESTED_CODE_BYTES + 4 * blocks * 4
        else:
            scales = blocks * 4
        one = (n + 1) // 2 + scales + n * cb
        return one, one
    ab = torch.empty((), dtype=input_dtype).element_size()
    m, k, o = tokens, in_features, out_features
    cast_in, quant = m * k * ab + m * k * 2, m * k * 2 + m * k + m * 4
    forward = cast_in + quant + (m * o * 4 + m * o * 2) + (m * o * 2 + m * o * ab)
    backward = n + 3 * n * ab + o * 4
    return forward, backward


def dequant_time_s(shapes: Iterable[tuple[int, int]], setting: QuantSetting, hbm_bandwidth: float, *,
                   tokens: int = 0, input_dtype: torch.dtype = torch.float32, forward_passes: int = 1,
                   backward_passes: int = 1) -> float:
    """Seconds the quantization kernels add to one micro-batch: their bytes moved at ``hbm_bandwidth`` (bytes/s).

    ``forward_passes``: 2 for recomputed (checkpointed) layers. A lower bound: the kernels are memory-bound."""
    total = 0
    for o, i in shapes:
        f, b = dequant_traffic_bytes(o, i, setting, tokens=tokens, input_dtype=input_dtype)
        total += f * forward_passes + b * backward_passes
    return total / hbm_bandwidth
