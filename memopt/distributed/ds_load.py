"""Pretrained weights from safetensors into a DeepSpeed layout, one tensor at a time.

The model comes built on the meta device (no weights anywhere). At ZeRO-1/2 (and DDP-like replication) every rank
holds the whole 16-bit model on its GPU by design, so each tensor is read from the memory-mapped file straight to
that device: host RAM never holds the model. At ZeRO-3 each module's parameters are read (at most the largest
module in full, on the host) and at once partitioned by ``deepspeed.zero.Init(module=...)``: only this rank's
partitions stay, on the GPU or, with parameter offload, in host memory, as the plan counts them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memopt.techniques.quantization import QuantSetting
from memopt.techniques.quantized_load import load_quantized

__all__ = ["load_into_deepspeed_layout"]


def load_into_deepspeed_layout(model: nn.Module, paths: Sequence[str | os.PathLike[str]], config: dict[str, Any],
                               device: torch.device | str) -> nn.Module:
    """Fill ``model`` (parameters on the meta device) from safetensors ``paths`` for DeepSpeed under ``config``
    (the dict ``deepspeed.initialize`` gets; ``{}`` for a replicated engine such as DDP); returns the model, ready
    for ``deepspeed.initialize``. Tied parameters stay tied; missing tensors raise with their names."""
    # in the engine's 16-bit dtype when it trains in one (an fp32 copy on the GPU would pass the plan's bytes),
    # else in the model's own
    dtype = torch.bfloat16 if config.get("bf16", {}).get("enabled") else (
        torch.float16 if config.get("fp16", {}).get("enabled") else
        next((p.dtype for p in model.parameters() if p.is_floating_point()), None))
    if int(config.get("zero_optimization", {}).get("stage", 0)) != 3:
        # every rank holds the whole model on its device: memopt's layer-by-layer loader, nothing quantized, each
        # tensor from the mapped file to the device (no host copy of the model)
        return load_quantized(model, [str(p) for p in paths], QuantSetting(), torch.device(device), dtype=dtype,
                              targets=[])
    return _load_zero3(model, paths, config, dtype)


def _load_zero3(model: nn.Module, paths: Sequence[str | os.PathLike[str]], config: dict[str, Any],
                dtype: torch.dtype | None) -> nn.Module:
    """ZeRO-3: each module's parameters read in full on the host and at once partitioned by
    ``deepspeed.zero.Init(module=...)``, children first (it converts a whole subtree)."""
    import contextlib

    import deepspeed
    from safetensors import safe_open

    with contextlib.ExitStack() as stack:  # each file opened (memory-mapped) once
        files = [stack.enter_context(safe_open(str(p), framework="pt", device="cpu")) for p in paths]
        where = {key: f for f in files for key in f.keys()}  # noqa: SIM118 - safe_open is not a mapping

        def read(name: str, dt: torch.dtype) -> torch.Tensor:
            return where[name].get_tensor(name).to(dtype=dt)

        names: dict[int, str] = {}  # a tied parameter is read under whichever of its names the files hold
        for n, p in model.named_parameters(remove_duplicate=False):
            if id(p) not in names or (names[id(p)] not in where and n in where):
                names[id(p)] = n
        missing = sorted(n for n, p in model.named_parameters()
                         if p.device.type == "meta" and names[id(p)] not in where)
        missing += sorted(n for n, b in model.named_buffers() if b.device.type == "meta" and n not in where)
        if missing:  # before anything is partitioned
            raise ValueError(f"the checkpoint lacks {len(missing)} tensor(s) the model needs: {missing[:8]} (files: "
                             f"{[str(Path(p)) for p in paths]})")
        for name, buf in list(model.named_buffers()):
            if buf.device.type == "meta":
                owner, _, attr = name.rpartition(".")
                (model.get_submodule(owner) if owner else model)._buffers[attr] = read(name, buf.dtype)
        # a meta parameter cannot take real data in place: it is replaced in every module that holds it (a tied
        # weight stays one parameter)
        owners: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in model.modules():
            for attr, p in module._parameters.items():
                if p is not None:
                    owners.setdefault(id(p), []).append((module, attr))
        offload = config["zero_optimization"].get("offload_param", {})
        for module in reversed(list(model.modules())):
            own = [p for p in module.parameters(recurse=False) if p.device.type == "meta"]
            if not own:
                continue
            for p in own:  # the module's parameters in full on the host, for as long as partitioning takes
                dt = dtype if dtype is not None and p.is_floating_point() else p.dtype
                new = nn.Parameter(read(names[id(p)], dt), requires_grad=p.requires_grad)
                for owner, attr in owners.pop(id(p)):
                    owner._parameters[attr] = new
            deepspeed.zero.Init(module=module, config_dict_or_path=config, remote_device=offload.get("device"),
                                pin_memory=bool(offload.get("pin_memory")))
    return model
