"""Checkpoints of sharded training that resume on another world size, and loading pretrained weights shard-wise.

``save_checkpoint`` / ``load_checkpoint`` use ``torch.distributed.checkpoint`` (DCP) with the
``get_state_dict`` / ``set_state_dict`` helpers: every rank writes its own shards (parameters and optimizer
states keyed by parameter name), and loading reshards them onto whatever layout the model has now — FSDP2
at another world size, or a plain single-process model. The step counter, the data position
(``samples_seen``) and the LR scheduler ride along.

``load_sharded`` fills an FSDP2-sharded model built on the meta device straight from safetensors files:
``fully_shard`` on the meta model, ``to_empty`` allocates only this rank's shards, and each rank reads only
its rows of each tensor (``safe_open(...).get_slice``, memory-mapped), so no process ever holds the whole
model.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memopt.distributed.torch_engines import apply_fsdp2
from memopt.techniques.sharding import ShardingSetting

__all__ = ["load_checkpoint", "load_sharded", "save_checkpoint"]


def _dist_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def save_checkpoint(path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer,
                    step: Any = None, *, lr_scheduler: Any = None) -> None:
    """Write a resharding-capable checkpoint (a DCP directory) from every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    extra = {"steps_done": int(getattr(step, "steps_done", 0)), "samples_seen": int(getattr(step, "samples_seen", 0))}
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd, "extra": extra}
    if lr_scheduler is not None:
        state["lr_scheduler"] = lr_scheduler.state_dict()
    dcp.save(state, checkpoint_id=str(path), no_dist=not _dist_ready())


def load_checkpoint(path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer,
                    step: Any = None, *, lr_scheduler: Any = None) -> dict[str, int]:
    """Load a checkpoint written by ``save_checkpoint`` into the model's current layout (any world size).

    The optimizer must have its states (call ``step`` once, or it is created lazily: an AdamW that has
    not stepped yet is initialized here with zero states so that DCP has tensors to load into).
    Returns the extra counters and sets them on ``step`` (``steps_done``, ``samples_seen``).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    _init_optimizer_states(optimizer)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd, "extra": {"steps_done": 0, "samples_seen": 0}}
    if lr_scheduler is not None:
        state["lr_scheduler"] = lr_scheduler.state_dict()
    dcp.load(state, checkpoint_id=str(path), no_dist=not _dist_ready())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(state["lr_scheduler"])
    extra = {k: int(v) for k, v in state["extra"].items()}
    if step is not None:
        step.steps_done = extra["steps_done"]
        if hasattr(step, "samples_seen"):
            step.samples_seen = extra["samples_seen"]
    return extra


def _init_optimizer_states(optimizer: torch.optim.Optimizer) -> None:
    """Create an optimizer's lazily-made states (a zero-gradient step with lr 0) so DCP can load into them."""
    if optimizer.state:
        return
    saved = []
    for group in optimizer.param_groups:
        saved.append((group.get("lr"), group.get("weight_decay")))
        group["lr"] = 0.0
        if "weight_decay" in group:
            group["weight_decay"] = 0.0
        for p in group["params"]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    for group, (lr, wd) in zip(optimizer.param_groups, saved):
        group["lr"] = lr
        if wd is not None:
            group["weight_decay"] = wd
        for p in group["params"]:
            p.grad = None
    # a zero step still advanced the step counters: the loaded state overwrites them


def load_sharded(model_on_meta: nn.Module, safetensors_paths: Sequence[str | os.PathLike[str]], setting: Any,
                 *, device: torch.device | str = "cpu", mp_policy: Any = None, block_stacks: Sequence[Any] = (),
                 strict: bool = True) -> nn.Module:
    """Shard a meta-device model with FSDP2 and fill each rank's shards from safetensors files.

    Build the model with its parameters on the meta device (``torch.device("meta")`` or accelerate's
    ``init_empty_weights()``, which keeps buffers real). Buffers that are not on meta are kept; buffers on
    meta are read from the checkpoint when it has them. Each rank reads only the rows of each parameter
    that its shard holds (FSDP2 shards dim 0 into ``ceil(dim0 / n)`` rows per rank). Returns the model
    (sharded in place). ``strict``: every parameter must be found in the files.
    """
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor

    setting = ShardingSetting.from_any(setting)
    if setting.engine != "fsdp2":
        raise ValueError("load_sharded fills FSDP2 shards; for DeepSpeed ZeRO-3 use deepspeed.zero.Init with the "
                         "model's own from_pretrained")
    kept = {name: b for name, b in model_on_meta.named_buffers() if b.device.type != "meta"}
    dev = torch.device(device)
    # with CPUOffloadPolicy the shards live on the host (``device`` "cpu") but the mesh is the accelerator's
    apply_fsdp2(model_on_meta, setting, mp_policy, block_stacks,
                device_type=None if setting.offload_params == "cpu" else dev.type)
    model_on_meta.to_empty(device=dev)
    for name, b in kept.items():
        owner, _, attr = name.rpartition(".")
        module = model_on_meta.get_submodule(owner) if owner else model_on_meta
        module._buffers[attr] = b.to(dev)
    wanted: dict[str, torch.Tensor] = dict(model_on_meta.named_parameters())
    wanted.update({n: b for n, b in model_on_meta.named_buffers() if n not in kept})
    found: set[str] = set()
    for path in safetensors_paths:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has keys(), not __iter__
                target = wanted.get(key)
                if target is None:
                    continue
                with torch.no_grad():
                    if isinstance(target, DTensor):
                        local = target.to_local()
                        rows = local.shape[0] if local.dim() else 0
                        shape = f.get_slice(key).get_shape()
                        mesh = target.device_mesh
                        shard_rank = mesh.get_local_rank(mesh.ndim - 1) if mesh.ndim > 1 else mesh.get_local_rank()
                        n = mesh.size(mesh.ndim - 1)
                        per = -(-shape[0] // n) if shape else 0
                        lo = min(shard_rank * per, shape[0]) if shape else 0
                        if rows:
                            part = f.get_slice(key)[lo:lo + rows]
                            local.copy_(part.to(local.dtype))
                            del part
                    else:
                        target.copy_(f.get_tensor(key).to(target.dtype))
                found.add(key)
    missing = sorted(set(wanted) - found)
    if strict and missing:
        raise ValueError(f"{len(missing)} tensors were not found in {[str(Path(p)) for p in safetensors_paths]}: "
                         f"{missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return model_on_meta
