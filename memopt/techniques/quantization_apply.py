"""Applying quantized frozen base weights (bitsandbytes) to a model: each target linear replaced by a frozen
quantized layer, and QLoRA outside a strategy.

Targets are the linears inside the repeated blocks (:func:`quantization_targets`): the embeddings, the LM head
and the modules a model keeps in fp32 (T5's ``wo``) stay in full precision, as Hugging Face's bitsandbytes
loader leaves them.

A weight is quantized from its value cast to the compute dtype, so the dequantized weight (and bitsandbytes'
``quant_state.dtype``) is in the compute dtype: what Hugging Face's loader produces with
``torch_dtype=<compute dtype>``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from memopt.techniques.adapters import AdapterSetting, apply_adapters, find_target_linears
from memopt.techniques.bitsandbytes_import import bitsandbytes
from memopt.techniques.model_change import ModelChange, Undo, no_change
from memopt.techniques.optimizers import build_optimizer
from memopt.techniques.quantization import QuantSetting

__all__ = [
    "apply_qlora",
    "apply_quantization",
    "change_model",
    "is_quantized",
    "quantization_targets",
]


def quantize_linear(linear: nn.Linear, setting: QuantSetting, *, weight: torch.Tensor | None = None,
                    device: torch.device | str | None = None) -> nn.Module:
    """A bitsandbytes layer holding ``linear``'s weight (or ``weight``) quantized on ``device`` (default: where
    the weight is). The bias parameter is shared with ``linear``."""
    bnb = bitsandbytes()
    w = linear.weight if weight is None else weight
    device = torch.device(device) if device is not None else w.device
    if device.type == "meta" or w.device.type == "meta":
        raise ValueError("cannot quantize weights on the meta device: load them first (load_quantized), or use "
                         "trace with the profile's stand-ins")
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


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, module)


def flag_name(setting: QuantSetting) -> str:
    return "is_loaded_in_4bit" if setting.bits == 4 else "is_loaded_in_8bit"


def _set_flag(model: nn.Module, setting: QuantSetting) -> Callable[[], None]:
    """peft picks its bitsandbytes LoRA layers when the model says it was loaded quantized."""
    name = flag_name(setting)
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


def change_model(change: ModelChange) -> Undo:
    """Quantization's change: the block linears of a model not quantized yet become frozen quantized layers, made
    straight on the training device one layer at a time (the full-precision weights never sit there together)."""
    setting = change.strategy.extra("quantization")
    if setting is None or is_quantized(change.model):
        return no_change
    device = change.move_to if not change.fake else None
    names = quantization_targets(change.model)
    change.quantized_originals.update((name, change.model.get_submodule(name)) for name in names)
    return apply_quantization(change.model, setting, stand_in=change.quantized_stand_in, targets=names,
                              device=device)


def apply_quantization(model: nn.Module, setting: QuantSetting | dict[str, Any], *,
                       stand_in: Callable[[nn.Linear, QuantSetting], nn.Module] | None = None,
                       targets: Sequence[str] | None = None,
                       device: torch.device | str | None = None) -> Callable[[], None]:
    """Replace the target linears by frozen quantized layers (bitsandbytes; or ``stand_in(linear, setting)``, the
    fake-tensor stand-ins a trace passes: ``memopt.profile.stand_ins.TRACE_STAND_INS``).

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
    if stand_in is not None:
        def make(linear: nn.Linear) -> nn.Module:
            return stand_in(linear, setting)
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
            if stand_in is None and w.device.type not in ("cpu", "meta"):
                moved_from = w.device
                w.data = w.data.to("cpu")
            set_module(model, name, new)
            replaced.append((name, original, moved_from, bias_dtype))
    except Exception:
        for name, original, moved_from, _ in reversed(replaced):
            if moved_from is not None:
                original.weight.data = original.weight.data.to(moved_from)
            set_module(model, name, original)
        raise
    unflag = _set_flag(model, setting)

    def undo() -> None:
        unflag()
        for name, original, moved_from, bias_dtype in reversed(replaced):
            if moved_from is not None:
                original.weight.data = original.weight.data.to(moved_from)
            if bias_dtype is not None and original.bias.dtype != bias_dtype:
                original.bias.data = original.bias.data.to(bias_dtype)  # bitsandbytes casts the bias in forward
            set_module(model, name, original)

    return undo


def apply_qlora(model: nn.Module, quantization: QuantSetting | dict[str, Any] | None = None,
                adapters: AdapterSetting | dict[str, Any] | None = None, *, optimizer: str = "paged_adamw8bit",
                **optimizer_kwargs: Any) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    """QLoRA outside a strategy: quantize the block linears (default 4-bit NF4 + double quantization, bf16
    compute), put adapters on them (default LoRA r=16, alpha 32), and build the optimizer over the adapters
    (default paged 8-bit AdamW, ``memopt.techniques.optimizers.build_optimizer``).

    Returns (the peft model, the optimizer, undo); the undo removes the adapters, then the quantization."""
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
