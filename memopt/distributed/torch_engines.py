"""Applying a sharding setting with PyTorch's own engines: FSDP2 (``fully_shard``) and DDP.

``apply_fsdp2`` calls ``torch.distributed.fsdp.fully_shard`` on every block and on the root, with a
``MixedPrecisionPolicy`` and, when offloading, a ``CPUOffloadPolicy``; hybrid sharding (HSDP) over a 2-D mesh when
``replicate_size > 1``; ``apply_ddp`` wraps for stage 0. memopt's mixed-precision settings become FSDP2's own
(``mp_policy_for``): it keeps fp32 sharded parameters and gathers them in bf16/fp16
(``MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32)``), so no autocast is needed. These wrappers live apart
from DeepSpeed's (``memopt.distributed.deepspeed_engine``) because the two engines share no code: what FSDP2 needs
(device meshes, mixed-precision and offload policies, undoing ``fully_shard``) stays out of DeepSpeed's
configuration, and the other way round.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from memopt.blocks import find_block_stacks
from memopt.techniques.sharding import ShardingSetting

__all__ = [
    "apply_ddp",
    "apply_fsdp2",
    "mp_policy_for",
]


def mp_policy_for(precision: str) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for a memopt precision (None: keep the weights' dtype throughout)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision in ("bf16_autocast", "bf16_master"):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision == "fp16_autocast":
        return MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    return None


def _mesh(setting: ShardingSetting, device_type: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    if setting.replicate_size > 1:
        return init_device_mesh(device_type, (setting.replicate_size, setting.shard_size),
                                mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device_type, (setting.world_size,), mesh_dim_names=("shard",))


def apply_fsdp2(model: nn.Module, setting: ShardingSetting, mp_policy: Any = None, block_stacks: Sequence[Any] = (),
                *, device_type: str | None = None, mesh: Any = None) -> Callable[[], None]:
    """``fully_shard`` every block of ``block_stacks`` and then the root; returns an undo.

    ``mp_policy``: a ``MixedPrecisionPolicy``, a ``(param_dtype, reduce_dtype)`` pair or None.
    ``block_stacks``: ``memopt.blocks.BlockStack``s (or lists of modules); found when empty.
    The process group must be initialized with ``world_size`` ranks (or pass a ``mesh``).
    The undo gathers the full weights into every rank (a collective: call it on all ranks),
    replaces the sharded parameters by plain ones and restores the module classes and hooks.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if setting.engine != "fsdp2":
        raise ValueError(f"apply_fsdp2 needs engine 'fsdp2', got {setting.engine!r}")
    if isinstance(mp_policy, tuple):
        mp_policy = MixedPrecisionPolicy(param_dtype=mp_policy[0], reduce_dtype=mp_policy[1])
    mp_policy = mp_policy or MixedPrecisionPolicy()
    if device_type is None:
        first = next(model.parameters(), None)
        device_type = "cpu" if first is None or first.device.type == "meta" else first.device.type
        if device_type == "cpu" and torch.cuda.is_available():
            device_type = "cuda"
    if mesh is None:
        mesh = _mesh(setting, device_type)
    offload = CPUOffloadPolicy(pin_memory=setting.pin_memory) if setting.offload_params == "cpu" else OffloadPolicy()
    if not block_stacks:
        block_stacks = find_block_stacks(model)
    blocks: list[nn.Module] = []
    for stack in block_stacks:
        blocks.extend(getattr(stack, "blocks", stack))
    sharded: list[nn.Module] = []
    try:
        for block in blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=setting.reshard_after_forward, mp_policy=mp_policy,
                        offload_policy=offload)
            sharded.append(block)
        # the root stays gathered from its forward to its backward (FSDP2's default for the root): its
        # backward starts right after its forward ends, so resharding would only add one all-gather
        fully_shard(model, mesh=mesh, reshard_after_forward=None if setting.reshard_after_forward else False,
                    mp_policy=mp_policy, offload_policy=offload)
        sharded.append(model)
    except Exception:
        _unshard_fsdp2(sharded, gather=False)
        raise
    if setting.prefetch > 1 and blocks:
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + setting.prefetch])
            block.set_modules_to_backward_prefetch(blocks[max(0, i - setting.prefetch):i][::-1])

    def undo() -> None:
        _unshard_fsdp2(sharded, gather=True)

    return undo


def _unshard_fsdp2(modules: list[nn.Module], *, gather: bool) -> None:
    from torch.distributed._composable.contract import _get_registry
    from torch.distributed._composable_state import _module_state_mapping
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    done: set[int] = set()
    for module in reversed(modules):
        for sub in module.modules():
            for name, p in list(sub._parameters.items()):
                if p is None or id(p) in done or not isinstance(p, DTensor):
                    continue
                full = p.full_tensor() if gather else p.to_local()
                new = nn.Parameter(full.detach().clone(), requires_grad=p.requires_grad)
                sub._parameters[name] = new
                done.add(id(new))
    for module in modules:
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        for attr in ("_pre_forward_hook_handle", "_post_forward_hook_handle"):
            handle = getattr(state, attr, None)
            if handle is not None:
                handle.remove()
        _module_state_mapping.pop(module, None)
        registry = _get_registry(module)
        if isinstance(registry, dict):
            registry.pop("fully_shard", None)
        module.__class__ = next(b for b in type(module).__bases__ if b is not FSDPModule)


def apply_ddp(model: nn.Module, setting: ShardingSetting, *, device_ids: list[int] | None = None) -> nn.Module:
    """Wrap in ``DistributedDataParallel`` with gradient buckets as views of the gradients (no extra copy)."""
    from torch.nn.parallel import DistributedDataParallel

    if setting.engine != "ddp":
        raise ValueError(f"apply_ddp needs engine 'ddp', got {setting.engine!r}")
    kw: dict[str, Any] = {"gradient_as_bucket_view": True}
    if setting.bucket_bytes:
        kw["bucket_cap_mb"] = setting.bucket_bytes / 2**20
    return DistributedDataParallel(model, device_ids=device_ids, **kw)
