"""Loading pretrained weights quantized as they load: a model skeleton (parameters on meta) filled from
safetensors checkpoints layer by layer, the target linears quantized as they load (or nothing quantized), and the
peak device bytes of that load."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memopt.blocks import tied_parameter_groups
from memopt.models import build_model
from memopt.strategy import Strategy
from memopt.techniques.precision import weight_dtype
from memopt.techniques.quantization import QuantSetting
from memopt.techniques.quantization_apply import flag_name, quantization_targets, quantize_linear, set_module
from memopt.techniques.quantized_bytes import quantized_weight_bytes
from memopt.units import allocator_size

__all__ = [
    "load_for_strategy",
    "load_peak_bytes",
    "load_quantized",
    "model_skeleton",
]


def model_skeleton(spec: Any) -> nn.Module:
    """The model of ``spec`` with parameters on meta and buffers real (non-persistent buffers such as rotary
    ``inv_freq`` are not in checkpoints): what ``load_quantized`` fills."""
    from accelerate import init_empty_weights

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
            set_module(model, name, quantize_linear(linear, setting, weight=source, device=device))
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
        setattr(model, flag_name(setting), True)
    return model


def load_for_strategy(model: nn.Module, checkpoint: str | Path | Sequence[str | Path], strategy: Strategy,
                      device: torch.device) -> int | None:
    """The checkpoint's weights into ``model`` (its parameters on meta) on the training device, in the weight dtype
    of the strategy's precision, its quantization targets quantized as they load; returns the peak allocated while
    loading on a GPU (None elsewhere)."""
    q = strategy.extra("quantization")
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    load_quantized(model, checkpoint, q if q is not None else QuantSetting(), device,
                   dtype=weight_dtype(strategy.precision), targets=None if q is not None else [])
    return int(torch.cuda.max_memory_allocated(device)) if cuda else None


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
