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

__all__ = ["load_into_deepspeed_layout"]


def _index(paths: Sequence[str | os.PathLike[str]]) -> dict[str, Path]:
    """Which file holds each tensor name."""
    from safetensors import safe_open

    where: dict[str, Path] = {}
    for path in paths:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has keys(), not __iter__
                where[key] = Path(path)
    return where


def _read(where: dict[str, Path], name: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(where[name]), framework="pt", device="cpu") as f:
        return f.get_tensor(name).to(device=device, dtype=dtype)


def load_into_deepspeed_layout(model: nn.Module, paths: Sequence[str | os.PathLike[str]], config: dict[str, Any],
                               device: torch.device | str) -> nn.Module:
    """Fill ``model`` (parameters on the meta device) from safetensors ``paths`` for DeepSpeed under ``config``
    (the dict ``deepspeed.initialize`` gets); returns the model, ready for ``deepspeed.initialize``. Buffers on
    meta are read from the files too; missing tensors raise with their names."""
    device = torch.device(device)
    where = _index(paths)
    names = {id(p): n for n, p in model.named_parameters()}  # a tied parameter keeps its first name
    missing = sorted(n for n, p in model.named_parameters() if p.device.type == "meta" and n not in where)
    missing += sorted(n for n, b in model.named_buffers() if b.device.type == "meta" and n not in where)
    if missing:
        raise ValueError(f"{len(missing)} tensors of the model are not in {[str(Path(p)) for p in paths]}: "
                         f"{missing[:5]}{' ...' if len(missing) > 5 else ''}")
    for name, buf in list(model.named_buffers()):
        if buf.device.type == "meta":
            owner, _, attr = name.rpartition(".")
            module = model.get_submodule(owner) if owner else model
            module._buffers[attr] = _read(where, name, device, buf.dtype)
    # a meta parameter cannot take real data in place: each is replaced by a real one in every module that holds it
    # (a tied weight stays one parameter)
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((module, attr))

    # in the engine's 16-bit dtype when it trains in one: an fp32 copy on the GPU would pass the plan's bytes
    half = torch.bfloat16 if config.get("bf16", {}).get("enabled") else (
        torch.float16 if config.get("fp16", {}).get("enabled") else None)

    def materialize(p: nn.Parameter, dev: torch.device) -> nn.Parameter:
        dtype = half if half is not None and p.dtype.is_floating_point else p.dtype
        new = nn.Parameter(_read(where, names[id(p)], dev, dtype), requires_grad=p.requires_grad)
        for module, attr in owners.pop(id(p)):
            module._parameters[attr] = new
        return new

    stage3 = int(config.get("zero_optimization", {}).get("stage", 0)) == 3
    if not stage3:
        for p in list(model.parameters()):  # each tensor from the mapped file to its device: no host copy of the model
            if p.device.type == "meta":
                materialize(p, device)
        return model
    import deepspeed

    offload = config["zero_optimization"].get("offload_param", {})
    for module in reversed(list(model.modules())):  # children first: Init(module=) converts the whole subtree
        own = [p for p in module.parameters(recurse=False) if p.device.type == "meta"]
        if not own:
            continue
        for p in own:  # the module's parameters in full on the host, for as long as partitioning takes
            materialize(p, torch.device("cpu"))
        deepspeed.zero.Init(module=module, config_dict_or_path=config, remote_device=offload.get("device"),
                            pin_memory=bool(offload.get("pin_memory")))
    return model
